"""Pass: rewrite one spatial stage for one tile — halo exchanges, tile ops, BN sync, joins.

Runs once per tile on a stage module whose nodes carry ``SpatialLayout`` (from
``spatial_region``) and ``TensorInfo`` (global shapes). Before (a 3x3 convolution)::

    conv2d = torch.ops.aten.conv2d.default(x, conv1_weight, None, [1, 1], [1, 1])

after, for tile t of a 2x2 grid: one ``HaloOp`` exchanges the halo (at the image border the
rank fills the padding itself) and runs the convolution with padding 0 on the window::

    fxpar_halo_0 = self.fxpar_halo_0(x, conv1_weight)   # rows -1:17 cols 15:33 <- tiles 1, 2, 3

BatchNorm and group norm become ``TileBatchNorm`` / ``TileGroupNorm`` (global statistics),
a reduction over H and W ``TileReduce``, an interpolation or reflect padding ``TileInterp``,
circular padding or a roll of H / W a ``Halo`` whose window wraps around the image (its
window is the tile's output), and a node outside the region that reads a tile gets a ``Join``
first. Halo modules are printed with their widths per side (``fxpar-inspect``).
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx

from fxpar.core import meta
from fxpar.core.fxgraph import graph_module, replace_node
from fxpar.core.geometry import (
    Exchange,
    Grid,
    Rect,
    avg_counts,
    exchange,
    unwrap,
    wrap_pieces,
)
from fxpar.core.meta import TensorInfo
from fxpar.frontend.rules.aten_ops import arg
from fxpar.frontend.rules.opclass import BatchNorm, Norm, Pointwise, Reduce, Window, classify
from fxpar.frontend.rules.perpixel import SIZED
from fxpar.frontend.rules.tokens import TokenLayout
from fxpar.passes.halo_fusion import FUSION_KEY, FusedRegion, GroupInfo, fusion_groups
from fxpar.passes.spatial_region import SpatialLayout, window_needs
from fxpar.passes.split_stages import model_output
from fxpar.passes.tile_tokens import tile_token_node
from fxpar.runtime.spatial.haloconv import conv_weight_of_transposed
from fxpar.runtime.spatial.interp import TileInterp
from fxpar.runtime.spatial.norms import TileGroupNorm
from fxpar.runtime.spatial.ops import (
    AvgDivisor,
    Halo,
    HaloOp,
    Join,
    TileBatchNorm,
)
from fxpar.runtime.spatial.reduce import TileReduce

aten = torch.ops.aten


@dataclass
class _Ctx:
    gm: fx.GraphModule
    grid: Grid
    tile: int
    key: str
    replicated: set[fx.Node]  # tiled-looking values that are in fact whole on every rank
    count: int = 0

    def add(self, prefix: str, module: torch.nn.Module) -> str:
        name = f"fxpar_{prefix}_{self.count}"
        if hasattr(self.gm, name):  # never replace a module the graph already calls
            raise AssertionError(f"tile module already has a submodule {name!r}")
        self.count += 1
        self.gm.add_submodule(name, module)
        return name

    def tag(self) -> int:
        return 10 + 2 * self.count


def _shape(n: fx.Node) -> tuple[int, ...]:
    return meta.get(n, TensorInfo).shape


def _extent(n: fx.Node) -> tuple[int, ...]:
    """The spatial sizes of ``n``'s output: (H, W), or (D, H, W) for a volume."""
    return tuple(_shape(n)[2:])


def _tiled(n: Any) -> bool:
    lay = meta.find(n, SpatialLayout) if isinstance(n, fx.Node) else None
    return lay is not None and lay.tiled


def _halo(ctx: _Ctx, before: fx.Node, x: fx.Node, needs: list[Rect], fill: float,
          wrap: bool = False) -> fx.Node:
    """Insert a Halo giving this tile ``needs[tile]`` of ``x`` (``wrap``: the needs wrap
    around the image, fxpar.core.geometry.wrap_pieces)."""
    ex: Exchange = exchange(ctx.grid, _extent(x), needs, ctx.tile, fill, wrap)
    tag = ctx.tag()
    whole = x in ctx.replicated or not _tiled(x)  # e.g. ASPP's pooled branch, upsampled
    name = ctx.add("halo", Halo(ex, ctx.key, replicated=whole, tag=tag))
    with ctx.gm.graph.inserting_before(before):
        node = ctx.gm.graph.call_module(name, (x,))
    n, c = _shape(x)[:2]
    meta.put(node, TensorInfo(((n, c, *ex.need.shape),), (meta.get(x, TensorInfo).dtype,)))
    return node


