"""Layouts through a captured loss: which dims of each tensor are split over the tile grid.

The model's spatial region keeps images as (N, C, H, W); a loss reshapes them freely: targets
of shape (N, H, W), one-hot classes moved last and back, H and W flattened into one dim, sums
over (0, 2, 3). So a loss tensor's layout is, per tensor dim, the tuple of grid axes that dim
holds: ``()`` for a dim every rank holds whole, ``(0,)`` for the rows of a horizontal split,
``(0, 1)`` for H and W flattened together (each rank holds its tile's cells of the flattened
dim, in its own row-major order: fine for the per-cell ops and reductions that follow, which
never read the order). ``None`` is a *replicated* value: whole, and the same, on every rank.

One rule per op (:data:`RULES`) maps the input layouts to the output layout, or says why the
op cannot run on tiles (:class:`NoRule`). The reductions of a loss (sum, mean, amax, any,
vector norms) over every split dim give replicated values (fxpar.runtime.spatial.lossops);
pointwise ops, softmax over classes, gather / scatter over classes, one-hot, permutes and
views that keep the split dims whole stay on tiles. An op whose inputs are all replicated is
run as it is on every rank (GeneralizedDice's weights, the final ratio of sums).
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx

from fxpar.core import meta
from fxpar.core.meta import TensorInfo
from fxpar.frontend.rules.aten_ops import arg
from fxpar.frontend.rules.pointwise import POINTWISE

aten = torch.ops.aten

Layout = tuple[tuple[int, ...], ...]
"""Per tensor dim, the grid axes it holds (row-major when several)."""


class NoRule(Exception):
    """The op cannot run on tiles; the message says why."""


@dataclass(frozen=True)
class Reduction:
    """How a reduction node runs on tiles: ``kind`` over ``dims`` (all split dims among
    them), ``count`` cells of the whole tensor per result."""

    kind: str
    dims: tuple[int, ...]
    keepdim: bool
    count: int
    ord: float = 2.0
    dtype: torch.dtype | None = None


@dataclass
class Propagation:
    """The layout of every node (None: replicated), what the rewrite must do at each node,
    and the extent of each grid axis (global, and the cells of every tile)."""

    layouts: dict[fx.Node, Any]
    reductions: dict[fx.Node, Reduction]
    sliced: dict[fx.Node, set[fx.Node]]
    """Pointwise node -> its replicated operands that vary along a split dim (each rank
    slices its tile from the whole value)."""
    resized: set[fx.Node]
    """Factories, views and expands whose size argument names global sizes of split dims."""


Rule = Callable[[fx.Node, list[Any], "_State"], Any]


@dataclass
class _State:
    extent: tuple[int, ...]
    """Global size along each grid axis."""
    axes: tuple[int, ...]
    """The axes that are split (more than one part)."""
    prop: Propagation

    def layout(self, a: Any) -> Any:
        return self.prop.layouts.get(a) if isinstance(a, fx.Node) else None

    def split(self, axes: tuple[int, ...]) -> bool:
        """Whether a dim holding ``axes`` is split over the tiles (some axis has parts)."""
        return any(a in self.axes for a in axes)

    def split_dims(self, lay: Layout) -> set[int]:
        return {i for i, axes in enumerate(lay) if self.split(axes)}

    def size(self, axes: tuple[int, ...]) -> int:
        """The global size of a dim holding ``axes``."""
        return math.prod(self.extent[a] for a in axes)


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


def _dims(d: Any, ndim: int) -> list[int]:
    ds = [d] if isinstance(d, int) else list(d or [])
    return sorted({int(x) % max(ndim, 1) for x in ds})


class Multi(tuple):
    """The layouts of an op with several outputs (max.dim: values, indices)."""


# -- rules --------------------------------------------------------------------------------------
def pointwise(n: fx.Node, ins: list[Any], st: _State) -> Any:
    """Broadcasting elementwise op: split dims align from the right; a replicated operand that
    varies along a split dim is sliced to the tile by each rank."""
    out = shape(n)
    lay: list[tuple[int, ...]] = [()] * len(out)
    sliced = set()
    for a in _tensor_args(n):
        la = st.layout(a)
        if not tiled(la):
            continue
        off = len(out) - len(la)
        for i, axes in enumerate(la):
            if axes and lay[off + i] and lay[off + i] != axes:
                raise NoRule("its operands are split along different dims")
            if axes:
                lay[off + i] = axes
    for a in _tensor_args(n):
        la = st.layout(a)
        s = shape(a)
        off = len(out) - len(s)
        for i, size in enumerate(s):
            axes = lay[off + i]
            if not axes:
                continue
            if tiled(la):
                if la[i] != axes:
                    raise NoRule(f"operand {a.name!r} is whole along dim {off + i}, which "
                                 f"another operand splits")
            elif size != 1:
                if size != st.size(axes) or len(axes) != 1 and not broadcast(a, i):
                    raise NoRule(f"operand {a.name!r} of shape {s} is not split but varies "
                                 f"along a split dim")
                sliced.add(a)
    if sliced:
        st.prop.sliced[n] = sliced
    return tuple(lay)


def broadcast(a: fx.Node, dim: int) -> bool:
    """Whether ``a`` is the same along ``dim`` (an expand of a size-1 dim: class weights spread
    over the image), so any ``k`` of its cells there are its tile's."""
    if getattr(a.target, "overloadpacket", None) is not aten.expand:
        return False
    src, out = shape(a.args[0]), shape(a)
    off = len(out) - len(src)
    return dim < off or src[dim - off] == 1


