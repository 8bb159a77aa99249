"""Reads that wrap around the image vs one process (run by tests/mpi/test_wrap.py): circular
padding and torch.roll over the spatial dims (fxpar issue 40; the window kind ``wrap``), where
a border tile reads the opposite border's rows and a roll's tiles each other's, cyclically.
P = 2 vertical, 3 horizontal, 4 square, odd sizes, shifts and pads larger than a tile, one
volume. Every case checks loss, every gradient, parameters after 2 SGD steps and BatchNorm
buffers in float64 (tests/helpers/transparency.py); the last shows that a roll off by one row
on the tiles fails the check."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from helpers.equivalence import collect_failures
from helpers.transparency import Case, check
from torch import nn

import fxpar
from fxpar.comm.world import world
from fxpar.frontend.rules import aten_ops
from fxpar.frontend.rules.opkind import Window
from fxpar.passes.spatial_region import Coverage
from fxpar.runtime.spatial.ops import Halo

P = fxpar.Plan


class Circular(nn.Module):
    """conv -> circular padding (asymmetric, given) -> conv without padding -> a conv whose
    own ``padding_mode="circular"`` pads -> 1x1 conv: a segmentation map of the input's size."""

    def __init__(self, pads: tuple[int, int, int, int] = (2, 0, 1, 1), nd: int = 2) -> None:
        super().__init__()
        conv = nn.Conv2d if nd == 2 else nn.Conv3d
        self.pads = pads
        self.a = conv(2, 4, 3, padding=1)
        self.b = conv(4, 4, 3)
        self.bn = nn.BatchNorm2d(4) if nd == 2 else nn.BatchNorm3d(4)
        self.c = conv(4, 4, 3, padding=1, padding_mode="circular")
        self.out = conv(4, 3, 1)

    def forward(self, x):
        y = F.pad(self.a(x), self.pads, mode="circular")
        return self.out(self.c(torch.relu(self.bn(self.b(y)))))


class ShiftedWindows(nn.Module):
    """Swin's shifted windows on (N, C, H, W): conv -> roll(-s) -> conv -> roll(+s) -> conv,
    plus a roll of the channels with one of W (per pixel for the channels)."""

    def __init__(self, shifts: tuple[int, ...] = (-3, -3), nd: int = 2, out: int = 3) -> None:
        super().__init__()
        conv = nn.Conv2d if nd == 2 else nn.Conv3d
        self.shifts = shifts
        self.dims = tuple(range(2, 2 + nd))
        self.a = conv(2, 4, 3, padding=1)
        self.b = conv(4, 4, 3, padding=1)
        self.out = conv(4, out, 1)

    def forward(self, x):
        y = torch.roll(self.a(x), self.shifts, self.dims)
        y = torch.roll(torch.relu(self.b(y)), tuple(-s for s in self.shifts), self.dims)
        y = y + torch.roll(y, (1, 2), (1, -1))
        return self.out(y)


def _seg(build: Any, shape: tuple[int, ...], plan: fxpar.Plan) -> Case:
    return Case(build, shape, plan, classes=3, segmentation=True)


def _wrapped(rp: fxpar.RankProgram | None) -> None:
    """The whole model ran on tiles, this rank's through exchanges that wrap."""
    if rp is None:
        return
    cov = rp.program.traced.meta[Coverage.KEY]
    assert not cov.ended and cov.share == 1.0, cov
    tile = rp.program.spatial.tile(0, rp.rank)
    assert any(isinstance(m, Halo) and m.exchange.wrap for m in tile.modules()), tile


def case_circular_p2_vertical_odd():
    _wrapped(check(_seg(Circular, (2, 2, 9, 11), P(spatial_parts=2, slice="vertical"))))


def case_circular_wider_than_a_tile_p3_horizontal():
    """Pads of 3 rows before and 1 after on 7 rows cut into tiles of 2, 2 and 3 rows: the
    first tile's window reaches past its neighbour to the far tile (a 9 x 6 map)."""
    _wrapped(check(Case(lambda: Circular((1, 1, 3, 1)), (2, 2, 7, 6),
                        P(spatial_parts=3, slice="horizontal"), classes=3,
                        targets=lambda g: torch.randint(0, 3, (2, 9, 6), generator=g))))


def case_shifted_windows_p4_square_odd():
    _wrapped(check(_seg(ShiftedWindows, (2, 2, 11, 9), P(spatial_parts=4))))


def case_rolls_larger_than_a_tile_p3_horizontal():
    """Shifts of -5 rows (tiles of 3 or 4 rows of 10) and +4 columns, then back."""
    _wrapped(check(_seg(lambda: ShiftedWindows((-5, 4)), (2, 2, 10, 7),
                        P(spatial_parts=3, slice="horizontal"))))


def case_volume_roll_and_circular_p4():
    """A volume on a 2 x 1 x 2 grid: a roll over D, H and W, and circular padding of all
    three (the conv's own padding_mode), with BatchNorm3d."""
    def build() -> nn.Module:
        return nn.Sequential(ShiftedWindows((1, -2, 3), nd=3, out=2),
                             Circular((1, 1, 1, 1, 1, 1), 3))

    case = Case(build, (2, 2, 5, 4, 7), P(spatial_parts=4, grid=(2, 1, 2)), classes=3,
                segmentation=True)
    _wrapped(check(case))


def case_a_roll_off_by_one_fails_the_check():
    """The same check, with the tiles rolling one column too far (the rule's shift + 1 along
    the split dim): the loss and the gradients differ; every rank runs the check to its end
    and reports."""
    original = aten_ops.roll_window

    def off_by_one(shape, shifts, dims, spatial):
        op = original(shape, shifts, dims, spatial)
        if isinstance(op, Window):
            op = Window(op.kind, op.k, op.s, (*op.p[:-1], op.p[-1] + 1), op.d, op.fill, op.attrs)
        return op

    aten_ops.roll_window = off_by_one
    try:
        with collect_failures() as failures:
            check(_seg(ShiftedWindows, (2, 2, 8, 6), P(spatial_parts=2, slice="vertical")))
    finally:
        aten_ops.roll_window = original
    got = world().allgather_object(len(failures))
    assert all(got[:2]), f"a roll off by one row passed the check on some rank: {got}"
    if world().rank == 0:
        print(f"off by one: {failures[0][:160]}", flush=True)
