"""Training-mode BatchNorm on tiles, with statistics over the whole image (every tile): the
statistics merge every tile's moments (fxpar.runtime.spatial.moments) in one allgather, and the
backward is exact with one allreduce (the custom op ``fxpar::sync_batch_norm``,
fxpar.runtime.spatial.library).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from fxpar.runtime.spatial import collectives as _collectives  # noqa: F401  (its torch.ops.fxpar)
from fxpar.runtime.spatial.group import TileOp


def batch_norm(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
               running_mean: torch.Tensor | None, running_var: torch.Tensor | None,
               num_batches_tracked: torch.Tensor | None, *, batch_stats: bool, update: bool,
               momentum: float | None, eps: float, key: str | None, count: int,
               box: tuple[tuple[int, int], ...] | None = None) -> torch.Tensor:
    """BatchNorm of tile ``x``: with the statistics of every tile of group ``key`` (``count``
    values per channel in all) when ``batch_stats``, updating the running statistics (unbiased
    variance, as torch) when ``update``; else with the running statistics, no communication.
    ``box``: the part of ``x`` (per spatial dim, local start and stop) the tile owns, when
    ``x`` also holds a border of a fused halo group (fxpar.passes.halo_fusion): the
    statistics are those of the boxes; every cell is normalised with them."""
    if not batch_stats:
        return nn.functional.batch_norm(x, running_mean, running_var, weight, bias, False,
                                        0.0, eps)
    if key is None:
        raise RuntimeError("BatchNorm with batch statistics on a tile needs its tile group")
    y, mean, var = torch.ops.fxpar.sync_batch_norm(
        x, weight, bias, key, count, eps, [v for iv in box or () for v in iv])
    if update and running_mean is not None and running_var is not None:
        # no torch.no_grad() needed (the statistics are non-differentiable outputs), and none
        # wanted: torch.export cannot save the region it would make
        if num_batches_tracked is not None:
            num_batches_tracked.add_(1)
        m = 1.0 / float(num_batches_tracked) if momentum is None else momentum
        running_mean.mul_(1 - m).add_(mean, alpha=m)
        running_var.mul_(1 - m).add_(var * (count / max(count - 1, 1)), alpha=m)
    return y


class TileBatchNorm(TileOp):
    """fxpar.frontend.capture.BatchNormOp on a tile: global statistics over the tile group
    ``key`` (``count`` = N*H*W values per channel), in the mode of the module that holds it."""

    def __init__(self, key: str, count: int, momentum: float, eps: float,
                 owner: str = "", box: tuple[tuple[int, int], ...] | None = None) -> None:
        super().__init__()
        self.key, self.count, self.momentum, self.eps = key, count, momentum, eps
        self.owner = owner  # as BatchNormOp.owner
        self.box = box  # the owned cells of an input that holds a fused group's border

    def emit_args(self) -> dict[str, Any]:
        return {"key": self.key, "count": self.count, "momentum": self.momentum,
                "eps": self.eps, "owner": self.owner, "box": self.box}

    def forward(self, x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                running_mean: torch.Tensor | None, running_var: torch.Tensor | None,
                num_batches_tracked: torch.Tensor | None = None) -> torch.Tensor:
        batch_stats = self.training or running_mean is None
        return batch_norm(x, weight, bias, running_mean, running_var, num_batches_tracked,
                          batch_stats=batch_stats, update=self.training,
                          momentum=self.momentum, eps=self.eps,
                          key=self.key if batch_stats else None, count=self.count,
                          box=self.box)

    def extra_repr(self) -> str:
        own = f"; statistics of the owned box {self.box} (fused halo border)" if self.box else ""
        return f"statistics over tile group {self.key!r} ({self.count} values per channel){own}"
