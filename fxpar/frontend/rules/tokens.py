"""Token layouts: tiled values that leave the (N, C, H, W) form and keep a tile's pixels.

Vision transformers, Swin, SegFormer, UNETR and ConvNeXt-V2 turn the image into tokens::

    x = x.flatten(2).transpose(1, 2)      # N, H*W, C: a token is a pixel
    x = x + attn(norm(x))                 # per token, or attention over all tokens
    x = x.transpose(1, 2).reshape(N, C, H, W)

On a tile, the same ops see the tile's pixels: ``flatten`` gives the tile's tokens in its own
row-major order, a LayerNorm over C or a linear layer acts on each token alone, and the reshape
back needs the tile's H and W. So such a block runs on tiles as long as every op in it either
acts on each token alone, reduces over every split dim (a replicated result, one allreduce),
contracts a split dim (``k.transpose(-2, -1) @ v`` of linear attention: partial products summed
over the tiles) or is attention whose keys are split (ring attention: fxpar.runtime.spatial.
attention).

Each value's *token layout* (fxpar.frontend.rules.layouts) says which image axes each of its
dims holds, at what extent; the (N, C, H, W) layout is where the ordinary spatial rules take
over again. Swin's windows are factors of such dims (the window index, the position inside a
window), allowed when every tile holds whole windows.

One rule per op (:data:`RULES`) maps the operands' layouts to a :class:`TokenLayout`: the output
layout and what the tile rewrite (fxpar.passes.tile_tokens) must do. An op without a rule, or
a use its rule refuses (:class:`NoRule`, with the reason), is never guessed at: the block then
ends the spatial region as before.
"""


from __future__ import annotations

import math
import operator
from collections.abc import Callable
from typing import Any

import torch
from torch import fx

from fxpar.core import meta
from fxpar.core.meta import TensorInfo
from fxpar.frontend.rules.aten_ops import arg
from fxpar.frontend.rules.attention import (
    attended,
    attention,
    einsum_attention,
    in_chain,
    is_transpose,
)
from fxpar.frontend.rules.dims import NoRule
from fxpar.frontend.rules.dims import _groups as view_groups
from fxpar.frontend.rules.layouts import (
    PLAIN,
    Axes,
    Layout,
    Multi,
    Probs,
    Rule,
    Scores,
    State,
    TokenLayout,
    image_layout,
    inner,
    is_image,
    normal,
    shape,
    size_of,
)
from fxpar.frontend.rules.layouts import dim_of as _dim
from fxpar.frontend.rules.layouts import first_tiled as _first
from fxpar.frontend.rules.layouts import tiled as _tiled
from fxpar.frontend.rules.pointwise import POINTWISE
from fxpar.frontend.rules.token_ops import (
    conv_1x1,
    expand_as,
    group_norm,
    pad,
    replicated_factory,
    roll,
    unfold,
)

__all__ = ["Axes", "Layout", "Multi", "Probs", "RULES", "Scores", "State", "TokenLayout",
           "image_layout", "is_image", "token_layout"]

aten = torch.ops.aten


def pointwise(n: fx.Node, st: State) -> TokenLayout:
    """Broadcasting elementwise op: tiled operands must agree (aligned from the right); a whole
    operand that varies along a split dim is cut to the tile's cells (positional only)."""
    out = shape(n)
    lay: list[Axes] = [()] * len(out)
    for a in n.all_input_nodes:
        la = st.layout(a)
        if not _tiled(la):
            continue
        off = len(out) - len(la)
        for i, axes in enumerate(la):
            if axes and lay[off + i] and lay[off + i] != axes:
                raise NoRule("its operands are tiled along different dims")
            if axes:
                lay[off + i] = axes
    sliced = []
    for pos, a in enumerate(n.args):
        if not isinstance(a, fx.Node) or _tiled(st.layout(a)) or \
                meta.find(a, TensorInfo) is None:
            continue
        s = shape(a)
        off = len(out) - len(s)
        if any(size != 1 and st.split(lay[off + i]) for i, size in enumerate(s)):
            if any(size not in (1, size_of(lay[off + i])) for i, size in enumerate(s)
                   if st.split(lay[off + i])):
                raise NoRule(f"operand {a.name!r} of shape {s} is whole and not the image's size")
            sliced.append(pos)
    for a in n.all_input_nodes:  # operands given in lists or by keyword: never cut
        if a not in n.args and not _tiled(st.layout(a)) and meta.find(a, TensorInfo):
            s = shape(a)
            off = len(out) - len(s)
            if any(size != 1 and st.split(lay[off + i]) for i, size in enumerate(s)):
                raise NoRule(f"operand {a.name!r} varies along a split dim")
    return TokenLayout(tuple(lay), sliced=tuple(sliced))




