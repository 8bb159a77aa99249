"""Pass helper: rewrite one node in a token layout (fxpar.frontend.rules.tokens) for one tile.

``fxpar.passes.halo.tile_stage`` calls :func:`tile_token_node` for every node the region pass
gave a :class:`TokenLayout`. What it does follows the node's ``action``:

- ``""``: nothing — the op acts on each token (or each row of a split dim) on its own;
- ``"resize"``: a view, reshape, expand or unflatten gets the tile's sizes where its sizes
  name split dims (a view becomes a reshape: a tile cut along W is not contiguous);
- ``"reduce"``: a reduction over the split dims becomes a ``TileReduceDims`` (the tile's
  partial, one allreduce, finished on the sum);
- ``"contract"``: a product over a split dim (linear attention's ``k^T v``) is the tile's
  product summed over the tiles (``fxpar::allreduce``);
- ``"unfold"``: Tensor.unfold along a split dim (HaloNet's key windows) on the tile's cells
  and the halo its windows reach into (a ``Halo`` exchange, as for a convolution);
- ``"ring"`` / ``"gather"``: attention over split keys becomes ``RingAttention`` (tiled
  queries) or ``GatherAttention`` (replicated queries), fxpar.runtime.spatial.attention.

Whole operands that vary along a split dim (a learned position embedding over all tokens) are
cut to the tile's cells first (``TileCells``). Before (a ViT block's attention on a 2x1 grid)::

    attn = torch.ops.aten.scaled_dot_product_attention.default(q, k, v)

after, on tile 0::

    attn = self.fxpar_ring_3(q, k, v)   # ring attention over 2 tiles, key lengths [32, 32]
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import fx, nn

from fxpar.core import meta
from fxpar.core.fxgraph import replace_node
from fxpar.core.geometry import Grid, Interval, Rect, tile
from fxpar.core.meta import TensorInfo
from fxpar.frontend.rules.aten_ops import arg
from fxpar.frontend.rules.token_ops import roll_args
from fxpar.frontend.rules.tokens import Axes, Multi, TokenLayout
from fxpar.runtime.spatial.attention import GatherAttention, RingAttention
from fxpar.runtime.spatial.lossops import TileReduceDims
from fxpar.runtime.spatial.norms import TileGroupNorm
from fxpar.runtime.spatial.tokens import GroupCells, TileCells, TileSoftmax

aten = torch.ops.aten
AddModule = Callable[[str, nn.Module], str]
"""``(prefix, module) -> name``: adds a submodule to the tile's stage."""
Halo = Callable[[fx.Node, fx.Node, list[Rect], bool], fx.Node]
"""``(before, x, needs, wrap) -> window``: inserts an exchange giving this tile ``needs[t]``
of the (N, C, H, W) value ``x``, wrapping around the image if ``wrap`` (fxpar.passes.halo)."""


def intervals(axes: Axes, grid: Grid, t: int) -> tuple[Interval, ...]:
    """Tile ``t``'s interval of each factor a dim holds (an image axis: its tile at that
    extent; a plain factor or the inside of a window: all of it)."""
    at = grid.position(t)
    return tuple(tile(e, grid.parts[a], at[a]) if a >= 0 else (0, e) for a, e in axes)


def local_size(axes: Axes, grid: Grid, t: int) -> int:
    """How many cells of a dim holding ``axes`` tile ``t`` holds."""
    return math.prod(b - a for a, b in intervals(axes, grid, t))


def _sizes(layout: tuple[Axes, ...], shape: tuple[int, ...], grid: Grid, t: int) -> list[int]:
    return [local_size(axes, grid, t) if axes else s
            for axes, s in zip(layout, shape, strict=True)]


