"""Pass: rewrite a captured loss (fxpar.frontend.loss) for one tile of the output.

The loss graph sees global shapes; on a tile, each tensor holds the tile's cells of its split
dims (fxpar.frontend.rules.dims says which). This pass makes the graph run on those:

- a reduction over the split dims becomes a :class:`TileReduceDims` (tile partial, one
  allreduce, the op finished on the sum: a mean divides by the global count), so sums, means
  and counts inside Dice, Tversky, ``ignore_index``, class weights and masks are global;
- factories, views and expands get the tile's sizes where their size arguments name the
  whole image's;
- a whole operand that varies along a split dim (an ``arange`` over H) is sliced to the tile.

Before (a soft Dice's per-class intersection, H split over two tiles)::

    sum_1 = torch.ops.aten.sum.dim_IntList(mul, [0, 2, 3])

after::

    sum_1 = self.fxpar_lossreduce_0(mul)   # sum over dims [0, 2, 3] of the whole tensor
"""

from __future__ import annotations

import math
import operator
from typing import Any

import torch
from torch import fx

from fxpar.core.fxgraph import graph_module
from fxpar.core.geometry import Grid, Rect
from fxpar.frontend.rules.dims import Propagation, broadcast, shape
from fxpar.runtime.spatial.lossops import TileReduceDims

aten = torch.ops.aten


def tile_loss(gm: fx.GraphModule, prop: Propagation, grid: Grid, extent: tuple[int, ...],
              tile: int, key: str) -> fx.GraphModule:
    """A copy of loss graph ``gm`` that runs on tile ``tile`` of ``grid`` (``extent``: the
    global size of each of the loss's grid axes: the image's, or, for an output with leaves at
    several image sizes, each size's in turn, fxpar.runtime.spatial.lossops.loss_axes), its
    reductions in tile group ``key``."""
    graph = fx.Graph()
    new_of: dict[fx.Node, fx.Node] = {}
    out = graph.graph_copy(gm.graph, new_of)
    graph.output(out)
    tm = graph_module(gm, graph, f"LossTile{tile}")
    nd = grid.ndim
    rect = Rect(*(iv for k in range(0, len(extent), nd)
                  for iv in grid.tile_rect(extent[k:k + nd], tile).dims))
    local = tuple(b - a for a, b in rect.dims)

    def local_size(axes: tuple[int, ...]) -> int:
        return math.prod(local[a] for a in axes)

    count = 0
    for old, n in list(new_of.items()):
        if old.op != "call_function":
            continue
        lay = prop.layouts.get(old)
        if old in prop.reductions:
            r = prop.reductions[old]
            name = f"fxpar_lossreduce_{count}"
            count += 1
            tm.add_submodule(name, TileReduceDims(r.kind, r.dims, r.keepdim, key, r.count,
                                                  r.ord, r.dtype))
            with graph.inserting_before(n):
                new = graph.call_module(name, (n.args[0],))
            new.meta.update(n.meta)
            n.replace_all_uses_with(new)
            graph.erase_node(n)
        elif old in prop.resized and lay is not None:
            sizes = [local_size(axes) if axes else s for axes, s in zip(lay, shape(old),
                                                                         strict=True)]
            if old.target is aten.expand.default:  # -1 keeps an input size as it is
                sizes = [-1 if s == -1 else v for s, v in zip(n.args[1], sizes, strict=True)]
            pos = 0 if getattr(old.target, "overloadpacket", None) in (
                aten.full, aten.zeros, aten.ones, aten.empty) else 1
            n.args = (*n.args[:pos], sizes, *n.args[pos + 1:])
            if old.target is aten.view.default:  # a tile (a target cut along W) may not be
                n.target = aten.reshape.default  # contiguous: reshape copies where it must
        for a in prop.sliced.get(old, ()):
            with graph.inserting_before(n):
                part = graph.call_function(operator.getitem,
                                           (new_of[a], _tile_index(a, old, lay, rect)))
            n.replace_input_with(new_of[a], part)
    graph.lint()
    tm.recompile()
    return tm


def _tile_index(a: fx.Node, user: fx.Node, lay: Any, rect: Any) -> tuple[slice, ...]:
    """The index that cuts this tile out of ``a``, a whole operand of ``user`` (layout
    ``lay``): broadcasting aligns ``a``'s dims with the output's last ones. Along a dim where
    ``a`` is an expand of one cell, the first cells do (a dim holding several axes, such as
    D*H*W flattened, has no contiguous range of its own)."""
    s = shape(a)
    off = len(lay) - len(s)
    index = []
    for i, size in enumerate(s):
        axes = lay[off + i]
        if not axes or size == 1:
            index.append(slice(None))
        elif broadcast(a, i):
            index.append(slice(0, math.prod(b - c for c, b in (rect.dims[x] for x in axes))))
        else:
            index.append(slice(*rect.dims[axes[0]]))
    return tuple(index)
