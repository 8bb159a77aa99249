"""``fxpar-run``'s training: its validation flags, and its job (program, data, validation set)
handed to the library's Trainer (fxpar.train.trainer), which holds the loop itself -- steps
with a progress line, validation passes, checkpoints, resume and the closing metrics.

Kept apart from fxpar.cli.run (flags, plan, model and data set-up) so each stays short.
Validation (``--val-data``) runs after step n when n is a multiple of ``--eval-every`` and after
the last step; with ``--checkpoint DIR`` an eval that improves ``--best-metric`` saves the
training state to ``DIR/best`` (a checkpoint folder of its own, keeping one version;
``fxpar-run --resume DIR/best`` and ``fxpar.program.checkpoint.export(DIR/best)`` read it), before
the step's regular checkpoint.

The recipe flags (:func:`add_recipe_args`): the optimizer (``--optimizer sgd|adamw``, ``--lr``,
``--momentum``, ``--weight-decay``, ``--nesterov``; SGD with momentum 0.9 by default), the LR
schedule (``--lr-schedule``, ``--warmup``: fxpar.train.schedules, over the run's optimizer
steps), ``--ema DECAY`` (fxpar.train.ema; ``--ema-eval`` validates with it), ``--clip-grad
NORM`` / ``--clip-value V`` and ``--accumulate K`` (K batches per optimizer step).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from fxpar.core.geometry import Rect
from fxpar.data.data import Batch, BatchSource, DataError
from fxpar.data.samples import SampleBatches
from fxpar.program.program import RankProgram
from fxpar.train.evaluate import BEST, SEGMENT_ONLY, Validation
from fxpar.train.metrics import Recorder
from fxpar.train.schedules import NAMES, by_name
from fxpar.train.trainer import TrainConfig, Trainer

OPTIMIZERS = ("sgd", "adamw")


@dataclass
class Job:
    """Everything set up and checked before training."""

    rp: RankProgram
    source: BatchSource
    window: Rect | None
    shape: tuple[int, ...]
    """The global batch: (N, C, H, W), or (N, C, D, H, W) for volumes."""
    dtype: torch.dtype
    compile_s: float
    how: str = "compiled"
    val: Validation | None = None
    """The validation set (``--val-data``), batches of the compiled batch size."""
    trainer: Trainer | None = None
    """The one Trainer of the run (it owns the LR scheduler: resume and training share it)."""


def add_eval_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("validation")
    g.add_argument("--val-data", type=Path, default=None, metavar="PATH",
                   help="validation set: a class folder as --data takes, or a CSV of images "
                   "with labels or masks (fxpar.data.samples); used whole, in eval mode")
    g.add_argument("--eval-every", type=int, default=None, metavar="N",
                   help="with --val-data: validate every N steps (default: after the last "
                   "step only)")
    g.add_argument("--val-batches", type=int, default=None, metavar="K",
                   help="with --val-data: validate on the first K batches only")
    g.add_argument("--best-metric", choices=tuple(BEST), default=None,
                   help="with --val-data and --checkpoint DIR: keep the best model by this "
                   "metric in DIR/best (default loss; dice and iou for masks)")


def add_recipe_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("optimizer and recipe")
    g.add_argument("--lr", type=float, default=0.01,
                   help="learning rate (the peak of --lr-schedule; default 0.01)")
    g.add_argument("--optimizer", choices=OPTIMIZERS, default="sgd",
                   help="torch.optim.SGD (default) or AdamW, at --lr")
    g.add_argument("--momentum", type=float, default=None,
                   help="SGD's momentum (default 0.9)")
    g.add_argument("--nesterov", action="store_true", help="SGD with Nesterov momentum")
    g.add_argument("--weight-decay", type=float, default=None, metavar="WD",
                   help="weight decay (default: 0 for sgd, 0.01 for adamw, torch's)")
    g.add_argument("--lr-schedule", choices=NAMES, default="constant",
                   help="LR over the run's optimizer steps (fxpar.train.schedules): constant "
                   "(default), cosine (to 0), poly (nnU-Net's, power 0.9), onecycle (peak "
                   "--lr)")
    g.add_argument("--warmup", type=int, default=0, metavar="N",
                   help="optimizer steps of linear warm-up to --lr (onecycle: its rising "
                   "phase)")
    g.add_argument("--ema", type=float, default=None, metavar="DECAY",
                   help="keep a moving average of the weights (fxpar.train.ema; e.g. 0.999), "
                   "saved in checkpoints")
    g.add_argument("--ema-eval", action="store_true",
                   help="with --ema and --val-data: validate with the averaged weights")
    g.add_argument("--clip-grad", type=float, default=None, metavar="NORM",
                   help="clip the gradients to this global norm before each optimizer step")
    g.add_argument("--clip-value", type=float, default=None, metavar="V",
                   help="clamp every gradient to [-V, V] before each optimizer step")
    g.add_argument("--accumulate", type=int, default=1, metavar="K",
                   help="K batches per optimizer step (gradient accumulation; default 1)")


def check_recipe_args(a: argparse.Namespace) -> None:
    """The optimizer flags against --optimizer; the rest through TrainConfig's own checks
    (the schedule's length against --steps when given). Raises ValueError."""
    if a.optimizer != "sgd":
        given = [f for f, v in (("--momentum", a.momentum), ("--nesterov", a.nesterov or None))
                 if v is not None]
        if given:
            raise ValueError(f"{', '.join(given)}: SGD's, not {a.optimizer}'s (AdamW has betas "
                             f"(0.9, 0.999)): drop it or use --optimizer sgd")
    if a.nesterov and a.momentum == 0:
        raise ValueError("--nesterov needs momentum: drop --momentum 0")
    for flag, v in (("--momentum", a.momentum), ("--weight-decay", a.weight_decay)):
        if v is not None and v < 0:
            raise ValueError(f"{flag} must be >= 0, got {v}")
    if a.ema_eval and a.val_data is None:
        raise ValueError("--ema-eval validates with the averaged weights: give --val-data")
    if a.warmup < 0:
        raise ValueError(f"--warmup must be >= 0, got {a.warmup}")
    if a.steps is not None:
        config(a)
    else:  # --epochs (or the default) fixes the steps later: the rest now, the schedule then
        config(argparse.Namespace(**{**vars(a), "steps": max(a.accumulate, 1),
                                     "lr_schedule": "constant", "warmup": 0}))


def optimizer(a: argparse.Namespace) -> Callable[[Any], torch.optim.Optimizer]:
    """The optimizer factory of the flags (SGD with momentum 0.9 by default)."""
    lr, wd = a.lr, a.weight_decay
    if a.optimizer == "adamw":
        return lambda ps: torch.optim.AdamW(ps, lr=lr, weight_decay=0.01 if wd is None else wd)
    momentum = 0.9 if a.momentum is None else a.momentum
    return lambda ps: torch.optim.SGD(ps, lr=lr, momentum=momentum, nesterov=a.nesterov,
                                      weight_decay=0.0 if wd is None else wd)


def check_eval_args(a: argparse.Namespace) -> None:
    """The validation and recipe flags' own consistency (before anything is built); raises
    ValueError."""
    _check_val_args(a)
    check_recipe_args(a)


def _check_val_args(a: argparse.Namespace) -> None:
    if a.val_data is None:
        given = [flag for flag, v in (("--eval-every", a.eval_every),
                                      ("--val-batches", a.val_batches),
                                      ("--best-metric", a.best_metric)) if v is not None]
        if given:
            raise ValueError(f"{', '.join(given)} need(s) --val-data PATH (a class folder or "
                             f"a CSV of validation samples)")
        return
    for flag, v in (("--eval-every", a.eval_every), ("--val-batches", a.val_batches)):
        if v is not None and v < 1:
            raise ValueError(f"{flag} must be >= 1")
    if a.best_metric is not None and a.checkpoint is None:
        raise ValueError("--best-metric keeps the best model in DIR/best: give --checkpoint "
                         "DIR")


def check_task(a: argparse.Namespace, val: Validation) -> None:
    """--best-metric against the set's task (known once its source is open)."""
    if val.task == "classify" and a.best_metric in SEGMENT_ONLY:
        raise DataError(f"--best-metric {a.best_metric} needs masks, but --val-data "
                        f"{a.val_data} has one class label per image: use loss or accuracy")


def config(a: argparse.Namespace) -> TrainConfig:
    """fxpar-run's training flags as the library's TrainConfig (raises ValueError)."""
    k = a.accumulate
    if k >= 1 and a.steps % k:
        raise ValueError(f"--steps {a.steps} with --accumulate {k}: make the steps (batches) "
                         f"a multiple of {k}")
    schedule = by_name(a.lr_schedule, max(a.steps // max(k, 1), 1), a.warmup)
    return TrainConfig(steps=a.steps, log_every=a.log_every, eval_every=a.eval_every,
                       best_metric=a.best_metric or "loss", checkpoint=a.checkpoint,
                       checkpoint_every=a.checkpoint_every, resume=a.resume,
                       metrics=a.metrics, nonfinite=a.nonfinite, name=str(a.model),
                       lr_schedule=schedule, ema=a.ema, ema_eval=a.ema_eval,
                       clip_grad=a.clip_grad, clip_value=a.clip_value, accumulate=k)


def _batches(job: Job) -> Callable[[int], Batch]:
    """Step -> this rank's batch: its input window of each image and, from a sample set with
    masks, only the part of each mask its loss reads (none on a rank without the loss)."""
    src, rp = job.source, job.rp
    if isinstance(src, SampleBatches):
        target, needed = rp.target_window(), rp.needs_targets
        return lambda step: src.batch(step, job.window, target, needed)
    return lambda step: src.batch(step, job.window)


def trainer(job: Job, a: argparse.Namespace) -> Trainer:
    """The library Trainer of a set-up job (fxpar.train.trainer; made once), validating on the
    rank's input window of the training data."""
    if job.trainer is None:
        job.trainer = Trainer(job.rp, config(a), _batches(job), job.val, job.window)
    return job.trainer


def resume(job: Job, a: argparse.Namespace) -> int | None:
    """The step to start from (Trainer.resume); None after a resume error or a recipe that
    does not fit the run (known once the steps are: --epochs), on every rank alike."""
    try:
        t = trainer(job, a)
    except (ValueError, TypeError) as e:  # the same flags on every rank: every rank stops
        if job.rp.rank == 0:
            print(f"fxpar-run: error: {e}", file=sys.stderr, flush=True)
        return None
    return t.resume()


def run(job: Job, a: argparse.Namespace, start: int) -> dict[str, Any] | None:
    """Collective: train from step ``start`` with validation and checkpoints, then the
    closing metrics (Trainer.fit)."""
    return trainer(job, a).fit(start)


def train(rp: RankProgram, batches: Callable[[int], Batch], args: argparse.Namespace,
          start_step: int = 0, after_step: Callable[[int], None] | None = None) -> Recorder:
    """fxpar-run's steps on its flags (``Trainer.train``; kept for scripts that call it)."""
    return Trainer(rp, config(args), batches).train(start_step, after_step)


def finish(job: Job, rec: Recorder, a: argparse.Namespace,
           evals: list[dict[str, Any]] | None = None) -> dict[str, Any] | None:
    """Collective: the closing metrics of a run (``Trainer.finish``; kept for scripts)."""
    return Trainer(job.rp, config(a), _batches(job)).finish(rec, evals)
