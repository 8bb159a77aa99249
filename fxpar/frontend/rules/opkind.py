"""The op classes of a spatial region: what the passes need to know about one op.

Pointwise ops run on tiles as they are; windowed ops need a halo; BatchNorm needs global
statistics; a reduction over H and W (a global mean) produces a replicated value.
fxpar.frontend.rules.aten_ops maps the nodes of a captured (ATen) graph to them;
fxpar.frontend.rules.opclass is the entry the passes call.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from fxpar.core.geometry import (
    Interval,
    transposed_rows,
    window_rows,
)

SPATIAL_RANKS = (3, 4, 5)
"""Ranks of the tensors a spatial region tiles: a sequence (N, C, L), an image (N, C, H, W), a
volume (N, C, D, H, W); the spatial dims are all dims after the channels."""


@dataclass(frozen=True)
class Pointwise:
    """Each output cell depends on the same cell of each input (broadcasting allowed)."""


@dataclass(frozen=True)
class Window:
    """A windowed op. ``kind``: one of :data:`WINDOW_KINDS` (conv, maxpool, avgpool, pad
    (constant), convT, interp: any interpolation, reflect / replicate padding, whose index map
    per dim is ``attr("maps")``; wrap: circular padding and torch.roll; unshuffle, shuffle:
    pixel_unshuffle and pixel_shuffle by ``k``), which says what the passes do with it.

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
        if self.kind not in WINDOW_KINDS:
            raise ValueError(f"window kind {self.kind!r} has no entry in WINDOW_KINDS")
        if not self.d:
            object.__setattr__(self, "d", (1,) * len(self.k))

    @property
    def ndim(self) -> int:
        """Spatial dims the op works over."""
        return len(self.k)

    def attr(self, name: str, default: Any = None) -> Any:
        return dict(self.attrs).get(name, default)

    @property
    def rule(self) -> WindowKind:
        """What the passes do with this kind of window (:data:`WINDOW_KINDS`)."""
        return WINDOW_KINDS[self.kind]

    def needs(self, out: Interval, dim: int) -> Interval:
        """Input interval (global; may pass the borders) for output interval ``out``."""
        return self.rule.needs(self, out, dim)

    def scale(self, dim: int) -> Fraction:
        """Input cells per output cell along ``dim`` (the stride, for a receptive field)."""
        return self.rule.scale(self, dim)


@dataclass(frozen=True)
class WindowKind:
    """What the passes need to know about one kind of windowed op: one entry of
    :data:`WINDOW_KINDS` per kind. The analysis (spatial regions, halo widths, receptive fields,
    halo fusion) reads only this; a new kind is an entry here and its tile op: an entry of
    ``TILE_OPS`` in fxpar.passes.halo (the op on the assembled window), or, with ``halo_op``,
    its kernel in ``KERNELS`` (fxpar.runtime.spatial.kernels), which ``HaloOp`` runs."""

    needs: Callable[[Window, Interval, int], Interval]
    """The input interval (global; may pass the borders) output interval ``out`` reads along
    ``dim``."""
    scale: Callable[[Window, int], Fraction]
    """Input cells per output cell along ``dim`` (receptive fields, fxpar.compiler.receptive)."""
    clamped: bool = False
    """Reads past the border repeat border cells (interpolation, reflect / replicate padding),
    so a window is clipped to the image instead of filled."""
    halo_op: bool = False
    """Runs as one ``HaloOp`` (fxpar.runtime.spatial.ops: the exchange fused with the op, which
    keeps only the tile and the halo pieces for backward); such ops can share a halo group
    (fxpar.passes.halo_fusion). Otherwise the window is assembled and ``TILE_OPS`` runs on it."""
    wraps: bool = False
    """Reads past the border wrap around to the opposite border (circular padding, torch.roll):
    input row ``r`` outside [0, extent) is row ``r mod extent``, brought by the exchange
    (fxpar.core.geometry.exchange with ``wrap``), never filled. Such an op has no finite
    receptive box (fxpar.compiler.receptive refuses it) and never joins a fused halo group."""

    def __post_init__(self) -> None:
        if self.wraps and (self.halo_op or self.clamped):
            raise ValueError("a wrapping window kind reads whole rows mod the extent: it is "
                             "neither clamped nor a HaloOp (its window is assembled, TILE_OPS)")


def _rows(w: Window, out: Interval, dim: int) -> Interval:
    return window_rows(out, w.k[dim], w.s[dim], w.p[dim], w.d[dim])


def _strided(w: Window, dim: int) -> Fraction:
    return Fraction(w.s[dim])


def _interp_scale(w: Window, dim: int) -> Fraction:
    m = w.attr("maps")[dim]  # fxpar.runtime.spatial.interp.AxisMap
    return Fraction(1) if m.mode in ("reflect", "replicate") else Fraction(m.size_in, m.size_out)


WINDOW_KINDS: dict[str, WindowKind] = {
    "conv": WindowKind(_rows, _strided, halo_op=True),
    "maxpool": WindowKind(_rows, _strided, halo_op=True),
    "avgpool": WindowKind(_rows, _strided, halo_op=True),
    "pad": WindowKind(_rows, lambda w, dim: Fraction(1)),  # constant padding, or a crop
    "convT": WindowKind(lambda w, out, dim: transposed_rows(out, w.k[dim], w.s[dim], w.p[dim],
                                                            w.d[dim]),
                        lambda w, dim: Fraction(1, w.s[dim])),
    "interp": WindowKind(lambda w, out, dim: w.attr("maps")[dim].needs(out), _interp_scale,
                         clamped=True),
    # output row o reads input row (o - p) mod extent: circular padding by (p, after), or
    # torch.roll by p (attrs "pad", resp. "roll": the shifts of the non-spatial dims)
    "wrap": WindowKind(_rows, lambda w, dim: Fraction(1), wraps=True),
    # pixel_unshuffle by r (k = s = r): output row o reads input rows [r o, r o + r)
    "unshuffle": WindowKind(_rows, _strided),
    # pixel_shuffle by r (k = s = r): output row o reads input row o // r
    "shuffle": WindowKind(lambda w, out, dim: transposed_rows(out, w.k[dim], w.s[dim], 0, 1),
                          lambda w, dim: Fraction(1, w.s[dim])),
}
"""Every kind of windowed op, by :attr:`Window.kind`."""


@dataclass(frozen=True)
class BatchNorm:
    """BatchNorm2d: global statistics over all tiles in training mode."""

    path: str


@dataclass(frozen=True)
class Reduce:
    """A reduction over the spatial dims of the whole image or volume (runtime.spatial.reduce):
    ``sum``, ``mean`` (global average pooling), ``amax``, ``norm`` (a vector norm of order
    ``ord``: a global response norm), ``bins`` (adaptive average pooling to ``out``) or
    ``maxbins`` (adaptive max pooling to ``out``); the result is replicated."""

    kind: str
    keepdim: bool = True
    out: tuple[int, ...] = (1, 1)
    ord: float = 2.0


@dataclass(frozen=True)
class Norm:
    """Group norm (instance norm: one channel per group) with per-sample statistics over all
    tiles; ``weight`` and ``bias`` are the argument positions of the affine parameters."""

    groups: int
    eps: float
    weight: int
    bias: int


Op = Pointwise | Window | BatchNorm | Reduce | Norm
