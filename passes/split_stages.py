"""Pass: cut the graph into ``plan.stages`` contiguous pieces of a topological order.

Every compute node gets a :class:`StageAssignment`. Cuts are chosen on the graph's own
(topological) node order, so every edge goes forward: a tensor made in stage a and used in
stage b > a is sent from a to b directly, however many cuts it crosses (U-Net skips, DenseNet
concatenations). Before (stages=2)::

    conv1 -> bn1 -> relu -> layer1 ... -> fc -> output

after: the same graph, ``node.meta["fxpar.stage"] = StageAssignment(0 | 1)`` on every node, and
a ``model_output`` node in front of ``output`` so the last stage builds the model's output even
when part of it was computed earlier.

Policy (when ``plan.balance`` is None): each node costs ``3 * forward FLOPs`` (forward plus a
backward of about twice that) plus ``BYTE_COST`` per output byte (memory-bound ops such as
BatchNorm and ReLU have no FLOPs but are not free); in a spatial stage a tiled node costs 1/P
of that. The cuts minimise the most expensive stage; among cuts within ``TOLERANCE`` of that
optimum, the one with the fewest bytes live across the cut wins (see ``choose_cuts``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import networkx as nx
from torch import fx

from fxpar.core import meta
from fxpar.core.meta import NodeCost, TensorInfo
from fxpar.core.plan import Plan, PlanError

BYTE_COST = 8.0
TOLERANCE = 0.08
_SKIP = ("placeholder", "output", "get_attr")


@dataclass(frozen=True)
class StageAssignment:
    """The stage a node runs in."""

    KEY: ClassVar[str] = "fxpar.stage"
    stage: int


def model_output(value: Any) -> Any:
    """Identity; marks the model's output so that the last stage assembles it."""
    return value


def compute_nodes(gm: fx.GraphModule) -> list[fx.Node]:
    """Nodes that do work, in graph (topological) order; what ``Plan.balance`` counts."""
    return [n for n in gm.graph.nodes if n.op not in _SKIP and n.target is not model_output]


def node_cost(n: fx.Node, parts: int = 1) -> float:
    """Estimated forward+backward cost; a node that runs on ``parts`` tiles costs 1/parts."""
    c = meta.find(n, NodeCost)
    if c is None:
        return 0.0
    lay = n.meta.get("fxpar.spatial")
    share = parts if lay is not None and lay.tiled else 1
    return (3.0 * c.flops + BYTE_COST * c.out_bytes) / share


def dataflow(gm: fx.GraphModule) -> nx.DiGraph:
    """The graph as networkx data: nodes carry ``cost`` and ``bytes``, edges go producer->user."""
    g = nx.DiGraph()
    for n in gm.graph.nodes:
        c = meta.find(n, NodeCost)
        g.add_node(n, cost=node_cost(n), bytes=0 if c is None else c.out_bytes)
        for user in n.users:
            g.add_edge(n, user)
    return g


def cut_traffic(gm: fx.GraphModule, order: list[fx.Node]) -> list[int]:
    """``traffic[p]``: bytes live across a cut placed before ``order[p]`` (model inputs and
    constants excluded: every rank has those)."""
    g = dataflow(gm)
    pos = {n: i for i, n in enumerate(order)}
    last = len(order)
    delta = [0] * (len(order) + 2)
    for n in order:
        users = [pos.get(u, last) for u in g.successors(n)]  # the output node counts as last
        if users:
            delta[pos[n] + 1] += g.nodes[n]["bytes"]
            delta[max(users) + 1] -= g.nodes[n]["bytes"]
    traffic, running = [], 0
    for p in range(len(order) + 1):
        running += delta[p]
        traffic.append(running)
    return traffic


def choose_cuts(costs: list[float], traffic: list[int], stages: int,
                spatial_costs: list[float] | None = None, spatial_stages: int = 0) -> list[int]:
    """Positions p_1 < ... < p_{S-1} (stage k is ``order[p_k:p_{k+1}]``).

    The leading ``spatial_stages`` stages are costed with ``spatial_costs`` (their work is
    shared by the tiles). First the smallest bottleneck T (the most expensive stage) is found
    by bisection with greedy packing; then each cut is placed, among positions whose stage
    cost lies within ``TOLERANCE`` of T and that leave a feasible packing for the rest, where
    the fewest bytes cross."""
    n = len(costs)
    sc = spatial_costs if spatial_costs is not None else costs
    pre = [0.0]
    spre = [0.0]
    for c, d in zip(costs, sc, strict=True):
        pre.append(pre[-1] + c)
        spre.append(spre[-1] + d)

    def cost(k: int, a: int, b: int) -> float:
        return (spre[b] - spre[a]) if k < spatial_stages else (pre[b] - pre[a])

    def packs(k: int, start: int, limit: float) -> bool:
        """Can nodes [start, n) go into stages k..S-1, each non-empty and <= limit?"""
        for stage in range(k, stages):
            left = stages - stage - 1
            end = start + 1
            if end > n - left:
                return False
            while end < n - left and cost(stage, start, end + 1) <= limit:
                end += 1
            if cost(stage, start, end) > limit:
                return False
            start = end
        return start == n

    lo, hi = 0.0, max(pre[n], spre[n]) + 1.0
    for _ in range(50):
        mid = (lo + hi) / 2
        if packs(0, 0, mid):
            hi = mid
        else:
            lo = mid
    limit = hi * (1 + TOLERANCE)
    cuts: list[int] = []
    start = 0
    for k in range(stages - 1):
        ends = [p for p in range(start + 1, n - (stages - k - 1) + 1)
                if cost(k, start, p) <= limit and packs(k + 1, p, limit)]
        near = [p for p in ends if cost(k, start, p) >= hi * (1 - TOLERANCE)] or ends
        best = min(near, key=lambda p: (traffic[p], abs(cost(k, start, p) - hi)))
        cuts.append(best)
        start = best
    return cuts


