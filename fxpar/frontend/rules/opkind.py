"""The op classes of a spatial region: what the passes need to know about one op.

Pointwise ops run on tiles as they are; windowed ops need a halo; BatchNorm needs global
statistics; a reduction over H and W (a global mean) produces a replicated value.
fxpar.frontend.rules.aten_ops maps the nodes of a captured (ATen) graph to them;
fxpar.frontend.rules.opclass is the entry the passes call.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fxpar.core.geometry import (
    Interval,
    transposed_rows,
    window_rows,
)


@dataclass(frozen=True)
class Pointwise:
    """Each output cell depends on the same cell of each input (broadcasting allowed)."""


@dataclass(frozen=True)
class Window:
    """A windowed op. ``kind``: conv, maxpool, avgpool, pad (constant), convT, interp (any
    interpolation, reflect / replicate padding: its index map per dim is ``attr("maps")``).

    Per spatial dim (H, W of an image; D, H, W of a volume): kernel k, stride s, padding p (the
    leading side), dilation d.
    """

    kind: str
    k: tuple[int, ...]
    s: tuple[int, ...]
    p: tuple[int, ...]
    d: tuple[int, ...] = ()
    """Dilation; empty means 1 along every dim."""
    fill: float = 0.0
    attrs: tuple[tuple[str, Any], ...] = ()

    def __post_init__(self) -> None:
        if not self.d:
            object.__setattr__(self, "d", (1,) * len(self.k))

    @property
    def ndim(self) -> int:
        """Spatial dims the op works over."""
        return len(self.k)

    def attr(self, name: str, default: Any = None) -> Any:
        return dict(self.attrs).get(name, default)

    def needs(self, out: Interval, dim: int) -> Interval:
        """Input interval (global; may pass the borders) for output interval ``out``."""
        k, s, p, d = self.k[dim], self.s[dim], self.p[dim], self.d[dim]
        if self.kind == "interp":  # fxpar.runtime.spatial.interp.AxisMap per dim
            return self.attr("maps")[dim].needs(out)
        if self.kind == "convT":
            return transposed_rows(out, k, s, p, d)
        return window_rows(out, k, s, p, d)


@dataclass(frozen=True)
class BatchNorm:
    """BatchNorm2d: global statistics over all tiles in training mode."""

    path: str


@dataclass(frozen=True)
class Reduce:
    """A reduction over the spatial dims of the whole image or volume (runtime.spatial.reduce):
    ``sum``, ``mean`` (global average pooling), ``amax`` or ``bins`` (adaptive average pooling
    to ``out``); the result is replicated."""

    kind: str
    keepdim: bool = True
    out: tuple[int, ...] = (1, 1)


@dataclass(frozen=True)
class Norm:
    """Group norm (instance norm: one channel per group) with per-sample statistics over all
    tiles; ``weight`` and ``bias`` are the argument positions of the affine parameters."""

    groups: int
    eps: float
    weight: int
    bias: int


Op = Pointwise | Window | BatchNorm | Reduce | Norm
