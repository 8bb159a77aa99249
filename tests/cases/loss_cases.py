"""The losses segmentation users train with, on tiled outputs, vs one process (run by
tests/test_losses.py). Each case trains a segmentation model with one loss for 2 SGD steps and
compares the loss, every gradient, the parameters after each step and every buffer in float64
(tests/transparency.py). The losses divide global sums by global sums (Dice, Tversky,
``ignore_index``, class weights, masks): per-tile weighting is wrong for all of them.

``LOSSES`` x ``PLANS`` x models is the full matrix (``FXPAR_LOSS_MATRIX=1``); CI runs every
loss under SP2 on the 2-D net and a chosen set of (loss, plan, model) triples."""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from transparency import Case, check

import fxpar

warnings.filterwarnings("ignore", category=UserWarning, module="monai")
warnings.filterwarnings("ignore", category=FutureWarning)

CLASSES = 3


class SegNet(nn.Module):
    """A small segmentation net (conv, BatchNorm, pooling, upsampling): 2-D or 3-D."""

    def __init__(self, dims: int = 2, cin: int = 2, classes: int = CLASSES) -> None:
        super().__init__()
        conv = nn.Conv2d if dims == 2 else nn.Conv3d
        bn = nn.BatchNorm2d if dims == 2 else nn.BatchNorm3d
        self.body = nn.Sequential(conv(cin, 6, 3, padding=1), bn(6), nn.ReLU(),
                                  conv(6, 6, 3, padding=1), nn.GroupNorm(2, 6), nn.ReLU(),
                                  conv(6, classes, 1))

    def forward(self, x):
        return self.body(x)


def labels(g: torch.Generator, shape: tuple[int, ...], channel: bool) -> torch.Tensor:
    """Class labels of the image ``shape`` (N, C, *spatial): (N, *spatial), or (N, 1,
    *spatial) with ``channel`` (MONAI's convention)."""
    n, spatial = shape[0], shape[2:]
    y = torch.randint(0, CLASSES, (n, *spatial), generator=g)
    return y[:, None] if channel else y


def _monai(name: str, **kw) -> Callable:
    import monai.losses as ml

    return getattr(ml, name)(**kw)


def _smp(name: str, *args, **kw) -> Callable:
    import segmentation_models_pytorch as smp

    return getattr(smp.losses, name)(*args, **kw)


def masked_mse(out, y, mask):
    """Per-pixel squared error times a mask, summed, divided by the mask's sum."""
    return ((out - y) ** 2 * mask).sum() / mask.sum()


def masked_dice(out, y, mask):
    return _monai("MaskedDiceLoss", softmax=True, to_onehot_y=True)(out, y, mask=mask)


def _weights() -> torch.Tensor:
    return torch.tensor([0.2, 1.0, 2.5], dtype=torch.float64)


LossCase = tuple[Callable[[], Callable], str]
"""(make the loss, target kind): ``labels`` (N, *spatial), ``labels1`` (N, 1, *spatial),
``masked1`` (labels1 and a mask), ``dense`` (a float target like the output, and a mask)."""

LOSSES: dict[str, LossCase] = {
    "ce": (lambda: F.cross_entropy, "labels"),
    "ce_ignore": (lambda: lambda o, y: F.cross_entropy(o, y, ignore_index=2), "labels"),
    "ce_weight": (lambda: lambda o, y: F.cross_entropy(o, y, weight=_weights()), "labels"),
    "ce_smooth": (lambda: lambda o, y: F.cross_entropy(o, y, label_smoothing=0.1), "labels"),
    "monai_dice": (lambda: _monai("DiceLoss", softmax=True, to_onehot_y=True), "labels1"),
    "monai_dicece": (lambda: _monai("DiceCELoss", softmax=True, to_onehot_y=True), "labels1"),
    "monai_dicefocal": (lambda: _monai("DiceFocalLoss", softmax=True, to_onehot_y=True),
                        "labels1"),
    "monai_gdice": (lambda: _monai("GeneralizedDiceLoss", softmax=True, to_onehot_y=True),
                    "labels1"),
    "monai_tversky": (lambda: _monai("TverskyLoss", softmax=True, to_onehot_y=True),
                      "labels1"),
    "monai_focal": (lambda: _monai("FocalLoss", to_onehot_y=True), "labels1"),
    "monai_maskeddice": (lambda: masked_dice, "masked1"),
    "smp_dice": (lambda: _smp("DiceLoss", "multiclass"), "labels"),
    "smp_jaccard": (lambda: _smp("JaccardLoss", "multiclass"), "labels"),
    "smp_focal": (lambda: _smp("FocalLoss", "multiclass"), "labels"),
    "masked_mse": (lambda: masked_mse, "dense"),
}


