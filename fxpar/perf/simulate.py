"""Run every rank's action list without MPI: find deadlocks, count time, check the rules.

Sends never block (the runtime's are nonblocking); a receive completes once its matching send
has run, no earlier than the sender's clock. F costs ``f_cost`` ticks, B ``b_cost``, the rest 0;
a backward split into B and W (zero-bubble schedules: the list has a W for it) costs half of
``b_cost`` for each; or, with ``stage_cost``, F of stage s costs ``stage_cost[s]`` and B twice
that (see
:func:`stage_costs`: forward FLOPs per rank, so a timeline shows where the real work waits).
The result says how long the step takes and how busy each rank was, so the bubble of a schedule
can be compared with the formula (p-1)/(m+p-1), and when each action ran (``spans``: what
``fxpar-inspect --timeline`` draws; a receive's span is the time its rank waited for the data).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from fxpar.core import meta
from fxpar.core.meta import NodeCost
from fxpar.core.schedule import Action, Links, Schedule, ScheduleError, split_keys
from fxpar.passes.spatial_region import SpatialLayout
from fxpar.passes.split_stages import StageAssignment, compute_nodes

if TYPE_CHECKING:
    from fxpar.program.program import Program

_MATCH = {"RECV_F": "SEND_F", "RECV_B": "SEND_B"}


@dataclass(frozen=True)
class StageSeconds:
    """One chunk (micro-batch) through one rank of a stage: forward and backward seconds, and
    the communication inside them (halos, statistics, attention over the tiles) for the
    record."""

    f: float
    b: float
    comm_f: float = 0.0
    comm_b: float = 0.0
    sent_f: int = 0
    """Bytes the rank's messages inside F carry: halo pieces, ring attention's blocks, the
    buffers of attention's allreduces (norm statistics are not counted)."""
    sent_b: int = 0
    """The same inside B (ring attention's backward also sends every block's dK and dV)."""


@dataclass(frozen=True)
class Timing:
    """What the simulator asks: seconds of an action on a rank, and when a message sent by
    action ``send`` on rank ``src`` arrives on rank ``dst`` (after the send)."""

    seconds: Callable[[int, Action], float]
    transfer: Callable[[Action, int, int], float]
    stages: dict[int, StageSeconds]
    allreduce: dict[int, tuple[int, ...]]
    """rank -> the ranks whose ALLREDUCE is one collective with its own."""


@dataclass(frozen=True)
class Span:
    """When one action of a rank ran in the simulation: ``[start, end)``."""

    action: Action
    start: float
    end: float


@dataclass(frozen=True)
class SimResult:
    makespan: float
    busy: dict[int, float]
    spans: dict[int, list[Span]] = field(default_factory=dict)
    """Per rank, one span per action, in the rank's order."""

    @property
    def bubble(self) -> float:
        """Idle fraction over all ranks: 1 - busy / (ranks x makespan)."""
        return 1.0 - sum(self.busy.values()) / (len(self.busy) * self.makespan)


def _senders(links: Links) -> dict[int, set[int]]:
    return {s: {a for a, dsts in links.items() if s in dsts} for s in links}


Together = Mapping[tuple[int, int, int], Sequence[int]]
"""(rank, copy, stage) -> the ranks whose F and B of that stage and copy are one collective
(the tiles of a spatial stage: halo exchanges, BatchNorm and mean allreduces), as
``RankMap.tile_groups`` gives. Such an action runs on all of them at once, when each has it
next."""


