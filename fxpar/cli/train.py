"""``fxpar-run``'s training loop: steps with a progress line, validation passes, checkpoints
(the latest, and the best by a validation metric), resume, and the closing metrics.

Kept apart from fxpar.cli.run (flags, plan, model and data set-up) so each stays short; the
validation arithmetic itself is fxpar.io.evaluate. Validation (``--val-data``) runs after step
n when n is a multiple of ``--eval-every`` and after the last step; with ``--checkpoint DIR``
an eval that improves ``--best-metric`` saves the training state to ``DIR/best`` (a
checkpoint folder of its own, keeping one version; ``fxpar-run --resume DIR/best`` and
``fxpar.io.checkpoint.export(DIR/best)`` read it), before the step's regular checkpoint.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from fxpar.core.geometry import Rect
from fxpar.io.data import Batch, BatchSource, DataError
from fxpar.io.evaluate import BEST, SEGMENT_ONLY, Validation, better, evaluate, line
from fxpar.io.metrics import Recorder, gather, table, write_metrics
from fxpar.io.program import RankProgram
from fxpar.io.samples import SampleBatches


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
                   "with labels or masks (fxpar.io.samples); used whole, in eval mode")
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


@dataclass
class Evals:
    """The evals of one run, in order, and the best so far (``--best-metric``)."""

    val: Validation
    window: Rect | None
    metric: str = "loss"
    history: list[dict[str, Any]] = field(default_factory=list)
    best: float | None = None

    def run(self, rp: RankProgram, a: argparse.Namespace, n: int) -> None:
        """Collective: validate after step n; rank 0 prints it; save DIR/best when better."""
        m = {"step": n, **evaluate(rp, self.val, self.window)}
        self.history.append(m)
        if rp.rank == 0:
            print(line(m, n, a.steps), flush=True)
        if a.checkpoint is None or not better(self.metric, m[self.metric], self.best):
            return
        from fxpar.io.checkpoint import save

        old, self.best = self.best, m[self.metric]
        best = Path(a.checkpoint) / "best"
        save(rp, best, n, extra={"eval": m, "best_metric": self.metric}, keep=1)
        if rp.rank == 0:
            was = "" if old is None else f" (was {old:.6f})"
            print(f"best: step {n} {self.metric} {self.best:.6f}{was} -> {best}", flush=True)


def train(rp: RankProgram, batches: Callable[[int], Batch], args: argparse.Namespace,
          start_step: int = 0, after_step: Callable[[int], None] | None = None) -> Recorder:
    """Steps ``start_step .. args.steps - 1`` on ``batches(step)``; rank 0 prints a progress
    line (step, loss, images/s) every ``args.log_every`` steps and at the last one.
    after_step(n): called after step n (1-based) finishes (validation, checkpoints)."""
    rec = Recorder(rp)
    every = args.log_every or max(1, args.steps // 50)
    for step in range(start_step, args.steps):
        t = time.perf_counter()
        x, y = batches(step)
        data_s = time.perf_counter() - t
        skipped = rp.guard.skipped
        loss, took = rec.step(x, y)
        n = step + 1
        dropped = rp.guard.skipped > skipped  # --nonfinite skip: every rank dropped it
        if rp.rank == 0 and (n % every == 0 or n == args.steps or n == start_step + 1
                             or dropped):
            ls = rp.loss_scale
            scale = "" if ls is None else f"  loss scale {ls.scale:g} ({ls.skipped} skipped)"
            skip = "  skipped: NaN/inf, undone on every rank" if dropped else ""
            print(f"step {n:>4}/{args.steps}  loss {loss:.6f}  {args.batch_size / took:8.2f} "
                  f"img/s  ({took:.3f} s, data {data_s:.3f} s){scale}{skip}", flush=True)
        if after_step is not None:
            after_step(n)
    return rec


def finish(job: Job, rec: Recorder, a: argparse.Namespace,
           evals: list[dict[str, Any]] | None = None) -> dict[str, Any] | None:
    """Collective: gather the metrics; rank 0 prints the table and writes --metrics (with the
    validation results under "eval" when given)."""
    metrics = gather(rec, str(a.model), a.batch_size, evals)
    if metrics is None:
        return None
    print(table(metrics))
    if job.rp.guard.skipped:
        print(f"skipped {job.rp.guard.skipped} step(s) with NaN/inf (--nonfinite skip): "
              f"their batches did not train", flush=True)
    if a.metrics is not None:
        print(f"metrics: {write_metrics(a.metrics, metrics)}")
    if rec.steps:
        n = len(rec.steps)
        over = f"this run's steps 2..{n} (its first step warms up)" if n > 1 else \
            "this run's one step (including warm-up)"
        print(f"done: median {metrics['images_per_s']:.2f} img/s over {over}", flush=True)
    return metrics


def resume(rp: RankProgram, a: argparse.Namespace) -> int | None:
    """The step to start from (--resume: the checkpoint's); None after a resume error, on every
    rank alike (the ranks agree first, so none goes on training alone)."""
    if a.resume is None:
        return 0
    from fxpar.io.checkpoint import CheckpointError, load

    step, error = None, None
    try:
        step = load(rp, a.resume)
    except CheckpointError as e:
        error = str(e)
    errors = [error] if rp.comm is None else rp.comm.allgather_object(error)
    if any(errors):
        if rp.rank == 0:
            bad = next(e for e in errors if e)
            print(f"fxpar-run: error: {bad}", file=sys.stderr)
        return None
    if rp.rank == 0:
        print(f"resumed from {a.resume} at step {step}", flush=True)
    return step


def checkpoint(rp: RankProgram, a: argparse.Namespace, n: int) -> None:
    """Collective: save --checkpoint after step n when it is due (every K steps, and the last)."""
    if a.checkpoint is None:
        return
    if n == a.steps or (a.checkpoint_every and n % a.checkpoint_every == 0):
        from fxpar.io.checkpoint import save

        save(rp, a.checkpoint, n)
        if rp.rank == 0:
            print(f"checkpoint: step {n} -> {a.checkpoint}", flush=True)


def _batches(job: Job) -> Callable[[int], Batch]:
    """Step -> this rank's batch: its input window of each image and, from a sample set with
    masks, only the part of each mask its loss reads (none on a rank without the loss)."""
    src, rp = job.source, job.rp
    if isinstance(src, SampleBatches):
        target, needed = rp.target_window(), rp.needs_targets
        return lambda step: src.batch(step, job.window, target, needed)
    return lambda step: src.batch(step, job.window)


def run(job: Job, a: argparse.Namespace, start: int) -> dict[str, Any] | None:
    """Collective: train from step ``start`` with validation and checkpoints after each step as
    due (a run with no step left validates once), then :func:`finish`."""
    rp = job.rp
    evals = None if job.val is None else \
        Evals(job.val, job.window, a.best_metric or "loss")

    def after(n: int) -> None:
        if evals is not None and (n == a.steps or (a.eval_every and n % a.eval_every == 0)):
            evals.run(rp, a, n)
        checkpoint(rp, a, n)

    rec = train(rp, _batches(job), a, start, after)
    if evals is not None and not evals.history:
        evals.run(rp, a, max(start, a.steps))
    return finish(job, rec, a, None if evals is None else evals.history)
