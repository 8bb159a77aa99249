"""AmoebaNet-D, the image classifier that GPipe (Huang et al. 2019) and torchgpipe scale up.

This is the network of torchgpipe's ``benchmarks/models/amoebanet`` (itself following the
TensorFlow TPU reference implementation), written as an ordinary single-device model so that
fxpar can capture it (``torch.export``) and parallelise it without the model knowing.

Layout (``L = num_layers``, ``F = num_filters``, ``c = F // 4``)::

    stem: 3x3 conv stride 2 (c channels) + BatchNorm
    reduction cell (2c) ─ reduction cell (4c)           <- the rest of the ImageNet stem
    normal cells (4c)  ─ reduction cell (8c)
    normal cells (8c)  ─ reduction cell (16c)
    normal cells (16c)
    classifier: adaptive avg pool to 1x1, flatten, linear

The ``L`` normal cells are spread over the three stacks as evenly as possible, earlier stacks
first (``L = 18`` gives 6/6/6 exactly as torchgpipe; ``L = 4`` gives 2/1/1; ``L = 1`` gives
1/0/0), so that tiny test models are possible without changing the genotype.  With
``num_classes=1000, num_layers=18, num_filters=208`` the model has the 81.5M parameters that
torchgpipe reports for GPipe's AmoebaNet-D (18, 208).

Deliberate differences from torchgpipe's code, all without effect on the parameter count:

* ``max_pool_3x3`` is a real :class:`nn.MaxPool2d` (torchgpipe, and MPI4DL after it, build an
  ``nn.AvgPool2d`` under that name by mistake).  Its padding is 1, so at stride 1 the spatial
  size is preserved; padded positions act as -inf, as in PyTorch.
* ``max_pool_2x2`` uses ``ceil_mode=True``.  For even sizes this is identical to the reference;
  for odd sizes it makes the 2x2 pool agree with every other stride-2 op of the reduction cell
  (all of which map ``n -> ceil(n / 2)``), so odd image sizes work instead of failing in an add.
* The stem does not apply a ReLU to the raw input image (torchgpipe does; it only discards the
  negative half of a normalised image and is absent from the TensorFlow reference).
* The one-pixel shift of :class:`FactorizedReduce` is a single ``nn.ZeroPad2d((-1, 1, -1, 1))``
  (crop the first row/column, zero-pad the last) instead of a tensor slice followed by a pad.
  The values are identical; one pad module is easier for a spatial-parallel compiler to treat
  as a windowed op than a ``getitem`` on spatial dimensions.

Image size: every stride-2 stage maps ``n -> ceil(n / 2)`` and there are five of them, so any
``H, W >= 1`` is accepted (the final map is ``ceil(H / 32) x ceil(W / 32)``); 32x32, 64x64 and
odd sizes such as 65x65 all work.  In training mode BatchNorm needs more than one value per
channel, so a batch of ONE image needs ``H > 32`` or ``W > 32``; batches of 2+ have no minimum.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

__all__ = [
    "NORMAL_CONCAT",
    "NORMAL_OPERATIONS",
    "OPERATIONS",
    "REDUCTION_CONCAT",
    "REDUCTION_OPERATIONS",
    "AmoebaNetD",
    "Cell",
    "FactorizedReduce",
    "amoebanetd",
    "stack_sizes",
]


def _relu_conv_bn(
    in_channels: int,
    out_channels: int,
    kernel_size: int | tuple[int, int] = 1,
    stride: int | tuple[int, int] = 1,
    padding: int | tuple[int, int] = 0,
) -> nn.Sequential:
    """ReLU -> conv (no bias: BatchNorm follows) -> BatchNorm, the unit every op is built from."""
    return nn.Sequential(
        nn.ReLU(inplace=False),
        nn.Conv2d(in_channels, out_channels, kernel_size, stride, padding, bias=False),
        nn.BatchNorm2d(out_channels),
    )


class FactorizedReduce(nn.Module):
    """Halve H and W with two 1x1 stride-2 convs on grids offset by one pixel, then concat.

    A single 1x1 stride-2 conv would only ever look at even rows and columns; the second path
    sees the odd ones, so no input pixel is ignored.  Used where a cell input must be brought
    down to the resolution of the other input (after a reduction cell) and as the stride-2
    form of the ``none`` (identity) op.
    """

    def __init__(self, in_channels: int, out_channels: int) -> None:
        super().__init__()
        if out_channels % 2:
            raise ValueError(f"FactorizedReduce needs an even out_channels, got {out_channels}")
        self.relu = nn.ReLU(inplace=False)
        self.conv1 = nn.Conv2d(in_channels, out_channels // 2, 1, stride=2, bias=False)
        # out[i, j] = in[i + 1, j + 1] (zero past the end): crop row/col 0, pad one at the end.
        self.shift = nn.ZeroPad2d((-1, 1, -1, 1))
        self.conv2 = nn.Conv2d(in_channels, out_channels // 2, 1, stride=2, bias=False)
        self.bn = nn.BatchNorm2d(out_channels)

    def forward(self, x: Tensor) -> Tensor:
        """Concatenate the even-grid and odd-grid halves along channels."""
        x = self.relu(x)
        x = torch.cat([self.conv1(x), self.conv2(self.shift(x))], dim=1)
        return self.bn(x)


# --- the operations of the genotype: (channels, stride) -> module -------------------------


def _none(channels: int, stride: int) -> nn.Module:
    """Identity; at stride 2 it must still halve the size, hence FactorizedReduce."""
    return nn.Identity() if stride == 1 else FactorizedReduce(channels, channels)


def _avg_pool_3x3(channels: int, stride: int) -> nn.Module:
    """3x3 average pool that averages only real pixels at the border (count_include_pad=False)."""
    return nn.AvgPool2d(3, stride=stride, padding=1, count_include_pad=False)


def _max_pool_3x3(channels: int, stride: int) -> nn.Module:
    """3x3 max pool; padding 1 keeps the size at stride 1 and gives ceil(n/2) at stride 2."""
    return nn.MaxPool2d(3, stride=stride, padding=1)


def _max_pool_2x2(channels: int, stride: int) -> nn.Module:
    """2x2 max pool; ceil_mode so odd sizes reduce to ceil(n/2) like the other stride-2 ops."""
    return nn.MaxPool2d(2, stride=stride, padding=0, ceil_mode=True)


def _conv_1x1(channels: int, stride: int) -> nn.Module:
    """ReLU-conv1x1-BN."""
    return _relu_conv_bn(channels, channels, 1, stride)


def _conv_3x3(channels: int, stride: int) -> nn.Module:
    """Bottlenecked 3x3 conv (1x1 down to c/4, 3x3, 1x1 back up), as in torchgpipe."""
    c, b = channels, channels // 4
    return nn.Sequential(
        *_relu_conv_bn(c, b, 1),
        *_relu_conv_bn(b, b, 3, stride, 1),
        *_relu_conv_bn(b, c, 1),
    )


def _conv_1x7_7x1(channels: int, stride: int) -> nn.Module:
    """Factorised 7x7 receptive field: 1x1 down to c/4, 1x7, 7x1, 1x1 back up."""
    c, b = channels, channels // 4
    return nn.Sequential(
        *_relu_conv_bn(c, b, 1),
        *_relu_conv_bn(b, b, (1, 7), (1, stride), (0, 3)),
        *_relu_conv_bn(b, b, (7, 1), (stride, 1), (3, 0)),
        *_relu_conv_bn(b, c, 1),
    )


OPERATIONS: dict[str, Callable[[int, int], nn.Module]] = {
    "none": _none,
    "avg_pool_3x3": _avg_pool_3x3,
    "max_pool_3x3": _max_pool_3x3,
    "max_pool_2x2": _max_pool_2x2,
    "conv_1x1": _conv_1x1,
    "conv_3x3": _conv_3x3,
    "conv_1x7_7x1": _conv_1x7_7x1,
}

# The AmoebaNet-D genotype, as (input state index, operation name).  Consecutive pairs are
# summed into a new state.  State 0 is the (preprocessed) previous cell's output, state 1 the
# one before it, states 2.. are the sums in order.  In a reduction cell every op that reads
# state 0 or 1 has stride 2.
NORMAL_OPERATIONS: tuple[tuple[int, str], ...] = (
    (1, "conv_1x1"),
    (1, "max_pool_3x3"),
    (1, "none"),
    (0, "conv_1x7_7x1"),
    (0, "conv_1x1"),
    (0, "conv_1x7_7x1"),
    (2, "max_pool_3x3"),
    (2, "none"),
    (1, "avg_pool_3x3"),
    (5, "conv_1x1"),
)
# [0, 3, 4, 6] follows the TensorFlow reference rather than the AmoebaNet paper's [4, 5, 6]:
# it is the choice that reproduces GPipe's reported parameter counts (see torchgpipe).
NORMAL_CONCAT: tuple[int, ...] = (0, 3, 4, 6)

REDUCTION_OPERATIONS: tuple[tuple[int, str], ...] = (
    (0, "max_pool_2x2"),
    (0, "max_pool_3x3"),
    (2, "none"),
    (1, "conv_3x3"),
    (2, "conv_1x7_7x1"),
    (2, "max_pool_3x3"),
    (3, "none"),
    (1, "max_pool_2x2"),
    (2, "avg_pool_3x3"),
    (3, "conv_1x1"),
)
REDUCTION_CONCAT: tuple[int, ...] = (4, 5, 6)


class Cell(nn.Module):
    """One AmoebaNet cell: combines the two previous cells' outputs through the genotype.

    Both inputs are first brought to ``channels`` channels (and, after a reduction, to the same
    resolution); the output concatenates the states listed in the concat list, so it has
    ``channels * len(concat)`` channels.  The genotype is unrolled in Python at construction
    time, so tracing sees a fixed graph of convs, pools, adds and one cat.
    """

    def __init__(
        self,
        channels_prev_prev: int,
        channels_prev: int,
        channels: int,
        reduction: bool,
        reduction_prev: bool,
    ) -> None:
        super().__init__()
        self.reduction = reduction
        self.preprocess_prev = _relu_conv_bn(channels_prev, channels)
        self.preprocess_prev_prev: nn.Module
        if reduction_prev:
            self.preprocess_prev_prev = FactorizedReduce(channels_prev_prev, channels)
        elif channels_prev_prev != channels:
            self.preprocess_prev_prev = _relu_conv_bn(channels_prev_prev, channels)
        else:
            self.preprocess_prev_prev = nn.Identity()

        genotype = REDUCTION_OPERATIONS if reduction else NORMAL_OPERATIONS
        self.indices: tuple[int, ...] = tuple(index for index, _ in genotype)
        self.op_names: tuple[str, ...] = tuple(name for _, name in genotype)
        self.concat: tuple[int, ...] = REDUCTION_CONCAT if reduction else NORMAL_CONCAT
        self.ops = nn.ModuleList(
            OPERATIONS[name](channels, 2 if reduction and index < 2 else 1)
            for index, name in genotype
        )
        self.out_channels = channels * len(self.concat)

    def extra_repr(self) -> str:
        """Show the genotype in ``print(model)``: the ops alone do not say what feeds them."""
        pairs = ", ".join(f"{i}:{n}" for i, n in zip(self.indices, self.op_names, strict=True))
        return f"reduction={self.reduction}, ops=[{pairs}], concat={list(self.concat)}"

    def forward(self, prev: Tensor, prev_prev: Tensor) -> Tensor:
        """Combine the previous cell's output ``prev`` and the one before it, ``prev_prev``."""
        states = [self.preprocess_prev(prev), self.preprocess_prev_prev(prev_prev)]
        for k in range(0, len(self.ops), 2):
            left = self.ops[k](states[self.indices[k]])
            right = self.ops[k + 1](states[self.indices[k + 1]])
            states.append(left + right)
        return torch.cat([states[i] for i in self.concat], dim=1)


