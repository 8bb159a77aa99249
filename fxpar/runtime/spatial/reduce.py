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

A vector norm over H and W (``norm``: ConvNeXt-V2's and MedNeXt's global response norm) sums
the tile's ``|x|^ord``, allreduces the sums and takes the root (:func:`vector_norm`, which the
loss's reductions share).

Adaptive max pooling (``maxbins``) gives all of a bin's gradient to one cell, the first maximum
in the image's row-major order (ATen's index), not spread over ties as ``amax`` does. Each tile
finds its own first maximum of each bin (dim by dim, last dim first: the first row holding the
maximum, and in it the first column), the allreduces take the largest value and, among the
tiles holding it, the smallest image index; the tile holding that cell contributes its value,
the others zero, through a differentiable sum. So the values, the indices and the gradient are
one device's exactly.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from fxpar.core.geometry import Interval
from fxpar.runtime.spatial.group import TileOp
from fxpar.runtime.spatial.norms import group_sum

KINDS = ("sum", "mean", "amax", "bins", "norm", "maxbins")

_NONE = torch.iinfo(torch.int64).max
"""The image index of a bin's maximum on a tile that holds none of the bin's cells."""


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


def extreme(x: torch.Tensor, dims: tuple[int, ...], op: str, key: str) -> torch.Tensor:
    """``amax`` / ``amin`` (``op``: "max" / "min") over ``dims`` of the whole tensor, keeping
    them; the gradient is split evenly over the cells equal to the extreme, on every tile (as
    one device does)."""
    return torch.ops.fxpar.group_extreme(x, key, list(dims), op)[0]


def vector_norm(x: torch.Tensor, dims: tuple[int, ...], ord: float, key: str) -> torch.Tensor:
    """``torch.linalg.vector_norm(x, ord, dims, keepdim=True)`` of the whole tensor, from this
    tile: one allreduce of the tile's sums of ``|x|^ord``, then the root. A zero norm's
    gradient is zero, as torch's is (the root's derivative there would make it 0 * inf)."""
    p = float(ord)
    if math.isinf(p):
        return extreme(x.abs(), dims, "max" if p > 0 else "min", key)
    if p == 0:
        return torch.ops.fxpar.allreduce((x != 0).sum(dim=dims, keepdim=True).to(x.dtype),
                                         key, "sum").detach()
    part = x.abs() if p == 1 else x * x if p == 2 else x.abs().pow(p)
    total = group_sum(part.sum(dim=dims, keepdim=True), key)
    if p == 1:
        return total
    some = total > 0
    safe = torch.where(some, total, torch.ones_like(total))
    return torch.where(some, safe.sqrt() if p == 2 else safe.pow(1.0 / p),
                       torch.zeros_like(total))


class TileReduce(TileOp):
    """A reduction over the spatial dims of the whole image (or volume), from this rank's tile
    ``box`` (one interval per spatial dim).

    kind: ``sum`` | ``mean`` | ``amax`` | ``norm`` (of order ``ord``) over every spatial dim
    (``keepdim`` as the op had it), ``bins`` (adaptive average pooling to ``out``) or
    ``maxbins`` (adaptive max pooling to ``out``: values and indices, as ATen gives them).
    ``extent``: the image's spatial sizes."""

    def __init__(self, kind: str, key: str, extent: tuple[int, ...],
                 box: tuple[Interval, ...], keepdim: bool = True,
                 out: tuple[int, ...] = (1, 1), ord: float = 2.0) -> None:
        super().__init__()
        if kind not in KINDS:
            raise ValueError(f"TileReduce kind {kind!r}: one of {KINDS}")
        self.kind, self.key, self.keepdim = kind, key, keepdim
        self.extent, self.box = tuple(extent), tuple(tuple(iv) for iv in box)
        self.out, self.ord = tuple(out), float(ord)
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
                "keepdim": self.keepdim, "out": self.out, "ord": self.ord}

    def forward(self, x: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if self.kind == "bins":
            return self._bins(x)
        if self.kind == "maxbins":
            return self._max_bins(x)
        if self.kind == "amax":
            y = extreme(x, _spatial(x), "max", self.key)
        elif self.kind == "norm":
            y = vector_norm(x, _spatial(x), self.ord, self.key)
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

    def _firsts(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per bin, the tile's maximum and the image index (row-major over the spatial dims,
        as ATen's) of its first cell holding it; -inf and :data:`_NONE` for a bin with no
        cell on this tile. Dim by dim from the last: the first maximum of each row, then the
        first row holding the maximum, and so on."""
        nd = len(self.extent)
        index = torch.zeros((), dtype=torch.int64)
        for d, (a, b) in enumerate(self.box):
            shape = [1] * nd
            shape[d] = -1
            index = index + torch.arange(a, b).view(shape) * math.prod(self.extent[d + 1:])
        val, idx = x, index.to(x.device).expand(x.shape)
        for d in reversed(range(nd)):
            e, o, (a, b) = self.extent[d], self.out[d], self.box[d]
            vals, idxs = [], []
            for i in range(o):
                lo, hi = max((i * e) // o, a), min(-((-(i + 1) * e) // o), b)
                if hi > lo:
                    m, at = val.narrow(2 + d, lo - a, hi - lo).max(2 + d, keepdim=True)
                    vals.append(m)
                    idxs.append(idx.narrow(2 + d, lo - a, hi - lo).gather(2 + d, at))
                else:  # none of the bin's rows is on this tile
                    size = list(val.shape)
                    size[2 + d] = 1
                    vals.append(val.new_full(size, -math.inf))
                    idxs.append(torch.full(size, _NONE, dtype=torch.int64, device=x.device))
            val, idx = torch.cat(vals, 2 + d), torch.cat(idxs, 2 + d)
        return val, idx

    def _max_bins(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Adaptive max pooling to ``out``: (values, indices), as one device's (module doc)."""
        with torch.no_grad():
            val, idx = self._firsts(x)
            best = torch.ops.fxpar.allreduce(val, self.key, "max")
            first = torch.ops.fxpar.allreduce(torch.where(val == best, idx, _NONE), self.key,
                                              "min")
        # the winning cell's value from the tile holding it, zero from the others
        cells, mine = torch.zeros_like(first), torch.ones_like(first, dtype=torch.bool)
        for d, (a, b) in enumerate(self.box):
            at = (first // math.prod(self.extent[d + 1:])) % self.extent[d]
            mine &= (at >= a) & (at < b)
            cells = cells * (b - a) + (at - a)
        cells = torch.where(mine, cells, 0)
        picked = x.flatten(2).gather(2, cells.flatten(2)).view(first.shape)
        return group_sum(torch.where(mine, picked, 0), self.key), first

    def extra_repr(self) -> str:
        size = "x".join(map(str, self.extent))
        to = "x".join(map(str, self.out))
        what = {"bins": f"adaptive average pool to {to}", "maxbins": f"adaptive max pool to {to}",
                "norm": f"norm (ord {self.ord:g}) over the spatial dims"}.get(
                    self.kind, f"{self.kind} over the spatial dims")
        cells = " x ".join(f"{a}:{b}" for a, b in self.box)
        return f"{what} of the {size} image from {cells}"
