"""What a plan would cost, without compiling it: the planner's fast estimate (issue 20).

The model is analysed once (:func:`analyse`: traced at one sample on fake tensors, its spatial
region found on a 2-tile grid), giving for each compute node, in the order ``Plan.balance``
counts: its forward seconds per sample on the profile (``costmodel.node_seconds``: the fixed
cost per op and the roofline share), whether a spatial stage tiles it, its output bytes, the
bytes live across a cut placed before it, and the parameter bytes it is the first to read; and
for each tile grid, each windowed node's halo messages (``costmodel.halo_messages``, the middle
tile) and each attention node's messages (``attention_comm.attention_traffic``: a ring's
K and V blocks, forward and backward, their bytes sent one after another). A candidate plan is
then costed from prefix sums of these:

- stage cuts: :func:`stage_cuts` picks them with networkx over the positions where the fewest
  bytes cross (a layered DAG of (stage, position); the bottleneck stage's seconds found by
  bisection, then the cut with the least traffic among those within ``TOLERANCE`` of it, as a
  shortest path);
- seconds: the same terms as ``costmodel.stage_seconds`` (F, B = 2x compute + the same halos
  and statistics, oversubscription; a backward the schedule splits, B and W half each, as
  ``costmodel.timing``), pipeline messages on the link between the stages' first
  ranks, a ring allreduce over every rank holding a stage, the optimizer step;
- step: the timed simulator on one layout's pipeline, a spatial stage's tiles acting as one
  rank (they run together), data-parallel copies as one (they run the same);
- memory: the terms of ``memory.estimate`` (parameters, gradients and momentum; outputs kept per
  micro-batch in flight, counted on the schedule as ``memory.schedule_in_flight`` does; halos
  and received inputs).

The estimate is checked against the full cost model on compiled programs in the tests.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import accumulate

import networkx as nx
import torch
from torch import fx, nn

from fxpar.compiler.passdriver import run_passes
from fxpar.core import meta
from fxpar.core.geometry import Grid
from fxpar.core.meta import NodeCost
from fxpar.core.plan import Plan, RankMap
from fxpar.core.roles import chunks_per_copy
from fxpar.core.schedule import Action, Schedule, chain, split_keys
from fxpar.frontend.rules.opclass import BatchNorm, Norm, classify
from fxpar.frontend.trace import trace
from fxpar.passes.precision import precision
from fxpar.passes.spatial_region import SpatialLayout, spatial_region
from fxpar.passes.split_stages import compute_nodes, cut_traffic
from fxpar.perf.costmodel import (
    OPTIMIZER_PASSES,
    _components,
    node_times,
)
from fxpar.perf.memory import peak_bytes, schedule_in_flight
from fxpar.perf.profile import Profile
from fxpar.perf.simulate import SimResult, Timing, simulate
from fxpar.planner.gridterms import Halos, grid_terms

TOLERANCE = 0.05
"""Cuts whose slowest stage is within this fraction of the best are ranked by traffic."""


@dataclass
class ModelTable:
    """Per compute node of the analysed model, what :func:`evaluate` sums (module doc)."""

    gm: fx.GraphModule
    shape: tuple[int, ...]
    """The global batch's shape."""
    profile: Profile
    fixed: list[float]
    work: list[float]
    fixed_b: list[float]
    work_b: list[float]
    """The backward's fixed and per-sample seconds (``costmodel.node_times``)."""
    tiled: list[bool]
    norm: list[bool]
    saved: list[int]
    params: list[int]
    traffic: list[int]
    positions: list[int]
    """Cut positions worth trying: 0, the local minima of ``traffic``, n."""
    halos: dict[tuple[int, ...], Halos | None] = field(default_factory=dict)
    sums: dict[tuple[int, ...] | None, _Sums] = field(default_factory=dict)
    schedules: dict[tuple[int, int, str, bool, int, bool, int], Schedule] = \
        field(default_factory=dict)
    cuts: dict[tuple[int, int, tuple[int, ...] | None, int], tuple[int, ...] | None] = \
        field(default_factory=dict)

    @property
    def size(self) -> int:
        return len(self.fixed)

    @property
    def ndim(self) -> int:
        return len(self.shape) - 2

    def prefix(self, grid: Grid | None) -> _Sums | None:
        """Prefix sums of the columns for ``grid`` (None: no tiles); None when its tiles are
        too small."""
        key = grid.parts if grid is not None else None
        if key not in self.sums:
            halos = self.halo(grid) if grid is not None else None
            if grid is not None and halos is None:
                return None
            self.sums[key] = _Sums(self, halos, grid.size if grid is not None else 1)
        return self.sums[key]

    def halo(self, grid: Grid) -> Halos | None:
        """The halo terms of ``grid`` (None when its tiles are too small for some window)."""
        if grid.parts not in self.halos:
            self.halos[grid.parts] = grid_terms(self.gm, self.shape, self.profile, self.tiled,
                                                  self.norm, grid)
        return self.halos[grid.parts]


