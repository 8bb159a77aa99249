"""Spatial parallelism vs one process, per op class and on whole models (run by
tests/mpi/test_spatial.py). Every case checks loss, every gradient, parameters after 2 SGD steps
and BatchNorm buffers in float64 (tests/helpers/transparency.py)."""

from __future__ import annotations

import torch
import torchvision.models as tvm
from helpers.models import resnet18_narrow, resnet50_narrow
from helpers.transparency import Case, check
from torch import nn

import fxpar
from fxpar import models


class Head(nn.Module):
    """features -> global mean -> linear: a classification loss over the whole image."""

    def __init__(self, body: nn.Module, channels: int, classes: int = 5) -> None:
        super().__init__()
        self.body = body
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(channels, classes)

    def forward(self, x):
        return self.fc(torch.flatten(self.pool(self.body(x)), 1))


def _bn_relu(c):
    return [nn.BatchNorm2d(c), nn.ReLU()]


class ChannelSplit(nn.Module):
    """CSPNet / Res2Net / MixConv: split the channels (unequal pieces, then equal chunks),
    convolve pieces, concatenate."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.inner = nn.Conv2d(5, 4, 3, padding=1)
        self.out = nn.Conv2d(7, 6, 1)

    def forward(self, x):
        a, b = torch.split(self.conv(x), [3, 5], dim=1)
        c, d = self.inner(b).chunk(2, dim=1)
        return self.out(torch.cat([a, c, torch.relu(d)], dim=1))


class ChannelSlice(nn.Module):
    """DPN / ReXNet: slices of the channel dim added to and concatenated with others."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.conv2 = nn.Conv2d(4, 4, 3, padding=1)

    def forward(self, x):
        y = self.conv(x)
        return torch.cat([y[:, :2] + y[:, 2:4], self.conv2(y[:, 4:])], dim=1)


class Attention(nn.Module):
    """ECA (mean over H, W -> conv1d over channels -> expand_as), CBAM's channel attention
    (mean and amax over H, W) and spatial attention (mean and amax over channels with
    keepdim -> 7x7 conv), a sum over H and W; amax over ``maximum(x, level)``: where the
    learned level is above every cell, the maximum ties over the whole image, across tiles,
    and its gradient, shared evenly by the tied cells, reaches ``level``."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 6, 3, padding=1)
        self.eca = nn.Conv1d(1, 1, 3, padding=1, bias=False)
        self.fc = nn.Conv2d(6, 6, 1)
        self.spatial = nn.Conv2d(2, 1, 7, padding=3)
        self.level = nn.Parameter(torch.tensor([-9.0, 0.0, 9.0, 9.0, -9.0, 9.0]).view(6, 1, 1))

    def forward(self, x):
        x = self.conv(x)
        y = self.eca(x.mean((2, 3)).unsqueeze(1)).transpose(-1, -2).unsqueeze(-1)
        x = x * torch.sigmoid(y).expand_as(x)
        floor = torch.maximum(x, self.level)
        x = x * torch.sigmoid(self.fc(x.mean((2, 3), keepdim=True)) +
                              self.fc(floor.amax((2, 3), keepdim=True)))
        s = torch.cat([x.mean(1, keepdim=True), x.amax(1, keepdim=True)], dim=1)
        x = x * torch.sigmoid(self.spatial(s))
        return x + torch.tanh(x.sum((2, 3), keepdim=True) / 100)


class PerPixel(nn.Module):
    """Ops on the batch and channel dims only, each of which used to end the region (issue 36,
    fxpar.frontend.rules.perpixel): unsqueeze / squeeze round trips, reshapes of N and C, H/W
    transposed and back, channel picks (select, index_select, x[:, idx], gather), max / argmax
    / min over channels with and without keepdim, softmax, var, norms, batch reductions."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Conv2d(3, 4, 3, padding=1)
        self.b = nn.Conv2d(4, 6, 3, padding=1)
        self.register_buffer("order", torch.tensor([2, 0, 3, 1]))

    def forward(self, x):
        y = self.a(x)                                                   # N, 4, H, W
        y = (y.unsqueeze(1) * 0.5).squeeze(1) + y[:, 0].unsqueeze(1)     # N, 1, C, H, W; N, H, W
        y = torch.relu(y.reshape(-1, 1, *y.shape[2:])).reshape(y.shape)  # N * C, 1, H, W
        y = (y.transpose(2, 3) * 2).transpose(2, 3).index_select(1, self.order)
        values, where = y.max(dim=1)                                    # N, H, W each
        y = y[:, self.order] - values.unsqueeze(1) + where.unsqueeze(1) * 0.1
        y = y.gather(1, y.argsort(1)) + y.argmax(1, keepdim=True) * 0.1
        y = y.softmax(1) + y / (y.var(1, keepdim=True) + 1) + y.amin(1, keepdim=True)
        y = y / (y.norm(dim=1, keepdim=True) + 1) - y.mean(0, keepdim=True) + y.sum(0) * 0.1
        return self.b(y)