def _tensor_args(n: fx.Node) -> list[fx.Node]:
    return [a for a in n.all_input_nodes if meta.find(a, TensorInfo) is not None]


def along(dim_arg: int) -> Rule:
    """An op along one dim (softmax, cumsum...): per cell of the other dims, so the dim must
    not be split; the layout passes through."""

    def rule(n: fx.Node, ins: list[Any], st: _State) -> Any:
        lay = ins[0]
        d = int(arg(n, dim_arg, 0)) % max(len(lay), 1)
        if st.split(lay[d]):
            raise NoRule(f"it works along dim {d}, which is split over the tiles")
        return lay
    return rule


def _named(n: fx.Node, name: str, default: Any) -> Any:
    """Argument ``name`` of ATen node ``n`` by its schema (positional or keyword)."""
    target = n.target
    if not isinstance(target, torch._ops.OpOverload):
        return default
    names = [a.name for a in target._schema.arguments]
    return arg(n, names.index(name), default) if name in names else default


def reduction(kind: str) -> Rule:
    """A reduction: over no split dim it stays on tiles; over every split dim it becomes a
    replicated value (fxpar.runtime.spatial.lossops); over some of them it has no rule."""

    def rule(n: fx.Node, ins: list[Any], st: _State) -> Any:
        lay, s = ins[0], shape(n.args[0])
        dims = _named(n, "dim", None)
        dims = list(range(len(s))) if dims is None or dims == [] else _dims(dims, len(s))
        keep = bool(_named(n, "keepdim", False))
        split = st.split_dims(lay)
        if not split & set(dims):
            return tuple(() if i in dims else axes for i, axes in enumerate(lay)) if keep \
                else tuple(axes for i, axes in enumerate(lay) if i not in dims)
        if not split <= set(dims):
            raise NoRule(f"it reduces dims {dims} of a tensor split along dims "
                         f"{sorted(split)}: only over all split dims or none")
        ord_ = float(_named(n, "ord", 2.0)) if kind == "norm" else 2.0
        st.prop.reductions[n] = Reduction(kind, tuple(dims), keep,
                                          math.prod(s[d] for d in dims), ord_,
                                          _named(n, "dtype", None))
        return None
    return rule


def extreme_dim(n: fx.Node, ins: list[Any], st: _State) -> Any:
    """max.dim / min.dim (values, indices) over a dim that is not split."""
    lay = ins[0]
    d = int(arg(n, 1, 0)) % len(lay)
    if st.split(lay[d]):
        raise NoRule(f"max / min with indices along dim {d}, which is split over the tiles")
    keep = bool(arg(n, 2, False))
    out = tuple(() if i == d else a for i, a in enumerate(lay)) if keep else \
        tuple(a for i, a in enumerate(lay) if i != d)
    return Multi((out, out))


def gather(n: fx.Node, ins: list[Any], st: _State) -> Any:
    """gather(self, dim, index): per cell of the index, along a dim that is not split."""
    base, lay, idx = n.args[0], st.layout(n.args[0]), st.layout(n.args[2])
    d = int(n.args[1]) % len(shape(base))
    if not tiled(idx) or idx[d] or tiled(lay) and lay != idx:
        raise NoRule(f"gather along dim {d} needs its input and index split alike, and not "
                     f"along dim {d}")
    if not tiled(lay):  # a whole table (class weights expanded to the image): my tile of it
        s = shape(base)
        if any(st.split(axes) and (s[i] != st.size(axes) or len(axes) != 1 and
                                   not broadcast(base, i)) for i, axes in enumerate(idx)):
            raise NoRule("gather from a whole tensor that is not the image's size")
        st.prop.sliced.setdefault(n, set()).add(base)
    return idx


