"""Honouring ``FXPAR_FAULT`` in the runtime (the faults are parsed by fxpar.core.faults).

:meth:`Injector.hook` gives the runtime, for one training step, what to call before each
forward action: it raises, kills, stalls or slows the rank there, or answers True to poison the
forward's inputs with NaN (``nan-loss``). ``caught-raise`` raises like ``raise``; the rank
program then catches it as a user's script would and leaves with ``sys.exit``
(:meth:`Injector.caught`).
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Callable

from fxpar.core.faults import CAUGHT_EXIT, FAULT_ENV, Fault, find
from fxpar.core.schedule import Action

ONCE = ("raise", "caught-raise", "sigkill", "stall", "nan-loss")


class InjectedFault(RuntimeError):
    """The exception a ``raise`` or ``caught-raise`` fault raises."""


def _say(rank: int, fault: Fault, what: str) -> None:
    print(f"[fxpar rank {rank}] {FAULT_ENV}={fault}: {what}", file=sys.stderr, flush=True)


class Injector:
    """The faults of one rank."""

    def __init__(self, faults: tuple[Fault, ...], rank: int) -> None:
        self.faults = tuple(f for f in faults if f.rank == rank)
        self.rank = rank

    def hook(self, step: int) -> Callable[[Action], bool] | None:
        """What the runtime calls before each forward of ``step`` (None: nothing to do)."""
        once = find(self.faults, self.rank, step, *ONCE)
        slow = find(self.faults, self.rank, step, "slow-rank")
        if once is None and slow is None:
            return None
        fired = [False]

        def before_forward(action: Action) -> bool:
            if slow is not None:
                time.sleep(slow.seconds(1.0))
            if once is None or fired[0]:
                return False
            fired[0] = True
            return self._fire(once, step, action)

        return before_forward

    def _fire(self, fault: Fault, step: int, action: Action) -> bool:
        if fault.kind in ("raise", "caught-raise"):
            raise InjectedFault(f"{FAULT_ENV}={fault}: injected failure in step {step}, "
                                f"action {action}")
        if fault.kind == "sigkill":
            _say(self.rank, fault, f"killing this process (SIGKILL) in step {step}, "
                                   f"action {action}")
            os.kill(os.getpid(), signal.SIGKILL)
        if fault.kind == "stall":
            seconds = fault.seconds(float("inf"))
            _say(self.rank, fault, f"stalling in step {step}, action {action}"
                                   + (f" for {seconds:g} s" if seconds != float("inf") else ""))
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                time.sleep(min(1.0, end - time.monotonic()))
            return False
        _say(self.rank, fault, f"NaN into the inputs of step {step}, action {action}")
        return True  # nan-loss

    def caught(self, step: int, error: BaseException) -> None:
        """After step ``step`` failed: with a ``caught-raise`` fault, do what a script that
        catches the error and exits does (print it, ``sys.exit(3)``)."""
        fault = find(self.faults, self.rank, step, "caught-raise")
        if fault is None:
            return
        _say(self.rank, fault, f"the script caught {type(error).__name__}: {error}; it "
                               f"leaves with sys.exit({CAUGHT_EXIT})")
        sys.exit(CAUGHT_EXIT)
