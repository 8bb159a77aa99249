"""A whole operand's cells of this tile, along a dim of tokens (fxpar.passes.tile_tokens).

A learned position embedding of a vision transformer is one whole tensor over every token of
the image, ``(1, H*W, C)``; on a tile, the tokens are the tile's pixels in its own row-major
order. :class:`TileCells` takes the embedding's entries of exactly those pixels: along a dim
holding one image axis a contiguous range, along a dim holding several (H and W flattened) the
tile's cells ``r * W + c`` for its rows r and columns c, in that order.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from fxpar.runtime.spatial.group import TileOp
from fxpar.runtime.spatial.norms import group_sum

Interval = tuple[int, int]


def cells(axes: tuple[tuple[int, int], ...], box: tuple[Interval, ...]) -> torch.Tensor:
    """The flat indices (row-major over ``axes``' extents) of the cells in ``box``."""
    index = torch.zeros((), dtype=torch.long)
    for (_, extent), (a, b) in zip(axes, box, strict=True):
        index = (index.unsqueeze(-1) * extent + torch.arange(a, b)).flatten()
    return index.reshape(-1)


class TileCells(nn.Module):
    """``x``'s cells of this tile along dim ``dim``, which holds image ``axes`` (axis, extent)
    whose intervals on this tile are ``box``."""

    def __init__(self, dim: int, axes: tuple[tuple[int, int], ...],
                 box: tuple[Interval, ...]) -> None:
        super().__init__()
        self.dim = dim
        self.axes = tuple((int(a), int(e)) for a, e in axes)
        self.box = tuple((int(a), int(b)) for a, b in box)
        self._index = cells(self.axes, self.box)

    def emit_args(self) -> dict[str, Any]:
        """The constructor's arguments (fxpar.program.emit writes ``TileCells(**these)``)."""
        return {"dim": self.dim, "axes": self.axes, "box": self.box}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if len(self.axes) == 1:
            (a, b), = self.box
            return x.narrow(self.dim, a, b - a)
        return x.index_select(self.dim, self._index.to(x.device))

    def extra_repr(self) -> str:
        where = " x ".join(f"{a}:{b}" for a, b in self.box)
        return f"dim {self.dim}: the tile's cells {where} of {[e for _, e in self.axes]}"


class GroupCells(nn.Module):
    """``x``'s cells of every tile of a group along dim ``dim`` (holding image ``axes``), tile
    after tile in rank order (``boxes``: each tile's intervals): the key columns of an attention
    bias whose keys travel round the ring (fxpar.runtime.spatial.attention), in the order of
    the ring's concatenated keys."""

    def __init__(self, dim: int, axes: tuple[tuple[int, int], ...],
                 boxes: tuple[tuple[Interval, ...], ...]) -> None:
        super().__init__()
        self.dim = dim
        self.axes = tuple((int(a), int(e)) for a, e in axes)
        self.boxes = tuple(tuple((int(a), int(b)) for a, b in box) for box in boxes)
        self._index = torch.cat([cells(self.axes, box) for box in self.boxes])

    def emit_args(self) -> dict[str, Any]:
        return {"dim": self.dim, "axes": self.axes, "boxes": self.boxes}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.index_select(self.dim, self._index.to(x.device))

    def extra_repr(self) -> str:
        return f"dim {self.dim}: every tile's cells of {[e for _, e in self.axes]} in rank order"


class TileSoftmax(TileOp):
    """``softmax(x, dim)`` along a dim split over the tile group ``key``: the maximum over all
    tiles (no gradient: a softmax does not depend on it), the exponentials' sum over all tiles
    (one allreduce each way, differentiable), the tile's share of the result."""

    def __init__(self, dim: int, key: str) -> None:
        super().__init__()
        self.dim, self.key = dim, key

    def emit_args(self) -> dict[str, Any]:
        return {"dim": self.dim, "key": self.key}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        top = torch.ops.fxpar.allreduce(x.detach().amax(self.dim, keepdim=True), self.key,
                                        "max")
        e = torch.exp(x - top)
        return e / group_sum(e.sum(self.dim, keepdim=True), self.key)

    def extra_repr(self) -> str:
        return f"softmax along dim {self.dim} over the tiles of {self.key!r}"
