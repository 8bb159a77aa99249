"""Pass: find the spatial region — the nodes that run on image tiles.

The region grows forward from the model's image inputs (N, C, H, W), volume inputs
(N, C, D, H, W) or sequence inputs (N, C, L) through ops fxpar knows how to run on tiles
(fxpar.frontend.rules.opclass). It ends before the first op that is not one of them (flatten, view,
linear, an unknown function: it is named in the node's ``SpatialLayout.reason``), before an
op whose output would leave some rank an empty tile, and before a pointwise op with an operand
that is not tiled but varies along a split dim (a learned H x 1 bias map with H split).
Reductions over H and W (global means, amax, adaptive average pooling to any size) stay in the
region and produce a *replicated* value.
Every node gets a :class:`SpatialLayout`: tiled, or replicated (the same whole value on every
rank of the group).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import fx

from fxpar.core import meta
from fxpar.core.geometry import Grid, Rect
from fxpar.core.meta import NodeCost, TensorInfo
from fxpar.core.plan import Plan, PlanError
from fxpar.frontend.capture import where
from fxpar.frontend.rules import tokens
from fxpar.frontend.rules.aten_ops import LAYOUT_OPS
from fxpar.frontend.rules.dims import NoRule
from fxpar.frontend.rules.islands import find_islands
from fxpar.frontend.rules.opclass import Pointwise, Reduce, Window, classify, why_not
from fxpar.frontend.rules.opkind import SPATIAL_RANKS
from fxpar.frontend.rules.perpixel import RULES as PER_PIXEL
from fxpar.frontend.rules.tokens import TokenLayout


@dataclass(frozen=True)
class SpatialLayout:
    """How a node's output lives on the ranks of a spatial stage."""

    KEY: ClassVar[str] = "fxpar.spatial"
    tiled: bool
    reason: str = ""
    """For a replicated node with tiled inputs: why the region ends here."""
    island: bool = False
    """A tiled value inside a per-pixel island (fxpar.frontend.rules.islands): H and W are not dims
    2 and 3 (N, H, W, C; or N, R, C, H, W), so it never crosses a stage or meets a join."""


GRID_KEY = "fxpar.grid"
"""``gm.meta`` key of the tile grid (a :class:`Grid`) the region pass chose."""


def _extent(n: fx.Node) -> tuple[int, ...] | None:
    """The spatial sizes ((L,), (H, W) or (D, H, W)) of a node's 3-D, 4-D or 5-D output; of a
    channel split's outputs when they all agree."""
    info = meta.find(n, TensorInfo)
    if info is None or not info.shapes or any(len(s) not in SPATIAL_RANKS for s in info.shapes):
        return None
    extents = {tuple(s[2:]) for s in info.shapes}
    return extents.pop() if len(extents) == 1 else None


def _size(ext: tuple[int, ...]) -> str:
    return "x".join(map(str, ext))


def spatial_dims(gm: fx.GraphModule) -> int:
    """How many spatial dims the model's image input has: 2 for (N, C, H, W), 3 for a volume
    (N, C, D, H, W), 1 for a sequence (N, C, L); 2 when no input is any of them."""
    for n in gm.graph.nodes:
        if n.op == "placeholder" and (ext := _extent(n)) is not None:
            return len(ext)
    return 2


def window_needs(grid: Grid, n: fx.Node, op: Window) -> list[Rect]:
    """Per tile of ``grid``, the window of its input ``n.args[0]`` that windowed op ``n``
    needs for the tile's part of its output (may reach past the image: padding)."""
    return [window_need(grid, n, op, u) for u in range(grid.size)]


def window_need(grid: Grid, n: fx.Node, op: Window, u: int) -> Rect:
    """Tile ``u``'s entry of :func:`window_needs`."""
    x = n.args[0]
    assert isinstance(x, fx.Node)
    out_ext = tuple(meta.get(n, TensorInfo).shape[2:])
    r = grid.tile_rect(out_ext, u)
    need = Rect(*(op.needs(iv, i) for i, iv in enumerate(r.dims)))
    if op.rule.clamped:  # border rows repeat (clamp, reflect): no fill past it
        need = need.intersect(Rect.whole(tuple(meta.get(x, TensorInfo).shape[2:]))) or need
    return need


def image_grid(gm: fx.GraphModule) -> Grid:
    """The tile grid :func:`spatial_region` chose for ``gm``."""
    return gm.meta[GRID_KEY]


