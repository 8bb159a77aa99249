"""Seconds per action of a compiled program on a machine (a ``Profile``): what the timed
simulator (``simulate(..., timing=...)``) runs the per-rank action lists on.

Compute: each node of the analysed graph costs ``op_s`` plus the larger of its FLOPs at the
profile's rate for its kind (dense and grouped convolutions, matrix products; torch's
FlopCounter counted them; a convolution call's fixed cost is ``Profile.conv_pixels`` more
rows; pools: the elements their windows read, at ``pool_rate`` where the profile measured it)
and the bytes it moves at ``mem_bytes`` (``norm_bytes`` for norms; it reads about as much as it
writes: twice its output), for one chunk (the compiler analyses the graph at one chunk of the
batch) and, in a spatial stage, one tile (1/P of a tiled node). A backward costs ``BACKWARD``
times its forward (pools: see ``node_times``). Ranks beyond a node's slots share them
(``Profile.slowdown``: 4 ranks on 2 cores compute at half speed).

Communication: a spatial stage's halo exchanges (every windowed node of the region, the
messages and bytes of the tile with the most neighbours, ``exchange`` geometry) and its norm
statistics (one allgather per BatchNorm / GroupNorm), each with the runtime's cost of a tile
op (``Profile.tile_op``: fixed, plus the tile's bytes at ``tile_op_bytes``; CPU work, so
slowed down like compute on a shared core), add to its F and B; so do its attentions over
the tiles (fxpar.perf.attention_comm: ring attention's K and V blocks, and in backward their
dK and dV too, one latency per message and the bytes one after another; gathered attention's
allreduces, ``ceil(log2 P)`` rounds of their buffer each), whose bytes (with the halos')
``StageSeconds`` records per direction; a pipeline message
costs ``alpha + beta * bytes`` on the link between the two ranks; ALLREDUCE is a ring over the
ranks holding the same stages, 2 (g - 1) steps of ``bytes / g``; STEP reads and writes the
parameters, gradients and optimizer state once (memory-bound).
"""

from __future__ import annotations

import itertools
import math
from typing import TYPE_CHECKING

from torch import fx

from fxpar.core import meta
from fxpar.core.geometry import Grid, Rect, exchange
from fxpar.core.meta import NodeCost, TensorInfo
from fxpar.core.roles import stage_groups
from fxpar.core.schedule import Action, split_keys
from fxpar.core.stages import links_of
from fxpar.frontend.rules.opclass import BatchNorm, Norm, Window, classify
from fxpar.passes.spatial_region import SpatialLayout, image_grid, window_need
from fxpar.passes.split_stages import StageAssignment, compute_nodes
from fxpar.perf.attention_comm import attention_traffic
from fxpar.perf.profile import Profile
from fxpar.perf.simulate import SimResult, StageSeconds, Timing, simulate

if TYPE_CHECKING:
    from fxpar.core.stages import Transfer
    from fxpar.program.program import Program

BACKWARD = 2.0
"""A node's backward costs this many times its forward (input and weight gradients)."""
CONV = ("convolution", "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d",
        "conv_transpose3d")
MATMUL = ("linear", "addmm", "mm", "bmm", "matmul")
MAX_POOL = ("max_pool1d", "max_pool2d", "max_pool3d", "max_pool1d_with_indices",
            "max_pool2d_with_indices", "max_pool3d_with_indices")
AVG_POOL = ("avg_pool1d", "avg_pool2d", "avg_pool3d")
OPTIMIZER_PASSES = 4
"""STEP reads and writes about this many parameter-sized tensors per parameter (SGD with
momentum: parameter, gradient, momentum buffer, written parameter and buffer)."""


def node_seconds(n: fx.Node, profile: Profile, share: float, norm: bool = False) -> float:
    """Forward seconds of node ``n`` when a rank runs ``share`` of it (a tile); ``norm``: a
    BatchNorm / group norm (its own memory rate)."""
    c = meta.find(n, NodeCost)
    if c is None:
        return 0.0
    name = _name(n)
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
    if name in CONV and rate and c.flops and profile.conv_pixels:  # the call's fixed cost
        compute += c.flops / _rows(n) * profile.conv_pixels / rate
    if profile.pool_rate and name in (*MAX_POOL, *AVG_POOL):
        compute = _window_elements(n) * share / profile.pool_rate
    bandwidth = (profile.norm_bytes or profile.mem_bytes) if norm else profile.mem_bytes
    memory = 2 * c.out_bytes * share / bandwidth
    return profile.op_s + max(compute, memory)


