"""3-D spatial parallelism vs one process (run by tests/mpi/test_volumes3d.py): every 3-D op class
on slabs, pencils, cubes and uneven explicit grids with odd sizes, and whole volume models
(MONAI UNet / SegResNet / BasicUNet with spatial_dims=3, the zoo's 3D U-Net and CosmoFlow)
under 1 rank, SP2 depth slabs, SP4 pencils, SP8 cube, SP2+PP2 and SP2+DP2. Every case checks
loss, every gradient, parameters after 2 SGD steps with momentum and every buffer in float64
(tests/helpers/transparency.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from helpers.transparency import Case, assert_covers, check
from torch import nn

import fxpar
from fxpar import models

P = fxpar.Plan


class Head3d(nn.Module):
    """features -> global mean over D, H, W -> linear."""

    def __init__(self, body: nn.Module, channels: int, classes: int = 5) -> None:
        super().__init__()
        self.body = body
        self.fc = nn.Linear(channels, classes)

    def forward(self, x):
        return self.fc(F.adaptive_avg_pool3d(self.body(x), 1).flatten(1))


def convs() -> nn.Module:
    """Conv3d with padding, stride + groups, an asymmetric dilated kernel; BatchNorm3d with
    global statistics, group norm over volumes."""
    return Head3d(nn.Sequential(
        nn.Conv3d(2, 6, 3, padding=1), nn.BatchNorm3d(6), nn.ReLU(),
        nn.Conv3d(6, 6, 3, stride=2, padding=1, groups=2), nn.GroupNorm(3, 6), nn.SiLU(),
        nn.Conv3d(6, 4, (3, 1, 3), dilation=(2, 1, 2), padding=(2, 0, 1)),
        nn.InstanceNorm3d(4, affine=True), nn.ReLU()), 4)


class Pools(nn.Module):
    """Max pool with ceil_mode and padding, average pools with count_include_pad=False and
    ceil_mode, plain, adaptive to a size that divides and to one that does not (bins)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv3d(2, 4, 3, padding=1)
        self.fc = nn.Linear(4 * 2 * 3 * 2 + 4 * 8, 5)

    def forward(self, x):
        x = self.conv(x)
        x = F.max_pool3d(x, 3, stride=2, padding=1, ceil_mode=True)
        a = F.avg_pool3d(x, 3, stride=2, padding=1, ceil_mode=True, count_include_pad=False)
        b = F.avg_pool3d(torch.relu(x), 2, stride=1)
        bins = F.adaptive_avg_pool3d(a, (2, 3, 2))  # bins that overlap (replicated)
        even = F.adaptive_avg_pool3d(b, 2).flatten(1)
        return self.fc(torch.cat([bins.flatten(1), even], 1))


class Upsampling(nn.Module):
    """Transposed convolutions (kernel 2 stride 2; kernel 3 stride 2 padding 1 with
    output_padding), trilinear with and without align_corners, nearest by a scale and to an
    odd size."""

    def __init__(self) -> None:
        super().__init__()
        self.down = nn.Conv3d(2, 4, 3, stride=2, padding=1)
        self.up1 = nn.ConvTranspose3d(4, 4, 2, stride=2)
        self.up2 = nn.ConvTranspose3d(4, 3, 3, stride=2, padding=1, output_padding=1)
        self.out = nn.Conv3d(3 + 4 + 4, 5, 1)

    def forward(self, x):
        y = torch.relu(self.down(x))
        a = self.up1(y)
        size = a.shape[2:]
        b = F.interpolate(self.up2(y), size=size, mode="trilinear", align_corners=True)
        c = F.interpolate(y, scale_factor=2, mode="trilinear", align_corners=False)
        d = F.interpolate(F.interpolate(y, size=(5, 7, 3), mode="nearest"), size=size,
                          mode="nearest")
        return self.out(torch.cat([b, a + c, d], 1)).mean((2, 3, 4))