class StackShuffle(nn.Module):
    """Selective kernels (branches stacked on dim 1, softmax attention over them, summed),
    FPN's merge (stacked on dim 0, summed), ShuffleNet's channel shuffle (view, transpose,
    view) and MONAI's ChannelPad (zero channels padded on)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Conv2d(3, 4, 3, padding=1)
        self.b = nn.Conv2d(3, 4, 3, padding=2, dilation=2)
        self.fc = nn.Conv2d(4, 8, 1)

    def forward(self, x):
        a, b = self.a(x), torch.tanh(self.b(x))
        paths = torch.stack([a, b], dim=1)                    # N, 2, C, H, W
        attn = self.fc(paths.sum(1).mean((2, 3), keepdim=True))
        attn = attn.view(x.shape[0], 2, 4, 1, 1).softmax(dim=1)
        y = (paths * attn).sum(dim=1) + torch.stack([a, b]).sum(dim=0)
        n, c, h, w = y.shape
        y = y.view(n, 2, c // 2, h, w).transpose(1, 2).contiguous().view(n, c, h, w)
        return nn.functional.pad(y, [0, 0, 0, 0, 1, 1])      # 6 channels


class PyramidPool(nn.Module):
    """PSPNet's pyramid: adaptive average pooling to sizes that do not divide the image
    (overlapping bins of varying size), 1x1 convolutions, upsampled and concatenated."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.branches = nn.ModuleList(nn.Conv2d(4, 1, 1) for _ in (2, 3, 5))
        self.out = nn.Conv2d(7, 6, 3, padding=1)

    def forward(self, x):
        x = self.conv(x)
        size = x.shape[-2:]
        pooled = [nn.functional.interpolate(b(nn.functional.adaptive_avg_pool2d(x, k)), size,
                                            mode="bilinear", align_corners=False)
                  for k, b in zip((2, 3, 5), self.branches, strict=True)]
        return self.out(torch.cat([x, *pooled], dim=1))


