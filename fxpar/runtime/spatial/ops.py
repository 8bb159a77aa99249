"""Spatial ops on tiles, with exact backward: re-tiling (halo / join), a windowed op fused with
its halo exchange, synchronised BatchNorm (in fxpar.runtime.spatial.batchnorm, re-exported
here). Each module calls fxpar's custom ops (fxpar.runtime.spatial.library) with its tile
group's name and its static arguments as a JSON string: the module holds data, the op talks
to the group over the communicator of the rank program running it
(fxpar.runtime.spatial.group).

Gradient convention: a *tiled* tensor's gradient lives with its tile, complete (a halo
exchange sends the gradients of received cells back to their owners, who add them to their
own). A *replicated* tensor (the same full value on every rank of the group) has a *partial*
gradient on each rank: the true gradient is the sum over the group. So:

- a loss computed on a replicated output is scaled by 1/P on each rank; every parameter
  gradient of a spatial stage is summed over its group (one rule for all parameters);
- the join (tiles -> replicated) sums the partial gradients backward (allreduce), then keeps
  this rank's tile; a global mean / BatchNorm statistics likewise sum their partial gradients;
- slicing a replicated tensor (the input image) scatters the window's gradient, unsummed.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from fxpar.core.geometry import Exchange, Rect
from fxpar.core.values import dumps
from fxpar.runtime.spatial import library as _library  # noqa: F401  (defines torch.ops.fxpar)
from fxpar.runtime.spatial.batchnorm import TileBatchNorm as TileBatchNorm  # re-export
from fxpar.runtime.spatial.exchange import memory_format as memory_format  # re-export
from fxpar.runtime.spatial.group import TileOp


def group_key(stage: int, copy: int = 0) -> str:
    """Name of the tile group of one spatial stage (of one model copy)."""
    return f"c{copy}s{stage}"


SIDES = {1: ("left", "right"), 2: ("top", "bottom", "left", "right"),
         3: ("front", "back", "top", "bottom", "left", "right")}
"""Names of the sides of a tile, in :meth:`Exchange.halo_widths` order."""


def widths(ex: Exchange) -> str:
    """``top=1 bottom=1 left=1 right=1`` (a volume: front and back too; a sequence: left and
    right only)."""
    w = ex.halo_widths()
    names = SIDES.get(len(w) // 2, tuple(f"s{i}" for i in range(len(w))))
    return " ".join(f"{n}={v}" for n, v in zip(names, w, strict=True))


class Halo(TileOp):
    """Re-tile a tiled (or replicated) tensor into the window ``exchange.need`` of this rank.

    Halo exchange, scatter (replicated -> tile) and the border padding are all this one op."""

    def __init__(self, exchange: Exchange, key: str, replicated: bool = False,
                 tag: int = 10) -> None:
        super().__init__()
        self.exchange = exchange
        self.key = key
        self.replicated = replicated
        self.tag = tag  # forward messages use tag, backward tag + 1 (unique per halo node)
        self.spec = dumps({"exchange": exchange, "replicated": replicated, "tag": tag})

    def emit_args(self) -> dict[str, Any]:
        """The constructor's arguments (fxpar.program.emit writes ``Halo(**these)`` as code)."""
        return {"exchange": self.exchange, "key": self.key, "replicated": self.replicated,
                "tag": self.tag}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.fxpar.halo(x, self.key, self.spec)

    def extra_repr(self) -> str:
        ex = self.exchange
        src = "replicated" if self.replicated else f"tile {ex.own}"
        return (f"{src} -> {ex.need}; halo {widths(ex)}; recv from {[u for u, _ in ex.recvs]}, "
                f"send to {[u for u, _ in ex.sends]}, "
                + ("wrapping around the image" if ex.wrap else f"fill={ex.fill}"))


class Join(TileOp):
    """Tiles -> the whole tensor on every rank of the group (end of the spatial region)."""

    def __init__(self, rects: tuple[Rect, ...], tile: int, key: str, tag: int = 10) -> None:
        super().__init__()
        self.rects, self.tile, self.key, self.tag = rects, tile, key, tag
        self.spec = dumps({"rects": tuple(rects), "tile": tile, "tag": tag})

    def emit_args(self) -> dict[str, Any]:
        return {"rects": self.rects, "tile": self.tile, "key": self.key, "tag": self.tag}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.fxpar.join(x, self.key, self.spec)

    def extra_repr(self) -> str:
        return f"tile {self.tile} {self.rects[self.tile]} -> all {len(self.rects)} tiles"


class AvgDivisor(nn.Module):
    """Divides a tile's sum-pool by its slice of the global divisor map (separable: the outer
    product of the per-dim window counts: rows and columns, or depth, rows and columns), so
    average pooling with ``count_include_pad=False`` or ``ceil_mode`` matches one device at
    every border."""

    def __init__(self, counts: tuple[list[int], ...]) -> None:
        super().__init__()
        self.counts = tuple(list(c) for c in counts)
        div = torch.ones((), dtype=torch.float64)
        for i, c in enumerate(self.counts):
            shape = [1] * len(self.counts)
            shape[i] = -1
            div = div * torch.tensor(c, dtype=torch.float64).view(shape)
        self.register_buffer("divisor", div, persistent=False)

    def emit_args(self) -> dict[str, Any]:
        return {"counts": self.counts}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x / self.divisor.to(x.dtype)


class HaloOp(TileOp):
    """A windowed op on this rank's tile, halo included: ``kind`` names its kernel
    (fxpar.runtime.spatial.kernels.KERNELS: conv, args weight and bias; maxpool; avgpool),
    which runs with padding 0 on the exchanged window."""

    def __init__(self, exchange: Exchange, key: str, kind: str, cfg: dict[str, Any],
                 replicated: bool = False, tag: int = 10, fused: bool = False) -> None:
        super().__init__()
        self.exchange, self.key, self.kind, self.cfg = exchange, key, kind, cfg
        self.replicated, self.tag = replicated, tag
        self.fused = fused  # inside a fused halo group: the window is local, no messages
        self.spec = dumps({"exchange": exchange, "kind": kind, "cfg": cfg,
                           "replicated": replicated, "tag": tag})

    def emit_args(self) -> dict[str, Any]:
        return {"exchange": self.exchange, "key": self.key, "kind": self.kind,
                "cfg": self.cfg, "replicated": self.replicated, "tag": self.tag,
                "fused": self.fused}

    def forward(self, x: torch.Tensor, *params: torch.Tensor) -> torch.Tensor:
        weight, bias = (*params, None, None)[:2]
        return torch.ops.fxpar.halo_op(x, weight, bias, self.key, self.spec)[0]

    def extra_repr(self) -> str:
        ex = self.exchange
        if self.fused:
            return (f"{self.kind} {self.cfg} on region {ex.own} -> window {ex.need} (fused: "
                    f"local, no messages)")
        src = "replicated" if self.replicated else f"tile {ex.own}"
        return (f"{self.kind} {self.cfg} on {src} -> window {ex.need}; halo {widths(ex)}; "
                f"recv from {[u for u, _ in ex.recvs]}, send to {[u for u, _ in ex.sends]}")
