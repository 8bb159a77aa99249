"""Reductions over split dims of any tensor of a loss on tiles: the result is whole on every rank.

A loss on a tiled output (fxpar.passes.tile_loss) reduces tensors whose split dims need not be
the trailing ones of an image: ``(N, C, H, W)`` probabilities summed over ``(0, 2, 3)`` (Dice),
``(N, H, W)`` per-pixel losses summed over everything (cross-entropy), ``(N, C, H*W)`` after a
flatten (smp's Dice). :class:`TileReduceDims` reduces the tile over the op's dims, sums the
partial results over the tile group (one allreduce) and finishes the op on the sum: a mean
divides by the *global* count of the reduced cells, a vector norm takes the root, a max keeps
one device's gradient on the ties. The result is replicated: as everywhere in fxpar, the
backward of the allreduce is an allreduce of the gradient (fxpar.runtime.spatial.norms).
"""

from __future__ import annotations

from typing import Any

import torch

from fxpar.runtime.spatial.group import TileOp
from fxpar.runtime.spatial.norms import group_sum
from fxpar.runtime.spatial.ops import Join
from fxpar.runtime.spatial.reduce import extreme, vector_norm

KINDS = ("sum", "mean", "amax", "amin", "any", "all", "norm")


class TileReduceDims(TileOp):
    """``kind`` over ``dims`` of a tensor whose split dims are among ``dims``, from this rank's
    tile; ``count`` is how many cells of the whole tensor each result reduces (for a mean),
    ``ord`` the order of a vector norm, ``dtype`` the op's accumulation dtype (None: the
    input's)."""

    def __init__(self, kind: str, dims: tuple[int, ...], keepdim: bool, key: str,
                 count: int = 1, ord: float = 2.0, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        if kind not in KINDS:
            raise ValueError(f"TileReduceDims kind {kind!r}: one of {KINDS}")
        self.kind, self.dims, self.keepdim, self.key = kind, tuple(dims), keepdim, key
        self.count, self.ord, self.dtype = count, float(ord), dtype

    def emit_args(self) -> dict[str, Any]:
        return {"kind": self.kind, "dims": self.dims, "keepdim": self.keepdim, "key": self.key,
                "count": self.count, "ord": self.ord, "dtype": self.dtype}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dims = tuple(d % x.dim() for d in self.dims) if x.dim() else ()
        if self.dtype is not None:
            x = x.to(self.dtype)
        key = self.key
        if self.kind in ("any", "all"):
            local = x.bool().any(dim=dims, keepdim=True) if self.kind == "any" else \
                x.bool().all(dim=dims, keepdim=True)
            y = torch.ops.fxpar.allreduce(local.to(torch.int32), key,
                                          "max" if self.kind == "any" else "min").bool()
        elif self.kind in ("amax", "amin"):
            y = extreme(x, dims, "max" if self.kind == "amax" else "min", key)
        elif self.kind == "norm":
            y = vector_norm(x, dims, self.ord, key)
        else:
            y = group_sum(x.sum(dim=dims, keepdim=True), key)
            if self.kind == "mean":
                y = y / self.count
        return y if self.keepdim else _squeeze(y, dims)

    def extra_repr(self) -> str:
        what = f"{self.kind} (ord {self.ord:g})" if self.kind == "norm" else self.kind
        return f"{what} over dims {list(self.dims)} of the whole tensor" + \
            (f", {self.count} cells" if self.kind == "mean" else "")


def _squeeze(y: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
    for d in sorted(dims, reverse=True):
        y = y.squeeze(d)
    return y


class JoinedLoss(torch.nn.Module):
    """The loss on the whole output, whole on every rank of the tile group: the output's tiles
    are joined first (an allgather; its backward sums the ranks' gradients and keeps each
    tile's part), and so are the tiles of the targets marked in ``joined`` (each rank holds
    its tile of a per-pixel target, as a loader reading only ``target_window()`` gives it).
    Exact for any loss, at the cost of the whole output on every rank: what fxpar does when a
    loss cannot be captured or has an op without a tile rule."""

    def __init__(self, loss_fn: Any, rects: tuple[Any, ...], tile: int, key: str,
                 joined: tuple[bool, ...] = ()) -> None:
        super().__init__()
        self.loss_fn, self.joined = loss_fn, tuple(joined)
        self.join = Join(rects, tile, key, tag=JOIN_TAG)

    def forward(self, output: torch.Tensor, *targets: Any) -> torch.Tensor:
        whole = [self._join(t) if j else t for t, j in
                 zip(targets, self.joined + (False,) * len(targets), strict=False)]
        return self.loss_fn(self.join(output), *whole)

    def _join(self, t: torch.Tensor) -> torch.Tensor:
        nd = self.join.rects[0].ndim
        lead = t.shape[:-nd]
        full = self.join(t.reshape(1, -1, *t.shape[-nd:]))
        return full.reshape(*lead, *full.shape[-nd:])


def image_layout(shape: tuple[int, ...], extent: tuple[int, ...]
                 ) -> tuple[tuple[int, ...], ...] | None:
    """The layout of a loss input (fxpar.frontend.rules.dims) whose last dims are the tiled
    output's image dims: each holds its grid axis, and the rank holds its tile; None for any
    other input, whole on every rank."""
    nd = len(extent)
    if len(shape) > nd and tuple(shape[-nd:]) == tuple(extent):
        return ((),) * (len(shape) - nd) + tuple((a,) for a in range(nd))
    return None


JOIN_TAG = 8
"""The tag of :class:`JoinedLoss`'s join in its tile group (the halo pass numbers its own
from 10 up)."""
