"""HaloNet's halo attention on tiles vs one process in float64 (run by tests/mpi/test_halonet.py).

timm's HaloAttn takes its queries in non-overlapping blocks and its keys and values in
overlapping windows (``F.pad`` + ``Tensor.unfold(2, win, block).unfold(3, win, block)``); an
unfold along a split dim makes each tile's own windows from its cells and a halo of its
neighbours' (fxpar.frontend.rules.token_ops.unfold, fxpar.passes.tile_tokens), and the relative
position logits are computed per window. A small HaloAttn block (stride 1 and 2) under SP2 and
SP4; overlapping windows on uneven tiles, of a tile and of the model's input (whole on every
rank); timm's halonet26t at 256 x 256 (batch 1) under SP2 and SP4 with at least 95 % of its work
on tiles (its last block, whose one 8 x 8 window covers the 8 x 8 map, ends the region with the
reason). Every case checks loss, every gradient, parameters after 2 SGD steps with momentum and
every buffer (tests/helpers/transparency.py). A halo one column short is caught."""

from __future__ import annotations

import torch
from helpers.transparency import Case, check
from torch import fx, nn

import fxpar
from fxpar.passes.spatial_region import Coverage

P = fxpar.Plan
PLANS = {"p2": P(spatial_parts=2, slice="vertical"), "p4": P(spatial_parts=4, slice="square")}


class Halo(nn.Module):
    """conv -> BN -> ReLU -> timm's HaloAttn (blocks of 4, halo 1, 2 heads) -> conv -> global
    mean -> linear."""

    def __init__(self, stride: int = 1) -> None:
        super().__init__()
        from timm.layers.halo_attn import HaloAttn

        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU())
        self.attn = HaloAttn(16, 16, stride=stride, num_heads=2, block_size=4, halo_size=1)
        self.out = nn.Conv2d(16, 8, 3, padding=1)
        self.fc = nn.Linear(8, 5)

    def forward(self, x):
        y = self.out(torch.relu(self.attn(self.stem(x))))
        return self.fc(y.mean((2, 3)))


SMALL = {"halo_attn": (lambda: Halo(), (2, 3, 16, 24)),
         "halo_attn_stride2": (lambda: Halo(stride=2), (2, 3, 16, 16))}
"""Small HaloAttn models and their inputs (every tile holds whole blocks under both plans)."""


def _coverage(rp: fxpar.RankProgram) -> Coverage:
    return rp.program.traced.meta[Coverage.KEY]


def small_case(name: str, plan: str) -> None:
    build, shape = SMALL[name]
    rp = check(Case(build, shape, PLANS[plan]))
    if rp is not None:
        cov = _coverage(rp)
        assert cov.share > 0.999 and not cov.ended, (name, plan, cov)


for _name in SMALL:
    for _plan in PLANS:
        globals()[f"case_{_name}_{_plan}"] = (lambda n=_name, p=_plan: small_case(n, p))


def halonet_case(plan: str) -> None:
    def build() -> nn.Module:
        import timm

        return timm.create_model("halonet26t", num_classes=5, pretrained=False, img_size=256)

    rp = check(Case(build, (1, 3, 256, 256), PLANS[plan]))
    if rp is None:
        return
    cov = _coverage(rp)
    print(f"coverage halonet26t {plan}: {cov.share:.4f} ({cov.ended})", flush=True)
    assert cov.share >= 0.95, (plan, cov)
    assert "stages.3.1.self_attn" in cov.ended and "whole windows" in cov.ended, cov.ended


for _plan in PLANS:
    globals()[f"case_halonet26t_256_{_plan}"] = (lambda p=_plan: halonet_case(p))


class Windows(nn.Module):
    """Overlapping windows by Tensor.unfold (5 rows every 2, 4 columns every 3: the last
    column in none), weighted by a softmax over each window's columns and summed: a pooling,
    whose (N, C, 6, 7) result is an image again (a 3x3 convolution on its tiles). ``conv``:
    of a 1x1 convolution's output, else of the model's input (whole on every rank)."""

    def __init__(self, conv: bool) -> None:
        super().__init__()
        self.a = nn.Conv2d(3, 4, 1) if conv else None
        self.b = nn.Conv2d(4 if conv else 3, 6, 3, padding=1)
        self.fc = nn.Linear(6, 5)

    def forward(self, x):
        if self.a is not None:
            x = torch.tanh(self.a(x))
        w = x.unfold(3, 4, 3).unfold(2, 5, 2)  # N, C, 6, 7, 5, 4
        y = (w.softmax(-1) * w).sum((-2, -1))
        return self.fc(self.b(y).mean((2, 3)))


def windows_case(conv: bool, plan: str) -> None:
    rp = check(Case(lambda: Windows(conv), (2, 3, 15, 23), PLANS[plan]))
    if rp is not None:
        cov = _coverage(rp)
        assert cov.share > 0.99 and not cov.ended, (plan, cov)


for _plan in PLANS:
    globals()[f"case_unfold_uneven_windows_of_the_input_{_plan}"] = \
        (lambda p=_plan: windows_case(False, p))
    globals()[f"case_unfold_uneven_windows_of_a_tile_{_plan}"] = \
        (lambda p=_plan: windows_case(True, p))


def _first_column_zeroed(x: torch.Tensor, dim: int) -> torch.Tensor:
    keep = torch.ones_like(x)
    keep.narrow(dim, 0, 1).zero_()
    return x * keep


def case_halo_one_column_short_is_caught() -> None:
    """Tile 1 loses the first column of the halo its key windows take from tile 0 (zeros
    instead): the check must fail, at the first step's loss."""
    from helpers.equivalence import collect_failures

    from fxpar.comm.world import world
    from fxpar.passes import tile_tokens

    original = tile_tokens._unfold

    def short(gm, n, info, grid, t, halo):  # type: ignore[no-untyped-def]
        def halo_short(at: fx.Node, x: fx.Node, needs, wrap: bool) -> fx.Node:
            win = halo(at, x, needs, wrap)
            if t != 1:
                return win
            axis = next(i for i, p in enumerate(grid.parts) if p > 1)
            with gm.graph.inserting_before(at):
                return gm.graph.call_function(_first_column_zeroed, (win, 2 + axis))
        return original(gm, n, info, grid, t, halo_short)

    tile_tokens._unfold = short
    try:
        with collect_failures() as failures:
            check(Case(lambda: Halo(), (2, 3, 16, 24), PLANS["p2"]))
    finally:
        tile_tokens._unfold = original
    everyone = world().allgather_object(failures[:2])
    assert all(everyone[:2]), everyone
    assert everyone[0][0].startswith("step 0 loss: 1 of 1 elements differ"), everyone
    if world().rank == 0:
        print(f"a halo one column short caught: {everyone[0][0][:100]}", flush=True)
