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

from fxpar.core import meta
from fxpar.core.meta import TensorInfo
from fxpar.frontend.rules.aten_ops import arg
from fxpar.frontend.rules.dims import NoRule

Axes = tuple[tuple[int, int], ...]
"""The grid axes one tensor dim holds, each with the image's extent along it (row-major)."""
Layout = tuple[Axes, ...]
"""Per tensor dim, its :data:`Axes`."""


class Multi(tuple):
    """The layouts of an op with several outputs (split, unbind, max with indices)."""


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
    (attention over split keys, from tiled / replicated queries). ``sliced``: positions of
    whole operands that vary along a split dim (each rank takes its tile's cells)."""

    KEY: ClassVar[str] = "fxpar.tokens"
    layout: Any
    action: str = ""
    reduce: tuple[Any, ...] = ()
    sliced: tuple[int, ...] = ()


@dataclass
class State:
    """The grid (parts per axis) and the layouts found so far (tiled values only)."""

    parts: tuple[int, ...]
    layouts: dict[fx.Node, Any] = field(default_factory=dict)

    def layout(self, a: Any) -> Any:
        return self.layouts.get(a) if isinstance(a, fx.Node) else None

    def split(self, axes: Axes) -> bool:
        """Whether a dim holding ``axes`` is spread over several tiles."""
        return any(self.parts[a] > 1 for a, _ in axes)


def image_layout(shape: tuple[int, ...], ndim: int) -> Layout:
    """The layout of an (N, C, H, W) (or N, C, D, H, W) tile of ``shape``."""
    return ((), ()) + tuple(((i, e),) for i, e in enumerate(shape[2:2 + ndim]))


def size_of(axes: Axes) -> int:
    """The global size of a dim holding ``axes``."""
    return math.prod(e for _, e in axes)


def shape(n: Any) -> tuple[int, ...]:
    info = meta.find(n, TensorInfo) if isinstance(n, fx.Node) else None
    if info is None or len(info.shapes) != 1:
        raise NoRule(f"{getattr(n, 'name', n)!r} has no single tensor shape")
    return tuple(info.shape)


def tiled(lay: Any) -> bool:
    """Whether a layout holds any grid axis (a tile of the image, not a whole value)."""
    if isinstance(lay, Multi):
        return any(tiled(x) for x in lay)
    return lay is not None and any(lay)


def dim_of(n: fx.Node, pos: int, default: Any, rank: int) -> int:
    return int(arg(n, pos, default)) % max(rank, 1)


Rule = Callable[[fx.Node, State], TokenLayout]

def is_image(layout: Any, out_shape: tuple[int, ...], ndim: int) -> bool:
    """Whether ``layout`` is the (N, C, H, W) layout of a tensor of ``out_shape``."""
    return len(out_shape) == ndim + 2 and layout == image_layout(out_shape, ndim)

