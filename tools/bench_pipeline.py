"""Benchmark (run by hand, not in CI): fxpar pipeline parallelism vs torch.distributed.pipelining
vs one process, on torchvision resnet18, batch 32 at 128x128, 2 ranks, CPU.

Both pipelined systems get the same model and seed, the same stage split (stage 1 starts at
``layer3``), the same micro-batches and schedule, one compute thread per rank, and the same
launcher (``mpiexec -n 2``); only the transport differs, and that is the point: fxpar talks MPI
(mpi4py over the MPICH wheel, shared memory), torch talks gloo (TCP over loopback).

The driver (default mode) launches a fresh worker per measurement, rotating the systems' order
every round so that a noisy machine's drifts hit all alike, and writes
``docs/bench_pipeline.json`` and a section of ``docs/benchmarks.md``::

    .venv/bin/python tools/bench_pipeline.py --rounds 5 --warmup 2 --steps 5

Worker mode (``--worker SYSTEM``) is what the driver runs; rank 0 prints one ``BENCH {json}``
line with the per-step wall times.
"""

from __future__ import annotations

import argparse
import atexit
import io
import json
import os
import platform
import re
import resource
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
BATCH, IMAGE, CLASSES, SEED, SPLIT = 32, 128, 10, 0, "layer3"
THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")
SECTION = "## Pipeline parallelism: fxpar vs torch.distributed.pipelining"
PIPELINED = ("fxpar", "torch")
AIM = 1.15  # the target for fxpar / torch pipelining
NOTES = "### Notes"  # hand-written analysis under this heading survives a re-run


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


def fxpar_balance(model: Any) -> tuple[int, int]:
    """fxpar's ``Plan.balance`` that starts stage 1 at the first node of ``SPLIT`` (balance
    counts compute nodes in graph order, the split pass's own ``compute_nodes``)."""
    import fxpar
    from passes.split_stages import compute_nodes

    nodes = compute_nodes(fxpar.trace(model, (8, 3, IMAGE, IMAGE)))
    idx = next(i for i, n in enumerate(nodes) if n.name.startswith(f"{SPLIT}_0"))
    return idx, len(nodes) - idx


def run_fxpar(args: argparse.Namespace) -> dict[str, Any]:
    """fxpar as a user would run it: compile once, then ``train_step`` on the global batch on
    every rank (it returns the loss everywhere, so its step includes one scalar allreduce)."""
    import torch
    from mpi4py import MPI

    import fxpar

    model, x, y = _setup(args.threads)
    plan = fxpar.Plan(stages=2, microbatches=args.microbatches, schedule=args.schedule,
                      balance=fxpar_balance(model))
    program = fxpar.compile(model, plan, torch.empty(BATCH, 3, IMAGE, IMAGE, device="meta"),
                            optimizer=lambda ps: torch.optim.SGD(ps, lr=0.01))
    rp = program.local()
    comm = MPI.COMM_WORLD
    n_params = sum(p.numel() for p in rp.parameters())
    times = _timed(lambda: rp.train_step(x, y), args.warmup, args.steps, comm.Barrier)
    return {"times": times, "stage_params": comm.gather(n_params), "rank": comm.Get_rank(),
            "balance": list(plan.balance or ()), "fxpar": str(Path(fxpar.__file__).parent),
            "transport":
            "MPI: " + " ".join(MPI.Get_library_version().split()[:3])}


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


def worker(args: argparse.Namespace) -> None:
    """Run one system; only rank 0 prints, so the driver reads exactly one record."""
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

        out["torch_threads"] = torch.get_num_threads()
        print("BENCH " + json.dumps(out), flush=True)


# -- driver -----------------------------------------------------------------------------------
def _free_port() -> int:
    """A port for gloo's rendezvous; fresh per launch so a lingering socket cannot collide."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _cpu_busy() -> float:
    """CPU-seconds all cores have been busy since boot (/proc/stat: all but idle and iowait;
    steal counts, since a neighbour VM taking our cores is noise too)."""
    f = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    return (sum(f) - f[3] - f[4]) / os.sysconf("SC_CLK_TCK")


def _children_cpu() -> float:
    """CPU-seconds of every waited-for descendant (mpiexec waits for its ranks)."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def wait_quiet(args: argparse.Namespace) -> float:
    """Wait (up to ``--quiet-wait`` s) until other processes use under ``--max-foreign`` cores:
    on a shared 2-core machine one concurrent test run halves a rank's speed."""
    t0 = time.time()
    while time.time() - t0 < args.quiet_wait:
        b0 = _cpu_busy()
        time.sleep(2.0)
        if (_cpu_busy() - b0) / 2.0 < args.max_foreign:
            break
    return time.time() - t0


