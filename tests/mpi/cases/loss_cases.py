"""The losses segmentation users train with, on tiled outputs, vs one process (run by
tests/mpi/test_losses.py). Each case trains a segmentation model with one loss for 2 SGD steps and
compares the loss, every gradient, the parameters after each step and every buffer in float64
(tests/helpers/transparency.py). The losses divide global sums by global sums (Dice, Tversky,
``ignore_index``, class weights, masks): per-tile weighting is wrong for all of them.

``LOSSES`` x ``PLANS`` is the full matrix (``FXPAR_LOSS_MATRIX=1``, 8 ranks for the 2x2x2
cube); CI runs every loss under SP2 and a chosen set of (loss, plan) pairs on 4 ranks."""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Callable

import torch
import torch.nn.functional as F
from helpers.transparency import Case, check
from torch import nn

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


def cumsum_loss(out, y):
    """Cross-entropy plus a term with a running sum down the rows: an op with no tile rule
    (it reads every row above), so fxpar joins the output for this loss (exact, warned)."""
    return F.cross_entropy(out, y) + 1e-2 * out.cumsum(2).square().mean()


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
    "joined_cumsum": (lambda: cumsum_loss, "labels"),
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
    "grid212": (fxpar.Plan(grid=(2, 1, 2)), 3),
}
"""Plans and the image dims they need (cube8: a volume)."""

SHAPES = {2: (4, 2, 11, 10), 3: (4, 2, 6, 5, 6)}
"""Odd sizes: uneven tiles."""


def _monai_net(name: str, dims: int) -> nn.Module:
    import monai.networks.nets as mn

    if name == "UNet":
        return mn.UNet(spatial_dims=dims, in_channels=2, out_channels=CLASSES,
                       channels=(4, 8, 16), strides=(2, 2), num_res_units=1)
    return mn.SegResNet(spatial_dims=dims, in_channels=2, out_channels=CLASSES, init_filters=4,
                        norm=("group", {"num_groups": 2}))


def _swin_unetr() -> nn.Module:
    import monai.networks.nets as mn

    return mn.SwinUNETR(in_channels=2, out_channels=CLASSES, feature_size=12, spatial_dims=2,
                        depths=(1, 1, 1, 1), num_heads=(1, 1, 1, 1), window_size=2)


def _smp_unet() -> nn.Module:
    import segmentation_models_pytorch as smp

    return smp.Unet(encoder_name="resnet18", encoder_weights=None, in_channels=2,
                    classes=CLASSES, encoder_depth=3, decoder_channels=(16, 8, 8))


MODELS: dict[str, tuple[Callable[[int], nn.Module], dict[int, tuple[int, ...]]]] = {
    "segnet": (lambda dims: SegNet(dims), SHAPES),
    "monai_unet": (lambda dims: _monai_net("UNet", dims), {2: (4, 2, 20, 12),
                                                            3: (4, 2, 8, 8, 12)}),
    "monai_segresnet": (lambda dims: _monai_net("SegResNet", dims), {2: (4, 2, 16, 24),
                                                                      3: (4, 2, 8, 16, 8)}),
    "smp_unet": (lambda dims: _smp_unet(), {2: (4, 2, 32, 24)}),
    "monai_swinunetr": (lambda dims: _swin_unetr(), {2: (2, 2, 64, 64)}),
}
"""The models the losses train: the small net above (odd sizes) and library segmentation
models (MONAI UNet, SegResNet, SwinUNETR with shifted windows of 2 on the tiles, smp Unet;
sizes their poolings divide)."""


FLOAT32_INSIDE = {"monai_focal", "monai_dicefocal"}
"""MONAI's FocalLoss casts its input to float32 (``input.float()``), so these losses are float32
computations whatever the model's dtype: one process running the captured graph differs from
one process running the loss by 6.8e-8 relative in the output's gradient (decomposed
log-sigmoid rounds differently in float32), and summing over tiles reorders float32 sums."""

RTOL32 = 1e-5
"""Element-wise relative tolerance for :data:`FLOAT32_INSIDE` (float32: 1.2e-7 per rounding)."""