class Elementwise(nn.Module):
    """Gates and encodings built from elementwise ops beyond the activations: ``1 - g``
    (aten.rsub), sin / cos, erf, square, logit, sign, floor, expm1 (fxpar.frontend.rules.
    pointwise); each runs on tiles, so the convolution after them does too."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 6, 3, padding=1)
        self.conv2 = nn.Conv2d(6, 6, 3, padding=1)

    def forward(self, x):
        y = self.conv(x)
        g = torch.sigmoid(y)
        z = (1 - g) * y + torch.sin(y) * torch.cos(y) + torch.special.erf(y) \
            + torch.square(y) * 0.1 + torch.logit(g, 1e-3) + torch.sign(y) * torch.floor(y) \
            + torch.expm1(-y.abs())
        return self.conv2(z)


OPS = {
    "elementwise": Elementwise,
    "conv_k1": lambda: nn.Sequential(nn.Conv2d(3, 6, 1), *_bn_relu(6)),
    "conv_k3": lambda: nn.Sequential(nn.Conv2d(3, 6, 3, padding=1), *_bn_relu(6),
                                     nn.Conv2d(6, 6, 3, padding=1)),
    "conv_k5_s2": lambda: nn.Sequential(nn.Conv2d(3, 6, 5, stride=2, padding=2), nn.ReLU()),
    "conv_k7_s2_nopad": lambda: nn.Sequential(nn.Conv2d(3, 6, 7, stride=2), nn.ReLU()),
    "conv_dilated": lambda: nn.Sequential(nn.Conv2d(3, 6, 3, padding=2, dilation=2), nn.ReLU()),
    "conv_1x7_7x1": lambda: nn.Sequential(nn.Conv2d(3, 6, (1, 7), padding=(0, 3)),
                                          nn.Conv2d(6, 6, (7, 1), padding=(3, 0))),
    "maxpool_pad": lambda: nn.Sequential(nn.Conv2d(3, 6, 3), nn.MaxPool2d(3, 2, padding=1)),
    "maxpool_ceil": lambda: nn.Sequential(nn.Conv2d(3, 6, 1), nn.MaxPool2d(2, 2,
                                                                            ceil_mode=True)),
    "avgpool_pad": lambda: nn.Sequential(nn.Conv2d(3, 6, 1), nn.AvgPool2d(3, 1, padding=1)),
    "avgpool_exclude_pad": lambda: nn.Sequential(
        nn.Conv2d(3, 6, 1), nn.AvgPool2d(3, 2, padding=1, count_include_pad=False)),
    "avgpool_ceil": lambda: nn.Sequential(nn.Conv2d(3, 6, 1), nn.AvgPool2d(3, 2, ceil_mode=True)),
    "upsample_nearest": lambda: nn.Sequential(nn.Conv2d(3, 6, 3, padding=1),
                                              nn.Upsample(scale_factor=2), nn.Conv2d(6, 6, 3)),
    "upsample_bilinear": lambda: nn.Sequential(nn.Conv2d(3, 6, 1),
                                               nn.Upsample(scale_factor=2, mode="bilinear")),
    "conv_transpose": lambda: nn.Sequential(nn.Conv2d(3, 6, 3, padding=1),
                                            nn.ConvTranspose2d(6, 6, 2, stride=2),
                                            nn.ConvTranspose2d(6, 6, 3, stride=1, padding=1)),
    "conv_transpose_s1_as_conv": lambda: nn.Sequential(  # a convolution on tiles (issue 36)
        nn.Conv2d(3, 6, 3, padding=1),
        nn.ConvTranspose2d(6, 6, 3, stride=1, padding=1, dilation=2, groups=2, output_padding=1),
        nn.ConvTranspose2d(6, 6, (1, 3), stride=1)),
    "per_pixel": PerPixel,
    "zero_pad_shift": lambda: nn.Sequential(nn.ZeroPad2d((-1, 1, -1, 1)), nn.Conv2d(3, 6, 1)),
    "channel_split": ChannelSplit,
    "channel_slice": ChannelSlice,
    "attention_reductions": Attention,
    "pyramid_pool": PyramidPool,
    "stack_shuffle": StackShuffle,
}


def op_case(name: str, parts: int, slice_: str, size: tuple[int, int]) -> None:
    check(Case(lambda: Head(OPS[name](), 6), (4, 3, *size),
               fxpar.Plan(spatial_parts=parts, slice=slice_)))


# one launch, many cases: every op at P=2 vertical (odd width), P=3 horizontal (odd height),
# P=4 square (odd both)
for _name in OPS:
    for _p, _s, _size in ((2, "vertical", (12, 13)), (3, "horizontal", (17, 12)),
                          (4, "square", (15, 13))):
        globals()[f"case_{_name}_p{_p}_{_s}"] = (
            lambda n=_name, p=_p, s=_s, z=_size: op_case(n, p, s, z))


def case_resnet18_p4_square():
    check(Case(lambda: tvm.resnet18(num_classes=5), (2, 3, 64, 64), fxpar.Plan(spatial_parts=4)))


def case_resnet50_p2_vertical():
    """resnet50's Bottlenecks at a sixteenth of the width (tests/helpers/models.py);
    torchvision's resnet50 trains in tests/mpi/cases/pipeline_cases.py and memory_cases.py."""
    check(Case(resnet50_narrow, (2, 3, 64, 64),
               fxpar.Plan(spatial_parts=2, slice="vertical")))


def case_mobilenet_v3_se_p3_horizontal():
    check(Case(lambda: tvm.mobilenet_v3_small(num_classes=5, dropout=0.0), (2, 3, 96, 96),
               fxpar.Plan(spatial_parts=3, slice="horizontal")))


