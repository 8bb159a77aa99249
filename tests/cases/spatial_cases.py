"""Spatial parallelism vs one process, per op class and on whole models (run by
tests/test_spatial.py). Every case checks loss, every gradient, parameters after 2 SGD steps
and BatchNorm buffers in float64 (tests/transparency.py)."""

from __future__ import annotations

import torch
import torchvision.models as tvm
from torch import nn
from transparency import Case, check

import fxpar
import models


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


OPS = {
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
    "zero_pad_shift": lambda: nn.Sequential(nn.ZeroPad2d((-1, 1, -1, 1)), nn.Conv2d(3, 6, 1)),
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
    check(Case(lambda: tvm.resnet50(num_classes=5), (2, 3, 64, 64),
               fxpar.Plan(spatial_parts=2, slice="vertical")))


def case_mobilenet_v3_se_p3_horizontal():
    check(Case(lambda: tvm.mobilenet_v3_small(num_classes=5, dropout=0.0), (2, 3, 96, 96),
               fxpar.Plan(spatial_parts=3, slice="horizontal")))


def case_amoebanet_p4_square_odd():
    check(Case(lambda: models.build("amoebanet", num_classes=5, num_layers=3, num_filters=16),
               (2, 3, 67, 65), fxpar.Plan(spatial_parts=4)))


def case_densenet_p2():
    check(Case(lambda: tvm.densenet121(num_classes=5), (2, 3, 64, 64),
               fxpar.Plan(spatial_parts=2, slice="horizontal")))


def case_unet_segmentation_p4():
    check(Case(lambda: models.build("unet", num_classes=3, base_channels=4, depth=3),
               (2, 3, 32, 40), fxpar.Plan(spatial_parts=4), classes=3, segmentation=True))


def case_sp_lp_resnet18():
    check(Case(lambda: tvm.resnet18(num_classes=5), (2, 3, 64, 64),
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
    """Run ``case`` with every convolution that can split taking fxpar.spatial.haloconv's path
    (test images are too small for the cost rule to choose it), and check some did."""
    from fxpar.spatial import haloconv
    from fxpar.spatial.ops import HaloOp

    old, haloconv.MIN_RATIO = haloconv.MIN_RATIO, 0
    try:
        rp = check(case)
    finally:
        haloconv.MIN_RATIO = old
    ops = [m for s in rp.stages.values() for m in s.modules() if isinstance(m, HaloOp)] \
        if rp is not None else []
    if ops:  # a rank of a spatial stage
        assert any(getattr(m, "_split", None) is not None for m in ops), "nothing split"


def case_split_convolutions_resnet18_p4_square():
    _split_everywhere(Case(lambda: tvm.resnet18(num_classes=5), (2, 3, 64, 64),
                           fxpar.Plan(spatial_parts=4)))


def case_split_convolutions_sp_pp_amoebanet_p3_vertical():
    _split_everywhere(Case(lambda: models.build("amoebanet", num_classes=5, num_layers=1,
                                                num_filters=8),
                           (4, 3, 48, 48),
                           fxpar.Plan(stages=2, spatial_parts=3, slice="vertical",
                                      microbatches=2, schedule="1f1b")))


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
