"""1-D models (sequences (N, C, L)) for the spatial tests on a one-dimensional tile grid: the
op classes one model each, a genomic / signal CNN classifier and a 1-D U-Net
(tests/unit/test_spatial_1d.py, tests/mpi/cases/seq1d_cases.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def _block(cin: int, cout: int, stride: int = 1) -> list[nn.Module]:
    return [nn.Conv1d(cin, cout, 5, stride=stride, padding=2), nn.BatchNorm1d(cout), nn.ReLU()]


class Classifier(nn.Module):
    """A genomic / signal CNN: conv-BN-ReLU blocks, max pools, a stride-2 convolution, a
    dilated one, a global mean over L and a linear head."""

    def __init__(self, c: int = 4, classes: int = 5) -> None:
        super().__init__()
        self.body = nn.Sequential(
            *_block(2, c), nn.MaxPool1d(3, stride=2, padding=1),
            *_block(c, 2 * c, stride=2), nn.MaxPool1d(2),
            nn.Conv1d(2 * c, 2 * c, 3, padding=2, dilation=2), nn.BatchNorm1d(2 * c), nn.ReLU())
        self.fc = nn.Linear(2 * c, classes)

    def forward(self, x):
        return self.fc(self.body(x).mean(-1))


class UNet1d(nn.Module):
    """A 1-D U-Net for per-position classes: two max-pool levels down, back up by a transposed
    convolution (padded to the skip's odd length) and by linear interpolation to the skip's
    length, skip concatenations, a 1x1 head."""

    def __init__(self, c: int = 4, classes: int = 3) -> None:
        super().__init__()
        self.enc1 = nn.Sequential(*_block(2, c))
        self.enc2 = nn.Sequential(*_block(c, 2 * c))
        self.mid = nn.Sequential(*_block(2 * c, 2 * c))
        self.up = nn.ConvTranspose1d(2 * c, 2 * c, 2, stride=2)
        self.dec2 = nn.Sequential(*_block(4 * c, c))
        self.dec1 = nn.Sequential(*_block(2 * c, c))
        self.head = nn.Conv1d(c, classes, 1)

    def forward(self, x):
        e1 = self.enc1(x)
        e2 = self.enc2(F.max_pool1d(e1, 2))
        m = self.mid(F.max_pool1d(e2, 2))
        u = self.up(m)
        u = F.pad(u, (0, e2.shape[-1] - u.shape[-1]))
        d2 = self.dec2(torch.cat([u, e2], 1))
        d1 = F.interpolate(d2, size=e1.shape[-1], mode="linear", align_corners=False)
        return self.head(self.dec1(torch.cat([d1, e1], 1)))


class Convs(nn.Module):
    """Conv1d with padding, stride + groups, an even dilated kernel without padding;
    BatchNorm1d, group norm and instance norm over the whole sequence; a global mean."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv1d(2, 6, 3, padding=1), nn.BatchNorm1d(6), nn.ReLU(),
            nn.Conv1d(6, 6, 5, stride=2, padding=2, groups=2), nn.GroupNorm(3, 6), nn.SiLU(),
            nn.Conv1d(6, 4, 4, dilation=3), nn.InstanceNorm1d(4, affine=True), nn.ReLU())
        self.fc = nn.Linear(4, 5)

    def forward(self, x):
        return self.fc(self.body(x).mean(2))


class Pools(nn.Module):
    """Max pool with ceil_mode and padding, average pools with count_include_pad=False and
    ceil_mode, plain; adaptive average pooling to a size that divides (a pool) and to one that
    does not (bins), adaptive max pooling to bins and to a divisor; amax and a vector norm over
    L."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(2, 4, 3, padding=1)
        self.fc = nn.Linear(4 * 5 + 4 * 4 + 4 * 5 + 4 * 2 + 4 + 4, 5)

    def forward(self, x):
        x = self.conv(x)
        x = F.max_pool1d(x, 3, stride=2, padding=1, ceil_mode=True)
        a = F.avg_pool1d(x, 3, stride=2, padding=1, ceil_mode=True, count_include_pad=False)
        b = F.avg_pool1d(torch.relu(x), 2, stride=1)
        feats = [F.adaptive_avg_pool1d(a, 5), F.adaptive_avg_pool1d(b[..., :36], 4),
                 F.adaptive_max_pool1d(a, 5), F.adaptive_max_pool1d(b[..., :36], 2),
                 b.amax(-1, keepdim=True), a.norm(dim=-1, keepdim=True)]
        return self.fc(torch.cat([f.flatten(1) for f in feats], 1))


class Upsampling(nn.Module):
    """Transposed convolutions (kernel 2 stride 2; kernel 3 stride 2 padding 1 with
    output_padding; kernel 3 stride 1), linear interpolation with and without align_corners,
    nearest by a scale and to an odd size."""

    def __init__(self) -> None:
        super().__init__()
        self.down = nn.Conv1d(2, 4, 3, stride=2, padding=1)
        self.up1 = nn.ConvTranspose1d(4, 4, 2, stride=2)
        self.up2 = nn.ConvTranspose1d(4, 3, 3, stride=2, padding=1, output_padding=1)
        self.same = nn.ConvTranspose1d(4, 4, 3, padding=1)
        self.out = nn.Conv1d(3 + 4 + 4, 5, 1)

    def forward(self, x):
        y = torch.relu(self.down(x))
        a = self.up1(y)
        size = a.shape[-1]
        b = F.interpolate(self.up2(y), size=size, mode="linear", align_corners=True)
        c = F.interpolate(self.same(y), scale_factor=2, mode="linear", align_corners=False)
        d = F.interpolate(F.interpolate(y, size=7, mode="nearest"), size=size, mode="nearest")
        return self.out(torch.cat([b, a + c, d], 1)).mean(2)


class Pads(nn.Module):
    """Reflect, replicate, circular and constant padding (modules and F.pad), a crop (a
    U-Net's skip), torch.roll along L, sum over L."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(2, 4, 3)
        self.reflect = nn.ReflectionPad1d((2, 1))
        self.conv2 = nn.Conv1d(4, 4, 3, padding=1, padding_mode="replicate")
        self.conv3 = nn.Conv1d(4, 4, 3, padding=1, padding_mode="circular")
        self.fc = nn.Linear(8, 5)

    def forward(self, x):
        y = self.conv(F.pad(x, (1, 1), mode="replicate"))
        z = self.conv3(self.conv2(self.reflect(y)))
        z = F.pad(z, (2, 1), value=0.5)
        n = y.shape[-1]  # z is n + 6 long: crop it back to y's length
        cat = torch.cat([z[:, :, 3:3 + n], torch.roll(y, 5, -1)], 1)
        return self.fc(cat.sum(-1) / 100)


class PerPosition(nn.Module):
    """Ops on the channels of each position: a channels-last block (transpose to (N, L, C),
    LayerNorm and Linear over C, back), max over the channels (values and indices) brought back
    by unsqueeze, softmax over the channels, a channel split."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Conv1d(2, 6, 5, padding=2)
        self.norm, self.mlp = nn.LayerNorm(6), nn.Linear(6, 6)
        self.b = nn.Conv1d(6, 4, 3, padding=1)

    def forward(self, x):
        y = self.a(x)
        y = y + self.mlp(self.norm(y.transpose(1, 2))).transpose(1, 2)
        values, where = y.max(dim=1)                                 # (N, L) each
        y = y * values.unsqueeze(1) + where.unsqueeze(1) * 0.1
        p, q = torch.split(y.softmax(1), [2, 4], dim=1)
        return self.b(torch.cat([q, p], 1)).mean(-1)
