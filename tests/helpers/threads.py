"""A tile group whose ranks are threads of one process: :class:`ThreadComm` hands tensors
between them with the collectives and the point-to-point calls fxpar's tile ops make
(fxpar.comm.mpi.Comm's), so the ops run without MPI in unit tests. Every call is logged in the
hub (which collectives each rank made, in order)."""

from __future__ import annotations

import threading
from collections import defaultdict, deque
from collections.abc import Callable
from typing import Any

import torch

TIMEOUT = 60.0
"""Seconds a thread waits for its peers before the test fails (no hang)."""


class Hub:
    """What the threads of one tile group share."""

    def __init__(self, size: int) -> None:
        self.barrier = threading.Barrier(size, timeout=TIMEOUT)
        self.slots: list[Any] = [None] * size
        self.calls: list[tuple[int, str]] = []
        self.lock = threading.Lock()
        self.mail: dict[tuple[int, int, int], deque[torch.Tensor]] = defaultdict(deque)
        self.posted = threading.Condition(self.lock)


class _Done:
    def wait(self) -> None:
        pass


class _Receive:
    """A receive completed by :meth:`wait`: the sender's tensor copied into ``buf``."""

    def __init__(self, hub: Hub, key: tuple[int, int, int], buf: torch.Tensor) -> None:
        self.hub, self.key, self.buf = hub, key, buf

    def wait(self) -> None:
        with self.hub.posted:
            if not self.hub.posted.wait_for(lambda: bool(self.hub.mail[self.key]), TIMEOUT):
                raise TimeoutError(f"no message {self.key} (source, destination, tag)")
            self.buf.copy_(self.hub.mail[self.key].popleft())


class ThreadComm:
    """Rank ``rank`` of a tile group whose ranks are threads of this process."""

    def __init__(self, hub: Hub, rank: int) -> None:
        self.hub, self.rank, self.size = hub, rank, len(hub.slots)

    def _exchange(self, t: torch.Tensor, what: str) -> list[torch.Tensor]:
        hub = self.hub
        with hub.lock:
            hub.calls.append((self.rank, what))
        hub.slots[self.rank] = t.detach().clone()
        hub.barrier.wait()
        out = [s.clone() for s in hub.slots]
        hub.barrier.wait()
        return out

    def allgather(self, t: torch.Tensor) -> list[torch.Tensor]:
        return self._exchange(t, "allgather")

    def allreduce(self, t: torch.Tensor, op: str = "sum") -> torch.Tensor:
        parts = self._exchange(t, "allreduce")
        total = parts[0]
        for p in parts[1:]:  # rank order on every rank: identical results
            total = total + p if op == "sum" else torch.maximum(total, p) if op == "max" \
                else torch.minimum(total, p)
        return t.copy_(total)

    def isend(self, t: torch.Tensor, dst: int, tag: int = 0) -> _Done:
        with self.hub.posted:
            self.hub.mail[(self.rank, dst, tag)].append(t.detach().clone())
            self.hub.posted.notify_all()
        return _Done()

    def irecv(self, t: torch.Tensor, src: int, tag: int = 0) -> _Receive:
        return _Receive(self.hub, (src, self.rank, tag), t)


def run_threads(size: int, fn: Callable[[ThreadComm], Any]) -> tuple[list[Any], Hub]:
    """``fn(comm)`` on ``size`` threads, one per rank; their results in rank order."""
    hub = Hub(size)
    results: list[Any] = [None] * size
    errors: list[BaseException] = []

    def body(rank: int) -> None:
        try:
            results[rank] = fn(ThreadComm(hub, rank))
        except BaseException as e:  # noqa: BLE001 - re-raised in the main thread
            errors.append(e)
            hub.barrier.abort()

    threads = [threading.Thread(target=body, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results, hub