def run(loss: str, plan: str, model: str = "segnet") -> None:
    make, kind = LOSSES[loss]
    p, dims = PLANS[plan]
    build, shapes = MODELS[model]
    shape = shapes[dims]
    tol = {"atol": 1e-9, "rtol": RTOL32} if loss in FLOAT32_INSIDE else {}
    check(Case(lambda: build(dims), shape, p, segmentation=True, loss=make(),
               targets=targets(kind, shape)), **tol)


CI = [(loss, "sp2") for loss in LOSSES] + [
    ("monai_dice", "sp4sq"), ("monai_dicece", "sp2pp2"), ("ce_ignore", "sp2pp2"),
    ("monai_tversky", "sp2dp2"), ("smp_dice", "sp4sq"), ("masked_mse", "sp2dp2"),
    ("ce_weight", "sp2gems"), ("monai_gdice", "grid212"), ("monai_dicece", "grid212"),
    ("smp_jaccard", "sp2dp2"), ("ce_smooth", "sp4sq"), ("monai_maskeddice", "sp2pp2"),
    ("joined_cumsum", "sp4sq"), ("joined_cumsum", "sp2pp2"),
]
CHOSEN = [(a, b) for a in LOSSES for b in PLANS] if os.environ.get("FXPAR_LOSS_MATRIX") == "1" \
    else CI

LIBRARY = [("monai_dicece", "sp2", "monai_unet"), ("monai_dice", "sp2pp2", "monai_unet"),
           ("smp_dice", "sp2", "smp_unet"), ("ce_ignore", "sp2dp2", "smp_unet"),
           ("monai_gdice", "grid212", "monai_segresnet"),
           ("monai_tversky", "sp4sq", "monai_segresnet"),
           ("monai_dicece", "sp2", "monai_swinunetr"),
           ("monai_tversky", "sp4sq", "monai_swinunetr")]
"""(loss, plan, library model) triples, in CI and in the matrix (which adds every loss under
every plan on the small net)."""

for _loss, _plan in CHOSEN:
    globals()[f"case_{_loss}_{_plan}"] = (lambda a, b: lambda: run(a, b))(_loss, _plan)
for _loss, _plan, _model in LIBRARY:
    globals()[f"case_{_model}_{_loss}_{_plan}"] = \
        (lambda a, b, m: lambda: run(a, b, m))(_loss, _plan, _model)


# -- the harness catches the old rule ------------------------------------------------------------
def _pixel_share(loss_fn: Callable) -> Callable:
    """The rule fxpar had before the loss was captured: each tile's loss of its own pixels,
    weighted by its share of the pixels (exact for a per-pixel mean only)."""
    from fxpar.program.tileloss import TileLoss

    def call(self: TileLoss, copy: int, tile: int, leaves, target):
        (output,), (extent,) = leaves, self.extents  # one tiled output
        box = self.grid.tile_rect(extent, tile)
        ys = target if isinstance(target, tuple) else (target,)
        cut = tuple(y[(..., *(slice(*iv) for iv in box.dims))] for y in ys)
        share = box.size / math.prod(extent)
        return loss_fn(output, *cut) * share * self.grid.size  # the runtime takes 1/P of it
    return call


def _mutated(loss: str) -> list[str]:
    """The failures the harness reports for ``loss`` under SP2 with the old per-tile rule."""
    from helpers.equivalence import collect_failures

    from fxpar.program.tileloss import TileLoss

    make, kind = LOSSES[loss]
    fn = make()
    original = TileLoss.__call__
    TileLoss.__call__ = _pixel_share(fn)
    try:
        with collect_failures() as failures:
            p, _ = PLANS["sp2"]
            rp = check(Case(lambda: SegNet(2), SHAPES[2], p, segmentation=True, loss=fn,
                            targets=targets(kind, SHAPES[2])))
    finally:
        TileLoss.__call__ = original
    return failures if rp is not None else None  # None: this rank sat the check out


def case_old_pixel_share_rule_is_caught():
    """Dice, ignore_index and a masked mean fail the check under the old rule (their
    gradients differ far beyond the tolerance); a plain per-pixel mean passes it, as it
    should (the rule was exact for it)."""
    for loss in ("monai_dice", "ce_ignore", "masked_mse"):
        failures = _mutated(loss)
        if failures is None:
            continue
        assert any("grad of" in f for f in failures), (loss, failures)
        print(f"{loss}: {len(failures)} failures, first: {failures[0][:160]}")
    assert _mutated("ce") in ([], None)
