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

The log flags (:func:`add_log_args`): ``--log-csv FILE``, ``--log-jsonl FILE``, ``--tensorboard
DIR`` (fxpar.train.logs: every step's progress values and every eval, written by rank 0).
The data flags (fxpar.data.augment.add_data_arguments, :func:`sampled_source`): ``--sampler``
and ``--augment`` draw and augment regions of the ``--data`` images (fxpar.data.loader), every
rank reading only its window of the augmented region, ``--prefetch N`` steps ahead.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fxpar.core.geometry import Rect
from fxpar.data.data import Batch, BatchSource, DataError
from fxpar.data.samples import SampleBatches
from fxpar.program.program import RankProgram
from fxpar.train.evaluate import BEST, SEGMENT_ONLY, Validation
from fxpar.train.logs import check_tensorboard
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


def add_log_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("logs (fxpar.train.logs; rank 0 writes, a resumed run appends)")
    g.add_argument("--log-csv", type=Path, default=None, metavar="FILE",
                   help="log every step (loss, lr, grad norm, img/s, s per step, data wait) "
                   "and every eval as CSV rows")
    g.add_argument("--log-jsonl", type=Path, default=None, metavar="FILE",
                   help="the same rows as JSON lines")
    g.add_argument("--tensorboard", type=Path, default=None, metavar="DIR",
                   help="the same values as TensorBoard scalars in DIR (pip install "
                   "'fxpar[tensorboard]')")


def add_train_args(p: argparse.ArgumentParser) -> None:
    """fxpar-run's validation, recipe, log and data flags."""
    from fxpar.data.augment import add_data_arguments

    add_eval_args(p)
    add_recipe_args(p)
    add_log_args(p)
    add_data_arguments(p)
    p.set_defaults(sampler=None)  # not given: the --data regions as they are (no sampling)


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
    if getattr(a, "tensorboard", None) is not None:
        check_tensorboard(f"--tensorboard {a.tensorboard}")
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
                       clip_grad=a.clip_grad, clip_value=a.clip_value, accumulate=k,
                       log_csv=getattr(a, "log_csv", None),
                       log_jsonl=getattr(a, "log_jsonl", None),
                       tensorboard=getattr(a, "tensorboard", None))


def _batches(job: Job, steps: int | None = None) -> Callable[[int], Batch]:
    """Step -> this rank's batch: its input window of each image and, from a sample set with
    masks, only the part of each mask its loss reads (none on a rank without the loss);
    sampled, augmented regions prefetched for steps up to ``steps``."""
    src, rp = job.source, job.rp
    if isinstance(src, Sampled):
        return src.loader(rp, job.window, steps)
    if isinstance(src, SampleBatches):
        target, needed = rp.target_window(), rp.needs_targets
        return lambda step: src.batch(step, job.window, target, needed)
    return lambda step: src.batch(step, job.window)


def trainer(job: Job, a: argparse.Namespace) -> Trainer:
    """The library Trainer of a set-up job (fxpar.train.trainer; made once), validating on the
    rank's input window of the training data."""
    if job.trainer is None:
        job.trainer = Trainer(job.rp, config(a), _batches(job, a.steps), job.val, job.window)
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
    closing metrics (Trainer.fit); the loader's threads are joined after."""
    t = trainer(job, a)
    try:
        return t.fit(start)
    finally:
        close = getattr(t.batches, "close", None)
        if close is not None:
            close()


def train(rp: RankProgram, batches: Callable[[int], Batch], args: argparse.Namespace,
          start_step: int = 0, after_step: Callable[[int], None] | None = None) -> Recorder:
    """fxpar-run's steps on its flags (``Trainer.train``; kept for scripts that call it)."""
    return Trainer(rp, config(args), batches).train(start_step, after_step)


def finish(job: Job, rec: Recorder, a: argparse.Namespace,
           evals: list[dict[str, Any]] | None = None) -> dict[str, Any] | None:
    """Collective: the closing metrics of a run (``Trainer.finish``; kept for scripts)."""
    return Trainer(job.rp, config(a), _batches(job)).finish(rec, evals)