def case_amoebanet_p4_square_odd():
    check(Case(lambda: models.build("amoebanet", num_classes=5, num_layers=3, num_filters=16),
               (2, 3, 67, 65), fxpar.Plan(spatial_parts=4)))


def case_densenet_p2():
    check(Case(lambda: tvm.DenseNet(32, (2, 2, 2, 2), 64, num_classes=5), (2, 3, 64, 64),
               fxpar.Plan(spatial_parts=2, slice="horizontal")))


def case_unet_segmentation_p4():
    check(Case(lambda: models.build("unet", num_classes=3, base_channels=4, depth=3),
               (2, 3, 32, 40), fxpar.Plan(spatial_parts=4), classes=3, segmentation=True))


def case_sp_lp_resnet18():
    check(Case(resnet18_narrow, (2, 3, 64, 64),
               fxpar.Plan(stages=2, spatial_parts=2, slice="vertical")))


def case_sp_pp_amoebanet_2_spatial_stages():
    check(Case(lambda: models.build("amoebanet", num_classes=5, num_layers=3, num_filters=16),
               (4, 3, 48, 48), fxpar.Plan(stages=3, spatial_parts=2, spatial_stages=2,
                                          microbatches=2, schedule="1f1b")))


def case_sp_pp_unet_tiles_to_one_rank():
    check(Case(lambda: models.build("unet", num_classes=3, base_channels=4, depth=3),
               (4, 3, 32, 32), fxpar.Plan(stages=2, spatial_parts=3, slice="horizontal",
                                          microbatches=2), classes=3, segmentation=True))


def _split_everywhere(case: Case) -> None:
    """Run ``case`` with every convolution that can split taking haloconv's path
    (test images are too small for the cost rule to choose it), and check some did (the
    split path's tile part ran)."""
    from fxpar.runtime.spatial import haloconv
    from fxpar.runtime.spatial.ops import HaloOp

    calls: list[int] = []
    real = haloconv.tile_part

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    old, haloconv.MIN_RATIO, haloconv.tile_part = haloconv.MIN_RATIO, 0, counted
    try:
        rp = check(case)
    finally:
        haloconv.MIN_RATIO, haloconv.tile_part = old, real
    ops = [m for s in rp.stages.values() for m in s.modules() if isinstance(m, HaloOp)] \
        if rp is not None else []
    if ops:  # a rank of a spatial stage
        assert calls, "nothing split"


def case_split_convolutions_resnet18_p4_square():
    _split_everywhere(Case(resnet18_narrow, (2, 3, 64, 64),
                           fxpar.Plan(spatial_parts=4)))


def case_split_convolutions_sp_pp_amoebanet_p3_vertical():
    _split_everywhere(Case(lambda: models.build("amoebanet", num_classes=5, num_layers=1,
                                                num_filters=8),
                           (4, 3, 48, 48),
                           fxpar.Plan(stages=2, spatial_parts=3, slice="vertical",
                                      microbatches=2, schedule="1f1b")))


def case_split_convolutions_unet3d_cube():
    """Volumes split too: faces, edges and corners of a 2x2x1 box grid as bands."""
    _split_everywhere(Case(lambda: models.build("unet3d", in_channels=3, num_classes=3,
                                                base=2, depth=3),
                           (2, 3, 16, 16, 16), fxpar.Plan(spatial_parts=4, slice="cube"),
                           classes=3, segmentation=True))


class RowBias(nn.Module):
    """A learned (1, C, H, 1) bias added inside the would-be region: an untiled operand that
    varies along the split dim H. fxpar must end the region before the add (it used to compile
    and then crash at the first step)."""

    def __init__(self, h: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 6, 3, padding=1)
        self.bias = nn.Parameter(torch.randn(1, 6, h, 1))
        self.conv2 = nn.Conv2d(6, 6, 3, padding=1)

    def forward(self, x):
        return self.conv2(torch.relu(self.conv(x) + self.bias))


def case_untiled_operand_varying_along_a_split_dim_ends_the_region():
    check(Case(lambda: Head(RowBias(12), 6), (4, 3, 12, 10),
               fxpar.Plan(spatial_parts=2, slice="horizontal")))
