"""Tokens are pixels (issue 40): blocks that flatten the image into tokens and come back, under
a real mpiexec, exact vs one process in float64 (tests/helpers/transparency.py: loss, every
gradient, parameters after 2 steps, buffers). Each model is small and built here; the library
models that use the same blocks are in tests/mpi/cases/attention_models_cases.py."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from helpers.attention_models import ClassToken
from helpers.transparency import Case, check
from torch import nn

import fxpar
from fxpar.passes.spatial_region import Coverage


class TokenMLP(nn.Module):
    """conv -> tokens (N, H*W, C) + a learned position embedding over every token -> LayerNorm,
    MLP, residual -> back to (N, C, H, W) -> conv -> head."""

    def __init__(self, h: int, w: int, c: int = 6) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, c, 3, padding=1)
        self.pos = nn.Parameter(torch.randn(1, h * w, c) * 0.1)
        self.norm = nn.LayerNorm(c)
        self.mlp = nn.Sequential(nn.Linear(c, 2 * c), nn.GELU(), nn.Linear(2 * c, c))
        self.conv = nn.Conv2d(c, c, 3, padding=1)
        self.head = nn.Linear(c, 5)

    def forward(self, x):
        x = self.stem(x)
        n, c, h, w = x.shape
        t = x.flatten(2).transpose(1, 2) + self.pos
        t = t + self.mlp(self.norm(t))
        x = t.transpose(1, 2).reshape(n, c, h, w)
        return self.head(self.conv(x).relu().mean((2, 3)))


class GRN(nn.Module):
    """MedNeXt's global response norm on (N, C, H, W): a vector norm over H and W."""

    def __init__(self, c: int = 6) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, c, 3, padding=1)
        self.gamma = nn.Parameter(torch.randn(1, c, 1, 1) * 0.1)
        self.beta = nn.Parameter(torch.randn(1, c, 1, 1) * 0.1)
        self.conv = nn.Conv2d(c, 3, 3, padding=1)

    def forward(self, x):
        x = self.stem(x)
        gx = torch.norm(x, p=2, dim=(-2, -1), keepdim=True)
        nx = gx / (gx.mean(dim=1, keepdim=True) + 1e-6)
        return self.conv(self.gamma * (x * nx) + self.beta + x)