def _inputs(n: fx.Node) -> list[fx.Node]:
    return [a for a in n.all_input_nodes if a.op != "get_attr"]


def spatial_region(gm: fx.GraphModule, plan: Plan) -> fx.GraphModule:
    """Annotate every node with its SpatialLayout (no-op for plans without spatial parts).

    Blocks in a token layout (fxpar.frontend.rules.tokens) are all or nothing: when an op
    cannot run on tiles with a token-layout operand, the blocks that operand came from end the
    region where they started, and the walk starts again without them."""
    if not plan.spatial:
        return gm
    grid = Grid(*plan.tile_grid(spatial_dims(gm)))
    gm.meta[GRID_KEY] = grid
    islands = find_islands(gm, grid.ndim)
    forbidden: dict[fx.Node, str] = {}  # a token block's start -> why the block cannot run
    while True:
        poisoned, why = _walk(gm, grid, islands, forbidden)
        if not poisoned:
            break
        forbidden.update(dict.fromkeys(poisoned, why))
    if not any(n.op != "placeholder" and meta.get(n, SpatialLayout).tiled
               for n in gm.graph.nodes):
        raise PlanError(_nothing_tiled(gm, plan, grid))
    gm.meta[Coverage.KEY] = coverage(gm, grid)
    return gm


def _walk(gm: fx.GraphModule, grid: Grid, islands: dict[fx.Node, str],
          forbidden: dict[fx.Node, str]) -> tuple[set[fx.Node], str]:
    """One walk over the graph in order, growing the region forward from the image inputs;
    the token blocks that must not start (their first nodes) if some op of theirs cannot run
    on tiles, and why (else nothing)."""
    tiled: set[fx.Node] = set()
    st = tokens.State(grid.parts)
    blocks: dict[fx.Node, frozenset[fx.Node]] = {}  # token-layout value -> its blocks' starts
    for n in gm.graph.nodes:
        n.meta.pop(TokenLayout.KEY, None)
        if n.op == "placeholder":
            ext = _extent(n)
            if ext is not None and grid.fits(ext):
                tiled.add(n)
                st.layouts[n] = _image(n, grid)
                meta.put(n, SpatialLayout(True))
            elif ext is not None and len(ext) == grid.ndim:
                meta.put(n, SpatialLayout(False, f"the {_size(ext)} input {n.name!r} is "
                                                 f"smaller than the {grid} tile grid"))
            else:
                meta.put(n, SpatialLayout(False))
            continue
        starts = frozenset().union(*(blocks[a] for a in n.all_input_nodes if a in blocks))
        if n.op == "output" and starts:
            return set(starts), "the model returns it in a token layout"
        if n.op in ("get_attr", "output"):
            meta.put(n, SpatialLayout(False))
            continue
        if starts:  # an op on a token-layout value: its rule, or the blocks end
            try:
                info = tokens.token_layout(gm, n, st)
            except NoRule as e:
                return set(starts), f"{_describe(gm, n)}: {e}"
            if not _token_node(n, info, grid, tiled, st):
                return set(starts), f"{_describe(gm, n)}: its output is smaller than the tiles"
            if n in tiled and meta.get(n, SpatialLayout).island:
                blocks[n] = starts
            continue
        ins = [a for a in _inputs(n) if a in tiled]
        if not ins:
            meta.put(n, SpatialLayout(False))
            continue
        role = islands.get(n)
        if role == "entry" and len(ins) < len(_inputs(n)):
            role = None  # a stack of tiles and whole tensors: the region ends there
        if role is not None and (role != "entry" or grid.fits(_extent(ins[0]) or ())):
            tiled.add(n)  # per-pixel ops in another layout: the tile as it is
            meta.put(n, SpatialLayout(True, island=role != "exit"))
            if role == "exit":
                st.layouts[n] = _image(n, grid)
            continue
        reason = _reason(gm, n, ins, tiled, grid)
        if reason is None:
            continue  # a global reduction: the region goes on past it
        refused = ""  # why a token block cannot start at n, which leaves the image layout
        if reason and n not in forbidden and n.op == "call_function":
            try:  # a block in a token layout may start here
                info = tokens.token_layout(gm, n, st)
            except NoRule as e:
                info = None
                starts = getattr(n.target, "overloadpacket", None) in LAYOUT_OPS
                refused = str(e) if starts and tokens.rule_of(gm, n) is not None else ""
            if info is not None and _token_node(n, info, grid, tiled, st):
                if n in tiled and meta.get(n, SpatialLayout).island:
                    blocks[n] = frozenset({n})
                continue
        if reason:
            if n in forbidden:
                reason += f"; the token block it starts stops at {forbidden[n]}"
            elif refused:
                reason += f"; no token block starts here: {refused}"
            meta.put(n, SpatialLayout(False, f"region ends at {n.name!r}: {reason}"))
            continue
        tiled.add(n)
        st.layouts[n] = _image(n, grid)
        meta.put(n, SpatialLayout(True))
    return set(), ""