class Pads(nn.Module):
    """Reflect, replicate and constant padding in 3-D (modules and F.pad), a crop of every
    spatial dim (a U-Net skip), channel concatenation, amax and sum over D, H, W."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv3d(2, 4, 3)
        self.reflect = nn.ReflectionPad3d((1, 2, 0, 1, 2, 1))
        self.conv2 = nn.Conv3d(4, 4, 3, padding=1, padding_mode="replicate")
        self.fc = nn.Linear(16, 5)

    def forward(self, x):
        y = self.conv(F.pad(x, (1, 1, 1, 1, 1, 1), mode="replicate"))
        z = self.conv2(self.reflect(y))
        z = F.pad(z, (0, 1, 1, 0, 2, 2), value=0.5)
        d, h, w = y.shape[2:]  # z is (d + 7, h + 2, w + 4): crop it back to y's size
        cat = torch.cat([z[:, :, 2:2 + d, 1:1 + h, 2:2 + w], y], 1)
        return self.fc(torch.cat([cat.amax((2, 3, 4)), cat.sum((2, 3, 4)) / 100], 1))


class PerPixel(nn.Module):
    """Ops on the batch and channel dims of a volume (issue 36, fxpar.frontend.rules.perpixel):
    max over channels (values and indices), unsqueeze / squeeze, a channel select, a reshape
    of N and C around a softmax, a sum over the batch."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Conv3d(2, 4, 3, padding=1)
        self.b = nn.Conv3d(4, 5, 3, padding=1)

    def forward(self, x):
        y = self.a(x)
        values, where = y.max(dim=1)                                    # N, D, H, W each
        y = (y.unsqueeze(1) * 2).squeeze(1) - values.unsqueeze(1) + where.unsqueeze(1) * 0.1
        y = y + y[:, 1].unsqueeze(1)
        y = y.reshape(-1, 2, *y.shape[2:]).softmax(1).reshape(y.shape) - y.sum(0) * 0.1
        return self.b(y).mean((2, 3, 4))


OPS = {"convs": (convs, (2, 2, 11, 13, 9)), "pools": (Pools, (2, 2, 13, 11, 14)),
       "upsampling": (Upsampling, (2, 2, 10, 12, 14)), "pads": (Pads, (2, 2, 11, 10, 13)),
       "per_pixel": (PerPixel, (2, 2, 7, 6, 5))}
GRIDS = {"slab2": P(spatial_parts=2, slice="slab"), "pencil4": P(spatial_parts=4,
                                                                    slice="pencil"),
         "cube8": P(spatial_parts=8, slice="cube"), "grid312": P(grid=(3, 1, 2)),
         "grid122": P(grid=(1, 2, 2))}


def _op_case(name: str, grid: str) -> None:
    build, shape = OPS[name]
    assert_covers(check(Case(build, shape, GRIDS[grid])), f"{name} {grid}", 0.9)


for _op in OPS:
    for _grid in GRIDS:
        globals()[f"case_op_{_op}__{_grid}"] = (lambda a=_op, b=_grid: _op_case(a, b))


# -- volumes with stages, GEMS and data parallelism ------------------------------------------
COMBOS = {  # plan, global batch
    "sp2_gems_pp": (P(stages=2, spatial_parts=2, slice="slab", microbatches=2, gems=True), 4),
    "sp2_pencil_2spatial": (P(stages=3, spatial_parts=2, slice="pencil", spatial_stages=2), 2),
    "full_5d": (P(stages=2, spatial_parts=2, slice="slab", microbatches=2, gems=True,
                  data_parallel=2), 8),
}


def _combo_case(plan: str) -> None:
    p, batch = COMBOS[plan]
    build = lambda: models.build("unet3d", in_channels=1, num_classes=3, base=2,  # noqa: E731
                                 depth=3)
    assert_covers(check(Case(build, (batch, 1, 16, 12, 16), p, classes=3, segmentation=True)),
                  f"unet3d {plan}")


for _combo in COMBOS:
    globals()[f"case_combo_unet3d__{_combo}"] = (lambda a=_combo: _combo_case(a))