class ViTBlock(nn.Module):
    """A patch embedding (strided conv), one pre-norm transformer block with global multi-head
    attention (F.scaled_dot_product_attention: ring attention on tiles), back to an image,
    a segmentation head."""

    def __init__(self, c: int = 8, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.embed = nn.Conv2d(3, c, 2, stride=2)
        self.norm1, self.norm2 = nn.LayerNorm(c), nn.LayerNorm(c)
        self.qkv, self.proj = nn.Linear(c, 3 * c), nn.Linear(c, c)
        self.mlp = nn.Sequential(nn.Linear(c, 2 * c), nn.GELU(), nn.Linear(2 * c, c))
        self.out = nn.Conv2d(c, 3, 3, padding=1)

    def forward(self, x):
        x = self.embed(x)
        n, c, h, w = x.shape
        t = x.flatten(2).transpose(1, 2)
        q, k, v = self.qkv(self.norm1(t)).reshape(n, h * w, 3, self.heads, c // self.heads) \
            .permute(2, 0, 3, 1, 4).unbind(0)
        a = F.scaled_dot_product_attention(q, k, v)
        t = t + self.proj(a.transpose(1, 2).reshape(n, h * w, c))
        t = t + self.mlp(self.norm2(t))
        x = t.transpose(1, 2).reshape(n, c, h, w)
        return F.interpolate(self.out(x), scale_factor=2.0, mode="bilinear")



class LinearAttention(nn.Module):
    """EfficientViT's ReLU linear attention: k^T v summed over every token (a product over a
    split dim), then per token q (k^T v) / q (sum k)."""

    def __init__(self, c: int = 8) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, c, 3, padding=1)
        self.qkv = nn.Linear(c, 3 * c)
        self.out = nn.Conv2d(c, 3, 3, padding=1)

    def forward(self, x):
        x = self.stem(x)
        n, c, h, w = x.shape
        q, k, v = self.qkv(x.flatten(2).transpose(1, 2)).relu().chunk(3, dim=-1)
        kv = k.transpose(-2, -1) @ v
        ksum = k.sum(dim=1, keepdim=True)
        t = (q @ kv) / ((q * ksum).sum(-1, keepdim=True) + 1e-3)
        return self.out(t.transpose(1, 2).reshape(n, c, h, w))


class EfficientAttention(nn.Module):
    """SegFormer's efficient self-attention, written out: queries from every token, keys and
    values from the map reduced by a strided convolution (another resolution), scores
    ``(q @ k^T) * scale``, softmax, ``@ v``; then MONAI's einsum form of the same."""

    def __init__(self, c: int = 8, heads: int = 2, sr: int = 2, einsum: bool = False) -> None:
        super().__init__()
        self.heads, self.einsum, self.scale = heads, einsum, (c // heads) ** -0.5
        self.stem = nn.Conv2d(3, c, 3, padding=1)
        self.q, self.kv, self.proj = nn.Linear(c, c), nn.Linear(c, 2 * c), nn.Linear(c, c)
        self.sr, self.norm = nn.Conv2d(c, c, sr, stride=sr), nn.LayerNorm(c)
        self.drop = nn.Dropout(0.0)
        self.out = nn.Conv2d(c, 3, 3, padding=1)

    def forward(self, x):
        x = self.stem(x)
        n, c, h, w = x.shape
        t = x.flatten(2).transpose(1, 2)
        q = self.q(t).reshape(n, h * w, self.heads, c // self.heads).permute(0, 2, 1, 3)
        r = self.norm(self.sr(t.permute(0, 2, 1).reshape(n, c, h, w)).reshape(n, c, -1)
                      .permute(0, 2, 1))
        k, v = self.kv(r).reshape(n, -1, 2, self.heads, c // self.heads) \
            .permute(2, 0, 3, 1, 4)
        if self.einsum:
            a = torch.einsum("blxd,blyd->blxy", q, k) * self.scale
            a = self.drop(a.softmax(dim=-1))
            o = torch.einsum("bhxy,bhyd->bhxd", a, v)
        else:
            a = self.drop(((q @ k.transpose(-2, -1)) * self.scale).softmax(dim=-1))
            o = a @ v
        t = t + self.proj(o.transpose(1, 2).reshape(n, h * w, c))
        return self.out(t.transpose(1, 2).reshape(n, c, h, w))


class BiasMap(nn.Module):
    """A learned bias map over the rows only, (1, C, H, 1), added to a horizontally split
    image: each tile adds its rows of it."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.head = nn.Conv2d(3, 4, 3, padding=1), nn.Conv2d(4, 3, 3, padding=1)
        self.bias = nn.Parameter(torch.randn(1, 4, 11, 1))

    def forward(self, x):
        return self.head(self.conv(x) + self.bias)


class SoftmaxW(nn.Module):
    """A softmax along W (split by vertical strips) between two convolutions: the maximum and
    the exponentials' sum over every tile."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Conv2d(3, 4, 3, padding=1), nn.Conv2d(4, 3, 3, padding=1)

    def forward(self, x):
        return self.b(self.a(x).softmax(3))


class GridAttention(nn.Module):
    """MaxViT's block and grid attention (timm maxxvit's window_partition / grid_partition)
    on (N, H, W, C) with a learned bias per head over the partition's cells, given to
    ``F.scaled_dot_product_attention`` as its mask: a block's cells stay on a tile, a grid
    window's cells are one from every (H / g) x (W / g) block, so its keys span the tiles
    (ring attention, the bias's columns in the ring's order)."""

    def __init__(self, g: int = 2, c: int = 4, heads: int = 2) -> None:
        super().__init__()
        self.g, self.heads = g, heads
        self.stem, self.out = nn.Conv2d(3, c, 3, padding=1), nn.Conv2d(c, 3, 3, padding=1)
        self.qkv = nn.ModuleList(nn.Linear(c, 3 * c) for _ in range(2))
        self.bias = nn.Parameter(torch.randn(2, heads, g * g, g * g))

    def _attend(self, x, i):
        b, n, c = x.shape
        q, k, v = self.qkv[i](x).view(b, n, 3, self.heads, c // self.heads) \
            .permute(2, 0, 3, 1, 4).unbind(0)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=self.bias[i])
        return x + y.transpose(1, 2).reshape(b, n, c)

    def forward(self, x):
        x = self.stem(x).permute(0, 2, 3, 1)
        n, h, w, c = x.shape
        g = self.g
        t = x.view(n, h // g, g, w // g, g, c).permute(0, 1, 3, 2, 4, 5).reshape(-1, g * g, c)
        t = self._attend(t, 0).view(n, h // g, w // g, g, g, c).permute(0, 1, 3, 2, 4, 5)
        x = t.reshape(n, g, h // g, g, w // g, c).permute(0, 2, 4, 1, 3, 5).reshape(-1, g * g, c)
        x = self._attend(x, 1).view(n, h // g, w // g, g, g, c).permute(0, 3, 1, 4, 2, 5)
        return self.out(x.reshape(n, h, w, c).permute(0, 3, 1, 2))


P = fxpar.Plan


def run(build, shape, plan, segmentation=False, classes=5, floor=0.99):
    rp = check(Case(build, shape, plan, classes=classes, segmentation=segmentation))
    if rp is None:
        return
    cov = rp.program.traced.meta[Coverage.KEY]
    print(f"coverage {cov.share:.4f} ({cov.ended or 'whole model'})")
    assert cov.share >= floor, f"coverage {cov.share:.3f} < {floor}: {cov.ended}"


def case_token_mlp_p2_vertical_odd():
    run(lambda: TokenMLP(13, 11), (2, 3, 13, 11), P(spatial_parts=2, slice="vertical"))


def case_token_mlp_p4_square():
    run(lambda: TokenMLP(10, 9), (2, 3, 10, 9), P(spatial_parts=4, slice="square"))


def case_grn_p3_horizontal():
    run(GRN, (2, 3, 11, 8), P(spatial_parts=3, slice="horizontal"), segmentation=True,
        classes=3)


def case_vit_ring_attention_p2():
    run(ViTBlock, (2, 3, 12, 10), P(spatial_parts=2, slice="vertical"), segmentation=True,
        classes=3)


def case_vit_ring_attention_p4_square_uneven():
    run(ViTBlock, (1, 3, 14, 10), P(spatial_parts=4, slice="square"), segmentation=True,
        classes=3)


def case_class_token_cross_attention_p3():
    run(ClassToken, (2, 3, 9, 8), P(spatial_parts=3, slice="horizontal"))


def case_linear_attention_p4_square():
    run(LinearAttention, (2, 3, 9, 10), P(spatial_parts=4, slice="square"), segmentation=True,
        classes=3)


def case_vit_sp2_pp2():
    run(ViTBlock, (4, 3, 12, 10), P(stages=2, spatial_parts=2, microbatches=2), segmentation=True,
        classes=3, floor=0.0)


def case_segformer_attention_written_out_p2():
    run(EfficientAttention, (2, 3, 12, 10), P(spatial_parts=2, slice="vertical"),
        segmentation=True, classes=3)


def case_einsum_attention_p4_square():
    run(lambda: EfficientAttention(einsum=True), (1, 3, 12, 12),
        P(spatial_parts=4, slice="square"), segmentation=True, classes=3)


def case_bias_map_over_split_rows_p3():
    run(BiasMap, (2, 3, 11, 7), P(spatial_parts=3, slice="horizontal"), segmentation=True,
        classes=3)


def case_softmax_over_split_w_p3():
    run(SoftmaxW, (2, 3, 7, 11), P(spatial_parts=3, slice="vertical"), segmentation=True,
        classes=3)


def case_token_mlp_sp2_dp2():
    run(lambda: TokenMLP(12, 10), (4, 3, 12, 10), P(spatial_parts=2, data_parallel=2))


def case_grid_attention_bias_p2():
    run(GridAttention, (2, 3, 8, 12), P(spatial_parts=2, slice="vertical"), segmentation=True,
        classes=3)


def case_grid_attention_bias_p4_square():
    run(lambda: GridAttention(heads=1), (1, 3, 12, 8), P(spatial_parts=4, slice="square"),
        segmentation=True, classes=3)


def case_grid_bias_columns_out_of_ring_order_caught():
    """Every tile takes the bias's key columns in reversed rank order: the ring attends to
    the right keys with the wrong bias, which the check must catch on every rank."""
    from helpers.equivalence import collect_failures

    from fxpar.comm.world import world
    from fxpar.runtime.spatial.tokens import GroupCells

    original = GroupCells.forward

    def reversed_ranks(self, x):  # type: ignore[no-untyped-def]
        return original(self, x).flip(self.dim)

    GroupCells.forward = reversed_ranks  # type: ignore[method-assign]
    try:
        with collect_failures() as failures:
            check(Case(GridAttention, (2, 3, 8, 12), P(spatial_parts=2, slice="vertical"),
                       classes=3, segmentation=True))
    finally:
        GroupCells.forward = original  # type: ignore[method-assign]
    everyone = world().allgather_object(failures[:1])
    assert all(everyone[:2]), everyone
    if world().rank == 0:
        print(f"bias columns out of the ring's order caught: {everyone[0][0][:100]}",
              flush=True)


torch.set_num_threads(1)
