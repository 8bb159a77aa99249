"""Fail fast: one rank's failure ends the whole MPI job, and no rank waits forever.

Under ``mpiexec`` a Python exception ends only its own process: MPICH (and Open MPI) leave the
other ranks blocked in their next receive or collective until the allocation runs out (checked
with the mpich wheel: a 2-rank job whose rank 1 raises while rank 0 receives never ends). So:

* :func:`install` (called by ``Program.local``, ``Program.for_rank(r, comm)``, ``load_program``
  and ``fxpar-run`` in any job of more than one rank; never by ``import fxpar``) sets an
  exception hook: an uncaught exception on a rank prints that rank's traceback once, under a
  banner naming the rank, and calls ``MPI_Abort``, which ends every rank of the job.
  ``FXPAR_FAILFAST=0`` turns it off. Each install that returned True is undone by one
  :func:`uninstall` (``RankProgram.close``); the last puts back the hooks found before.
* :func:`agree` is the first collective of a rank program: every rank sends a fingerprint of
  what it compiled (plan, schedule, transfers, initial weights) or the error it hit, so ranks
  that would disagree (another plan, another seed, one rank failing to compile) all raise the
  same :class:`Disagreement` instead of deadlocking later.
* the watchdog (``FXPAR_WATCHDOG=SECONDS``, ``fxpar-run --watchdog``, :func:`set_watchdog`):
  every blocking communication call of :class:`fxpar.comm.mpi.Comm` runs under :func:`watching`;
  one that waits longer than the limit prints what it waited for (and the action the runtime
  was running) and aborts the job: a peer stuck in a loop or dead without the launcher noticing.

A rank killed by a signal (``kill -9``, the kernel's OOM killer) is noticed by the launcher,
which ends the others (Hydra: "BAD TERMINATION ... KILLED BY SIGNAL: 9").
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from types import TracebackType
from typing import Any

from fxpar.core.plan import PlanError

WATCHDOG_ENV = "FXPAR_WATCHDOG"
FAILFAST_ENV = "FXPAR_FAILFAST"
# Environment variables an MPI launcher sets in every rank (MPICH/Hydra, Open MPI, Slurm).
LAUNCHER_VARS = ("PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_RANK")
SIZE_VARS = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "SLURM_NTASKS")


def launched() -> bool:
    """Whether an MPI launcher started this process."""
    return any(v in os.environ for v in LAUNCHER_VARS)


def _launched_size() -> int:
    for var in SIZE_VARS:
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    return 1


# -- messages (docs/errors.md shows them) ---------------------------------------------------
def failure_banner(rank: int, size: int) -> str:
    return (f"fxpar: rank {rank} of {size} failed; ending the whole job (MPI_Abort). "
            f"Its traceback follows; other ranks are stopped without one.")


def watchdog_message(rank: int, seconds: float, what: str, doing: str) -> str:
    return (f"fxpar watchdog: rank {rank} waited {seconds:.0f} s in {what}{doing}; a peer rank "
            f"is stuck, deadlocked or dead. Ending the whole job (MPI_Abort). If a step can "
            f"legitimately wait this long, raise {WATCHDOG_ENV} (fxpar-run --watchdog); 0 "
            f"turns the watchdog off.")


def disagreement_message(kind: str, detail: str) -> str:
    if kind == "error":
        return f"{detail} (every rank stops here: nothing was communicated but this check)"
    return (f"the ranks compiled different programs ({detail}): every rank must run the same "
            f"script with the same model, plan, example shape and fxpar/torch versions, and "
            f"build the model's initial weights identically (torch.manual_seed(...) before "
            f"building it on every rank, or build it on the meta device and compile with seed=)")


class Disagreement(PlanError):
    """Raised on every rank alike when the start-up check finds ranks that failed or differ."""


# -- the exception hook ------------------------------------------------------------------------
_installed = False
_holders = 0
"""Installs not yet undone (the hooks go back when the last is)."""
_previous: tuple[Any, Any] | None = None
"""(sys.excepthook, threading.excepthook) before the first install."""
_abort: Callable[[int], None] | None = None


def _world_abort(code: int) -> None:
    from mpi4py import MPI

    MPI.COMM_WORLD.Abort(code)


def _say(text: str) -> None:
    """Write ``text`` and its newline to stderr in one call: ranks failing at once (several
    watchdogs firing) then print whole lines, not one glued to another."""
    sys.stderr.write(text.rstrip("\n") + "\n")
    sys.stderr.flush()


def _end_job(rank: int, size: int, text: str) -> None:
    """Print ``text`` under the banner, then end every rank of the job."""
    sys.stdout.flush()
    _say(f"{failure_banner(rank, size)}\n{text}")
    (_abort or _world_abort)(1)
    os._exit(1)  # MPI_Abort can return when every peer has already exited


def _rank_size() -> tuple[int, int]:
    from mpi4py import MPI

    return MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()


def fail(exc: BaseException) -> None:
    """End the whole job because of ``exc`` on this rank (prints its traceback once)."""
    rank, size = _rank_size()
    _end_job(rank, size, "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)))


def _hook(kind: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
    rank, size = _rank_size()
    text = "".join(traceback.format_exception(kind, value, tb))
    if isinstance(value, Disagreement):  # raised on every rank alike: rank 0 says it, once
        if rank != 0:
            time.sleep(10.0)  # rank 0's abort normally ends this process first
            (_abort or _world_abort)(1)
            os._exit(1)
        sys.stdout.flush()
        _say(f"fxpar: the start-up check failed on every rank; ending the whole job.\n{text}")
        (_abort or _world_abort)(1)
        os._exit(1)
    _end_job(rank, size, text)


def _thread_hook(args: threading.ExceptHookArgs) -> None:
    if args.exc_type is SystemExit or args.exc_value is None:
        return
    _hook(args.exc_type, args.exc_value, args.exc_traceback)


def install(abort: Callable[[int], None] | None = None, force: bool = False) -> bool:
    """Make an uncaught exception on this rank end the whole job (see the module doc). Only in a
    job of more than one rank started by an MPI launcher (or ``force``); idempotent. Returns
    whether the hook is installed. abort(code): how to end the job (default MPI_Abort).

    Each call that returns True counts as one holder: :func:`uninstall` releases one, and the
    last puts back the hooks that were there before (a rank program holds it while open)."""
    global _installed, _abort, _holders, _previous
    configure()
    if os.environ.get(FAILFAST_ENV, "1") == "0":
        return False
    if not force and not (launched() and _launched_size() > 1):
        return False
    if abort is not None:
        _abort = abort
    if not _installed:
        _previous = (sys.excepthook, threading.excepthook)
        sys.excepthook = _hook
        threading.excepthook = _thread_hook
        _installed = True
    _holders += 1
    return True


def uninstall(held: bool = True) -> None:
    """Undo one :func:`install` that returned True (``held``: what it returned; False does
    nothing). The last one puts back the previous hooks, unless someone replaced ours since."""
    global _installed, _holders, _previous
    if not held or _holders == 0:
        return
    _holders -= 1
    if _holders or not _installed:
        return
    before, thread_before = _previous or (sys.__excepthook__, threading.__excepthook__)
    if sys.excepthook is _hook:
        sys.excepthook = before
    if threading.excepthook is _thread_hook:
        threading.excepthook = thread_before
    _installed, _previous = False, None


def installed() -> bool:
    """Whether the fail-fast hook is installed now."""
    return _installed


# -- start-up agreement ------------------------------------------------------------------------
_agreements = 0


def agreements() -> int:
    """How many times this process took part in :func:`agree`. A caller that compares it with
    an earlier count knows whether its rank passed the start-up check since: after it, a failing
    rank must end the job (its peers may already be in their first training communication)."""
    return _agreements


def agree(comm: Any, fingerprint: dict[str, str] | None, error: str | None = None) -> None:
    """Collective, the first of a rank program: raise :class:`Disagreement` on every rank when
    any rank reports an ``error`` or the ranks' fingerprints differ."""
    global _agreements
    _agreements += 1
    everyone: list[tuple[dict[str, str] | None, str | None]] = \
        comm.allgather_object((fingerprint, error))
    failed = [r for r, (_, e) in enumerate(everyone) if e]
    if failed:
        first = everyone[failed[0]][1]
        same = all(everyone[r][1] == first for r in failed)
        if same and len(failed) == len(everyone):
            raise Disagreement(str(first))  # the same error everywhere: just that error
        where = "every rank" if len(failed) == len(everyone) else \
            f"rank{'s' if len(failed) > 1 else ''} {_ranks(failed)}"
        detail = f"on {where}: {first}" if same else \
            "; ".join(f"on rank {r}: {everyone[r][1]}" for r in failed)
        raise Disagreement(disagreement_message("error", detail))
    prints = [f or {} for f, _ in everyone]
    groups: dict[str, list[int]] = {}
    for r, f in enumerate(prints):
        groups.setdefault(repr(sorted(f.items())), []).append(r)
    if len(groups) > 1:
        keys = sorted({k for f in prints for k in f})
        differ = [k for k in keys if len({f.get(k) for f in prints}) > 1]
        sides = " vs ".join(f"rank{'s' if len(rs) > 1 else ''} {_ranks(rs)}"
                            for rs in groups.values())
        raise Disagreement(disagreement_message(
            "fingerprint", f"{', '.join(differ)} differ: {sides}"))


