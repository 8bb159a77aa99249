"""Group and instance normalisation on tiles, with statistics over the whole image.

``aten.group_norm`` normalises each (sample, group) over its channels and *all* of H and W, so
on tiles the statistics merge every tile's: each tile computes its count, mean and sum of
squared deviations from that mean (M2) per (sample, group), one allgather gives every rank all
of them, and each rank merges them alike with the parallel-variance formula, as
fxpar.runtime.spatial.batchnorm does (exact in float32 also when the mean is large next to the
spread: never E[x^2] - E[x]^2). Instance norm without running statistics is group norm with one
channel per group.

The collectives are fxpar's differentiable custom ops (fxpar.runtime.spatial.library):
:func:`group_gather` (an allgather; each rank's use of the gathered values contributes to the
gradient of every tile's, so its backward is an allreduce) and :func:`group_sum` (an allreduce,
whose backward is an allreduce again). Everything else is ordinary autograd on the tile.
"""

from __future__ import annotations

from typing import Any

import torch

from fxpar.runtime.spatial import collectives as _collectives  # noqa: F401  (its torch.ops.fxpar)
from fxpar.runtime.spatial.group import TileOp
from fxpar.runtime.spatial.moments import stats_dtype


def group_sum(x: torch.Tensor, key: str) -> torch.Tensor:
    """Sum of ``x`` over the ranks of tile group ``key``, differentiable (``fxpar::allreduce``)."""
    return torch.ops.fxpar.allreduce(x, key, "sum")


def group_gather(x: torch.Tensor, key: str) -> torch.Tensor:
    """``x`` of every rank of tile group ``key``, stacked in rank order, differentiable
    (``fxpar::allgather``)."""
    return torch.ops.fxpar.allgather(x, key)


class TileGroupNorm(TileOp):
    """``aten.group_norm`` (``groups`` groups; ``groups`` = channels for instance norm) on a
    tile: per (sample, group) statistics over ``count`` values of the whole image."""

    def __init__(self, groups: int, eps: float, key: str, count: int) -> None:
        super().__init__()
        self.groups, self.eps, self.key, self.count = groups, eps, key, count

    def emit_args(self) -> dict[str, Any]:
        return {"groups": self.groups, "eps": self.eps, "key": self.key, "count": self.count}

    def forward(self, x: torch.Tensor, weight: torch.Tensor | None = None,
                bias: torch.Tensor | None = None) -> torch.Tensor:
        n, c = x.shape[:2]
        # statistics in float32 for bfloat16 / float16 tiles (Plan(precision=...))
        xg = x.reshape(n, self.groups, -1).to(stats_dtype(x))
        local = xg.mean(-1)
        d = xg - local.unsqueeze(-1)  # deviations from this tile's mean
        # [count, mean, M2] of every tile, merged in rank order (the module doc)
        tiles = group_gather(torch.stack([torch.full_like(local, xg.shape[-1]), local,
                                          (d * d).sum(-1)]), self.key)
        counts, means, m2s = tiles.unbind(1)
        total = counts.sum(0)
        mean = (counts * means).sum(0) / total
        var = (m2s + counts * (means - mean) ** 2).sum(0) / total
        rstd = torch.rsqrt(var + self.eps)
        # (x - mean) * rstd from the local deviations, which autograd keeps anyway (for M2):
        # no second tile-sized tensor is saved for backward
        y = (d * rstd.unsqueeze(-1) - ((mean - local) * rstd).unsqueeze(-1)).reshape(x.shape)
        shape = (1, c) + (1,) * (x.dim() - 2)
        if weight is not None:
            y = y * weight.reshape(shape)
        if bias is not None:
            y = y + bias.reshape(shape)
        return y.to(x.dtype)

    def extra_repr(self) -> str:
        return (f"groups={self.groups}, statistics over tile group {self.key!r} "
                f"({self.count} values per group)")
