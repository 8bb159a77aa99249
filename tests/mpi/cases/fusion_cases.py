"""Halo fusion (``Plan(halo_fusion=...)``) vs one process, in float64 (run by
tests/mpi/test_fusion.py): loss, every gradient, parameters after 2 SGD steps, every buffer, on
fused groups holding BatchNorm (statistics of the owned cells only), strided convolutions and
pools, depthwise separable chains, uneven tiles, volumes, and with pipelining, GEMS and data
parallelism; and what it does: fewer messages per step, and a fused step whose BatchNorm took
its statistics over the border too is caught."""

from __future__ import annotations

import copy
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torchvision
from helpers.models import resnet18_narrow
from helpers.transparency import Case, check, sub_comm

import fxpar
from fxpar import models
from fxpar.comm.mpi import Comm
from fxpar.passes.halo_fusion import FUSION_KEY
from fxpar.runtime.spatial import batchnorm

P = fxpar.Plan


def _resnet() -> torch.nn.Module:
    """torchvision's resnet18; the other resnet18 cases take the same blocks at a sixteenth
    of the width (tests/helpers/models.py): fusion groups and their borders follow the kernels
    and strides, not the channels."""
    return torchvision.models.resnet18(num_classes=5)


def _amoeba() -> torch.nn.Module:
    return models.build("amoebanet", num_classes=5, num_layers=3, num_filters=16)


def _unet() -> torch.nn.Module:
    return models.build("unet", num_classes=3, base_channels=4, depth=3)


def _mobilenet() -> torch.nn.Module:  # depthwise-separable chains, ReLU6, strided depthwise
    return torchvision.models.mobilenet_v2(num_classes=5, width_mult=0.25, dropout=0.0)


def _unet3d() -> torch.nn.Module:
    return models.build("unet3d", in_channels=3, num_classes=3, base=2, depth=3)


CASES: dict[str, tuple[Callable[[], torch.nn.Module], tuple[int, ...], fxpar.Plan, bool]] = {
    "resnet18_sp4_square_all": (_resnet, (2, 3, 64, 64), P(spatial_parts=4, halo_fusion="all"),
                                False),
    "resnet18_sp3_horizontal_uneven_all": (resnet18_narrow, (2, 3, 70, 52),
                                           P(spatial_parts=3, slice="horizontal",
                                             halo_fusion="all"), False),
    "amoeba_sp4_square_all": (_amoeba, (2, 3, 48, 48), P(spatial_parts=4, halo_fusion="all"),
                              False),
    "mobilenet_v2_sp2_vertical_all": (_mobilenet, (2, 3, 64, 64),
                                      P(spatial_parts=2, slice="vertical",
                                        halo_fusion="all"), False),
    "unet_sp4_all": (_unet, (2, 3, 32, 40), P(spatial_parts=4, halo_fusion="all"), True),
    "unet_sp2_auto": (_unet, (2, 3, 32, 32), P(spatial_parts=2, halo_fusion="auto"), True),
    "unet3d_cube_all": (_unet3d, (2, 3, 16, 16, 16),
                        P(spatial_parts=4, slice="cube", halo_fusion="all"), True),
    "amoeba_sp2_pp2_1f1b_all": (_amoeba, (4, 3, 48, 48),
                                P(stages=2, spatial_parts=2, microbatches=2, schedule="1f1b",
                                  halo_fusion="all"), False),
    "unet_sp2_gems_all": (_unet, (4, 3, 32, 32),
                          P(stages=2, spatial_parts=2, gems=True, microbatches=2,
                            halo_fusion="all"), True),
    "resnet18_sp2_dp2_all_recompute": (resnet18_narrow, (4, 3, 64, 64),
                                       P(spatial_parts=2, data_parallel=2, halo_fusion="all",
                                         recompute="always"), False),
}


def _case(name: str) -> None:
    build, shape, plan, seg = CASES[name]
    rp = check(Case(build, shape, plan, classes=3 if seg else 5, segmentation=seg))
    if rp is None:  # a rank the plan does not use
        return
    assert rp.program.spatial is not None
    groups = rp.program.spatial.build(0, 0).meta[FUSION_KEY]
    assert groups, f"{name}: nothing was fused, so the case checks nothing of fusion"


for _name in CASES:
    globals()[f"case_{_name}"] = (lambda a=_name: _case(a))


@contextmanager
def _sends() -> Iterator[Counter]:
    """Point-to-point sends any communicator of this process posts."""
    calls: Counter = Counter()
    old = Comm.isend

    def isend(self: Comm, *args: Any, **kw: Any) -> Any:
        calls["isend"] += 1
        return old(self, *args, **kw)

    Comm.isend = isend  # type: ignore[method-assign]
    try:
        yield calls
    finally:
        Comm.isend = old  # type: ignore[method-assign]


def _step(model: torch.nn.Module, plan: fxpar.Plan, comm: Comm, x: torch.Tensor,
          y: torch.Tensor) -> tuple[float, int]:
    program = fxpar.compile(copy.deepcopy(model), plan,
                            torch.empty(x.shape, dtype=x.dtype, device="meta"))
    with program.local(comm) as rp, _sends() as calls:
        loss = rp.train_step(x, y)
    return float(loss), calls["isend"]


def case_fusion_sends_fewer_messages_for_the_same_loss() -> None:
    """ResNet-18 SP4: "all" posts fewer halo messages per step than "off" (each basic block's
    two 3x3 convolutions share one exchange), with the same loss."""
    comm = sub_comm(4)
    if comm is None:
        return
    torch.manual_seed(0)
    model = resnet18_narrow().double()
    x = torch.randn(2, 3, 64, 64, dtype=torch.float64)
    y = torch.randint(0, 5, (2,))
    loss0, sent0 = _step(model, P(spatial_parts=4), comm, x, y)
    loss1, sent1 = _step(model, P(spatial_parts=4, halo_fusion="all"), comm, x, y)
    assert sent1 < sent0 * 0.75, (comm.rank, sent0, sent1)
    assert abs(loss0 - loss1) <= 1e-12 * abs(loss0), (loss0, loss1)


def case_harness_catches_border_statistics() -> None:
    """The check fails when a fused group's BatchNorm takes its statistics over the whole
    region (border included) instead of the owned box: the harness sees fusion's one trap."""
    original = batchnorm.batch_norm
    boxes = [0]

    def whole_region(*args: Any, box: Any = None, **kw: Any) -> torch.Tensor:
        boxes[0] += box is not None
        return original(*args, **kw)

    batchnorm.batch_norm = whole_region
    try:
        caught = outside = False
        try:  # None: a rank outside the plan's 4 (the case runs in a launch of more)
            outside = check(Case(resnet18_narrow, (2, 3, 64, 64),
                                 P(spatial_parts=4, halo_fusion="all"))) is None
        except AssertionError:
            caught = True
        if outside:
            return
        assert boxes[0] > 0, "no fused BatchNorm ran"
        assert caught, "the harness did not notice statistics over the border"
    finally:
        batchnorm.batch_norm = original


torch.set_num_threads(1)