def _reason(gm: fx.GraphModule, n: fx.Node, ins: list[fx.Node], tiled: set[fx.Node],
            grid: Grid) -> str | None:
    """Why ``n`` (reading tiles ``ins``) cannot run on tiles in the image layout ('' if it
    can; None for a reduction over the whole image, which the region goes on past)."""
    op = classify(gm, n)
    ext = _extent(n)
    if op is None:
        return f"{_describe(gm, n)} cannot run on tiles"
    if isinstance(op, Reduce):
        meta.put(n, SpatialLayout(False))
        return None
    if ext is None or len(ext) != grid.ndim:
        return f"{_describe(gm, n)} does not produce an image (or volume, or sequence) tensor"
    if not grid.fits(ext):
        return f"its {_size(ext)} output is smaller than the {grid} tile grid"
    if isinstance(op, Pointwise) and any(_extent(a) not in (ext, None) for a in ins):
        return "its tiled inputs have different image sizes"
    if isinstance(op, Pointwise):
        return _whole_operand(n, tiled, grid, ext)
    return ""


def _image(n: fx.Node, grid: Grid) -> Any:
    """The token layout of an (N, C, H, W) tile value (of each output of a channel split)."""
    shapes = meta.get(n, TensorInfo).shapes
    lays = [tokens.image_layout(tuple(s), grid.ndim) for s in shapes]
    return lays[0] if len(lays) == 1 else tokens.Multi(lays)


def _token_node(n: fx.Node, info: TokenLayout, grid: Grid, tiled: set[fx.Node],
                st: tokens.State) -> bool:
    """Record how ``n`` runs in a token layout: a replicated value, a token-layout value, or
    the image layout again (the block's end); False if its output cannot be a tile."""
    meta.put(n, info)
    lay = info.layout
    if lay is None:
        meta.put(n, SpatialLayout(False))  # replicated (a reduction): the region goes on
        return True
    shapes = meta.get(n, TensorInfo).shapes
    if not isinstance(lay, tokens.Multi) and len(shapes) == 1 and \
            tokens.is_image(lay, tuple(shapes[0]), grid.ndim):
        ext = _extent(n)
        if ext is None or not grid.fits(ext):
            return False
        tiled.add(n)
        st.layouts[n] = lay
        meta.put(n, SpatialLayout(True))
        return True
    tiled.add(n)
    st.layouts[n] = lay
    meta.put(n, SpatialLayout(True, island=True))
    return True


@dataclass(frozen=True)
class Coverage:
    """How much of the spatial stages' work is spread over the tiles (forward FLOPs, from the
    analysis): ``tiled`` of ``image``, where ``image`` counts every op the ranks of the
    spatial stages run, whatever its tensors' shapes. An op on tiles (or a reduction of
    tiles: each rank reduces its own) counts as tiled; an op every rank of the group runs on
    the same whole value (after a join, on a pooled branch, an attention block on a flattened
    map, the classifier head of a stage) does not. So a rank runs about ``(1 - share) +
    share / P`` of one process's forward FLOPs. ``ended``: why the region ends early ('' if
    it covers everything); ``replicated``: the ops run whole on every rank, by FLOPs (at most
    :data:`LISTED`)."""

    KEY: ClassVar[str] = "fxpar.coverage"
    tiled: int
    image: int
    ended: str = ""
    replicated: tuple[tuple[str, int], ...] = ()

    @property
    def share(self) -> float:
        return self.tiled / self.image if self.image else 1.0


LISTED = 10
"""How many replicated ops :class:`Coverage` names."""


