"""``Plan(channels_last=True)`` vs one process with the same layout, in float64 (run by
tests/mpi/test_channels_last.py): loss, every gradient, parameters after 2 SGD steps, every buffer;
on one rank, a spatial grid, spatial + pipeline stages, and a volume (channels_last_3d). The
compiled program's convolution outputs really are channels-last.

The reference is the model with its convolution weights channels-last too: PyTorch's own
kernels round differently in the two layouts (one process, float64 ResNet-18 at 32x32:
gradients differ by up to 4e-9 where they reach 100), which is not fxpar's to hide; what the
plan promises is the one-process training in that layout."""

from __future__ import annotations

import torch
import torchvision.models as tvm
from helpers.transparency import Case, check

import fxpar
from fxpar import models
from fxpar.program.program import to_channels_last

P = fxpar.Plan


def _cl(build):
    """``build`` with its convolution weights channels-last (the reference's layout)."""
    def made() -> torch.nn.Module:
        model = build()
        to_channels_last(list(model.parameters()))
        return model
    return made


def _unet() -> torch.nn.Module:
    return models.build("unet", num_classes=3, base_channels=4, depth=3)


def case_resnet18_one_rank() -> None:
    check(Case(_cl(lambda: tvm.resnet18(num_classes=5)), (2, 3, 32, 32),
               P(channels_last=True)))


def case_unet_sp4_square() -> None:
    check(Case(_cl(_unet), (2, 3, 32, 40), P(spatial_parts=4, channels_last=True), classes=3,
               segmentation=True))


def case_unet_sp3_pp2() -> None:
    check(Case(_cl(_unet), (4, 3, 32, 32), P(stages=2, spatial_parts=3, slice="horizontal",
                                        microbatches=2, channels_last=True),
               classes=3, segmentation=True))


def case_unet3d_slab2() -> None:
    check(Case(_cl(lambda: models.build("unet3d", in_channels=3, num_classes=3, base=2,
                                        depth=3)),
               (2, 3, 16, 16, 16), P(spatial_parts=2, slice="slab", channels_last=True),
               classes=3, segmentation=True))


def case_layout_reaches_the_tiles() -> None:
    """On a tile, the convolutions' outputs (and so the halo windows after them) are
    channels-last."""
    from helpers.transparency import sub_comm

    comm = sub_comm(2)
    if comm is None:
        return
    torch.manual_seed(0)
    model = _unet().double()
    program = fxpar.compile(model, P(spatial_parts=2, channels_last=True),
                            torch.empty(2, 3, 32, 32, dtype=torch.float64, device="meta"),
                            comm=comm)
    seen: list[bool] = []
    with program.local(comm) as rp:
        for m in rp.stages.values():
            for sub in m.modules():
                if type(sub).__name__ == "HaloOp" and sub.kind == "conv":
                    sub.register_forward_hook(lambda mod, a, out: seen.append(
                        out.is_contiguous(memory_format=torch.channels_last)))
        rp.train_step(torch.randn(2, 3, 32, 32, dtype=torch.float64),
                      torch.randint(0, 3, (2, 32, 32)))
    assert seen and all(seen), seen


torch.set_num_threads(1)
