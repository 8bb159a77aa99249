"""Reading, computing and writing in overlap, for region-by-region inference (fxpar.predict).

The main thread computes batch b while a reader thread prepares the input of batch b + 1 and
a writer thread transforms and writes the output of batch b - 1::

    main thread:   forward 0 | forward 1 | forward 2 | forward 3 |
    reader:        read 1    | read 2    | read 3    |           |
    writer:                  | write 0   | write 1   | write 2   | write 3

Only the main thread runs the model and communicates, so each rank sends and receives its
messages in the order it did without the helpers. The helpers do work that releases the GIL:
decoding and encoding TIFF tiles and Zarr chunks (zlib), numpy copies, torch's elementwise
kernels. Each queue holds at most ``depth`` batches, so a run holds at most ``depth + 2``
inputs (one being read, ``depth`` waiting, one computing) and as many outputs.

An exception in a helper is raised again in the main thread at its next hand-over (the same
exception object, with a note naming the thread), where it is handled as if the main thread
had raised it: fxpar.predict re-raises it in one process and ends the whole job under MPI
(fxpar.comm.failfast). Leaving the ``with`` block of a helper stops and joins its thread, on
errors and KeyboardInterrupt too; a stopped writer drops the batches still waiting (a resumed
run computes them again). ``threaded=False`` makes the same calls in the main thread, in turn
(``FXPAR_PREDICT_OVERLAP=0``).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator, Sequence
from types import TracebackType
from typing import Any, Generic, TypeVar

T = TypeVar("T")
R = TypeVar("R")

POLL = 0.05
"""Seconds a blocked hand-over waits before it looks again whether the other side stopped."""

_END = object()
"""The last item of a queue."""
_FAILED = object()
"""Put by a failing reader: wakes the main thread waiting for its next item."""


class _Helper:
    """A thread beside the main one, the bounded queue between them, and its error."""

    def __init__(self, name: str, depth: int, threaded: bool) -> None:
        if depth < 1:
            raise ValueError(f"depth {depth}: a helper needs room for at least 1 item")
        self.name = name
        self.queue: queue.Queue[Any] = queue.Queue(maxsize=depth)
        self.stopping = threading.Event()
        self.error: BaseException | None = None
        self.thread = None if not threaded else threading.Thread(
            target=self._guarded, name=f"fxpar-predict-{name}", daemon=True)

    def _run(self) -> None:
        raise NotImplementedError

    def _guarded(self) -> None:
        try:
            self._run()
        except BaseException as e:  # noqa: BLE001 - every error goes to the main thread
            e.add_note(f"(raised in fxpar-predict's {self.name} thread)")
            self.error = e
            self._wake()

    def _wake(self) -> None:
        """Wake the main thread if it waits for this helper (after an error)."""

    def _offer(self, item: Any) -> bool:
        """Put ``item`` (from the helper thread), unless the main thread stops it first."""
        while not self.stopping.is_set():
            try:
                self.queue.put(item, timeout=POLL)
                return True
            except queue.Full:
                pass
        return False

    def check(self) -> None:
        """Raise the helper's error in the calling (main) thread, if it had one."""
        if self.error is not None:
            raise self.error

    def close(self) -> None:
        """Stop the helper after the item in hand (it drops what still waits) and join it."""
        self.stopping.set()
        if self.thread is not None and self.thread.ident is not None:
            self.thread.join()

    def __enter__(self) -> Any:
        if self.thread is not None:
            self.thread.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


class Prefetch(_Helper, Generic[T, R]):
    """``produce(item)`` for each of ``items`` in order, computed in a thread up to ``depth``
    items ahead of the main thread iterating over it (inside ``with``)."""

    def __init__(self, items: Sequence[T], produce: Callable[[T], R], *, name: str = "reader",
                 depth: int = 1, threaded: bool = True) -> None:
        super().__init__(name, depth, threaded)
        self.items = items
        self.produce = produce

    def _wake(self) -> None:
        self._offer(_FAILED)

    def _run(self) -> None:
        for item in self.items:
            if self.stopping.is_set() or not self._offer(self.produce(item)):
                return
        self._offer(_END)

    def __iter__(self) -> Iterator[R]:
        if self.thread is None:
            yield from map(self.produce, self.items)
            return
        if self.thread.ident is None:
            raise RuntimeError("iterate over a Prefetch inside its with block")
        while True:
            self.check()
            got = self.queue.get()
            if got is _END:
                return
            if got is _FAILED:
                self.check()
            yield got


class Drain(_Helper, Generic[T]):
    """``consume(item)`` for each item the main thread :meth:`put` s, in order, in a thread;
    the main thread waits only while ``depth`` items already wait. :meth:`finish` waits for
    them all; leaving the ``with`` block without it drops those still waiting."""

    def __init__(self, consume: Callable[[T], None], *, name: str = "writer", depth: int = 1,
                 threaded: bool = True) -> None:
        super().__init__(name, depth, threaded)
        self.consume = consume

    def _run(self) -> None:
        while not self.stopping.is_set():
            try:
                item = self.queue.get(timeout=POLL)
            except queue.Empty:
                continue
            if item is _END:
                return
            self.consume(item)

    def put(self, item: T) -> None:
        """Hand ``item`` over (raises the writer's error, if it had one)."""
        if self.thread is None:
            self.consume(item)
            return
        self._hand(item)

    def _hand(self, item: Any) -> None:
        if self.thread is None or self.thread.ident is None:
            raise RuntimeError("put items into a Drain inside its with block")
        while True:
            self.check()
            try:
                self.queue.put(item, timeout=POLL)
                return
            except queue.Full:
                pass

    def finish(self) -> None:
        """Wait until every item put is consumed; raise the writer's error, if it had one."""
        if self.thread is None:
            return
        self._hand(_END)
        self.thread.join()
        self.check()
