"""Models whose output is a structure, with the loss users write for it, vs one process (run by
tests/mpi/test_outputs.py): a dict with an auxiliary mask and a class head on pooled features
(torchvision's ``{"out", "aux"}``), deep-supervision heads at 1/2 and 1/4 with per-size
targets, a dataclass (the ``ModelOutput`` style), a NamedTuple, and smp's U-Net with
``aux_params`` (``(mask, label)``). Each leaf keeps its own layout: the masks tiled, each at its
own size, the class head whole on every rank of the tile group. The loss is captured over the
structure; a loss that cuts its targets itself (``y[:, ::2, ::2]``) runs on the joined leaves.
Loss, every gradient, parameters after 2 SGD steps, every buffer and the eval output's every
leaf in float64 (tests/helpers/transparency.py)."""

from __future__ import annotations

import dataclasses
import warnings
from typing import NamedTuple

import torch
import torch.nn.functional as F
from helpers.transparency import Case, assert_covers, check
from torch import nn

import fxpar
from fxpar.compiler.loss import LossWarning

CLASSES, LABELS = 3, 4


@dataclasses.dataclass
class SegOutput:
    """A ``ModelOutput``-style dataclass (an unset field is None)."""

    mask: torch.Tensor
    aux: torch.Tensor | None = None
    label: torch.Tensor | None = None


class MaskLabel(NamedTuple):
    mask: torch.Tensor
    label: torch.Tensor


class Heads(nn.Module):
    """A small segmentation net with a mask head at full size, deep-supervision heads at 1/2
    and 1/4 (stride-2 convolutions), an auxiliary mask head and a class head on globally
    pooled features, returned as ``form`` says."""

    def __init__(self, form: str) -> None:
        super().__init__()
        self.form = form
        self.stem = nn.Sequential(nn.Conv2d(3, 6, 3, padding=1), nn.BatchNorm2d(6), nn.ReLU())
        self.down1 = nn.Sequential(nn.Conv2d(6, 6, 3, stride=2, padding=1), nn.GroupNorm(2, 6),
                                   nn.ReLU())
        self.down2 = nn.Sequential(nn.Conv2d(6, 6, 3, stride=2, padding=1), nn.BatchNorm2d(6),
                                   nn.ReLU())
        self.mask = nn.Conv2d(6, CLASSES, 1)
        self.aux = nn.Conv2d(6, CLASSES, 3, padding=1)
        self.ds2 = nn.Conv2d(6, CLASSES, 1)
        self.ds4 = nn.Conv2d(6, CLASSES, 1)
        self.label = nn.Linear(6, LABELS)

    def forward(self, x: torch.Tensor):
        f = self.stem(x)
        h = self.down1(f)
        q = self.down2(h)
        full = f + F.interpolate(h, size=f.shape[2:], mode="nearest")
        mask, label = self.mask(full), self.label(q.mean((2, 3)))
        if self.form == "dict":
            return {"out": mask, "aux": self.aux(f), "label": label}
        if self.form == "deep":
            return mask, [self.ds2(h), self.ds4(q)]
        if self.form == "dataclass":
            return SegOutput(mask, label=label)
        return MaskLabel(mask, label)


def dict_loss(o, y, labels):
    return F.cross_entropy(o["out"], y) + 0.4 * F.cross_entropy(o["aux"], y) + \
        0.2 * F.cross_entropy(o["label"], labels)


def deep_loss(o, y, y2, y4):
    """nnU-Net's deep supervision: each head against the target at its size, halving weights."""
    mask, (half, quarter) = o
    return F.cross_entropy(mask, y) + 0.5 * F.cross_entropy(half, y2) + \
        0.25 * F.cross_entropy(quarter, y4)


def deep_loss_cutting(o, y):
    """The same, the loss cutting the smaller targets itself (strided slices of a tiled
    target: the leaves are joined for it)."""
    mask, (half, quarter) = o
    return F.cross_entropy(mask, y) + 0.5 * F.cross_entropy(half, y[:, ::2, ::2]) + \
        0.25 * F.cross_entropy(quarter, y[:, ::4, ::4])


def dataclass_loss(o: SegOutput, y, labels):
    assert o.aux is None
    return F.cross_entropy(o.mask, y) + 0.3 * F.cross_entropy(o.label, labels)


def namedtuple_loss(o: MaskLabel, y, labels):
    soft = o.mask.softmax(1)
    one_hot = F.one_hot(y, CLASSES).permute(0, 3, 1, 2).to(soft.dtype)
    dice = 1 - (2 * (soft * one_hot).sum((0, 2, 3)) + 1) / (soft.sum((0, 2, 3)) +
                                                          one_hot.sum((0, 2, 3)) + 1)
    return dice.mean() + F.cross_entropy(o.label, labels)


