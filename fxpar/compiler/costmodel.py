"""Seconds per action of a compiled program on a machine (a ``Profile``): what the timed
simulator (``simulate(..., timing=...)``) runs the per-rank action lists on.

Compute: each node of the analysed graph costs ``op_s`` plus the larger of its FLOPs at the
profile's rate for its kind (dense and grouped convolutions, matrix products; torch's
FlopCounter counted them)
and the bytes it moves at ``mem_bytes`` (``norm_bytes`` for norms; it reads about as much as it
writes: twice its output),
for one chunk (the compiler analyses the graph at one chunk of the batch) and, in a spatial
stage, one tile (1/P of a tiled node). A backward costs ``BACKWARD`` times its forward. Ranks
beyond a node's slots share them (``Profile.slowdown``: 4 ranks on 2 cores compute at half
speed).

Communication: a spatial stage's halo exchanges (every windowed node of the region, the
messages and bytes of the tile with the most neighbours, ``exchange`` geometry) and its norm
statistics (one allgather per BatchNorm / GroupNorm), each with the runtime's fixed cost of a
tile op (``tile_op_s``), add to its F and B; a pipeline message
costs ``alpha + beta * bytes`` on the link between the two ranks; ALLREDUCE is a ring over the
ranks holding the same stages, 2 (g - 1) steps of ``bytes / g``; STEP reads and writes the
parameters, gradients and optimizer state once (memory-bound).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import fx

from fxpar.compiler.profile import Profile
from fxpar.core import meta
from fxpar.core.geometry import Grid, Rect, exchange
from fxpar.core.meta import NodeCost, TensorInfo
from fxpar.core.roles import stage_groups
from fxpar.core.schedule import Action
from fxpar.frontend.rules.opclass import BatchNorm, Norm, Window, classify
from fxpar.passes.spatial_region import SpatialLayout, image_grid
from fxpar.passes.split_stages import StageAssignment, compute_nodes

if TYPE_CHECKING:
    from fxpar.io.program import Program

BACKWARD = 2.0
"""A node's backward costs this many times its forward (input and weight gradients)."""
CONV = ("convolution", "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d",
        "conv_transpose3d")
MATMUL = ("linear", "addmm", "mm", "bmm", "matmul")
OPTIMIZER_PASSES = 4
"""STEP reads and writes about this many parameter-sized tensors per parameter (SGD with
momentum: parameter, gradient, momentum buffer, written parameter and buffer)."""


@dataclass(frozen=True)
class StageSeconds:
    """One chunk (micro-batch) through one rank of a stage: forward and backward seconds, and
    the communication inside them (halos, statistics) for the record."""

    f: float
    b: float
    comm_f: float = 0.0
    comm_b: float = 0.0


def node_seconds(n: fx.Node, profile: Profile, share: float, norm: bool = False) -> float:
    """Forward seconds of node ``n`` when a rank runs ``share`` of it (a tile); ``norm``: a
    BatchNorm / group norm (its own memory rate)."""
    c = meta.find(n, NodeCost)
    if c is None:
        return 0.0
    name = getattr(getattr(n.target, "overloadpacket", None), "__name__", "")
    rate = profile.conv_flops if name in CONV else profile.matmul_flops if name in MATMUL \
        else None
    if name in CONV:
        groups = _groups(n)
        w = n.args[1] if len(n.args) > 1 else None
        info = meta.find(w, TensorInfo) if isinstance(w, fx.Node) else None
        if groups > 1 and profile.dwconv_flops:
            rate = profile.dwconv_flops
        elif info is not None and len(info.shape) >= 3:
            rate = profile.conv_rate(int(info.shape[1]), int(max(info.shape[2:])))
    compute = c.flops * share / rate if rate and c.flops else 0.0
    bandwidth = (profile.norm_bytes or profile.mem_bytes) if norm else profile.mem_bytes
    memory = 2 * c.out_bytes * share / bandwidth
    return profile.op_s + max(compute, memory)


def _groups(n: fx.Node) -> int:
    """The ``groups`` argument of an ATen convolution node (1 when absent)."""
    names = [a.name for a in n.target._schema.arguments]  # type: ignore[union-attr]
    pos = names.index("groups") if "groups" in names else -1
    if pos < 0:
        return 1
    return int(n.args[pos]) if len(n.args) > pos else int(n.kwargs.get("groups", 1))