def _window(ctx: _Ctx, n: fx.Node, op: Window) -> None:
    x = n.args[0]
    assert isinstance(x, fx.Node)
    out_ext, in_ext = _extent(n), _extent(x)
    needs = window_needs(ctx.grid, n, op)
    own = ctx.grid.tile_rect(out_ext, ctx.tile)
    need = needs[ctx.tile]
    g = ctx.gm.graph
    fused, inside = meta.find(n, FusedRegion), meta.find(x, FusedRegion)
    if fused is not None or inside is not None:  # in a fused halo group (halo_fusion)
        out = fused.regions[ctx.tile] if fused is not None else own
        if inside is not None:  # the window is local: x holds a region wider than the tile
            need = Rect(*(op.needs(iv, i) for i, iv in enumerate(out.dims)))
            ex = Exchange(inside.regions[ctx.tile], need, in_ext, (), (), op.fill)
        else:  # the group's head: its one exchange brings the whole group's window
            ex = exchange(ctx.grid, in_ext, list(fused.needs), ctx.tile, op.fill)
        with g.inserting_before(n):
            new = _fused(ctx, n, op, x, ex, out, in_ext, out_ext, local=inside is not None)
    elif op.rule.halo_op:
        ex = exchange(ctx.grid, in_ext, needs, ctx.tile, op.fill)
        with g.inserting_before(n):
            new = _fused(ctx, n, op, x, ex, own, in_ext, out_ext)
    else:
        win = _halo(ctx, n, x, needs, op.fill, op.rule.wraps)
        with g.inserting_before(n):
            new = _tile_op(ctx, n, op, win, own, need)
    replace_node(g, n, new)


def _fused(ctx: _Ctx, n: fx.Node, op: Window, x: fx.Node, ex: Exchange, own: Rect,
           in_ext: tuple[int, ...], out_ext: tuple[int, ...], local: bool = False) -> fx.Node:
    """One HaloOp node: exchange + op, keeping only the tile and the halo pieces for
    backward (``fxpar::halo_op``, fxpar.runtime.spatial.library). ``own``: the output region
    this tile computes; ``local``: inside a fused halo group (the window is already here)."""
    g = ctx.gm.graph
    args: tuple[Any, ...] = (x,)
    if op.kind == "conv":
        groups, w, b = _weights(n)
        if op.attr("transposed"):  # a stride-1 transposed convolution, as a convolution
            w = g.call_function(conv_weight_of_transposed, (w, groups))
        cfg = {"stride": op.s, "dilation": op.d, "groups": groups}
        args = (x, w) if b is None else (x, w, b)
    elif op.kind == "maxpool":
        cfg = {"kernel": op.k, "stride": op.s, "dilation": op.d}
    else:
        override = op.attr("divisor_override")
        plain = not op.attr("ceil_mode") and op.attr("count_include_pad")
        cfg = {"kernel": op.k, "stride": op.s,
               "divisor_override": override if (override or plain) else 1}
    tag = ctx.tag()
    whole = x in ctx.replicated or not _tiled(x)
    name = ctx.add("halo", HaloOp(ex, ctx.key, op.kind, cfg, whole and not local, tag,
                                  fused=local))
    node = g.call_module(name, args)
    if op.kind == "avgpool" and cfg["divisor_override"] == 1 and not op.attr("divisor_override"):
        counts = [avg_counts(in_ext[i], out_ext[i], op.k[i], op.s[i], op.p[i],
                             bool(op.attr("count_include_pad")))[slice(*own.dims[i])]
                  for i in range(len(in_ext))]
        div = AvgDivisor(tuple(counts))
        node = g.call_module(ctx.add("avgdiv", div), (node,))
    return node