def _mask_labels(shape):
    def make(g: torch.Generator):
        n, h, w = shape[0], shape[2], shape[3]
        return (torch.randint(0, CLASSES, (n, h, w), generator=g),
                torch.randint(0, LABELS, (n,), generator=g))
    return make


def _deep_targets(shape):
    def make(g: torch.Generator):
        y = torch.randint(0, CLASSES, (shape[0], *shape[2:]), generator=g)
        return y, y[:, ::2, ::2].contiguous(), y[:, ::4, ::4].contiguous()
    return make


def _smp_unet():
    import segmentation_models_pytorch as smp

    return smp.Unet(encoder_name="resnet18", encoder_weights=None, classes=CLASSES,
                    encoder_depth=3, decoder_channels=(16, 8, 8),
                    aux_params={"classes": LABELS, "dropout": 0.0})


def smp_loss(o, y, labels):
    import segmentation_models_pytorch as smp

    mask, label = o
    return smp.losses.DiceLoss("multiclass")(mask, y) + F.cross_entropy(label, labels)


P = fxpar.Plan
SP2 = P(spatial_parts=2, slice="vertical")
SP4 = P(spatial_parts=4, slice="square")
SP2_PP2 = P(stages=2, spatial_parts=2, microbatches=2)
SP2_DP2 = P(spatial_parts=2, data_parallel=2)
SP2_GEMS = P(stages=2, spatial_stages=2, spatial_parts=2, gems=True)
"""Both stages spatial, so the loss runs on the tiles of each GEMS copy."""
SP2_SPATIAL_PP2 = P(stages=2, spatial_stages=2, spatial_parts=2, slice="horizontal",
                    microbatches=2)


def _run(build, shape, plan, loss, targets, joined: bool = False, steps: int = 2):
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        rp = check(Case(build, shape, plan, loss=loss, targets=targets(shape), steps=steps))
    said = [str(w.message) for w in seen if issubclass(w.category, LossWarning)]
    if rp is not None and plan.spatial_stages == plan.stages and rp.needs_targets:
        # the loss runs on the tiles; rank 0 (tile 0 of the last stage) says when it is joined
        made = next(iter(rp.tile_loss.plans.values()))
        assert bool(made.joined) == joined, made.joined
        if rp.rank == 0:
            assert bool(said) == joined, said
    assert_covers(rp, f"{loss.__name__} {plan}")


def case_dict_sp2():
    _run(lambda: Heads("dict"), (4, 3, 16, 20), SP2, dict_loss, _mask_labels)


def case_dict_sp4():
    _run(lambda: Heads("dict"), (2, 3, 20, 12), SP4, dict_loss, _mask_labels)


def case_dict_sp2_pp2():
    _run(lambda: Heads("dict"), (4, 3, 16, 16), SP2_PP2, dict_loss, _mask_labels)


def case_deep_sp2_dp2():
    _run(lambda: Heads("deep"), (4, 3, 16, 16), SP2_DP2, deep_loss, _deep_targets)


def case_deep_sp4():
    _run(lambda: Heads("deep"), (2, 3, 24, 16), SP4, deep_loss, _deep_targets)


def case_deep_cutting_sp4():
    # rows 18 = 9 + 9 over 2 tiles: the second tile starts at an odd row, so cutting its own
    # target with y[:, ::2] would take the wrong rows (the leaves and targets are joined)
    _run(lambda: Heads("deep"), (2, 3, 18, 18), SP4, deep_loss_cutting,
         lambda s: lambda g: torch.randint(0, CLASSES, (s[0], *s[2:]), generator=g),
         joined=True)


def case_deep_gems():
    _run(lambda: Heads("deep"), (4, 3, 16, 16), SP2_GEMS, deep_loss, _deep_targets)


def case_dataclass_sp2_microbatches():
    _run(lambda: Heads("dataclass"), (4, 3, 16, 16), SP2_SPATIAL_PP2, dataclass_loss,
         _mask_labels)


def case_namedtuple_sp2_dp2():
    _run(lambda: Heads("namedtuple"), (4, 3, 16, 16), SP2_DP2, namedtuple_loss, _mask_labels)


def case_smp_unet_aux_sp2():
    _run(_smp_unet, (2, 3, 32, 32), SP2, smp_loss, _mask_labels)


def dict_loss_without_aux(o, y, labels):
    """A loss that reads some leaves only: the aux head's gradients stay None, as on one
    process (a zero would let weight decay and momentum move it)."""
    return F.cross_entropy(o["out"], y) + 0.2 * F.cross_entropy(o["label"], labels)


def case_dict_unread_leaf_gems():
    _run(lambda: Heads("dict"), (4, 3, 16, 16), SP2_GEMS, dict_loss_without_aux, _mask_labels)
