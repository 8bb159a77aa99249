"""Attention over the tiles in the compile-time message accounting and the cost model (issue 40
item 3): ring attention's bytes (``ring_bytes``) and gathered attention's allreduces in a
stage's communication estimate (fxpar.perf.costmodel, fxpar.perf.attention_comm), the tags of
ring attentions (fxpar.runtime.spatial.tags), and what ``fxpar-inspect --after halo`` says of
them. No MPI."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from helpers.attention_models import ClassToken
from torch import nn

import fxpar
from fxpar.compiler.passdriver import dump
from fxpar.core.geometry import tile
from fxpar.passes.spatial_region import image_grid
from fxpar.perf.attention_comm import Traffic, attention_traffic
from fxpar.perf.costmodel import _middle_tile, halo_messages, stage_seconds
from fxpar.perf.profile import Link, Profile
from fxpar.runtime.spatial.attention import GatherAttention, RingAttention, ring_bytes
from fxpar.runtime.spatial.tags import max_tag, tag_owners


def _profile() -> Profile:
    return Profile(name="test", device="cpu", conv_flops=1e10, matmul_flops=1e10, mem_bytes=1e9,
                   op_s=0.0, p2p_intra=Link(1e-3, 1e-9), p2p_inter=Link(1e-2, 1e-8),
                   allreduce_intra=Link(1e-4, 1e-8), allreduce_inter=Link(1e-3, 1e-8),
                   ranks_per_node=4)


class ViT(nn.Module):
    """A patch embedding, ``blocks`` pre-norm blocks of global multi-head attention (SDPA:
    ring attention on tiles), back to an image (tests/mpi/cases/tokens_cases.py's ViTBlock)."""

    def __init__(self, c: int = 8, heads: int = 2, blocks: int = 1) -> None:
        super().__init__()
        self.heads = heads
        self.embed = nn.Conv2d(3, c, 2, stride=2)
        self.norms = nn.ModuleList(nn.LayerNorm(c) for _ in range(blocks))
        self.qkvs = nn.ModuleList(nn.Linear(c, 3 * c) for _ in range(blocks))
        self.out = nn.Conv2d(c, 3, 3, padding=1)

    def forward(self, x):
        x = self.embed(x)
        n, c, h, w = x.shape
        t = x.flatten(2).transpose(1, 2)
        for norm, qkv in zip(self.norms, self.qkvs, strict=True):
            q, k, v = qkv(norm(t)).reshape(n, h * w, 3, self.heads, c // self.heads) \
                .permute(2, 0, 3, 1, 4).unbind(0)
            t = t + F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(n, h * w, c)
        return self.out(t.transpose(1, 2).reshape(n, c, h, w))



def _compile(model: nn.Module, shape: tuple[int, ...], **plan) -> fxpar.Program:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fxpar.compile(model, fxpar.Plan(**plan), torch.empty(shape, device="meta"))


def _attention_nodes(program: fxpar.Program) -> list[torch.fx.Node]:
    return [n for n in program.traced.graph.nodes
            if "scaled_dot_product_attention" in str(n.target)]


def _halo_bytes(program: fxpar.Program, t: int) -> int:
    gm, grid = program.traced, image_grid(program.traced)
    return sum(halo_messages(gm, n, grid, t)[2] for n in gm.graph.nodes
               if n.op == "call_function")


@pytest.mark.parametrize("parts,slice_", [(2, "vertical"), (4, "square")])
def test_a_vit_stage_is_charged_its_ring_attention_bytes(parts, slice_):
    """ViT on a 14x10 image: 7x5 patches (35 tokens), batch 2 x 2 heads x width 4 (float32).
    The stage's bytes are its halos' and ``ring_bytes`` for the tile the cost model prices
    (the middle one), forward and backward; the ring's messages and bytes make its seconds."""
    program = _compile(ViT(), (2, 3, 14, 10), spatial_parts=parts, slice=slice_)
    grid = image_grid(program.traced)
    t = _middle_tile(grid)
    rows = [tile(7, grid.parts[0], i) for i in range(grid.parts[0])]
    cols = [tile(5, grid.parts[1], j) for j in range(grid.parts[1])]
    lengths = [(r1 - r0) * (c1 - c0) for r0, r1 in rows for c0, c1 in cols]
    fwd, bwd = ring_bytes(lengths, t, 2 * 2, 4, 4, torch.float32)
    assert fwd and bwd > fwd
    st = stage_seconds(program, _profile())[0]
    halos = _halo_bytes(program, t)
    assert st.sent_f == halos + fwd and st.sent_b == halos + bwd
    p2p = _profile().p2p_intra
    ring_f = 4 * (parts - 1) * p2p.alpha + fwd * p2p.beta
    ring_b = (4 * (parts - 1) + 4 * parts) * p2p.alpha + bwd * p2p.beta
    assert st.comm_b - st.comm_f == pytest.approx(ring_b - ring_f)
    assert st.f - st.comm_f > 0 and st.comm_f >= ring_f


def test_a_class_tokens_allreduces_are_charged():
    """Replicated queries (1 row per sample, width 8, float32, 2 samples): forward allreduces the
    row maxima and the rescaled sums (float32: 2 x 4 B and 2 x 9 x 4 B), backward the output's
    gradient (2 x 8 x 4 B), each ceil(log2 3) = 2 rounds of the allreduce link."""
    program = _compile(ClassToken(), (2, 3, 9, 8), spatial_parts=3, slice="horizontal")
    gm, grid = program.traced, image_grid(program.traced)
    node, = _attention_nodes(program)
    fwd, bwd = attention_traffic(gm, node, grid, 1)
    assert fwd == Traffic(allreduces=(2 * 4, 2 * 9 * 4)) and bwd == Traffic(allreduces=(64,))
    ar = _profile().allreduce_intra
    assert fwd.seconds(_profile().p2p_intra, ar, 3) == pytest.approx(
        2 * (ar.seconds(8) + ar.seconds(72)))
    st = stage_seconds(program, _profile())[0]
    assert st.sent_f == _halo_bytes(program, 1) + 80
    assert st.sent_b == _halo_bytes(program, 1) + 64


def test_attention_on_one_rank_or_outside_the_region_costs_nothing():
    program = _compile(ViT(), (2, 3, 14, 10), stages=2)
    st = stage_seconds(program, _profile())
    assert all(s.sent_f == s.sent_b == 0 and s.comm_f == 0 for s in st.values())


def test_two_ring_attentions_in_one_stage_get_tags_of_their_own():
    program = _compile(ViT(blocks=2), (2, 3, 14, 10), spatial_parts=2, slice="vertical")
    tile0 = program.spatial.tile(0, 0)
    rings = [m for m in tile0.modules() if isinstance(m, RingAttention)]
    assert len(rings) == 2
    owners = tag_owners(tile0)  # every tag of the stage, one op each
    tags = {t for r in rings for t in (r.tag, r.tag + 1)}
    assert len(tags) == 4 and tags <= set(owners)
    assert max_tag(tile0) >= max(tags)
    # the same tags on every tile: the ring's messages match
    tile1 = program.spatial.tile(0, 1)
    assert [r.tag for r in tile1.modules() if isinstance(r, RingAttention)] == \
        [r.tag for r in rings]


def test_a_tag_shared_by_two_tile_ops_is_a_compiler_bug():
    stage = nn.Module()
    stage.ring = RingAttention("tiles", [4, 4], tag=12)
    stage.other = RingAttention("tiles", [4, 4], tag=13)
    with pytest.raises(AssertionError, match=r"'ring' and 'other' .* MPI tag 13"):
        tag_owners(stage)
    stage.other = RingAttention("tiles", [4, 4], tag=14)
    stage.gather = GatherAttention("tiles")  # allreduces: no tag
    assert tag_owners(stage) == {12: "ring", 13: "ring", 14: "other", 15: "other"}


def test_inspect_says_what_ring_attention_sends():
    program = _compile(ViT(), (2, 3, 14, 10), spatial_parts=2, slice="vertical")
    text = dump("halo", program.spatial.tile(0, 0))
    line = next(x for x in text.splitlines() if "RingAttention" in x)
    assert "ring attention over 2 tiles' tokens [14, 21]" in line
    assert "K, V go round in 1 step(s), dK, dV back in 2; tags" in line
    assert math.prod((7, 5)) == 14 + 21