def _weights(n: fx.Node) -> tuple[int, Any, Any]:
    """(groups, weight node, bias node) of an ATen convolution node (conv2d, convolution,
    conv_transpose2d: their schemas name ``groups``)."""
    assert isinstance(n.target, torch._ops.OpOverload), n.target
    names = [a.name for a in n.target._schema.arguments]
    pos = names.index("groups")
    groups = n.args[pos] if len(n.args) > pos else n.kwargs.get("groups", 1)
    bias = n.args[2] if len(n.args) > 2 else n.kwargs.get("bias")
    return int(groups), n.args[1], bias


def _crop(g: fx.Graph, x: fx.Node, box: Rect) -> fx.Node:
    return g.call_function(operator.getitem, (x, (slice(None), slice(None),
                                                  *(slice(*iv) for iv in box.dims))))


def _tile_op(ctx: _Ctx, n: fx.Node, op: Window, win: fx.Node, own: Rect, need: Rect
             ) -> fx.Node:
    """Window op ``n`` on its assembled window ``win`` (:data:`TILE_OPS`), giving ``own``."""
    tile_op = TILE_OPS.get(op.kind)
    if tile_op is None:
        raise AssertionError(f"window kind {op.kind!r} runs in no HaloOp and has no TILE_OPS "
                             f"entry")
    return tile_op(ctx, n, op, win, own, need)


def _pad_tile(ctx: _Ctx, n: fx.Node, op: Window, win: fx.Node, own: Rect,
              need: Rect) -> fx.Node:
    return win  # the window is the padded (or cropped) tile


def _interp_tile(ctx: _Ctx, n: fx.Node, op: Window, win: fx.Node, own: Rect,
                 need: Rect) -> fx.Node:
    interp = TileInterp(op.attr("maps"), own.dims, tuple(a for a, _ in need.dims))
    return ctx.gm.graph.call_module(ctx.add("interp", interp), (win,))


CONV_TRANSPOSED = {1: F.conv_transpose1d, 2: F.conv_transpose2d, 3: F.conv_transpose3d}
"""The transposed convolution of each number of spatial dims."""


def _conv_transposed_tile(ctx: _Ctx, n: fx.Node, op: Window, win: fx.Node, own: Rect,
                          need: Rect) -> fx.Node:
    """The whole transposed convolution of the window, cropped to this tile's outputs."""
    g, s = ctx.gm.graph, op.s
    groups, w, b = _weights(n)
    conv_t = CONV_TRANSPOSED[len(s)]
    full = g.call_function(conv_t, (win, w, b, s, 0, 0, groups, op.d))
    base = tuple(a * s[i] - op.p[i] for i, (a, _) in enumerate(need.dims))
    return _crop(g, full, own.moved(base))


def _wrap_tile(ctx: _Ctx, n: fx.Node, op: Window, win: fx.Node, own: Rect,
               need: Rect) -> fx.Node:
    """Circular padding or torch.roll: the wrapped window is the tile's output; a roll's
    shifts of the batch or channel dims (attr ``roll``) are done on it."""
    other = op.attr("roll") or ()
    if not other:
        return win
    dims, shifts = zip(*other, strict=True)
    return ctx.gm.graph.call_function(aten.roll.default, (win, list(shifts), list(dims)))


def _unshuffle_tile(ctx: _Ctx, n: fx.Node, op: Window, win: fx.Node, own: Rect,
                    need: Rect) -> fx.Node:
    """pixel_unshuffle by r: the window [r o0, r o1) of each dim gives exactly the tile's
    output rows [o0, o1), wherever the input's tiles end."""
    return ctx.gm.graph.call_function(aten.pixel_unshuffle.default, (win, op.k[0]))


def _shuffle_tile(ctx: _Ctx, n: fx.Node, op: Window, win: fx.Node, own: Rect,
                  need: Rect) -> fx.Node:
    """pixel_shuffle by r of the window (input rows [a, b): output rows [r a, r b)), cropped
    to this tile's output rows, which need not start or end at a multiple of r."""
    g, r = ctx.gm.graph, op.k[0]
    full = g.call_function(aten.pixel_shuffle.default, (win, r))
    return _crop(g, full, own.moved(tuple(a * r for a, _ in need.dims)))


