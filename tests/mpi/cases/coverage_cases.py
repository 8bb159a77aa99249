"""Coverage against a FLOP counter (run by tests/mpi/test_coverage.py): each rank of a real SP2 and
SP4 job counts the forward FLOPs it executes (torch.utils.flop_counter), and their sum gives
the share of one process's work the tiles split. It must match the compiler's figure
(``Coverage.share``) within 1 %, for a model with work every rank runs whole: squeeze-excite
1x1 convolutions on pooled vectors, a pyramid-pooling branch on bins that do not divide the
map, and a classifier head after a flatten."""

from __future__ import annotations

import warnings

import torch
from helpers.transparency import sub_comm
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

import fxpar
from fxpar.passes.spatial_region import Coverage


class Mixed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(),
                                  nn.Conv2d(16, 16, 3, padding=1), nn.ReLU())
        self.se = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Conv2d(16, 64, 1), nn.ReLU(),
                                nn.Conv2d(64, 16, 1), nn.Sigmoid())
        self.pyramid = nn.Sequential(nn.AdaptiveAvgPool2d(3), nn.Conv2d(16, 32, 1))
        self.head = nn.Linear(16 * 10 * 12, 10)

    def forward(self, x):
        y = self.stem(x)
        y = y * self.se(y)
        y = y + nn.functional.interpolate(self.pyramid(y).mean(1, keepdim=True), size=y.shape[2:])
        return self.head(y.flatten(1))


def _forward_flops(f, x) -> int:
    with FlopCounterMode(display=False) as counter:
        f(x)
    return int(counter.get_total_flops())


def _check(parts: int) -> None:
    comm = sub_comm(parts)
    if comm is None:
        return
    torch.manual_seed(0)
    model = Mixed().eval()
    x = torch.randn(2, 3, 10, 12)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        program = fxpar.compile(model, fxpar.Plan(spatial_parts=parts, slice="square"), x)
    share = program.traced.meta[Coverage.KEY].share
    rp = program.local(comm).eval()
    with torch.no_grad():
        mine = _forward_flops(rp.forward, x)
        one = _forward_flops(model, x)
    total = sum(comm.allgather_object(mine))
    measured = (parts * one - total) / ((parts - 1) * one)  # tiled share: P*one - sum = (P-1)*t
    print(f"SP{parts}: coverage {share:.4f}, measured {measured:.4f} "
          f"(ranks ran {total / one:.3f} x one process's forward FLOPs)")
    assert 0.5 < share < 0.99, share  # the model keeps work off the tiles on purpose
    assert abs(measured - share) <= 0.01, (measured, share)


def case_coverage_matches_a_flop_counter_sp2():
    _check(2)


def case_coverage_matches_a_flop_counter_sp4():
    _check(4)


class TransposedVolume(nn.Module):
    """A stride-1 ConvTranspose3d between convolutions (a 3-D decoder's refining layer)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Conv3d(2, 8, 3, padding=1), nn.ReLU(),
                                 nn.ConvTranspose3d(8, 8, 3, stride=1, padding=1), nn.ReLU(),
                                 nn.Conv3d(8, 2, 1))

    def forward(self, x):
        return self.net(x)


def case_stride1_conv_transpose_splits_its_work():
    """Issue 36: a stride-1 ConvTranspose3d on depth slabs ran a window padded on every dim
    (the busiest rank 1.04x one process at 2 slabs); as a convolution each slab computes its
    own rows: the busiest rank runs at most 0.55x one process's forward FLOPs."""
    comm = sub_comm(2)
    if comm is None:
        return
    torch.manual_seed(0)
    model = TransposedVolume().eval()
    x = torch.randn(1, 2, 16, 12, 12)
    program = fxpar.compile(model, fxpar.Plan(spatial_parts=2), x)
    rp = program.local(comm).eval()
    with torch.no_grad():
        mine = _forward_flops(rp.forward, x)
        one = _forward_flops(model, x)
    busiest = max(comm.allgather_object(mine)) / one
    print(f"stride-1 ConvTranspose3d, 2 slabs: busiest rank {busiest:.3f}x one process")
    assert busiest <= 0.55, busiest
