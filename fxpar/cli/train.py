"""``fxpar-run``'s training: its validation flags, and its job (program, data, validation set)
handed to the library's Trainer (fxpar.train.trainer), which holds the loop itself -- steps
with a progress line, validation passes, checkpoints, resume and the closing metrics.

Kept apart from fxpar.cli.run (flags, plan, model and data set-up) so each stays short.
Validation (``--val-data``) runs after step n when n is a multiple of ``--eval-every`` and after
the last step; with ``--checkpoint DIR`` an eval that improves ``--best-metric`` saves the
training state to ``DIR/best`` (a checkpoint folder of its own, keeping one version;
``fxpar-run --resume DIR/best`` and ``fxpar.program.checkpoint.export(DIR/best)`` read it), before
the step's regular checkpoint.
"""

from __future__ import annotations

import argparse
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
from fxpar.train.trainer import TrainConfig, Trainer


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


def check_eval_args(a: argparse.Namespace) -> None:
    """The validation flags' own consistency (before anything is built); raises ValueError."""
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
    """fxpar-run's training flags as the library's TrainConfig."""
    return TrainConfig(steps=a.steps, log_every=a.log_every, eval_every=a.eval_every,
                       best_metric=a.best_metric or "loss", checkpoint=a.checkpoint,
                       checkpoint_every=a.checkpoint_every, resume=a.resume,
                       metrics=a.metrics, nonfinite=a.nonfinite, name=str(a.model))


def _batches(job: Job) -> Callable[[int], Batch]:
    """Step -> this rank's batch: its input window of each image and, from a sample set with
    masks, only the part of each mask its loss reads (none on a rank without the loss)."""
    src, rp = job.source, job.rp
    if isinstance(src, SampleBatches):
        target, needed = rp.target_window(), rp.needs_targets
        return lambda step: src.batch(step, job.window, target, needed)
    return lambda step: src.batch(step, job.window)


def trainer(job: Job, a: argparse.Namespace) -> Trainer:
    """The library Trainer for a set-up job (fxpar.train.trainer), validating on the rank's
    input window of the training data."""
    return Trainer(job.rp, config(a), _batches(job), job.val, job.window)


def resume(job: Job, a: argparse.Namespace) -> int | None:
    """The step to start from (Trainer.resume); None after a resume error, on every rank."""
    return trainer(job, a).resume()


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
