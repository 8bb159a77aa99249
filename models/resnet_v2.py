"""Pre-activation ResNet for CIFAR-style inputs (He et al. 2016, "Identity Mappings in Deep
Residual Networks"), the "ResNet-110-v2" that MPI4DL benchmarks.

Why pre-activation: each block is ``x + F(x)`` with BatchNorm and ReLU moved *inside* ``F``
before each conv, so the identity path from input to output carries no nonlinearity at all.
That is what lets ResNet-110 (and deeper) train well, and it is also convenient for fxpar: the
residual adds are plain elementwise ops between tensors of one layout.

Layout for ``depth = 6n + 2`` and ``width = w``::

    3x3 conv, 16w channels
    group 1: n blocks, 16w channels, stride 1
    group 2: n blocks, 32w channels, first block stride 2
    group 3: n blocks, 64w channels, first block stride 2
    BatchNorm, ReLU, adaptive avg pool to 1x1, flatten, linear

Each basic block is BN-ReLU-conv3x3-BN-ReLU-conv3x3.  Where the channel count or resolution
changes, the shortcut is a 1x1 strided conv applied to the block's pre-activated input (as in the
authors' code) rather than zero padding, which would need spatial slicing in the graph.  The
global average pool is adaptive, so any image size works; every stride-2 conv maps
``n -> ceil(n / 2)``, odd sizes included, and the final map is ``ceil(H / 4) x ceil(W / 4)``.
In training mode BatchNorm needs more than one value per channel, so a batch of ONE image needs
``H > 4`` or ``W > 4``; batches of 2+ have no minimum size.

ResNet-110 (n = 18) with 10 classes has about 1.7M parameters, as in the paper.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

__all__ = ["PreActBlock", "PreActResNet", "resnet110_v2", "resnet_v2"]


def _conv3x3(in_channels: int, out_channels: int, stride: int = 1) -> nn.Conv2d:
    """3x3 conv with padding 1 and no bias (a BatchNorm always follows)."""
    return nn.Conv2d(in_channels, out_channels, 3, stride=stride, padding=1, bias=False)


class PreActBlock(nn.Module):
    """Basic pre-activation block: ``x + conv(relu(bn(conv(relu(bn(x))))))``."""

    def __init__(self, in_channels: int, out_channels: int, stride: int = 1) -> None:
        super().__init__()
        self.bn1 = nn.BatchNorm2d(in_channels)
        self.relu1 = nn.ReLU(inplace=False)
        self.conv1 = _conv3x3(in_channels, out_channels, stride)
        self.bn2 = nn.BatchNorm2d(out_channels)
        self.relu2 = nn.ReLU(inplace=False)
        self.conv2 = _conv3x3(out_channels, out_channels)
        # Decided here, not in forward, so the traced graph has no branches.
        self.shortcut: nn.Module | None = None
        if stride != 1 or in_channels != out_channels:
            self.shortcut = nn.Conv2d(in_channels, out_channels, 1, stride=stride, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        """Residual add of the block input (or its projection) and the two-conv branch."""
        out = self.relu1(self.bn1(x))
        # A projection must see the same normalised input as the branch; identity keeps raw x.
        skip = x if self.shortcut is None else self.shortcut(out)
        out = self.conv1(out)
        out = self.conv2(self.relu2(self.bn2(out)))
        return out + skip


class PreActResNet(nn.Module):
    """CIFAR-style pre-activation ResNet: stem conv, three block groups, BN-ReLU-pool-linear."""

    def __init__(self, blocks_per_group: int, num_classes: int = 10, width: int = 1) -> None:
        super().__init__()
        widths = [16 * width, 32 * width, 64 * width]
        self.conv1 = _conv3x3(3, widths[0])
        layers: list[nn.Module] = []
        in_channels = widths[0]
        for group, channels in enumerate(widths):
            for i in range(blocks_per_group):
                stride = 2 if group > 0 and i == 0 else 1
                layers.append(PreActBlock(in_channels, channels, stride))
                in_channels = channels
        self.layers = nn.Sequential(*layers)
        # The last block's output is not normalised yet (pre-activation), hence BN-ReLU here.
        self.bn = nn.BatchNorm2d(in_channels)
        self.relu = nn.ReLU(inplace=False)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(in_channels, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        """Images ``(N, 3, H, W)`` -> class logits ``(N, num_classes)``."""
        x = self.layers(self.conv1(x))
        x = self.pool(self.relu(self.bn(x)))
        return self.fc(torch.flatten(x, 1))


def resnet_v2(depth: int = 110, num_classes: int = 10, width: int = 1) -> nn.Module:
    """Build a pre-activation ResNet of ``depth = 6n + 2`` layers (n basic blocks per group).

    ``width`` multiplies the 16/32/64 channel widths (a wide-ResNet knob for scaling studies).
    """
    if depth < 8 or (depth - 2) % 6 != 0:
        raise ValueError(f"depth must be 6n+2, e.g. 20, 56, 110; got {depth}")
    if width < 1:
        raise ValueError(f"width must be >= 1, got {width}")
    return PreActResNet((depth - 2) // 6, num_classes=num_classes, width=width)


def resnet110_v2(num_classes: int = 10) -> nn.Module:
    """ResNet-110-v2 (18 blocks per group, about 1.7M parameters for 10 classes)."""
    return resnet_v2(depth=110, num_classes=num_classes)
