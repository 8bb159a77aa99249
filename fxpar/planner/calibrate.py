"""Measure a machine profile (``fxpar-calibrate``): a short calibration run of a few op kinds and
sizes, and of the project's own ``Comm`` between ranks.

Compute (each rank's view, one rank measures): 3x3 convolutions forward at three shapes (FLOPs
counted as torch's FlopCounterMode counts them: a multiply-add is 2), a depthwise one, a linear
layer, a ReLU over 4 M values (bytes read and written), a training BatchNorm over 8x64x64x64
values and a ReLU over one value (the fixed cost per op),
each the median of 5 timeit batches.
Communication (with 2 ranks or more): a ping-pong between ranks 0 and 1 at sizes from 8 bytes to
4 MiB (one-way time = half the round trip) and an allreduce over every rank at the same sizes;
``alpha`` is the smallest message's time and ``beta`` the slope of the rest above it (the
allreduce per ring step: time / (2 (g - 1)) against bytes / g). A tiny spatial model then
measures what a tile op costs in fxpar's own runtime (:func:`tile_ops`). Ranks that share a
node are told by MPI (``COMM_TYPE_SHARED``); with all ranks on one node, the inter-node links
are not measured and copy the intra-node ones (``measured["inter"]`` says so).
"""

from __future__ import annotations

import os
import statistics
import time
import timeit
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from fxpar.comm.mpi import Comm
from fxpar.perf.profile import Link, Profile

CONV_SHAPES = ((1, 64, 64, 128), (1, 128, 128, 64), (1, 32, 32, 256))
"""(batch, in channels, out channels, side) of the timed 3x3 convolutions."""
GRID_CHANNELS = (16, 32, 64, 128, 256, 512)
"""Channel counts of the convolution rate grid (1x1 and 3x3 each, batch 4 at 32x32)."""
SIZES = (8, 1024, 65536, 1 << 20, 4 << 20)
"""Message bytes of the ping-pong and allreduce."""


def _timed(fn: Callable[[], Any], min_run_time: float) -> float:
    """Median seconds of one call: 5 batches of calls (timeit), each about a fifth of
    ``min_run_time`` long, after one warm-up call."""
    t0 = time.perf_counter()
    fn()
    once = max(time.perf_counter() - t0, 1e-7)
    number = max(1, int(min_run_time / 5 / once))
    return statistics.median(timeit.Timer(fn).repeat(repeat=5, number=number)) / number


