"""More ops on tiles (issue 40, item 4) vs one process in float64 (run by tests/mpi/test_ops40.py):
global response norms (vector norms over H, W and D, H, W, zero norms included), adaptive max
pooling to 1, to a size that divides the map and to one that does not (ties: the gradient goes
to ATen's first cell), pixel_shuffle / pixel_unshuffle with tile boundaries off the block grid,
timm's SpaceToDepth and DepthToSpace chains; then ConvNeXt-V2 (GRN) and TResNet (SpaceToDepth)
from timm under SP2 and SP4, with the share of their work on tiles. Every case checks loss,
every gradient, parameters after 2 SGD steps with momentum and every buffer
(tests/helpers/transparency.py). A norm that leaves out one cell of one tile is caught."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from helpers.transparency import Case, check
from torch import nn

import fxpar
from fxpar.passes.spatial_region import Coverage

P = fxpar.Plan
PLANS = {"p2": P(spatial_parts=2, slice="vertical"), "p4": P(spatial_parts=4, slice="square")}


class Head(nn.Module):
    """conv -> ``op`` -> conv -> global mean -> linear (2-D or 3-D)."""

    def __init__(self, op: nn.Module, cin: int = 3, mid: int = 6, cout: int = 6,
                 nd: int = 2) -> None:
        super().__init__()
        conv = nn.Conv2d if nd == 2 else nn.Conv3d
        self.a, self.op, self.b = conv(cin, mid, 3, padding=1), op, conv(cout, 4, 3, padding=1)
        self.fc = nn.Linear(4, 5)

    def forward(self, x):
        y = self.b(self.op(torch.tanh(self.a(x))))
        return self.fc(y.mean(tuple(range(2, y.dim()))))


class Grn(nn.Module):
    """timm's GlobalResponseNorm on NCHW (``x.norm(p=2, dim=(2, 3))``), MedNeXt's on volumes
    (``torch.norm(x, p=2, dim=(-3, -2, -1))``), or another order. ``zero``: channel 0 is
    zeroed first, so its norm is 0 and its gradient must be torch's (0, not nan)."""

    def __init__(self, c: int = 6, nd: int = 2, ord: float = 2.0, zero: bool = False) -> None:
        super().__init__()
        shape = (1, c) + (1,) * nd
        self.gamma = nn.Parameter(torch.linspace(0.5, 1.5, c).view(shape))
        self.beta = nn.Parameter(torch.linspace(-0.2, 0.2, c).view(shape))
        self.register_buffer("mask", torch.ones(shape))
        if zero:
            self.mask[:, 0] = 0
        self.nd, self.ord = nd, ord

    def forward(self, x):
        x = x * self.mask
        dims = (2, 3) if self.nd == 2 else (-3, -2, -1)
        g = x.norm(p=self.ord, dim=dims, keepdim=True) if self.nd == 2 else \
            torch.norm(x, p=self.ord, dim=dims, keepdim=True)
        n = g / (g.mean(dim=1, keepdim=True) + 1e-6)
        return self.gamma * (x * n) + self.beta + x


class AdaptiveMax(nn.Module):
    """Adaptive max pooling to ``size``, upsampled back and added; ``ties``: the cells above
    0.2 become exactly 0.2 (a straight-through clamp), so each bin's maximum ties over many
    cells across tiles and only the first (ATen's index) may take the gradient."""

    def __init__(self, size, ties: bool = False) -> None:
        super().__init__()
        self.size, self.ties = size, ties

    def forward(self, x):
        if self.ties:
            x = torch.where(x > 0.2, x - x.detach() + 0.2, x)
        pool = F.adaptive_max_pool2d if x.dim() == 4 else F.adaptive_max_pool3d
        mode = "nearest"
        return x + F.interpolate(pool(x, self.size), size=x.shape[2:], mode=mode)


class Shuffles(nn.Module):
    """pixel_unshuffle(r) -> conv -> pixel_shuffle(r): on odd images (15 x 21 with r = 3) the
    input tiles' boundaries are not multiples of r."""

    def __init__(self, r: int, c: int = 6) -> None:
        super().__init__()
        self.r, self.conv = r, nn.Conv2d(c * r * r, c * r * r, 3, padding=1)

    def forward(self, x):
        return F.pixel_shuffle(torch.relu(self.conv(F.pixel_unshuffle(x, self.r))), self.r)


class Timm(nn.Module):
    """timm's SpaceToDepth (4) and DepthToSpace (2) around a convolution."""

    def __init__(self, c: int = 3) -> None:
        super().__init__()
        from timm.layers.space_to_depth import DepthToSpace, SpaceToDepth

        self.s2d, self.d2s = SpaceToDepth(4), DepthToSpace(2)
        self.conv = nn.Conv2d(16 * c, 24, 3, padding=1)

    def forward(self, x):
        return self.d2s(self.conv(self.s2d(x)))