def simulate(schedule: Schedule, links: Links, f_cost: float = 1.0,
             b_cost: float = 2.0, stage_cost: Mapping[int, float] | None = None,
             together: Together | None = None, timing: Timing | None = None) -> SimResult:
    """Execute ``schedule``; raise ScheduleError on deadlock.

    stage_cost: F cost per stage (B costs twice as much), instead of ``f_cost``/``b_cost``.
    together: tile groups (``RankMap.tile_groups``): their F and B start at once on every
    tile, when all have reached it. timing: seconds from a cost model
    (fxpar.perf.costmodel.timing) instead of ticks: F, B, ALLREDUCE (one collective over
    ``timing.allreduce``'s ranks) and STEP take ``timing.seconds``, a message arrives
    ``timing.transfer`` after its send."""
    together = together or {}
    senders = _senders(links)
    split = split_keys(schedule.values())
    sent: dict[Action, float] = {}  # (kind, stage, mb, copy) of a send -> time it ran
    source: dict[Action, int] = {}  # ... and the rank that sent it last
    clock = {r: 0.0 for r in schedule}
    busy = {r: 0.0 for r in schedule}
    spans: dict[int, list[Span]] = {r: [] for r in schedule}
    pc = {r: 0 for r in schedule}
    progress = True
    while progress:
        progress = False
        for r, acts in schedule.items():
            while pc[r] < len(acts):
                a = acts[pc[r]]
                start = clock[r]
                if a.kind in _MATCH:
                    peers = senders.get(a.stage, set()) if a.kind == "RECV_F" else \
                        links.get(a.stage, set())
                    keys = [Action(_MATCH[a.kind], p, a.mb, a.copy) for p in peers]
                    if not all(k in sent for k in keys):
                        break
                    clock[r] = max([clock[r], *(sent[k] + (timing.transfer(k, source[k], r)
                                                           if timing else 0.0)
                                                for k in keys)])
                elif a.kind in ("SEND_F", "SEND_B"):
                    sent[a] = max(sent.get(a, 0.0), clock[r])
                    source[a] = r
                elif a.kind == "W":
                    cost = _cost(a, r, timing, stage_cost, f_cost, b_cost, split)
                    clock[r] += cost
                    busy[r] += cost
                    spans[r].append(Span(a, start, clock[r]))
                    pc[r] += 1
                    progress = True
                    continue
                elif a.kind in ("F", "B") or (timing is not None and
                                              a.kind in ("ALLREDUCE", "STEP")):
                    if a.kind in ("F", "B"):
                        tiles = together.get((r, a.copy, a.stage), (r,))
                    elif a.kind == "ALLREDUCE":
                        assert timing is not None
                        tiles = timing.allreduce.get(r, (r,))
                    else:
                        tiles = (r,)
                    if any(schedule[m][pc[m]:pc[m] + 1] != [a] for m in tiles):
                        break  # a collective: every tile must have reached it
                    start = max(clock[m] for m in tiles)
                    costs = {m: _cost(a, m, timing, stage_cost, f_cost, b_cost, split)
                             for m in tiles}
                    end = start + max(costs.values())  # a collective ends for all at once
                    for m in tiles:
                        clock[m] = end
                        busy[m] += costs[m]
                        spans[m].append(Span(a, start, end))
                        pc[m] += 1
                    progress = True
                    continue
                spans[r].append(Span(a, start, clock[r]))
                pc[r] += 1
                progress = True
    stuck = {r: str(acts[pc[r]]) for r, acts in schedule.items() if pc[r] < len(acts)}
    if stuck:
        raise ScheduleError(f"deadlock: ranks wait forever at {stuck}")
    return SimResult(max(clock.values()), busy, spans)


def _cost(a: Action, rank: int, timing: Timing | None, stage_cost: Mapping[int, float] | None,
          f_cost: float, b_cost: float, split: frozenset[tuple[int, int, int]] = frozenset()
          ) -> float:
    if timing is not None:
        return timing.seconds(rank, a)
    half = a.kind == "W" or (a.kind == "B" and (a.copy, a.stage, a.mb) in split)
    if stage_cost is not None:
        return stage_cost[a.stage] * (1.0 if a.kind == "F" else 1.0 if half else 2.0)
    return f_cost if a.kind == "F" else b_cost / 2 if half else b_cost


def stage_costs(program: Program) -> dict[int, float]:
    """Forward FLOPs of one micro-batch of each stage, as one rank of it runs them: the sum of
    its nodes' ``NodeCost.flops``, where a tiled node of a spatial stage counts 1/P (each of
    the P tiles does that share). Feed to ``simulate(..., stage_cost=...)``."""
    gm = program.traced
    if gm is None:
        raise ValueError("the program has no analysed graph (compile it with fxpar.compile)")
    plan = program.plan
    out = {s: 0.0 for s in range(plan.stages)}
    for n in compute_nodes(gm):
        s = meta.get(n, StageAssignment).stage
        c = meta.find(n, NodeCost)
        lay = meta.find(n, SpatialLayout)
        if c is not None:
            out[s] += c.flops / (plan.group_size(s) if lay is not None and lay.tiled else 1)
    return out


