"""A stage's backward in two parts: B (input gradients, now) and W (weight gradients, later).

Zero-bubble schedules (fxpar.core.schedule.zero_bubble) send a stage's input gradients upstream
as soon as they exist and fill idle slots with the weight gradients. Both come from the one
autograd graph the stage's forward built; nothing is computed twice:

- **B** (:func:`backward_inputs`) finds, for every parameter, its *boundary nodes*: the first
  nodes of the graph, walking from the parameter towards the outputs, that also lie on a path
  from a stage input (a convolution's backward node, for its weight). A hook on each boundary
  node keeps the gradient that reaches it while ``torch.autograd.backward`` computes the input
  gradients (the graph is retained).
- **W** (:meth:`WeightWork.run`) starts the engine again at each boundary node
  (``torch.autograd.graph.GradientEdge``) with the kept gradient and asks only for its
  parameters: the convolution's backward runs again for its weight alone, and the input side
  of the graph (halo exchanges, norm statistics, everything that communicates) is not
  touched: W is local. A node whose backward is one Python function for inputs and weights
  (the tiles' synchronised BatchNorm, whose input gradient needs an allreduce) keeps its weight
  gradients from its run in B and returns them in W without communicating.

Parameters are grouped by shared boundary nodes and each group is one engine call: asking for
all at once would run the input side again (conv2's boundary node leads to conv1's weight
through the activations) and count those gradients twice. Where one boundary node of a group
lies below another (a weight used twice in a row), the lower one's gradient is pinned to the
kept one during W for the same reason.

A stage none of whose inputs needs a gradient (the first stage, fed the batch) has no input
gradients: its B runs the whole backward, as without splitting, and its W has nothing left.
Parameters with a use that never meets a stage input's path get their whole gradients in B.
The idea is the one of Qi et al. (2023) and of torch.distributed.pipelining's
stage_backward_input / stage_backward_weight; this is fxpar's own, which also handles views
among the outputs and the communicating tile ops.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch.autograd.graph import GradientEdge, Node

Grads = tuple[torch.Tensor | None, ...]


def grad_node(t: torch.Tensor) -> Node | None:
    """The autograd node gradients of ``t`` arrive at: its ``grad_fn``, or a leaf's gradient
    accumulator (made on first use)."""
    if t.grad_fn is not None:
        return t.grad_fn
    if not t.requires_grad:
        return None
    return t.view_as(t).grad_fn.next_functions[0][0]  # type: ignore[union-attr]


def _consumers(roots: Sequence[Node]) -> dict[Node, list[Node]]:
    """node -> the nodes that feed it gradients (its forward consumers), over the graph below
    ``roots``."""
    out: dict[Node, list[Node]] = {}
    seen = set(roots)
    todo = deque(roots)
    while todo:
        node = todo.popleft()
        for nxt, _ in node.next_functions:
            if nxt is None:
                continue
            out.setdefault(nxt, []).append(node)
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return out


def _above(starts: Sequence[Node], consumers: dict[Node, list[Node]],
           stop: set[Node] | frozenset[Node] = frozenset()) -> tuple[set[Node], set[Node]]:
    """Nodes reached from ``starts`` towards the outputs, not passing ``stop``; and the nodes
    of ``stop`` met on the way."""
    seen, met = set(starts), set()
    todo = deque(starts)
    while todo:
        for up in consumers.get(todo.popleft(), []):
            if up in stop:
                met.add(up)
            elif up not in seen:
                seen.add(up)
                todo.append(up)
    return seen, met


@dataclass
class _Group:
    params: list[torch.Tensor]
    nodes: list[Node]
    grads: dict[Node, Grads] = field(default_factory=dict)


@dataclass
class WeightWork:
    """What W needs of one micro-batch: the boundary nodes, their kept gradients, and the
    parameters each group's engine call accumulates into."""

    groups: list[_Group]

    def run(self) -> None:
        """Compute the weight gradients into ``param.grad`` (autograd accumulates them, so
        gradient hooks fire), then drop the graph."""
        for g in self.groups:
            edges, outs = [], []
            for node in g.nodes:
                for i, x in enumerate(g.grads.get(node, ())):
                    if x is not None:
                        edges.append(GradientEdge(node, i))
                        outs.append(x)
            if not edges:
                continue
            pins = [node.register_prehook(_pin(g.grads[node]))
                    for node in g.nodes if len(g.nodes) > 1 and node in g.grads]
            try:  # into .grad by autograd itself: gradient hooks (a DP bucket's sum) fire
                torch.autograd.backward(edges, outs, retain_graph=True, inputs=g.params)
            finally:
                for h in pins:
                    h.remove()
        self.groups = []


def _pin(kept: Grads) -> Callable[[Grads], Grads]:
    """A pre-hook that makes a node see ``kept`` whatever else reaches it."""
    return lambda _incoming: kept


def backward_inputs(outputs: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None],
                    inputs: Sequence[torch.Tensor], params: Sequence[torch.Tensor]
                    ) -> tuple[list[torch.Tensor | None], WeightWork]:
    """B: the gradients of ``inputs`` (None where an input takes none) for ``outputs``
    receiving ``grads`` (None: ones, for a scalar loss), and the :class:`WeightWork` that W
    runs later for ``params``. Parameters out of reach of every input get their gradients
    here (module doc)."""
    params = [p for p in params if p.requires_grad]
    wanted = [i for i, x in enumerate(inputs) if x.requires_grad]
    result: list[torch.Tensor | None] = [None] * len(inputs)
    if not wanted:  # the whole backward now; nothing is left for W
        torch.autograd.backward(list(outputs), list(grads))
        return result, WeightWork([])
    roots = [n for n in map(grad_node, outputs) if n is not None]
    consumers = _consumers(roots)
    in_nodes = [n for n in (grad_node(inputs[i]) for i in wanted) if n is not None]
    closure, _ = _above(in_nodes, consumers)
    groups: dict[Node, _Group] = {}
    orphans: list[torch.Tensor] = []
    for p in params:
        node = grad_node(p)
        if node not in consumers:
            continue  # the outputs do not depend on it (it gets no gradient, as in one backward)
        side, met = _above([node], consumers, stop=closure)
        if not met or any(r in side for r in roots):  # some use of it never meets an input
            orphans.append(p)
            continue
        joined = {id(g): g for n in met if (g := groups.get(n)) is not None}
        group = _Group([p], sorted(met, key=id))
        for g in joined.values():
            group.params += g.params
            group.nodes = sorted(set(group.nodes) | set(g.nodes), key=id)
        for n in group.nodes:
            groups[n] = group
    work = WeightWork(list({id(g): g for g in groups.values()}.values()))
    hooks = []
    for g in work.groups:
        for node in g.nodes:
            hooks.append(node.register_prehook(
                lambda gs, node=node, g=g: g.grads.__setitem__(node, tuple(gs)) or None))
    try:  # the inputs' gradients, and the orphans' into their .grad
        torch.autograd.backward(list(outputs), list(grads), retain_graph=True,
                                inputs=[inputs[i] for i in wanted] + orphans)
    finally:
        for h in hooks:
            h.remove()
    for i in wanted:
        result[i] = inputs[i].grad
    return result, work
