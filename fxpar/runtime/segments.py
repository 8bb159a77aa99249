"""Checkpoint segments inside a stage (``Plan(recompute_segments=k)``): keep only k boundaries.

Stage-level recompute (fxpar.runtime.recompute) helps when a rank holds activations of several
micro-batches; with one large image per step a stage still holds all of its activations while
its backward runs. Cutting the stage's graph into k segments of about equal activation bytes and
running each under ``torch.utils.checkpoint`` (non-reentrant) keeps, during the forward, only
each segment's inputs; in the backward each segment runs again right before its own backward,
so at most one segment's activations live at a time (Chen et al.'s sqrt(n) checkpointing:
k ~ sqrt(layers) minimises the peak).

The recomputation must not talk to other ranks a second time: ``checkpoint``'s ``context_fn``
gives one context for the first forward and one for the recomputation, and they are the stage
recompute's :func:`recording` and :func:`replaying` (halo pieces, statistics and joins come
from the record; the random number generator is replayed, so dropout draws the same mask).
BatchNorm's running statistics are updated again by the recomputation: the runtime puts the
stage's buffers back after its backward, as for stage recompute.

A segment must not mutate its own inputs, or its recomputation would start from the written
values (torch.export's graphs keep ``relu_`` / ``add_``; a stage input can be written by the
stage's first node). A cut is only placed where no tensor made before it is written in place
after it; a stage input that a segment writes is cloned inside the checkpointed function and
the written clone is what later nodes read.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx
from torch.utils.checkpoint import checkpoint

from fxpar.core import meta
from fxpar.core.meta import NodeCost
from fxpar.runtime.recompute import Record, recording, replaying


def writes_in_place(gm: fx.GraphModule, n: fx.Node) -> bool:
    """True when ``n`` writes its first argument in place (``aten.relu_``, ``inplace=True``)."""
    if n.op == "call_module":
        return bool(getattr(gm.get_submodule(str(n.target)), "inplace", False))
    if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload):
        first = n.target._schema.arguments[:1]  # aten.relu_: its first argument is written
        return bool(first) and first[0].alias_info is not None and first[0].alias_info.is_write
    if n.op == "call_function":
        return bool(n.kwargs.get("inplace", False))
    return n.op == "call_method" and str(n.target).endswith("_") and \
        not str(n.target).startswith("_")


@dataclass(frozen=True)
class Segment:
    """Consecutive nodes of a stage graph, what they read from before and what later nodes
    (or the stage's output) read from them."""

    nodes: tuple[fx.Node, ...]
    inputs: tuple[fx.Node, ...]
    outputs: tuple[fx.Node, ...]
    written: tuple[int, ...] = ()  # positions in ``inputs`` the segment writes in place


def _cost(n: fx.Node) -> int:
    """What a node's output weighs in the forward (its bytes; halo and tile ops: 1)."""
    c = meta.find(n, NodeCost)
    return max(c.out_bytes if c is not None else 0, 1)


def cut(gm: fx.GraphModule, k: int) -> list[Segment]:
    """``gm``'s computing nodes in at most ``k`` segments of about equal activation bytes, cut
    only where no tensor crossing the cut is written in place later."""
    body = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output", "get_attr")]
    index = {n: i for i, n in enumerate(body)}
    last_write: dict[fx.Node, int] = {}
    for i, n in enumerate(body):
        if writes_in_place(gm, n) and n.args and isinstance(n.args[0], fx.Node):
            last_write[n.args[0]] = i
    total = sum(_cost(n) for n in body)
    cuts, acc, target = [], 0, total / k
    for i, n in enumerate(body[:-1]):
        acc += _cost(n)
        if len(cuts) == k - 1 or acc < target * (len(cuts) + 1):
            continue
        # a tensor made up to here and written after here crosses the cut (its writer reads it)
        if any(index[a] <= i < w for a, w in last_write.items() if a in index):
            continue
        cuts.append(i + 1)
    bounds = [0, *cuts, len(body)]
    out = gm.graph.output_node()
    segments = []
    for lo, hi in zip(bounds, bounds[1:], strict=False):
        nodes = body[lo:hi]
        inside = set(nodes)
        inputs = list(dict.fromkeys(a for n in nodes for a in n.all_input_nodes
                                    if a not in inside and a.op != "get_attr"))
        outputs = [n for n in nodes if any(u is out or index.get(u, -1) >= hi for u in n.users)]
        writes = {n.args[0] for n in nodes if writes_in_place(gm, n) and n.args}
        written = tuple(i for i, a in enumerate(inputs) if a in writes)
        segments.append(Segment(tuple(nodes), tuple(inputs), tuple(outputs), written))
    return segments


class Segmented:
    """Runs stage module ``gm`` as :func:`cut`'s segments, each under ``torch.utils.checkpoint``
    with its exchanges recorded and replayed (the module doc)."""

    def __init__(self, gm: fx.GraphModule, k: int, device: torch.device) -> None:
        self.gm, self.device = gm, device
        self.segments = cut(gm, k)
        self.placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]

    def __call__(self, *args: Any) -> Any:
        env: dict[fx.Node, Any] = dict(zip(self.placeholders, args, strict=True))
        for seg in self.segments:
            outs = checkpoint(self._run, seg, *[env[a] for a in seg.inputs],
                              use_reentrant=False, context_fn=self._contexts)
            env.update(zip(seg.outputs + tuple(seg.inputs[i] for i in seg.written), outs,
                           strict=True))
        out = self.gm.graph.output_node()
        return fx.node.map_arg(out.args[0], lambda n: env[n])

    def _run(self, seg: Segment, *ins: Any) -> tuple[Any, ...]:
        runner = fx.Interpreter(self.gm)
        ins = tuple(x.clone() if i in seg.written else x for i, x in enumerate(ins))
        runner.env = dict(zip(seg.inputs, ins, strict=True))
        for n in seg.nodes:
            for a in n.all_input_nodes:
                if a.op == "get_attr" and a not in runner.env:
                    runner.env[a] = runner.run_node(a)
            runner.env[n] = runner.run_node(n)
        return tuple(runner.env[n] for n in seg.outputs) + tuple(ins[i] for i in seg.written)

    def _contexts(self) -> tuple[Any, Any]:
        """``checkpoint``'s context_fn: record the first forward's exchanges, replay them."""
        held: list[Record] = []

        @contextmanager
        def first() -> Iterator[None]:
            with recording(self.device) as rec:
                held.append(rec)
                yield

        @contextmanager
        def again() -> Iterator[None]:
            with replaying(held[0]):
                yield

        return first(), again()


def segmented(cache: dict[int, Segmented], gm: fx.GraphModule, k: int,
              device: torch.device) -> Callable[..., Any]:
    """``gm``'s :class:`Segmented` runner (made once per module)."""
    if id(gm) not in cache:
        cache[id(gm)] = Segmented(gm, k, device)
    return cache[id(gm)]
