"""Benchmark (by hand, not in CI): fxpar pipeline parallelism vs torch.distributed.pipelining vs
one process on torchvision resnet18, batch 32 at 128x128, 2 ranks, CPU; and fxpar's measured
pipeline bubble against the textbook (p-1)/(m+p-1).

Both pipelined systems get the same model and seed, the same stage split (stage 1 starts at
``layer3``), the same micro-batches and schedule, one compute thread per rank, and the same
launcher (``mpiexec -n 2``); only the transport differs: fxpar talks MPI (mpi4py over the MPICH
wheel, shared memory), torch talks gloo (TCP over loopback).

A section of the suite (``tools/benchlib.py`` has the contract; ``tools/bench.py`` renders
docs/benchmarks.md). Alone, it prints the Section JSON::

    .venv/bin/python tools/bench_pipeline.py --quick
    .venv/bin/python tools/bench_pipeline.py --rounds 5 --pipeline-rev HEAD

Worker mode (``--worker SYSTEM``) is what the driver launches, under ``mpiexec -n 2`` for the
pipelined systems; rank 0 prints one ``BENCH {json}`` line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from benchlib import (
    ROOT,
    emit,
    fmt_spread,
    machine,
    measure,
    rotate,
    snapshot,
    spread,
    thread_env,
    worker_command,
)

TITLE = "Pipeline parallelism: fxpar vs torch.distributed.pipelining, and the bubble"
BATCH, IMAGE, CLASSES, SEED, SPLIT, STAGES = 32, 128, 10, 0, "layer3", 2
SYSTEMS = ("fxpar", "torch", "single", "single-mb")
PIPELINED = ("fxpar", "torch")
AIM = 1.15  # issue 7's target for fxpar / torch pipelining
LABELS = {"fxpar": "fxpar PP (MPI)", "torch": "torch.distributed.pipelining (gloo)",
          "single": "one process, full batch", "single-mb": "one process, micro-batches + accum"}


# -- worker -----------------------------------------------------------------------------------
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


def busy_time(actions: Iterable[tuple[str, float, float, float]]) -> float:
    """Seconds a rank computed in one step: F and B actions (kind, start, end, wait) minus the
    time they sat blocked on a receive. The optimizer STEP is left out, as the formula does."""
    return sum(max(end - start - wait, 0.0) for kind, start, end, wait in actions
               if kind in ("F", "B"))


def fxpar_balance(model: Any) -> tuple[int, int]:
    """fxpar's ``Plan.balance`` that starts stage 1 at the first node of ``SPLIT`` (balance
    counts compute nodes in graph order, the split pass's own ``compute_nodes``)."""
    import fxpar
    from fxpar.core.meta import module_path
    from fxpar.passes.split_stages import compute_nodes

    nodes = compute_nodes(fxpar.trace(model, (8, 3, IMAGE, IMAGE)))
    # the captured graph names ATen calls (conv2d_12); the module path says where they come from
    idx = next(i for i, n in enumerate(nodes) if module_path(n).split(".")[0] == SPLIT)
    return idx, len(nodes) - idx


def run_fxpar(args: argparse.Namespace) -> dict[str, Any]:
    """fxpar as a user would run it: compile once, then ``train_step`` on the global batch on
    every rank (it returns the loss everywhere, so its step includes one scalar allreduce).
    The runtime's action timeline is on for every step (a few perf_counter calls per action):
    it gives each rank's busy time for the bubble."""
    import torch
    from mpi4py import MPI

    import fxpar

    model, x, y = _setup(args.threads)
    plan = fxpar.Plan(stages=STAGES, microbatches=args.microbatches, schedule=args.schedule,
                      balance=fxpar_balance(model))
    program = fxpar.compile(model, plan, torch.empty(BATCH, 3, IMAGE, IMAGE, device="meta"),
                            optimizer=lambda ps: torch.optim.SGD(ps, lr=0.01))
    rp = program.local()
    comm = MPI.COMM_WORLD
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
    return {"times": times, "stage_params": comm.gather(n_params), "rank": comm.Get_rank(),
            "ranks": comm.gather(mine), "balance": list(plan.balance or ()),
            "fxpar": str(Path(fxpar.__file__).parent),
            "transport": "MPI: " + " ".join(MPI.Get_library_version().split()[:3])}