TILE_OPS: dict[str, Callable[[_Ctx, fx.Node, Window, fx.Node, Rect, Rect], fx.Node]] = {
    "pad": _pad_tile,
    "interp": _interp_tile,
    "convT": _conv_transposed_tile,
    "wrap": _wrap_tile,
    "unshuffle": _unshuffle_tile,
    "shuffle": _shuffle_tile,
}
"""The tile op of each window kind that runs on an assembled window (the kinds of
fxpar.frontend.rules.opkind.WINDOW_KINDS without ``halo_op``): (context, node, op, window
node, this tile's output region, the window's region) -> the node of the tile's output."""


def _as_tile(ctx: _Ctx, n: fx.Node, a: Any) -> Any:
    """The input ``a`` of pointwise node ``n``, as this tile sees it."""
    if not isinstance(a, fx.Node) or meta.find(a, TensorInfo) is None:
        return a
    if _tiled(a) and a not in ctx.replicated:
        return a
    shape = meta.get(a, TensorInfo).shapes
    ext = _extent(n)
    if len(shape) == 1 and len(shape[0]) == len(ext) + 2 and tuple(shape[0][2:]) == ext:
        return _my_tile(ctx, n, a)  # whole on every rank: slice my tile
    return a  # broadcast (e.g. a squeeze-excite scale of shape N x C x 1 x 1)


def _my_tile(ctx: _Ctx, before: fx.Node, x: fx.Node) -> fx.Node:
    """This rank's tile of ``x``, an image every rank holds whole (the model's input): a Halo
    that slices it (no messages)."""
    ext = _extent(x)
    return _halo(ctx, before, x, [ctx.grid.tile_rect(ext, u) for u in range(ctx.grid.size)], 0.0)


def _whole_inputs(ctx: _Ctx, n: fx.Node) -> None:
    """A token-layout node reading the whole input image (every rank holds it): my tile."""
    for a in n.all_input_nodes:
        info = meta.find(a, TensorInfo)
        if a in ctx.replicated and info is not None and len(info.shapes) == 1 and \
                len(info.shape) == ctx.grid.ndim + 2:
            n.replace_input_with(a, _my_tile(ctx, n, a))


def _island_entry(ctx: _Ctx, n: fx.Node) -> None:
    """A per-pixel island that starts from a whole tensor (the input image): slice my tile."""
    lay = meta.find(n, SpatialLayout)
    x = n.args[0] if n.args else None
    if lay is None or not lay.island or not isinstance(x, fx.Node) or \
            (_tiled(x) and x not in ctx.replicated) or getattr(meta.find(x, SpatialLayout),
                                                             "island", False):
        return
    n.args = (_my_tile(ctx, n, x), *n.args[1:])


def _tile_reshape(ctx: _Ctx, n: fx.Node) -> None:
    """A reshape, view or expand that keeps the spatial dims last, with this tile's sizes there
    (an expand's -1 stays -1)."""
    shape = _shape(n)
    nd = ctx.grid.ndim
    own = ctx.grid.tile_rect(tuple(shape[-nd:]), ctx.tile)
    sizes = list(n.args[1])
    sizes[-nd:] = [-1 if s == -1 else v for s, v in zip(sizes[-nd:], own.shape, strict=True)]
    n.args = (n.args[0], sizes, *n.args[2:])


def _tile_norm(ctx: _Ctx, n: fx.Node, op: Norm) -> None:
    """Group / instance norm -> TileGroupNorm (per-sample statistics over all tiles)."""
    shape = _shape(n)
    count = shape[1] // op.groups * math.prod(shape[2:])
    name = ctx.add("groupnorm", TileGroupNorm(op.groups, op.eps, ctx.key, count))
    args = [_as_tile(ctx, n, n.args[0])]
    args += [arg(n, i, None) for i in (op.weight, op.bias)]
    with ctx.gm.graph.inserting_before(n):
        new = ctx.gm.graph.call_module(name, tuple(args))
    replace_node(ctx.gm.graph, n, new)


