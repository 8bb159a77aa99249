"""Training-mode BatchNorm on tiles, with statistics over the whole image (every tile).

Each tile computes its own count n_i, mean m_i and sum of squared deviations from that mean
M2_i (PyTorch's fused kernel for BatchNorm statistics), and the tiles exchange these with ONE
collective (an allgather of ``[n_i, m_i, M2_i]``). Every rank then merges them the same way
(the same kernels on the same values in rank order) with the parallel-variance formula (Chan
et al.; what torch's SyncBatchNorm does)::

    N = sum n_i      mean = sum n_i m_i / N      M2 = sum (M2_i + n_i (m_i - mean)^2)

so all ranks hold identical statistics, and no step subtracts two large numbers: the
E[x^2] - E[x]^2 form loses every digit in float32 when the mean is large next to the spread
(an image of mean 1e4 and spread 1), and already moved gradients by 4e-7 relative in float64
in Inception-v3. Tiles may hold different counts (uneven splits). The merge runs in float64
on the C-sized statistics; only its result is cast to the input's dtype. Each tile's own mean
comes rounded to the input's dtype (as in torch's SyncBatchNorm): in float32 at mean 1e4 and
spread 1 that moves the merged variance by ~6e-6 relative (tests/unit/test_batchnorm.py).

Backward is exact: one allreduce of the two per-channel gradient sums (of gy and gy * xhat)
the global statistics make every tile's input gradient depend on.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from fxpar.comm.mpi import Comm
from fxpar.runtime.spatial.group import TileOp


def stats_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype norm statistics of ``x`` are kept in: ``x``'s, but float32 for bfloat16 and
    float16 inputs (as PyTorch's own kernels accumulate them; ``Plan(precision=...)``)."""
    return torch.float32 if x.dtype in (torch.bfloat16, torch.float16) else x.dtype


def local_moments(x: torch.Tensor) -> torch.Tensor:
    """This tile's ``[n, mean (C), M2 (C)]`` over dims 0, 2, 3 of ``x`` (float64, 1 + 2C).

    ``batch_norm_update_stats`` (mean, then squared deviations from it, accumulated in
    double on CPU) is PyTorch's own fused kernel for BatchNorm's statistics: one read of the
    tile per pass and no temporary the size of the tile."""
    c = x.shape[1]
    n = x.numel() // c if c else 0
    out = torch.zeros(1 + 2 * c, dtype=torch.float64, device=x.device)
    out[0] = n
    if n:
        running = None  # float32 buffers (left unchanged: momentum 0) select the kernel's
        if stats_dtype(x) != x.dtype:  # mixed-type path, which returns float32 statistics of
            running = torch.zeros(c, dtype=torch.float32, device=x.device)  # a bf16 / fp16 x
        mean, var = torch.batch_norm_update_stats(x, running, running, 0.0)
        out[1:1 + c] = mean
        out[1 + c:] = var.double() * n
    return out