def analyse(model: nn.Module, shape: tuple[int, ...], profile: Profile) -> ModelTable:
    """Trace ``model`` at one sample of ``shape`` (N, C, *spatial) and tabulate its nodes."""
    one = torch.empty((1, *shape[1:]), device="meta",
                      dtype=next((p.dtype for p in model.parameters()), torch.float32))
    gm = trace(model, one)
    two = Plan(spatial_parts=2) if all(e >= 2 for e in shape[2:]) else Plan()
    gm = run_passes(gm, two, [("precision", precision), ("spatial_region", spatial_region)],
                    first=None)
    order = compute_nodes(gm)
    fixed, work, fixed_b, work_b, tiled, norm, saved = [], [], [], [], [], [], []
    for n in order:
        c = meta.find(n, NodeCost)
        is_norm = isinstance(classify(gm, n), (BatchNorm, Norm))
        f0, b0 = node_times(n, profile, 0.0, is_norm)  # linear in the share: fixed + work
        f1, b1 = node_times(n, profile, 1.0, is_norm)
        fixed.append(f0)
        work.append(f1 - f0)
        fixed_b.append(b0)
        work_b.append(b1 - b0)
        lay = meta.find(n, SpatialLayout)
        tiled.append(bool(lay is not None and lay.tiled and two.spatial))
        norm.append(is_norm)
        saved.append(c.out_bytes if c is not None else 0)
    index = {n: i for i, n in enumerate(order)}
    params = [0] * len(order)
    for n in gm.graph.nodes:
        if n.op == "get_attr" and n.users:
            first = min(index.get(u, len(order) - 1) for u in n.users)
            t = operator.attrgetter(str(n.target))(gm)
            if isinstance(t, torch.Tensor):
                params[first] += t.numel() * t.element_size()
    traffic = cut_traffic(gm, order)
    return ModelTable(gm, tuple(shape), profile, fixed, work, fixed_b, work_b, tiled, norm,
                      saved, params, traffic, cut_positions(traffic))


def cut_positions(traffic: list[int]) -> list[int]:
    """0, every position where the traffic is a local minimum (the first of a plateau: lower
    than on its left, not higher than the next different value on its right), and the end:
    where a cut costs the fewest bytes nearby."""
    n = len(traffic) - 1
    out = [0]
    for p in range(1, n):
        right = next((traffic[q] for q in range(p + 1, n + 1) if traffic[q] != traffic[p]),
                     traffic[p])
        if traffic[p] < traffic[p - 1] and traffic[p] <= right:
            out.append(p)
    out.append(n)
    return out


@dataclass(frozen=True)
class Stages:
    """A candidate's stages: bounds into the node order and seconds of one micro-batch."""

    bounds: tuple[int, ...]
    f: tuple[float, ...]
    b: tuple[float, ...]
    act: tuple[int, ...]
    """Bytes one rank of the stage keeps for backward per micro-batch."""