def _tile_batch_norm(ctx: _Ctx, n: fx.Node) -> None:
    """A captured graph's BatchNormOp -> TileBatchNorm (global statistics over the tiles)."""
    bn = ctx.gm.get_submodule(str(n.target))
    shape = _shape(n)
    fused = meta.find(n, FusedRegion)  # holds a fused halo group's border: own box's stats
    box = None
    if fused is not None:
        region = fused.regions[ctx.tile]
        own = ctx.grid.tile_rect(_extent(n), ctx.tile)
        box = own.moved(tuple(a for a, _ in region.dims)).dims
    name = ctx.add("syncbn", TileBatchNorm(ctx.key, shape[0] * math.prod(shape[2:]),
                                           bn.momentum, bn.eps, bn.owner, box))
    x = _as_tile(ctx, n, n.args[0])  # the input image is whole: my tile
    with ctx.gm.graph.inserting_before(n):
        new = ctx.gm.graph.call_module(name, (x, *n.args[1:]))
    replace_node(ctx.gm.graph, n, new)


def tile_stage(stage: fx.GraphModule, grid: Grid, tile: int, key: str,
               batch_inputs: set[int], fusion: str = "off") -> fx.GraphModule:
    """A copy of ``stage`` that runs tile ``tile`` of ``grid`` (parameters shared).

    batch_inputs: positions of the stage's inputs that are the model's input (every rank holds
    the whole image, so halos read from it are local slices). fusion: ``Plan.halo_fusion``
    (fxpar.passes.halo_fusion: which windowed ops share one exchange)."""
    graph = fx.Graph()
    out = graph.graph_copy(stage.graph, {})
    graph.output(out)
    gm = graph_module(stage, graph, f"{type(stage).__name__}Tile{tile}")
    gm.meta[FUSION_KEY] = tuple(GroupInfo(tuple(n.name for n in g.ops), g.widths(grid, tile))
                                for g in fusion_groups(gm, grid, fusion))
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    ctx = _Ctx(gm, grid, tile, key, {placeholders[i] for i in batch_inputs})
    joins: dict[fx.Node, fx.Node] = {}
    for n in list(gm.graph.nodes):
        if n.op in ("placeholder", "get_attr", "output") or n.target is model_output:
            continue  # the model's output leaves as it is: tiles for a loss on tiles
        info = meta.find(n, TokenLayout)
        if info is not None:  # in a token layout (fxpar.passes.tile_tokens)
            if info.action != "unfold":  # an unfold's halo takes its window of a whole input
                _whole_inputs(ctx, n)
            tile_token_node(gm, n, info, grid, tile, key, ctx.add, ctx.tag,
                            lambda at, x, needs, wrap: _halo(ctx, at, x, needs, 0.0, wrap))
            continue
        if _tiled(n):
            _island_entry(ctx, n)
            op = classify(gm, n)
            if isinstance(op, Window):
                _window(ctx, n, op)
            elif getattr(n.target, "overloadpacket", None) in SIZED:
                if not meta.get(n, SpatialLayout).island:  # (N, C, H, W) to (N', C', H, W)
                    n.args = (_as_tile(ctx, n, n.args[0]), *n.args[1:])
                _tile_reshape(ctx, n)  # the tile's H and W
            elif isinstance(op, Pointwise):
                # nested too: the operands of a cat come as one list
                n.args = fx.node.map_arg(n.args, lambda a, n=n: _as_tile(ctx, n, a))
            elif isinstance(op, Norm):
                _tile_norm(ctx, n, op)
            elif isinstance(op, BatchNorm):  # fxpar.frontend.capture's BatchNormOp
                _tile_batch_norm(ctx, n)
            continue
        tiled_ins = [a for a in n.all_input_nodes if _tiled(a) and a not in ctx.replicated]
        if not tiled_ins:
            continue
        op = classify(gm, n)
        if isinstance(op, Reduce):
            x = n.args[0]
            own = grid.tile_rect(_extent(x), tile)
            name = ctx.add("reduce", TileReduce(op.kind, key, _extent(x), own.dims,
                                                op.keepdim, op.out, op.ord))
            with gm.graph.inserting_before(n):
                new = gm.graph.call_module(name, (x,))
            replace_node(gm.graph, n, new)
            continue
        for a in tiled_ins:  # the region ends here: the whole tensor on every rank
            if a not in joins:
                rects = tuple(grid.tile_rect(_extent(a), u) for u in range(grid.size))
                name = ctx.add("join", Join(rects, tile, key, tag=ctx.tag()))
                with gm.graph.inserting_before(n):
                    joins[a] = gm.graph.call_module(name, (a,))
            n.replace_input_with(a, joins[a])
    gm.graph.lint()
    gm.recompile()
    return gm


