"""Learning-rate schedules: factories ``schedule(optimizer) -> LRScheduler`` built from torch's
own schedulers (never reimplemented), and :class:`RankSchedule`, the schedule of one rank.

``TrainConfig(lr_schedule=warmup_cosine(total_steps=1000, warmup=50))`` hands the factory to
the Trainer, which builds the scheduler once over the rank's optimizer and steps it once per
optimizer step (or per epoch: ``schedule_every="epoch"``); ``fxpar-run --lr-schedule cosine
--warmup 50`` does the same. Counts are of scheduler steps: optimizer steps (with
``accumulate=k``, a k-th of the batches), or epochs.

Warm-up (every factory's ``warmup``): ``LinearLR`` from ``1/(warmup+1)`` of the base LR, so
scheduler step e < warmup trains at ``lr * (e+1) / (warmup+1)`` and step ``warmup`` at ``lr``;
then the schedule proper, by ``SequentialLR``.

A rank whose stages hold no parameter has no optimizer (``rp.optimizer is None``): its
schedule runs on a placeholder optimizer the factory of the program builds over one empty
tensor, with the same hyper-parameters, so every rank holds the same LR sequence (for the
progress line and the checkpoint) and resumes it the same way.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch.optim import Optimizer
from torch.optim.lr_scheduler import (
    CosineAnnealingLR,
    LinearLR,
    LRScheduler,
    OneCycleLR,
    PolynomialLR,
    ReduceLROnPlateau,
    SequentialLR,
)

if TYPE_CHECKING:
    from fxpar.program.program import RankProgram

Schedule = Callable[[Optimizer], LRScheduler]
"""A factory: the scheduler of an optimizer (what ``TrainConfig.lr_schedule`` holds)."""

NAMES = ("constant", "cosine", "poly", "onecycle")
"""The schedules ``fxpar-run --lr-schedule`` names (:func:`by_name`)."""


def _check(total_steps: int, warmup: int) -> None:
    if total_steps < 1:
        raise ValueError(f"a schedule of total_steps={total_steps}: give the number of "
                         f"scheduler steps it spans (optimizer steps, or epochs), >= 1")
    if not 0 <= warmup < total_steps:
        raise ValueError(f"warmup={warmup} with total_steps={total_steps}: warm up for 0 .. "
                         f"{total_steps - 1} steps, fewer than the schedule spans")


def _warm(optimizer: Optimizer, warmup: int,
          then: Callable[[], LRScheduler] | None) -> LRScheduler:
    """The scheduler ``then()`` makes, after ``warmup`` linear warm-up steps (``then`` alone
    for none; the warm-up alone, then a constant LR, for no ``then``). Built in the order
    SequentialLR expects: the warm-up first."""
    if warmup == 0 and then is not None:
        return then()
    ramp = LinearLR(optimizer, start_factor=1 / (warmup + 1), total_iters=warmup)
    if then is None:
        return ramp
    return SequentialLR(optimizer, [ramp, then()], milestones=[warmup])


def constant(warmup: int = 0) -> Schedule:
    """The optimizer's LR throughout, after ``warmup`` warm-up steps."""
    if warmup < 0:
        raise ValueError(f"warmup={warmup}: give a number of steps >= 0")
    return lambda opt: _warm(opt, warmup, None)


def warmup_cosine(total_steps: int, warmup: int = 0, eta_min: float = 0.0) -> Schedule:
    """Linear warm-up for ``warmup`` steps, then ``CosineAnnealingLR`` from the LR down to
    ``eta_min`` over the remaining ``total_steps - warmup`` steps."""
    _check(total_steps, warmup)

    return lambda opt: _warm(opt, warmup, lambda: CosineAnnealingLR(
        opt, T_max=total_steps - warmup, eta_min=eta_min))


def polynomial(total_steps: int, power: float = 0.9, warmup: int = 0) -> Schedule:
    """nnU-Net's ``lr * (1 - step / total_steps) ** power`` (``PolynomialLR``), after
    ``warmup`` warm-up steps (it then spans the remaining steps)."""
    _check(total_steps, warmup)
    if power <= 0:
        raise ValueError(f"power={power}: a polynomial decay has power > 0 (nnU-Net: 0.9)")
    return lambda opt: _warm(opt, warmup, lambda: PolynomialLR(
        opt, total_iters=total_steps - warmup, power=power))


