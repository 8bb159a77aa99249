"""Attention over tokens split across the tiles (fxpar.frontend.rules.tokens' attention rules).

``F.scaled_dot_product_attention(q, k, v)`` whose keys are split over the tiles runs as ring
attention (tiled queries) or merged partial attention (replicated queries, a class token)
(fxpar.runtime.spatial.attention). Attention written out, ``softmax((q @ k^T) * scale) @ v``
(SegFormer, with matmuls) or with einsums (MONAI's ``blxd,blyd->blxy`` and
``bhxy,bhyd->bhxd``), is the same computation: its scores get a key dim marked
:class:`Scores`, the softmax over it makes it :class:`Probs`, and the product with the values
ends the chain, which the tile rewrite (fxpar.passes.tile_tokens) replaces by one ring
attention; the scores of a tile's queries against every key are never held at once. Scaling by
a number, dropout with p = 0 and the softmax over the keys may come between; any other use of
the scores has no rule.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import fx

from fxpar.frontend.rules.aten_ops import arg
from fxpar.frontend.rules.dims import NoRule
from fxpar.frontend.rules.layouts import (
    Layout,
    Multi,
    Probs,
    Rule,
    Scores,
    State,
    TokenLayout,
    shape,
    size_of,
    tiled,
)

aten = torch.ops.aten


def is_transpose(b: fx.Node) -> bool:
    """``b`` is ``k.transpose(-2, -1)`` (or the permute that swaps the last two dims)."""
    packet = getattr(b.target, "overloadpacket", None)
    rank = len(shape(b))
    if packet is aten.transpose:
        return sorted(int(arg(b, i, 0)) % rank for i in (1, 2)) == [rank - 2, rank - 1]
    if packet is aten.permute:
        dims = [int(d) % rank for d in arg(b, 1, [])]
        return dims == [*range(rank - 2), rank - 1, rank - 2]
    return False


def attended(lp: Layout, lv: Layout, st: State) -> TokenLayout:
    """softmax(q k^T) @ v with the keys split: ring attention (tiled queries) or merged
    partial attention (replicated queries)."""
    keys = tuple(lp[-1])
    if tuple(lv[-2]) != keys or any(st.split(a) for a in lv[:-2]) or st.split(lv[-1]):
        raise NoRule("the values of an attention are not split like its keys")
    if any(lp[:-2]):
        raise NoRule("attention batched over a split dim")
    if st.split(lp[-2]):
        return TokenLayout((*lp[:-1], lv[-1]), "ring")
    return TokenLayout(None, "gather")


def einsum_attention(terms: list[str], out: str, operands: list[Any], st: State
                      ) -> TokenLayout | None:
    """MONAI's attention as einsums: ``bhxd,bhyd->bhxy`` (scores, the keys ``y`` split) and
    ``bhxy,bhyd->bhxd`` (probabilities times values); None for any other einsum."""
    if len(terms) != 2 or len(out) != len(terms[0]) or len(terms[1]) != len(out):
        return None
    a, b = terms
    la, lb = st.layout(operands[0]), st.layout(operands[1])
    batch = out[:-2]
    if a[:-2] != batch or b[:-2] != batch or not tiled(lb):
        return None
    x, d = a[-2], a[-1]
    if len({x, d, b[-2], b[-1]}) != 3:
        return None
    if tiled(la) and isinstance(la[-1], Probs) and b[-2] == d and out[-2:] == x + b[-1]:
        return attended(la, lb, st)
    if b[-1] == d and out[-2:] == x + b[-2] and st.split(lb[-2]):
        lq = la if tiled(la) else ((),) * len(a)
        if any(lq[:-2]) or any(lb[:-2]) or st.split(lq[-1]) or st.split(lb[-1]):
            return None
        return TokenLayout((*lq[:-1], Scores(lb[-2])), "pending")
    return None


def attention(n: fx.Node, st: State) -> TokenLayout:
    """scaled_dot_product_attention(q, k, v, mask): keys split over the tiles -> ring attention
    (tiled queries; a mask becomes the ring's bias, its rows the tile's queries and its columns
    every tile's keys in rank order) or merged partial attention (replicated queries, a class
    token); keys whole -> each query on its own tile (a mask varying along a split dim cut to
    the tile's cells)."""
    q, k, v = n.args[:3]
    mask = arg(n, 3, None)
    if float(arg(n, 4, 0.0)) or bool(arg(n, 5, False)):
        raise NoRule("attention with dropout or is_causal over tiled tokens")
    if isinstance(mask, fx.Node) and tiled(st.layout(mask)):
        raise NoRule("attention whose mask is itself split over the tiles")
    lq, lk, lv = (st.layout(x) for x in (q, k, v))
    if tiled(lk) != tiled(lv) or tiled(lk) and lk[:-1] != lv[:-1]:
        raise NoRule("its keys and values are not tiled alike")
    if not tiled(lk) or not st.split(lk[-2]):  # per window: batch dims may be split alike
        if any(tiled(la) and st.split(la[-1]) for la in (lq, lk, lv)) or tiled(lk) and (
                not tiled(lq) or lq[:-2] != lk[:-2]) and any(st.split(a) for a in lk[:-2]):
            raise NoRule("attention whose queries and keys are split along different dims")
        out = (*lq[:-1], lv[-1] if tiled(lv) else ()) if tiled(lq) else None
        return TokenLayout(out, sliced=_mask_cut(mask, out, st))
    if not tiled(lq):
        if mask is not None:
            raise NoRule("a mask on replicated queries attending to split keys")
        return TokenLayout(None, "gather")
    for lay in (lq, lk):
        if any(st.split(a) for i, a in enumerate(lay) if i != len(lay) - 2):
            raise NoRule("attention over a tensor split along a dim other than its tokens")
    if isinstance(mask, fx.Node):
        want = (size_of(lq[-2]), size_of(lk[-2]))
        if any(s not in (1, w) for s, w in zip(shape(mask)[-2:], want, strict=False)):
            raise NoRule(f"a mask of shape {shape(mask)} over {want[0]} queries and "
                         f"{want[1]} keys")
    return TokenLayout(lq, "ring")


def _mask_cut(mask: Any, out: Any, st: State) -> tuple[int, ...]:
    """(3,) when the attention ``mask`` (aligned from the right with the output, keys whole)
    varies along a split dim (the rewrite cuts it to the tile's cells), else ()."""
    if not isinstance(mask, fx.Node) or out is None:
        return ()
    s = shape(mask)
    off = len(out) - len(s)
    varying = [i for i, size in enumerate(s) if size != 1 and st.split(out[off + i])]
    if any(s[i] != size_of(out[off + i]) for i in varying):
        raise NoRule(f"a mask of shape {s} is whole and not the image's size")
    return (3,) if varying else ()


SCALING = {aten.mul, aten.div}
"""Ops that may scale attention scores by a number (``(q @ k^T) * scale``)."""


def in_chain(gm: fx.GraphModule, n: fx.Node, st: State, products: Mapping[Any, Rule]
             ) -> TokenLayout | None:
    """``n`` reading attention scores or probabilities with split keys (:class:`Scores`,
    :class:`Probs`): scaling by a number and the softmax over the keys keep the chain going;
    dropout with p = 0 is nothing; the product with the values ends it (its own rule); any
    other use has no rule. None if ``n`` reads no such value."""
    lays = [st.layout(a) for a in n.all_input_nodes]
    marks = [la[-1] for la in lays if tiled(la) and not isinstance(la, Multi) and
             isinstance(la[-1], (Scores, Probs))]
    if not marks:
        return None
    packet = getattr(n.target, "overloadpacket", None)
    lay = st.layout(n.args[0]) if n.args else None
    first = lay is not None and not isinstance(lay, Multi) and lay and \
        isinstance(lay[-1], (Scores, Probs))
    if n.op == "call_module" and first:
        if getattr(gm.get_submodule(str(n.target)), "p", 1.0) == 0:
            return TokenLayout(lay, "pending")
        raise NoRule("dropout on attention probabilities whose keys are split over the tiles")
    if packet in SCALING and first and isinstance(lay[-1], Scores) and \
            len(n.all_input_nodes) == 1 and isinstance(n.args[1], (int, float)):
        return TokenLayout(lay, "pending")
    if packet in (aten.softmax, aten._softmax) and first and isinstance(lay[-1], Scores) and \
            int(arg(n, 1, -1)) % len(lay) == len(lay) - 1:
        return TokenLayout((*lay[:-1], Probs(lay[-1])), "pending")
    if packet in (aten.matmul, aten.bmm, aten.einsum) and (
            first and isinstance(lay[-1], Probs) or packet is aten.einsum):
        rule = products[packet]
        return rule(n, st)
    raise NoRule("attention scores over split keys are used by an op other than a scaling, "
                 "the softmax over the keys or the product with the values")


