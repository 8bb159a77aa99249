"""Capture: the bodies of a model's ``with torch.autocast(...)`` blocks inlined into the graph.

A ``with torch.autocast(...)`` block inside a model's forward is captured (non-strict export,
torch 2.11 to 2.14) as a higher-order op whose body is a submodule, called with the values the
block reads and returning a tuple of those it makes::

    submod_9 = self.submod_9                          # a GraphModule: the block's ops
    to_3 = torch.ops.higher_order.wrap_with_autocast(
        'cpu', torch.bfloat16, False, False, submod_9, relu, relu_1, pad)
    getitem = to_3[0]

(``wrap_with_autocast(device_type, dtype, enabled, cache_enabled, body, *args)``). fxpar's
passes read plain ATen ops (timm's EfficientViT runs its linear attention in such a block,
which no layout rule could see into), so :func:`inline_blocks` copies each body's ops into the
graph in the op's place, nested blocks too, and keeps what the block set as data: each op of
the block carries an :class:`AutocastRegion` (``enabled``, ``dtype``) that the mixed-precision
pass (fxpar.passes.precision) follows: no autocast casts inside ``enabled=False`` (EfficientViT
keeps its attention in float32 under a bf16 plan, as on one process), that dtype's casts
inside ``enabled=True``. Empty bodies (export leaves some where it splits a block around a
nested one) go with no trace.

``with torch.no_grad()`` blocks (``wrap_with_set_grad_enabled``) stay as they are (the
spatial region ends at one): inlining them would need each op's "no gradient" as well, and
detaching the block's inputs is not that: an op that returns its input itself (``y.float()``
of a float32 ``y``) passes the gradient on in the block, and export reads ``y`` after the block
from that op's output.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import fx

from fxpar.core import meta


@dataclass(frozen=True)
class AutocastRegion:
    """The node ran inside ``torch.autocast(device_type, dtype, enabled=enabled)`` in the
    model's forward (the innermost such block); nodes outside any block have no record."""

    KEY: ClassVar[str] = "fxpar.autocast"
    enabled: bool
    """False: autocast is off in the block (the op computes in its inputs' dtypes)."""
    dtype: torch.dtype
    """The compute dtype the block names (export records the device's default when the
    block does not name one)."""
    device_type: str
    """The device the block names ("cuda", "cpu"); fxpar's casts do not depend on it."""


def _autocast(n: fx.Node) -> tuple[AutocastRegion, fx.Node, tuple[Any, ...]]:
    """A ``wrap_with_autocast`` call's (what the block sets, its body's ``get_attr`` node, the
    values passed to the body)."""
    device_type, dtype, enabled, _cache, body, *args = n.args
    return AutocastRegion(bool(enabled), dtype, str(device_type)), body, tuple(args)


def _block(n: fx.Node) -> bool:
    """Whether ``n`` calls ``wrap_with_autocast``."""
    return n.op == "call_function" and isinstance(n.target, torch._ops.HigherOrderOperator) \
        and getattr(n.target, "__name__", None) == "wrap_with_autocast"


def inline_blocks(gm: fx.GraphModule) -> None:
    """Every ``wrap_with_autocast`` of ``gm.graph`` replaced by its body's ops (nested blocks
    too), as described in the module doc."""
    g = gm.graph
    todo = [n for n in g.nodes if _block(n)]
    bodies: set[str] = set()  # the submodules of the bodies inlined
    while todo:
        n = todo.pop(0)
        region, body_node, args = _autocast(n)
        body = _attr(gm, str(body_node.target))
        assert isinstance(body, fx.GraphModule)
        bodies.add(str(body_node.target))
        with g.inserting_before(n):
            outs = _copy_body(gm, body, args, region, todo)
        for user in list(n.users):
            if user.op == "call_function" and user.target is operator.getitem and \
                    isinstance(user.args[1], int):
                user.replace_all_uses_with(outs[user.args[1]])
                g.erase_node(user)
        if n.users:
            raise RuntimeError(f"{n.name}: a wrap_with_autocast result read other than by "
                               "index")
        g.erase_node(n)
        if not body_node.users:
            g.erase_node(body_node)
    for name in bodies - {str(m.target) for m in g.nodes if m.op == "get_attr"}:
        delattr(gm, name)


def _copy_body(gm: fx.GraphModule, body: fx.GraphModule, args: tuple[Any, ...],
               region: AutocastRegion, todo: list[fx.Node]) -> list[Any]:
    """``body``'s ops copied into ``gm.graph`` (at its insertion point) over ``args``; the
    values of its output tuple, each op marked with ``region`` (a nested block's ops get its
    own when it is inlined in turn). Copies of nested blocks join ``todo``; the bodies
    they call (and those of other context-manager ops) move onto ``gm``."""
    g = gm.graph
    env: dict[fx.Node, Any] = {}
    places = [p for p in body.graph.nodes if p.op == "placeholder"]
    if len(places) != len(args):
        raise RuntimeError(f"an autocast block's body takes {len(places)} values, is given "
                           f"{len(args)}")
    env.update(zip(places, args, strict=True))
    outs: list[Any] = []
    for b in body.graph.nodes:
        if b.op == "placeholder":
            continue
        if b.op == "get_attr" and isinstance(inner := _attr(body, str(b.target)),
                                             fx.GraphModule):  # a nested op's body
            name = _free_name(gm, str(b.target))
            gm.add_submodule(name, inner)
            env[b] = g.get_attr(name)
            continue
        if b.op == "output":
            res = b.args[0]
            outs = list(fx.node.map_arg(res, lambda a: env[a])) \
                if isinstance(res, (tuple, list)) else [fx.node.map_arg(res, lambda a: env[a])]
            continue
        if b.op != "call_function":
            raise RuntimeError(f"an autocast block's body holds a {b.op} node ({b.name}): fxpar "
                               "inlines only bodies of ATen ops and nested blocks")
        c = g.node_copy(b, lambda a: env[a])
        meta.put(c, region)
        env[b] = c
        if _block(c):
            todo.append(c)
    return outs


def _free_name(gm: fx.GraphModule, base: str) -> str:
    name, i = f"fxpar_{base}", 0
    while hasattr(gm, name):
        i += 1
        name = f"fxpar_{base}_{i}"
    return name


def _attr(m: torch.nn.Module, path: str) -> Any:
    for part in path.split("."):
        m = getattr(m, part)
    return m
