"""GEMS mirror and data-parallel replicas: which ranks hold each stage, and which chunks of the
batch each (replica, copy) trains on.

Copy 1 (the GEMS mirror) puts role j of the flat role list on rank N-1-j (see fxpar.core.plan),
so a
spatial stage's P tiles land on the top P ranks and, with an odd N, the middle rank holds the
same role in both copies. All ranks holding a stage — every tile, both copies, every replica —
sum their gradients (one allreduce over that *stage group*); both copies and all replicas then
apply the same update and stay identical.

Chunks: the global batch is cut into D x C x T x m equal contiguous chunks (replicas, copies,
GEMS rounds, micro-batches, in that nesting order). Copy c of replica d trains on the T x m
chunks starting at ``((d*C) + c) * T * m``; its micro-batch ``mb`` (rounds concatenated) is
chunk ``first + mb``. The single-device reference accumulates gradients over the chunks in that
order, and BatchNorm running statistics are merged to match it (fxpar.runtime.sync).
"""

from __future__ import annotations

from fxpar.core.plan import Plan, RankMap


def stage_groups(rank_map: RankMap) -> dict[int, tuple[int, ...]]:
    """stage -> every rank that holds it (all tiles, copies and replicas), sorted."""
    plan = rank_map.plan
    out: dict[int, set[int]] = {s: set() for s in range(plan.stages)}
    for r in range(plan.world_size):
        for role in rank_map.roles_of(r):
            out[role.stage].add(r)
    return {s: tuple(sorted(ranks)) for s, ranks in out.items()}


def first_chunk(plan: Plan, dp: int, copy: int) -> int:
    """Index of the first chunk (of ``plan.chunks()``) that copy ``copy`` of replica ``dp``
    trains on; it trains on ``chunks_per_copy(plan)`` consecutive chunks."""
    return (dp * plan.copies + copy) * chunks_per_copy(plan)


def chunks_per_copy(plan: Plan) -> int:
    """Micro-batches one model copy runs per step (GEMS rounds x micro-batches)."""
    return plan.gems_times * plan.microbatches