def compute(min_run_time: float = 0.2, quick: bool = False) -> dict[str, Any]:
    """This process's convolution and matrix-product FLOP/s, memory bytes/s and op cost
    (``quick``: small shapes, for tests: the rates it gives are not the machine's)."""
    torch.manual_seed(0)
    convs = []
    for n, cin, cout, side in CONV_SHAPES:
        side = side // 8 if quick else side
        x = torch.randn(n, cin, side, side)
        w = torch.randn(cout, cin, 3, 3)

        def conv(x: torch.Tensor = x, w: torch.Tensor = w) -> torch.Tensor:
            return F.conv2d(x, w, padding=1)

        t = _timed(conv, min_run_time)
        flops = 2 * n * cout * side * side * cin * 9  # multiply-add = 2, as FlopCounterMode
        convs.append({"shape": [n, cin, cout, side], "seconds": t, "flops": flops})
    grid = []
    for c in GRID_CHANNELS:
        for k in (1, 3):
            side = 8 if quick else 32
            xg, wg = torch.randn(4, c, side, side), torch.randn(c, c, k, k)
            tg = _timed(lambda xg=xg, wg=wg, k=k: F.conv2d(xg, wg, padding=k // 2),
                        min_run_time / 4)
            grid.append((c, k, 2 * 4 * c * side * side * c * k * k / tg))
    act = torch.randn(8 if not quick else 2, 64, 64 if not quick else 16, 64)
    dw = torch.randn(64, 1, 3, 3)
    t_dw = _timed(lambda: F.conv2d(act, dw, padding=1, groups=64), min_run_time)
    dw_flops = 2 * act.numel() * 9
    a, w = (torch.randn(16, 128), torch.randn(128, 128)) if quick else \
        (torch.randn(256, 1024), torch.randn(1024, 1024))
    t_mm = _timed(lambda: F.linear(a, w), min_run_time)
    mm_flops = 2 * a.shape[0] * a.shape[1] * w.shape[0]
    big = torch.randn((1 if quick else 4) << 20)  # an activation's size (16 MiB)
    t_mem = _timed(lambda: torch.relu(big), min_run_time)
    ones, zeros = torch.ones(64), torch.zeros(64)
    t_norm = _timed(lambda: F.batch_norm(act, zeros.clone(), ones.clone(), ones, zeros, True),
                    min_run_time)
    one = torch.randn(1)
    t_op = _timed(lambda: torch.relu(one), min_run_time)
    t_pool = _timed(lambda: F.max_pool2d(act, 3, 1, 1), min_run_time)  # AmoebaNet's pool
    return {
        "conv_flops": statistics.median(c["flops"] / c["seconds"] for c in convs),
        "matmul_flops": mm_flops / t_mm,
        "mem_bytes": 2 * big.numel() * big.element_size() / t_mem,
        "norm_bytes": 2 * act.numel() * act.element_size() / t_norm,
        "dwconv_flops": dw_flops / t_dw,
        "pool_rate": act.numel() * 9 / t_pool,
        "conv_grid": grid,
        "op_s": t_op,
        "convs": convs, "matmul_s": t_mm, "relu_s": t_mem, "relu_values": big.numel(),
        "batch_norm_s": t_norm, "batch_norm_shape": list(act.shape), "max_pool_s": t_pool,
    }


def fit(points: list[tuple[float, float]]) -> Link:
    """``seconds = alpha + beta * bytes`` through ``(bytes, seconds)`` points: alpha is the
    smallest message's time (a free intercept is lost in the large messages' noise), beta the
    least-squares slope of the rest above it (>= 0)."""
    points = sorted(points)
    alpha = max(points[0][1], 0.0)
    num = sum(b * (t - alpha) for b, t in points[1:])
    den = sum(b * b for b, _ in points[1:])
    return Link(alpha, max(num / den, 0.0) if den else 0.0)


def _pingpong(comm: Comm, nbytes: int, repeats: int) -> float:
    buf = torch.zeros(max(nbytes // 4, 1))
    comm.barrier()
    t0 = time.perf_counter()
    for _ in range(repeats):
        if comm.rank == 0:
            comm.send(buf, 1)
            comm.recv(buf, 1)
        elif comm.rank == 1:
            comm.recv(buf, 0)
            comm.send(buf, 0)
    return (time.perf_counter() - t0) / repeats / 2


def _allreduce(comm: Comm, nbytes: int, repeats: int) -> float:
    buf = torch.zeros(max(nbytes // 4, 1))
    comm.barrier()
    t0 = time.perf_counter()
    for _ in range(repeats):
        comm.allreduce(buf)
    return (time.perf_counter() - t0) / repeats


def communication(comm: Comm, repeats: int = 20) -> dict[str, Any]:
    """Ping-pong (ranks 0 and 1) and allreduce (all ranks) timings and their fitted links;
    every rank takes part, rank 0's figures count."""
    g = comm.size
    p2p = [(float(b), _pingpong(comm, b, repeats)) for b in SIZES]
    ar = [(float(b), _allreduce(comm, b, repeats)) for b in SIZES]
    per_step = [(b / g, t / (2 * (g - 1))) for b, t in ar]
    return {"p2p": fit(p2p), "allreduce": fit(per_step), "p2p_points": p2p,
            "allreduce_points": ar}


TILE_LAYERS = 8
"""Convolution + BatchNorm + ReLU blocks of the model that measures the cost of a tile op."""
TILE_SIZES = ((2, 8, 16), (4, 32, 64))
"""(batch, channels, side) of its two inputs: a tiny one (the fixed cost) and one of 2 MiB
(how the cost grows with the tile)."""


def tile_ops(comm: Comm, repeats: int) -> dict[str, Any]:
    """What one tile op of a spatial stage costs in fxpar's own runtime: a model of
    ``TILE_LAYERS`` 3x3 convolution + BatchNorm + ReLU blocks (2 tile ops each, both ways), its
    step timed on ranks 0 and 1 as ``Plan(spatial_parts=2)`` and on each alone as ``Plan()``;
    per tile op, (SP step - one rank's step / 2) / (4 x blocks), at the two ``TILE_SIZES``:
    ``tile_op_s`` the small one's cost, ``tile_op_bytes`` the bytes/s of the growth between
    them. Every rank of ``comm`` takes part (the others wait)."""
    from torch import nn

    from fxpar.compiler.driver import compile as fx_compile
    from fxpar.core.plan import Plan

    pair = comm.split(0 if comm.rank < 2 else 1)
    alone = comm.split(comm.rank)
    out: dict[str, Any] = {"sizes": []}
    for batch, channels, side in TILE_SIZES:
        torch.manual_seed(0)
        blocks = [nn.Sequential(nn.Conv2d(channels, channels, 3, padding=1),
                                nn.BatchNorm2d(channels), nn.ReLU())
                  for _ in range(TILE_LAYERS)]
        model = nn.Sequential(*blocks, nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                              nn.Linear(channels, 2))
        x = torch.randn(batch, channels, side, side)
        y = torch.arange(batch) % 2
        meta = torch.empty(x.shape, device="meta")

        def step_time(plan: Plan, group: Comm, model: nn.Module = model,
                      x: torch.Tensor = x, y: torch.Tensor = y,
                      meta: torch.Tensor = meta) -> float:
            rp = fx_compile(model, plan, meta).local(group)
            rp.train_step(x, y)
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                rp.train_step(x, y)
                times.append(time.perf_counter() - t0)
            return statistics.median(times)

        one = step_time(Plan(), alone)
        comm.barrier()
        sp = step_time(Plan(spatial_parts=2), pair) if comm.rank < 2 else 0.0
        comm.barrier()
        out["sizes"].append({"shape": [batch, channels, side, side], "sp2_step_s": sp,
                             "one_rank_step_s": one, "tile_bytes": x.numel() * 4 // 2,
                             "per_op_s": max(sp - one / 2, 0.0) / (4 * TILE_LAYERS)})
    small, large = out["sizes"][0], out["sizes"][-1]
    grow = (large["per_op_s"] - small["per_op_s"]) / (large["tile_bytes"] - small["tile_bytes"])
    out["tile_op_s"] = small["per_op_s"]
    out["tile_op_bytes"] = 1 / grow if grow > 0 else 0.0
    return out


def calibrate(comm: Comm | None, name: str, quick: bool = False,
              ranks_per_node: int | None = None) -> Profile:
    """A profile of this machine: compute on rank 0 (every rank in step), communication over
    ``comm`` when it has 2 ranks or more. ranks_per_node: how many ranks jobs will place on
    one node (default: as many as this node has cores); its slots are its cores / threads."""
    min_run = 0.05 if quick else 0.2
    rank = comm.rank if comm is not None else 0
    measured: dict[str, Any] = {}
    comp = compute(min_run) if rank == 0 else {}  # quick shortens the timing, not the shapes
    measured["compute"] = {k: v for k, v in comp.items()
                           if k in ("convs", "matmul_s", "relu_s", "relu_values", "batch_norm_s",
                                     "batch_norm_shape", "max_pool_s")}
    p2p = allreduce = Link(0.0, 0.0)
    tiles: dict[str, Any] = {}
    per_node = 1
    if comm is not None and comm.size > 1:
        got = communication(comm, 5 if quick else 20)
        p2p, allreduce = got["p2p"], got["allreduce"]
        tiles = tile_ops(comm, 3 if quick else 10)
        measured["tile_ops"] = tiles
        per_node = comm.node_size()
        measured.update(p2p_points=got["p2p_points"], allreduce_points=got["allreduce_points"])
    else:
        measured["communication"] = "not measured (one rank): links are 0"
    if comm is not None and per_node >= comm.size:
        measured["inter"] = "all ranks on one node: inter-node links copy the intra-node ones"
    if comm is not None:
        comp = comm.bcast_object(comp)
    threads = torch.get_num_threads()
    slots = max(1, (os.cpu_count() or 1) // threads)
    measured["ranks_sharing_this_node"] = per_node
    return Profile(
        name=name, device="cpu", conv_flops=comp["conv_flops"],
        matmul_flops=comp["matmul_flops"], mem_bytes=comp["mem_bytes"], op_s=comp["op_s"],
        norm_bytes=comp["norm_bytes"], dwconv_flops=comp["dwconv_flops"],
        pool_rate=comp["pool_rate"], conv_grid=tuple(comp["conv_grid"]),
        tile_op_s=tiles["tile_op_s"] if tiles else 0.0,
        tile_op_bytes=tiles["tile_op_bytes"] if tiles else 0.0,
        p2p_intra=p2p, p2p_inter=p2p, allreduce_intra=allreduce, allreduce_inter=allreduce,
        ranks_per_node=ranks_per_node or max(per_node, slots), cores_per_rank=threads,
        slots_per_node=slots, measured=measured)
