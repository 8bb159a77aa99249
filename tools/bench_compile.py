"""Benchmark section ``compile``: how long ``fxpar.compile`` takes, and how much memory, for
ResNet-152 on 16384x16384 images and 64-rank plans.

The compiler works on fake tensors, so neither the time nor the memory should depend on the
image size; what they depend on is the graph (ResNet-152: ~500 nodes) and the plan (64 tiles,
each with its own halo bookkeeping). Every measurement is a fresh process, so the import cost
and the peak RSS belong to that one compile alone. Run through
``tools/bench.py --only compile``; ``--worker`` is the per-launch process.
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib  # noqa: E402  (stdlib only: the timed imports start cold)

TITLE = "Compile time and memory: ResNet-152 at 16384x16384 on 64 ranks, and make demo"
AIM_S, AIM_GB = 3.0, 1.5
DEMO_AIM_S = 3.0
"""Seconds `make demo`'s fxpar-run may report as "compiled in" (a cold start: no capture
cache)."""
IMAGE = 16384
PLANS = {  # name -> Plan keyword arguments; each is 64 ranks
    "sp64": {"spatial_parts": 64},
    "pp4-sp16": {"stages": 4, "spatial_parts": 16, "spatial_stages": 4, "microbatches": 4},
    "gems-dp2-sp16": {"stages": 2, "spatial_parts": 16, "spatial_stages": 2, "microbatches": 2,
                      "gems": True, "data_parallel": 2},
}
BUILDS = ("meta", "real")
DEMO_RANKS = 5
"""tools/demo.py's ranks (the worker reads its arguments from there)."""


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--compile-plans", default=",".join(PLANS),
                        help=f"comma-separated, of {', '.join(PLANS)}")
    parser.add_argument("--compile-builds", default=",".join(BUILDS),
                        help="meta: model built on the meta device; real: with weights")
    parser.add_argument("--compile-image-size", type=int, default=IMAGE)
    parser.add_argument("--compile-rank", type=int, default=0,
                        help="the rank whose program for_rank() builds")