def node_times(n: fx.Node, profile: Profile, share: float, norm: bool = False
               ) -> tuple[float, float]:
    """Forward and backward seconds of node ``n`` (see :func:`node_seconds`). A backward costs
    ``BACKWARD`` times the forward, but where the profile measured pools: a max pool's backward
    scatters the gradient to the winners (memory-bound), an average pool's spreads it over the
    windows (as its forward)."""
    f = node_seconds(n, profile, share, norm)
    name = _name(n)
    c = meta.find(n, NodeCost)
    if not profile.pool_rate or c is None or name not in (*MAX_POOL, *AVG_POOL):
        return f, BACKWARD * f
    if name in AVG_POOL:
        return f, f
    return f, profile.op_s + 2 * c.out_bytes * share / profile.mem_bytes


def _rows(n: fx.Node) -> int:
    """Rows of convolution ``n``'s output: batch x spatial positions."""
    shape = meta.get(n, TensorInfo).shapes[0]
    return max(1, shape[0] * math.prod(shape[2:]))


def _tile_bytes(n: fx.Node, share: float) -> float:
    """Bytes of the tile a tile op of node ``n`` works on: its input's share (a norm: its
    output's)."""
    x = n.args[0]
    src = x if isinstance(x, fx.Node) and meta.find(x, TensorInfo) is not None else n
    info = meta.get(src, TensorInfo)
    return info.cell_bytes * math.prod(info.shapes[0][2:]) * share


def _name(n: fx.Node) -> str:
    return getattr(getattr(n.target, "overloadpacket", None), "__name__", "")


def _window_elements(n: fx.Node) -> int:
    """Output elements x kernel size of a pool node: the elements its windows read."""
    info = meta.get(n, TensorInfo)
    kernel = n.args[1] if len(n.args) > 1 else n.kwargs.get("kernel_size", 1)
    dims = len(info.shapes[0]) - 2
    k = list(kernel) if isinstance(kernel, (list, tuple)) else [kernel] * dims
    k = k * dims if len(k) == 1 else k
    return math.prod(info.shapes[0]) * math.prod(int(v) for v in k)


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


def halo_messages(gm: fx.GraphModule, n: fx.Node, grid: Grid, tile: int
                  ) -> tuple[int, int, int]:
    """Windowed node ``n``'s halo exchange for ``tile`` in one direction: (messages sent and
    received, bytes of the largest, bytes received in all); (0, 0, 0) for a node that
    exchanges nothing. Only the tiles next to ``tile`` (along each dim and diagonally) are
    looked at, so a grid of 2,048 tiles costs what one of 9 does: a window reaching past a
    neighbouring tile is not what the planner considers. A window that wraps around the image
    (circular padding, torch.roll) reads from the opposite border: its messages are the
    exchange's own (fxpar.core.geometry.exchange), over every tile."""
    op = classify(gm, n)
    x = n.args[0]
    if not isinstance(op, Window) or not isinstance(x, fx.Node):
        return 0, 0, 0
    lay = meta.find(x, SpatialLayout)
    if lay is None or not lay.tiled or x.op == "placeholder":
        return 0, 0, 0  # the model input (whole on every rank: it slices its window)
    info = meta.get(x, TensorInfo)
    extent = tuple(info.shape[2:])
    if op.rule.wraps:
        ex = exchange(grid, extent, [window_need(grid, n, op, u) for u in range(grid.size)],
                      tile, wrap=True)
        sizes = [r.size for _, r in (*ex.sends, *ex.recvs)]
        return (len(sizes), max(sizes, default=0) * info.cell_bytes,
                ex.recv_elements() * info.cell_bytes)
    own = grid.tile_rect(extent, tile)
    inside = window_need(grid, n, op, tile).intersect(Rect.whole(extent))
    sizes, received = [], 0
    for u in _near(grid, tile):
        sent = own.intersect(window_need(grid, n, op, u))
        got = grid.tile_rect(extent, u).intersect(inside) if inside is not None else None
        sizes += [r.size for r in (sent, got) if r is not None]
        received += got.size if got is not None else 0
    if not sizes:
        return 0, 0, 0
    return len(sizes), max(sizes) * info.cell_bytes, received * info.cell_bytes


def _near(grid: Grid, tile: int) -> list[int]:
    """The tiles around ``tile`` (at most one step along each dim), without it."""
    pos = grid.position(tile)
    out = []
    for step in itertools.product((-1, 0, 1), repeat=grid.ndim):
        q = [p + d for p, d in zip(pos, step, strict=True)]
        if any(d for d in step) and all(0 <= v < n for v, n in zip(q, grid.parts,
                                                                  strict=True)):
            u = 0
            for v, n in zip(q, grid.parts, strict=True):
                u = u * n + v
            out.append(u)
    return out


def halo_seconds(gm: fx.GraphModule, n: fx.Node, grid: Grid, tile: int,
                 profile: Profile) -> float:
    """One direction's cost of windowed node ``n``'s halo exchange for ``tile``: its messages on
    the intra-node link (tiles of a stage sit next to each other), in parallel (the largest
    message's bytes) after one latency each."""
    count, largest, _ = halo_messages(gm, n, grid, tile)
    return _halo_time(count, largest, profile)