def launch(system: str, args: argparse.Namespace) -> dict[str, Any]:
    """One fresh worker (2 ranks under mpiexec for the pipelined systems); its BENCH record,
    with ``foreign``: the cores other processes used meanwhile (busy CPU minus our own)."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", system,
           "--schedule", args.schedule, "--microbatches", str(args.microbatches),
           "--warmup", str(args.warmup), "--steps", str(args.steps),
           "--threads", str(args.threads)]
    if system in PIPELINED:
        cmd = [str(Path(sys.executable).parent / "mpiexec"), "-n", "2", *cmd]  # mpich wheel
    env = {**os.environ, **dict.fromkeys(THREAD_VARS, str(args.threads)),
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()),
           "PYTHONPATH": os.pathsep.join([str(args.src), os.environ.get("PYTHONPATH", "")])}
    t0, b0, c0 = time.time(), _cpu_busy(), _children_cpu()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=args.src, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=args.timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # our own session: mpiexec and its ranks
        out, err = proc.communicate()
    wall = time.time() - t0
    foreign = max(0.0, (_cpu_busy() - b0) - (_children_cpu() - c0)) / wall
    lines = [ln for ln in out.splitlines() if ln.startswith("BENCH ")]
    if proc.returncode or not lines:
        raise RuntimeError(f"{system} worker failed (rc {proc.returncode}):\n"
                           f"{out[-4000:]}\n{err[-8000:]}")
    return {**json.loads(lines[-1].removeprefix("BENCH ")), "foreign": foreign}


def measure(system: str, args: argparse.Namespace) -> dict[str, Any]:
    """``launch`` after a quiet spell; repeated (``--retries``) while another process took
    more than ``--max-foreign`` cores during it. The last attempt is kept either way."""
    for attempt in range(args.retries + 1):
        waited = wait_quiet(args)
        rec = launch(system, args)
        rec.update(attempt=attempt, waited=waited)
        if rec["foreign"] < args.max_foreign:
            break
        print(f"  {system}: {rec['foreign']:.2f} foreign cores meanwhile; again", flush=True)
    return rec


def _spread(values: list[float]) -> dict[str, float]:
    """Median and range: a noisy 2-core VM makes means and single runs misleading."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def summarize(rounds: list[dict[str, Any]], systems: list[str]) -> dict[str, Any]:
    """Per system: img/s per round (batch / median step time), then median and range over
    rounds; ratios are taken within each round (same machine state), then summarised."""
    ips = {s: [BATCH / statistics.median(r[s]["times"]) for r in rounds] for s in systems}
    out: dict[str, Any] = {"img_per_s": {s: _spread(v) for s, v in ips.items()}, "ratios": {}}
    for num, den in (("fxpar", "torch"), ("fxpar", "single"), ("torch", "single"),
                     ("fxpar", "single-mb")):
        out["ratios"][f"{num}/{den}"] = _spread([a / b for a, b in zip(ips[num], ips[den],
                                                                      strict=True)])
    return out


def machine() -> dict[str, Any]:
    """What the numbers depend on, for the doc (the driver never imports MPI: a singleton
    MPI_Init in the parent could clash with the mpiexec it launches)."""
    import torch

    cpu = re.search(r"model name\s*:\s*(.*)", Path("/proc/cpuinfo").read_text())
    return {"nproc": os.cpu_count(), "cpu": cpu.group(1) if cpu else platform.processor(),
            "torch": torch.__version__, "python": platform.python_version()}


def _git(*a: str) -> str:
    return subprocess.run(["git", *a], cwd=ROOT, capture_output=True, check=True).stdout.decode()