class _Sums:
    """Prefix sums of a table's columns for one grid (or none)."""

    def __init__(self, t: ModelTable, halos: Halos | None, parts: int) -> None:
        def pre(xs: list[float] | list[int] | tuple[float, ...] | tuple[int, ...]
                ) -> list[float]:
            return [0.0, *accumulate(float(x) for x in xs)]

        self.parts = parts
        flags = halos.tiled if halos is not None else t.tiled
        self.fixed = (pre(t.fixed), pre(t.fixed_b))  # (forward, backward)
        self.tiled = tuple(pre([w if tl else 0.0 for w, tl in zip(ws, flags, strict=True)])
                           for ws in (t.work, t.work_b))
        self.whole = tuple(pre([0.0 if tl else w for w, tl in zip(ws, flags, strict=True)])
                           for ws in (t.work, t.work_b))
        self.saved_t = pre([s if tl else 0 for s, tl in zip(t.saved, flags, strict=True)])
        self.saved_w = pre([0 if tl else s for s, tl in zip(t.saved, flags, strict=True)])
        n = t.size
        self.hfix = pre(halos.fixed if halos else [0.0] * n)
        self.hbig = pre(halos.largest if halos else [0] * n)
        self.hrecv = pre(halos.received if halos else [0] * n)
        self.ops = pre(halos.ops if halos else [0.0] * n)
        self.op_sample = pre(halos.op_per_sample if halos else [0.0] * n)
        self.params = pre(t.params)
        self.ring_fixed = tuple(pre(halos.ring_fixed[d] if halos else [0.0] * n)
                                for d in range(2))
        self.ring_bytes = tuple(pre(halos.ring_bytes[d] if halos else [0] * n)
                                for d in range(2))

    def compute(self, a: int, b: int, mb: int, spatial: bool, back: bool = False) -> float:
        """Seconds of nodes [a, b) for ``mb`` samples, forward (or ``back``ward)."""
        fixed, tiled, whole = (c[int(back)] for c in (self.fixed, self.tiled, self.whole))
        parts = self.parts if spatial else 1
        return (fixed[b] - fixed[a]) + mb * ((tiled[b] - tiled[a]) / parts
                                             + whole[b] - whole[a])

    def comm(self, a: int, b: int, mb: int, beta: float, slow: float = 1.0) -> float:
        """Halo and statistics seconds of nodes [a, b), one direction: messages, and the
        runtime's tile ops at the rank's core speed (``slow``)."""
        ops = (self.ops[b] - self.ops[a]) + mb * (self.op_sample[b] - self.op_sample[a])
        return (self.hfix[b] - self.hfix[a]) + mb * beta * (self.hbig[b] - self.hbig[a]) + \
            slow * ops

    def ring(self, a: int, b: int, mb: int, beta: float, back: bool) -> float:
        """Seconds of the attention messages of nodes [a, b), forward (or ``back``ward)."""
        fixed, nbytes = self.ring_fixed[int(back)], self.ring_bytes[int(back)]
        return fixed[b] - fixed[a] + mb * beta * (nbytes[b] - nbytes[a])

    def act(self, a: int, b: int, mb: int, spatial: bool) -> int:
        tiled = self.saved_t[b] - self.saved_t[a]
        if spatial:
            return int(mb * (tiled / self.parts + self.saved_w[b] - self.saved_w[a]
                             + self.hrecv[b] - self.hrecv[a]))
        return int(mb * (tiled + self.saved_w[b] - self.saved_w[a]))


def stage_cuts(t: ModelTable, stages: int, spatial_stages: int, grid: Grid | None,
               mb: int = 1) -> tuple[int, ...] | None:
    """Bounds (0, p_1, ..., n) of ``stages`` stages over the table's cut positions, the
    leading ``spatial_stages`` tiled on ``grid``: the smallest slowest stage (F + B of ``mb``
    samples), then the least traffic (module doc); None when there are too few positions."""
    key = (stages, spatial_stages, grid.parts if grid else None, mb)
    if key not in t.cuts:
        t.cuts[key] = _cuts(t, stages, spatial_stages, grid, mb)
    return t.cuts[key]


def _cuts(t: ModelTable, k: int, s: int, grid: Grid | None, mb: int) -> tuple[int, ...] | None:
    pos = t.positions
    m = len(pos) - 1
    if k > m:
        return None
    sums = t.prefix(grid)
    if sums is None:
        return None
    beta = t.profile.p2p_intra.beta

    def cost(j: int, a: int, b: int) -> float:
        sp = grid is not None and j < s
        c = sums.compute(pos[a], pos[b], mb, sp) + sums.compute(pos[a], pos[b], mb, sp, True)
        return c + (2 * sums.comm(pos[a], pos[b], mb, beta) if sp else 0.0)

    def reach(limit: float) -> list[int] | None:
        """Per boundary j, the furthest position j stages of at most ``limit`` reach (each
        stage at least one position, room left for the rest); None if they cannot end at m."""
        ends, a = [0], 0
        for j in range(k):
            left = k - j - 1
            b = a + 1
            if b > m - left or cost(j, a, b) > limit:
                return None
            while b < m - left and cost(j, a, b + 1) <= limit:
                b += 1
            ends.append(a := b)
        return ends if a == m else None

    def back(limit: float) -> list[int]:
        """Per boundary j, the earliest position from which the last k - j stages of at
        most ``limit`` still reach m."""
        starts, b = [m], m
        for j in range(k - 1, -1, -1):
            a = b - 1
            while a > j and cost(j, a - 1, b) <= limit:
                a -= 1
            starts.append(b := a)
        return starts[::-1]

    lo, hi = 0.0, max(cost(0, 0, m), cost(k - 1, 0, m)) + 1.0
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if reach(mid) is not None else (mid, hi)
    limit = hi * (1 + TOLERANCE)
    late, early = reach(limit), back(limit)
    assert late is not None
    g = nx.DiGraph()
    for j in range(k):
        for a in range(early[j], late[j] + 1):
            for b in range(max(a + 1, early[j + 1]), late[j + 1] + 1):
                if cost(j, a, b) > limit:
                    break
                g.add_edge((j, a), (j + 1, b), weight=t.traffic[pos[b]] if b < m else 0)
    try:
        path = nx.shortest_path(g, (0, 0), (k, m), weight="weight")
    except (nx.NetworkXNoPath, nx.NodeNotFound):
        return None
    return tuple(pos[p] for _, p in path)