def coverage(gm: fx.GraphModule, grid: Grid, stage_of: dict[fx.Node, int] | None = None,
             stages: int = 1) -> Coverage:
    """The spatial region's :class:`Coverage` (its layouts as the region pass left them), over
    the nodes of the first ``stages`` stages (``stage_of``; None: every node)."""
    tiled = image = 0
    first = ""
    whole: list[tuple[int, str]] = []
    for n in gm.graph.nodes:
        cost = meta.find(n, NodeCost)
        if cost is None or n.op in ("placeholder", "get_attr", "output") or \
                (stage_of is not None and stage_of.get(n, 0) >= stages):
            continue
        image += cost.flops
        lay = meta.find(n, SpatialLayout)
        ins_tiled = any((la := meta.find(a, SpatialLayout)) is not None and la.tiled
                        for a in _inputs(n))
        if lay is not None and (lay.tiled or (ins_tiled and not lay.reason)):
            tiled += cost.flops  # a tile op, or a reduction of tiles
            continue
        if cost.flops:
            whole.append((cost.flops, _describe(gm, n)))
        if not first and lay is not None and lay.reason:
            first = _explained(gm, n)
    whole.sort(key=lambda fw: -fw[0])
    return Coverage(tiled, image, first, tuple((w, f) for f, w in whole[:LISTED]))


def _operands(args: Any, direct: bool) -> Iterator[tuple[bool, fx.Node]]:
    """(is a positional argument of its own, node) for every node among ``args``."""
    for a in args:
        if isinstance(a, fx.Node):
            yield direct, a
        elif isinstance(a, (list, tuple)):
            yield from _operands(a, False)
        elif isinstance(a, dict):
            yield from _operands(a.values(), False)


def _whole_operand(n: fx.Node, tiled: set[fx.Node], grid: Grid, ext: tuple[int, ...]) -> str:
    """Why pointwise ``n`` cannot run on tiles because of an operand that is not tiled but
    varies along a split dim ('' if none). The tile rewrite slices a whole operand only when it
    is a positional argument with the output's rank and extent; anything else is used as it
    is, so it must broadcast along the split dims (size 1 there)."""
    # a concatenation's operands come as one list; each is sliced to the tile like an argument
    cat = getattr(n.target, "overloadpacket", n.target) in (torch.ops.aten.cat, torch.cat)
    args = n.args[0] if cat and n.args and isinstance(n.args[0], (list, tuple)) else n.args
    for direct, a in [*_operands(args, True), *_operands(n.kwargs.values(), False)]:
        info = meta.find(a, TensorInfo)
        if a in tiled or info is None or len(info.shapes) != 1:
            continue
        shape = info.shape
        if direct and len(shape) == len(ext) + 2 and tuple(shape[2:]) == ext:
            continue
        if getattr(n.target, "overloadpacket", None) in PER_PIXEL and len(shape) < len(ext) + 2:
            continue  # an index list (index_select's, x[:, idx]'s), not a broadcast operand
        trailing = (1,) * max(0, grid.ndim - len(shape)) + tuple(shape[-grid.ndim:])
        if any(size > 1 and parts > 1 for size, parts in
               zip(trailing[-grid.ndim:], grid.parts, strict=True)):
            return (f"its operand {a.name!r} of shape {tuple(shape)} is not tiled and varies "
                    f"along a split dim (only same-size or size-1 spatial operands are)")
    return ""


def _nothing_tiled(gm: fx.GraphModule, plan: Plan, grid: Grid) -> str:
    """The message when no op can run on tiles, with the fix that applies."""
    inputs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if not any(_extent(n) is not None for n in inputs):
        shapes = [meta.get(n, TensorInfo).shapes for n in inputs if meta.find(n, TensorInfo)]
        got = ", ".join("x".join(map(str, s)) + f" ({len(s)}-D)" for ss in shapes for s in ss)
        return (f"spatial_parts={plan.spatial_parts} splits the spatial dims of an image (N, C, "
                f"H, W), a volume (N, C, D, H, W) or a sequence (N, C, L), but this model's "
                f"input is "
                f"{got or 'not a tensor'}: set "
                f"spatial_parts=1 (stages, microbatches, gems and data_parallel work on any "
                f"input)")
    first = _first_end(gm)
    if first is None:  # the region goes on past every use of the image: reductions only
        mean = next((u for n in inputs for u in n.users), None)
        into = "is not used by the model" if mean is None else \
            f"goes straight into {_describe(gm, mean)}, a reduction over all of H and W"
        return (f"nothing in this model can run on {grid} tiles: the image "
                f"{into}, so there is no per-pixel work to split; set spatial_parts=1 (or put "
                f"convolutions before it)")
    head = (f"nothing in this model can run on {grid} tiles "
            f"({_explained(gm, first)})")
    ext = _extent(first)
    if first.op != "placeholder" and (ext is None or grid.fits(ext)):
        return (f"{head}: the first op on the image must run on tiles; change that op or set "
                f"spatial_parts=1")
    return head + _what_fits(gm, plan, grid, first)


