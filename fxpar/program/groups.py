"""What a rank program builds over its communicator, and owns: the sub-communicators of its
stage groups and tile groups, the gradient synchronisers of its stages (which hook its
parameters) and the tile groups its tile ops talk in. RankProgram.close gives them back."""

from __future__ import annotations

from typing import Any

from torch import fx

from fxpar.comm.mpi import Comm
from fxpar.core.lowering import lower
from fxpar.core.roles import chunks_per_copy, first_chunk, stage_groups
from fxpar.core.wire import Order, agreed_order
from fxpar.program.compiled import CompiledProgram
from fxpar.runtime.spatial.group import TileGroups
from fxpar.runtime.spatial.ops import group_key
from fxpar.runtime.sync import Member, StageSync, forward_order

GroupKey = tuple[Any, ...]
"""``("stage", s)`` or ``("tiles", copy, stage, dp)``."""


def communicators(program: CompiledProgram, rank: int, comm: Comm | None) -> dict[GroupKey, Comm]:
    """Every sub-communicator ``rank`` is in: stage groups and tile groups. Created in one
    global order (each group collective over its members only), so no rank waits on another
    that is creating a different group. The caller owns them (``Comm.free``)."""
    if comm is None:
        return {}
    rm, plan = program.rank_map, program.plan
    groups: list[tuple[GroupKey, tuple[int, ...]]] = []
    for s, ranks in stage_groups(rm).items():
        groups.append((("stage", s), ranks))
    if plan.spatial:
        for d in range(plan.data_parallel):
            for c in range(plan.copies):
                for s in range(plan.spatial_stages):
                    groups.append((("tiles", c, s, d), rm.group(d, c, s)))
    out = {}
    for i, (key, ranks) in enumerate(sorted(groups)):
        if rank in ranks and len(ranks) > 1:
            sub = comm.group(ranks, tag=i)
            assert sub is not None
            out[key] = sub
    return out


def stage_syncs(program: CompiledProgram, rank: int, stages: dict[tuple[int, int], fx.GraphModule],
                comms: dict[GroupKey, Comm]) -> list[StageSync]:
    """One gradient / BatchNorm-statistics synchroniser per stage ``rank`` holds."""
    plan, rm = program.plan, program.rank_map
    dp = rm.dp_index(rank)
    members: dict[int, list[Member]] = {}
    for role in rm.roles_of(rank):
        members.setdefault(role.stage, []).append(
            Member(stages[(role.copy, role.stage)], first_chunk(plan, dp, role.copy),
                   chunks_per_copy(plan), counts_stats=role.tile == 0,
                   unread=program.model_keys.unused))
    # the job's stage module where it has one (a compiled program); a loaded one holds only
    # this rank's modules, built alike on every rank from the saved graphs
    job = program.graph.modules
    return [StageSync(ms, comms.get(("stage", s)), plan.chunks(),
                      forward_order(job[s] if job[s] is not None else ms[0].module))
            for s, ms in sorted(members.items())]


def tile_groups(program: CompiledProgram, rank: int, comms: dict[GroupKey, Comm]
                ) -> TileGroups:
    """``rank``'s tile-group communicators by key (bound for each step it runs)."""
    rm = program.rank_map
    dp = rm.dp_index(rank)
    named = {group_key(r.stage, r.copy): comms[("tiles", r.copy, r.stage, dp)]
             for r in rm.roles_of(rank) if ("tiles", r.copy, r.stage, dp) in comms}
    return TileGroups(named)


def rank_order(program: CompiledProgram, rank: int, only: frozenset[str] | None) -> Order:
    """``rank``'s point-to-point messages to each peer in the order both ends issue them, for
    the program's schedule (``only``: its actions of those kinds, on every rank alike, as a
    forward pass runs them): fxpar.core.wire, from every rank's lowered step."""
    known = getattr(program, "orders", None)  # a Program's (a loaded one has none)
    if known is not None and only in known:
        return known[only].get(rank, {})
    schedule = program.schedule if only is None else \
        {r: [a for a in acts if a.kind in only] for r, acts in program.schedule.items()}
    grid = program.spatial.grid if program.spatial is not None else None
    orders = agreed_order(lower(schedule, program.graph, program.rank_map, grid))
    if known is not None:
        known[only] = orders
    return orders.get(rank, {})
