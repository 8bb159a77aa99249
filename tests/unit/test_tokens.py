"""Token layouts in the spatial region (fxpar.frontend.rules.tokens): which blocks leave the
(N, C, H, W) form and still run on tiles, the layouts they get, and the blocks that end the
region where they start because one op in them cannot run on tiles."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxpar
from fxpar.core import meta
from fxpar.frontend.rules.tokens import Probs, Scores, TokenLayout
from fxpar.passes.spatial_region import Coverage, SpatialLayout


def _traced(model: nn.Module, shape: tuple[int, ...], parts: int = 2) -> torch.fx.GraphModule:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        program = fxpar.compile(model.double(), fxpar.Plan(spatial_parts=parts),
                                torch.empty(shape, dtype=torch.float64, device="meta"))
    return program.traced


class Tokens(nn.Module):
    def __init__(self, attend: str = "sdpa") -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 4, 3, padding=1)
        self.norm, self.qkv = nn.LayerNorm(4), nn.Linear(4, 12)
        self.attend = attend

    def forward(self, x):
        x = self.stem(x)
        n, c, h, w = x.shape
        t = x.flatten(2).transpose(1, 2)
        q, k, v = self.qkv(self.norm(t)).chunk(3, dim=-1)
        if self.attend == "sdpa":
            t = t + F.scaled_dot_product_attention(q, k, v)
        elif self.attend == "written":
            t = t + ((q @ k.transpose(-2, -1)) * 0.5).softmax(-1) @ v
        elif self.attend == "softmax over tokens":  # not attention: a softmax over split keys
            t = t + (q @ k.transpose(-2, -1)).softmax(-1).sum(-1, keepdim=True)
        return t.transpose(1, 2).reshape(n, c, h, w)


def _by_name(gm: torch.fx.GraphModule) -> dict[str, torch.fx.Node]:
    return {n.name: n for n in gm.graph.nodes}


def test_tokens_keep_the_tile_layout_and_come_back_to_the_image():
    gm = _traced(Tokens(), (1, 3, 8, 6))
    nodes = _by_name(gm)
    flat = meta.get(nodes["flatten"], TokenLayout)
    assert flat.layout == ((), (), ((0, 8), (1, 6)))  # H and W flattened, row-major
    assert meta.get(nodes["transpose"], TokenLayout).layout == ((), ((0, 8), (1, 6)), ())
    attn = next(n for n in gm.graph.nodes if "scaled_dot_product" in str(n.target))
    assert meta.get(attn, TokenLayout).action == "ring"
    back = next(n for n in gm.graph.nodes if n.op == "call_function" and
                n.target == torch.ops.aten.reshape.default)
    assert meta.get(back, SpatialLayout) == SpatialLayout(True)  # the image again
    assert gm.meta[Coverage.KEY].share == 1.0


def test_attention_written_out_is_one_chain_ending_in_ring_attention():
    gm = _traced(Tokens("written"), (1, 3, 8, 6))
    records = [meta.find(n, TokenLayout) for n in gm.graph.nodes]
    actions = [r.action for r in records if r is not None]
    assert actions.count("ring") == 1 and actions.count("pending") >= 3
    scores = [r.layout[-1] for r in records if r is not None and r.action == "pending"]
    assert any(isinstance(s, Scores) for s in scores) and any(isinstance(s, Probs)
                                                              for s in scores)


def test_a_block_with_an_op_that_cannot_run_on_tiles_ends_the_region_where_it_starts():
    gm = _traced(Tokens("softmax over tokens"), (1, 3, 8, 6))
    nodes = _by_name(gm)
    assert meta.get(nodes["flatten"], SpatialLayout).reason.startswith("region ends at "
                                                                       "'flatten'")
    assert not any(meta.find(n, TokenLayout) for n in gm.graph.nodes)
    assert gm.meta[Coverage.KEY].share < 0.5


def test_a_whole_position_embedding_is_cut_to_the_tiles_cells():
    from fxpar.runtime.spatial.tokens import TileCells, cells

    assert cells(((0, 4), (1, 5)), ((1, 3), (2, 5))).tolist() == [7, 8, 9, 12, 13, 14]
    x = torch.arange(20.0).reshape(1, 20, 1)
    assert TileCells(1, ((0, 4), (1, 5)), ((1, 3), (2, 5)))(x).flatten().tolist() == \
        [7.0, 8.0, 9.0, 12.0, 13.0, 14.0]
    assert TileCells(1, ((0, 20),), ((5, 8),))(x).flatten().tolist() == [5.0, 6.0, 7.0]


@pytest.mark.parametrize("parts", [2, 4])
def test_grn_vector_norm_over_h_and_w_stays_spatial(parts):
    class GRN(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(3, 4, 3, padding=1)

        def forward(self, x):
            x = self.conv(x)
            g = torch.norm(x, p=2, dim=(-2, -1), keepdim=True)
            return x * (g / (g.mean(dim=1, keepdim=True) + 1e-6))

    gm = _traced(GRN(), (1, 3, 8, 8), parts)
    assert gm.meta[Coverage.KEY].share == 1.0 and not gm.meta[Coverage.KEY].ended


class Windows(nn.Module):
    """Swin's window partition and reverse on (N, H, W, C), attention inside each window."""

    def __init__(self, window: int) -> None:
        super().__init__()
        self.w = window
        self.stem = nn.Conv2d(3, 4, 3, padding=1)
        self.qkv = nn.Linear(4, 12)

    def forward(self, x):
        x = self.stem(x)
        n, c, h, w = x.shape
        s = self.w
        t = torch.roll(x.permute(0, 2, 3, 1), shifts=(-1, -1), dims=(1, 2))
        win = t.view(n, h // s, s, w // s, s, c).permute(0, 1, 3, 2, 4, 5).reshape(-1, s * s, c)
        q, k, v = self.qkv(win).chunk(3, dim=-1)
        win = ((q @ k.transpose(-2, -1)) * 0.5).softmax(-1) @ v
        t = win.view(n, h // s, w // s, s, s, c).permute(0, 1, 3, 2, 4, 5).reshape(n, h, w, c)
        return torch.roll(t, shifts=(1, 1), dims=(1, 2)).permute(0, 3, 1, 2)


def test_windows_that_tiles_hold_whole_are_attention_on_each_tile():
    gm = _traced(Windows(2), (1, 3, 8, 8), parts=4)
    assert gm.meta[Coverage.KEY].share == 1.0
    nodes = _by_name(gm)
    cut = meta.get(nodes["view"], TokenLayout)  # window index and position inside a window
    assert cut.layout == ((), ((0, 4),), ((-2, 2),), ((1, 4),), ((-3, 2),), ())
    rolls = [meta.get(n, TokenLayout) for n in gm.graph.nodes if "roll" in n.name]
    assert [r.action for r in rolls] == ["roll", "roll"]
    assert not any(r.action == "ring" for r in (meta.find(n, TokenLayout)
                                                for n in gm.graph.nodes) if r)


def test_windows_that_cross_the_tiles_edges_end_the_region_with_the_reason():
    gm = _traced(Windows(4), (1, 3, 12, 12), parts=2)  # 6-column tiles, windows of 4
    assert gm.meta[Coverage.KEY].share < 0.5
    assert "windows of 4 cells along a dim of 12 cross the tiles' edges (2 tiles)" in \
        gm.meta[Coverage.KEY].ended
    assert not any(meta.find(n, TokenLayout) for n in gm.graph.nodes)
