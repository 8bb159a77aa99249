"""Validation: one pass of a compiled program over a whole validation set, in eval mode, with
metrics every rank agrees on exactly (``fxpar-run --val-data``).

Why sums and not means: the output of a batch exists only on the last stage's ranks, and with
GEMS copies or data-parallel replicas several ranks hold the same rows (``RankProgram.forward``
merges every copy's chunks on each of them). Averaging per-rank means would weigh ranks, not
samples, and count shared rows several times. So exactly one rank contributes each output
chunk -- the rank holding tile 0 of the last stage of the (replica, copy) that computed it
(:func:`contributed_rows`) -- with float64 *sums* over its rows: the loss summed over the
elements the loss averages over (samples; pixels for a segmentation loss, as
``F.cross_entropy`` averages: the program's loss_fn is taken to be such a mean, its value
times the element count being the sum), the correct predictions, the sample count and, for
segmentation, per class the intersection, predicted and target pixel counts. Every other rank
adds zeros. One allreduce (sum) of that vector at the end of the pass gives every rank the
same totals, from which :func:`summarize` derives the metrics: the same numbers one process
computes on the whole set (counts exactly, the loss up to summation order).

The set is used whole: batches are the compiled batch size B (a compiled program runs only
that), the last partial one padded with repeated samples (the set's first ones) whose rows are
masked out of the sums. ``limit`` caps the pass at its first K batches.

Vector layout (:data:`HEAD`, then for segmentation K intersections, K predicted counts, K
target counts)::

    [loss_sum, loss_elements, correct, samples, inter_0..K-1, pred_0..K-1, target_0..K-1]

Dice_k = 2 inter_k / (pred_k + target_k) and IoU_k = inter_k / (pred_k + target_k - inter_k)
are undefined (None) for a class absent from both prediction and target; the mean Dice / IoU
is over the classes where they are defined.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from fxpar.core.geometry import Rect
from fxpar.data.data import BatchSource, DataError, FolderBatches, ImageFolder

if TYPE_CHECKING:
    from fxpar.program.program import Program, RankProgram
    from fxpar.runtime.loop import LossFn

TASKS = ("classify", "segment")
HEAD = ("loss_sum", "loss_elements", "correct", "samples")
BEST = {"loss": "min", "accuracy": "max", "dice": "max", "iou": "max"}
"""The metrics ``--best-metric`` may name, and which way is better."""
SEGMENT_ONLY = ("dice", "iou")


def width(task: str, classes: int) -> int:
    """Length of the sums vector of ``task`` with ``classes`` classes."""
    return len(HEAD) + (3 * classes if task == "segment" else 0)


# -- sums of one set of rows --------------------------------------------------------------------
def sums(out: torch.Tensor, y: torch.Tensor, loss_fn: LossFn, task: str,
         classes: int) -> torch.Tensor:
    """float64 sums (see the module doc) over every row of ``out`` (logits (n, K) for
    classification, (n, K, *spatial) for segmentation) against ``y`` (labels (n,) or masks
    (n, *spatial), int64). Raises DataError for targets that do not fit the output."""
    v = torch.zeros(width(task, classes), dtype=torch.float64)
    n = int(out.shape[0])
    if n == 0:
        return v
    want = (n,) if task == "classify" else (n, *out.shape[2:])
    if tuple(y.shape) != want or out.shape[1] != classes:
        what = "labels" if task == "classify" else "masks"
        raise DataError(f"validation {what} of shape {tuple(y.shape)} do not fit the model "
                        f"output {tuple(out.shape)} ({classes} classes): expected {what} of "
                        f"shape {want}")
    y = y.to(out.device, torch.int64)
    low, high = int(y.min()), int(y.max())
    if low < 0 or high >= classes:
        bad = low if low < 0 else high
        raise DataError(f"validation targets hold class {bad} but the model has {classes} "
                        f"classes (0..{classes - 1}): raise --num-classes or fix the labels")
    logits = out.detach().to(torch.float64)
    elements = y.numel()
    v[0] = float(loss_fn(logits, y)) * elements  # the loss is a mean over y's elements
    pred = logits.argmax(1)
    hit = pred == y
    v[1], v[2], v[3] = elements, int(hit.sum()), n
    if task == "segment":
        k = len(HEAD)
        v[k:k + classes] = torch.bincount(y[hit], minlength=classes).double().cpu()
        v[k + classes:k + 2 * classes] = \
            torch.bincount(pred.flatten(), minlength=classes).double().cpu()
        v[k + 2 * classes:] = torch.bincount(y.flatten(), minlength=classes).double().cpu()
    return v


def summarize(v: torch.Tensor, task: str, classes: int) -> dict[str, Any]:
    """The metrics of a sums vector: loss (mean over the loss's elements), samples, and
    accuracy with correct (classification) or pixel accuracy with pixels, dice, iou and
    per_class (segmentation)."""
    loss_sum, elements, correct, samples = (float(t) for t in v[:len(HEAD)])
    out: dict[str, Any] = {"loss": loss_sum / elements if elements else math.nan,
                           "samples": int(samples),
                           "accuracy": correct / elements if elements else math.nan}
    if task == "classify":
        out["correct"] = int(correct)
        return out
    k = len(HEAD)
    inter, pred, target = (v[k + i * classes:k + (i + 1) * classes].tolist() for i in range(3))
    per_class = []
    for c in range(classes):
        both = pred[c] + target[c]
        per_class.append({"class": c, "dice": 2 * inter[c] / both if both else None,
                          "iou": inter[c] / (both - inter[c]) if both else None,
                          "pixels": int(target[c]), "predicted": int(pred[c])})
    dice = [p["dice"] for p in per_class if p["dice"] is not None]
    iou = [p["iou"] for p in per_class if p["iou"] is not None]
    out.update(pixels=int(elements), correct=int(correct),
               dice=sum(dice) / len(dice) if dice else math.nan,
               iou=sum(iou) / len(iou) if iou else math.nan, per_class=per_class)
    return out


def contributed_rows(program: Program, rank: int, batch: int) -> list[tuple[int, int]]:
    """The rows of a global batch whose output ``rank`` contributes to the sums: the rows of
    each (replica, copy) whose last stage's tile 0 it holds. Every row has exactly one
    contributor (the batch splits into replicas x copies contiguous equal parts, as the
    chunks of fxpar.core.roles do)."""
    plan, rank_map = program.plan, program.rank_map
    groups = plan.data_parallel * plan.copies
    per, last = batch // groups, plan.stages - 1
    return [(g * per, (g + 1) * per) for g in range(groups)
            if rank_map.rank_of(g // plan.copies, g % plan.copies, last, 0) == rank]


# -- the validation set -------------------------------------------------------------------------
@dataclass
class Validation:
    """A validation set as the eval pass reads it: ``source`` has batches of one sample in
    file order (its step i is sample i), so the pass can build batches of the compiled size
    with a padded last one from any BatchSource."""

    source: BatchSource
    samples: int
    task: str
    classes: int
    shape: tuple[int, ...]
    """A batch: (B, C, *spatial) with the compiled batch size B."""
    dtype: torch.dtype
    limit: int | None = None
    """At most this many batches per pass (``--val-batches``); None: the whole set."""
    name: str = ""

    @property
    def batches(self) -> int:
        whole = -(-self.samples // self.shape[0])
        return whole if self.limit is None else min(whole, self.limit)

    @property
    def used(self) -> int:
        """Samples one pass evaluates."""
        return min(self.samples, self.batches * self.shape[0])

    def describe(self) -> str:
        capped = "" if self.used == self.samples else f", first {self.used} per pass"
        return (f"validation: {self.name} ({self.samples} samples{capped}, {self.task}, "
                f"{self.batches} batches of {self.shape[0]})")


def open_validation(path: str | Path, shape: tuple[int, ...], dtype: torch.dtype,
                    classes: int, seed: int = 0, level: int = 0,
                    limit: int | None = None) -> Validation:
    """The validation set at ``path`` (a class folder, or a CSV of fxpar.data.samples) for
    batches of ``shape`` (B, C, *spatial). Reads only headers; raises DataError saying what
    to change (another image size, too many classes, an empty set)."""
    one = (1, *shape[1:])
    try:
        from fxpar.data import samples
    except ImportError:  # before fxpar.data.samples: class folders only
        samples = None  # type: ignore[assignment]
    try:
        if samples is not None:
            source = samples.open_source(path, one, dtype, seed, shuffle=False, level=level)
            task = samples.task(source)
        else:
            data = ImageFolder.scan(path, tuple(shape[2:]), shape[1])
            source, task = FolderBatches(data, 1, dtype, seed, shuffle=False), "classify"
    except DataError as e:
        text = str(e)
        raise DataError(text.replace("--data", "--val-data", 1) if text.startswith("--data")
                        else f"--val-data {path}: {text}") from None
    found = getattr(getattr(source, "data", None), "classes", None)
    if found is not None and len(found) > classes:
        raise DataError(f"--val-data {path} has {len(found)} classes but the model has "
                        f"{classes}: raise --num-classes")
    n = int(source.steps_per_epoch)  # type: ignore[attr-defined]
    if n < 1:
        raise DataError(f"--val-data {path} holds no samples")
    if limit is not None and limit < 1:
        raise ValueError("--val-batches must be >= 1")
    return Validation(source, n, task, classes, tuple(shape), dtype, limit, str(path))


def output_shape(program: Program) -> tuple[int, ...] | None:
    """The model output's shape for one micro-batch (``Program.output_shape``)."""
    return program.output_shape


def check_output(val: Validation, out: tuple[int, ...] | None) -> None:
    """Raise DataError when the model's output (shape ``out``, when known) cannot be scored
    against the set's targets: logits (N, K) for labels, (N, K, *spatial) for masks."""
    if out is None:
        return
    spatial = tuple(val.shape[2:])
    if val.task == "classify" and len(out) != 2:
        raise DataError(f"--val-data {val.name} has one label per image but the model's "
                        f"output is {'x'.join(map(str, out))} per micro-batch: give masks "
                        f"(a CSV with a mask column) or a classifier")
    if val.task == "segment" and tuple(out[2:]) != spatial:
        raise DataError(f"--val-data {val.name} has masks of {'x'.join(map(str, spatial))} "
                        f"but the model's output is {'x'.join(map(str, out))} per "
                        f"micro-batch: segmentation needs logits (N, K, "
                        f"{', '.join(map(str, spatial))})")


def read_batch(val: Validation, b: int, window: Rect | None, need_x: bool, need_y: bool
               ) -> tuple[torch.Tensor | None, torch.Tensor | None, int]:
    """Batch ``b`` of a pass: (x with only ``window`` filled, or None; y, or None; how many
    leading rows are real samples, the rest being padding). Reads only what is needed."""
    size = val.shape[0]
    first = b * size
    valid = min(size, val.used - first)
    index = [(first + k) % val.used for k in range(size)]
    x = torch.empty(val.shape, dtype=val.dtype) if need_x and window is not None else None
    ys: list[torch.Tensor] = []
    if x is None and not need_y:
        return None, None, valid
    where = (slice(None), *(slice(a, z) for a, z in window.dims)) if window is not None else ()
    for k, i in enumerate(index):
        xi, yi = val.source.batch(i, window if x is not None else None)
        if x is not None:
            x[(k, *where)] = xi[(0, *where)]
        ys.append(yi)
    return x, torch.cat(ys) if need_y else None, valid


def evaluate(rp: RankProgram, val: Validation, window: Rect | None) -> dict[str, Any]:
    """Collective: one pass over ``val`` in eval mode (back to training mode after), every
    rank giving only its input ``window`` (None: a rank that never reads the input); the
    metrics (:func:`summarize`, plus ``seconds``), the same on every rank."""
    t0 = time.perf_counter()
    size = val.shape[0]
    mine = contributed_rows(rp.program, rp.rank, size)
    total = torch.zeros(width(val.task, val.classes), dtype=torch.float64)
    rp.eval()
    try:
        for b in range(val.batches):
            x, y, valid = read_batch(val, b, window, window is not None, bool(mine))
            out = rp.forward(x)
            for lo, hi in mine:
                if out is None or y is None:
                    raise RuntimeError(f"rank {rp.rank} holds the last stage but got no "
                                       f"output from forward")
                hi = min(hi, valid)
                if hi > lo:
                    total += sums(out[lo:hi], y[lo:hi], rp.program.loss_fn, val.task,
                                  val.classes)
    finally:
        rp.train()
    if rp.comm is not None and rp.comm.size > 1:
        rp.comm.allreduce(total)
    return {**summarize(total, val.task, val.classes),
            "seconds": round(time.perf_counter() - t0, 6)}


def line(m: dict[str, Any], step: int, steps: int) -> str:
    """The progress line of one eval (rank 0 prints it next to the training steps)."""
    head = f"eval  step {step:>4}/{steps}  loss {m['loss']:.6f}"
    if "dice" not in m:
        return (f"{head}  accuracy {m['accuracy']:.4f} ({m['correct']}/{m['samples']})  "
                f"({m['seconds']:.2f} s)")
    return (f"{head}  dice {m['dice']:.4f}  iou {m['iou']:.4f}  pixel accuracy "
            f"{m['accuracy']:.4f} ({m['samples']} images)  ({m['seconds']:.2f} s)")


def better(metric: str, new: float, old: float | None) -> bool:
    """Whether ``new`` improves on ``old`` (None: nothing yet) for ``metric`` (NaN never)."""
    if math.isnan(new):
        return False
    if old is None:
        return True
    return new < old if BEST[metric] == "min" else new > old
