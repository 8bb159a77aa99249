"""U-Net (Ronneberger et al. 2015) for full-resolution semantic segmentation.

Why it is in the zoo: segmentation of very large images is the case spatial parallelism is for,
since the output has the input's resolution and no stage can shrink the image away.  U-Net also
has long skip connections from every encoder level to the decoder, which exercise the layer and
pipeline cutters (tensors that live across many stages).

Layout for ``depth = d`` and ``base_channels = c``::

    encoder level k = 0..d-1: double conv (c * 2**k channels), then 2x2 max pool
    bottleneck:               double conv (c * 2**d channels)
    decoder level k = d-1..0: 2x2 stride-2 transposed conv to c * 2**k channels,
                              concat with the encoder level-k output, double conv
    head:                     1x1 conv to num_classes (per-pixel logits)

A double conv is (3x3 conv padding 1, BatchNorm, ReLU) twice; the padding keeps H and W, so
(unlike the original, unpadded U-Net) the output has exactly the input's H and W.  That needs H
and W divisible by ``2**depth``: each max pool floors odd sizes and the transposed conv exactly
doubles, so otherwise the skip concat fails.  There is no check inside ``forward`` (it would
break tracing); callers must pass suitable sizes.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

__all__ = ["DoubleConv", "UNet", "unet"]


class DoubleConv(nn.Module):
    """(3x3 conv, BatchNorm, ReLU) x 2, the unit of every U-Net level."""

    def __init__(self, in_channels: int, out_channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.relu1 = nn.ReLU(inplace=False)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_channels)
        self.relu2 = nn.ReLU(inplace=False)

    def forward(self, x: Tensor) -> Tensor:
        """Two conv-BN-ReLU steps at unchanged resolution."""
        x = self.relu1(self.bn1(self.conv1(x)))
        return self.relu2(self.bn2(self.conv2(x)))


class UNet(nn.Module):
    """Encoder-decoder with skip concatenations; output ``(N, num_classes, H, W)``."""

    def __init__(
        self,
        in_channels: int = 3,
        num_classes: int = 2,
        base_channels: int = 16,
        depth: int = 4,
    ) -> None:
        super().__init__()
        if depth < 1:
            raise ValueError(f"depth must be >= 1, got {depth}")
        if base_channels < 1:
            raise ValueError(f"base_channels must be >= 1, got {base_channels}")
        widths = [base_channels * 2**k for k in range(depth + 1)]

        self.down = nn.ModuleList()
        self.pools = nn.ModuleList()
        channels = in_channels
        for k in range(depth):
            self.down.append(DoubleConv(channels, widths[k]))
            self.pools.append(nn.MaxPool2d(2, stride=2))
            channels = widths[k]
        self.bottleneck = DoubleConv(channels, widths[depth])

        # Decoder modules are stored deepest level first, the order forward uses them in.
        self.ups = nn.ModuleList()
        self.up_convs = nn.ModuleList()
        for k in reversed(range(depth)):
            self.ups.append(nn.ConvTranspose2d(widths[k + 1], widths[k], 2, stride=2))
            self.up_convs.append(DoubleConv(2 * widths[k], widths[k]))
        self.head = nn.Conv2d(widths[0], num_classes, 1)

    def forward(self, x: Tensor) -> Tensor:
        """Images ``(N, C, H, W)``, H and W divisible by ``2**depth`` -> logits at full size."""
        skips: list[Tensor] = []
        for block, pool in zip(self.down, self.pools, strict=True):
            x = block(x)
            skips.append(x)
            x = pool(x)
        x = self.bottleneck(x)
        for up, block, skip in zip(self.ups, self.up_convs, reversed(skips), strict=True):
            x = block(torch.cat([skip, up(x)], dim=1))
        return self.head(x)


def unet(
    in_channels: int = 3,
    num_classes: int = 2,
    base_channels: int = 16,
    depth: int = 4,
) -> nn.Module:
    """Build a U-Net with ``depth`` pooling levels; H and W must be divisible by ``2**depth``.

    ``base_channels`` is the width of the first level; each level down doubles it.  The output
    has ``num_classes`` channels of per-pixel logits at the input's H and W.
    """
    return UNet(in_channels, num_classes, base_channels, depth)
