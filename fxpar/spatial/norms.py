"""Group and instance normalisation on tiles, with statistics over the whole image.

``aten.group_norm`` normalises each (sample, group) over its channels and *all* of H and W, so
on tiles the statistics are sums over every tile of the group: the mean first (one allreduce of
the per-tile sums), then the variance as the mean of squared deviations from it (a second
allreduce) -- the two-pass form, exact in float32 also when the mean is large next to the
spread (never E[x^2] - E[x]^2). Instance norm without running statistics is group norm with one
channel per group.

The reductions are :func:`group_sum`, a differentiable allreduce: each rank's use of the summed
value contributes to the gradient of every tile, so its backward is an allreduce again.
Everything else is ordinary autograd on the tile.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from fxpar.spatial.ops import group


class _GroupSum(torch.autograd.Function):
    """The sum over the tile group of a tensor every rank holds (replicated result)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, key: str) -> torch.Tensor:
        ctx.key = key
        return group(key).allreduce(x.contiguous().clone())

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        return group(ctx.key).allreduce(g.contiguous().clone()), None


def group_sum(x: torch.Tensor, key: str) -> torch.Tensor:
    """Sum of ``x`` over the ranks of tile group ``key``, differentiable."""
    return _GroupSum.apply(x, key)


class TileGroupNorm(nn.Module):
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
        xg = x.reshape(n, self.groups, -1)
        mean = group_sum(xg.sum(-1), self.key) / self.count
        d = xg - mean.unsqueeze(-1)
        var = group_sum((d * d).sum(-1), self.key) / self.count
        y = (d * torch.rsqrt(var + self.eps).unsqueeze(-1)).reshape(x.shape)
        shape = (1, c) + (1,) * (x.dim() - 2)
        if weight is not None:
            y = y * weight.reshape(shape)
        if bias is not None:
            y = y + bias.reshape(shape)
        return y

    def extra_repr(self) -> str:
        return (f"groups={self.groups}, statistics over tile group {self.key!r} "
                f"({self.count} values per group)")
