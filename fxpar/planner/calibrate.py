"""Measure a machine profile (``fxpar-calibrate``): a short calibration run of a few op kinds and
sizes, and of the project's own ``Comm`` between ranks.

Compute (each rank's view, one rank measures): 3x3 convolutions forward at three shapes (FLOPs
counted as torch's FlopCounterMode counts them: a multiply-add is 2), a call's fixed cost
(:func:`call_cost`: forward and backward on a small and a larger image), a depthwise one, a linear
layer, a ReLU over 4 M values (bytes read and written), a training BatchNorm over 8x64x64x64
values and a ReLU over one value (the fixed cost per op),
each the median of 5 timeit batches (:class:`Effort` sets how long and how many; the CLI
planner's calibration of the machine it runs on, fxpar.planner.localprofile, takes
:data:`LOCAL`: 3 batches of one call each, a few seconds in all).
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
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F

from fxpar.comm.protocol import Comm
from fxpar.perf.profile import Link, Profile

CONV_SHAPES = ((1, 64, 64, 128), (1, 128, 128, 64), (1, 32, 32, 256))
"""(batch, in channels, out channels, side) of the timed 3x3 convolutions."""
GRID_CHANNELS = (16, 32, 64, 128, 256, 512)
"""Channel counts of the convolution rate grid (1x1 and 3x3 each, batch 4 at 32x32)."""
CALL_CHANNELS = (128, 256)
"""Channel counts of the 3x3 convolutions that measure a call's fixed cost (``call_cost``)."""
CALL_SIDES = (8, 32)
"""... their image sides (one image: 64 and 1,024 rows). The fitted ``p0`` depends on the pair
(the efficiency does not fall linearly): here, 64 against 1,024 rows gave 35-108 over 64-512
channels. On ResNet-18 at 128², micro-batches of 1, 2 and 4 images cost 1.5x, 1.35x and
1.15x a batch of 8's per image (measured, CPU time, one core); p0 = 40 predicts 1.47x, 1.20x
and 1.07x."""
SIZES = (8, 1024, 65536, 1 << 20, 4 << 20)
"""Message bytes of the ping-pong and allreduce."""


@dataclass(frozen=True)
class Effort:
    """How long a calibration measures (the shapes and sizes are the same at every effort)."""

    min_run_time: float
    """Seconds each compute timing aims at (its batches together)."""
    batches: int
    """Timed batches per compute timing (their median counts)."""
    messages: int
    """Round trips / allreduces per message size."""
    steps: int
    """Timed training steps per tile-op measurement."""
    layers: int = 8
    """Convolution blocks of the tile-op model (:func:`tile_ops`)."""
    grid_flops: float = 0.0
    """Most FLOPs of one call of the convolution grid (0: no limit): a larger convolution is
    timed at 16x16 instead of 32x32 (at 256 and 512 channels one CPU core ran both at the
    same rate, 110-114 GFLOP/s, in a quarter of the time)."""


FULL = Effort(0.2, 5, 20, 10)
"""``fxpar-calibrate``."""
QUICK = Effort(0.05, 5, 5, 3)
"""``fxpar-calibrate --quick`` (tests)."""
LOCAL = Effort(0.01, 3, 10, 3, layers=4, grid_flops=2e9)
"""The CLI planner's profile of the machine it runs on (fxpar.planner.localprofile): each
compute timing is mostly 1 warm-up and 3 timed calls of the same shapes as :data:`FULL` (the
grid's largest at 16x16), the tile-op model half as deep."""


def _timed(fn: Callable[[], Any], min_run_time: float, batches: int = 5,
           device: torch.device | None = None) -> float:
    """Median seconds of one call: ``batches`` batches of calls (timeit), together about
    ``min_run_time`` long, after one warm-up call (on a GPU each call waits for its kernels)."""
    if device is not None and device.type == "cuda":
        op = fn

        def fn() -> None:
            op()
            torch.cuda.synchronize(device)

    t0 = time.perf_counter()
    fn()
    once = max(time.perf_counter() - t0, 1e-7)
    number = max(1, int(min_run_time / batches / once))
    return statistics.median(timeit.Timer(fn).repeat(repeat=batches, number=number)) / number


