"""The watchdog: no rank waits forever, and when one would, every rank says where it is.

Every blocking communication call of :class:`fxpar.comm.mpi.Comm` (and of the torch backend)
runs under :func:`watching`. A call that waits longer than the limit ends the whole job
(``MPI_Abort``) after printing what it waited for and, asked over the watchdog's own
communicator, what every rank is doing: its step, its action and how long it has been at it, in
a table and on the schedule's step x rank grid. A rank that does not answer within a few
seconds is dead or stuck in a call that holds Python's lock.

The limit (``FXPAR_WATCHDOG``, ``fxpar-run --watchdog``, :func:`set_watchdog`):

* ``auto`` (the default): 10 x the slowest training step this process has seen, at least
  300 s; until the first step ends (compile, warm-up) 1800 s. ``auto:FLOOR`` puts both floors at
  FLOOR seconds (for tests and rehearsals).
* a number: that many seconds for every call; ``0`` turns the watchdog off.

It also ends a job that a rank has left: a rank whose process exits (normally, or by
``sys.exit``) tells its peers how many steps it completed; a peer in, or starting, a later step
would wait for it forever, so it ends the job at once, naming who left. (A rank that leaves
with a *failed* step ends the job itself: fxpar.comm.failfast.)

The watchdog thread polls its communicator every half second: that is its whole cost.
"""

from __future__ import annotations

import atexit
import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from fxpar.comm import failfast
from fxpar.core.options import setting

WATCHDOG_ENV = "FXPAR_WATCHDOG"
FLOOR = 300.0
"""Seconds any call may wait, whatever the steps measured (auto)."""
START = 1800.0
"""Seconds a call may wait before the first training step has ended (auto)."""
FACTOR = 10.0
ANSWER_SECONDS = 3.0
"""How long a firing watchdog waits for the other ranks to say where they are."""
DEFER_SECONDS = 10.0
"""How long a firing watchdog stays quiet when a lower rank's is reporting too."""
ASK, STATE, LEFT = 101, 102, 103  # tags on the watchdog's own communicator


@dataclass(frozen=True)
class Limit:
    """How long one communication call may wait. ``fixed`` seconds, or (None) auto:
    max(``floor``, ``factor`` x the slowest step seen); ``start`` until a step has ended."""

    fixed: float | None = None
    floor: float = FLOOR
    start: float = START
    factor: float = FACTOR

    def seconds(self, slowest: float | None) -> float:
        if self.fixed is not None:
            return self.fixed
        if slowest is None:
            return max(self.floor, self.start)
        return max(self.floor, self.factor * slowest)

    def describe(self, slowest: float | None) -> str:
        if self.fixed is not None:
            return f"{self.fixed:g} s ({WATCHDOG_ENV}={self.fixed:g})"
        if slowest is None:
            return f"{self.seconds(None):g} s (auto, before the first step ended)"
        return (f"{self.seconds(slowest):g} s (auto: {self.factor:g} x the slowest step, "
                f"{slowest:.3g} s, at least {self.floor:g} s)")


def parse_limit(value: str) -> Limit | None:
    """``FXPAR_WATCHDOG``'s value as a Limit; None: off."""
    v = value.strip().lower()
    try:
        if v in ("", "auto"):
            return Limit()
        if v.startswith("auto:"):
            floor = float(v[5:])
            if floor <= 0:
                raise ValueError
            return Limit(floor=floor, start=floor)
        seconds = float(v)
    except ValueError:
        raise ValueError(
            f"{WATCHDOG_ENV}={value!r}: give auto (the default: {FACTOR:g} x the slowest step, "
            f"at least {FLOOR:g} s), auto:FLOOR, the seconds a communication call may wait "
            f"(e.g. 600), or 0 for no watchdog") from None
    if seconds < 0:
        raise ValueError(f"watchdog seconds must be >= 0 (0 turns it off), got {seconds:g}")
    return Limit(fixed=seconds) if seconds else None