def scatter(n: fx.Node, ins: list[Any], st: _State) -> Any:
    """scatter(self, dim, index, src | value) along a dim that is not split (one-hot)."""
    d = int(n.args[1]) % len(shape(n.args[0]))
    lays = [st.layout(a) for a in n.all_input_nodes]
    ref = next((la for la in lays if tiled(la)), None)
    if ref is None or ref[d]:
        raise NoRule(f"scatter along dim {d}, which holds the image's dims")
    base = n.args[0]
    if not tiled(st.layout(base)):  # a fresh zeros / full: made at the tile's size
        if not _factory(base) or len(base.users) != 1:
            raise NoRule("scatter into a whole tensor")
        st.prop.layouts[base] = ref
        st.prop.resized.add(base)
    for a in n.all_input_nodes:
        la = st.layout(a)
        sa = shape(a)
        if tiled(la) and la != ref or not tiled(la) and any(
                sa[i] != 1 for i, axes in enumerate(ref) if st.split(axes) and i < len(sa)):
            raise NoRule(f"operand {a.name!r} of the scatter is split differently")
    return ref


def _factory(n: Any) -> bool:
    return isinstance(n, fx.Node) and getattr(n.target, "overloadpacket", None) in FACTORIES


FACTORIES = {aten.full, aten.zeros, aten.ones, aten.empty}


def permute(n: fx.Node, ins: list[Any], st: _State) -> Any:
    lay = ins[0]
    return tuple(lay[int(d) % len(lay)] for d in n.args[1])


def unsqueeze(n: fx.Node, ins: list[Any], st: _State) -> Any:
    lay = list(ins[0])
    d = int(n.args[1])
    lay.insert(d % (len(lay) + 1), ())
    return tuple(lay)


def squeeze(n: fx.Node, ins: list[Any], st: _State) -> Any:
    lay, s = ins[0], shape(n.args[0])
    dims = _dims(arg(n, 1, None), len(s)) if len(n.args) > 1 else \
        [i for i, v in enumerate(s) if v == 1]
    dims = [d for d in dims if s[d] == 1]
    return tuple(a for i, a in enumerate(lay) if i not in dims)


def select(n: fx.Node, ins: list[Any], st: _State) -> Any:
    lay = ins[0]
    d = int(n.args[1]) % len(lay)
    if st.split(lay[d]):
        raise NoRule(f"it indexes dim {d}, which is split over the tiles")
    return tuple(a for i, a in enumerate(lay) if i != d)


def slice_(n: fx.Node, ins: list[Any], st: _State) -> Any:
    lay = ins[0]
    d = int(arg(n, 1, 0)) % len(lay)
    if st.split(lay[d]):
        raise NoRule(f"it slices dim {d}, which is split over the tiles")
    return tuple(() if i == d else a for i, a in enumerate(lay))


def cat(n: fx.Node, ins: list[Any], st: _State) -> Any:
    parts = list(n.args[0])
    lays = [st.layout(a) for a in parts]
    ref = next(la for la in lays if tiled(la))
    d = int(arg(n, 1, 0)) % len(ref)
    if st.split(ref[d]) or any(la != ref for la in lays):
        raise NoRule("it concatenates tensors split differently, or along a split dim")
    return ref


def view(n: fx.Node, ins: list[Any], st: _State) -> Any:
    """view / reshape, group by group of dims whose sizes multiply alike: a group without
    image dims passes; image dims (with size-1 dims) merged into one dim keep all their axes
    (H, W -> H*W); one dim holding several axes cut back into their sizes gets them back; an
    image dim merged with another dim, or cut otherwise, has no rule."""
    lay, src, dst = ins[0], shape(n.args[0]), shape(n)
    out: list[tuple[int, ...]] = []
    for gi, gj in _groups(src, dst):
        axes = tuple(a for k in gi for a in lay[k])
        big = [k for k in gj if dst[k] != 1]
        if not axes:
            out += [()] * len(gj)
            continue
        if any(src[k] != 1 and not lay[k] for k in gi):
            raise NoRule(f"it merges the image dims with dims {[k for k in gi if not lay[k]]}")
        if len(big) == 1:
            out += [axes if k == big[0] else () for k in gj]
        elif len(gi) == 1 and [dst[k] for k in big] == [st.extent[a] for a in axes]:
            it = iter(axes)
            out += [(next(it),) if k in big else () for k in gj]
        else:
            raise NoRule(f"it cuts image dims {gi} into dims of sizes {[dst[k] for k in gj]}")
    st.prop.resized.add(n)
    return tuple(out)


def _groups(src: tuple[int, ...], dst: tuple[int, ...]) -> list[tuple[list[int], list[int]]]:
    """Consecutive dims of ``src`` and ``dst`` whose sizes multiply to the same number."""
    out: list[tuple[list[int], list[int]]] = []
    i = j = 0
    while i < len(src) or j < len(dst):
        gi, gj, pi, pj = [], [], 1, 1
        if i < len(src):
            gi, pi, i = [i], src[i], i + 1
        if j < len(dst):
            gj, pj, j = [j], dst[j], j + 1
        while pi != pj:
            if pi < pj and i < len(src):
                gi.append(i)
                pi, i = pi * src[i], i + 1
            elif j < len(dst):
                gj.append(j)
                pj, j = pj * dst[j], j + 1
            else:
                raise NoRule(f"a view of {src} as {dst}")
        out.append((gi, gj))
    return out


