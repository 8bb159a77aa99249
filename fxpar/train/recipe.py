"""What a :class:`~fxpar.train.trainer.TrainConfig` adds around each optimizer step of a rank
program: gradient clipping (run by the program between its gradient sync and the optimizer
step, ``rp.before_optimizer_step``), accumulation (``rp.train_step(..., accumulate=k)``), the
LR schedule (fxpar.train.schedules) and the weights' moving average (fxpar.train.ema); with a
log open (fxpar.train.logs) it measures the gradient norm at each optimizer step.

Counting: the Trainer's steps are batches (``train_step`` calls); with ``accumulate=k`` the
last of each cycle of k makes an optimizer step (fxpar.program.gradstep), and only those step
the EMA and a per-step schedule (``schedule_every="step"``; a per-epoch one steps after each
epoch's last batch, ``steps_per_epoch``). A step the program dropped (NaN/inf under
``--nonfinite skip``, which also ends an accumulation cycle early, or a float16 overflow)
trains nothing and steps neither. Each rank steps its own scheduler and average; they agree
because every rank sees the same steps.
"""

from __future__ import annotations

import math
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING

from fxpar.program.checkpoint import Stateful
from fxpar.train.config import TrainConfig
from fxpar.train.ema import EMA
from fxpar.train.logs import wanted
from fxpar.train.schedules import RankSchedule

if TYPE_CHECKING:
    from fxpar.program.program import RankProgram


@dataclass(frozen=True)
class ClipNorm:
    """``rp.before_optimizer_step`` hook: clip the gradients to a global norm (the whole
    model's, each parameter counted once: ``rp.clip_grad_norm_``, collective)."""

    max_norm: float

    def __call__(self, rp: RankProgram) -> None:
        rp.clip_grad_norm_(self.max_norm)


@dataclass(frozen=True)
class ClipValue:
    """``rp.before_optimizer_step`` hook: clamp every gradient to [-value, value]."""

    value: float

    def __call__(self, rp: RankProgram) -> None:
        rp.clip_grad_value_(self.value)


@dataclass(frozen=True)
class MeasureNorm:
    """``rp.before_optimizer_step`` hook while a log is open (fxpar.train.logs): measure the
    gradients' global norm without clipping (``rp.clip_grad_norm_(inf)``: the coefficient is
    exactly 1), before any clipping by value."""

    def __call__(self, rp: RankProgram) -> None:
        rp.clip_grad_norm_(math.inf)


class Recipe:
    """The schedule, average and clipping of ``config`` for ``rp`` (the module doc). Its
    clipping hook goes on ``rp.before_optimizer_step`` once, however many Trainers share
    ``rp``."""

    def __init__(self, rp: RankProgram, config: TrainConfig) -> None:
        self.rp, self.config = rp, config
        self.schedule = None if config.lr_schedule is None else \
            RankSchedule(rp, config.lr_schedule)
        self.ema = None if config.ema is None else EMA(rp, config.ema, config.ema_warmup)
        hooks: list[ClipNorm | ClipValue | MeasureNorm] = []
        if config.clip_grad is not None:
            hooks.append(ClipNorm(config.clip_grad))
        elif wanted(config):
            hooks.append(MeasureNorm())
        if config.clip_value is not None:
            hooks.append(ClipValue(config.clip_value))
        for hook in hooks:
            if hook not in rp.before_optimizer_step:
                rp.before_optimizer_step.append(hook)
        self._before = (False, 0)

    def _drops(self) -> int:
        """Steps and cycles the program dropped so far (the NaN/inf policy's, the loss
        scale's, an accumulation cycle's)."""
        rp, ls = self.rp, self.rp.loss_scale
        return rp.guard.skipped + rp.accumulation.dropped + (ls.skipped if ls is not None else 0)

    def before_batch(self) -> float | None:
        """Before a batch: note where the accumulation cycle stands; the LR the batch trains
        with (:attr:`lr`)."""
        cycle = self.rp.accumulation
        self._before = (cycle.done == self.config.accumulate - 1, self._drops())
        return self.lr

    def after_batch(self, n: int) -> bool:
        """After batch n (1-based, counted from step 0): whether it made an optimizer step (the
        last of its accumulation cycle, not dropped); if so, step the average and the
        per-step schedule. A per-epoch schedule steps after every epoch's last batch."""
        last, drops = self._before
        stepped = last and self._drops() == drops
        c = self.config
        if stepped and self.ema is not None:
            self.ema.update()
        if self.schedule is not None and (
                (c.schedule_every == "step" and stepped) or
                (c.schedule_every == "epoch" and n % (c.steps_per_epoch or 1) == 0)):
            self.schedule.step()
        return stepped

    def state(self) -> dict[str, Stateful]:
        """What a checkpoint keeps of the recipe, by name (fxpar.program.checkpoint's
        ``state=``)."""
        out: dict[str, Stateful] = {}
        if self.schedule is not None:
            out["scheduler"] = self.schedule
        if self.ema is not None:
            out["ema"] = self.ema
        return out

    def evaluating(self) -> AbstractContextManager[None]:
        """Where validation runs: in the averaged weights with ``ema_eval``."""
        if self.ema is not None and self.config.ema_eval:
            return self.ema.applied()
        return nullcontext()

    @property
    def lr(self) -> float | None:
        """The LR of the next step (the first parameter group's); None on a rank without an
        optimizer and schedule."""
        if self.schedule is not None:
            return self.schedule.lr
        opt = self.rp.optimizer
        return None if opt is None else float(opt.param_groups[0]["lr"])

    def progress(self, lr: float | None) -> str:
        """The progress line's part: ``lr`` (what the batch trained with: :attr:`lr` before
        it), and the gradients' global norm when the program measured it (clipping by norm)."""
        norm = self.rp.grad_norm
        return ("" if lr is None else f"  lr {lr:.4g}") + \
            ("" if norm is None else f"  grad norm {norm:.4g}")