def compute(min_run_time: float = 0.2, quick: bool = False, batches: int = 5,
            device: torch.device | None = None, grid_flops: float = 0.0) -> dict[str, Any]:
    """This process's convolution and matrix-product FLOP/s, memory bytes/s and op cost
    (``quick``: small shapes, for tests: the rates it gives are not the machine's), on
    ``device`` (default the CPU), each timing the median of ``batches`` batches; grid_flops:
    see :attr:`Effort.grid_flops`."""
    torch.manual_seed(0)
    dev = device or torch.device("cpu")

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=dev)

    def timed(fn: Callable[[], Any], seconds: float) -> float:
        return _timed(fn, seconds, batches, dev)

    convs = []
    for n, cin, cout, side in CONV_SHAPES:
        side = side // 8 if quick else side
        x = randn(n, cin, side, side)
        w = randn(cout, cin, 3, 3)

        def conv(x: torch.Tensor = x, w: torch.Tensor = w) -> torch.Tensor:
            return F.conv2d(x, w, padding=1)

        t = timed(conv, min_run_time)
        flops = 2 * n * cout * side * side * cin * 9  # multiply-add = 2, as FlopCounterMode
        convs.append({"shape": [n, cin, cout, side], "seconds": t, "flops": flops})
    grid = []
    for c in GRID_CHANNELS:
        for k in (1, 3):
            side = 8 if quick else 32
            if grid_flops and 2 * 4 * c * side * side * c * k * k > grid_flops:
                side = 16
            xg, wg = randn(4, c, side, side), randn(c, c, k, k)
            tg = timed(lambda xg=xg, wg=wg, k=k: F.conv2d(xg, wg, padding=k // 2),
                       min_run_time / 4)
            grid.append((c, k, 2 * 4 * c * side * side * c * k * k / tg))
    act = randn(8 if not quick else 2, 64, 64 if not quick else 16, 64)
    dw = randn(64, 1, 3, 3)
    t_dw = timed(lambda: F.conv2d(act, dw, padding=1, groups=64), min_run_time)
    dw_flops = 2 * act.numel() * 9
    a, w = (randn(16, 128), randn(128, 128)) if quick else (randn(256, 1024), randn(1024, 1024))
    t_mm = timed(lambda: F.linear(a, w), min_run_time)
    mm_flops = 2 * a.shape[0] * a.shape[1] * w.shape[0]
    big = randn((1 if quick else 4) << 20)  # an activation's size (16 MiB)
    t_mem = timed(lambda: torch.relu(big), min_run_time)
    ones, zeros = torch.ones(64, device=dev), torch.zeros(64, device=dev)
    t_norm = timed(lambda: F.batch_norm(act, zeros.clone(), ones.clone(), ones, zeros, True),
                   min_run_time)
    one = randn(1)
    t_op = timed(lambda: torch.relu(one), min_run_time)
    t_pool = timed(lambda: F.max_pool2d(act, 3, 1, 1), min_run_time)  # AmoebaNet's pool
    calls = call_cost(randn, max(batches, 5), quick, device)
    return {
        "conv_flops": statistics.median(c["flops"] / c["seconds"] for c in convs),
        "matmul_flops": mm_flops / t_mm,
        "mem_bytes": 2 * big.numel() * big.element_size() / t_mem,
        "norm_bytes": 2 * act.numel() * act.element_size() / t_norm,
        "dwconv_flops": dw_flops / t_dw,
        "pool_rate": act.numel() * 9 / t_pool,
        "conv_grid": grid,
        "conv_pixels": statistics.median(c["conv_pixels"] for c in calls),
        "op_s": t_op,
        "convs": convs, "matmul_s": t_mm, "relu_s": t_mem, "relu_values": big.numel(),
        "batch_norm_s": t_norm, "batch_norm_shape": list(act.shape), "max_pool_s": t_pool,
        "calls": calls,
    }


def call_cost(randn: Callable[..., torch.Tensor], repeats: int = 5, quick: bool = False,
              device: torch.device | None = None) -> list[dict[str, Any]]:
    """A convolution call's fixed cost as rows of work (``Profile.conv_pixels``): per channel
    count of :data:`CALL_CHANNELS`, a 3x3 convolution's forward and backward on one image of
    each of ``CALL_SIDES`` (``a`` < ``b`` rows), fitted to ``t = k (rows + p0)``:
    ``p0 = (q b - a) / (1 - q)`` with ``q = t_a / t_b`` (>= 0). The two sizes alternate
    ``repeats`` times and ``q`` is the median of each pair's ratio, so a machine that slows
    down for a while (a shared core) slows both sides of a pair alike."""
    out = []
    (ra, rb) = (side * side for side in CALL_SIDES)
    for c in CALL_CHANNELS:
        c = c // 8 if quick else c
        w = randn(c, c, 3, 3).requires_grad_()
        xs = [randn(1, c, side, side).requires_grad_() for side in CALL_SIDES]

        def step(x: torch.Tensor, calls: int, w: torch.Tensor = w) -> float:
            _sync(device)
            t0 = time.perf_counter()
            for _ in range(calls):
                F.conv2d(x, w, padding=1).sum().backward()
            _sync(device)
            return (time.perf_counter() - t0) / calls

        small = max(1, rb // ra // 4)  # calls of the small image per pair: a similar span
        step(xs[0], 1), step(xs[1], 1)  # warm-up
        pairs = [(step(xs[0], small), step(xs[1], 1)) for _ in range(repeats)]
        q = statistics.median(ta / tb for ta, tb in pairs)
        out.append({"channels": c, "rows": [ra, rb], "seconds": pairs,
                    "conv_pixels": fixed_rows(ra, rb, q)})
    return out


def fixed_rows(a: int, b: int, q: float) -> float:
    """``p0`` of ``t = k (rows + p0)`` from ``q = t(a) / t(b)``, ``a < b`` rows (>= 0; a ratio
    of 1 or more, the small call as slow as the large one, gives 0: no fit)."""
    return max((q * b - a) / (1 - q), 0.0) if q < 1 else 0.0


def fit(points: list[tuple[float, float]]) -> Link:
    """``seconds = alpha + beta * bytes`` through ``(bytes, seconds)`` points: alpha is the
    smallest message's time (a free intercept is lost in the large messages' noise), beta the
    least-squares slope of the rest above it (>= 0)."""
    points = sorted(points)
    alpha = max(points[0][1], 0.0)
    num = sum(b * (t - alpha) for b, t in points[1:])
    den = sum(b * b for b, _ in points[1:])
    return Link(alpha, max(num / den, 0.0) if den else 0.0)


def _sync(device: torch.device | None) -> None:
    """Wait for ``device``'s queued kernels (a GPU's; nothing on the CPU)."""
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)


def _pingpong(comm: Comm, nbytes: int, repeats: int, device: torch.device | None = None
              ) -> float:
    buf = torch.zeros(max(nbytes // 4, 1), device=device)
    comm.barrier()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        if comm.rank == 0:
            comm.send(buf, 1)
            comm.recv(buf, 1)
        elif comm.rank == 1:
            comm.recv(buf, 0)
            comm.send(buf, 0)
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) / 2


def _allreduce(comm: Comm, nbytes: int, repeats: int, device: torch.device | None = None
               ) -> float:
    buf = torch.zeros(max(nbytes // 4, 1), device=device)
    comm.barrier()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        comm.allreduce(buf)
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def communication(comm: Comm, repeats: int = 20, device: torch.device | None = None
                  ) -> dict[str, Any]:
    """Ping-pong (ranks 0 and 1) and allreduce (all ranks) timings of tensors on ``device``
    (default the CPU) and their fitted links; every rank takes part, rank 0's figures count.
    Each size's time is the median of ``repeats`` (a rank descheduled once on a loaded machine
    moves a mean by milliseconds)."""
    g = comm.size
    p2p = [(float(b), _pingpong(comm, b, repeats, device)) for b in SIZES]
    ar = [(float(b), _allreduce(comm, b, repeats, device)) for b in SIZES]
    per_step = [(b / g, t / (2 * (g - 1))) for b, t in ar]
    return {"p2p": fit(p2p), "allreduce": fit(per_step), "p2p_points": p2p,
            "allreduce_points": ar}


TILE_LAYERS = 8
"""Convolution + BatchNorm + ReLU blocks of the model that measures the cost of a tile op."""
TILE_SIZES = ((2, 8, 16), (4, 32, 64))
"""(batch, channels, side) of its two inputs: a tiny one (the fixed cost) and one of 2 MiB
(how the cost grows with the tile)."""


def tile_ops(comm: Comm, repeats: int, device: torch.device | None = None,
             layers: int = TILE_LAYERS) -> dict[str, Any]:
    """What one tile op of a spatial stage costs in fxpar's own runtime: a model of ``layers``
    3x3 convolution + BatchNorm + ReLU blocks (2 tile ops each, both ways), its step timed on
    ranks 0 and 1 as ``Plan(spatial_parts=2)`` and on each alone as ``Plan()``;
    per tile op, (SP step - one rank's step / 2) / (4 x blocks), at the two ``TILE_SIZES``:
    ``tile_op_s`` the small one's cost, ``tile_op_bytes`` the bytes/s of the growth between
    them. Every rank of ``comm`` takes part (the others wait). The programs are made with
    ``for_rank``, not ``local``: the start-up check of ``local`` would count as the job's
    (failfast.agreements), and the model here is the same on every rank by construction."""
    from torch import nn

    from fxpar.compiler.driver import compile as fx_compile
    from fxpar.core.plan import Plan
    from fxpar.frontend.share import CaptureCache

    captures = CaptureCache()  # each model traced once, for both plans

    pair = comm.split(0 if comm.rank < 2 else 1)
    alone = comm.split(comm.rank)
    out: dict[str, Any] = {"sizes": []}
    for batch, channels, side in TILE_SIZES:
        torch.manual_seed(0)
        blocks = [nn.Sequential(nn.Conv2d(channels, channels, 3, padding=1),
                                nn.BatchNorm2d(channels), nn.ReLU())
                  for _ in range(layers)]
        model = nn.Sequential(*blocks, nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                              nn.Linear(channels, 2))
        x = torch.randn(batch, channels, side, side, device=device)
        y = torch.arange(batch, device=device) % 2
        meta = torch.empty(x.shape, device="meta")

        def step_time(plan: Plan, group: Comm, model: nn.Module = model,
                      x: torch.Tensor = x, y: torch.Tensor = y,
                      meta: torch.Tensor = meta) -> float:
            rp = fx_compile(model, plan, meta, captures=captures).for_rank(group.rank, group)
            if device is not None:
                rp.to(device)
            rp.train_step(x, y)
            times = []
            for _ in range(repeats):
                _sync(device)
                t0 = time.perf_counter()
                rp.train_step(x, y)
                _sync(device)
                times.append(time.perf_counter() - t0)
            rp.close()
            return statistics.median(times)

        one = step_time(Plan(), alone)
        comm.barrier()
        sp = step_time(Plan(spatial_parts=2), pair) if comm.rank < 2 else 0.0
        comm.barrier()
        out["sizes"].append({"shape": [batch, channels, side, side], "sp2_step_s": sp,
                             "one_rank_step_s": one, "tile_bytes": x.numel() * 4 // 2,
                             "per_op_s": max(sp - one / 2, 0.0) / (4 * layers)})
    small, large = out["sizes"][0], out["sizes"][-1]
    grow = (large["per_op_s"] - small["per_op_s"]) / (large["tile_bytes"] - small["tile_bytes"])
    out["tile_op_s"] = small["per_op_s"]
    out["tile_op_bytes"] = 1 / grow if grow > 0 else 0.0
    pair.free()
    alone.free()
    return out


def calibrate(comm: Comm | None, name: str, quick: bool = False,
              ranks_per_node: int | None = None, *, effort: Effort | None = None,
              device: torch.device | None = None) -> Profile:
    """A profile of this machine: compute on rank 0 (the other ranks wait, asleep),
    communication over ``comm`` when it has 2 ranks or more. ranks_per_node: how many ranks
    jobs will place on one node (default: as many as this node has cores); its slots are its
    cores / threads (on GPUs: its GPUs). effort: how long to measure (default :data:`QUICK`
    with ``quick``, else :data:`FULL`). device: the CPU (default) or this rank's GPU."""
    how = effort or (QUICK if quick else FULL)
    rank = comm.rank if comm is not None else 0
    measured: dict[str, Any] = {"effort": asdict(how)}
    # every effort keeps the shapes (compute's ``quick`` shrinks them: not the machine's rates)
    t0 = time.perf_counter()
    comp = compute(how.min_run_time, batches=how.batches, device=device,
                   grid_flops=how.grid_flops) if rank == 0 else {}
    if comm is not None:
        comm.barrier(poll=0.002)  # the others sleep: a spinning rank would take a core
    took = measured["seconds"] = {"compute": time.perf_counter() - t0}
    measured["compute"] = {k: v for k, v in comp.items()
                           if k in ("convs", "matmul_s", "relu_s", "relu_values", "batch_norm_s",
                                     "batch_norm_shape", "max_pool_s", "calls")}
    p2p = allreduce = Link(0.0, 0.0)
    tiles: dict[str, Any] = {}
    per_node = 1
    if comm is not None and comm.size > 1:
        t0 = time.perf_counter()
        got = communication(comm, how.messages, device)
        p2p, allreduce = got["p2p"], got["allreduce"]
        t1 = time.perf_counter()
        tiles = tile_ops(comm, how.steps, device, how.layers)
        took.update(communication=t1 - t0, tile_ops=time.perf_counter() - t1)
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
    gpu = device is not None and device.type == "cuda"
    slots = torch.cuda.device_count() if gpu else max(1, (os.cpu_count() or 1) // threads)
    measured["ranks_sharing_this_node"] = per_node
    return Profile(
        name=name, device="cuda" if gpu else "cpu", conv_flops=comp["conv_flops"],
        matmul_flops=comp["matmul_flops"], mem_bytes=comp["mem_bytes"], op_s=comp["op_s"],
        norm_bytes=comp["norm_bytes"], dwconv_flops=comp["dwconv_flops"],
        pool_rate=comp["pool_rate"], conv_grid=tuple(comp["conv_grid"]),
        conv_pixels=comp["conv_pixels"],
        tile_op_s=tiles["tile_op_s"] if tiles else 0.0,
        tile_op_bytes=tiles["tile_op_bytes"] if tiles else 0.0,
        p2p_intra=p2p, p2p_inter=p2p, allreduce_intra=allreduce, allreduce_inter=allreduce,
        ranks_per_node=ranks_per_node or max(per_node, slots), cores_per_rank=threads,
        slots_per_node=slots, measured=measured)