@dataclass(frozen=True)
class Position:
    """Where one rank is, as it answers a firing watchdog."""

    rank: int
    step: int
    """The training step it is in (or last ended, when ``in_step`` is False); 0: none yet."""
    in_step: bool
    action: str
    index: int | None
    """The action's place in the rank's action list (its row of the grid)."""
    seconds: float
    """How long it has been waiting (``waiting``) or running the action."""
    waiting: str
    """The call it waits in; "" when it computes."""

    def describe(self) -> str:
        where = (f"step {self.step}, action {self.action}" if self.in_step and self.action
                 else f"between steps (after step {self.step})" if not self.in_step
                 else f"step {self.step}")
        if self.waiting:
            return f"{where}: waiting {self.seconds:.0f} s in {self.waiting}"
        return f"{where}: running {self.seconds:.0f} s, not communicating"


def watchdog_message(rank: int, seconds: float, what: str, doing: str) -> str:
    return (f"fxpar watchdog: rank {rank} waited {seconds:.0f} s in {what}{doing}; a peer rank "
            f"is stuck, deadlocked or dead. Ending the whole job (MPI_Abort). If a step can "
            f"legitimately wait this long, raise {WATCHDOG_ENV} (fxpar-run --watchdog); 0 "
            f"turns the watchdog off.")


def left_message(rank: int, peer: int, steps: int, step: int) -> str:
    return (f"fxpar watchdog: rank {peer} left the job (its process exited) after {steps} "
            f"step{'s' if steps != 1 else ''} while rank {rank} is in step {step}: it will "
            f"never send what step {step} needs. Ending the whole job (MPI_Abort). Every rank "
            f"must run the same number of steps; a rank that stops early must stop them all.")