# -- worker ----------------------------------------------------------------------------------
def _rss_gb() -> float:
    """Peak RSS so far, GB (10^9 bytes; Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9


def worker(a: argparse.Namespace) -> dict[str, Any]:
    """Imports, model construction, compile and for_rank, each timed; peak RSS after each."""
    rec: dict[str, Any] = {"plan": a.plan, "build": a.build}
    t = time.perf_counter()
    import torch

    rec["import_torch_s"] = time.perf_counter() - t
    t = time.perf_counter()
    import torchvision

    rec["import_torchvision_s"] = time.perf_counter() - t
    t = time.perf_counter()
    import fxpar

    rec["import_fxpar_s"] = time.perf_counter() - t
    rec["rss_imports_gb"] = _rss_gb()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    t = time.perf_counter()
    if a.build == "meta":
        with torch.device("meta"):
            model = torchvision.models.resnet152(num_classes=1000)
    else:
        model = torchvision.models.resnet152(num_classes=1000)
    rec["build_s"] = time.perf_counter() - t
    rec["rss_build_gb"] = _rss_gb()
    plan = fxpar.Plan(**PLANS[a.plan])
    shape = (plan.chunks(), 3, a.image, a.image)
    t = time.perf_counter()
    program = fxpar.compile(model, plan, shape)
    rec["compile_s"] = time.perf_counter() - t
    rec["rss_compile_gb"] = _rss_gb()
    t = time.perf_counter()
    rp = program.for_rank(a.rank)
    rec["for_rank_s"] = time.perf_counter() - t
    rec["rss_for_rank_gb"] = _rss_gb()
    rec.update(world_size=program.world_size, batch=shape[0],
               rank_params=sum(p.numel() for p in rp.parameters()),
               nodes=len(program.traced.graph.nodes) if program.traced is not None else None)
    return rec


def demo_worker() -> dict[str, Any]:
    """Under ``mpiexec -n demo.RANKS``: `make demo`'s fxpar-run for one step; rank 0's
    "compiled in" seconds (rank 0 captures the model for every rank, then each compiles)."""
    import contextlib
    import io
    import re

    import demo

    from fxpar.cli.run import main as fxpar_run

    size = int(os.environ.get("PMI_SIZE", "0"))
    if size != demo.RANKS:
        raise RuntimeError(f"launched on {size} ranks, but tools/demo.py runs {demo.RANKS}: "
                           f"make DEMO_RANKS its number")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = fxpar_run([*demo.ARGS, "--steps", "1"])
    found = re.search(r"compiled in ([0-9.]+) s", out.getvalue())
    if code or (found is None and "compiled in" in out.getvalue()):
        raise RuntimeError(f"fxpar-run exited {code}:\n{out.getvalue()[-2000:]}")
    return {"compile_s": float(found.group(1)) if found else None}


# -- driver ----------------------------------------------------------------------------------
def _names(value: str, known: Any, flag: str) -> list[str]:
    names = [n.strip() for n in value.split(",") if n.strip()]
    bad = [n for n in names if n not in known]
    if bad or not names:
        raise ValueError(f"{flag}: unknown {bad or 'empty list'}; choose from {', '.join(known)}")
    return names


def run(opts: argparse.Namespace) -> dict[str, Any]:
    plans = _names(opts.compile_plans, PLANS, "--compile-plans")
    builds = _names("real" if getattr(opts, "quick", False) else opts.compile_builds, BUILDS,
                    "--compile-builds")
    cases = [(p, b) for p in plans for b in builds]

    def one(case: tuple[str, str], _round: int) -> dict[str, Any]:
        args = ["--worker", "--plan", case[0], "--build", case[1],
                f"--image={opts.compile_image_size}", f"--rank={opts.compile_rank}"]
        return benchlib.measure(
            benchlib.worker_command("bench_compile.py", args), benchlib.thread_env(1),
            retries=opts.retries, max_foreign=opts.max_foreign, timeout=opts.timeout)

    rounds = benchlib.interleave("compile", opts.rounds, cases, one, key="/".join)
    env = {k: v for k, v in benchlib.thread_env(1).items() if k != "FXPAR_CAPTURE_CACHE"}
    demo = []
    for k in range(opts.rounds):
        benchlib.progress("compile", k + 1, opts.rounds, "make demo's compile")
        demo.append(benchlib.measure(
            benchlib.worker_command("bench_compile.py", ["--worker", "--demo"], DEMO_RANKS),
            env, retries=opts.retries, max_foreign=opts.max_foreign, timeout=opts.timeout))
    return section(rounds, cases, opts, demo)


def _sp(recs: list[dict[str, Any]], key: str) -> dict[str, float]:
    return benchlib.spread([r[key] for r in recs])


def section(rounds: list[dict[str, Any]], cases: list[tuple[str, str]],
            opts: argparse.Namespace, demo: list[dict[str, Any]] | None = None
            ) -> dict[str, Any]:
    """The Section dict from the per-round worker records (and `make demo`'s, one a round)."""
    fmt = benchlib.fmt_spread
    rows, aims, summary = [], [], {}
    t_plot: dict[str, list[list[Any]]] = {}
    m_plot: dict[str, list[list[Any]]] = {}
    aim_build = "real" if any(b == "real" for _, b in cases) else "meta"
    for plan, build in cases:
        recs = [r[f"{plan}/{build}"] for r in rounds]
        s = {k: _sp(recs, k) for k in ("compile_s", "for_rank_s", "build_s", "rss_imports_gb",
                                       "rss_compile_gb", "rss_for_rank_gb")}
        s["compile_peak_minus_imports_gb"] = benchlib.spread(
            [r["rss_compile_gb"] - r["rss_imports_gb"] for r in recs])
        s["imports_s"] = benchlib.spread([r["import_torch_s"] + r["import_torchvision_s"] +
                                          r["import_fxpar_s"] for r in recs])
        summary[f"{plan}/{build}"] = s
        rows.append([plan, recs[0]["world_size"], recs[0]["batch"], build,
                     fmt(s["compile_s"]), fmt(s["rss_compile_gb"]),
                     fmt(s["compile_peak_minus_imports_gb"]), fmt(s["for_rank_s"]),
                     fmt(s["rss_for_rank_gb"])])
        t_plot.setdefault(build, []).append([plan, s["compile_s"]["median"]])
        m_plot.setdefault(build, []).append([plan, s["rss_compile_gb"]["median"]])
        if build == aim_build:
            label = f"{plan}, {build} model"
            aims.append({"what": f"compile time, {label}", "aim": f"<= {AIM_S:g} s",
                         "measured": fmt(s["compile_s"], " s"),
                         "met": s["compile_s"]["median"] <= AIM_S, "why": None})
            aims.append({"what": f"peak RSS after compile (imports included), {label}",
                         "aim": f"<= {AIM_GB:g} GB", "measured": fmt(s["rss_compile_gb"], " GB"),
                         "met": s["rss_compile_gb"]["median"] <= AIM_GB, "why": None})
    demo_rows = []
    if demo:
        d = benchlib.spread([r["compile_s"] for r in demo])
        demo_rows.append(["make demo: AmoebaNet-D (2, 32), 4x3x256², SP4 stage + 1 stage, "
                          f"{DEMO_RANKS} ranks", fmt(d, " s"), f"{len(demo)}",
                          f"{max(r['foreign'] for r in demo):.2f}"])
        over = d["median"] - DEMO_AIM_S
        aims.append({
            "what": f"compile in `make demo` ({DEMO_RANKS} ranks on this machine, no capture "
                    f"cache)", "aim": f"<= {DEMO_AIM_S:g} s", "measured": fmt(d, " s"),
            "met": d["median"] <= DEMO_AIM_S, "why": None if over <= 0 else
            f"{over:.2f} s over: rank 0 captures the model for every rank (torch.export, "
            f"cold: its first use imports torch.export, torch._dynamo and sympy, about 1 s "
            f"of it), while {DEMO_RANKS - 1} ranks wait asleep; the time is that one trace "
            f"on a core shared with {DEMO_RANKS - 1} starting ranks (see the notes)"})
    everything = [r[k] for r in rounds for k in r]
    imports = [[name, fmt(_sp(everything, f"import_{name}_s"))]
               for name in ("torch", "torchvision", "fxpar")]
    imports += [[f"resnet152 on {b}", fmt(_sp([r for r in everything if r["build"] == b],
                                              "build_s"))]
                for b in dict.fromkeys(b for _, b in cases)]
    imports.append(["RSS after imports, GB", fmt(_sp(everything, "rss_imports_gb"))])
    foreign = max((r["foreign"] for r in everything), default=0.0)
    method = (
        f"torchvision resnet152(num_classes=1000), input (B, 3, {opts.compile_image_size}, "
        f"{opts.compile_image_size}) float32 with B = the plan's chunks (micro-batches x GEMS "
        f"copies x data-parallel copies), 64-rank plans: `sp64` = `Plan(spatial_parts=64)`, "
        f"`pp4-sp16` = `Plan(stages=4, spatial_parts=16, spatial_stages=4, microbatches=4)`, "
        f"`gems-dp2-sp16` = `Plan(stages=2, spatial_parts=16, spatial_stages=2, "
        f"microbatches=2, gems=True, data_parallel=2)`. Every measurement is a fresh process "
        f"(one thread) that times `import torch`, `import torchvision`, `import fxpar`, builds "
        f"the model (on the meta device, or with real weights), times `fxpar.compile(model, "
        f"plan, shape)` alone (no imports, no model construction), then "
        f"`program.for_rank({opts.compile_rank})` (which, for a meta model, materialises that "
        f"rank's stages only). Peak RSS is the process's `ru_maxrss` (GB = 10^9 bytes) and so "
        f"includes the interpreter, torch and torchvision (the RSS right after the imports is "
        f"given too) and, for a real model, its ~60M float32 weights (0.24 GB). "
        f"{len(rounds)} round(s), cases in an order rotated per round; launches saw at most "
        f"{foreign:.2f} foreign cores.")
    return {
        "name": "compile", "title": TITLE, "method": method,
        "tables": [
            {"title": "Compile (median over rounds, range)",
             "columns": ["plan", "ranks", "batch", "model", "compile s", "peak RSS GB",
                         "peak - imports GB", "for_rank s", "peak after for_rank GB"],
             "rows": rows},
            {"title": "Imports and model construction, seconds (all launches)",
             "columns": ["what", "median (range)"], "rows": imports},
            {"title": "`make demo`'s compile: fxpar-run's \"compiled in\" on rank 0 (one "
                      "launch of 1 step a round, mpiexec, 1 thread per rank)",
             "columns": ["job", "compiled in", "launches", "foreign cores (most)"],
             "rows": demo_rows}],
        "plots": [
            {"file": "compile_time.png", "title": "fxpar.compile, ResNet-152, 64 ranks",
             "xlabel": "plan", "ylabel": "seconds", "kind": "bar", "series": t_plot,
             "hline": AIM_S},
            {"file": "compile_rss.png", "title": "peak RSS after compile (imports included)",
             "xlabel": "plan", "ylabel": "GB", "kind": "bar", "series": m_plot,
             "hline": AIM_GB}],
        "aims": aims, "notes": "",
        "raw": {"summary": summary, "rounds": rounds, "cpu_count": os.cpu_count()},
    }


def main() -> None:
    p = argparse.ArgumentParser(description="worker of tools/bench.py --only compile")
    p.add_argument("--worker", action="store_true", required=True)
    p.add_argument("--demo", action="store_true", help="time make demo's compile")
    p.add_argument("--plan", choices=list(PLANS))
    p.add_argument("--build", choices=BUILDS)
    p.add_argument("--image", type=int, default=IMAGE)
    p.add_argument("--rank", type=int, default=0)
    a = p.parse_args()
    if a.demo:
        record = demo_worker()
        if record["compile_s"] is not None:  # rank 0 prints the line
            benchlib.emit(record)
        return
    if a.plan is None or a.build is None:
        p.error("--plan and --build are required without --demo")
    benchlib.emit(worker(a))


if __name__ == "__main__":
    main()