def stages_of(t: ModelTable, plan: Plan, mb: int, grid: Grid | None,
              slow: float) -> Stages | None:
    """The stages of ``plan`` (cuts from :func:`stage_cuts`, or ``plan.balance``) and their
    seconds and kept bytes for micro-batches of ``mb`` samples; None if they cannot be cut."""
    s = plan.spatial_stages if grid is not None else 0
    if plan.balance is not None:
        bounds = (0, *accumulate(plan.balance))
    else:
        cut = stage_cuts(t, plan.stages, s, grid)
        if cut is None:
            return None
        bounds = cut
    sums = t.prefix(grid)
    if sums is None:
        return None
    beta = t.profile.p2p_intra.beta
    f, b, act = [], [], []
    for j in range(plan.stages):
        lo, hi = bounds[j], bounds[j + 1]
        sp = j < s
        comm = sums.comm(lo, hi, mb, beta, slow) if sp else 0.0
        ring = [sums.ring(lo, hi, mb, beta, d) if sp else 0.0 for d in (False, True)]
        f.append(slow * sums.compute(lo, hi, mb, sp) + comm + ring[0])
        b.append(slow * sums.compute(lo, hi, mb, sp, True) + comm + ring[1])
        act.append(sums.act(lo, hi, mb, sp))
    return Stages(tuple(bounds), tuple(f), tuple(b), tuple(act))


@dataclass(frozen=True)
class Estimate:
    """A plan's predicted step (seconds), bubble and peak bytes on its fullest rank."""

    plan: Plan
    step_s: float
    bubble: float
    memory: int
    stages: Stages


def evaluate(t: ModelTable, plan: Plan, exact: bool = True) -> Estimate | None:
    """The estimate of ``plan`` (module doc); None when its stages cannot be cut or its tiles
    are too small. ``exact=False``: a closed-form pipeline time instead of the simulator (for
    ranking many candidates quickly)."""
    batch = t.shape[0]
    mb = batch // plan.chunks()
    grid = Grid(*plan.tile_grid(t.ndim)) if plan.spatial else None
    world = plan.world_size
    prof = t.profile
    st = stages_of(t, plan, mb, grid, prof.slowdown(world))
    if st is None:
        return None
    k, m = plan.stages, chunks_per_copy(plan)
    size = [plan.group_size(j) for j in range(k)]
    first = [sum(size[:j]) for j in range(k)]
    layout = sum(size)
    params = [int(sum(t.params[st.bounds[j]:st.bounds[j + 1]])) for j in range(k)]
    held = {j: [j, k - 1 - j] if plan.gems and k - 1 - j != j else [j] for j in range(k)}

    def allreduce(j: int) -> float:
        g = plan.data_parallel * size[j] * (2 if plan.gems and k - 1 - j != j else 1)
        if g < 2:
            return 0.0
        span = first[j] + size[j] - 1 + (plan.data_parallel - 1) * layout
        link = prof.link(first[j], span, collective=True)
        return 2 * (g - 1) * (link.alpha + link.beta * params[j] / g)

    sync = [allreduce(j) for j in range(k)]
    step = [prof.slowdown(world) * (OPTIMIZER_PASSES * sum(params[i] for i in held[j])
                                    / prof.mem_bytes + prof.op_s) for j in range(k)]
    sent = [t.traffic[st.bounds[j + 1]] * mb // (size[j] if j < (plan.spatial_stages if grid
                                                                 else 0) else 1)
            for j in range(k)]

    def link_s(j: int, nbytes: int) -> float:
        return prof.link(first[j], first[min(j + 1, k - 1)]).seconds(nbytes)

    if exact:
        sim = _simulate(t, plan, st, sync, step, sent, link_s, held)
        makespan = sim.makespan  # the bubble over every rank: stage j has size[j] of them
        bubble = 1 - sum(size[j] * sim.busy[j] for j in range(k)) / (layout * makespan)
    else:  # the ramp: (p-1)(F+B) for GPipe and 1F1B, (p-1)(F+B-W) = (p-1)F for ZB-H1
        work = [m * sum(st.f[i] + st.b[i] for i in held[j]) for j in range(k)]
        lag = [st.f[j] + (0.0 if plan.schedule == "zero_bubble" else st.b[j]) for j in range(k)]
        ramp = sum(lag[j] + 2 * link_s(j, sent[j]) for j in range(k)) - max(lag)
        if plan.gems:
            ramp /= 2
        busiest = max(range(k), key=lambda j: work[j])
        makespan = work[busiest] + ramp + max(sum(sync[i] for i in held[j]) + step[j]
                                              for j in range(k))
        bubble = 1 - sum(work) / (k * makespan)
    memory = peak_bytes(st.act, params, sent, held, schedule_in_flight(_schedule(t, plan)),
                        plan.recompute == "always")
    return Estimate(plan, makespan, bubble, memory, st)


