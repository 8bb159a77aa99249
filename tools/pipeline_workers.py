"""Workers of ``tools/bench_pipeline.py``: one launch trains torchvision resnet18 for a few steps
with one system (an fxpar schedule, a torch.distributed.pipelining schedule, or plain PyTorch in
one process) and rank 0 prints one ``BENCH {json}`` line (``benchlib.emit``).

The driver launches them, under ``mpiexec -n RANKS`` for the pipelined systems::

    mpiexec -n 2 python tools/pipeline_workers.py --worker fxpar:1f1b --ranks 2 --microbatches 4

Every system gets the same model and seed, the same batch, the same stage cut (``CUTS``: the
modules each stage starts at, for 2, 4 and 8 stages) and the same threads per rank. A system
with ``per_rank`` 2 cuts twice as many stages as ranks (virtual stages: stage s on rank
s % ranks, or torch's "V" placement for ZBV). Nothing here is imported by the driver except
these constants and ``SYSTEMS``: torch, fxpar and MPI are imported inside the workers.
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchlib import emit  # a sibling in tools/ (the script's folder, or on sys.path)

BATCH, IMAGE, CLASSES, SEED = 32, 128, 10, 0
CUTS: dict[int, tuple[str, ...]] = {
    2: ("layer3",),
    4: ("layer2", "layer3", "layer4"),
    8: ("layer1.1", "layer2.0", "layer2.1", "layer3.0", "layer3.1", "layer4.0", "layer4.1"),
}
"""Stages -> the modules where stages 1, 2, ... begin (resnet18's stem + 4 layers of 2 blocks).
Each layer costs about the same FLOPs (half the pixels, twice the channels), so the 4-stage cut
is one layer a stage (the stem rides with layer1) and the 8-stage cut one block a stage."""


@dataclass(frozen=True)
class System:
    """One thing the benchmark launches, keyed ``impl:name``."""

    key: str
    impl: str  # "fxpar" | "torch" | "single"
    schedule: str  # fxpar's Plan.schedule, or the torch.distributed.pipelining class
    per_rank: int = 1  # stages each rank holds
    twin: str = ""  # the fxpar schedule a torch system is the counterpart of
    placement: str = "loop"  # stage s on rank s % ranks; "v": rank r holds r and 2R-1-r

    @property
    def label(self) -> str:
        if self.impl == "single":
            return "one process, full batch (reference)"
        v = f", {self.per_rank} stages/rank" if self.per_rank > 1 else ""
        return f"{self.impl} `{self.schedule}`{v}"


SYSTEMS: dict[str, System] = {s.key: s for s in (
    System("fxpar:gpipe", "fxpar", "gpipe"),
    System("fxpar:1f1b", "fxpar", "1f1b"),
    System("fxpar:zero_bubble", "fxpar", "zero_bubble"),
    System("fxpar:interleaved_1f1b", "fxpar", "interleaved_1f1b", per_rank=2),
    System("fxpar:zero_bubble_v", "fxpar", "zero_bubble_v", per_rank=2, placement="v"),
    System("torch:gpipe", "torch", "ScheduleGPipe", twin="gpipe"),
    System("torch:1f1b", "torch", "Schedule1F1B", twin="1f1b"),
    # ZB1P with one stage per rank is ZB-H1, fxpar's zero_bubble
    System("torch:zero_bubble", "torch", "ScheduleInterleavedZeroBubble", twin="zero_bubble"),
    System("torch:interleaved_1f1b", "torch", "ScheduleInterleaved1F1B", per_rank=2,
           twin="interleaved_1f1b"),
    System("torch:interleaved_zb", "torch", "ScheduleInterleavedZeroBubble", per_rank=2),
    System("torch:zbv", "torch", "ScheduleZBVZeroBubble", per_rank=2, twin="zero_bubble_v",
           placement="v"),
    System("single", "single", "none"),
)}


def _setup(threads: int) -> tuple[Any, Any, Any]:
    """Model, batch and targets, identical in every system and rank (same seed, float32)."""
    import torch
    import torchvision

    torch.set_num_threads(threads)  # the env vars are set too; this covers intra-op threads
    torch.manual_seed(SEED)
    model = torchvision.models.resnet18(num_classes=CLASSES).float()
    gen = torch.Generator().manual_seed(SEED)
    x = torch.randn(BATCH, 3, IMAGE, IMAGE, generator=gen)
    y = torch.randint(0, CLASSES, (BATCH,), generator=gen)
    return model, x, y


def _timed(step: Any, warmup: int, steps: int, barrier: Any) -> list[float]:
    """Wall time of each of ``steps`` steps after ``warmup`` untimed ones; ranks start the timed
    steps together so rank 0's clock measures the pipeline, not a late peer."""
    for _ in range(warmup):
        step()
    barrier()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return times


def busy_time(actions: Sequence[tuple[str, float, float, float]]) -> float:
    """Seconds a rank computed in one step: F, B and W actions (kind, start, end, wait) minus
    the time they sat blocked on a receive. The optimizer STEP is left out, as the formula
    does."""
    return sum(max(end - start - wait, 0.0) for kind, start, end, wait in actions
               if kind in ("F", "B", "W"))


def stage_ranks(system: System, ranks: int) -> list[list[int]]:
    """Per rank, the stage indices it holds (in order)."""
    if system.placement == "v":
        return [[r, 2 * ranks - 1 - r] for r in range(ranks)]
    return [[r + k * ranks for k in range(system.per_rank)] for r in range(ranks)]


def starts(paths: Sequence[str], cuts: Sequence[str]) -> list[int]:
    """Index of the first module path inside each of ``cuts`` (a path is inside ``layer2``
    when it is ``layer2`` or starts with ``layer2.``), in order; raise when a cut is missing or
    the cuts are out of graph order."""
    out = []
    for cut in cuts:
        idx = next((i for i, p in enumerate(paths) if p == cut or p.startswith(cut + ".")), None)
        if idx is None:
            raise ValueError(f"no compute node comes from module {cut!r}")
        out.append(idx)
    if out != sorted(set(out)) or (out and out[0] == 0):
        raise ValueError(f"cuts {list(cuts)} start at nodes {out}: not increasing from > 0")
    return out


def balance_of(paths: Sequence[str], cuts: Sequence[str]) -> tuple[int, ...]:
    """``Plan.balance`` (compute nodes per stage, graph order) that starts a stage at each cut."""
    edges = [0, *starts(paths, cuts), len(paths)]
    return tuple(b - a for a, b in zip(edges, edges[1:], strict=False))


def fxpar_balance(model: Any, cuts: Sequence[str]) -> tuple[int, ...]:
    """fxpar's ``Plan.balance`` that starts a stage at the first node of each module of
    ``cuts`` (balance counts compute nodes in graph order, the split pass's own
    ``compute_nodes``; the captured graph names ATen calls, the module path says where they
    come from)."""
    import fxpar
    from fxpar.core.meta import module_path
    from fxpar.passes.split_stages import compute_nodes

    nodes = compute_nodes(fxpar.trace(model, (8, 3, IMAGE, IMAGE)))
    return balance_of([module_path(n) for n in nodes], cuts)


def run_fxpar(system: System, args: argparse.Namespace) -> dict[str, Any]:
    """fxpar as a user would run it: compile once, then ``train_step`` on the global batch on
    every rank (it returns the loss everywhere, so its step includes one scalar allreduce).
    The runtime's action timeline is on for every step (a few perf_counter calls per action):
    it gives each rank's busy time for the bubble. Rank 0 also simulates the compiled schedule
    with unit costs (F = 1, B = 2, or B = W = 1 when split) for the simulator's bubble."""
    import torch
    from mpi4py import MPI

    import fxpar
    from fxpar.compiler.driver import links_of
    from fxpar.perf.simulate import simulate

    comm = MPI.COMM_WORLD
    model, x, y = _setup(args.threads)
    n = comm.Get_size() * system.per_rank
    extra = {"stages_per_rank": system.per_rank} if system.per_rank > 1 else {}
    plan = fxpar.Plan(stages=n, microbatches=args.microbatches, schedule=system.schedule,
                      balance=fxpar_balance(model, CUTS[n]), **extra)
    program = fxpar.compile(model, plan, torch.empty(BATCH, 3, IMAGE, IMAGE, device="meta"),
                            optimizer=lambda ps: torch.optim.SGD(ps, lr=0.01))
    rp = program.local()
    timelines: list[list[Any]] = []

    def step() -> None:
        rp.runtime.timeline = []
        rp.train_step(x, y)
        timelines.append(rp.runtime.timeline)
        rp.runtime.timeline = None

    times = _timed(step, args.warmup, args.steps, comm.Barrier)
    flat = [[(t.action.kind, t.start, t.end, t.wait) for t in tl]
            for tl in timelines[args.warmup:]]
    mine = {"wall": times, "busy": [busy_time(tl) for tl in flat],
            "opt": [sum(e - s for k, s, e, _ in tl if k == "STEP") for tl in flat]}
    n_params = sum(p.numel() for p in rp.parameters())
    sim = simulate(program.schedule, links_of(program.graph)).bubble if comm.Get_rank() == 0 \
        else None
    return {"times": times, "stage_params": comm.gather(n_params), "rank": comm.Get_rank(),
            "ranks": comm.gather(mine), "balance": list(plan.balance or ()), "stages": n,
            "sim_bubble": sim, "fxpar": str(Path(fxpar.__file__).parent),
            "transport": "MPI: " + " ".join(MPI.Get_library_version().split()[:3])}


def run_torch(system: System, args: argparse.Namespace) -> dict[str, Any]:
    """torch.distributed.pipelining as its docs show it (tracer frontend, ``build_stage`` for
    each of the rank's stage indices, a schedule object over them, SGD on their parameters);
    outputs are not returned, as in fxpar."""
    import torch
    import torch.distributed as dist
    import torch.distributed.pipelining.schedules as schedules
    import torch.nn.functional as F
    from mpi4py import MPI
    from torch.distributed.pipelining import SplitPoint, pipeline

    comm = MPI.COMM_WORLD  # only the launcher's rank/size; all tensors go through gloo
    rank, size = comm.Get_rank(), comm.Get_size()
    dist.init_process_group("gloo", rank=rank, world_size=size)
    model, x, y = _setup(args.threads)
    n = size * system.per_rank
    mb = BATCH // args.microbatches
    pipe = pipeline(model, mb_args=(x[:mb],),
                    split_spec=dict.fromkeys(CUTS[n], SplitPoint.BEGINNING))
    if pipe.num_stages != n:
        raise RuntimeError(f"torch cut {pipe.num_stages} stages, expected {n}")
    mine = stage_ranks(system, size)[rank]
    stages = [pipe.build_stage(i, torch.device("cpu")) for i in mine]
    params = [p for st in stages for p in st.submod.parameters()]
    opt = torch.optim.SGD(params, lr=0.01)
    kind = getattr(schedules, system.schedule)
    single = issubclass(kind, schedules.PipelineScheduleSingle)
    sched = kind(stages[0] if single else stages, n_microbatches=args.microbatches,
                 loss_fn=F.cross_entropy)
    first, last = 0 in mine, n - 1 in mine

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        sched.step(*((x,) if first else ()), return_outputs=False,
                   **({"target": y, "losses": []} if last else {}))
        opt.step()

    times = _timed(step, args.warmup, args.steps, comm.Barrier)
    out = {"times": times, "stage_params": comm.gather(sum(p.numel() for p in params)),
           "rank": rank, "stages": n, "transport": f"torch.distributed {dist.get_backend()}"}
    dist.destroy_process_group()
    return out


def run_single(args: argparse.Namespace) -> dict[str, Any]:
    """Plain PyTorch, one process, the full batch at once: the reference the pipelines'
    second (third, fourth) core is for."""
    import torch
    import torch.nn.functional as F

    model, x, y = _setup(args.threads)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        opt.step()

    times = _timed(step, args.warmup, args.steps, lambda: None)
    return {"times": times, "stage_params": [sum(p.numel() for p in model.parameters())],
            "rank": 0, "stages": 1, "transport": "none"}


def worker(argv: Sequence[str]) -> None:
    """Run one system; only rank 0 prints, so the driver reads exactly one record. An
    exception on a pipelined rank aborts the whole job (its peers would wait forever)."""
    p = argparse.ArgumentParser(description="bench_pipeline worker (launched by the driver)")
    p.add_argument("--worker", choices=sorted(SYSTEMS), required=True)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--profile", default="", help="cProfile each rank to PREFIX.*.prof")
    args = p.parse_args(argv)
    system = SYSTEMS[args.worker]
    if args.profile:
        import cProfile

        prof = cProfile.Profile()
        prof.enable()
    try:
        if system.impl == "single":
            out = run_single(args)
        else:
            out = (run_fxpar if system.impl == "fxpar" else run_torch)(system, args)
    except BaseException:
        if system.impl == "single":
            raise
        traceback.print_exc()
        sys.stderr.flush()
        from mpi4py import MPI

        MPI.COMM_WORLD.Abort(1)
        raise
    if args.profile:
        prof.disable()
        prof.dump_stats(f"{args.profile}.{args.worker.replace(':', '-')}.rank{out['rank']}.prof")
    if out.pop("rank") == 0:
        import torch

        emit({**out, "torch_threads": torch.get_num_threads()})


if __name__ == "__main__":
    worker(sys.argv[1:])
