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
* a rank whose program failed (:func:`mark_failed`: a step raised) may not leave quietly: its
  peers wait in that step. When the user's script catches the error and exits anyway
  (``sys.exit``, the end of the script), an ``atexit`` handler ends the whole job instead of
  waiting in ``MPI_Finalize``; ``RankProgram.close()`` of a failed program does it at once.
* the watchdog (fxpar.comm.watchdog) ends a job whose ranks wait too long or that a rank left.

A rank killed by a signal (``kill -9``, the kernel's OOM killer) is noticed by the launcher,
which ends the others (Hydra: "BAD TERMINATION ... KILLED BY SIGNAL: 9").
"""

from __future__ import annotations

import atexit
import hashlib
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable, Mapping
from types import TracebackType
from typing import Any

from fxpar.comm import launch
from fxpar.core.options import flag
from fxpar.core.plan import PlanError

FAILFAST_ENV = "FXPAR_FAILFAST"
END_GRACE = 0.5
"""Seconds between printing why the job ends and MPI_Abort."""


def launched() -> bool:
    """Whether a launcher (mpiexec, srun, torchrun: fxpar.comm.launch) started this process."""
    return launch.launched()


def _launched_size() -> int:
    return launch.launched_size() or 2  # a launcher that does not say: assume a real job


# -- messages (docs/errors.md shows them) ---------------------------------------------------
def failure_banner(rank: int, size: int) -> str:
    return (f"fxpar: rank {rank} of {size} failed; ending the whole job (MPI_Abort). "
            f"Its traceback follows; other ranks are stopped without one.")


def left_failed_message(rank: int, size: int, failure: str) -> str:
    return (f"fxpar: rank {rank} of {size} is leaving with a failed program ({failure}). Its "
            f"peers wait in that step for it, so the whole job ends now (MPI_Abort) instead of "
            f"hanging in MPI_Finalize. A failed step cannot be resumed: let the error "
            f"propagate, or resume from a checkpoint in a new job.")


def disagreement_message(kind: str, detail: str) -> str:
    if kind == "error":
        return f"{detail} (every rank stops here: nothing was communicated but this check)"
    return (f"the ranks compiled different programs ({detail}): every rank must run the same "
            f"script with the same model, plan, example shape and fxpar/torch versions, and "
            f"build the model's initial weights identically (torch.manual_seed(...) before "
            f"building it on every rank, or build it on the meta device and compile with seed=)")


class Disagreement(PlanError):
    """Raised on every rank alike when the start-up check finds ranks that failed or differ."""

    everywhere = True
    """Raised on every rank at the same point (the fail-fast hook prints it once, rank 0's)."""


# -- the exception hook ------------------------------------------------------------------------
_installed = False
_holders = 0
"""Installs not yet undone (the hooks go back when the last is)."""
_previous: tuple[Any, Any] | None = None
"""(sys.excepthook, threading.excepthook) before the first install."""
_abort: Callable[[int], None] | None = None


YIELD_VAR = "MPIR_CVAR_ENABLE_HEAVY_YIELD"


def oversubscribed(environ: Mapping[str, str] | None = None) -> bool:
    """Whether the launcher put more ranks on this node than this process may use cores."""
    found = launch.detect(environ)
    return found is not None and found.local_size > len(os.sched_getaffinity(0))


def mpi() -> Any:
    """mpi4py's MPI module (initialising MPI on first use).

    Before MPI starts on a node with more ranks than cores, this asks MPICH to sleep instead of
    spinning while a call waits (``MPIR_CVAR_ENABLE_HEAVY_YIELD=1``, unless set): spinning
    ranks take the cores the computing ones need (3x slower steps measured with 6 ranks on 2
    cores). Open MPI does the same by itself when oversubscribed."""
    if "mpi4py.MPI" not in sys.modules and YIELD_VAR not in os.environ and oversubscribed():
        os.environ[YIELD_VAR] = "1"
    from mpi4py import MPI

    return MPI


def _mpi_running() -> Any:
    """mpi4py's MPI module when this process initialised MPI, else None (a torchrun job)."""
    module = sys.modules.get("mpi4py.MPI")
    return module if module is not None and module.Is_initialized() and \
        not module.Is_finalized() else None


def _world_abort(code: int) -> None:
    """MPI_Abort; without MPI, just this process's exit: torchrun's agent (or ``srun
    --kill-on-bad-exit=1``) then ends the other ranks."""
    running = _mpi_running()
    if running is not None:
        running.COMM_WORLD.Abort(code)


def say(text: str) -> None:
    """Write ``text`` and its newline to stderr in one call: ranks failing at once (several
    watchdogs firing) then print whole lines, not one glued to another."""
    sys.stderr.write(text.rstrip("\n") + "\n")
    sys.stderr.flush()


_quiet: list[Callable[[], None]] = []
"""Called before MPI_Abort: stop other threads' MPI calls (the watchdog's)."""


def before_end(fn: Callable[[], None]) -> None:
    """Call ``fn`` before this process aborts the job (fxpar.comm.watchdog stops its thread:
    MPI_Abort while another thread polls MPI crashed the rank, exit 11)."""
    _quiet.append(fn)


def end(code: int = 1) -> None:
    """End every rank of the job now (after a moment for the launcher to forward what this
    rank printed: an abort can otherwise cut it off)."""
    sys.stdout.flush()
    sys.stderr.flush()
    for fn in _quiet:
        try:
            fn()
        except Exception:  # noqa: BLE001, S110 - nothing may keep the job alive
            pass
    time.sleep(END_GRACE)
    (_abort or _world_abort)(code)
    os._exit(code)  # MPI_Abort can return when every peer has already exited


def _end_job(rank: int, size: int, text: str) -> None:
    """Print ``text`` under the banner, then end every rank of the job."""
    sys.stdout.flush()  # what the rank printed first stays before the banner
    say(f"{failure_banner(rank, size)}\n{text}")
    end(1)


def _rank_size() -> tuple[int, int]:
    running = _mpi_running()
    if running is not None:
        return running.COMM_WORLD.Get_rank(), running.COMM_WORLD.Get_size()
    found = launch.detect()
    return (found.rank, found.size) if found is not None else (0, 1)


def fail(exc: BaseException) -> None:
    """End the whole job because of ``exc`` on this rank (prints its traceback once; an error
    raised on every rank alike is printed by rank 0 only)."""
    _hook(type(exc), exc, exc.__traceback__)


def _hook(kind: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
    rank, size = _rank_size()
    text = "".join(traceback.format_exception(kind, value, tb))
    if getattr(value, "everywhere", False):  # raised on every rank alike: rank 0 says it once
        if rank != 0:
            time.sleep(10.0)  # rank 0's abort normally ends this process first
            end(1)
        say(f"fxpar: every rank stopped with this error; ending the whole job.\n{text}")
        end(1)
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
    if not flag("failfast"):
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


# -- failed programs ------------------------------------------------------------------------
_failure: str | None = None
"""What failed on this rank (a step of some rank program), or None."""


def mark_failed(what: str) -> None:
    """Note that a step failed on this rank: from now on, leaving the process (however) ends
    the whole job, since the peers wait in that step. Only in a job where the hook is
    installed (a multi-rank launch)."""
    global _failure
    if not _installed:
        return
    if _failure is None:
        atexit.register(end_failed)  # after mpi4py's: runs before MPI_Finalize
    _failure = what


def failure() -> str | None:
    """What failed on this rank (see :func:`mark_failed`), or None."""
    return _failure


def end_failed() -> None:
    """End the job because this rank's program failed (no-op when none did)."""
    if _failure is None or not _installed:
        return
    rank, size = _rank_size()
    say(left_failed_message(rank, size, _failure))
    end(1)



# -- start-up agreement ------------------------------------------------------------------------
_agreements = 0


def agreements() -> int:
    """How many times this process took part in :func:`agree`. A caller that compares it with
    an earlier count knows whether its rank passed the start-up check since: after it, a failing
    rank must end the job (its peers may already be in their first training communication)."""
    return _agreements


def agree(comm: Any, fingerprint: dict[str, str] | None, error: str | None = None,
          counted: bool = True) -> None:
    """Collective, the first of a rank program: raise :class:`Disagreement` on every rank when
    any rank reports an ``error`` or the ranks' fingerprints differ. ``counted=False``: a
    meeting before the program exists (fxpar-run's, before rank 0 captures the model for every
    rank), after which the ranks still move together: :func:`agreements` does not count it."""
    global _agreements
    _agreements += int(counted)
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