def split_stages(gm: fx.GraphModule, plan: Plan) -> fx.GraphModule:
    """Assign every node of ``gm`` (analysed) to one of ``plan.stages`` stages."""
    order = compute_nodes(gm)
    s = plan.stages
    if s > len(order):
        raise PlanError(f"Plan.stages={s} but the model has only {len(order)} compute nodes: "
                        f"use at most {len(order)} stages")
    if plan.balance is not None:
        if sum(plan.balance) != len(order):
            raise PlanError(
                f"Plan.balance={plan.balance} sums to {sum(plan.balance)} but the model has "
                f"{len(order)} compute nodes (the nodes `fxpar-inspect MODEL` lists, without "
                f"placeholders, get_attr and output): make it sum to {len(order)}")
        cuts = [sum(plan.balance[:k]) for k in range(1, s)]
    else:
        costs = [node_cost(n) for n in order]
        shared = [node_cost(n, plan.spatial_parts) for n in order] if plan.spatial else None
        cuts = choose_cuts(costs, cut_traffic(gm, order), s, shared,
                           plan.spatial_stages if plan.spatial else 0)
    cuts = _outside_islands(gm, order, cuts, plan)
    bounds = [0, *cuts, len(order)]
    for k in range(s):
        for n in order[bounds[k]:bounds[k + 1]]:
            meta.put(n, StageAssignment(k))
    first_use = {n: min((meta.get(u, StageAssignment).stage for u in n.users
                         if meta.find(u, StageAssignment)), default=0)
                 for n in gm.graph.nodes if n.op in ("placeholder", "get_attr")}
    for n, stage in first_use.items():
        meta.put(n, StageAssignment(stage if n.op == "get_attr" else 0))
    _mark_output(gm, s - 1)
    for n in gm.graph.nodes:
        if n.op == "get_attr":
            used = {meta.get(u, StageAssignment).stage for u in n.users}
            if len(used) > 1 and _is_parameter(gm, str(n.target)):
                raise PlanError(f"parameter {n.target} is used in stages {sorted(used)}; "
                                f"parameters shared across stages are not supported: set "
                                f"Plan.balance so all its uses fall in one stage")
            if len(used) > 1:
                raise PlanError(f"{n.target!r} is used by stages {sorted(used)}; a tensor "
                                f"attribute shared across stages is not supported: change the "
                                f"cut with Plan.balance")
    _check_no_shared_modules(gm)
    return gm


def _outside_islands(gm: fx.GraphModule, order: list[fx.Node], cuts: list[int],
                     plan: Plan) -> list[int]:
    """Cuts moved past any per-pixel island they would split (its tiles, with H and W outside
    dims 2 and 3, cannot cross between stages), and past the ``getitem`` s of an op with
    several outputs (``x.max(dim=1)``: a stage sends tensors, not tuples): an explicit balance
    that splits one is an error."""
    index = {n: i for i, n in enumerate(order)}
    spans = [(i, max((index.get(u, len(order)) for u in n.users), default=i))
             for i, n in enumerate(order)
             if getattr(n.meta.get("fxpar.spatial"), "island", False) or _several(n)]
    out: list[int] = []
    for p in cuts:
        q = p  # the stage after the cut starts at order[q]: no island value may cross it
        while q < len(order) and any(i < q <= end for i, end in spans):
            q += 1
        if q != p and plan.balance is not None:
            raise PlanError(f"Plan.balance={plan.balance} cuts the model inside a per-pixel "
                            f"block (ConvNeXt's permute .. permute, ResNeSt's split attention, "
                            f"an op with several outputs and its getitems) at node "
                            f"{order[p].name!r}, whose tiles cannot cross stages: move that cut "
                            f"by {q - p} node(s)")
        if out and q <= out[-1] or q >= len(order):
            raise PlanError(f"stages={plan.stages}: cannot place the cuts outside the model's "
                            f"per-pixel blocks; use fewer stages or an explicit balance")
        out.append(q)
    return out


def _several(n: fx.Node) -> bool:
    """Does ``n`` have several tensor outputs (read through ``getitem``)?"""
    info = meta.find(n, TensorInfo)
    return info is not None and len(info.shapes) > 1


def _is_parameter(gm: fx.GraphModule, target: str) -> bool:
    try:
        gm.get_parameter(target)
    except AttributeError:
        return False
    return True


def _mark_output(gm: fx.GraphModule, last: int) -> None:
    out = next(n for n in gm.graph.nodes if n.op == "output")
    if out.args and isinstance(out.args[0], fx.Node) and out.args[0].target is model_output:
        return
    with gm.graph.inserting_before(out):
        packed = gm.graph.call_function(model_output, (out.args[0],))
    out.args = (packed,)
    meta.put(packed, StageAssignment(last))


def _check_no_shared_modules(gm: fx.GraphModule) -> None:
    """A module whose parameters or buffers are used in two stages would train as two."""
    where: dict[int, tuple[str, int]] = {}
    for n in gm.graph.nodes:
        if n.op != "call_module":
            continue
        stage = meta.get(n, StageAssignment).stage
        mod = gm.get_submodule(str(n.target))
        for pname, p in [*mod.named_parameters(), *mod.named_buffers()]:
            seen = where.setdefault(id(p), (f"{n.target}.{pname}", stage))
            if seen[1] != stage:
                raise PlanError(f"parameter {seen[0]} is used in stages {seen[1]} and {stage}; "
                                f"parameters shared across stages are not supported: set "
                                f"Plan.balance so both uses fall in one stage")