def _simulate(t: ModelTable, plan: Plan, st: Stages, sync: list[float], step: list[float],
              sent: list[int], link_s: Callable[[int, int], float],
              held: dict[int, list[int]]) -> SimResult:
    """One layout's pipeline in the timed simulator: stage j on rank j (its tiles and
    data-parallel copies run the same actions at the same time)."""
    k = plan.stages
    schedule = _schedule(t, plan)
    split = split_keys(schedule.values())
    recompute = plan.recompute == "always"

    def seconds(rank: int, a: Action) -> float:
        if a.kind == "F":
            return st.f[a.stage]
        if a.kind in ("B", "W"):  # a split backward: half each, B recomputes the forward
            extra = st.f[a.stage] if recompute and a.kind == "B" else 0.0
            half = a.kind == "W" or (a.copy, a.stage, a.mb) in split
            return st.b[a.stage] / (2 if half else 1) + extra
        if a.kind == "ALLREDUCE":
            return sum(sync[i] for i in held[rank])
        if a.kind == "STEP":
            return step[rank]
        return 0.0

    def transfer(send: Action, src: int, dst: int) -> float:
        j = send.stage if send.kind == "SEND_F" else send.stage - 1  # the cut it crosses
        return link_s(j, sent[j])

    groups = {j: tuple(sorted({j, k - 1 - j})) if plan.gems else (j,) for j in range(k)}
    timing = Timing(seconds, transfer, {}, _components(groups))
    return simulate(schedule, chain(k), timing=timing)


def _schedule(t: ModelTable, plan: Plan) -> Schedule:
    """The action lists of ``plan``'s pipeline, one rank per stage (cached in ``t``)."""
    summed = plan.gems or plan.data_parallel > 1 or plan.spatial
    key = (plan.stages, plan.microbatches, plan.schedule, plan.gems, plan.gems_times, summed,
           plan.stages_per_rank)
    if key not in t.schedules:
        t.schedules[key] = _reduced_schedule(*key)  # the order does not depend on seconds
    return t.schedules[key]


def _reduced_schedule(stages: int, microbatches: int, schedule: str, gems: bool,
                      gems_times: int, sync: bool, per_rank: int = 1) -> Schedule:
    """The action lists of a plan of ``stages`` ranks (no tiles, no data parallelism), with
    ALLREDUCE when the real plan sums gradients (``sync``)."""
    from fxpar.compiler.driver import rank_schedules

    plan = Plan(stages=stages, microbatches=microbatches, schedule=schedule,  # type: ignore
                gems=gems, gems_times=gems_times, stages_per_rank=per_rank)
    return rank_schedules(RankMap(plan), chain(stages), sync)


__all__ = ["ModelTable", "Estimate", "Stages", "analyse", "evaluate", "stage_cuts",
           "cut_positions"]