def validate(schedule: Schedule, links: Links) -> None:
    """Check the rules: each (copy, stage, mb) has one F and one B on one rank, F before B,
    and every send is matched by a receive (and the reverse)."""
    owner: dict[tuple[int, int], int] = {}
    counts: Counter[Action] = Counter()
    for r, acts in schedule.items():
        done_f: set[tuple[int, int, int]] = set()
        done_b: set[tuple[int, int, int]] = set()
        for a in acts:
            counts[a] += 1
            if a.kind == "B":
                done_b.add((a.copy, a.stage, a.mb))
            if a.kind == "W" and (a.copy, a.stage, a.mb) not in done_b:
                raise ScheduleError(f"rank {r}: {a} comes before its input-gradient pass "
                                    f"{a._replace(kind='B')} (or that runs on another rank)")
            if a.kind in ("F", "B"):
                key = (a.copy, a.stage)
                if owner.setdefault(key, r) != r:
                    raise ScheduleError(f"stage {a.stage} (copy {a.copy}) runs on ranks "
                                        f"{owner[key]} and {r}")
            if a.kind == "F":
                done_f.add((a.copy, a.stage, a.mb))
            if a.kind == "B" and (a.copy, a.stage, a.mb) not in done_f:
                raise ScheduleError(f"rank {r}: {a} comes before its forward")
    for a, n in counts.items():
        if a.kind in ("F", "B", "W") and n != 1:
            raise ScheduleError(f"{a} appears {n} times")
    fs = {(a.copy, a.stage, a.mb) for a in counts if a.kind == "F"}
    bs = {(a.copy, a.stage, a.mb) for a in counts if a.kind == "B"}
    if fs != bs:
        raise ScheduleError(f"forwards without backwards (or the reverse): {sorted(fs ^ bs)}")
    senders = _senders(links)
    for a in counts:
        if a.kind == "SEND_F":
            for dst in links.get(a.stage, set()):
                if Action("RECV_F", dst, a.mb, a.copy) not in counts:
                    raise ScheduleError(f"{a} has no matching {dst}RECV_F{a.mb}")
        if a.kind == "RECV_F":
            for src in senders.get(a.stage, set()):
                if Action("SEND_F", src, a.mb, a.copy) not in counts:
                    raise ScheduleError(f"{a} has no matching {src}SEND_F{a.mb}")
        if a.kind == "SEND_B":
            for src in senders.get(a.stage, set()):
                if Action("RECV_B", src, a.mb, a.copy) not in counts:
                    raise ScheduleError(f"{a} has no matching {src}RECV_B{a.mb}")


def interleave(queues: dict[int, list[list[Action]]], links: Links, f_cost: float = 1.0,
               b_cost: float = 2.0, together: Together | None = None) -> Schedule:
    """Merge each rank's several action lists (GEMS: one per model copy) into one order by list
    scheduling: each rank runs, of its lists' next actions, the one that can start earliest.
    The result comes with a deadlock-free execution as witness (this simulation).

    together: tile groups (see ``Together``); ranks that share two of them (GEMS with spatial
    parts) then meet their peers in each in one order."""
    senders = _senders(links)
    split = split_keys(q for qs in queues.values() for q in qs)
    sent: dict[Action, float] = {}
    clock = {r: 0.0 for r in queues}
    pcs = {r: [0] * len(qs) for r, qs in queues.items()}
    out: dict[int, list[Action]] = {r: [] for r in queues}
    together = together or {}
    index = {(r, a.copy, a.stage): i for r, qs in queues.items()
             for i, q in enumerate(qs) for a in q}

    def group(r: int, i: int, a: Action) -> list[tuple[int, int]]:
        """(rank, list index) of every rank that runs ``a`` together with ``r``."""
        ranks = together.get((r, a.copy, a.stage), (r,)) if a.kind in ("F", "B") else (r,)
        return [(m, index[(m, a.copy, a.stage)]) if m != r else (r, i) for m in ranks]

    def ready(r: int, i: int, a: Action) -> float | None:
        if a.kind in ("F", "B"):
            slots = group(r, i, a)
            if any(queues[m][j][pcs[m][j]:pcs[m][j] + 1] != [a] for m, j in slots):
                return None  # a tile of the group is not there yet
            return max(clock[m] for m, _ in slots)
        if a.kind not in _MATCH:
            return clock[r]
        peers = senders.get(a.stage, set()) if a.kind == "RECV_F" else links.get(a.stage, set())
        keys = [Action(_MATCH[a.kind], p, a.mb, a.copy) for p in peers]
        if not all(k in sent for k in keys):
            return None
        return max([clock[r], *(sent[k] for k in keys)])

    remaining = sum(len(q) for qs in queues.values() for q in qs)
    while remaining:
        progress = False
        for r, qs in queues.items():
            options = [(t, i) for i, q in enumerate(qs) if pcs[r][i] < len(q)
                       if (t := ready(r, i, q[pcs[r][i]])) is not None]
            if not options:
                continue
            # a send never waits and its receiver may: on a tie it goes first (a send put
            # behind another list's actions can leave a peer tile's receive waiting forever)
            t, _, i = min((t, not qs[i][pcs[r][i]].kind.startswith("SEND"), i)
                          for t, i in options)
            a = qs[i][pcs[r][i]]
            for m, j in group(r, i, a):
                clock[m] = t
                if a.kind in ("SEND_F", "SEND_B"):
                    sent[a] = clock[m]
                elif a.kind in ("F", "B", "W"):
                    clock[m] += _cost(a, m, None, None, f_cost, b_cost, split)
                out[m].append(a)
                pcs[m][j] += 1
                remaining -= 1
            progress = True
        if not progress:
            stuck = {r: [str(q[pcs[r][i]]) for i, q in enumerate(qs) if pcs[r][i] < len(q)]
                     for r, qs in queues.items()}
            raise ScheduleError(f"deadlock while merging copies: ranks wait at {stuck}")
    return out