class Watchdog:
    """One per process (see the module doc). ``rank``: this process's world rank."""

    def __init__(self, limit: Limit, rank: Callable[[], int]) -> None:
        self.limit = limit
        self.rank = rank
        self.slowest: float | None = None
        self.step = 0
        self.in_step = False
        self.action = ""
        self.index: int | None = None
        self.grid: Callable[[dict[int, int]], str] | None = None
        """Renders the schedule grid with each rank's action (rank -> index) marked."""
        self.left: dict[int, int] = {}
        """Peers whose process exited -> the steps they completed."""
        self.members: frozenset[int] | None = None
        """The world ranks the current step needs (None: all); a rank outside it may leave."""
        self._action_since = time.monotonic()
        self._since: float | None = None
        self._what: Callable[[], str] | None = None
        self._depth = 0
        self._channel: Any = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._fired = threading.Lock()
        self._talk = threading.RLock()
        """Held for every use of the channel (the thread and a firing main thread)."""
        self._askers: set[int] = set()
        """Ranks that asked where this one is: their watchdogs are reporting."""

    # -- what the runtime tells it --------------------------------------------------------------
    def doing(self, action: object, index: int | None = None) -> None:
        self.action, self.index, self._action_since = str(action), index, time.monotonic()

    def step_began(self, step: int, members: frozenset[int] | None = None) -> None:
        """A training step begins; ``members``: the world ranks it needs (None: all)."""
        self.step, self.in_step, self.action, self.index = step, True, "", None
        self.members = members
        self._action_since = time.monotonic()
        self._check_left()

    def step_ended(self, seconds: float) -> None:
        self.in_step = False
        self.slowest = seconds if self.slowest is None else max(self.slowest, seconds)

    @contextlib.contextmanager
    def watching(self, what: Callable[[], str]) -> Iterator[None]:
        outer = self._depth == 0
        if outer:
            self._what = what
            self._since = time.monotonic()
            self._start()
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1
            if outer:
                self._since = None

    # -- the thread ------------------------------------------------------------------------------
    def attach(self, channel: Any) -> None:
        """Talk to the other ranks' watchdogs over ``channel`` (an mpi4py communicator of the
        whole job, this watchdog's own) and tell them when this process exits."""
        if self._channel is not None:
            return
        self._channel = channel
        atexit.register(self.leave)  # after mpi4py's: runs before MPI_Finalize
        failfast.before_end(self.quiet)
        self._start()

    def quiet(self) -> None:
        """Stop the thread (unless it is the caller) and wait for it to leave MPI."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=2.0)

    def _start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="fxpar-watchdog",
                                            daemon=True)
            self._thread.start()

    def _tick(self) -> float:
        return min(0.5, max(0.05, self.limit.seconds(self.slowest) / 5))

    def _run(self) -> None:
        while not self._stop.wait(self._tick()):
            self._serve()
            self._check_left()
            since, what = self._since, self._what
            if since is None or what is None:
                continue
            waited = time.monotonic() - since
            if waited >= self.limit.seconds(self.slowest):
                doing = f" (while running action {self.action})" if self.action else ""
                self._fire(watchdog_message(self.rank(), waited, what(), doing) +
                           f" The limit was {self.limit.describe(self.slowest)}.")

    def _serve(self) -> None:
        """Answer peers asking where this rank is; note peers that left."""
        ch = self._channel
        if ch is None:
            return
        mpi = failfast.mpi()
        status = mpi.Status()
        with self._talk:
            while ch.iprobe(source=mpi.ANY_SOURCE, tag=ASK, status=status):
                asker = status.Get_source()
                ch.recv(source=asker, tag=ASK)
                ch.send(self.position(), dest=asker, tag=STATE)
                self._askers.add(asker)
            while ch.iprobe(source=mpi.ANY_SOURCE, tag=LEFT, status=status):
                self.left[status.Get_source()] = ch.recv(source=status.Get_source(), tag=LEFT)

    def _check_left(self) -> None:
        members = self.members
        behind = {p: n for p, n in self.left.items() if n < self.step and self.in_step
                  and (members is None or p in members)}
        if behind:
            peer = min(behind)
            self._fire(left_message(self.rank(), peer, behind[peer], self.step))

    def position(self) -> Position:
        now = time.monotonic()
        since, what = self._since, self._what
        waiting = what() if since is not None and what is not None else ""
        return Position(self.rank(), self.step, self.in_step, self.action, self.index,
                        now - (since if waiting else self._action_since), waiting)

    def positions(self) -> dict[int, Position | None]:
        """Every rank's position (None: no answer within ANSWER_SECONDS)."""
        me = self.rank()
        out: dict[int, Position | None] = {me: self.position()}
        ch = self._channel
        if ch is None:
            return out
        mpi = failfast.mpi()
        peers = [r for r in range(ch.Get_size()) if r != me]
        with self._talk:
            asks = [ch.isend(me, dest=r, tag=ASK) for r in peers]
        out.update({r: None for r in peers})
        status = mpi.Status()
        deadline = time.monotonic() + ANSWER_SECONDS
        while any(out[r] is None for r in peers) and time.monotonic() < deadline:
            self._serve()  # a peer firing at the same time asks us too
            with self._talk:
                got = ch.iprobe(source=mpi.ANY_SOURCE, tag=STATE, status=status)
                if got:
                    out[status.Get_source()] = ch.recv(source=status.Get_source(), tag=STATE)
            if not got:
                time.sleep(0.01)
        del asks  # never waited for: the job ends next
        return out

    def report(self) -> str:
        """Every rank's position, as a table and on the grid."""
        got = self.positions()
        rows = [f"  rank {r}: " + (p.describe() if p is not None else
                                   f"no answer in {ANSWER_SECONDS:g} s (dead, exited, or stuck "
                                   f"in a call that holds Python's lock)")
                for r, p in sorted(got.items())]
        text = "Where every rank is:\n" + "\n".join(rows)
        marks = {r: p.index for r, p in got.items() if p is not None and p.index is not None
                 and p.in_step}
        if self.grid is not None and marks:
            text += "\n" + self.grid(marks)
        return text

    def _fire(self, headline: str) -> None:
        if not self._fired.acquire(blocking=False):
            return  # the other thread is already ending the job
        try:
            text = f"{headline}\n{self.report()}"
        except Exception as e:  # noqa: BLE001 - the report must never keep the job alive
            text = f"{headline}\n(where the other ranks are could not be asked: {e})"
        if any(r < self.rank() for r in self._askers):
            # a lower rank's watchdog fired too and is reporting: let it speak for the job
            deadline = time.monotonic() + DEFER_SECONDS
            while time.monotonic() < deadline:
                self._serve()
                time.sleep(0.05)
        failfast.say(text)  # still here: speak after all
        failfast.end(1)

    def leave(self) -> None:
        """At process exit: tell the peers how many steps this rank completed (unless its
        program failed: then fxpar.comm.failfast ends the job), then stop the thread, before
        MPI_Finalize."""
        self.quiet()
        ch, self._channel = self._channel, None
        if ch is None or failfast.failure() is not None:
            return
        done = self.step - (1 if self.in_step else 0)
        sends = [ch.isend(done, dest=r, tag=LEFT) for r in range(ch.Get_size())
                 if r != self.rank()]
        deadline = time.monotonic() + 1.0
        while sends and time.monotonic() < deadline:
            sends = [s for s in sends if not s.Test()]
            time.sleep(0.005)