def tile_token_node(gm: fx.GraphModule, n: fx.Node, info: TokenLayout, grid: Grid, t: int,
                    key: str, add: AddModule, tag: Callable[[], int], halo: Halo) -> None:
    """Rewrite ``n`` (in stage ``gm``) for tile ``t`` of ``grid``, talking in tile group
    ``key`` (``tag()``: the message tag of the next op that sends; ``halo``: a wrapped
    exchange of an (N, C, H, W) value, fxpar.passes.halo)."""
    g = gm.graph
    for pos in info.sliced:
        a = n.args[pos]
        assert isinstance(a, fx.Node)
        with g.inserting_before(n):
            cut = _cut(g, a, meta.get(n, TensorInfo).shape, info.layout, grid, t, add)
        n.args = (*n.args[:pos], cut, *n.args[pos + 1:])
    if info.action == "resize":
        _resize(n, info.layout, grid, t)
    elif info.action == "reduce":
        kind, dims, keep, count, order = info.reduce
        name = add("tokenreduce", TileReduceDims(kind, dims, keep, key, count, order))
        with g.inserting_before(n):
            new = g.call_module(name, (n.args[0],))
        replace_node(g, n, new)
    elif info.action == "contract":
        with g.inserting_after(n):
            total = g.call_function(torch.ops.fxpar.allreduce.default, (n, key, "sum"))
        n.replace_all_uses_with(total, delete_user_cb=lambda u: u is not total)
        total.meta.update(n.meta)
    elif info.action == "softmax":
        name = add("softmax", TileSoftmax(info.reduce[0], key))
        with g.inserting_before(n):
            new = g.call_module(name, (n.args[0],))
        replace_node(g, n, new)
    elif info.action == "groupnorm":
        x = meta.get(n.args[0], TensorInfo).shape
        groups = int(arg(n, 1, 1))
        norm = TileGroupNorm(groups, float(arg(n, 4, 1e-5)), key,
                             x[1] // groups * math.prod(x[2:]))
        name = add("groupnorm", norm)
        with g.inserting_before(n):
            new = g.call_module(name, (n.args[0], arg(n, 2, None), arg(n, 3, None)))
        replace_node(g, n, new)
    elif info.action == "roll":
        _roll(gm, n, info, grid, t, halo)
    elif info.action == "unfold":
        _unfold(gm, n, info, grid, t, halo)
    elif info.action == "pending":
        pass  # part of an attention chain: gone once its end is rewritten
    elif info.action in ("ring", "gather"):
        _attention(gm, n, info, grid, t, key, add, tag)
    elif info.action:
        raise AssertionError(f"token action {info.action!r} has no rewrite")



def _resize(n: fx.Node, layout: Any, grid: Grid, t: int) -> None:
    """The tile's sizes in ``n``'s size argument."""
    assert not isinstance(layout, Multi)
    out = tuple(meta.get(n, TensorInfo).shape)
    sizes = _sizes(layout, out, grid, t)
    packet = n.target.overloadpacket
    if packet is aten.unflatten:
        d = int(n.args[1]) % len(meta.get(n.args[0], TensorInfo).shape)
        n.args = (n.args[0], n.args[1], sizes[d:d + len(n.args[2])], *n.args[3:])
        return
    if packet is aten.expand:  # -1 keeps an input size
        sizes = [-1 if s == -1 else v for s, v in zip(n.args[1], sizes, strict=True)]
    n.args = (n.args[0], sizes, *n.args[2:])
    if packet is aten.view:  # a tile cut along W is not contiguous
        n.target = aten.reshape.default


def _cut(g: fx.Graph, a: fx.Node, out: tuple[int, ...], layout: Any, grid: Grid, t: int,
         add: AddModule) -> fx.Node:
    """The tile's cells of whole operand ``a`` of a node with output ``out`` / ``layout``
    (broadcasting aligns ``a``'s dims with the output's last ones)."""
    s = meta.get(a, TensorInfo).shape
    off = len(out) - len(s)
    node = a
    for i, size in enumerate(s):
        axes = layout[off + i]
        if axes and size != 1 and any(x >= 0 and grid.parts[x] > 1 for x, _ in axes):
            box = intervals(axes, grid, t)
            node = g.call_module(add("cells", TileCells(i, axes, box)), (node,))
    return node


def _attention(gm: fx.GraphModule, n: fx.Node, info: TokenLayout, grid: Grid, t: int,
               key: str, add: AddModule, tag: Callable[[], int]) -> None:
    """scaled_dot_product_attention over split keys -> ring / gathered attention."""
    dead: list[fx.Node] = []
    mask = None
    if n.target.overloadpacket is aten.scaled_dot_product_attention:
        q, k, v = n.args[:3]
        mask = arg(n, 3, None)
        assert isinstance(q, fx.Node) and isinstance(k, fx.Node)
        e = meta.get(q, TensorInfo).shape[-1]
        scale = arg(n, 6, None)
        scale = float(scale) if scale is not None else 1.0 / math.sqrt(e)
    else:  # softmax(q @ k^T * scale) @ v, written out
        q, k, v, scale, dead = attention_chain(gm, n)
    if info.action == "ring":
        lengths = [local_size(key_axes(k), grid, u) for u in range(grid.size)]
        module: nn.Module = RingAttention(key, lengths, scale, tag())
    else:
        module = GatherAttention(key, scale)
    name = add(info.action, module)
    with gm.graph.inserting_before(n):
        bias = _bias(gm.graph, mask, q, k, grid, t, add) if isinstance(mask, fx.Node) else None
        new = gm.graph.call_module(name, (q, k, v) if bias is None else (q, k, v, bias))
    replace_node(gm.graph, n, new)
    for d in dead:  # the scores, scaling and softmax of one tile: no longer used
        if not d.users:
            gm.graph.erase_node(d)


def _bias(g: fx.Graph, mask: fx.Node, q: fx.Node, k: fx.Node, grid: Grid, t: int,
          add: AddModule) -> fx.Node:
    """Ring attention's bias from a whole attention mask (..., Lq, Lk): its rows this tile's
    queries, its columns every tile's keys in rank order (the ring's)."""
    s = meta.get(mask, TensorInfo).shape
    node = mask
    if s[-2] != 1:
        qa = key_axes(q)
        node = g.call_module(add("cells", TileCells(len(s) - 2, qa, intervals(qa, grid, t))),
                             (node,))
    if s[-1] != 1:
        ka = key_axes(k)
        boxes = tuple(intervals(ka, grid, u) for u in range(grid.size))
        node = g.call_module(add("cells", GroupCells(len(s) - 1, ka, boxes)), (node,))
    return node


def attention_chain(gm: fx.GraphModule, n: fx.Node) -> tuple[fx.Node, fx.Node, fx.Node, float,
                                                     list[fx.Node]]:
    """(q, k, v, scale, the chain's nodes from the end back) of an attention written out:
    ``n`` is ``probs @ v`` (matmul or einsum); back from ``probs`` through dropout, softmax
    and scalings (fxpar.frontend.rules.tokens: their ``pending`` records) to ``q @ k^T``."""
    einsum = n.target.overloadpacket is aten.einsum
    probs, v = n.args[1] if einsum else n.args[:2]
    scale, node, dead = 1.0, probs, []
    while True:
        assert isinstance(node, fx.Node)
        dead.append(node)
        packet = getattr(node.target, "overloadpacket", None)
        if packet in (aten.matmul, aten.bmm, aten.einsum):
            break
        if packet is aten.mul:
            scale *= float(node.args[1])
        elif packet is aten.div:
            scale /= float(node.args[1])
        node = node.args[0]
    if packet is aten.einsum:
        q, k = node.args[1]
    else:
        q, kt = node.args[:2]
        assert isinstance(kt, fx.Node)
        dead.append(kt)
        k = kt.args[0]
    assert isinstance(q, fx.Node) and isinstance(k, fx.Node) and isinstance(v, fx.Node)
    return q, k, v, scale, dead


def key_axes(k: fx.Node) -> Axes:
    """The axes of the key tokens' dim (second to last) of ``k``."""
    lay = meta.get(k, TokenLayout).layout if meta.find(k, TokenLayout) is not None else None
    if lay is None or isinstance(lay, Multi):
        raise AssertionError(f"keys {k.name!r} of ring attention have no token layout")
    return lay[-2]


def _roll(gm: fx.GraphModule, n: fx.Node, info: TokenLayout, grid: Grid, t: int,
          halo: Halo) -> None:
    """torch.roll over split dims of an image held in another dim order ((N, H, W, C)):
    permuted to (N, C, H, W), a wrapped exchange brings each tile the rows its shifted
    output reads (output row o reads row o - shift), permuted back; shifts of dims that are
    not split are done on the tile."""
    g = gm.graph
    x = n.args[0]
    assert isinstance(x, fx.Node)
    lay = meta.get(x, TokenLayout).layout if meta.find(x, TokenLayout) else None
    assert lay is not None, f"roll {n.name!r} reads no token-layout value"
    image = sorted((axes[0][0], i) for i, axes in enumerate(lay) if axes)
    order = [i for i, axes in enumerate(lay) if not axes] + [i for _, i in image]
    back = [order.index(i) for i in range(len(order))]
    whole = tuple(meta.get(x, TensorInfo).shape)
    extent = tuple(whole[i] for _, i in image)
    shift = {lay[d][0][0]: s for d, s in info.roll}
    needs = []
    for u in range(grid.size):
        own = grid.tile_rect(extent, u)
        needs.append(Rect(*((a - shift.get(k, 0), b - shift.get(k, 0))
                            for k, (a, b) in enumerate(own.dims))))
    with g.inserting_before(n):
        moved = g.call_function(aten.permute.default, (x, order))
    moved.meta.update(x.meta)
    moved.meta.pop(TokenLayout.KEY, None)
    meta.put(moved, TensorInfo((tuple(whole[i] for i in order),),
                               (meta.get(x, TensorInfo).dtype,)))
    win = halo(n, moved, needs, True)
    rest = [(d, s) for d, s in zip(*_shifts(n), strict=True) if d not in dict(info.roll)]
    with g.inserting_before(n):
        new = g.call_function(aten.permute.default, (win, back))
        if rest:
            new = g.call_function(aten.roll.default, (new, [s for _, s in rest],
                                                      [d for d, _ in rest]))
    replace_node(g, n, new)


def _shifts(n: fx.Node) -> tuple[list[int], list[int]]:
    """(dims, shifts) of roll ``n``, dims counted from 0."""
    shifts, dims = roll_args(n)
    rank = len(meta.get(n, TensorInfo).shape)
    return [int(d) % rank for d in dims], [int(s) for s in shifts]


def _unfold(gm: fx.GraphModule, n: fx.Node, info: TokenLayout, grid: Grid, t: int,
            halo: Halo) -> None:
    """Tensor.unfold(dim, size, step) along a split dim: the tile's windows j0:j1 read cells
    ``[j0 * step, (j1 - 1) * step + size)`` of the dim. The input (the image in some dim order,
    fxpar.frontend.rules.token_ops.unfold) is moved to (1, rest, *image dims) for the exchange
    that brings them, moved back, and unfolded as it is."""
    g = gm.graph
    x = n.args[0]
    assert isinstance(x, fx.Node)
    whole = tuple(meta.get(x, TensorInfo).shape)
    d = int(n.args[1]) % len(whole)
    size, step = int(n.args[2]), int(n.args[3])
    lay = list(info.layout[:-1])
    axis = lay[d][0][0]
    lay[d] = ((axis, whole[d]),)
    image = [i for _, i in sorted((axes[0][0], i) for i, axes in enumerate(lay)
                                  if axes and axes[0][0] >= 0)]
    rest = [i for i in range(len(lay)) if i not in image]
    order, extent = rest + image, tuple(whole[i] for i in image)
    windows = meta.get(n, TensorInfo).shape[d]
    needs = []
    for u in range(grid.size):
        j0, j1 = tile(windows, grid.parts[axis], grid.position(u)[axis])
        own = grid.tile_rect(extent, u).dims
        needs.append(Rect(*((j0 * step, (j1 - 1) * step + size) if k == axis else iv
                            for k, iv in enumerate(own))))
    lead = [whole[i] for i in rest]
    moved, flat = x, len(rest) != 2
    with g.inserting_before(n):
        if order != list(range(len(order))):
            moved = g.call_function(aten.permute.default, (moved, order))
        if flat:
            mine = grid.tile_rect(extent, t).shape
            moved = g.call_function(aten.reshape.default, (moved, [1, math.prod(lead), *mine]))
    if moved is not x:
        moved.meta.update(x.meta)
        moved.meta.pop(TokenLayout.KEY, None)
        outer = (1, math.prod(lead)) if flat else tuple(lead)
        meta.put(moved, TensorInfo(((*outer, *extent),), (meta.get(x, TensorInfo).dtype,)))
    win = halo(n, moved, needs, False)
    with g.inserting_before(n):
        if flat:
            win = g.call_function(aten.reshape.default, (win, [*lead, *needs[t].shape]))
        if order != list(range(len(order))):
            win = g.call_function(aten.permute.default,
                                  (win, [order.index(i) for i in range(len(order))]))
    n.args = (win, *n.args[1:])
