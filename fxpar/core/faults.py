"""Injected faults, for tests and for users rehearsing failures: ``FXPAR_FAULT``.

``FXPAR_FAULT=RANK:STEP:KIND[:ARG]`` (several, comma separated) makes rank RANK misbehave in
training step STEP (1 = the first step this process runs after compile or after a checkpoint
load: the step count goes on from the loaded checkpoint's step). Kinds:

==================  =============================================================================
raise               an exception in the rank's first forward of the step (as a failing layer)
caught-raise        the same, caught by the script, which then leaves with ``sys.exit(3)`` (the
                    exit a user's ``except Exception: ...; sys.exit(...)`` makes)
sigkill             the rank kills itself with SIGKILL there (as the kernel's OOM killer does)
stall               the rank sleeps there for ARG seconds (default: forever): a hung rank
nan-loss            the rank's first forward of the step yields NaN (its loss, or the
                    activations it sends on), so the loss and the gradients go NaN
slow-rank           the rank sleeps ARG seconds (default 1) before each forward, from STEP on
corrupt-checkpoint  the checkpoint saved at STEP gets this rank's shard damaged after it is
                    written (ARG: ``truncate``, the default, or ``flip``: one byte changed)
==================  =============================================================================

The runtime reads the variable when a rank program is made (``RankProgram.train_step`` honours
it), the checkpoint code at each ``fxpar.program.checkpoint.save``; nothing else does.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from fxpar.core.options import setting
from fxpar.core.plan import PlanError

FAULT_ENV = "FXPAR_FAULT"
KINDS = ("raise", "caught-raise", "sigkill", "stall", "nan-loss", "slow-rank",
         "corrupt-checkpoint")
CAUGHT_EXIT = 3
"""The exit code of a ``caught-raise`` rank (the script's own ``sys.exit``)."""


class FaultSpecError(PlanError):
    """``FXPAR_FAULT`` does not parse; the message shows the form."""


@dataclass(frozen=True)
class Fault:
    """One injected fault: ``kind`` on ``rank`` at training step ``step`` (1-based)."""

    rank: int
    step: int
    kind: str
    arg: str = ""

    def seconds(self, default: float) -> float:
        """ARG as seconds (stall, slow-rank), or ``default``."""
        return float(self.arg) if self.arg else default

    def __str__(self) -> str:
        return f"{self.rank}:{self.step}:{self.kind}" + (f":{self.arg}" if self.arg else "")


def _bad(text: str, why: str) -> FaultSpecError:
    return FaultSpecError(
        f"{FAULT_ENV}={text!r}: {why}. Write RANK:STEP:KIND[:ARG], several comma separated, "
        f"with KIND one of {', '.join(KINDS)} (e.g. {FAULT_ENV}=1:3:raise or "
        f"{FAULT_ENV}=0:2:stall:30); unset it for no fault")


def parse(text: str) -> tuple[Fault, ...]:
    """The faults ``text`` (the variable's value) names; () for an empty one."""
    faults = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        parts = item.split(":", 3)
        if len(parts) < 3:
            raise _bad(text, f"{item!r} has {len(parts)} of the 3 fields")
        rank, step, kind = parts[:3]
        arg = parts[3] if len(parts) > 3 else ""
        if not rank.isdigit() or not step.isdigit() or int(step) < 1:
            raise _bad(text, f"{item!r}: RANK must be >= 0 and STEP >= 1 (whole numbers)")
        if kind not in KINDS:
            raise _bad(text, f"{item!r}: unknown kind {kind!r}")
        if arg and kind in ("stall", "slow-rank"):
            try:
                if float(arg) < 0:
                    raise ValueError
            except ValueError:
                raise _bad(text, f"{item!r}: ARG of {kind} is seconds (>= 0)") from None
        if arg and kind == "corrupt-checkpoint" and arg not in ("truncate", "flip"):
            raise _bad(text, f"{item!r}: ARG of corrupt-checkpoint is truncate or flip")
        if arg and kind not in ("stall", "slow-rank", "corrupt-checkpoint"):
            raise _bad(text, f"{item!r}: {kind} takes no ARG")
        faults.append(Fault(int(rank), int(step), kind, arg))
    return tuple(faults)


def from_env(environ: Mapping[str, str] | None = None) -> tuple[Fault, ...]:
    """The faults ``FXPAR_FAULT`` names in ``environ`` (default: this process's)."""
    return parse(setting("fault", environ))


def find(faults: tuple[Fault, ...], rank: int, step: int, *kinds: str) -> Fault | None:
    """The fault of one of ``kinds`` for ``rank`` at ``step`` (slow-rank: at or after it)."""
    for f in faults:
        if f.rank != rank or f.kind not in kinds:
            continue
        if f.step == step or (f.kind == "slow-rank" and step >= f.step):
            return f
    return None
