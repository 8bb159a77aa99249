"""Chains: a fixed run of layout ops that together is one op fxpar tiles.

Some models write a known op as views and a permute. TResNet's stem (timm's ``SpaceToDepth``,
the first op of ``tresnet_m``) is::

    view = aten.view(x, [N, C, H/b, b, W/b, b])
    permute = aten.permute(view, [0, 3, 5, 1, 2, 4])        # N, b, b, C, H/b, W/b
    contiguous = aten.contiguous(permute)
    out = aten.view(contiguous, [N, b*b*C, H/b, W/b])

The first view splits H and W, so no tile can run it: the region would end at the model's
first op. The chain is ``pixel_unshuffle`` by b (a window op: output row o reads input rows
[b o, b o + b)) with its channels in another order -- (i, j, c) instead of (c, i, j) -- so it
is rewritten into exactly that, at capture (fxpar.frontend.capture.normalize)::

    pixel_unshuffle = aten.pixel_unshuffle(x, b)             # N, C*b*b, H/b, W/b: (c, i, j)
    view = aten.view(pixel_unshuffle, [N, C, b*b, H/b, W/b])
    permute = aten.permute(view, [0, 2, 1, 3, 4])            # the channel order (i, j, c)
    contiguous = aten.contiguous(permute)
    out = aten.view(contiguous, [N, b*b*C, H/b, W/b])

The window op has its tiling rule (fxpar.frontend.rules.aten_ops); the channel reorder after it
works on each pixel alone, as ShuffleNet's channel shuffle does (fxpar.frontend.rules.islands).
``DepthToSpace`` (the inverse) is the channel reorder, then ``pixel_shuffle``.

Adaptive max pooling to a size that divides the map (not to 1) whose indices nothing reads,
``getitem(adaptive_max_pool2d(x, out), 0)``, is ``max_pool2d(x, k, k)`` with k = x / out: the
same bins, the same first maximum of each (ATen's tie rule), one output instead of (values,
indices), so it runs on tiles as a max pool. To 1 or to sizes that do not divide the map it
stays (a reduction over the whole image, fxpar.frontend.rules.aten_ops).

Each rewrite computes the same values from the same cells, so it changes no result and no
gradient, whatever the plan. :data:`CHAINS` has one entry per chain: a matcher on its last node
that says which nodes it is and what it becomes. Adding a chain is adding an entry.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx

from fxpar.core.geometry import per_dim

aten = torch.ops.aten
VIEWS = (aten.view.default, aten.reshape.default, aten._unsafe_view.default)
COPIES = (aten.contiguous.default, aten.clone.default)
Shape = tuple[int, ...]
Emit = Callable[..., fx.Node]
"""``emit(target, *args)``: insert a call of ``target`` where the chain is, recording its
value; returns its node."""


@dataclass(frozen=True)
class Found:
    """A chain in a graph: its nodes (its output first; each read by the chain only, so all go
    once the output is replaced) and the ops it is, ``build(emit)`` -> the new output."""

    nodes: tuple[fx.Node, ...]
    build: Callable[[Emit], fx.Node]


@dataclass(frozen=True)
class Chain:
    """One kind of chain: ``match(node)`` -> :class:`Found` when ``node`` ends one, else
    None."""

    name: str
    match: Callable[[fx.Node], Found | None]


def _calls(n: Any, targets: tuple[Any, ...]) -> bool:
    return isinstance(n, fx.Node) and n.op == "call_function" and n.target in targets


def _val(n: Any) -> Any:
    return n.meta.get("val") if isinstance(n, fx.Node) else n


def _shape(n: Any) -> Shape | None:
    shape = tuple(getattr(_val(n), "shape", ()))
    return shape if shape and all(isinstance(v, int) for v in shape) else None


def _view_permute_view(last: fx.Node
                       ) -> tuple[tuple[fx.Node, ...], fx.Node, Shape, list[int], list[int],
                                  list[int]] | None:
    """``view -> permute -> [contiguous] -> view`` ending at ``last``, on an (N, C, H, W)
    input: (nodes, input, its shape, first sizes, permutation, last sizes)."""
    if not _calls(last, VIEWS):
        return None
    nodes = [last, last.args[0]]
    if _calls(nodes[-1], COPIES):  # the permute's copy (contiguous): the same values
        nodes.append(nodes[-1].args[0])
    permute = nodes[-1]
    if not _calls(permute, (aten.permute.default,)) or not _calls(permute.args[0], VIEWS):
        return None
    first = permute.args[0]
    nodes.append(first)
    x, shape = first.args[0], _shape(first.args[0])
    if any(len(n.users) != 1 for n in nodes[1:]) or shape is None or len(shape) != 4:
        return None
    sizes = [[int(v) for v in n.args[1]] for n in (first, last)]
    return tuple(nodes), x, shape, sizes[0], [int(d) % 6 for d in permute.args[1]], sizes[1]


def _space_to_depth(last: fx.Node) -> Found | None:
    """timm's SpaceToDepth(b): pixel_unshuffle(b), channels (c, i, j) -> (i, j, c)."""
    found = _view_permute_view(last)
    if found is None:
        return None
    nodes, x, (n, c, h, w), first, perm, out = found
    b = first[3] if len(first) == 6 else 0
    if not (b > 1 and h % b == 0 and w % b == 0 and first == [n, c, h // b, b, w // b, b]
            and perm == [0, 3, 5, 1, 2, 4] and out == [n, c * b * b, h // b, w // b]):
        return None

    def build(emit: Emit) -> fx.Node:
        y = emit(aten.pixel_unshuffle.default, x, b)
        y = emit(aten.view.default, y, [n, c, b * b, h // b, w // b])
        y = emit(aten.contiguous.default, emit(aten.permute.default, y, [0, 2, 1, 3, 4]))
        return emit(aten.view.default, y, [n, b * b * c, h // b, w // b])
    return Found(nodes, build)


def _depth_to_space(last: fx.Node) -> Found | None:
    """timm's DepthToSpace(b): channels (i, j, c) -> (c, i, j), then pixel_shuffle(b)."""
    found = _view_permute_view(last)
    if found is None:
        return None
    nodes, x, (n, c, h, w), first, perm, out = found
    b = first[1] if len(first) == 6 else 0
    if not (b > 1 and c % (b * b) == 0 and first == [n, b, b, c // (b * b), h, w]
            and perm == [0, 3, 4, 1, 5, 2] and out == [n, c // (b * b), h * b, w * b]):
        return None

    def build(emit: Emit) -> fx.Node:
        y = emit(aten.view.default, x, [n, b * b, c // (b * b), h, w])
        y = emit(aten.contiguous.default, emit(aten.permute.default, y, [0, 2, 1, 3, 4]))
        return emit(aten.pixel_shuffle.default, emit(aten.view.default, y, [n, c, h, w]), b)
    return Found(nodes, build)


ADAPTIVE_MAX = {aten.adaptive_max_pool1d.default: aten.max_pool1d.default,
                aten.adaptive_max_pool2d.default: aten.max_pool2d.default,
                aten.adaptive_max_pool3d.default: aten.max_pool3d.default}


def _adaptive_max_as_pool(last: fx.Node) -> Found | None:
    """``getitem(adaptive_max_pool2d(x, out), 0)``, out dividing x and not 1, the indices
    unread: ``max_pool2d(x, k, k)``, k = x / out (1-D and 3-D likewise)."""
    pool = last.args[0] if last.op == "call_function" and last.target is operator.getitem \
        and last.args[1] == 0 else None
    if not _calls(pool, tuple(ADAPTIVE_MAX)):
        return None
    x, shape = pool.args[0], _shape(pool.args[0])
    others = [u for u in pool.users if u is not last]
    if shape is None or any(u.target is not operator.getitem or u.users for u in others):
        return None
    nd = len(shape) - 2
    out = per_dim(pool.args[1], nd)
    if out == (1,) * nd or any(e % o for e, o in zip(shape[2:], out, strict=True)):
        return None
    k = [e // o for e, o in zip(shape[2:], out, strict=True)]
    return Found((last, *others, pool),
                 lambda emit: emit(ADAPTIVE_MAX[pool.target], x, k, k))


CHAINS = (
    Chain("space_to_depth", _space_to_depth),  # timm's SpaceToDepth (TResNet's stem)
    Chain("depth_to_space", _depth_to_space),  # timm's DepthToSpace
    Chain("adaptive_max_as_pool", _adaptive_max_as_pool),
)
"""Every chain :func:`fuse_chains` rewrites."""


def fuse_chains(gm: fx.GraphModule) -> None:
    """Rewrite every chain of :data:`CHAINS` in ``gm`` into the ops it is (module doc). The
    new nodes keep the chain's place in the model (``nn_module_stack``, ``stack_trace``) for
    messages, and their values (``val``) for the analysis."""
    g = gm.graph
    for last in list(g.nodes):
        found = next((f for c in CHAINS if (f := c.match(last)) is not None), None)
        if found is None:
            continue
        like = found.nodes[-1]  # the chain's first op: where the model calls it

        def emit(target: Any, *args: Any, _like: fx.Node = like) -> fx.Node:
            node = g.create_node("call_function", target, args,
                                 name=target.overloadpacket.__name__)
            node.meta.update({k: _like.meta[k] for k in ("nn_module_stack", "stack_trace")
                              if k in _like.meta})
            node.meta["val"] = target(*[_val(a) for a in args])
            return node

        with g.inserting_before(last):
            out = found.build(emit)
        last.replace_all_uses_with(out)
        for n in found.nodes:  # the output first: each is unused once those after it are gone
            g.erase_node(n)