def along(pos: int, default: Any = -1) -> Rule:
    """An op along one dim (softmax, cumsum): the dim must not be split; a softmax along a
    split dim (MobileViT-v2's context scores over every patch) takes the maximum and the sum
    of its exponentials over all tiles (``softmax``)."""
    def rule(n: fx.Node, st: State) -> TokenLayout:
        lay = _first(n, st)
        d = _dim(n, pos, default, len(lay))
        if st.split(lay[d]) and n.target.overloadpacket in (aten.softmax, aten._softmax) and \
                len(n.all_input_nodes) == 1:
            return TokenLayout(lay, "softmax", reduce=(d,))
        if st.split(lay[d]):
            raise NoRule("it works along a dim that is split over the tiles (softmax over "
                         "tokens of several tiles is attention: use "
                         "F.scaled_dot_product_attention)")
        return TokenLayout(lay)
    return rule


def last_dims(count: Callable[[fx.Node], int]) -> Rule:
    """An op over the last ``count(n)`` dims of its first operand (linear: 1, layer_norm:
    len(normalized_shape)); every other operand whole (its weights)."""
    def rule(n: fx.Node, st: State) -> TokenLayout:
        lay = _first(n, st)
        if any(st.split(a) for a in lay[len(lay) - count(n):]):
            raise NoRule("it acts along a dim that is split over the tiles")
        if any(_tiled(st.layout(a)) for a in n.all_input_nodes[1:]):
            raise NoRule("its weights are tiled")
        return TokenLayout(lay)
    return rule


def reduction(kind: str) -> Rule:
    """sum / mean / amax / amin / vector norm: over no split dim it stays on the tile; over
    every split dim it is replicated (tile partial, one allreduce)."""
    def rule(n: fx.Node, st: State) -> TokenLayout:
        lay = _first(n, st)
        rank = len(lay)
        names = [a.name for a in n.target._schema.arguments]
        pos = names.index("dim") if "dim" in names else None
        dims = arg(n, pos, None) if pos is not None else None
        dims = list(range(rank)) if dims in (None, []) else \
            sorted({int(d) % rank for d in ([dims] if isinstance(dims, int) else dims)})
        keep = bool(arg(n, names.index("keepdim"), False)) if "keepdim" in names else False
        split = {i for i, a in enumerate(lay) if st.split(a)}
        if "dtype" in names and arg(n, names.index("dtype"), None) is not None:
            raise NoRule("a reduction with a dtype argument")
        if not split & set(dims):
            return TokenLayout(tuple(() if i in dims else a for i, a in enumerate(lay)) if keep
                               else tuple(a for i, a in enumerate(lay) if i not in dims))
        if not split <= set(dims):
            raise NoRule(f"it reduces dims {dims} of a value split along dims {sorted(split)}: "
                         f"only over all split dims or none")
        order = float(arg(n, 1, 2.0)) if kind == "norm" else 2.0
        count = math.prod(shape(n.args[0])[d] for d in dims)
        return TokenLayout(None, "reduce", (kind, tuple(dims), keep, count, order))
    return rule


def permute(n: fx.Node, st: State) -> TokenLayout:
    lay = _first(n, st)
    return TokenLayout(tuple(lay[int(d) % len(lay)] for d in arg(n, 1, [])))


def transpose(n: fx.Node, st: State) -> TokenLayout:
    lay = list(_first(n, st))
    i, j = (_dim(n, k, 0, len(lay)) for k in (1, 2))
    lay[i], lay[j] = lay[j], lay[i]
    return TokenLayout(tuple(lay))


def unsqueeze(n: fx.Node, st: State) -> TokenLayout:
    lay = list(_first(n, st))
    lay.insert(int(arg(n, 1, 0)) % (len(lay) + 1), ())
    return TokenLayout(tuple(lay))


def squeeze(n: fx.Node, st: State) -> TokenLayout:
    lay, s = _first(n, st), shape(n.args[0])
    dims = arg(n, 1, None)
    dims = [i for i, v in enumerate(s) if v == 1] if dims is None else \
        [int(d) % len(s) for d in ([dims] if isinstance(dims, int) else dims)]
    return TokenLayout(tuple(a for i, a in enumerate(lay) if not (i in dims and s[i] == 1)))