def snapshot(rev: str) -> tuple[Path, str]:
    """``rev`` exported to a temporary folder (``git archive``; the repository is only read),
    so that edits to the working tree during a long run cannot change what is measured."""
    folder = Path(tempfile.mkdtemp(prefix="bench-fxpar-"))
    atexit.register(shutil.rmtree, folder, True)  # also when a worker fails
    archive = subprocess.run(["git", "archive", rev], cwd=ROOT, capture_output=True, check=True)
    tarfile.open(fileobj=io.BytesIO(archive.stdout)).extractall(folder, filter="data")
    return folder, _git("rev-parse", "--short", rev).strip()


def revision() -> str:
    """The working tree's commit, marked ``+dirty`` when tracked files differ from it."""
    dirty = any(not ln.endswith(("docs/", "bench_pipeline.py"))
                for ln in _git("status", "--porcelain", "--untracked-files=no").splitlines())
    return _git("rev-parse", "--short", "HEAD").strip() + ("+dirty" if dirty else "")


def markdown(res: dict[str, Any]) -> str:
    """The doc section: how it was measured first, so the numbers can be reproduced."""
    a, m = res["args"], res["machine"]
    lines = [SECTION, "",
             f"Measured {res['date']} on fxpar {res['revision']} with `{res['command']}` "
             f"(by hand, not in CI).", "",
             f"- Machine: {m['nproc']} cores, {m['cpu']}, torch {m['torch']}, "
             f"Python {m['python']}; a shared, noisy VM.",
             f"- Model: torchvision resnet18(num_classes={CLASSES}), float32, batch {BATCH} at "
             f"{IMAGE}x{IMAGE}, SGD lr 0.01, synthetic data, seed {SEED}.",
             f"- Pipelines: 2 ranks under `mpiexec -n 2`, stage 1 starts at `{SPLIT}` in both "
             f"(stage parameter counts: fxpar {res['stage_params']['fxpar']}, torch "
             f"{res['stage_params']['torch']}; fxpar balance {res['balance']}), "
             f"{a['microbatches']} micro-batches of {BATCH // a['microbatches']}.",
             f"- Transports: fxpar {res['transport']['fxpar']} (mpi4py, shared memory); "
             f"torch {res['transport']['torch']} (TCP over loopback).",
             f"- Threads: {a['threads']} intra-op thread per rank/process (torch.set_num_threads "
             f"and {'/'.join(THREAD_VARS)}).",
             f"- Method: {a['rounds']} rounds, each launching every system once as a fresh "
             f"process, in an order rotated per round; a launch runs {a['warmup']} warm-up + "
             f"{a['steps']} timed steps and scores batch / median step time. Tables: median "
             f"over rounds and min-max; ratios are per round, then median. A launch during "
             f"which other processes took over {a['max_foreign']} cores (busy CPU minus the "
             f"worker's own) was redone (up to {a['retries']} times); the kept launches saw at "
             f"most {res['max_foreign_cores']:.2f}.",
             ""]
    for sched, s in res["results"].items():
        lines += [f"### schedule `{sched}`", "",
                  "| system | median img/s | range img/s | fxpar / system (median, range) |",
                  "|---|---:|---:|---:|"]
        for name, v in s["img_per_s"].items():
            r = s["ratios"].get(f"fxpar/{name}")
            ratio = f"{r['median']:.2f}x ({r['min']:.2f}-{r['max']:.2f})" if r else "-"
            lines.append(f"| {LABELS[name]} | {v['median']:.1f} | {v['min']:.1f}-{v['max']:.1f} "
                         f"| {ratio} |")
        lines.append("")
    aims = [f"`{sched}` {s['ratios']['fxpar/torch']['median']:.2f}x "
            f"({'met' if s['ratios']['fxpar/torch']['median'] >= AIM else 'not met'})"
            for sched, s in res["results"].items()]
    lines += [f"Aim fxpar >= {AIM}x torch pipelining's throughput (median of per-round ratios): "
              + ", ".join(aims) + ".", ""]
    return "\n".join(lines)


LABELS = {"fxpar": "fxpar PP (MPI)", "torch": "torch.distributed.pipelining (gloo)",
          "single": "one process, full batch", "single-mb": "one process, micro-batches + accum"}