def _ranks(rs: list[int]) -> str:
    return ", ".join(map(str, rs[:8])) + (", ..." if len(rs) > 8 else "")


def digest(*parts: object) -> str:
    """A short stable hash of ``repr`` of each part (for fingerprints)."""
    h = hashlib.sha256()
    for p in parts:
        h.update(repr(p).encode())
        h.update(b"\0")
    return h.hexdigest()[:16]


# -- the watchdog ------------------------------------------------------------------------------
class Watchdog:
    """Ends the job when one blocking call waits longer than ``seconds`` (a daemon thread checks
    a few times per limit). ``doing``: what the runtime is running (the action), for messages."""

    def __init__(self, seconds: float, rank: Callable[[], int]) -> None:
        self.seconds = seconds
        self.rank = rank
        self.doing = ""
        self._since: float | None = None
        self._what: Callable[[], str] | None = None
        self._depth = 0
        self._thread: threading.Thread | None = None

    @contextlib.contextmanager
    def watching(self, what: Callable[[], str]) -> Iterator[None]:
        outer = self._depth == 0
        if outer:
            self._what = what
            self._since = time.monotonic()
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="fxpar-watchdog",
                                                daemon=True)
                self._thread.start()
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1
            if outer:
                self._since = None

    def _run(self) -> None:
        tick = min(1.0, max(0.05, self.seconds / 5))
        while True:
            time.sleep(tick)
            since, what = self._since, self._what
            if since is None or what is None or time.monotonic() - since < self.seconds:
                continue
            doing = f" (while running action {self.doing})" if self.doing else ""
            rank = self.rank()
            sys.stdout.flush()
            _say(watchdog_message(rank, time.monotonic() - since, what(), doing))
            (_abort or _world_abort)(1)
            os._exit(1)