def _describe(gm: fx.GraphModule, n: fx.Node) -> str:
    if n.op == "call_module":
        return f"{type(gm.get_submodule(str(n.target))).__name__} {n.target!r}"
    if isinstance(n.target, torch._ops.OpOverload):  # a captured ATen op: say where it is from
        at = where(n)
        return f"aten.{n.target.overloadpacket.__name__}" + (f" ({at})" if at else "")
    return f"{getattr(n.target, '__name__', n.target)!s} ({n.op})"


def _first_end(gm: fx.GraphModule) -> fx.Node | None:
    """The first node where the region ends (graph order), if any."""
    return next((n for n in gm.graph.nodes
                 if (lay := meta.find(n, SpatialLayout)) is not None and lay.reason), None)


def _explained(gm: fx.GraphModule, n: fx.Node) -> str:
    """``n``'s reason for ending the region and, for an op fxpar does not tile, why not and
    what would let it (for error messages; fxpar-inspect shows the short reason)."""
    reason = meta.get(n, SpatialLayout).reason
    if n.op in ("call_module", "call_function", "call_method") and classify(gm, n) is None:
        return f"{reason}: {why_not(gm, n)}"
    return reason


def region_ends(gm: fx.GraphModule) -> list[str]:
    """The reasons the region ends, one per node where it does (for messages and inspect)."""
    return [lay.reason for n in gm.graph.nodes
            if (lay := meta.find(n, SpatialLayout)) is not None and lay.reason]


def limit_region(gm: fx.GraphModule, plan: Plan) -> fx.GraphModule:
    """Pass (after split_stages): the region stops at the end of the last spatial stage; a
    spatial stage with nothing to split is an error."""
    if not plan.spatial:
        return gm
    stage_of = {n: n.meta["fxpar.stage"].stage for n in gm.graph.nodes if "fxpar.stage" in n.meta}
    used = set()
    said = False
    for n in gm.graph.nodes:
        lay = meta.find(n, SpatialLayout)
        if lay is None or not lay.tiled or n.op == "placeholder":
            continue
        if stage_of.get(n, 0) >= plan.spatial_stages:
            reason = "" if said else (f"region ends at {n.name!r}: the first node after the "
                                      f"last spatial stage ({plan.spatial_stages - 1})")
            said = True
            meta.put(n, SpatialLayout(False, reason))
        else:
            used.add(stage_of.get(n, 0))
    gm.meta[Coverage.KEY] = coverage(gm, image_grid(gm), stage_of, plan.spatial_stages)
    missing = sorted(set(range(plan.spatial_stages)) - used)
    if missing:
        first = _first_end(gm)
        raise PlanError(
            f"spatial stage(s) {missing} would have no tiled work: the spatial region ends "
            f"earlier ({_explained(gm, first) if first else 'at the end of the model'}). Use "
            f"spatial_stages={min(missing)} or cut the stages differently (Plan.balance)")
    return gm


def _what_fits(gm: fx.GraphModule, plan: Plan, grid: Grid, first: fx.Node) -> str:
    """': use an image of at least HxW, or spatial_parts <= P' for the op that failed."""
    image = next((_extent(n) for n in gm.graph.nodes if n.op == "placeholder"), None)
    ext = _extent(first)
    if image is None or ext is None or grid.fits(ext):
        return ": use a larger image or fewer spatial_parts"
    f = max(p / e for p, e in zip(grid.parts, ext, strict=True))
    at_least = _size(tuple(int(-(-i * f // 1)) for i in image))
    if plan.grid is not None:
        return f": use an image of at least {at_least}, or a smaller Plan.grid"
    most = max((p for p in range(1, min(math.prod(ext), 1024) + 1)
                if Grid(*Plan(spatial_parts=p, slice=plan.slice).tile_grid(len(ext))).fits(ext)),
               default=1)
    if len(ext) == 1:  # a sequence: one grid, whatever the slice
        return f": use a sequence of at least {at_least}, or spatial_parts <= {most}"
    return (f": use an image of at least {at_least}, or spatial_parts <= {most} "
            f"with slice={plan.slice!r}")
