"""3D U-Net (Çiçek et al. 2016, "3D U-Net: Learning Dense Volumetric Segmentation from Sparse
Annotation") for full-resolution volumetric segmentation.

Why it is in the zoo: volumes (CT, MRI, microscopy stacks) are where activations outgrow one
device first, since a 3-D feature map grows with the cube of the side; like the 2-D U-Net its
output keeps the input's resolution and its long skip connections span the whole network, so it
exercises spatial parallelism over three dimensions and the layer and pipeline cutters.

Layout for ``depth = d`` (resolution levels, the paper has 4) and ``base = c`` (the paper has 32),
with the paper's channel scheme: the *second* conv of every level doubles the channels::

    analysis level k = 0..d-2: conv to c * 2**k, conv to c * 2**(k+1), 2x2x2 max pool
    bottom level (k = d-1):    conv to c * 2**(d-1), conv to c * 2**d
    synthesis level k = d-2..0: 2x2x2 stride-2 transposed conv (keeps its c * 2**(k+2) channels,
                               as in the paper), concat with the level-k analysis output
                               (c * 2**(k+1) channels), conv to c * 2**(k+1), conv to c * 2**(k+1)
    head:                      1x1x1 conv to num_classes (per-voxel logits)

For the paper's settings (1 input channel, base 32, depth 4) this gives its 32-64 / 64-128 /
128-256 / 256-512 analysis path, 512-channel up-convolutions and 256 / 128 / 64 synthesis widths.
Every conv is ``Conv3d(3x3x3, padding 1) -> BatchNorm3d -> ReLU``.  Unlike the paper's unpadded
convolutions, the padding keeps D, H and W, so the output has exactly the input's spatial size;
that needs D, H and W divisible by ``2**(depth - 1)`` (each max pool floors odd sizes and the
transposed conv exactly doubles, so otherwise the skip concat fails).  There is no check inside
``forward`` (it would break tracing); callers must pass suitable sizes.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

__all__ = ["ConvBNReLU3d", "UNet3D", "UNet3DLevel", "unet3d"]


class ConvBNReLU3d(nn.Module):
    """3x3x3 conv (padding 1, no bias: a BatchNorm follows), BatchNorm3d, ReLU."""

    def __init__(self, in_channels: int, out_channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv3d(in_channels, out_channels, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm3d(out_channels)
        self.relu = nn.ReLU(inplace=False)

    def forward(self, x: Tensor) -> Tensor:
        """One conv-BN-ReLU step at unchanged resolution."""
        return self.relu(self.bn(self.conv(x)))


class UNet3DLevel(nn.Module):
    """Two conv-BN-ReLU steps: ``in -> mid -> out`` channels, the unit of every level."""

    def __init__(self, in_channels: int, mid_channels: int, out_channels: int) -> None:
        super().__init__()
        self.block1 = ConvBNReLU3d(in_channels, mid_channels)
        self.block2 = ConvBNReLU3d(mid_channels, out_channels)

    def forward(self, x: Tensor) -> Tensor:
        """Both steps, resolution unchanged."""
        return self.block2(self.block1(x))


class UNet3D(nn.Module):
    """Volumetric encoder-decoder with skip concatenations; ``(N, C, D, H, W)`` in,
    ``(N, num_classes, D, H, W)`` out."""

    def __init__(
        self,
        in_channels: int = 1,
        num_classes: int = 3,
        base: int = 32,
        depth: int = 4,
    ) -> None:
        super().__init__()
        if depth < 1:
            raise ValueError(f"depth must be >= 1 (the number of resolution levels), got {depth}")
        if base < 1:
            raise ValueError(f"base must be >= 1, got {base}")
        if in_channels < 1 or num_classes < 1:
            raise ValueError(
                f"in_channels and num_classes must be >= 1, got {in_channels} and {num_classes}"
            )

        # Analysis path: level k convs to base * 2**k, then base * 2**(k+1) channels.
        self.down = nn.ModuleList()
        self.pools = nn.ModuleList()
        channels = in_channels
        for k in range(depth - 1):
            self.down.append(UNet3DLevel(channels, base * 2**k, base * 2 ** (k + 1)))
            self.pools.append(nn.MaxPool3d(2, stride=2))
            channels = base * 2 ** (k + 1)
        self.bottom = UNet3DLevel(channels, base * 2 ** (depth - 1), base * 2**depth)
        channels = base * 2**depth

        # Synthesis path, stored deepest level first (the order forward uses them in).  The
        # up-convolution keeps its channel count, as in the paper (512 -> 512 at the bottom).
        self.ups = nn.ModuleList()
        self.up_convs = nn.ModuleList()
        for k in reversed(range(depth - 1)):
            skip = base * 2 ** (k + 1)
            self.ups.append(nn.ConvTranspose3d(channels, channels, 2, stride=2))
            self.up_convs.append(UNet3DLevel(channels + skip, skip, skip))
            channels = skip
        self.head = nn.Conv3d(channels, num_classes, 1)

    def forward(self, x: Tensor) -> Tensor:
        """Volumes with D, H, W divisible by ``2**(depth - 1)`` -> logits at full size."""
        skips: list[Tensor] = []
        for level, pool in zip(self.down, self.pools, strict=True):
            x = level(x)
            skips.append(x)
            x = pool(x)
        x = self.bottom(x)
        for up, level, skip in zip(self.ups, self.up_convs, reversed(skips), strict=True):
            x = level(torch.cat([skip, up(x)], dim=1))
        return self.head(x)


def unet3d(
    in_channels: int = 1,
    num_classes: int = 3,
    base: int = 32,
    depth: int = 4,
) -> nn.Module:
    """Build the 3D U-Net of Çiçek et al. 2016 with ``depth`` resolution levels.

    ``depth - 1`` max pools, so D, H and W must be divisible by ``2**(depth - 1)``.  Channels
    follow the paper (the second conv of each analysis level doubles them; ``base`` is the width
    of the very first conv).  The defaults are the paper's: one input channel, 3 classes, base 32,
    4 levels (about 19M parameters).  The output has ``num_classes`` channels of per-voxel logits
    at the input's D, H and W.
    """
    return UNet3D(in_channels, num_classes, base, depth)