def pick(n: fx.Node, st: State) -> TokenLayout:
    """select / slice / narrow along a dim that is not split; along a split dim, a slice of
    all of it (Swin's crop of a padding of nothing), or every s-th cell from one of the first
    s (Swin's patch merging, ``x[:, 1::2]``) when every tile starts on a multiple of s."""
    lay = _first(n, st)
    d = _dim(n, 1, 0, len(lay))
    if n.target.overloadpacket is aten.slice and len(lay[d]) == 1 and lay[d][0][0] >= 0:
        start, end, step = arg(n, 2, None) or 0, arg(n, 3, None), int(arg(n, 4, 1))
        (axis, extent), = lay[d]
        whole = end is None or end >= shape(n.args[0])[d]
        if whole and step == 1 and start == 0:
            return TokenLayout(lay)
        if whole and 0 <= start < step and st.aligned(axis, extent, step):
            return TokenLayout(tuple(((axis, extent // step),) if i == d else a
                                     for i, a in enumerate(lay)))
    if st.split(lay[d]):
        raise NoRule(f"it indexes dim {d}, which is split over the tiles")
    if n.target.overloadpacket is aten.select:
        return TokenLayout(tuple(a for i, a in enumerate(lay) if i != d))
    return TokenLayout(tuple(() if i == d else a for i, a in enumerate(lay)))


def pieces(n: fx.Node, st: State) -> TokenLayout:
    """split / chunk / unbind along a dim that is not split: one layout per piece."""
    lay = _first(n, st)
    d = _dim(n, 1 if n.target.overloadpacket is aten.unbind else 2, 0, len(lay))
    if st.split(lay[d]):
        raise NoRule(f"it splits dim {d}, which is split over the tiles")
    count = len(meta.get(n, TensorInfo).shapes)
    one = tuple(a for i, a in enumerate(lay) if i != d) \
        if n.target.overloadpacket is aten.unbind else lay
    return TokenLayout(Multi((one,) * count))


def getitem(n: fx.Node, st: State) -> TokenLayout:
    lays = st.layout(n.args[0])
    return TokenLayout(lays[int(n.args[1])] if isinstance(lays, Multi) else lays)


def cat(n: fx.Node, st: State) -> TokenLayout:
    """cat / stack of tensors tiled alike, along a dim that is not split."""
    parts = list(n.args[0])
    lays = [st.layout(a) for a in parts]
    ref = next(la for la in lays if _tiled(la))
    if any(la != ref for la in lays):
        raise NoRule("it joins tensors that are not tiled alike")
    if n.target.overloadpacket is aten.stack:
        lay = list(ref)
        lay.insert(int(arg(n, 1, 0)) % (len(ref) + 1), ())
        return TokenLayout(tuple(lay))
    if st.split(ref[_dim(n, 1, 0, len(ref))]):
        raise NoRule("it concatenates along a split dim")
    return TokenLayout(ref)


def view(n: fx.Node, st: State) -> TokenLayout:
    """view / reshape / flatten / unflatten, group by group of dims whose sizes multiply
    alike: the group's factors (:data:`Axes`; a dim that is not the image's is a plain factor)
    are dealt out to the new dims in row-major order. Image dims merged into one keep all their
    factors (H, W -> H*W); a dim cut back gets them back; an image axis cut into (E / w, w) is
    Swin's window partition: the window index and the position inside it, allowed when every
    tile holds whole windows. A size argument naming split dims gets the tile's sizes
    (``resize``)."""
    lay, src, dst = _first(n, st), shape(n.args[0]), shape(n)
    out: list[Axes] = []
    for gi, gj in view_groups(src, dst):
        factors = [f for k in gi for f in (lay[k] or ((PLAIN, src[k]),) if src[k] != 1
                                           else lay[k])]
        if not normal(tuple(factors)):
            out += [()] * len(gj)
            continue
        out += _deal(factors, [dst[k] for k in gj], st)
    sized = n.target.overloadpacket is not aten.flatten
    return TokenLayout(tuple(out), "resize" if sized and any(st.split(a) for a in out) else "")


def _deal(factors: list[tuple[int, int]], sizes: list[int], st: State) -> list[Axes]:
    """``factors`` (row-major) dealt out to dims of ``sizes`` (whose product they make): a
    factor that one dim takes only part of is cut into (outer, inner) cells."""
    queue, out = list(factors), []
    for size in sizes:
        took: list[tuple[int, int]] = []
        have = 1
        while have < size:
            if not queue:
                raise NoRule(f"a view of {factors} as {sizes}")
            axis, extent = queue.pop(0)
            if have * extent <= size:
                took.append((axis, extent))
                have *= extent
                continue
            want = size // have
            if size % have or extent % want:
                raise NoRule(f"it cuts a dim of {extent} cells into {want} parts unevenly")
            rest = extent // want
            if axis >= 0:
                if not st.aligned(axis, extent, rest):
                    raise NoRule(
                        f"windows of {rest} cells along a dim of {extent} cross the tiles' "
                        f"edges ({st.parts[axis]} tiles): choose an image size or a number of "
                        f"parts whose tiles hold whole windows")
                took.append((axis, want))
                queue.insert(0, (inner(axis), rest))
            elif axis == PLAIN:
                took.append((PLAIN, want))
                queue.insert(0, (PLAIN, rest))
            else:
                raise NoRule("it cuts the inside of a window")
            have *= want
        out.append(normal(tuple(took)))
    if queue:
        raise NoRule(f"a view of {factors} as {sizes}")
    return out


def expand(n: fx.Node, st: State) -> TokenLayout:
    lay = _first(n, st)
    out = shape(n)
    new = ((),) * (len(out) - len(lay)) + tuple(lay)
    return TokenLayout(new, "resize" if any(st.split(a) for a in new) else "")


def matmul(n: fx.Node, st: State) -> TokenLayout:
    """a @ b over (..., M, K) x (..., K, N): per row of a split M; over a split K (both
    operands split alike there: linear attention's k^T v) the tiles' products are summed."""
    a, b = n.args[0], n.args[1]
    sa, sb = shape(a), shape(b)
    if len(sa) < 2 or len(sb) < 2:
        raise NoRule("a matrix-vector product")
    la = st.layout(a) if _tiled(st.layout(a)) else ((),) * len(sa)
    lb = st.layout(b) if _tiled(st.layout(b)) else ((),) * len(sb)
    batch_a, batch_b = la[:-2], lb[:-2]
    width = max(len(batch_a), len(batch_b))
    batch = []
    for i in range(width):
        x = batch_a[i - width + len(batch_a)] if i - width + len(batch_a) >= 0 else ()
        y = batch_b[i - width + len(batch_b)] if i - width + len(batch_b) >= 0 else ()
        if x and y and x != y:
            raise NoRule("its operands are tiled along different batch dims")
        batch.append(x or y)
    for i, x in enumerate(batch):  # a split batch dim (Swin's windows): split alike in both
        for lx, sx in ((la, sa), (lb, sb)):
            j = i - width + len(lx) - 2
            if st.split(x) and j >= 0 and not lx[j] and sx[j] != 1:
                raise NoRule("a product batched over a dim one operand splits and the other "
                             "holds whole")
    if isinstance(la[-1], Probs):  # softmax(q k^T) @ v: the end of an attention chain
        return attended(la, lb, st)
    if st.split(la[-1]) or st.split(lb[-2]):
        if any(st.split(x) for x in batch):
            raise NoRule("a product over a split dim, batched over a split dim")
        if la[-1] != lb[-2] or st.split(la[-2]) or st.split(lb[-1]):
            raise NoRule("it contracts a split dim of one operand with a dim the other "
                         "does not split alike")
        return TokenLayout(None, "contract")
    if st.split(lb[-1]) and _tiled(st.layout(b)) and is_transpose(b):  # q @ k^T: scores
        return TokenLayout((*batch, la[-2], Scores(lb[-1])), "pending")
    if st.split(la[-2]) and st.split(lb[-1]):
        raise NoRule("both of its operands' free dims are split (attention scores between "
                     "two tiled token sets: use F.scaled_dot_product_attention)")
    return TokenLayout((*batch, la[-2], lb[-1]))


def einsum(n: fx.Node, st: State) -> TokenLayout:
    """einsum: each index letter holds the axes its operands give it (alike in all); a split
    letter summed away makes the result replicated, summed over the tiles."""
    equation, operands = str(n.args[0]).replace(" ", ""), list(n.args[1])
    ins, _, out = equation.partition("->")
    terms = ins.split(",")
    if "." in equation or not out and "->" not in equation:
        raise NoRule("an einsum with '...' or an implicit output")
    letters: dict[str, Axes] = {}
    for term, x in zip(terms, operands, strict=True):
        lay = st.layout(x)
        if not _tiled(lay):
            continue
        for c, axes in zip(term, lay, strict=True):
            if axes and letters.get(c, axes) != axes:
                raise NoRule(f"index {c!r} is tiled differently in its operands")
            if axes:
                letters[c] = axes
    for term, x in zip(terms, operands, strict=True):
        if not _tiled(st.layout(x)) and any(st.split(letters.get(c, ())) and s != 1
                                            for c, s in zip(term, shape(x), strict=True)):
            raise NoRule(f"operand {x.name!r} is whole along a split index")
    chain = einsum_attention(terms, out, operands, st)
    if chain is not None:
        return chain
    summed = [c for c in letters if c not in out and st.split(letters[c])]
    kept = [c for c in out if st.split(letters.get(c, ()))]
    if summed and kept:
        raise NoRule("it sums a split index into a result that is still split")
    if summed:
        return TokenLayout(None, "contract")
    if len({letters[c] for c in kept}) < len(kept) or len(kept) > 1:
        raise NoRule("two of its result's indices are split (attention scores between two "
                     "tiled token sets: use F.scaled_dot_product_attention)")
    return TokenLayout(tuple(letters.get(c, ()) for c in out))








RULES: dict[Any, Rule] = {
    **dict.fromkeys(POINTWISE, pointwise), aten.bernoulli: pointwise,
    aten.softmax: along(1), aten._softmax: along(1), aten.log_softmax: along(1),
    aten._log_softmax: along(1), aten.cumsum: along(1, 0),
    aten.sum: reduction("sum"), aten.mean: reduction("mean"), aten.amax: reduction("amax"),
    aten.amin: reduction("amin"), aten.linalg_vector_norm: reduction("norm"),
    aten.linear: last_dims(lambda n: 1),
    aten.layer_norm: last_dims(lambda n: len(arg(n, 1, []))),
    aten.permute: permute, aten.transpose: transpose, aten.unsqueeze: unsqueeze,
    aten.squeeze: squeeze, aten.select: pick, aten.slice: pick, aten.narrow: pick,
    aten.split: pieces, aten.split_with_sizes: pieces, aten.chunk: pieces, aten.unbind: pieces,
    aten.cat: cat, aten.stack: cat,
    aten.view: view, aten.reshape: view, aten._unsafe_view: view, aten.flatten: view,
    aten.unflatten: view, aten.expand: expand,
    aten.matmul: matmul, aten.bmm: matmul, aten.einsum: einsum,
    aten.scaled_dot_product_attention: attention,
    aten.pad: pad, aten.constant_pad_nd: pad, aten.roll: roll, aten.unfold: unfold,
    aten.expand_as: expand_as, aten.group_norm: group_norm,
    aten.conv1d: conv_1x1, aten.conv2d: conv_1x1, aten.conv3d: conv_1x1,
    aten.new_empty: replicated_factory, aten.new_zeros: replicated_factory,
    aten.new_ones: replicated_factory, aten.new_full: replicated_factory,
}
"""One entry per ATen op (overload packet) that can run on tiles in a token layout."""


def rule_of(gm: fx.GraphModule, n: fx.Node) -> Rule | None:
    """The rule of node ``n`` (fxpar's dropout module counts as elementwise)."""
    if n.op == "call_function" and n.target is operator.getitem:
        return getitem
    if n.op == "call_module":
        from_capture = type(gm.get_submodule(str(n.target))).__name__ == "DropoutOp"
        return pointwise if from_capture else None
    return RULES.get(getattr(n.target, "overloadpacket", None))


def token_layout(gm: fx.GraphModule, n: fx.Node, st: State) -> TokenLayout:
    """``n``'s :class:`TokenLayout` given its operands' layouts in ``st``; :class:`NoRule`
    (with the reason) when it cannot run on tiles."""
    chain = in_chain(gm, n, st, RULES)
    if chain is not None:
        return chain
    rule = rule_of(gm, n)
    if rule is None:
        name = getattr(n.target, "overloadpacket", n.target)
        raise NoRule(f"fxpar has no token-layout rule for {name}")
    try:
        out = rule(n, st)
    except (IndexError, TypeError, ValueError, StopIteration) as e:
        raise NoRule(f"its arguments are not the ones its rule knows ({e})") from None
    if out.layout is not None and not isinstance(out.layout, Multi) and \
            not any(st.split(a) for a in out.layout) and out.action in ("", "resize"):
        return TokenLayout(None)  # nothing of the image left: the same on every rank
    return out