def run_torch(args: argparse.Namespace) -> dict[str, Any]:
    """torch.distributed.pipelining as its docs show it (tracer frontend, ``build_stage``,
    a schedule object, SGD on the stage's parameters); outputs are not returned, as in fxpar."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from mpi4py import MPI
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe, SplitPoint, pipeline

    comm = MPI.COMM_WORLD  # only the launcher's rank/size; all tensors go through gloo
    rank, size = comm.Get_rank(), comm.Get_size()
    dist.init_process_group("gloo", rank=rank, world_size=size)
    model, x, y = _setup(args.threads)
    mb = BATCH // args.microbatches
    pipe = pipeline(model, mb_args=(x[:mb],), split_spec={SPLIT: SplitPoint.BEGINNING})
    stage = pipe.build_stage(rank, torch.device("cpu"))
    opt = torch.optim.SGD(stage.submod.parameters(), lr=0.01)
    kind = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[args.schedule]
    sched = kind(stage, n_microbatches=args.microbatches, loss_fn=F.cross_entropy)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        if rank == 0:
            sched.step(x)
        else:  # the last of 2 stages
            sched.step(target=y, losses=[], return_outputs=False)
        opt.step()

    n_params = sum(p.numel() for p in stage.submod.parameters())
    times = _timed(step, args.warmup, args.steps, comm.Barrier)
    out = {"times": times, "stage_params": comm.gather(n_params), "rank": rank,
           "transport": f"torch.distributed {dist.get_backend()}"}
    dist.destroy_process_group()
    return out


def run_single(args: argparse.Namespace, accumulate: bool) -> dict[str, Any]:
    """Plain PyTorch, one process: the full batch at once, or the same micro-batches with
    gradient accumulation (what the pipelines compute, without the second core)."""
    import torch
    import torch.nn.functional as F

    model, x, y = _setup(args.threads)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    m = args.microbatches if accumulate else 1
    xs, ys = x.chunk(m), y.chunk(m)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        for xi, yi in zip(xs, ys, strict=True):
            (F.cross_entropy(model(xi), yi) / m).backward()
        opt.step()

    times = _timed(step, args.warmup, args.steps, lambda: None)
    return {"times": times, "stage_params": [sum(p.numel() for p in model.parameters())],
            "rank": 0, "transport": "none"}


def worker(argv: Sequence[str]) -> None:
    """Run one system; only rank 0 prints, so the driver reads exactly one record."""
    p = argparse.ArgumentParser(description="bench_pipeline worker (launched by the driver)")
    p.add_argument("--worker", choices=SYSTEMS, required=True)
    p.add_argument("--schedule", choices=["gpipe", "1f1b"], default="gpipe")
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--profile", default="", help="cProfile each rank to PREFIX.*.prof")
    args = p.parse_args(argv)
    if args.profile:
        import cProfile

        prof = cProfile.Profile()
        prof.enable()
    runners = {"fxpar": run_fxpar, "torch": run_torch,
               "single": lambda a: run_single(a, False),
               "single-mb": lambda a: run_single(a, True)}
    out = runners[args.worker](args)
    if args.profile:
        prof.disable()
        prof.dump_stats(f"{args.profile}.{args.worker}.rank{out['rank']}.prof")
    if out.pop("rank") == 0:
        import torch

        emit({**out, "torch_threads": torch.get_num_threads()})


# -- pure summaries (tested in tests/test_bench_pipeline.py) ----------------------------------
def bubble_formula(p: int, m: int) -> float:
    """The GPipe/1F1B bubble with p equal stages, m micro-batches and free communication."""
    return (p - 1) / (m + p - 1)


def launch_bubble(ranks: Sequence[dict[str, list[float]]]) -> dict[str, float]:
    """One fxpar launch's bubble: per timed step, 1 - sum of the ranks' busy time / (p x the
    step's wall time, the slowest rank's), then the median over steps; and the median stage 0 /
    stage 1 busy-time ratio (rank r holds stage r)."""
    p, steps = len(ranks), len(ranks[0]["wall"])
    bubbles, imbalance = [], []
    for i in range(steps):
        wall = max(r["wall"][i] for r in ranks)
        bubbles.append(1.0 - sum(r["busy"][i] for r in ranks) / (p * wall))
        imbalance.append(ranks[0]["busy"][i] / ranks[-1]["busy"][i])
    return {"bubble": statistics.median(bubbles), "imbalance": statistics.median(imbalance),
            "img_per_s": BATCH / statistics.median(max(r["wall"][i] for r in ranks)
                                                  for i in range(steps))}


def summarize(rounds: Sequence[dict[str, Any]], systems: Sequence[str]) -> dict[str, Any]:
    """Per system: img/s per round (batch / median step time), then median and range over
    rounds; ratios are taken within each round (same machine state), then summarised."""
    ips = {s: [BATCH / statistics.median(r[s]["times"]) for r in rounds] for s in systems}
    out: dict[str, Any] = {"img_per_s": {s: spread(v) for s, v in ips.items()}, "ratios": {}}
    for num, den in (("fxpar", "torch"), ("fxpar", "single"), ("fxpar", "single-mb"),
                     ("torch", "single")):
        out["ratios"][f"{num}/{den}"] = spread([a / b for a, b in zip(ips[num], ips[den],
                                                                      strict=True)])
    return out


def throughput_table(sched: str, m: int, s: dict[str, Any]) -> dict[str, Any]:
    """One schedule's systems: img/s median and range, and fxpar's per-round ratio to each."""
    rows = []
    for name, v in s["img_per_s"].items():
        r = s["ratios"].get(f"fxpar/{name}")
        rows.append([LABELS[name], f"{v['median']:.1f}", f"{v['min']:.1f}-{v['max']:.1f}",
                     fmt_spread(r, "x") if r else "-"])
    return {"title": f"Throughput, schedule `{sched}`, {m} micro-batches of {BATCH // m}",
            "columns": ["system", "median img/s", "range img/s", "fxpar / system (median, range)"],
            "rows": rows}


def aim_row(sched: str, m: int, ratio: dict[str, float]) -> dict[str, Any]:
    """Issue 7's aim for one schedule: fxpar / torch pipelining throughput >= AIM."""
    met = ratio["median"] >= AIM
    why = "" if met else (
        "Both systems run the same stage modules on the same per-stage schedule, so they do the "
        "same work along the same critical path, and the transport moves a few MiB per step "
        "against a step of seconds: a 15% lead would need torch to be 15% slower than its own "
        "compute, and it is not (see the notes). A lead has to come from different work: more "
        "micro-batches, fxpar's own stage cut, or spatial/GEMS plans torch cannot express.")
    return {"what": f"fxpar PP / torch.distributed.pipelining img/s, `{sched}`, m = {m}",
            "aim": f">= {AIM}x", "measured": fmt_spread(ratio, "x"), "met": met, "why": why}