_watchdog: Watchdog | None = None
_NOTHING = contextlib.nullcontext()


def set_watchdog(seconds: float | None) -> None:
    """Abort the job when a communication call blocks longer than ``seconds`` (None/0: off)."""
    global _watchdog
    if seconds is not None and seconds < 0:
        raise ValueError(f"watchdog seconds must be >= 0 (0 turns it off), got {seconds}")
    if not seconds:
        _watchdog = None
        return
    if _watchdog is None:
        _watchdog = Watchdog(seconds, lambda: _rank_size()[0])
    _watchdog.seconds = seconds


def configure() -> None:
    """Read ``FXPAR_WATCHDOG`` (seconds; unset or 0: no watchdog). Called by :func:`install`
    and :func:`fxpar.comm.world.world`; an explicit :func:`set_watchdog` later wins."""
    value = os.environ.get(WATCHDOG_ENV, "")
    if not value:
        return
    try:
        seconds = float(value)
    except ValueError:
        raise ValueError(f"{WATCHDOG_ENV}={value!r}: give the seconds a communication call "
                         f"may wait (e.g. 600), or 0 for no watchdog") from None
    set_watchdog(seconds)


def watching(what: Callable[[], str]) -> contextlib.AbstractContextManager[None]:
    """Context for one blocking communication call; ``what()`` describes it (called only when
    the watchdog fires). A shared no-op when the watchdog is off."""
    return _NOTHING if _watchdog is None else _watchdog.watching(what)


def doing(action: object) -> None:
    """Note what the runtime is running now (named in a watchdog message)."""
    if _watchdog is not None:
        _watchdog.doing = str(action)

