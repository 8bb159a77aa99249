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

from collections.abc import Sequence
from typing import Any

import torch

from fxpar.core.outputs import from_leaves
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
    """The loss on the whole output, whole on every rank of the tile group: each tiled leaf of
    the output is joined first (an allgather; its backward sums the ranks' gradients and keeps
    each tile's part), and so are the per-pixel targets (each rank holds its tile of one, as a
    loader reading only ``target_window()`` gives it). Exact for any loss, at the cost of the
    whole output on every rank: what fxpar does when a loss cannot be captured or has an op
    without a tile rule.

    leaves: per leaf of the output, the tiles' rects of its image (None: whole already);
    targets: the same per target; spec: the output's structure (fxpar.core.outputs)."""

    def __init__(self, loss_fn: Any, leaves: tuple[tuple[Any, ...] | None, ...], tile: int,
                 key: str, targets: tuple[tuple[Any, ...] | None, ...] = (),
                 spec: Any = None) -> None:
        super().__init__()
        self.loss_fn, self.spec = loss_fn, spec
        self.leaves = [None if r is None else Join(r, tile, key, tag=JOIN_TAG) for r in leaves]
        self.targets = [None if r is None else Join(r, tile, key, tag=JOIN_TAG)
                        for r in targets]

    def forward(self, *args: Any) -> torch.Tensor:
        n = len(self.leaves)
        leaves = [t if j is None else _join(j, t) for t, j in zip(args[:n], self.leaves,
                                                                    strict=True)]
        joins = self.targets + [None] * (len(args) - n - len(self.targets))
        whole = [t if j is None else _join(j, t) for t, j in zip(args[n:], joins, strict=True)]
        return self.loss_fn(from_leaves(self.spec, leaves), *whole)


def _join(join: Join, t: torch.Tensor) -> torch.Tensor:
    """``t``'s tiles joined: an (N, C, *image) tensor as it is, any other (a target (N, H, W))
    as one (1, -1, *image) tensor and back."""
    nd = join.rects[0].ndim
    if t.dim() == nd + 2:
        return join(t)
    lead = t.shape[:-nd]
    full = join(t.reshape(1, -1, *t.shape[-nd:]))
    return full.reshape(*lead, *full.shape[-nd:])


def image_layout(shape: tuple[int, ...], extent: tuple[int, ...], first_axis: int = 0
                 ) -> tuple[tuple[int, ...], ...] | None:
    """The layout of a loss input (fxpar.frontend.rules.dims) whose last dims are the tiled
    output's image dims: each holds its grid axis, and the rank holds its tile; None for any
    other input, whole on every rank. ``first_axis``: the loss's axis of the image's first
    dim (an output with leaves at several image sizes gives each size axes of its own:
    :func:`loss_axes`)."""
    nd = len(extent)
    if len(shape) > nd and tuple(shape[-nd:]) == tuple(extent):
        return ((),) * (len(shape) - nd) + tuple((first_axis + a,) for a in range(nd))
    return None


def loss_axes(extents: Sequence[tuple[int, ...] | None]) -> list[tuple[int, ...]]:
    """The image sizes of an output's tiled leaves, each once, in order: size k holds the
    loss's grid axes ``k*nd .. k*nd + nd - 1`` (a main mask and a half-size deep-supervision
    head: axes 0, 1 at full size, 2, 3 at half)."""
    return list(dict.fromkeys(e for e in extents if e is not None))


def target_extent(shape: tuple[int, ...], sizes: Sequence[tuple[int, ...]]
                  ) -> tuple[int, ...] | None:
    """The image size (of :func:`loss_axes`) a target is per-pixel at, the first that fits;
    None: the target is whole on every rank (class labels, weights)."""
    return next((e for e in sizes if image_layout(shape, e) is not None), None)


JOIN_TAG = 8
"""The tag of :class:`JoinedLoss`'s join in its tile group (the halo pass numbers its own
from 10 up)."""