def bubble_rows(bubble: dict[str, dict[int, list[dict[str, float]]]]) -> list[list[str]]:
    """Rows of the bubble table: schedule, m, formula and measured (median, range)."""
    rows = []
    for sched, per_m in bubble.items():
        for m, recs in sorted(per_m.items()):
            b = spread([100 * r["bubble"] for r in recs])
            rows.append([f"`{sched}`", str(m), str(BATCH // m),
                         f"{100 * bubble_formula(STAGES, m):.1f}%", fmt_spread(b, "%", 1),
                         f"{statistics.median(r['imbalance'] for r in recs):.2f}",
                         f"{statistics.median(r['img_per_s'] for r in recs):.1f}",
                         str(len(recs))])
    return rows


def bubble_plot(bubble: dict[str, dict[int, list[dict[str, float]]]]) -> dict[str, Any]:
    """Measured median bubble per schedule against the formula, over m."""
    ms = sorted({m for per_m in bubble.values() for m in per_m})
    series = {"formula (p-1)/(m+p-1)": [[m, 100 * bubble_formula(STAGES, m)]
                                        for m in range(min(ms), max(ms) + 1)]}
    for sched, per_m in bubble.items():
        series[f"fxpar {sched}, measured"] = [
            [m, 100 * statistics.median(r["bubble"] for r in recs)]
            for m, recs in sorted(per_m.items())]
    return {"file": "pipeline_bubble.png", "title": "Pipeline bubble, 2 stages, batch 32",
            "xlabel": "micro-batches m", "ylabel": "bubble, % of p x step time", "kind": "line",
            "series": series}


# -- driver -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Config:
    """The run's settings after ``--quick`` has been applied."""

    rounds: int
    warmup: int
    steps: int
    microbatches: int
    schedules: tuple[str, ...]
    bubble_ms: tuple[int, ...]
    bubble_rounds: int
    threads: int
    max_foreign: float
    retries: int
    timeout: float
    rev: str


def add_args(parser: argparse.ArgumentParser) -> None:
    """This section's options (the suite's common ones are --rounds, --quick, ...)."""
    g = parser.add_argument_group("pipeline")
    g.add_argument("--pipeline-schedules", default="gpipe,1f1b", help="comma-separated")
    g.add_argument("--pipeline-microbatches", type=int, default=4,
                   help="micro-batches of the fxpar / torch / one-process comparison")
    g.add_argument("--pipeline-warmup", type=int, default=2, help="untimed steps per launch")
    g.add_argument("--pipeline-steps", type=int, default=5, help="timed steps per launch")
    g.add_argument("--pipeline-threads", type=int, default=1, help="intra-op threads per rank")
    g.add_argument("--pipeline-bubble-microbatches", default="1,2,4,8",
                   help="comma-separated m of the bubble table (quick: 2,4)")
    g.add_argument("--pipeline-bubble-rounds", type=int, default=3,
                   help="launches per (schedule, m) of the bubble, at most --rounds")
    g.add_argument("--pipeline-rev", default="", help="measure this commit (git archive to a "
                   "temporary folder) instead of the working tree")


def config(opts: argparse.Namespace) -> Config:
    """``opts`` with this section's defaults for what the caller did not set."""
    p = argparse.ArgumentParser(add_help=False)
    add_args(p)
    o = {**vars(p.parse_args([])), **vars(opts)}
    ints = (lambda s: tuple(int(v) for v in str(s).split(",") if v))  # noqa: E731
    quick = bool(o.get("quick"))
    cfg = Config(
        rounds=1 if quick else int(o.get("rounds", 5)),
        warmup=1 if quick else o["pipeline_warmup"], steps=2 if quick else o["pipeline_steps"],
        microbatches=o["pipeline_microbatches"],
        schedules=tuple(s for s in o["pipeline_schedules"].split(",") if s),
        bubble_ms=(2, 4) if quick else ints(o["pipeline_bubble_microbatches"]),
        bubble_rounds=1 if quick else min(int(o.get("rounds", 5)), o["pipeline_bubble_rounds"]),
        threads=o["pipeline_threads"], max_foreign=float(o.get("max_foreign", 0.25)),
        retries=int(o.get("retries", 3)), timeout=float(o.get("timeout", 300.0)),
        rev=o["pipeline_rev"])
    bad = [m for m in (cfg.microbatches, *cfg.bubble_ms) if m < 1 or BATCH % m]
    if bad or set(cfg.schedules) - {"gpipe", "1f1b"}:
        raise SystemExit(f"bench_pipeline: micro-batch counts must divide the batch {BATCH} "
                         f"(got {bad}) and schedules be gpipe/1f1b (got {cfg.schedules})")
    return cfg


def _measure(system: str, sched: str, m: int, cfg: Config, src: Path) -> dict[str, Any]:
    """One fresh worker launch, with benchlib's quiet-machine guard."""
    args = ["--worker", system, "--schedule", sched, "--microbatches", str(m),
            "--warmup", str(cfg.warmup), "--steps", str(cfg.steps), "--threads", str(cfg.threads)]
    cmd = worker_command("bench_pipeline.py", args, STAGES if system in PIPELINED else None)
    rec = measure(cmd, thread_env(cfg.threads, src), retries=cfg.retries,
                  max_foreign=cfg.max_foreign, timeout=cfg.timeout)
    print(f"  pipeline {sched:5} m={m} {system:9} {BATCH / statistics.median(rec['times']):6.1f}"
          f" img/s  foreign {rec['foreign']:.2f}  ({rec['wall']:.0f} s)", file=sys.stderr,
          flush=True)
    return rec


def run(opts: argparse.Namespace) -> dict[str, Any]:
    """Comparison rounds (every system once per round and schedule, order rotated), then the
    bubble launches of fxpar over m (the comparison's own fxpar launches serve its m)."""
    cfg = config(opts)
    src, rev = snapshot(cfg.rev) if cfg.rev else (ROOT, "working tree")
    m0 = cfg.microbatches
    comp: dict[str, list[dict[str, Any]]] = {s: [] for s in cfg.schedules}
    for r in range(cfg.rounds):
        for sched in cfg.schedules:
            rnd = {}
            for system in rotate(SYSTEMS, r):
                if system.startswith("single") and sched != cfg.schedules[0]:
                    rnd[system] = comp[cfg.schedules[0]][r][system]  # schedule-independent
                else:
                    rnd[system] = _measure(system, sched, m0, cfg, src)
            comp[sched].append(rnd)
    bubble: dict[str, dict[int, list[dict[str, float]]]] = {s: {} for s in cfg.schedules}
    for sched in cfg.schedules:
        if m0 in cfg.bubble_ms:
            bubble[sched][m0] = [launch_bubble(rnd["fxpar"]["ranks"]) for rnd in comp[sched]]
    bubble_raw: list[dict[str, Any]] = []
    for r in range(cfg.bubble_rounds):
        for sched in cfg.schedules:
            for m in rotate([m for m in cfg.bubble_ms if m != m0], r):
                rec = _measure("fxpar", sched, m, cfg, src)
                bubble[sched].setdefault(m, []).append(launch_bubble(rec["ranks"]))
                bubble_raw.append({"schedule": sched, "m": m, "ranks": rec["ranks"],
                                   "foreign": rec["foreign"], "attempt": rec["attempt"]})
    return section(cfg, comp, bubble, bubble_raw, rev)


def section(cfg: Config, comp: dict[str, list[dict[str, Any]]],
            bubble: dict[str, dict[int, list[dict[str, float]]]],
            bubble_raw: list[dict[str, Any]], rev: str) -> dict[str, Any]:
    """The Section (see benchlib) from the launches' records."""
    first = comp[cfg.schedules[0]][0]
    results = {s: summarize(comp[s], SYSTEMS) for s in cfg.schedules}
    foreign = [rnd[s]["foreign"] for rounds in comp.values() for rnd in rounds for s in SYSTEMS]
    foreign += [b["foreign"] for b in bubble_raw]
    argv = [str(Path(sys.argv[0]).resolve().relative_to(ROOT))
            if Path(sys.argv[0]).resolve().is_relative_to(ROOT) else sys.argv[0], *sys.argv[1:]]
    tables = [throughput_table(s, cfg.microbatches, results[s]) for s in cfg.schedules]
    tables.append({"title": f"Pipeline bubble of fxpar, p = {STAGES} stages, batch {BATCH}",
                   "columns": ["schedule", "m", "micro-batch", "formula (p-1)/(m+p-1)",
                               "measured (median, range)", "stage 0 / stage 1 compute",
                               "img/s", "launches"],
                   "rows": bubble_rows(bubble)})
    return {
        "name": "pipeline", "title": TITLE, "command": "python " + " ".join(argv),
        "method": method(cfg, first, max(foreign), rev), "machine": machine(),
        "tables": tables, "plots": [bubble_plot(bubble)],
        "aims": [aim_row(s, cfg.microbatches, results[s]["ratios"]["fxpar/torch"])
                 for s in cfg.schedules],
        "notes": notes(cfg, results, bubble, comp, bubble_raw),
        "raw": {"config": asdict(cfg),
                "revision": rev, "results": results,
                "bubble": {s: {str(m): v for m, v in per_m.items()}
                           for s, per_m in bubble.items()},
                "comparison": {s: [{k: {f: rnd[k][f] for f in ("times", "foreign", "attempt")}
                                    for k in SYSTEMS} for rnd in rounds]
                               for s, rounds in comp.items()},
                "bubble_launches": bubble_raw,
                "stage_params": {k: first[k]["stage_params"] for k in PIPELINED},
                "balance": first["fxpar"]["balance"],
                "fxpar_imported_from": first["fxpar"]["fxpar"],
                "transport": {k: first[k]["transport"] for k in PIPELINED},
                "max_foreign_cores": max(foreign)},
    }


def method(cfg: Config, first: dict[str, Any], max_foreign: float, rev: str) -> str:
    """How it was measured, with what this run's workers reported (split, transports)."""
    sp = first["fxpar"]["stage_params"], first["torch"]["stage_params"]
    same = "the same in both" if sp[0] == sp[1] else "**they differ**"
    return (
        f"torchvision resnet18(num_classes={CLASSES}), float32, batch {BATCH} at {IMAGE}x{IMAGE},"
        f" SGD lr 0.01, synthetic data, seed {SEED}, {cfg.threads} intra-op thread per rank. "
        + (f"fxpar as of commit {rev} (`--pipeline-rev`, exported with `git archive`). "
           if cfg.rev else "")
        + f"Pipelines: {STAGES} ranks under `mpiexec -n {STAGES}`, stage 1 starts at `{SPLIT}` "
        f"(stage parameter counts fxpar {sp[0]}, torch {sp[1]}: {same}; fxpar balance "
        f"{first['fxpar']['balance']}). Transports: fxpar {first['fxpar']['transport']} "
        f"(mpi4py, shared memory); torch {first['torch']['transport']} (TCP over loopback). "
        f"{cfg.rounds} round(s), each launching every system once as a fresh process in an order "
        f"rotated per round; a launch runs {cfg.warmup} warm-up + {cfg.steps} timed steps and "
        f"scores batch / median step time; ratios are per round, then median (range). A launch "
        f"during which other processes took over {cfg.max_foreign} cores was redone (up to "
        f"{cfg.retries} times); the kept launches saw at most {max_foreign:.2f}.\n\n"
        f"Bubble: fxpar's runtime records every action's start, end and receive wait "
        f"(`Runtime.timeline`, as `fxpar-run --metrics` does). A rank's busy time in a step is "
        f"the sum of its F and B actions minus their waits; the step's bubble is 1 - (sum of "
        f"the ranks' busy time) / (p x the step's wall time, the slower rank's `train_step`), "
        f"median over the timed steps, then median (range) over {cfg.bubble_rounds} launch(es) "
        f"per schedule and m (at m = {cfg.microbatches} the comparison's fxpar launches). The "
        f"formula (p-1)/(m+p-1) assumes equal stages and free communication; the measurement "
        f"also counts stage imbalance (the slower stage sets the pace; its ratio is in the "
        f"table), waits for the peer's activations or gradients, the optimizer step, the loss "
        f"allreduce and the Python between actions, so expect it at or above the formula.")


def disturbed(cfg: Config, comp: dict[str, list[dict[str, Any]]],
              bubble_raw: Sequence[dict[str, Any]]) -> list[str]:
    """Kept launches during which other processes took over ``max_foreign`` cores (retries
    exhausted): their numbers are the machine's, not the system's."""
    out = [f"`{sched}` round {r + 1} {s} ({rnd[s]['foreign']:.2f} cores)"
           for sched, rounds in comp.items() for r, rnd in enumerate(rounds) for s in SYSTEMS
           if rnd[s]["foreign"] > cfg.max_foreign
           and not (s.startswith("single") and sched != cfg.schedules[0])]
    return out + [f"`{b['schedule']}` m = {b['m']} fxpar ({b['foreign']:.2f} cores)"
                  for b in bubble_raw if b["foreign"] > cfg.max_foreign]


def notes(cfg: Config, results: dict[str, Any], bubble: dict[str, dict[int, list[dict]]],
          comp: dict[str, list[dict[str, Any]]], bubble_raw: Sequence[dict[str, Any]]) -> str:
    """The analysis that stays true from run to run; numbers are this run's or a formula's."""
    m = cfg.microbatches
    level = all(1 / 1.1 <= r["ratios"]["fxpar/torch"]["median"] <= 1.1
                for r in results.values())
    head = ("**fxpar and torch.distributed.pipelining are level within this machine's noise**"
            if level else "**fxpar/torch is outside +-10% in this run**: read it against the "
            "disturbed launches below; with equal work on an equal schedule (below), a real lead "
            "is not expected")
    bad = disturbed(cfg, comp, bubble_raw)
    noise = (f"Kept although other processes took over {cfg.max_foreign} cores meanwhile "
             f"(retries exhausted), so not to be trusted: {'; '.join(bad)}." if bad else
             f"No kept launch saw other processes take over {cfg.max_foreign} cores.")
    ratios = ", ".join(f"`{s}` {fmt_spread(r['ratios']['fxpar/torch'], 'x')}"
                       for s, r in results.items())
    single = ", ".join(f"`{s}` {fmt_spread(r['ratios']['fxpar/single'], 'x')}"
                       for s, r in results.items())
    step = statistics.median(t for rounds in comp.values() for rnd in rounds
                             for t in rnd["fxpar"]["times"])
    measured = ", ".join(f"`{s}` {100 * statistics.median(r['bubble'] for r in per_m[m]):.0f}%"
                         for s, per_m in bubble.items() if m in per_m)
    mib = (BATCH // m) * 128 * (IMAGE // 8) ** 2 * 4 / 2**20
    return (
        f"{head} (fxpar/torch this run: {ratios}). {noise} One system's throughput moves by "
        f"several percent from round to round, so the sign of a 5% difference is not resolved, "
        f"a 15% lead would be. Why fxpar cannot pull ahead on this comparison:\n\n"
        f"- **Same work.** Both systems run the same stage split, and each stage module alone "
        f"(forward + backward of one micro-batch, one thread) takes the same time in both "
        f"(checked by hand). Both schedules give each rank the same per-stage order, hence the "
        f"same bubble: the formula gives {100 * bubble_formula(STAGES, m):.0f}% at p = {STAGES}, "
        f"m = {m}; fxpar's measured bubble this run: {measured or 'not measured at this m'} "
        f"(see the bubble table).\n"
        f"- **fxpar's runtime adds next to nothing.** Its timelines show compute back to back "
        f"along the critical path, the gaps being waits for the slower stage (imbalance, not "
        f"overhead); Python dispatch, MPI calls and copies add milliseconds. torch's timeline "
        f"has the same shape.\n"
        f"- **Transport does not matter at this size.** A step moves 2 x {m} tensors of "
        f"{mib:.1f} MiB (the `layer2` output of a micro-batch, and its gradient): milliseconds "
        f"over MPI shared memory or gloo TCP against a {step:.2f} s step (this run's fxpar "
        f"median).\n"
        f"- **cProfile of both ranks** (worker `--profile PREFIX`) shows the same shape in both "
        f"systems: autograd backward and convolutions, then waiting for the peer.\n\n"
        f"A lead has to come from doing different work, which this comparison pins on purpose: "
        f"fxpar's cost model left alone picks its own cut (not measured here), more "
        f"micro-batches shrink the bubble for both, and spatial or GEMS plans have no "
        f"counterpart in torch pipelining. Against one process the ideal on 2 cores with this "
        f"bubble is 2 x m/(m+1) = {2 * m / (m + 1):.2f}x; fxpar/one process this run: {single}. "
        f"The gap is mostly two busy ranks sharing one small VM, not the smaller micro-batches "
        f"(compare the two one-process rows).")


def main() -> None:
    """Standalone: the suite's common options plus this section's; prints the Section JSON."""
    if "--worker" in sys.argv[1:]:
        worker(sys.argv[1:])
        return
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--quick", action="store_true",
                   help="1 round, 1 warm-up + 2 steps, bubble at m = 2, 4 only")
    p.add_argument("--max-foreign", type=float, default=0.25,
                   help="cores other processes may use during a launch before it is redone")
    p.add_argument("--retries", type=int, default=3)
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per launch")
    add_args(p)
    t0 = time.time()
    sec = run(p.parse_args())
    print(json.dumps(sec, indent=2))
    print(f"bench_pipeline: {time.time() - t0:.0f} s", file=sys.stderr)


if __name__ == "__main__":
    main()
