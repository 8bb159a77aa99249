"""Exact inference on images larger than memory: region by region, each region spatially
parallel (``fxpar.predict``, ``fxpar-predict``).

The recipe::

    whole graph (meta, the image's size) --reach--> step, scale, margins    (receptive.py)
        --regions--> regions, crops, crop shapes                           (fxpar.data.regions)
        --compile--> one program per crop shape, in eval mode
        --loop--> per batch of regions: each rank reads its window of each crop (plus halo)
                  from the image, forward, the output rank keeps each region's middle and
                  writes it (fxpar.data.writers), progress on stderr; a reader thread
                  prepares the next batch and a writer thread writes the last one while a
                  batch computes (predict_pipeline.py)

Every rank reads only its tile of each crop plus the halo its first convolutions need
(``RankProgram.input_window``), never the whole image; the crops overlap by the model's
margins, which cost recomputation (reported as the overlap factor) but make the result equal
the whole-image output, with no seams. Regions of one crop shape run ``batch`` at a time (the
batch dimension: data-parallel plans give each replica its own regions).
"""

from __future__ import annotations

import copy
import functools
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from fxpar.comm import failfast
from fxpar.comm.mpi import Comm
from fxpar.compiler.outputs import check_single
from fxpar.compiler.predict_pipeline import Drain, Prefetch
from fxpar.compiler.receptive import (
    Reach,
    ReachError,
    check_same_interpolation,
    interp_ratios,
    needs,
    output_channels,
    output_extent,
    reach_model,
)
from fxpar.core.geometry import Rect
from fxpar.core.options import flag
from fxpar.core.plan import Plan
from fxpar.data.errors import DataError
from fxpar.data.images import to_tensor
from fxpar.data.regions import Region, RegionGrid, batches, region_grid
from fxpar.data.writers import PredictionStore
from fxpar.frontend.trace import trace
from fxpar.program.program import Program

OUTPUTS = ("argmax", "softmax", "sigmoid", "logits")


class Image(Protocol):
    """What predict reads: (C, *spatial) and any window of it (fxpar.data.images readers).
    ``read`` is called from predict's reader thread (one call at a time)."""

    shape: tuple[int, ...]

    def read(self, window: Rect) -> np.ndarray: ...


@dataclass
class ArrayImage:
    """An image already in memory, (C, H, W) or (C, D, H, W), as an :class:`Image`."""

    array: np.ndarray | torch.Tensor
    reads: list[Rect] = field(default_factory=list)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.array.shape)

    def read(self, window: Rect) -> np.ndarray:
        self.reads.append(window)
        part = self.array[(slice(None), *(slice(a, b) for a, b in window.dims))]
        return part.numpy() if isinstance(part, torch.Tensor) else np.asarray(part)


def transform(out: torch.Tensor, kind: str) -> np.ndarray:
    """A crop's output (K, ...) as written: class indices (argmax; a one-channel output is
    thresholded at logit 0), probabilities (softmax / sigmoid) or the raw logits."""
    if kind == "argmax":  # over a last, contiguous dim: 10x faster than over dim 0 on CPU
        k = out.shape[0]
        idx = out.movedim(0, -1).contiguous().argmax(-1)[None] if k > 1 else (out > 0)
        return idx.numpy().astype(np.uint8 if k <= 256 else np.int32)
    if kind == "softmax":
        return F.softmax(out.float(), 0).numpy()
    if kind == "sigmoid":
        return torch.sigmoid(out.float()).numpy()
    return out.numpy()


def out_channels_dtype(k: int, kind: str, dtype: torch.dtype) -> tuple[int, np.dtype]:
    if kind == "argmax":
        return 1, np.dtype(np.uint8 if k <= 256 else np.int32)
    if kind == "logits":
        return k, np.dtype(str(dtype).removeprefix("torch."))
    return k, np.dtype(np.float32)