def input_windows(stage: fx.GraphModule, grid: Grid, batch_inputs: set[int]
                  ) -> list[Rect | None] | None:
    """What each tile of ``grid`` reads of the model input (the stage's inputs at positions
    ``batch_inputs``, whole on every rank): per tile, the bounding box of the windows the
    halos :func:`tile_stage` puts on the input take, clipped to the image, or the whole image
    where an op reads the input as it is; None for a tile that reads none of it. Worked out
    from the stage graph for all tiles at once, without rewriting it: the cases below are
    tile_stage's, in its order. None (no windows) when the input is not an image."""
    placeholders = [n for n in stage.graph.nodes if n.op == "placeholder"]
    inputs = [placeholders[i] for i in sorted(batch_inputs)]
    if not inputs:
        return [None] * grid.size
    for x in inputs:
        info = meta.find(x, TensorInfo)
        if info is None or len(info.shapes) != 1 or len(info.shapes[0]) != grid.ndim + 2:
            return None
    reads: list[list[Rect]] = [[] for _ in range(grid.size)]
    for x in inputs:
        image = Rect.whole(_extent(x))
        for n in x.users:
            for u, need in enumerate(_reads(stage, grid, n, x)):
                inside = image if need is None else need.intersect(image)
                if inside is not None:
                    reads[u].append(inside)
    return [bounding(rs) if rs else None for rs in reads]



def _reads(gm: fx.GraphModule, grid: Grid, n: fx.Node, x: fx.Node) -> list[Rect | None]:
    """Per tile, what node ``n`` of the untiled stage reads of the whole input ``x`` once
    :func:`tile_stage` has rewritten it: a window, or None for all of it."""
    whole: list[Rect | None] = [None] * grid.size
    if n.op in ("placeholder", "get_attr", "output") or n.target is model_output or \
            not _tiled(n) or _mentions(n.kwargs, x):  # outside the region: x stays whole
        return whole
    tiles = [grid.tile_rect(_extent(x), u) for u in range(grid.size)]
    windows: list[list[Rect]] = []
    args: list[Any] = list(n.args)
    lay = meta.find(n, SpatialLayout)
    if lay is not None and lay.island and args and args[0] is x and \
            not getattr(meta.find(x, SpatialLayout), "island", False):  # _island_entry
        windows.append(tiles)
        args[0] = None
    op = classify(gm, n)
    if isinstance(op, Window) and args and args[0] is x:
        needs = window_needs(grid, n, op)
        if op.rule.wraps:  # the image cells a wrapping window's pieces stand for
            ext = _extent(x)
            needs = [bounding([unwrap(p, ext) for p in wrap_pieces(r, ext)]) for r in needs]
        windows.append(needs)
        args[0] = None
    elif isinstance(op, Pointwise) and _mentions(args, x) and _sliced(n, x):
        windows.append(tiles)
        args = [fx.node.map_arg(a, lambda v: None if v is x else v) for a in args]
    elif isinstance(op, (Norm, BatchNorm)) and args and args[0] is x and _sliced(n, x):
        windows.append(tiles)
        args[0] = None
    if not windows or _mentions(args, x):  # left as it is: the op reads the whole input
        return whole
    return [bounding([w[u] for w in windows]) for u in range(grid.size)]


def _sliced(n: fx.Node, x: fx.Node) -> bool:
    """_as_tile slices the whole input ``x`` to the tile where it has ``n``'s extent (else
    ``n`` broadcasts it)."""
    return _extent(x) == _extent(n)


def _mentions(args: Any, x: fx.Node) -> bool:
    found: list[fx.Node] = []
    fx.node.map_arg(args, lambda a: found.append(a) or a)  # type: ignore[func-returns-value]
    return x in found


def bounding(rects: list[Rect]) -> Rect:
    """The smallest box holding every one of ``rects`` (not empty)."""
    return Rect(*((min(r.dims[i][0] for r in rects), max(r.dims[i][1] for r in rects))
                  for i in range(rects[0].ndim)))
