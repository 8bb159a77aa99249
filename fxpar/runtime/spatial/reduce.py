"""Reductions over the whole image (or volume) from tiles: the result is the same on every rank.

Global average pooling (``mean`` over H and W, ``adaptive_avg_pool2d`` to 1x1), squeeze-excite
and CBAM's channel attention (``amax`` over H and W), ``sum`` over H and W, and adaptive
average pooling to any output size (PSPNet's pyramid: bins that overlap and vary in size) all
reduce the tiles' partial results with one allreduce. The output is *replicated*; as
everywhere in fxpar, a replicated value's gradient on each rank is that rank's part of the
whole gradient (its tile's consumers), so the backward of the allreduce is an allreduce of the
gradient again (:func:`fxpar.runtime.spatial.norms.group_sum`).

``amax`` keeps one device's gradient exactly, ties included: PyTorch spreads the gradient
evenly over every cell equal to the maximum, so the tiles count their cells at the global
maximum (one more allreduce) and each gives its own ``g / count``.

Adaptive average pooling bin ``i`` of ``o`` over an extent ``E`` covers rows
``[floor(i E / o), ceil((i + 1) E / o))`` (ATen's ``start_index`` / ``end_index``). A tile
sums the rows it holds of each bin, dim by dim, the allreduce adds the tiles, and the result is
divided by the bins' sizes.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from fxpar.core.geometry import Interval
from fxpar.runtime.spatial.group import TileOp
from fxpar.runtime.spatial.norms import group_sum

KINDS = ("sum", "mean", "amax", "bins")


def bins(extent: int, out: int, rows: Interval) -> torch.Tensor:
    """The (rows, out) 0/1 matrix: row r of ``rows`` (global) lies in adaptive bin i."""
    r = torch.arange(rows[0], rows[1]).unsqueeze(1)
    i = torch.arange(out).unsqueeze(0)
    start = (i * extent) // out
    end = -((-(i + 1) * extent) // out)  # ceil
    return ((r >= start) & (r < end)).to(torch.float64)


def bin_sizes(extent: int, out: int) -> torch.Tensor:
    """How many rows each of ``out`` adaptive bins over ``extent`` holds."""
    return bins(extent, out, (0, extent)).sum(0)


def _spatial(x: torch.Tensor) -> tuple[int, ...]:
    return tuple(range(2, x.dim()))


class TileReduce(TileOp):
    """A reduction over the spatial dims of the whole image (or volume), from this rank's tile
    ``box`` (one interval per spatial dim).

    kind: ``sum`` | ``mean`` | ``amax`` (over every spatial dim; ``keepdim`` as the op had it)
    or ``bins`` (adaptive average pooling to ``out``). ``extent``: the image's spatial
    sizes."""

    def __init__(self, kind: str, key: str, extent: tuple[int, ...],
                 box: tuple[Interval, ...], keepdim: bool = True,
                 out: tuple[int, ...] = (1, 1)) -> None:
        super().__init__()
        if kind not in KINDS:
            raise ValueError(f"TileReduce kind {kind!r}: one of {KINDS}")
        self.kind, self.key, self.keepdim = kind, key, keepdim
        self.extent, self.box = tuple(extent), tuple(tuple(iv) for iv in box)
        self.out = tuple(out)
        if kind == "bins":  # the bins' sizes
            sizes = torch.ones((), dtype=torch.float64)
            for i, (e, o) in enumerate(zip(self.extent, self.out, strict=True)):
                shape = [1] * len(self.out)
                shape[i] = -1
                sizes = sizes * bin_sizes(e, o).view(shape)
            self._sizes = sizes

    def emit_args(self) -> dict[str, Any]:
        """The constructor's arguments (fxpar.program.emit writes ``TileReduce(**these)``)."""
        return {"kind": self.kind, "key": self.key, "extent": self.extent, "box": self.box,
                "keepdim": self.keepdim, "out": self.out}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "bins":
            return self._bins(x)
        if self.kind == "amax":
            y = torch.ops.fxpar.group_extreme(x, self.key, list(_spatial(x)), "max")[0]
        else:
            y = group_sum(x.sum(dim=_spatial(x), keepdim=True), self.key)
            if self.kind == "mean":
                y = y / math.prod(self.extent)
        return y if self.keepdim else y.flatten(2).squeeze(-1)

    def _bins(self, x: torch.Tensor) -> torch.Tensor:
        """The tile's cells summed into the bins, dim by dim (plain sums of the rows each bin
        holds: no matmul with the 0/1 maps, which would cost rows x bins multiply-adds)."""
        part = x
        for d, (e, o, (a, b)) in enumerate(zip(self.extent, self.out, self.box, strict=True)):
            pieces = []
            for i in range(o):
                lo, hi = max((i * e) // o, a), min(-((-(i + 1) * e) // o), b)
                rows = part.narrow(2 + d, lo - a, hi - lo) if hi > lo else \
                    part.narrow(2 + d, 0, 0)  # none of the bin's rows is on this tile
                pieces.append(rows.sum(2 + d, keepdim=True))
            part = torch.cat(pieces, 2 + d)
        return group_sum(part, self.key) / self._sizes.to(x)

    def extra_repr(self) -> str:
        size = "x".join(map(str, self.extent))
        what = f"adaptive average pool to {'x'.join(map(str, self.out))}" \
            if self.kind == "bins" else f"{self.kind} over the spatial dims"
        cells = " x ".join(f"{a}:{b}" for a, b in self.box)
        return f"{what} of the {size} image from {cells}"