@dataclass
class Progress:
    """A progress bar on stderr: redrawn in place on a terminal, else a line every ~2 %.
    ``done`` starts at the regions a resumed run skips; rate and ETA count only this run's."""

    total: int
    done: int = 0
    start: float = field(default_factory=time.perf_counter)
    computed: int = 0
    pixels: int = 0
    shown: int = -1
    stream: Any = None

    def update(self, regions: int, pixels: int) -> None:
        self.done += regions
        self.computed += regions
        self.pixels += pixels
        stream = self.stream or sys.stderr
        tty = getattr(stream, "isatty", lambda: False)()
        pct = 100 * self.done // max(self.total, 1)
        if not tty and pct < self.shown + 2 and self.done < self.total:
            return
        self.shown = pct
        took = time.perf_counter() - self.start
        rate = self.pixels / took / 1e6 if took > 0 else 0.0
        left = (self.total - self.done) * took / max(self.computed, 1)
        bar = "#" * (pct // 5) + "." * (20 - pct // 5)
        end = "\r" if tty and self.done < self.total else "\n"
        print(f"predict [{bar}] {self.done}/{self.total} regions {pct:3d}%  {rate:.2f} Mpx/s  "
              f"eta {left:.0f} s", end=end, file=stream, flush=True)


@dataclass
class Prediction:
    """What a prediction run did (the same on every rank)."""

    grid: RegionGrid
    reach: Reach
    shapes: list[tuple[int, ...]]
    regions: int
    skipped: int
    seconds: float
    overlap: float
    """Input cells computed per input cell of the image (crops overlap by the margins)."""
    output: np.ndarray | Path | None = None
    """The whole output (``out=None``) or the written path, on the writing rank; else None."""


def _check_covered(gm: Any, grid: RegionGrid, regions: list[Region], limit: int = 4096
                   ) -> None:
    """Each region's input needs lie inside its crop, or past the image border (padding the
    crop pads alike): the exactness condition, checked on the whole-image graph."""
    image = grid.image
    for r in regions[:limit]:
        got = needs(gm, r.out)
        for i, ((n0, n1), (c0, c1)) in enumerate(zip(got.dims, r.crop.dims, strict=True)):
            if (n0 < c0 and c0 > 0) or (n1 > c1 and c1 < image[i]):
                raise ReachError(f"region {r.index} needs input cells {n0}..{n1} along dim "
                                 f"{i} but its crop is {c0}..{c1}: fxpar's margins are wrong "
                                 f"for this model (please report it)")


def predict_regions(model: nn.Module, plan: Plan, image: Image | np.ndarray | torch.Tensor,
            out: str | Path | None = None, *,
            compile_crop: Callable[[torch.Tensor], Program], region: int | tuple[int, ...] = 1024,
            batch: int = 1, output: str = "logits", dtype: torch.dtype = torch.float32,
            comm: Comm | None = None, overwrite: bool = False, progress: bool = True,
            settings: dict[str, Any] | None = None, geo: dict[str, Any] | None = None,
            log: Callable[[str], None] | None = None,
            device: torch.device | str = "cpu") -> Prediction:
    """Run ``model`` (eval mode, its current weights) over the whole ``image`` (C, *spatial),
    region by region, each region on all ranks of ``plan``; collective over ``comm`` (default:
    the MPI world when the plan has several ranks).

    out: a ``.zarr`` or ``.tif`` path written region by region (resumable, fxpar.data.writers),
    or None to return the whole output as an array (small images, tests). region: input cells
    per region and dim (rounded up to the model's step). output: argmax | softmax | sigmoid |
    logits. settings: extra values a resumed run must match (the CLI passes the model and
    weights). compile_crop: ``fxpar.compile`` of ``model`` and ``plan`` for an example
    (``fxpar.predict`` passes it). Raises ReachError / DataError / PlanError before any
    communication. device: where each rank computes (its batches go there, the outputs it
    writes come back to the host)."""
    if output not in OUTPUTS:
        raise ValueError(f"output {output!r}: choose one of {', '.join(OUTPUTS)}")
    if batch < 1:
        raise ValueError(f"batch {batch}: give at least 1 region per forward")
    src: Image = image if hasattr(image, "read") else ArrayImage(image)  # type: ignore[arg-type]
    if any(p.dtype != dtype for p in model.parameters()):
        model = copy.deepcopy(model).to(dtype)  # the caller's model stays as it is
    training = model.training
    model.eval()
    try:
        return _predict(model, plan, src, out, compile_crop, region, batch, output, dtype, comm,
                        overwrite, progress, settings, geo, log, torch.device(device))
    finally:
        model.train(training)


def _predict(model: nn.Module, plan: Plan, src: Image, out: str | Path | None,
             compile_crop: Callable[[torch.Tensor], Program], region: int | tuple[int, ...],
             batch: int, output: str, dtype: torch.dtype, comm: Comm | None, overwrite: bool,
             progress: bool, settings: dict[str, Any] | None, geo: dict[str, Any] | None,
             log: Callable[[str], None] | None, device: torch.device) -> Prediction:
    channels, *size = src.shape
    whole = trace(model, (1, channels, *size))
    check_single(whole)
    out_size = output_extent(whole)
    sizes = (region,) * len(size) if isinstance(region, int) else tuple(region)
    if all(r >= e for r, e in zip(sizes, size, strict=True)):
        # one region, the whole image: exact for any model the compiler splits (global means
        # and norms over the image included), nothing to check
        ones = (1,) * len(size)
        r = Reach(tuple(size), out_size, ones, tuple(Fraction(o, e) for o, e in zip(
            out_size, size, strict=True)), (0,) * len(size), (0,) * len(size))
    else:
        r = reach_model(model, channels, tuple(size), whole)
    grid = region_grid(tuple(size), region, r.step, r.scale, r.before, r.after, out_size)
    regions = list(grid.regions())
    if len(regions) > 1:
        _check_covered(whole, grid, regions)
    shapes = grid.shapes()
    world = comm
    if world is None and plan.world_size > 1:
        from fxpar.comm.world import world as mpi_world

        world = mpi_world()
    rank = world.rank if world is not None else 0
    programs = {}
    for shape in shapes:  # every check before the first message
        program = compile_crop(torch.empty((batch, channels, *shape), dtype=dtype,
                                           device="meta"))
        if interp_ratios(whole):
            check_same_interpolation(whole, trace(model, (1, channels, *shape)))
        programs[shape] = program
    writer = next(iter(programs.values())).rank_map.rank_of(0, 0, plan.stages - 1, 0)
    c_out, out_dtype = out_channels_dtype(output_channels(whole), output, dtype)
    store, error = None, None
    if rank == writer and out is not None:
        info = {"image": list(size), "region": list(grid.region), "output": output,
                "dtype": str(out_dtype), **(settings or {})}
        try:
            store = PredictionStore(out, (c_out, *grid.out_image), out_dtype,
                                    (c_out, *(max(1, math.floor(x * s)) for x, s in zip(
                                        grid.region, grid.scale, strict=True))), info, overwrite)
        except DataError as e:
            error = str(e)
    done = set(store.done) if store is not None else set()
    whole_out = np.zeros((c_out, *grid.out_image), out_dtype) if out is None and \
        rank == writer else None
    if world is not None and world.size > 1:  # every rank agrees on errors and skipped work
        shared = world.allgather_object((error, sorted(done)))
        error = next((e for e, _ in shared if e), None)
        done = {tuple(i) for i in shared[writer][1]}
    if error is not None:
        raise DataError(error)
    todo = [g for g in regions if g.index not in done]
    bar = Progress(len(regions), len(regions) - len(todo)) \
        if progress and rank == writer else None
    if log is not None and rank == writer:
        log(describe(grid, r, shapes, len(todo), len(regions)))
    t0 = time.perf_counter()
    helpers = flag("predict_overlap")  # reader and writer threads (predict_pipeline.py)
    sink = _Sink(output, store, whole_out, bar)
    with Drain(sink.write, threaded=helpers and rank == writer) as writes:
        for shape, program in programs.items():
            mine = [g for g in todo if g.crop_shape == shape]
            if not mine:
                continue
            rp = program.local(world) if world is not None else program.for_rank(0)
            rp.to(device)
            rp.eval()
            window = rp.input_window()
            read = functools.partial(_read_batch, src, window, (batch, channels, *shape), dtype)
            try:
                with Prefetch(list(batches(mine, batch)), read,
                              threaded=helpers and window is not None) as inputs:
                    for group, x in inputs:
                        y = rp.forward(x.to(device) if x is not None else None)
                        if rank == writer:
                            writes.put((group, y.cpu()))
            except Exception as e:
                if world is None or world.size == 1:
                    raise
                failfast.fail(e)  # one rank failing ends the whole job: nobody waits
            finally:
                rp.close()
        try:
            writes.finish()
        except Exception as e:
            if world is None or world.size == 1:
                raise
            failfast.fail(e)
    result: np.ndarray | Path | None = whole_out
    if store is not None:
        result = store.finish(geo, grid.scale)
    overlap = sum(g.crop.size for g in regions) / math.prod(size)
    return Prediction(grid, r, shapes, len(regions), len(regions) - len(todo),
                      time.perf_counter() - t0, overlap, result)


def _read_batch(src: Image, window: Rect | None, shape: tuple[int, ...], dtype: torch.dtype,
                group: list[Region]) -> tuple[list[Region], torch.Tensor | None]:
    """The input of one forward (``shape``: batch, channels, *crop) for ``group``'s regions
    (the last repeated up to the batch): only ``window`` of each crop is read and filled, the
    rest of the crop costs no RAM. None on a rank that reads no input (a later stage)."""
    if window is None:
        return group, None
    x = torch.empty(shape, dtype=dtype)
    crops = group + [group[-1]] * (shape[0] - len(group))
    for j, g in enumerate(crops):
        read = src.read(window.moved(tuple(-a for a, _ in g.crop.dims)))
        x[(j, slice(None), *(slice(a, b) for a, b in window.dims))] = to_tensor(read, dtype)
    return group, x


@dataclass
class _Sink:
    """Where the writing rank puts each batch's output: the middle of each region, transformed
    (``output``), into the store or the whole array; then the progress bar moves."""

    output: str
    store: PredictionStore | None
    whole: np.ndarray | None
    bar: Progress | None

    def write(self, done: tuple[list[Region], torch.Tensor]) -> None:
        group, y = done
        for j, g in enumerate(group):
            vals = transform(y[(j, slice(None), *(slice(a, b) for a, b in g.keep.dims))],
                             self.output)
            if self.store is not None:
                self.store.write(g.index, g.out, vals)
            elif self.whole is not None:
                self.whole[(slice(None), *(slice(a, b) for a, b in g.out.dims))] = vals
        if self.bar is not None:
            self.bar.update(len(group), sum(g.box.size for g in group))


def describe(grid: RegionGrid, r: Reach, shapes: list[tuple[int, ...]], todo: int,
             total: int) -> str:
    """The plan of a prediction run, in a few lines (printed by fxpar-predict)."""
    fmt = "x".join
    crops = ", ".join(fmt(map(str, s)) for s in shapes)
    scale = "x".join(str(Fraction(s)) for s in r.scale)
    return (f"image {fmt(map(str, grid.image))} -> output {fmt(map(str, grid.out_image))} "
            f"(scale {scale}); step {fmt(map(str, r.step))}, margins "
            f"{fmt(map(str, r.before))} before / {fmt(map(str, r.after))} after\n"
            f"regions {fmt(map(str, grid.region))}: {total} in a "
            f"{fmt(map(str, grid.counts))} grid ({total - todo} already done); crops {crops}")