def merge_moments(parts: Sequence[torch.Tensor]
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(mean, biased variance, N)`` of the union of the tiles whose ``local_moments`` are
    ``parts`` (float64). Every rank runs the same kernels on the same gathered values, so all
    get identical results; no value leaves the device (no host synchronisation). A tile with
    no values (count 0, moments 0) adds nothing."""
    stacked = torch.stack(list(parts))  # (tiles, 1 + 2C), in rank order
    c = (stacked.shape[1] - 1) // 2
    n, means, m2s = stacked[:, :1], stacked[:, 1:1 + c], stacked[:, 1 + c:]
    total = n.sum()
    mean = (n * means).sum(0) / total
    d = means - mean
    return mean, (m2s + n * d * d).sum(0) / total, total


def global_moments(x: torch.Tensor, comm: Comm) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel mean and biased variance of ``x`` over every tile of ``comm`` (in
    :func:`stats_dtype`, identical on every rank): one allgather of the tiles' local moments."""
    mean, var, _ = merge_moments(comm.allgather(local_moments(x)))
    return mean.to(stats_dtype(x)), var.to(stats_dtype(x))


class _SyncBatchNorm(torch.autograd.Function):
    """Training-mode BatchNorm with statistics over all tiles. Saves only the input and the
    per-channel statistics (like PyTorch's own kernel), so tiles keep 1/P of the memory.

    Forward: the tile's local moments (one fused kernel), one allgather, the merge (module
    doc), then the normalisation as PyTorch's fused ``batch_norm`` in eval form fed the global
    statistics. Backward: ``native_batch_norm_backward`` in eval form (gy * w * invstd and the
    local parameter-gradient sums) plus one more eval-form ``batch_norm`` for the correction
    terms the global statistics add. Written with elementwise ops this took ~4x longer per
    element than one device's BatchNorm (measured on CPU; issue 7's profile)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor | None,
                bias: torch.Tensor | None, comm: Comm, count: int, eps: float,
                box: tuple[slice, ...]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        mean, var = global_moments(x[box], comm)
        y = nn.functional.batch_norm(x, mean, var, weight, bias, False, 0.0, eps)
        ctx.save_for_backward(x, weight, mean, var)
        ctx.comm, ctx.count, ctx.eps, ctx.box = comm, count, eps, box
        ctx.mark_non_differentiable(mean, var)
        return y, mean, var

    @staticmethod
    def backward(ctx: Any, gy: torch.Tensor, _gm: Any, _gv: Any) -> tuple[Any, ...]:
        if getattr(ctx, "weight_grads", None) is not None:
            # run again for the weights alone (a zero-bubble W, fxpar.runtime.splitgrad): the
            # first run's local sums, no second allreduce
            gw, gb = ctx.weight_grads
            return None, gw, gb, None, None, None, None
        x, weight, mean, var = ctx.saved_tensors
        w = weight if weight is not None else torch.ones_like(mean)
        invstd = torch.rsqrt(var + ctx.eps)
        # the saved statistics too: CPU's eval form ignores them, CUDA's asserts they are
        # there (torch 2.11, H200: "save_mean should always be defined")
        gx, gw_l, gb_l = torch.ops.aten.native_batch_norm_backward(
            gy.contiguous(), x, w, mean, var, mean, invstd, False, ctx.eps, [True, True, True])
        total = ctx.comm.allreduce(torch.stack([gb_l, gw_l]))
        # gx = scale * (gy - sum(gy)/count - xhat * sum(gy * xhat)/count): the first term is
        # gx above; the rest is xhat times a per-channel factor plus a per-channel constant
        # (a fused halo group's border cells are not in the statistics: only the box is)
        scale = invstd * w
        gx[ctx.box] += nn.functional.batch_norm(x[ctx.box], mean, var,
                                                -scale * total[1] / ctx.count,
                                                -scale * total[0] / ctx.count, False, 0.0,
                                                ctx.eps)
        # parameter gradients stay local: the stage's ALLREDUCE sums them over the tiles
        gw = gw_l if weight is not None and ctx.needs_input_grad[1] else None
        gb = gb_l if weight is not None and ctx.needs_input_grad[2] else None
        ctx.weight_grads = (gw, gb)
        return gx, gw, gb, None, None, None, None


def batch_norm(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
               running_mean: torch.Tensor | None, running_var: torch.Tensor | None,
               num_batches_tracked: torch.Tensor | None, *, batch_stats: bool, update: bool,
               momentum: float | None, eps: float, comm: Comm | None, count: int,
               box: tuple[tuple[int, int], ...] | None = None) -> torch.Tensor:
    """BatchNorm of tile ``x``: with the statistics of every tile of ``comm`` (``count``
    values per channel in all) when ``batch_stats``, updating the running statistics (unbiased
    variance, as torch) when ``update``; else with the running statistics, no communication.
    ``box``: the part of ``x`` (per spatial dim, local start and stop) the tile owns, when
    ``x`` also holds a border of a fused halo group (fxpar.passes.halo_fusion): the
    statistics are those of the boxes; every cell is normalised with them."""
    if not batch_stats:
        return nn.functional.batch_norm(x, running_mean, running_var, weight, bias, False,
                                        0.0, eps)
    if comm is None:
        raise RuntimeError("BatchNorm with batch statistics on a tile needs its tile group")
    sl = (slice(None), slice(None), *(slice(a, b) for a, b in box or ()))
    y, mean, var = _SyncBatchNorm.apply(x, weight, bias, comm, count, eps, sl)
    if update and running_mean is not None and running_var is not None:
        with torch.no_grad():
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
                          comm=self.group() if batch_stats else None, count=self.count,
                          box=self.box)

    def extra_repr(self) -> str:
        own = f"; statistics of the owned box {self.box} (fused halo border)" if self.box else ""
        return f"statistics over tile group {self.key!r} ({self.count} values per channel){own}"
