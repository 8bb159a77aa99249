"""Library models at the width a plan's case needs.

A case about a schedule, GEMS, data parallelism, halo fusion or a saved program checks how the
plan moves tensors between tiles, stages, copies and replicas; what it needs of the model is
its structure (residual joins across cuts, strided and 1x1 downsampling, BatchNorm, a head),
not its width. torchvision's resnet18 carries 11.2M parameters and resnet50 23.5M; at the 32-64
pixel images of those cases their float64 parameters, gradients and comparisons were most of
each case's time (one 6-rank SP+PP+GEMS+DP case: 13.5 s wide, 2.2 s narrow). The models here are
timm's ResNet code with resnet18's and resnet50's blocks at a sixteenth of the width. The
full-width torchvision models still train in one case of each plan family (and in the library
matrix); the tests/mpi/cases files say which.
"""

from __future__ import annotations

from timm.models.resnet import BasicBlock, Bottleneck, ResNet
from torch import nn

NARROW = dict(channels=(16, 32, 64, 128), stem_width=16, zero_init_last=False)
"""A sixteenth of the width (channels 64-512 become 16-128). ``zero_init_last=False``: timm
zeroes each block's last BatchNorm weight by default, which would leave every convolution of the
residual branches without a gradient in the first step, where a wrong one could not show."""


def resnet18_narrow(num_classes: int = 5) -> nn.Module:
    """resnet18's BasicBlocks (2, 2, 2, 2) at :data:`NARROW` width: 0.72M parameters."""
    return ResNet(BasicBlock, [2, 2, 2, 2], num_classes=num_classes, **NARROW)


def resnet50_narrow(num_classes: int = 5) -> nn.Module:
    """resnet50's Bottlenecks (3, 4, 6, 3) at :data:`NARROW` width: 1.49M parameters."""
    return ResNet(Bottleneck, [3, 4, 6, 3], num_classes=num_classes, **NARROW)
