"""How to train: :class:`TrainConfig`, one flat, keyword-only record of every setting of the
Trainer (fxpar.train.trainer), validated on construction with messages that say what to
change, so it is checked before any rank communicates."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from fxpar.runtime.guard import nonfinite_policy
from fxpar.train.evaluate import BEST
from fxpar.train.logs import check_tensorboard
from fxpar.train.schedules import Schedule

EVERY = ("step", "epoch")
"""When the LR schedule steps: after every optimizer step, or after every epoch."""


@dataclass(frozen=True)
class TrainConfig:
    """How to train: one field per ``fxpar-run`` training flag."""

    steps: int
    """Train until this step (a resumed run starts at its checkpoint's step). Steps are
    batches (``train_step`` calls): with ``accumulate=k``, steps / k optimizer steps."""
    log_every: int | None = None
    """Rank 0 prints a progress line every this many steps (None: about 50 lines a run),
    and at the first and last step."""
    eval_every: int | None = None
    """Validate every this many steps (None: after the last step only); needs ``val``."""
    best_metric: str = "loss"
    """The validation metric ``checkpoint/best`` keeps the best model by (fxpar.train.evaluate)."""
    checkpoint: Path | None = None
    """Save the training state here after the last step (and every ``checkpoint_every``)."""
    checkpoint_every: int | None = None
    resume: Path | None = None
    """Start from this checkpoint folder's state and step."""
    metrics: Path | None = None
    """Rank 0 writes the run's metrics (throughput, per-rank times, evals) here as JSON."""
    nonfinite: str | None = None
    """NaN/inf policy (stop, skip, off); None: FXPAR_NONFINITE (fxpar.core.options)."""
    name: str = "model"
    """The model's name in the metrics."""
    lr_schedule: Schedule | None = None
    """``optimizer -> torch.optim.lr_scheduler.LRScheduler`` (fxpar.train.schedules:
    warmup_cosine, polynomial, one_cycle); None: the optimizer's LR throughout."""
    schedule_every: str = "step"
    """Step the schedule after every optimizer step ("step") or every epoch ("epoch")."""
    steps_per_epoch: int | None = None
    """Batches per epoch (with ``schedule_every="epoch"``)."""
    ema: float | None = None
    """Keep a moving average of the weights with this decay (fxpar.train.ema); None: none."""
    ema_warmup: bool = True
    """The average's decay warms up as min(ema, (1 + t) / (10 + t)) (fxpar.train.ema)."""
    ema_eval: bool = False
    """Validate with the averaged weights (swapped in for the pass, then back); needs ema."""
    clip_grad: float | None = None
    """Clip the gradients to this global norm (the whole model's) before each optimizer step."""
    clip_value: float | None = None
    """Clamp every gradient to [-clip_value, clip_value] before each optimizer step."""
    accumulate: int = 1
    """Batches per optimizer step (gradient accumulation); 1 means none."""
    log_csv: Path | None = None
    """Rank 0 logs every step and eval to this CSV file (fxpar.train.logs); give the same
    logs on every rank (the gradient norm is then measured, a collective)."""
    log_jsonl: Path | None = None
    """The same rows as JSON lines (fxpar.train.logs)."""
    tensorboard: Path | None = None
    """The same values as TensorBoard scalars in this folder (``pip install
    'fxpar[tensorboard]'``)."""

    def __post_init__(self) -> None:
        if self.steps < 0:
            raise ValueError(f"steps must be >= 0, got {self.steps}")
        for what, v in (("log_every", self.log_every), ("eval_every", self.eval_every),
                        ("checkpoint_every", self.checkpoint_every),
                        ("steps_per_epoch", self.steps_per_epoch)):
            if v is not None and v < 1:
                raise ValueError(f"{what} must be >= 1, got {v}")
        if self.best_metric not in BEST:
            raise ValueError(f"best_metric {self.best_metric!r}: use one of {', '.join(BEST)}")
        if self.checkpoint_every is not None and self.checkpoint is None:
            raise ValueError("checkpoint_every needs checkpoint (a folder)")
        if self.nonfinite is not None:
            nonfinite_policy(self.nonfinite)
        self._check_recipe()
        if self.tensorboard is not None:
            check_tensorboard(f"tensorboard={self.tensorboard}")

    def _check_recipe(self) -> None:
        if self.lr_schedule is not None and not callable(self.lr_schedule):
            raise TypeError(f"lr_schedule must be a factory optimizer -> LRScheduler (e.g. "
                            f"fxpar.train.schedules.warmup_cosine(1000, warmup=50)), got "
                            f"{type(self.lr_schedule).__name__}")
        if self.schedule_every not in EVERY:
            raise ValueError(f"schedule_every {self.schedule_every!r}: use 'step' or 'epoch'")
        if self.schedule_every == "epoch" and (self.lr_schedule is None
                                               or self.steps_per_epoch is None):
            raise ValueError("schedule_every='epoch' needs lr_schedule and steps_per_epoch "
                             "(batches per epoch)")
        if self.ema is not None and not 0.0 <= self.ema < 1.0:
            raise ValueError(f"ema {self.ema}: give a decay in [0, 1), e.g. 0.999")
        if self.ema_eval and self.ema is None:
            raise ValueError("ema_eval validates with the averaged weights: give ema (a decay, "
                             "e.g. 0.999)")
        for what, v in (("clip_grad", self.clip_grad), ("clip_value", self.clip_value)):
            if v is not None and not v > 0:
                raise ValueError(f"{what} must be > 0, got {v}")
        if self.clip_grad is not None and self.clip_value is not None:
            raise ValueError("give clip_grad (a global norm) or clip_value (a bound per "
                             "element), not both")
        if self.accumulate < 1:
            raise ValueError(f"accumulate must be >= 1 (batches per optimizer step), got "
                             f"{self.accumulate}")
        k = self.accumulate
        if k > 1:  # a checkpoint, eval or epoch in the middle of an accumulation would lose it
            for what, v in (("steps", self.steps), ("checkpoint_every", self.checkpoint_every),
                            ("eval_every", self.eval_every),
                            ("steps_per_epoch", self.steps_per_epoch)):
                if v is not None and v % k:
                    raise ValueError(f"{what}={v} with accumulate={k}: make it a multiple of "
                                     f"{k} (each {k} batches make one optimizer step)")