OPS = {  # name -> (model, input shape)
    "grn": (lambda: Head(Grn()), (2, 3, 15, 13)),
    "grn_zero_norm": (lambda: Head(Grn(zero=True)), (2, 3, 15, 13)),
    "norm_ord1_inf": (lambda: Head(nn.Sequential(Grn(ord=1.0), Grn(ord=float("inf")))),
                      (2, 3, 15, 13)),
    "adaptive_max_1_ties": (lambda: Head(AdaptiveMax(1, ties=True)), (2, 3, 15, 13)),
    "adaptive_max_divides": (lambda: Head(AdaptiveMax((5, 4))), (2, 3, 15, 12)),
    "adaptive_max_bins_ties": (lambda: Head(AdaptiveMax((4, 5), ties=True)), (2, 3, 15, 13)),
    "pixel_shuffles": (lambda: Head(Shuffles(3)), (2, 3, 15, 21)),
    "space_to_depth": (lambda: Head(Timm(6), mid=6, cout=6), (2, 3, 20, 28)),
}


def _joins(rp: fxpar.RankProgram) -> list[str]:
    """The joins in this rank's stages: where the image is put together on every rank."""
    return [name for s in rp.stages.values() for name, _ in s.named_children()
            if name.startswith("fxpar_join")]


def op_case(name: str, plan: str) -> None:
    build, shape = OPS[name]
    rp = check(Case(build, shape, PLANS[plan]))
    assert rp is None or not _joins(rp), f"{name} joins the image: {_joins(rp)}"


for _name in OPS:
    for _plan in PLANS:
        globals()[f"case_{_name}_{_plan}"] = (lambda n=_name, p=_plan: op_case(n, p))


def case_volume_grn_and_adaptive_max_p4_pencil() -> None:
    """MedNeXt's GRN over D, H, W and adaptive max pooling of a volume to bins that do not
    divide it, on 2 x 2 pencils of an odd volume."""
    def build() -> nn.Module:
        return Head(nn.Sequential(Grn(nd=3), AdaptiveMax((2, 3, 2), ties=True)), cin=2, nd=3)

    rp = check(Case(build, (2, 2, 7, 9, 6), P(spatial_parts=4, slice="pencil")))
    assert rp is None or not _joins(rp), _joins(rp)


LIBRARY = {"convnextv2_atto": 64, "tresnet_m": 64}
"""timm models and the image side they train at (ConvNeXt-V2: a GRN in every block; TResNet:
SpaceToDepth is its first op)."""


def library_case(model: str, plan: str) -> None:
    def build() -> nn.Module:
        import timm

        return timm.create_model(model, num_classes=5, pretrained=False)

    side = LIBRARY[model]
    rp = check(Case(build, (2, 3, side, side), PLANS[plan]))
    if rp is None:
        return
    cov = rp.program.traced.meta[Coverage.KEY]
    print(f"coverage {model} {plan}: {cov.share:.4f} ({cov.ended or 'whole model'})")
    assert cov.share >= 0.95, (model, plan, cov)
    assert not _joins(rp), f"{model} under {plan} joins the image: {_joins(rp)}"


for _model in LIBRARY:
    for _plan in PLANS:
        globals()[f"case_{_model}_{_plan}"] = (lambda m=_model, p=_plan: library_case(m, p))


def case_norm_missing_one_cell_is_caught() -> None:
    """Rank 1's tile leaves out one cell from its sum of squares in every global response
    norm: the check must fail, on every rank (the norm is replicated), at the first step."""
    from helpers.equivalence import collect_failures

    from fxpar.comm.world import world
    from fxpar.runtime.spatial import reduce

    original = reduce.vector_norm

    def off_by_one_cell(x, dims, ord, key):  # type: ignore[no-untyped-def]
        if world().rank == 1:
            keep = torch.ones_like(x)
            keep[..., -1, -1] = 0
            x = x * keep
        return original(x, dims, ord, key)

    reduce.vector_norm = off_by_one_cell
    try:
        with collect_failures() as failures:
            check(Case(lambda: Head(Grn()), (2, 3, 15, 13), PLANS["p2"]))
    finally:
        reduce.vector_norm = original
    everyone = world().allgather_object(failures[:2])
    assert all(everyone[:2]), everyone
    assert everyone[0][0].startswith("step 0 loss: 1 of 1 elements differ"), everyone
    if world().rank == 0:
        print(f"a norm missing one cell caught: {everyone[0][0][:100]}", flush=True)
