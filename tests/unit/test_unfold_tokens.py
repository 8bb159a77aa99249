"""Tensor.unfold in a token layout (fxpar.frontend.rules.token_ops.unfold): HaloNet's
overlapping key windows run on tiles when every tile holds whole blocks (a halo brings the
cells its windows reach past its edge), and end the region with the reason when they do not."""

from __future__ import annotations

import warnings

import torch
from torch import nn

import fxpar
from fxpar.core import meta
from fxpar.frontend.rules.tokens import TokenLayout
from fxpar.passes.spatial_region import Coverage


class Halo(nn.Module):
    def __init__(self, block: int = 4) -> None:
        super().__init__()
        from timm.layers.halo_attn import HaloAttn

        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.attn = HaloAttn(8, 8, num_heads=2, block_size=block, halo_size=1)

    def forward(self, x):
        return self.attn(self.stem(x))


def _traced(model: nn.Module, shape: tuple[int, ...], **plan: object) -> torch.fx.GraphModule:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fxpar.compile(model.double(), fxpar.Plan(**plan),  # type: ignore[arg-type]
                             torch.empty(shape, dtype=torch.float64, device="meta")).traced


def test_key_windows_along_a_split_dim_are_unfolded_on_each_tile_with_a_halo():
    gm = _traced(Halo(), (1, 3, 8, 16), spatial_parts=2, slice="vertical")
    unfolds = [meta.get(n, TokenLayout) for n in gm.graph.nodes if "unfold" in n.name]
    # along H (not split): on the tile as it is; along W (split): the tile's windows + a halo
    assert [u.action for u in unfolds] == ["", "unfold"]
    # (N, C, windows along H, windows along W, inside a window along H, ... along W)
    assert unfolds[1].layout == ((), (), ((0, 2),), ((1, 4),), (), ())
    cov = gm.meta[Coverage.KEY]
    assert not cov.ended and cov.share == 1.0


def test_blocks_that_cross_the_tiles_edges_end_the_region_with_the_reason():
    gm = _traced(Halo(), (1, 3, 8, 20), spatial_parts=2, slice="vertical")  # tiles of 10
    cov = gm.meta[Coverage.KEY]
    assert cov.share < 0.5 and "tiles hold whole windows" in cov.ended, cov.ended


def test_one_window_over_the_whole_map_ends_the_region_with_the_reason():
    gm = _traced(Halo(block=8), (1, 3, 8, 8), spatial_parts=2, slice="vertical")
    cov = gm.meta[Coverage.KEY]
    assert "tiles hold whole windows" in cov.ended, cov.ended