def one_cycle(total_steps: int, max_lr: float | None = None, pct_start: float = 0.3,
              **kwargs: Any) -> Schedule:
    """``OneCycleLR`` over ``total_steps`` steps, peaking at ``max_lr`` (default: the
    optimizer's LR) after ``pct_start`` of them; ``kwargs`` go to OneCycleLR
    (``anneal_strategy``, ``div_factor``, ``cycle_momentum``, ...). With ``cycle_momentum``
    (its default) the optimizer needs a momentum (SGD's) or betas (Adam's)."""
    _check(total_steps, 0)
    if not 0 < pct_start < 1:
        raise ValueError(f"pct_start={pct_start}: the share of the steps that warm up, in "
                         f"(0, 1)")

    def build(opt: Optimizer) -> LRScheduler:
        peak = [g["lr"] for g in opt.param_groups] if max_lr is None else max_lr
        return OneCycleLR(opt, max_lr=peak, total_steps=total_steps, pct_start=pct_start,
                          **kwargs)
    return build


def by_name(name: str, total_steps: int, warmup: int = 0) -> Schedule | None:
    """``fxpar-run --lr-schedule NAME --warmup N``: None for a constant LR without warm-up.
    onecycle warms up for ``warmup`` steps when given (its ``pct_start``), else 30%."""
    if name == "constant":
        return constant(warmup) if warmup else None
    if name == "cosine":
        return warmup_cosine(total_steps, warmup)
    if name == "poly":
        return polynomial(total_steps, warmup=warmup)
    if name == "onecycle":
        _check(total_steps, warmup)
        return one_cycle(total_steps, pct_start=warmup / total_steps if warmup else 0.3)
    raise ValueError(f"--lr-schedule {name!r}: use one of {', '.join(NAMES)}")


def _placeholder(rp: RankProgram) -> Optimizer:
    """The optimizer of a rank without parameters: the program's factory over one empty
    tensor (the same hyper-parameters, nothing to update)."""
    if rp.program.optimizer is None:
        raise ValueError("lr_schedule needs an optimizer: compile the program with "
                         "optimizer=lambda params: torch.optim.SGD(params, lr=...)")
    return rp.program.optimizer(iter([torch.nn.Parameter(torch.zeros(0))]))


class RankSchedule:
    """One rank's LR schedule: ``factory`` over its optimizer, or over a placeholder optimizer
    on a rank without one (the module doc)."""

    def __init__(self, rp: RankProgram, factory: Schedule) -> None:
        self.placeholder = None if rp.optimizer is not None else _placeholder(rp)
        optimizer = rp.optimizer if rp.optimizer is not None else self.placeholder
        assert optimizer is not None
        self.optimizer = optimizer
        scheduler = factory(optimizer)
        if isinstance(scheduler, ReduceLROnPlateau) or not isinstance(scheduler, LRScheduler):
            raise TypeError(f"lr_schedule gave a {type(scheduler).__name__}: give a factory "
                            f"optimizer -> torch.optim.lr_scheduler.LRScheduler that steps "
                            f"without a metric (ReduceLROnPlateau needs one)")
        if scheduler.optimizer is not optimizer:
            raise ValueError("lr_schedule built its scheduler over another optimizer: build it "
                             "over the optimizer it is given")
        self.scheduler = scheduler

    def step(self) -> None:
        if self.placeholder is not None:
            self.placeholder.step()  # no gradients: nothing changes, but the scheduler sees
        self.scheduler.step()        # its optimizer stepped first, as on every other rank

    @property
    def lr(self) -> float:
        """The LR of the first parameter group, for the next step."""
        return float(self.optimizer.param_groups[0]["lr"])

    def state_dict(self) -> dict[str, Any]:
        """The scheduler's state (and the placeholder's hyper-parameters, which the scheduler
        moves and which no optimizer state of the checkpoint holds)."""
        return {"scheduler": self.scheduler.state_dict(),
                "placeholder": None if self.placeholder is None else
                self.placeholder.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.placeholder is not None and state.get("placeholder") is not None:
            self.placeholder.load_state_dict(state["placeholder"])
        self.scheduler.load_state_dict(state["scheduler"])