# -- the data flags: --sampler, --augment on --data (fxpar.data.loader) ------------------------
def sampled(a: argparse.Namespace) -> bool:
    """Whether the flags ask to draw or augment regions (``--sampler`` or ``--augment``)."""
    return getattr(a, "sampler", None) is not None or \
        getattr(a, "augment", "none").strip().lower() not in ("", "none")


def no_sampling(a: argparse.Namespace) -> None:
    """Synthetic data: the data flags have nothing to draw from (raises DataError)."""
    if sampled(a) or getattr(a, "pos_neg", "1:1") != "1:1":
        flags = "--sampler" if a.sampler is not None else "--augment" if sampled(a) else \
            "--pos-neg"
        raise DataError(f"{flags} draws and augments regions of the --data images, but the "
                        f"data is synthetic (one fixed batch): give --data (a class folder or "
                        f"a CSV of images) or drop {flags}")


class _Window:
    """One slide's image or label map at one level, read by window through the sample
    source's reader cache (fxpar.data.samples), which a lock guards across loader threads."""

    def __init__(self, readers: Any, path: Path, level: int, mask: bool,
                 lock: threading.Lock) -> None:
        self.readers, self.path, self.level, self.mask, self.lock = \
            readers, path, level, mask, lock
        with lock:
            self.shape = tuple(readers(path, level, mask).shape)

    @property
    def size(self) -> tuple[int, ...]:
        return self.shape[1:]

    def read(self, window: Rect) -> Any:
        with self.lock:
            reader = self.readers(self.path, self.level, self.mask)
        return reader.read(window)


def _coarsest(readers: Any, path: Path) -> np.ndarray:
    """A mask's coarsest pyramid level, whole (a sampler's map: any resolution)."""
    levels = readers(path, 0, True).levels
    r = readers(path, len(levels) - 1, True)
    return np.asarray(r.read(Rect.whole(r.size))[0])


def _foreground(data: Any, readers: Any) -> list[np.ndarray]:
    """--sampler foreground: each CSV row's ``foreground`` column (a weight map, any
    resolution). Raises DataError when the data has none."""
    path = Path(data.source)
    why = "--sampler foreground weights each image's region centres by a tissue mask: add " \
          "a 'foreground' column to the --data CSV (per row, a mask file at any resolution, " \
          "values are weights >= 0)"
    if path.suffix.lower() != ".csv":
        raise DataError(f"{why}; --data {path} is a folder: list its images in a CSV")
    with open(path, newline="", encoding="utf-8-sig") as f:
        rows = list(csv.reader(f))
    header = [c.strip().lower() for c in rows[0]]
    if "foreground" not in header:
        raise DataError(f"{why}; {path} has the columns {header}")
    col, by_line = header.index("foreground"), dict(enumerate(rows, start=1))
    masks = []
    for s in data.samples:
        cell = by_line[s.line][col].strip() if col < len(by_line[s.line]) else ""
        if not cell:
            raise DataError(f"{path}:{s.line}: column 'foreground' is empty: give the "
                            f"image's tissue mask")
        masks.append(_coarsest(readers, path.parent / cell).astype(np.float64))
    return masks


def sampled_source(a: argparse.Namespace, src: Any) -> Any:
    """``src`` (the --data samples) drawn by ``--sampler`` and augmented by ``--augment``
    (:class:`Sampled`), or ``src`` itself without those flags (or synthetic data, with none
    of them). Raises DataError for a combination that cannot work."""
    if not isinstance(src, SampleBatches):
        no_sampling(a)
        return src
    if not sampled(a):
        return src
    from fxpar.data.augment import data_options
    from fxpar.data.loader import AugmentedBatches, Slide
    from fxpar.data.sampling import sampler_of

    opts = data_options(argparse.Namespace(**{**vars(a), "sampler": a.sampler or "uniform"}))
    if a.no_shuffle:
        raise DataError("--no-shuffle keeps the file order, but --sampler / --augment visit "
                        "the images in a seeded order each epoch: drop --no-shuffle")
    data, readers, lock = src.data, src.readers, threading.Lock()
    fixed = [s for s in data.samples if any(s.origin)]
    if fixed:
        raise DataError(f"{data.source}:{fixed[0].line}: the row fixes its region (origin "
                        f"{fixed[0].origin}), but --sampler draws the regions: drop the "
                        f"y, x columns (or --sampler / --augment)")
    segment = data.task == "segment"
    if opts.sampler == "balanced" and not segment:
        raise DataError("--sampler balanced centres regions on positive / negative pixels "
                        "of each image's mask: give --data a CSV of image,mask rows")
    masks = _foreground(data, readers) if opts.sampler == "foreground" else None
    labels = [_coarsest(readers, s.mask) for s in data.samples] \
        if opts.sampler == "balanced" else None
    slides = [Slide(_Window(readers, s.image, s.level, False, lock),
                    _Window(readers, s.mask, s.mask_level, True, lock) if segment else None,
                    s.label or 0) for s in data.samples]
    sampler = sampler_of(opts.sampler, masks=masks, labels=labels, pos=opts.pos, neg=opts.neg)
    if a.ignore_index is not None and segment:
        label_pad = a.ignore_index  # what a region past the image's edge is labelled
    else:
        label_pad = 0
    batches = AugmentedBatches(slides, sampler, opts.chain, data.size, src.batch_size,
                               seed=a.seed, steps_per_epoch=src.steps_per_epoch,
                               dtype=src.dtype, label_pad=label_pad)
    return Sampled(batches, opts, data)


