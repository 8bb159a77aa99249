"""Layouts of tiled values that leave the (N, C, H, W) form (fxpar.frontend.rules.tokens).

A value's layout is, per tensor dim, the grid axes that dim holds with the image extent along
each (:data:`Axes`): ``()`` for a dim every rank holds whole, ``((0, 64),)`` for the rows of a
64-row image, ``((0, 64), (1, 48))`` for its rows and columns flattened (the tile's cells in
row-major order). An (N, C, H, W) tile has ``((), (), ((0, H),), ((1, W),))``: the *image
layout* (:func:`image_layout`), where the ordinary spatial rules take over again. ``None`` is a
replicated value (whole and the same on every rank). Extents travel with the layout because one
block may mix resolutions (SegFormer's keys come from a map reduced by a strided convolution).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

from torch import fx

from fxpar.frontend.rules.aten_ops import arg
from fxpar.frontend.rules.dims import Multi as Multi  # re-exported: a token rule's outputs
from fxpar.frontend.rules.dims import NoRule, tiled
from fxpar.frontend.rules.dims import shape as shape  # re-exported: the token rules read it

Axes = tuple[tuple[int, int], ...]
"""The factors one tensor dim holds, row-major, each ``(axis, extent)``: ``axis >= 0`` a grid
axis of the image with ``extent`` cells along it (split over the tiles when the grid has parts
there); :data:`PLAIN` a factor of ``extent`` that is not the image's (the batch merged with
Swin's windows: every tile holds all of it); :func:`inner` ``(a)`` the position inside a window
of ``extent`` cells along axis ``a`` (every tile holds whole windows: never split). A dim with
no image factor is ``()``."""

PLAIN = -1
"""The axis of a factor that is not the image's."""


def inner(axis: int) -> int:
    """The axis code of the position inside a window along image axis ``axis``."""
    return -2 - axis


def image_factor(f: tuple[int, int]) -> bool:
    """Whether factor ``f`` is cells of an image axis (split when its axis has parts)."""
    return f[0] >= 0


def normal(axes: Axes) -> Axes:
    """``axes`` with each window index followed by the position inside the window merged
    back into the axis ((a, E / w), (inner(a), w) -> (a, E)), and () when no image factor is
    left (a plain or inner factor alone is like any other dim)."""
    out: list[tuple[int, int]] = []
    for f in axes:
        if out and f[0] < PLAIN and out[-1][0] == -2 - f[0]:
            out[-1] = (out[-1][0], out[-1][1] * f[1])
        else:
            out.append((int(f[0]), int(f[1])))
    return tuple(out) if any(image_factor(f) or f[0] < PLAIN for f in out) else ()
Layout = tuple[Axes, ...]
"""Per tensor dim, its :data:`Axes`."""



class Scores(tuple):
    """The key dim of attention scores ``q @ k^T`` whose keys are split: the :data:`Axes` of
    the keys. Only scaling, the softmax over it (giving :class:`Probs`) and the product with
    the values may follow: the whole chain becomes one ring attention (the scores of a tile's
    queries against every key are never held at once)."""


class Probs(tuple):
    """The key dim of ``softmax(q @ k^T)`` whose keys are split (:class:`Scores`)."""


@dataclass(frozen=True)
class TokenLayout:
    """How a node reading tiled values in a token layout runs on a tile.

    ``layout``: its output's :data:`Layout` (a :class:`Multi` for several outputs; None: a
    replicated value). ``action``: what the tile rewrite does: ``""`` (the op as it is),
    ``"resize"`` (its size argument gets the tile's sizes), ``"reduce"`` (a reduction over
    the split dims: ``reduce`` holds (kind, dims, keepdim, count, ord)), ``"contract"`` (a
    product over a split dim: the tile's product, summed over the tiles), ``"ring"`` / ``"gather"``
    (attention over split keys, from tiled / replicated queries), ``"roll"`` (torch.roll over
    split dims: Swin's shifted windows), ``"unfold"`` (Tensor.unfold along a split dim: the
    tile's windows, with a halo), ``"pending"`` (inside an attention chain).
    ``sliced``: positions of whole operands that vary along a split dim (each rank takes its
    tile's cells)."""

    KEY: ClassVar[str] = "fxpar.tokens"
    layout: Any
    action: str = ""
    reduce: tuple[Any, ...] = ()
    sliced: tuple[int, ...] = ()
    roll: tuple[tuple[int, int], ...] = ()
    """For ``"roll"``: (dim, shift) of each split dim rolled (a wrapped exchange)."""


@dataclass
class State:
    """The grid (parts per axis) and the layouts found so far (tiled values only)."""

    parts: tuple[int, ...]
    layouts: dict[fx.Node, Any] = field(default_factory=dict)

    def layout(self, a: Any) -> Any:
        return self.layouts.get(a) if isinstance(a, fx.Node) else None

    def split(self, axes: Axes) -> bool:
        """Whether a dim holding ``axes`` is spread over several tiles."""
        return any(a >= 0 and self.parts[a] > 1 for a, _ in axes)

    def aligned(self, axis: int, extent: int, window: int) -> bool:
        """Whether every tile of ``extent`` cells along ``axis`` starts and ends on a
        multiple of ``window`` (so windows never cross a tile's edge)."""
        p = self.parts[axis]
        return extent % window == 0 and all((k * extent // p) % window == 0
                                            for k in range(p + 1))


def image_layout(shape: tuple[int, ...], ndim: int) -> Layout:
    """The layout of an (N, C, H, W) (or N, C, D, H, W) tile of ``shape``."""
    return ((), ()) + tuple(((i, e),) for i, e in enumerate(shape[2:2 + ndim]))


def size_of(axes: Axes) -> int:
    """The global size of a dim holding ``axes``."""
    return math.prod(e for _, e in axes)




def dim_of(n: fx.Node, pos: int, default: Any, rank: int) -> int:
    return int(arg(n, pos, default)) % max(rank, 1)

def first_tiled(n: fx.Node, st: State) -> Layout:
    """The layout of ``n``'s first operand, which must be tiled."""
    lay = st.layout(n.args[0])
    if not tiled(lay):
        raise NoRule("its first operand is not tiled")
    return lay


Rule = Callable[[fx.Node, State], TokenLayout]

def is_image(layout: Any, out_shape: tuple[int, ...], ndim: int) -> bool:
    """Whether ``layout`` is the (N, C, H, W) layout of a tensor of ``out_shape``."""
    return len(out_shape) == ndim + 2 and layout == image_layout(out_shape, ndim)