def targets(kind: str, shape: tuple[int, ...]) -> Callable[[torch.Generator], object]:
    def make(g: torch.Generator) -> object:
        if kind == "labels":
            return labels(g, shape, False)
        y1 = labels(g, shape, True)
        mask = (torch.rand((shape[0], 1, *shape[2:]), generator=g) > 0.3).double()
        if kind == "labels1":
            return y1
        if kind == "masked1":
            return (y1, mask)
        dense = torch.randn((shape[0], CLASSES, *shape[2:]), dtype=torch.float64, generator=g)
        return (dense, mask)
    return make


PLANS: dict[str, tuple[fxpar.Plan, int]] = {
    "sp2": (fxpar.Plan(spatial_parts=2, slice="horizontal"), 2),
    "sp4sq": (fxpar.Plan(spatial_parts=4, slice="square"), 2),
    "sp2pp2": (fxpar.Plan(spatial_parts=2, slice="horizontal", stages=2, spatial_stages=2,
                          microbatches=2), 2),
    "sp2dp2": (fxpar.Plan(spatial_parts=2, slice="vertical", data_parallel=2), 2),
    "sp2gems": (fxpar.Plan(spatial_parts=2, slice="horizontal", stages=2, spatial_stages=2,
                           gems=True), 2),
    "cube8": (fxpar.Plan(spatial_parts=8, slice="cube"), 3),
}
"""Plans and the image dims they need (cube8: a volume)."""

SHAPES = {2: (4, 2, 11, 10), 3: (4, 2, 6, 5, 6)}
"""Odd sizes: uneven tiles."""


FLOAT32_INSIDE = {"monai_focal", "monai_dicefocal"}
"""MONAI's FocalLoss casts its input to float32 (``input.float()``), so these losses are float32
computations whatever the model's dtype: one process running the captured graph differs from
one process running the loss by 6.8e-8 relative in the output's gradient (decomposed
log-sigmoid rounds differently in float32), and summing over tiles reorders float32 sums."""

RTOL32 = 1e-5
"""Element-wise relative tolerance for :data:`FLOAT32_INSIDE` (float32: 1.2e-7 per rounding)."""


def run(loss: str, plan: str) -> None:
    make, kind = LOSSES[loss]
    p, dims = PLANS[plan]
    shape = SHAPES[dims]
    tol = {"atol": 1e-9, "rtol": RTOL32} if loss in FLOAT32_INSIDE else {}
    check(Case(lambda: SegNet(dims), shape, p, segmentation=True, loss=make(),
               targets=targets(kind, shape)), **tol)


CI = [(loss, "sp2") for loss in LOSSES] + [
    ("monai_dice", "sp4sq"), ("monai_dicece", "sp2pp2"), ("ce_ignore", "sp2pp2"),
    ("monai_tversky", "sp2dp2"), ("smp_dice", "sp4sq"), ("masked_mse", "sp2dp2"),
    ("ce_weight", "sp2gems"), ("monai_gdice", "cube8"), ("monai_dicece", "cube8"),
    ("smp_jaccard", "sp2dp2"), ("ce_smooth", "sp4sq"), ("monai_maskeddice", "sp2pp2"),
]
CHOSEN = [(a, b) for a in LOSSES for b in PLANS] if os.environ.get("FXPAR_LOSS_MATRIX") == "1" \
    else CI

for _loss, _plan in CHOSEN:
    globals()[f"case_{_loss}_{_plan}"] = (lambda a, b: lambda: run(a, b))(_loss, _plan)
