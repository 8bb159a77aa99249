"""Reductions over the whole image from tiles: the result is the same on every rank.

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
sums its rows into the bins with a 0/1 matrix per dim (one ``einsum``), the allreduce adds the
tiles, and the result is divided by the bins' sizes.
"""

from __future__ import annotations

from typing import Any

import torch

from fxpar.comm.mpi import Comm
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


class _GlobalMax(torch.autograd.Function):
    """``amax`` over H and W of the whole image; gradient split evenly over the ties."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Comm) -> torch.Tensor:
        m = comm.allreduce(x.amax(dim=(2, 3), keepdim=True).contiguous(), op="max")
        at = x == m
        count = comm.allreduce(at.sum(dim=(2, 3), keepdim=True).to(x.dtype))
        ctx.save_for_backward(at, count)
        ctx.comm = comm
        return m

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        at, count = ctx.saved_tensors
        g = ctx.comm.allreduce(g.contiguous().clone())
        return at * (g / count), None


class TileReduce(TileOp):
    """A reduction over H and W of the whole image, from this rank's tile ``rect``.

    kind: ``sum`` | ``mean`` | ``amax`` (over H and W; ``keepdim`` as the op had it) or
    ``bins`` (adaptive average pooling to ``out``). ``extent``: the image's (H, W)."""

    def __init__(self, kind: str, key: str, extent: tuple[int, int],
                 rows: Interval, cols: Interval, keepdim: bool = True,
                 out: tuple[int, int] = (1, 1)) -> None:
        super().__init__()
        if kind not in KINDS:
            raise ValueError(f"TileReduce kind {kind!r}: one of {KINDS}")
        self.kind, self.key, self.keepdim = kind, key, keepdim
        self.extent, self.rows, self.cols, self.out = tuple(extent), tuple(rows), tuple(cols), \
            tuple(out)
        if kind == "bins":  # the tile's rows and columns into the bins, and the bins' sizes
            (h, w), (oh, ow) = self.extent, self.out
            self._ah, self._aw = bins(h, oh, self.rows), bins(w, ow, self.cols)
            self._sizes = torch.outer(bin_sizes(h, oh), bin_sizes(w, ow))

    def emit_args(self) -> dict[str, Any]:
        """The constructor's arguments (fxpar.io.emit writes ``TileReduce(**these)``)."""
        return {"kind": self.kind, "key": self.key, "extent": self.extent, "rows": self.rows,
                "cols": self.cols, "keepdim": self.keepdim, "out": self.out}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "bins":
            return self._bins(x)
        if self.kind == "amax":
            y = _GlobalMax.apply(x, self.group())
        else:
            y = group_sum(x.sum(dim=(2, 3), keepdim=True), self.group())
            if self.kind == "mean":
                y = y / (self.extent[0] * self.extent[1])
        return y if self.keepdim else y.flatten(2).squeeze(-1)

    def _bins(self, x: torch.Tensor) -> torch.Tensor:
        part = torch.einsum("nchw,hi,wj->ncij", x, self._ah.to(x), self._aw.to(x))
        return group_sum(part, self.group()) / self._sizes.to(x)

    def extra_repr(self) -> str:
        what = f"adaptive average pool to {self.out[0]}x{self.out[1]}" \
            if self.kind == "bins" else f"{self.kind} over H and W"
        return (f"{what} of the {self.extent[0]}x{self.extent[1]} image from rows "
                f"{self.rows[0]}:{self.rows[1]} cols {self.cols[0]}:{self.cols[1]}")