def _halo_time(count: int, largest: int, profile: Profile) -> float:
    link = profile.p2p_intra
    return count * link.alpha + largest * link.beta if count else 0.0


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
    back = {s: 0.0 for s in range(plan.stages)}
    comm = {s: 0.0 for s in range(plan.stages)}  # both directions
    att_f, att_b = dict.fromkeys(comp, 0.0), dict.fromkeys(comp, 0.0)  # attention's, each
    sent_f, sent_b = dict.fromkeys(comp, 0), dict.fromkeys(comp, 0)
    for n in compute_nodes(gm):
        s = meta.get(n, StageAssignment).stage
        lay = meta.find(n, SpatialLayout)
        tiled = lay is not None and lay.tiled and plan.group_size(s) > 1
        share = 1.0 / (plan.group_size(s) if tiled else 1)
        norm = isinstance(classify(gm, n), (BatchNorm, Norm))
        f, b = node_times(n, profile, share, norm)
        comp[s] += f
        back[s] += b
        if grid is not None and plan.group_size(s) > 1:
            traffic = attention_traffic(gm, n, grid, tile)
            if traffic is not None:
                fwd, bwd = traffic
                att_f[s] += fwd.seconds(profile.p2p_intra, profile.allreduce_intra, grid.size)
                att_b[s] += bwd.seconds(profile.p2p_intra, profile.allreduce_intra, grid.size)
                sent_f[s] += fwd.nbytes
                sent_b[s] += bwd.nbytes
        if tiled and grid is not None:
            count, largest, received = halo_messages(gm, n, grid, tile)
            halo = _halo_time(count, largest, profile)
            sent_f[s] += received  # the middle tile sends about what it receives
            sent_b[s] += received
            if halo or norm:  # the runtime's work: at the rank's (shared) core speed
                comm[s] += halo + profile.slowdown(program.world_size) * profile.tile_op(
                    _tile_bytes(n, share))
            if norm:
                link = profile.allreduce_intra
                comm[s] += math.ceil(math.log2(grid.size)) * link.alpha
    slow = profile.slowdown(program.world_size)
    return {s: StageSeconds(slow * comp[s] + comm[s] + att_f[s],
                            slow * back[s] + comm[s] + att_b[s],
                            comm[s] + att_f[s], comm[s] + att_b[s], sent_f[s], sent_b[s])
            for s in range(plan.stages)}


def _stage_param_bytes(program: Program) -> dict[int, int]:
    return {s: sum(p.numel() * p.element_size() for p in m.parameters())
            for s, m in enumerate(program.graph.modules)}


def _rank_bytes(program: Program, t: Transfer) -> int:
    """Bytes of transfer ``t`` one rank sends (a tiled output leaves as tiles, 1/P each)."""
    return t.nbytes // (program.plan.group_size(t.src) if t.tiled else 1)


def _sent_bytes(program: Program) -> dict[int, int]:
    """Per stage, bytes it sends forward per chunk (its outputs other stages read)."""
    out: dict[int, int] = {}
    for t in program.graph.transfers:
        out[t.src] = out.get(t.src, 0) + _rank_bytes(program, t)
    return out


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

    split = bool(split_keys(program.schedule.values()))

    def seconds(rank: int, a: Action) -> float:
        if a.kind == "F":
            return stages[a.stage].f
        if a.kind == "B":  # a split backward: about half is input, half weight gradients
            return stages[a.stage].b / (2 if split else 1)
        if a.kind == "W":
            return stages[a.stage].b / 2
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

    grads = {s: sum(_rank_bytes(program, t) for t in program.graph.transfers
                    if t.dst == s and t.grad)
             for s in range(program.plan.stages)}

    def transfer(send: Action, src: int, dst: int) -> float:
        nbytes = sent.get(send.stage, 0) if send.kind == "SEND_F" else grads[send.stage]
        return profile.link(src, dst).seconds(nbytes)

    return Timing(seconds, transfer, stages, _components(groups))


def predict(program: Program, profile: Profile) -> SimResult:
    """The timed simulation of one step of ``program`` on ``profile``: step seconds
    (``makespan``), bubble, per-rank busy time and spans."""
    return simulate(program.schedule, links_of(program.graph),
                    together=program.rank_map.tile_groups(), timing=timing(program, profile))


def _components(groups: dict[int, tuple[int, ...]]) -> dict[int, tuple[int, ...]]:
    """rank -> the ranks its ALLREDUCE meets (stage groups joined where they share a rank)."""
    import networkx as nx

    g = nx.Graph()
    for ranks in groups.values():
        g.add_nodes_from(ranks)
        g.add_edges_from(zip(ranks, ranks[1:], strict=False))
    return {r: tuple(sorted(c)) for c in nx.connected_components(g) for r in c}