def _middle_tile(grid: Grid) -> int:
    """The tile at the middle of the grid (the most neighbours: the slowest exchanges)."""
    pos = [p // 2 for p in grid.parts]
    t = 0
    for p, n in zip(pos, grid.parts, strict=True):
        t = t * n + p
    return t


def halo_seconds(gm: fx.GraphModule, n: fx.Node, grid: Grid, tile: int,
                 profile: Profile) -> float:
    """One direction's cost of windowed node ``n``'s halo exchange for ``tile``: its messages on
    the intra-node link (tiles of a stage sit next to each other), in parallel (the largest
    message's bytes) after one latency each."""
    op = classify(gm, n)
    x = n.args[0]
    if not isinstance(op, Window) or not isinstance(x, fx.Node):
        return 0.0
    lay = meta.find(x, SpatialLayout)
    if lay is None or not lay.tiled or x.op == "placeholder":
        return 0.0  # the model input (whole on every rank: it slices its window), no message
    out_ext = tuple(meta.get(n, TensorInfo).shape[2:])
    in_ext = tuple(meta.get(x, TensorInfo).shape[2:])
    needs = [Rect(*(op.needs(iv, i) for i, iv in enumerate(grid.tile_rect(out_ext, u).dims)))
             for u in range(grid.size)]
    ex = exchange(grid, in_ext, needs, tile)
    if not ex.recvs and not ex.sends:
        return 0.0
    info = meta.get(x, TensorInfo)
    cell = info.shape[0] * info.shape[1] * torch.empty((), dtype=info.dtype).element_size()
    largest = max([r.size for _, r in (*ex.recvs, *ex.sends)]) * cell
    link = profile.p2p_intra
    return (len(ex.recvs) + len(ex.sends)) * link.alpha + largest * link.beta


def stage_seconds(program: Program, profile: Profile) -> dict[int, StageSeconds]:
    """Per stage, F and B seconds of one chunk on one of its ranks (module doc)."""
    gm = program.traced
    if gm is None:
        raise ValueError("the program has no analysed graph (compile it with fxpar.compile)")
    plan = program.plan
    spatial = program.spatial is not None
    grid = image_grid(gm) if spatial else None
    tile = _middle_tile(grid) if grid is not None else 0
    comp = {s: 0.0 for s in range(plan.stages)}
    comm = {s: 0.0 for s in range(plan.stages)}
    for n in compute_nodes(gm):
        s = meta.get(n, StageAssignment).stage
        lay = meta.find(n, SpatialLayout)
        tiled = lay is not None and lay.tiled and plan.group_size(s) > 1
        share = 1.0 / (plan.group_size(s) if tiled else 1)
        norm = isinstance(classify(gm, n), (BatchNorm, Norm))
        comp[s] += node_seconds(n, profile, share, norm)
        if tiled and grid is not None:
            halo = halo_seconds(gm, n, grid, tile, profile)
            comm[s] += halo + (profile.tile_op_s if halo or norm else 0.0)
            if norm:
                link = profile.allreduce_intra
                comm[s] += math.ceil(math.log2(grid.size)) * link.alpha
    slow = profile.slowdown(program.world_size)
    return {s: StageSeconds(slow * comp[s] + comm[s], slow * BACKWARD * comp[s] + comm[s],
                            comm[s], comm[s])
            for s in range(plan.stages)}


def _stage_param_bytes(program: Program) -> dict[int, int]:
    return {s: sum(p.numel() * p.element_size() for p in m.parameters())
            for s, m in enumerate(program.graph.modules)}


def _sent_bytes(program: Program) -> dict[int, int]:
    """Per stage, bytes it sends forward per chunk (its outputs other stages read; a tiled
    output leaves as tiles, 1/P each)."""
    out: dict[int, int] = {}
    for t in program.graph.transfers:
        share = program.plan.group_size(t.src) if t.tiled else 1
        out[t.src] = out.get(t.src, 0) + t.nbytes // share
    return out


@dataclass(frozen=True)
class Timing:
    """What the simulator asks: seconds of an action on a rank, and when a message sent by
    action ``send`` on rank ``src`` arrives on rank ``dst`` (after the send)."""

    seconds: Callable[[int, Action], float]
    transfer: Callable[[Action, int, int], float]
    stages: dict[int, StageSeconds]
    allreduce: dict[int, tuple[int, ...]]
    """rank -> the ranks whose ALLREDUCE is one collective with its own."""


def timing(program: Program, profile: Profile) -> Timing:
    """The cost model of ``program`` on ``profile`` (module doc)."""
    stages = stage_seconds(program, profile)
    params = _stage_param_bytes(program)
    sent = _sent_bytes(program)
    groups = stage_groups(program.rank_map)
    held: dict[int, set[int]] = {}
    for s, ranks in groups.items():
        for r in ranks:
            held.setdefault(r, set()).add(s)

    def seconds(rank: int, a: Action) -> float:
        if a.kind == "F":
            return stages[a.stage].f
        if a.kind == "B":
            return stages[a.stage].b
        if a.kind == "STEP":
            nbytes = sum(params[s] for s in held.get(rank, ()))
            return profile.slowdown(program.world_size) * (
                OPTIMIZER_PASSES * nbytes / profile.mem_bytes + profile.op_s)
        if a.kind == "ALLREDUCE":
            total = 0.0
            for s in held.get(rank, ()):
                g = len(groups[s])
                if g > 1:
                    link = profile.link(groups[s][0], groups[s][-1], collective=True)
                    total += 2 * (g - 1) * (link.alpha + link.beta * params[s] / g)
            return total
        return 0.0

    grads = {s: sum(t.nbytes // (program.plan.group_size(t.src) if t.tiled else 1)
                    for t in program.graph.transfers if t.dst == s and t.grad)
             for s in range(program.plan.stages)}

    def transfer(send: Action, src: int, dst: int) -> float:
        nbytes = sent.get(send.stage, 0) if send.kind == "SEND_F" else grads[send.stage]
        return profile.link(src, dst).seconds(nbytes)

    return Timing(seconds, transfer, stages, _components(groups))


def _components(groups: dict[int, tuple[int, ...]]) -> dict[int, tuple[int, ...]]:
    """rank -> the ranks its ALLREDUCE meets (stage groups joined where they share a rank)."""
    import networkx as nx

    g = nx.Graph()
    for ranks in groups.values():
        g.add_nodes_from(ranks)
        g.add_edges_from(zip(ranks, ranks[1:], strict=False))
    return {r: tuple(sorted(c)) for c in nx.connected_components(g) for r in c}