def stack_sizes(num_layers: int) -> tuple[int, int, int]:
    """Split ``num_layers`` normal cells over the three stacks, earlier stacks taking the rest.

    Why: GPipe's ``L`` counts all normal cells (torchgpipe requires ``L % 3 == 0``); spreading
    the remainder keeps that meaning for multiples of 3 and still allows ``L = 1`` or ``2``.
    """
    base, extra = divmod(num_layers, 3)
    sizes = [base + (1 if i < extra else 0) for i in range(3)]
    return sizes[0], sizes[1], sizes[2]


class AmoebaNetD(nn.Module):
    """AmoebaNet-D: stem, reduction/normal cell stacks, global-pool classifier.

    Kept as a flat ``ModuleList`` of cells with a two-state loop in ``forward`` (instead of
    torchgpipe's tuple-passing ``nn.Sequential``) so the traced graph is a plain chain of
    cells with ordinary tensor edges, including the skip from each cell to the next-but-one.
    """

    def __init__(self, num_classes: int = 10, num_layers: int = 4, num_filters: int = 512) -> None:
        super().__init__()
        if num_layers < 1:
            raise ValueError(f"num_layers must be >= 1, got {num_layers}")
        if num_filters < 8:
            raise ValueError(f"num_filters must be >= 8 (the 1x7/3x3 bottlenecks need "
                             f"num_filters // 8 >= 1 channel), got {num_filters}")
        channels = num_filters // 4
        self.stem = nn.Sequential(
            nn.Conv2d(3, channels, 3, stride=2, padding=1, bias=False),
            nn.BatchNorm2d(channels),
        )

        plan: list[bool] = [True, True]  # True = reduction cell; these two finish the stem
        for i, repeat in enumerate(stack_sizes(num_layers)):
            if i > 0:
                plan.append(True)
            plan.extend([False] * repeat)

        self.cells = nn.ModuleList()
        channels_prev_prev = channels_prev = channels
        reduction_prev = False
        for reduction in plan:
            if reduction:
                channels *= 2
            cell = Cell(channels_prev_prev, channels_prev, channels, reduction, reduction_prev)
            self.cells.append(cell)
            channels_prev_prev, channels_prev = channels_prev, cell.out_channels
            reduction_prev = reduction

        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(channels_prev, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        """Images ``(N, 3, H, W)`` -> class logits ``(N, num_classes)``."""
        prev = prev_prev = self.stem(x)
        for cell in self.cells:
            prev, prev_prev = cell(prev, prev_prev), prev
        return self.fc(torch.flatten(self.pool(prev), 1))


def amoebanetd(num_classes: int = 10, num_layers: int = 4, num_filters: int = 512) -> nn.Module:
    """Build AmoebaNet-D (L=``num_layers`` normal cells, D=``num_filters``) for 3-channel images.

    Same signature and defaults as torchgpipe's / MPI4DL's ``amoebanetd`` so benchmark settings
    carry over.  ``num_filters >= 8``; any image size ``>= 1`` works (see the module docstring).
    """
    return AmoebaNetD(num_classes=num_classes, num_layers=num_layers, num_filters=num_filters)