# -- the process's watchdog ----------------------------------------------------------------------
_watchdog: Watchdog | None = None
_configured = False
_NOTHING = contextlib.nullcontext()


def set_watchdog(seconds: float | str | Limit | None) -> None:
    """The limit: seconds (None/0: off), "auto", "auto:FLOOR" or a :class:`Limit`."""
    global _watchdog, _configured
    _configured = True
    limit = seconds if isinstance(seconds, Limit) else \
        parse_limit("0" if seconds is None else str(seconds))
    if limit is None:
        if _watchdog is not None:
            _watchdog.limit = Limit(fixed=float("inf"))  # attached peers still get answers
            if _watchdog._channel is None:
                _watchdog._stop.set()
                _watchdog = None
        return
    if _watchdog is None:
        _watchdog = Watchdog(limit, lambda: failfast._rank_size()[0])
    _watchdog.limit = limit


def configure() -> None:
    """Read ``FXPAR_WATCHDOG`` (default auto), once; an explicit :func:`set_watchdog` wins."""
    if not _configured:
        set_watchdog(parse_limit(setting("watchdog")) or 0)


def current() -> Watchdog | None:
    return _watchdog


def attach() -> None:
    """Start the exchange with the other ranks' watchdogs: a duplicate of the world
    communicator, made once per process by its first :func:`fxpar.comm.world.world` (every rank
    of a job calls that first, so the collective lines up)."""
    global _watchdog
    configure()
    if _watchdog is None:  # off: no limit, but peers' reports and exits still get through
        _watchdog = Watchdog(Limit(fixed=float("inf")), lambda: failfast._rank_size()[0])
    if _watchdog._channel is not None:
        return
    mpi = failfast.mpi()
    if mpi.Query_thread() < mpi.THREAD_MULTIPLE:
        return  # the thread may not call MPI: the limit still applies, without the report
    _watchdog.attach(mpi.COMM_WORLD.Dup())


def watching(what: Callable[[], str]) -> contextlib.AbstractContextManager[None]:
    """Context for one blocking communication call; ``what()`` describes it (called only when
    the watchdog fires). A shared no-op when the watchdog is off."""
    return _NOTHING if _watchdog is None else _watchdog.watching(what)


def doing(action: object, index: int | None = None) -> None:
    """Note what the runtime is running now (``index``: its place in the action list)."""
    if _watchdog is not None:
        _watchdog.doing(action, index)