def write_docs(res: dict[str, Any], json_path: Path, md_path: Path) -> None:
    """JSON in full; the markdown section replaces an earlier one of the same title, keeping
    its hand-written ``### Notes`` (the analysis of why, which a script cannot write)."""
    json_path.write_text(json.dumps(res, indent=2) + "\n")
    text = md_path.read_text() if md_path.exists() else (
        "# Benchmarks\n\nMeasured by hand with the scripts in `tools/`; not run in CI. Numbers "
        "from a small shared machine are noisy: read medians and ranges, not single runs.\n")
    head, _, rest = text.partition(SECTION)
    end = rest.find("\n## ")
    body, tail = (rest, "") if end < 0 else (rest[:end], rest[end:])
    notes = "\n" + body[body.find(NOTES):].rstrip() + "\n" if NOTES in body else ""
    md_path.write_text(head.rstrip() + "\n\n" + markdown(res) + notes + tail)


def driver(args: argparse.Namespace) -> None:
    """Rounds x schedules x systems, a fresh process per measurement (no state, cache or
    allocator warmth carries over from one system to the next)."""
    systems = ["fxpar", "torch", "single", "single-mb"]
    args.src, rev = snapshot(args.rev) if args.rev else (ROOT, revision())
    schedules = args.schedules.split(",")
    res: dict[str, Any] = {"command": " ".join(["python", *sys.argv]), "args": vars(args),
                           "machine": machine(), "date": time.strftime("%Y-%m-%d"),
                           "revision": rev,
                           "results": {}, "raw": {}, "transport": {}, "stage_params": {}}
    raw: dict[str, list[dict[str, Any]]] = {s: [] for s in schedules}
    t_start = time.time()
    for r in range(args.rounds):
        for sched in schedules:
            args.schedule = sched
            rnd: dict[str, Any] = {}
            order = systems[r % len(systems):] + systems[:r % len(systems)]
            for system in order:
                if system.startswith("single") and sched != schedules[0]:
                    rnd[system] = raw[schedules[0]][r][system]  # schedule-independent
                    continue
                rec = measure(system, args)
                rnd[system] = rec
                res["transport"][system] = rec["transport"]
                res["stage_params"][system] = rec["stage_params"]
                res["balance"] = rec.get("balance", res.get("balance"))
                res["fxpar_imported_from"] = rec.get("fxpar", res.get("fxpar_imported_from"))
                print(f"round {r + 1}/{args.rounds} {sched:5} {system:9} "
                      f"{BATCH / statistics.median(rec['times']):6.1f} img/s  "
                      f"steps {[round(t, 3) for t in rec['times']]}  "
                      f"foreign {rec['foreign']:.2f}  "
                      f"({time.time() - t_start:.0f} s)", flush=True)
            raw[sched].append(rnd)
    args.schedule, args.src = None, str(args.src)
    if res["stage_params"]["fxpar"] != res["stage_params"]["torch"]:
        print("WARNING: stage splits differ:", res["stage_params"], flush=True)
    for sched in schedules:
        res["results"][sched] = summarize(raw[sched], systems)
        res["raw"][sched] = [{s: {k: rec[s][k] for k in ("times", "foreign", "attempt")}
                              for s in systems} for rec in raw[sched]]
    res["max_foreign_cores"] = max(rec[s]["foreign"] for sched in schedules
                                   for rec in raw[sched] for s in systems)
    print(json.dumps(res["results"], indent=2))
    if not args.no_write:
        write_docs(res, ROOT / "docs" / "bench_pipeline.json", ROOT / "docs" / "benchmarks.md")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--schedules", default="gpipe,1f1b", help="comma-separated: gpipe,1f1b")
    p.add_argument("--threads", type=int, default=1, help="intra-op threads per rank")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per launch")
    p.add_argument("--max-foreign", type=float, default=0.25,
                   help="cores other processes may use during a launch before it is redone")
    p.add_argument("--retries", type=int, default=3)
    p.add_argument("--quiet-wait", type=float, default=300.0,
                   help="seconds to wait for a quiet machine before each launch")
    p.add_argument("--rev", default="", help="measure this commit (git archive to a temporary "
                   "folder) instead of the working tree")
    p.add_argument("--no-write", action="store_true", help="print only; leave docs/ alone")
    p.add_argument("--worker", choices=["fxpar", "torch", "single", "single-mb"])
    p.add_argument("--schedule", default="gpipe", help=argparse.SUPPRESS)
    p.add_argument("--profile", default="", help="worker: cProfile each rank to PREFIX.*.prof")
    args = p.parse_args()
    if args.worker:
        worker(args)
    else:
        driver(args)


if __name__ == "__main__":
    main()
