"""Norm statistics over the whole image from tiles (training-mode BatchNorm on tiles).

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

import torch

from fxpar.comm.mpi import Comm


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
