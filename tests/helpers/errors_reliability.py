"""Triggers and texts for the reliability entries of the errors catalogue (issue 23): each
raises the real error without MPI, or builds the text fxpar prints before a job ends."""

from __future__ import annotations

import torch
from torch import nn

import fxpar
from fxpar.comm import failfast, watchdog
from fxpar.core import faults
from fxpar.runtime.guard import nonfinite_policy


def _one_rank() -> fxpar.RankProgram:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 2))
    program = fxpar.compile(model, fxpar.Plan(), (4, 3, 8, 8),
                            optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
    return program.local()


def nan_batch() -> None:
    """A step whose input holds a NaN: NonFiniteError (the default policy, stop)."""
    x = torch.randn(4, 3, 8, 8)
    x[1, 0, 2, 2] = float("nan")
    _one_rank().train_step(x, torch.tensor([0, 1, 0, 1]))


def train_after_failure() -> None:
    """A script that catches a failed step and trains on: ProgramFailed."""
    rp = _one_rank()
    x, y = torch.randn(4, 3, 8, 8), torch.tensor([0, 1, 0, 1])
    try:
        rp.train_step(x, y.float())  # cross_entropy of float targets of the wrong shape
    except RuntimeError:
        pass
    rp.train_step(x, y)


def bad_nonfinite_setting() -> None:
    nonfinite_policy("never")


def bad_fault_spec() -> None:
    faults.parse("1:x:raise")


def bad_watchdog_setting() -> None:
    watchdog.parse_limit("ten minutes")


def left_failed() -> str:
    return failfast.left_failed_message(
        1, 3, "rank 1, step 4: ActionFailed: action 1F0 raised ValueError: bad target")


def peer_left() -> str:
    return watchdog.left_message(0, 2, 3, 4)


__all__ = ["bad_fault_spec", "bad_nonfinite_setting", "bad_watchdog_setting",
           "left_failed", "nan_batch", "peer_left", "train_after_failure"]
