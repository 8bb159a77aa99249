"""Run every rank's action list without MPI: find deadlocks, count time, check the rules.

Sends never block (the runtime's are nonblocking); a receive completes once its matching send
has run, no earlier than the sender's clock. F costs ``f_cost`` ticks, B ``b_cost``, the rest 0;
or, with ``stage_cost``, F of stage s costs ``stage_cost[s]`` and B twice that (see
:func:`stage_costs`: forward FLOPs per rank, so a timeline shows where the real work waits).
The result says how long the step takes and how busy each rank was, so the bubble of a schedule
can be compared with the formula (p-1)/(m+p-1), and when each action ran (``spans``: what
``fxpar-inspect --timeline`` draws; a receive's span is the time its rank waited for the data).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from fxpar import meta
from fxpar.meta import NodeCost
from fxpar.schedule import Action, Links, Schedule
from passes.spatial_region import SpatialLayout
from passes.split_stages import StageAssignment, compute_nodes

if TYPE_CHECKING:
    from fxpar.program import Program

_MATCH = {"RECV_F": "SEND_F", "RECV_B": "SEND_B"}


class ScheduleError(RuntimeError):
    """A schedule that breaks a rule or deadlocks; the message names the actions."""


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


def simulate(schedule: Schedule, links: Links, f_cost: float = 1.0,
             b_cost: float = 2.0, stage_cost: Mapping[int, float] | None = None) -> SimResult:
    """Execute ``schedule``; raise ScheduleError on deadlock.

    stage_cost: F cost per stage (B costs twice as much), instead of ``f_cost``/``b_cost``."""
    senders = _senders(links)
    sent: dict[Action, float] = {}  # (kind, stage, mb, copy) of a send -> time it ran
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
                    clock[r] = max([clock[r], *(sent[k] for k in keys)])
                elif a.kind in ("SEND_F", "SEND_B"):
                    sent[a] = clock[r]
                elif a.kind in ("F", "B"):
                    if stage_cost is not None:
                        cost = stage_cost[a.stage] * (1.0 if a.kind == "F" else 2.0)
                    else:
                        cost = f_cost if a.kind == "F" else b_cost
                    clock[r] += cost
                    busy[r] += cost
                spans[r].append(Span(a, start, clock[r]))
                pc[r] += 1
                progress = True
    stuck = {r: str(acts[pc[r]]) for r, acts in schedule.items() if pc[r] < len(acts)}
    if stuck:
        raise ScheduleError(f"deadlock: ranks wait forever at {stuck}")
    return SimResult(max(clock.values()), busy, spans)


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
        for a in acts:
            counts[a] += 1
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
        if a.kind in ("F", "B") and n != 1:
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
               b_cost: float = 2.0) -> Schedule:
    """Merge each rank's several action lists (GEMS: one per model copy) into one order by list
    scheduling: each rank runs, of its lists' next actions, the one that can start earliest.
    The result comes with a deadlock-free execution as witness (this simulation)."""
    senders = _senders(links)
    sent: dict[Action, float] = {}
    clock = {r: 0.0 for r in queues}
    pcs = {r: [0] * len(qs) for r, qs in queues.items()}
    out: dict[int, list[Action]] = {r: [] for r in queues}

    def ready(r: int, a: Action) -> float | None:
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
                       if (t := ready(r, q[pcs[r][i]])) is not None]
            if not options:
                continue
            t, i = min(options)
            a = qs[i][pcs[r][i]]
            clock[r] = t
            if a.kind in ("SEND_F", "SEND_B"):
                sent[a] = clock[r]
            elif a.kind in ("F", "B"):
                clock[r] += f_cost if a.kind == "F" else b_cost
            out[r].append(a)
            pcs[r][i] += 1
            remaining -= 1
            progress = True
        if not progress:
            stuck = {r: [str(q[pcs[r][i]]) for i, q in enumerate(qs) if pcs[r][i] < len(q)]
                     for r, qs in queues.items()}
            raise ScheduleError(f"deadlock while merging copies: ranks wait at {stuck}")
    return out
