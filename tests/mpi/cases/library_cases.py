"""Models from the public libraries (timm, segmentation-models-pytorch, MONAI, torchvision),
unchanged, vs one process in float64 (tests/helpers/transparency.py: loss, every gradient,
parameters after 2 SGD steps with momentum, every buffer, full_state_dict, eval output). Spatial
plans also check how much of the model's work the spatial region spreads over the tiles (the share
of forward FLOPs on image tensors, ``fxpar.passes.spatial_region.Coverage``) against the floor
recorded for each model in ``MODELS``; docs/models.md shows the same figures.

One case per (model, plan): ``case_<model>__<plan>``. tests/mpi/test_libraries.py runs the CI
subset; ``FXPAR_LIBRARY_MATRIX=1`` runs every pair (tools/models_matrix.py writes the table).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import NamedTuple

import torch
from helpers.attention_models import efficientvit_b0
from helpers.transparency import Case, check
from torch import nn

import fxpar
from fxpar.passes.spatial_region import Coverage


class Model(NamedTuple):  # (the case loader does not register this module: no dataclass)
    build: Callable[[], nn.Module]
    size: tuple[int, int]
    coverage: float
    """The least spatial coverage the SP plans must reach (1.0 - the head's share)."""
    segmentation: bool = False


def _timm(name: str, **kw) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        import timm

        return timm.create_model(name, num_classes=5, pretrained=False, **kw)
    return build


def _tv(name: str, **kw) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        import torchvision.models as tvm

        return getattr(tvm, name)(num_classes=5, **kw)
    return build


def _smp(name: str, **kw) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        import segmentation_models_pytorch as smp

        return getattr(smp, name)(encoder_name="resnet18", encoder_weights=None, classes=3,
                                  **kw)
    return build


def _monai(name: str) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        import monai.networks.nets as mn

        if name == "UNet":
            return mn.UNet(spatial_dims=2, in_channels=3, out_channels=3,
                           channels=(8, 16, 32), strides=(2, 2), num_res_units=1)
        if name == "UNETR":  # a ViT encoder (16^3 patches) on a 3-D volume
            return mn.UNETR(in_channels=3, out_channels=3, img_size=(32, 32, 32), feature_size=8,
                            hidden_size=32, mlp_dim=64, num_heads=2, spatial_dims=3)
        if name.startswith("SwinUNETR"):  # shifted windows of 2 (tiles hold whole windows)
            return mn.SwinUNETR(in_channels=3, out_channels=3, feature_size=12,
                                spatial_dims=int(name[-2]), depths=(2, 2, 2, 2),
                                num_heads=(1, 1, 1, 1), window_size=2)
        if name == "MedNeXt":  # with its global response norm (a vector norm over H, W)
            return mn.MedNeXt(spatial_dims=2, in_channels=3, out_channels=3, init_filters=8,
                              kernel_size=3, global_resp_norm=True)
        if name == "SegResNet":
            return mn.SegResNet(spatial_dims=2, in_channels=3, out_channels=3, init_filters=8)
        return mn.BasicUNet(spatial_dims=2, in_channels=3, out_channels=3,
                            features=(8, 8, 16, 32, 64, 8))
    return build


def _segformer() -> nn.Module:
    import segmentation_models_pytorch as smp

    model = smp.Segformer(encoder_name="mit_b0", encoder_weights=None, classes=3)
    for m in model.modules():  # stochastic depth draws random numbers: off, as for
        if hasattr(m, "drop_prob"):  # torchvision's convnext_tiny here
            m.drop_prob = 0.0
    return model


MODELS: dict[str, Model] = {
    "timm_efficientnet_b0": Model(_timm("efficientnet_b0"), (64, 64), 0.95),
    "timm_convnext_atto": Model(_timm("convnext_atto"), (64, 64), 0.95),
    "timm_regnety_002": Model(_timm("regnety_002"), (64, 64), 0.95),
    "timm_resnest14d": Model(_timm("resnest14d"), (64, 64), 0.95),
    "timm_tf_efficientnetv2_s": Model(_timm("tf_efficientnetv2_s"), (64, 64), 0.95),
    # the same blocks (fused MBConv, TensorFlow's "same" padding) at 5.9M parameters, not 20M
    "timm_tf_efficientnetv2_b0": Model(_timm("tf_efficientnetv2_b0"), (64, 64), 0.95),
    # at 80x80 its 3x3 maps make one process's own step-1 gradients move by 2e-7 relative
    # when the input moves by 1e-15 (measured): 112x112 is well conditioned (1e-9)
    "tv_inception_v3": Model(_tv("inception_v3", aux_logits=False, init_weights=False,
                                 dropout=0.0), (112, 112), 0.95),
    "tv_convnext_tiny": Model(_tv("convnext_tiny", stochastic_depth_prob=0.0), (64, 64), 0.95),
    "tv_efficientnet_b0": Model(_tv("efficientnet_b0", dropout=0.0,
                                    stochastic_depth_prob=0.0), (64, 64), 0.95),
    "smp_Unet": Model(_smp("Unet"), (64, 64), 0.95, segmentation=True),
    "smp_FPN": Model(_smp("FPN", decoder_dropout=0.0), (64, 64), 0.95, segmentation=True),
    "smp_DeepLabV3Plus": Model(_smp("DeepLabV3Plus", decoder_aspp_dropout=0.0), (64, 64), 0.95,
                               segmentation=True),
    "monai_UNet": Model(_monai("UNet"), (64, 64), 0.95, segmentation=True),
    "monai_SegResNet": Model(_monai("SegResNet"), (64, 64), 0.95, segmentation=True),
    "monai_BasicUNet": Model(_monai("BasicUNet"), (64, 64), 0.95, segmentation=True),
    # beyond the list: channel splits (MixConv), stacked branches (selective kernels),
    # the channel shuffle, adaptive pooling to sizes that do not divide the map (PSPNet)
    "timm_mixnet_s": Model(_timm("mixnet_s"), (64, 64), 0.95),
    "timm_skresnet18": Model(_timm("skresnet18"), (64, 64), 0.95),
    "tv_shufflenet_v2_x0_5": Model(_tv("shufflenet_v2_x0_5"), (64, 64), 0.95),
    # issue 40: tokens are pixels (efficient self-attention over every token: ring
    # attention), a ViT encoder on a volume, global response norms, position attention
    "smp_Segformer": Model(_segformer, (64, 64), 0.95, segmentation=True),
    "monai_UNETR": Model(_monai("UNETR"), (32, 32, 32), 0.95, segmentation=True),
    "monai_SwinUNETR_2d": Model(_monai("SwinUNETR_2d"), (64, 64), 0.95, segmentation=True),
    "monai_SwinUNETR_3d": Model(_monai("SwinUNETR_3d"), (64, 64, 64), 0.95, segmentation=True),
    "monai_MedNeXt": Model(_monai("MedNeXt"), (64, 64), 0.95, segmentation=True),
    "timm_convnextv2_atto": Model(_timm("convnextv2_atto"), (64, 64), 0.95),
    # cross-covariance attention (sums over every token), MobileViT-v2's separable attention
    # (a softmax over every patch, GroupNorm over the patches) on unfolded 2x2 patches
    "timm_edgenext_xx_small": Model(_timm("edgenext_xx_small"), (64, 64), 0.95),
    "timm_mobilevitv2_050": Model(_timm("mobilevitv2_050"), (64, 64), 0.95),
    "smp_MAnet": Model(_smp("MAnet"), (64, 64), 0.95, segmentation=True),
    # block attention in windows on the tiles, grid attention over cells of every tile (ring
    # attention with its relative-position bias): windows of 2 at 64^2
    "timm_maxvit_nano_rw_256": Model(_timm("maxvit_nano_rw_256", img_size=64), (64, 64), 0.95),
    # overlapping key windows (a halo per block); at 256^2 its last block's one window is the
    # whole 8x8 map and runs whole
    "timm_halonet26t": Model(_timm("halonet26t"), (256, 256), 0.95),
    # linear attention inside torch.autocast(enabled=False), here in the model's dtype
    # (tests/mpi/cases/efficientvit_cases.py also trains timm's float32 attention)
    "timm_efficientvit_b0": Model(lambda: efficientvit_b0(float64_attention=True), (128, 128),
                                  0.95),
    "timm_tresnet_m": Model(_timm("tresnet_m"), (64, 64), 0.95),
    "smp_PSPNet": Model(_smp("PSPNet", psp_dropout=0.0, encoder_depth=5, upsampling=32),
                        (96, 96), 0.95, segmentation=True),
}

P = fxpar.Plan
PLANS: dict[str, tuple[fxpar.Plan, int]] = {  # plan, global batch
    "one": (P(), 2),
    "sp2": (P(spatial_parts=2, slice="vertical"), 2),
    "sp4": (P(spatial_parts=4, slice="square"), 2),
    "pp2": (P(stages=2, microbatches=2, schedule="1f1b"), 4),
    "sp2_pp": (P(stages=2, spatial_parts=2, microbatches=2, schedule="1f1b"), 4),
    "sp2_dp2": (P(spatial_parts=2, data_parallel=2), 4),
}


def run(model: str, plan: str) -> None:
    m, (p, batch) = MODELS[model], PLANS[plan]
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        rp = check(Case(m.build, (batch, 3, *m.size), p, classes=3 if m.segmentation else 5,
                        segmentation=m.segmentation))
    if rp is None or not p.spatial:
        return
    cov = rp.program.traced.meta[Coverage.KEY]
    print(f"coverage {model} {plan}: {cov.share:.4f} ({cov.ended or 'whole model'})")
    assert cov.share >= m.coverage, (
        f"{model} under {plan}: the spatial region covers {cov.share:.1%} < {m.coverage:.0%} "
        f"of the forward FLOPs on image tensors: {cov.ended}")
    said = [str(w.message) for w in seen if "spatial region" in str(w.message)]
    assert bool(said) == (cov.share < fxpar.compiler.driver.COVERAGE_WARN), said


for _model in MODELS:
    for _plan in PLANS:
        globals()[f"case_{_model}__{_plan}"] = (lambda a=_model, b=_plan: run(a, b))


CI_OTHER_PLANS = {"one": "timm_convnext_atto", "sp4": "monai_UNet", "pp2": "tv_efficientnet_b0",
                  "sp2_pp": "smp_DeepLabV3Plus", "sp2_dp2": "monai_BasicUNet"}
"""The model each plan other than SP2 runs on in CI: a different kind for each. SP4 runs on
MONAI's U-Net (skips across 2x2 tiles); smp's U-Net under SP4 took 31 s of the suite, and it is
predicted under SP4 in tests/mpi/cases/predict_cases.py."""

CI_NOT_SP2 = {
    "timm_tf_efficientnetv2_s": "timm_tf_efficientnetv2_b0 has its blocks at a quarter of the "
                                "parameters (SP2 took 52 s of the suite)",
    "tv_convnext_tiny": "timm_convnext_atto trains the ConvNeXt block under 1 rank and SP2 "
                        "(SP2 took 46 s of the suite)",
    "tv_efficientnet_b0": "it runs under PP2 in CI, timm_efficientnet_b0 under SP2 (SP2 took "
                          "20 s of the suite)",
    "monai_SwinUNETR_3d": "monai_SwinUNETR_2d trains the same shifted windows, masks, rolls "
                          "and patch merging; at 64^3 in float64 (the least size its five "
                          "halvings allow) a 2-rank case was killed for memory on the 23 GB "
                          "test machine beside the rest of the suite",
    "timm_convnextv2_atto": "tests/mpi/cases/ops40_cases.py trains it under SP2 and SP4",
    "timm_halonet26t": "tests/mpi/cases/halonet_cases.py trains it under SP2 and SP4",
    "timm_efficientvit_b0": "tests/mpi/cases/efficientvit_cases.py trains it under SP2 and SP4",
    "timm_tresnet_m": "tests/mpi/cases/ops40_cases.py trains it under SP2 and SP4",
    "smp_MAnet": "its one attention block (at 1/32 of the image) runs whole; smp_Unet trains "
                 "the same encoder (SP2 took 15 s)",
}
"""The models CI does not run under SP2, and which CI case trains what they would show;
``FXPAR_LIBRARY_MATRIX=1`` runs them under every plan. Times measured in one ``make test``."""


def ci_subset() -> list[str]:
    """Every model under SP2 but :data:`CI_NOT_SP2`; each other plan on one model
    (:data:`CI_OTHER_PLANS`)."""
    assert set(CI_OTHER_PLANS) == set(PLANS) - {"sp2"} and set(CI_OTHER_PLANS.values()) <= \
        set(MODELS) and set(CI_NOT_SP2) <= set(MODELS)
    return [f"case_{m}__sp2" for m in MODELS if m not in CI_NOT_SP2] + \
        [f"case_{model}__{plan}" for plan, model in CI_OTHER_PLANS.items()]


torch.set_num_threads(1)
