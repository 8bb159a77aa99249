"""Coverage against a FLOP counter (run by tests/mpi/test_coverage.py): each rank of a real SP2 and
SP4 job counts the forward FLOPs it executes (torch.utils.flop_counter), and their sum gives
the share of one process's work the tiles split. It must match the compiler's figure
(``Coverage.share``) within 1 %, for a model with work every rank runs whole: squeeze-excite
1x1 convolutions on pooled vectors, a pyramid-pooling branch on bins that do not divide the
map, and a classifier head after a flatten. And FlopCounterMode around a whole training step
of split convolutions (``fxpar::halo_op`` / ``fxpar::halo_conv_grad``) counts one process's
convolution FLOPs, forward and backward, summed over the tiles."""

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


class WideStem(nn.Module):
    """Three 3x3 convolutions on an image 256 columns wide, then a pooled classifier head. In
    two column tiles (``Plan(spatial_parts=2, slice="vertical")``, halo_fusion "off": one
    ``fxpar::halo_op`` per convolution) the first reads its window of the replicated input;
    the others receive a halo column and split (fxpar.runtime.spatial.haloconv: tiles of 128
    output columns, bands of 1, within ``MIN_RATIO``): the tile's part runs while the halo
    travels, and backward is ``fxpar::halo_conv_grad``."""

    def __init__(self) -> None:
        super().__init__()
        self.convs = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(),
                                   nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(),
                                   nn.Conv2d(8, 8, 3, padding=1), nn.ReLU())
        self.head = nn.Linear(8, 10)

    def forward(self, x):
        return self.head(self.convs(x).mean((2, 3)))


def _step_flops(step) -> dict[str, int]:
    """FLOPs per op of one training step, as FlopCounterMode counts them."""
    with FlopCounterMode(display=False) as counter:
        step()
    return {str(op): int(n) for op, n in counter.get_flop_counts()["Global"].items()}


FORWARD_CONVS, BACKWARD_CONVS = ("aten.convolution", "fxpar.halo_op"), \
    ("aten.convolution_backward", "fxpar.halo_conv_grad")


def case_flop_counter_around_a_train_step_with_split_convolutions():
    """Issue 59: FlopCounterMode around ``rp.train_step`` (Lightning's ``measure_flops``, MFU
    counters) raised at the first ``halo_conv_grad``. Summed over the two tiles, forward and
    backward convolution FLOPs are one process's (torch counts a convolution by its outputs,
    which the tiles partition: the halo columns add none); the step's total is at least one
    process's, and above it only by the head every rank runs whole."""
    comm = sub_comm(2)
    if comm is None:
        return
    torch.manual_seed(0)
    model = WideStem()
    x, y = torch.randn(2, 3, 8, 256), torch.randint(0, 10, (2,))
    program = fxpar.compile(model, fxpar.Plan(spatial_parts=2, slice="vertical"), x,
                            loss_fn=nn.functional.cross_entropy,
                            optimizer=lambda p: torch.optim.SGD(p, lr=0.01))
    rp = program.local(comm)
    mine = _step_flops(lambda: rp.train_step(x, y))
    assert mine.get("fxpar.halo_conv_grad", 0) > 0, mine  # the split convolutions ran
    one = _step_flops(lambda: nn.functional.cross_entropy(model(x), y).backward())
    ranks = comm.allgather_object(mine)
    summed = {op: sum(r.get(op, 0) for r in ranks) for op in {op for r in ranks for op in r}}
    total, whole = sum(summed.values()), sum(one.values())
    print(f"SP2 train step: ranks {ranks}, one process {one}: "
          f"ranks ran {total / whole:.4f}x one process's FLOPs")
    for ops in (FORWARD_CONVS, BACKWARD_CONVS):
        assert sum(summed.get(op, 0) for op in ops) == sum(one.get(op, 0) for op in ops), ops
    convs = sum(one.get(op, 0) for op in FORWARD_CONVS + BACKWARD_CONVS)
    assert whole <= total <= whole + (comm.size - 1) * (whole - convs), (total, whole, convs)