def expand(n: fx.Node, ins: list[Any], st: _State) -> Any:
    lay = ins[0]
    out = shape(n)
    st.prop.resized.add(n)
    return ((),) * (len(out) - len(lay)) + tuple(lay)


def index(n: fx.Node, ins: list[Any], st: _State) -> Any:
    """``w[target]``: a whole 1-D table (class weights) read per cell of a split index."""
    base, indices = n.args[0], list(n.args[1])
    if tiled(st.layout(base)) or len(indices) != 1 or not tiled(st.layout(indices[0])):
        raise NoRule("indexing a split tensor (only a whole table by a split index runs on "
                     "tiles)")
    return st.layout(indices[0]) + ((),) * (len(shape(base)) - 1)


def one_hot(n: fx.Node, ins: list[Any], st: _State) -> Any:
    return tuple(ins[0]) + ((),)


def getitem(n: fx.Node, ins: list[Any], st: _State) -> Any:
    lays = st.layout(n.args[0])
    return lays[int(n.args[1])] if isinstance(lays, Multi) else lays


RULES: dict[Any, Rule] = {
    **dict.fromkeys(POINTWISE, pointwise), aten.bernoulli: pointwise,
    aten._softmax: along(1), aten._log_softmax: along(1), aten.softmax: along(1),
    aten.log_softmax: along(1), aten.cumsum: along(1),
    aten.sum: reduction("sum"), aten.mean: reduction("mean"), aten.amax: reduction("amax"),
    aten.amin: reduction("amin"), aten.max: reduction("amax"), aten.min: reduction("amin"),
    aten.any: reduction("any"), aten.all: reduction("all"),
    aten.linalg_vector_norm: reduction("norm"),
    aten.gather: gather, aten.scatter: scatter, aten.permute: permute,
    aten.unsqueeze: unsqueeze, aten.squeeze: squeeze, aten.select: select,
    aten.slice: slice_, aten.cat: cat, aten.view: view, aten.reshape: view,
    aten._unsafe_view: view, aten.expand: expand, aten.index: index, aten.one_hot: one_hot,
}
"""One entry per ATen op (overload packet) of a captured, decomposed loss."""

_DIM_REDUCTIONS = {aten.max.dim: extreme_dim, aten.min.dim: extreme_dim}
"""Overloads whose rule differs from their packet's (max / min with indices)."""


def rule_of(n: fx.Node) -> Rule | None:
    if n.target is operator.getitem:
        return getitem
    if n.target in _DIM_REDUCTIONS:
        return _DIM_REDUCTIONS[n.target]  # type: ignore[index]
    return RULES.get(getattr(n.target, "overloadpacket", None))


def propagate(gm: fx.GraphModule, extent: tuple[int, ...], parts: tuple[int, ...],
              inputs: list[Layout | None]) -> Propagation:
    """Every node's layout; raises :class:`NoRule` naming the first op that cannot run on
    tiles (``node`` attribute set) or an output that is not replicated."""
    st = _State(tuple(extent), tuple(i for i, p in enumerate(parts) if p > 1),
                Propagation({}, {}, {}, set()))
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for n, lay in zip(placeholders, inputs, strict=True):
        st.prop.layouts[n] = lay
    for n in gm.graph.nodes:
        if n.op in ("placeholder", "get_attr"):
            continue
        if n.op == "output":
            if tiled(st.layout(n.args[0])):
                raise _at(NoRule("the loss returns a per-pixel tensor: reduce it to a scalar "
                                 "(reduction='mean' or 'sum')"), n)
            continue
        ins = [st.layout(a) for a in n.args if isinstance(a, fx.Node)]
        if not any(tiled(la) for la in (st.layout(a) for a in n.all_input_nodes)) and \
                n.target is not operator.getitem:
            st.prop.layouts[n] = None  # whole on every rank: runs as it is
            continue
        rule = rule_of(n)
        if rule is None:
            raise _at(NoRule("fxpar has no tile rule for it"), n)
        try:
            st.prop.layouts[n] = rule(n, ins, st)
        except NoRule as e:
            raise _at(e, n) from None
        except (IndexError, TypeError, ValueError) as e:
            raise _at(NoRule(f"its arguments are not the ones its rule knows ({e})"),
                      n) from None
    return st.prop


def _at(e: NoRule, n: fx.Node) -> NoRule:
    e.node = n  # type: ignore[attr-defined]
    return e