# -- whole volume models --------------------------------------------------------------------
def _monai(name: str):
    def build() -> nn.Module:
        import monai.networks.nets as mn

        if name == "UNet":
            return mn.UNet(spatial_dims=3, in_channels=1, out_channels=3, channels=(4, 8, 16),
                           strides=(2, 2), num_res_units=1)
        if name == "SegResNet":
            return mn.SegResNet(spatial_dims=3, in_channels=1, out_channels=3, init_filters=4,
                                blocks_down=(1, 2, 2), blocks_up=(1, 1),
                                norm=("GROUP", {"num_groups": 2}))
        return mn.BasicUNet(spatial_dims=3, in_channels=1, out_channels=3,
                            features=(4, 4, 8, 8, 16, 4))
    return build


VOLUME_MODELS = {
    "monai_UNet": (_monai("UNet"), True),
    "monai_SegResNet": (_monai("SegResNet"), True),
    "monai_BasicUNet": (_monai("BasicUNet"), True),
    "unet3d": (lambda: models.build("unet3d", in_channels=1, num_classes=3, base=4, depth=3),
               True),
    "cosmoflow": (lambda: models.build("cosmoflow", in_channels=1, base=4, blocks=3,
                                       input_size=32, hidden=(16, 8)), False),
}
VOLUME_PLANS = {  # plan, global batch
    "one": (P(), 2),
    "sp2_slab": (P(spatial_parts=2, slice="slab"), 2),
    "sp4_pencil": (P(spatial_parts=4, slice="pencil"), 2),
    "sp8_cube": (P(spatial_parts=8, slice="cube"), 2),
    "sp2_pp2": (P(stages=2, spatial_parts=2, slice="slab", microbatches=2, schedule="1f1b"), 4),
    "sp2_dp2": (P(spatial_parts=2, slice="slab", data_parallel=2), 4),
}
SIZE = 32


def _model_case(model: str, plan: str) -> None:
    build, seg = VOLUME_MODELS[model]
    p, batch = VOLUME_PLANS[plan]
    rp = check(Case(build, (batch, 1, SIZE, SIZE, SIZE), p, classes=3 if seg else 4,
                    segmentation=seg))
    assert_covers(rp, f"{model} {plan}")


for _model in VOLUME_MODELS:
    for _plan in VOLUME_PLANS:
        globals()[f"case_{_model}__{_plan}"] = (lambda a=_model, b=_plan: _model_case(a, b))

torch.set_num_threads(1)


# -- the check catches a missing corner --------------------------------------------------------
def case_zeroed_corner_piece_is_caught() -> None:
    """On a 2x2x2 cube the 3x3x3 convolutions need corner pieces from the diagonal tile. Zero
    the corner piece rank 7 receives in its first forward window (only it: faces and edges
    arrive intact): the check must fail on that rank, at the first step's loss, and name
    tensors element-wise (proof that corners are exchanged and that the harness sees one)."""
    import sys

    from helpers.equivalence import collect_failures

    from fxpar.comm.world import world
    from fxpar.runtime.spatial import exchange

    original = exchange.rebuild
    fired: list[int] = []

    def rebuild(x, ex, replicated, pieces):  # type: ignore[no-untyped-def]
        if not fired and not replicated and world().rank == 7 and \
                sys._getframe(1).f_code.co_name == "window":
            corners = [i for i, (rect, _) in enumerate(pieces)
                       if all(a[1] <= o[0] or a[0] >= o[1]
                              for a, o in zip(rect.dims, ex.own.dims, strict=True))]
            if corners:
                pieces = [(r, b.mul(0) if i in corners else b) for i, (r, b) in enumerate(pieces)]
                fired.append(len(corners))
        return original(x, ex, replicated, pieces)

    exchange.rebuild = rebuild
    try:
        with collect_failures() as failures:
            check(Case(convs, (2, 2, 8, 8, 8), GRIDS["cube8"]))
    finally:
        exchange.rebuild = original
    everyone = world().allgather_object((bool(fired), failures[:3]))
    assert [f for f, _ in everyone] == [False] * 7 + [True], everyone
    caught = everyone[7][1]
    assert caught and caught[0].startswith("step 0 loss: 1 of 1 elements differ"), caught
    if world().rank == 0:
        print(f"zeroed corner on rank 7 caught: {caught[0][:120]}", flush=True)