@dataclass
class Sampled:
    """Regions of the --data images drawn and augmented (fxpar.data.loader.AugmentedBatches),
    each rank filling only its windows; loaded ``options.prefetch`` steps ahead."""

    source: Any
    """The fxpar.data.loader.AugmentedBatches."""
    options: Any
    """The fxpar.data.augment.DataOptions of the flags."""
    data: Any
    """The fxpar.data.samples.SampleSet the slides come from."""

    @property
    def task(self) -> str:
        return self.data.task

    @property
    def steps_per_epoch(self) -> int:
        return self.source.steps_per_epoch

    @property
    def dtype(self) -> torch.dtype:
        return self.source.dtype

    @dtype.setter
    def dtype(self, value: torch.dtype) -> None:
        self.source.dtype = value

    def describe(self) -> str:
        o, d = self.options, self.data
        what = f"{len(d.classes)} classes" if d.task == "classify" else "masks"
        ratio = f" {o.pos:g}:{o.neg:g}" if o.sampler == "balanced" else ""
        ahead = f"prefetch {o.prefetch}" if o.prefetch else "no prefetch"
        return (f"data: {d.source} ({len(d)} images, {what}), {o.sampler}{ratio} regions of "
                f"{'x'.join(map(str, d.size))}, augment {o.chain}, {ahead}, "
                f"{self.steps_per_epoch} steps per epoch")

    def loader(self, rp: RankProgram, window: Rect | None, steps: int | None
               ) -> Callable[[int], Batch]:
        """Step -> this rank's batch: only its data-parallel replica's rows, only its input
        window of each augmented image and its target window of each label map."""
        src, plan = self.source, rp.plan
        if src.replicas != plan.data_parallel:  # each replica's samples keyed by its index
            self.source = src = dataclasses.replace(src, replicas=plan.data_parallel)
        replica = rp.program.rank_map.dp_index(rp.rank) if plan.data_parallel > 1 else None
        target, needed = rp.target_window(), rp.needs_targets

        def load(step: int) -> Batch:
            return src.batch(step, window, target, needed, replica)
        return Prefetched(load, steps, self.options.prefetch, self.options.workers)


class Prefetched:
    """``load(step)`` prefetched ``depth`` steps ahead (fxpar.data.loader.Prefetcher) for
    steps called in order up to ``steps``; a step out of order restarts the queue there."""

    def __init__(self, load: Callable[[int], Batch], steps: int | None, depth: int,
                 workers: int) -> None:
        self.load, self.steps, self.depth, self.workers = load, steps, depth, workers
        self._feed: Any = None
        self._next: int | None = None

    def __call__(self, step: int) -> Batch:
        if not self.depth or self.steps is None or step >= self.steps:
            return self.load(step)
        if self._feed is None or step != self._next:
            from fxpar.data.loader import Prefetcher

            self.close()
            self._feed = Prefetcher(self.load, range(step, self.steps), self.depth,
                                    self.workers)
        self._next = step + 1
        return next(self._feed)

    def close(self) -> None:
        if self._feed is not None:
            self._feed.close()
            self._feed = None
