"""Benchmark section ``precision``: the largest image one rank trains in 4 GiB, and bf16's speed.

(c) Largest square image under a per-rank budget (4 GiB), ResNet-50 and AmoebaNet-D, for
    one process in float32 (plain eager PyTorch), SP4 in float32, and SP4 with bfloat16 and
    checkpoint segments (``Plan(spatial_parts=4, precision="bf16", recompute_segments=k)``).
    Memory is *measured*: each launch trains 2 steps on a synthetic image and every rank
    reports its peak RSS during those steps (Linux's VmHWM, reset after compiling) minus its
    RSS before the model was built (imports and MPI excluded);
    the largest rank counts. Activation memory is linear in the pixels, so each system is
    measured at two sizes and the line through them gives the side that reaches the budget;
    the first and the last system of each model are then launched at that side, and the line
    through that check and the larger size gives their side.
(d) Step time of bfloat16 and float16 against float32 on this CPU, one process x 1 thread,
    fxpar's single-rank program next to eager PyTorch under ``torch.autocast`` (the limit:
    the same kernels without fxpar), in interleaved rounds.

Run through ``tools/bench.py --only precision`` or alone: ``python tools/bench_precision.py
--quick`` prints the Section JSON.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_spatial  # noqa: E402
import benchlib  # noqa: E402

TITLE = "Mixed precision and checkpoint segments: largest image per rank, bf16 step time"
GIB = 2 ** 30
PIXELS_AIM = 8.0  # SP4 + bf16 + segments vs one process fp32, in pixels
SYSTEMS = {  # name -> (ranks, precision, segments); ranks 1 = plain eager PyTorch
    "one process fp32": (1, "fp32", 1),
    "SP4 fp32": (4, "fp32", 1),
    "SP4 bf16 + segments": (4, "bf16", 8),
}
PRECISIONS = ("fp32", "bf16", "fp16")


def add_args(parser: argparse._ActionsContainer) -> None:
    parser.add_argument("--precision-models", default="resnet50,amoebanet")
    parser.add_argument("--precision-amoeba", default="6,64",
                        help="AmoebaNet-D num_layers,num_filters")
    parser.add_argument("--precision-budget-gib", type=float, default=4.0)
    parser.add_argument("--precision-sizes", default="384,768",
                        help="the two image sides each system's memory is measured at")
    parser.add_argument("--precision-no-check", action="store_true",
                        help="skip the launch at the predicted side")
    parser.add_argument("--precision-time-model", default="resnet50")
    parser.add_argument("--precision-time-image", type=int, default=384)


# -- workers ------------------------------------------------------------------------------------
def worker(a: argparse.Namespace) -> None:
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(1)

    if a.ranks > 1 or a.worker == "time" and a.system == "fxpar":
        from fxpar.comm.world import world

        comm = world()
    else:
        comm = None
    before = benchlib.rss_bytes()
    torch.manual_seed(0)  # every rank builds the same weights and image
    model = bench_spatial.build(a.model, a.amoeba)
    x = torch.randn(1, 3, a.image, a.image)
    y = torch.tensor([1])
    dtype = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[a.precision]
    if a.system == "eager":
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        scaler = torch.amp.GradScaler("cpu") if a.precision == "fp16" else None

        def step() -> None:
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=dtype or torch.float32, enabled=dtype is not None):
                loss = F.cross_entropy(model(x), y)
            if scaler is None:
                loss.backward()
                opt.step()
            else:
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
    else:
        import fxpar

        plan = fxpar.Plan(spatial_parts=a.ranks, precision=a.precision,
                          recompute_segments=a.segments)
        rp = fxpar.compile(model, plan, x, optimizer=lambda p: torch.optim.SGD(
            p, lr=0.01, momentum=0.9)).local(comm)

        def step() -> None:
            rp.train_step(x, y)
    # the compile's own transient peak is not training memory: reset the high-water mark (what
    # stays resident, model and compiled program included, is counted from `before`)
    benchlib.reset_peak_rss()
    times = []
    for i in range(a.steps):
        t = time.perf_counter()
        step()
        if i >= a.warmup:
            times.append(time.perf_counter() - t)
    peak = benchlib.peak_rss_bytes() - before
    mine = {"peak": peak, "time": statistics.median(times) if times else None}
    ranks = comm.allgather_object(mine) if comm is not None else [mine]
    if comm is None or comm.rank == 0:
        benchlib.emit({"peak": max(r["peak"] for r in ranks), "ranks": ranks,
                       "time": ranks[0]["time"]})


def worker_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    p.add_argument("--worker", required=True, choices=["memory", "time"])
    p.add_argument("--system", choices=["eager", "fxpar"], required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--amoeba", default="6,64")
    p.add_argument("--image", type=int, required=True)
    p.add_argument("--ranks", type=int, default=1)
    p.add_argument("--precision", default="fp32")
    p.add_argument("--segments", type=int, default=1)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--warmup", type=int, default=1)
    return p


def _launch(opts: argparse.Namespace, worker_: str, system: str, model: str, image: int,
            ranks: int, precision: str, segments: int, steps: int) -> dict[str, Any]:
    args = ["--worker", worker_, "--system", system, "--model", model, "--amoeba",
            opts.precision_amoeba, "--image", str(image), "--ranks", str(ranks), "--precision",
            precision, "--segments", str(segments), "--steps", str(steps)]
    cmd = benchlib.worker_command("bench_precision.py", args,
                                  ranks if system == "fxpar" else None)
    return benchlib.measure(cmd, benchlib.thread_env(1), retries=opts.retries,
                            max_foreign=opts.max_foreign, timeout=opts.timeout)


# -- (c) the largest image ----------------------------------------------------------------------
def largest(sizes: tuple[int, int], peaks: tuple[float, float], budget: float) -> dict[str, Any]:
    """The line through (pixels, peak) at the two sizes, and the side (a multiple of 32) whose
    peak it puts at the budget."""
    (s1, s2), (m1, m2) = sizes, peaks
    slope = (m2 - m1) / (s2 * s2 - s1 * s1)
    fixed = m1 - slope * s1 * s1
    side = int(math.sqrt(max(budget - fixed, 0.0) / slope) // 32 * 32) if slope > 0 else 0
    return {"bytes_per_pixel": slope, "fixed": fixed, "side": side}


def refine(rows: list[dict[str, Any]], budget: float) -> None:
    """Where a system was checked at its predicted side, the line through its larger measured
    size and the check (two measured points, one near the budget) gives the side instead
    (``source`` says which); pixel ratios against the one-process row of the same model."""
    for r in rows:
        check = r.get("checked")
        r["source"] = "extrapolated from the two sizes"
        if check and check["side"] > r["sizes"][1]:
            fit = largest((r["sizes"][1], check["side"]), (r["peaks"][1], check["peak"]), budget)
            r.update(side=fit["side"], source="interpolated: larger size and check")
    for r in rows:
        base = next(b for b in rows if b["model"] == r["model"] and b["ranks"] == 1)
        r["pixels_ratio"] = (r["side"] / base["side"]) ** 2 if base["side"] else 0.0


def memory_rows(opts: argparse.Namespace, models: list[str]) -> list[dict[str, Any]]:
    sizes = tuple(int(s) for s in opts.precision_sizes.split(","))
    budget = opts.precision_budget_gib * GIB
    rows = []
    for model in models:
        for name, (ranks, precision, segments) in SYSTEMS.items():
            benchlib.progress("precision", len(rows) + 1, len(models) * len(SYSTEMS),
                              f"{model} {name}")
            system = "eager" if ranks == 1 else "fxpar"
            peaks = tuple(_launch(opts, "memory", system, model, s, ranks, precision, segments,
                                  2)["peak"] for s in sizes)
            fit = largest(sizes, peaks, budget)  # type: ignore[arg-type]
            rows.append({"model": model, "system": name, "ranks": ranks, "sizes": sizes,
                         "peaks": peaks, **fit})
            print(f"  peaks {[round(p / GIB, 2) for p in peaks]} GiB -> {fit['side']}^2",
                  file=sys.stderr, flush=True)
        base = next(r for r in rows if r["model"] == model and r["ranks"] == 1)
        for row in (base, rows[-1]):  # the prediction checked for the first and the last
            if opts.precision_no_check or row["side"] < 32:
                continue
            ranks, precision, segments = SYSTEMS[row["system"]]
            rec = _launch(opts, "memory", "eager" if ranks == 1 else "fxpar", model,
                          row["side"], ranks, precision, segments, 2)
            row["checked"] = {"side": row["side"], "peak": rec["peak"]}
    return rows


# -- (d) bf16 / fp16 step time ------------------------------------------------------------------
def time_rows(opts: argparse.Namespace) -> dict[str, Any]:
    model, image = opts.precision_time_model, opts.precision_time_image
    systems = [(s, p) for s in ("eager", "fxpar") for p in PRECISIONS]
    rounds = benchlib.interleave(
        "precision", opts.rounds, systems,
        lambda sp, _k: _launch(opts, "time", sp[0], model, image, 1, sp[1], 1, 4), key=" ".join)
    times = {f"{s} {p}": [r[f"{s} {p}"]["time"] for r in rounds] for s, p in systems}
    ratios = {f"{s} {p}/fp32": [a / b for a, b in zip(times[f"{s} {p}"], times[f"{s} fp32"],
                                                       strict=True)]
              for s, p in systems if p != "fp32"}
    return {"model": model, "image": image, "times": times, "ratios": ratios}


# -- the section --------------------------------------------------------------------------------
def run(opts: argparse.Namespace) -> dict[str, Any]:
    if getattr(opts, "quick", False):
        opts.precision_sizes, opts.precision_time_image = "96,128", 96
        opts.precision_amoeba, opts.precision_budget_gib = "2,16", 1.0
    models = [m.strip() for m in opts.precision_models.split(",") if m.strip()]
    return section(memory_rows(opts, models), time_rows(opts), opts)


def _gib(b: float) -> str:
    return f"{b / GIB:.2f}"


def section(mem: list[dict[str, Any]], tm: dict[str, Any], opts: argparse.Namespace
            ) -> dict[str, Any]:
    budget = opts.precision_budget_gib
    sizes = opts.precision_sizes.replace(",", " and ")
    mem_table = {"title": f"(c) Largest square image per rank within {budget:g} GiB "
                          f"(measured at {sizes} px, extrapolated linearly in pixels)",
                 "columns": ["model", "system", "peak GiB at the two sizes",
                             "MiB per megapixel", "fixed GiB", "checked: peak at the "
                             "predicted side", "largest side", "from", "pixels / one "
                             "process"],
                 "rows": []}
    aims = []
    refine(mem, budget * GIB)
    for r in mem:
        check = r.get("checked")
        mem_table["rows"].append([
            r["model"], r["system"], " / ".join(_gib(p) for p in r["peaks"]),
            f"{r['bytes_per_pixel'] * 1e6 / 2**20:.0f}", _gib(r["fixed"]),
            f"{_gib(check['peak'])} GiB at {check['side']}^2" if check else "-",
            f"{r['side']}^2", r["source"], f"{r['pixels_ratio']:.1f}x"])
        if r["system"] == "SP4 bf16 + segments":
            aims.append({"what": f"largest image within {budget:g} GiB per rank, SP4 + bf16 + "
                                 f"segments vs one process fp32, {r['model']} (pixels)",
                         "aim": f">= {PIXELS_AIM:g}x", "measured": f"{r['pixels_ratio']:.1f}x",
                         "met": r["pixels_ratio"] >= PIXELS_AIM})
    ts = tm["times"]
    time_table = {"title": f"(d) Train step seconds, {tm['model']} 1x{tm['image']}^2, one "
                           f"process x 1 thread (median, range over rounds)",
                  "columns": ["system", *PRECISIONS, "bf16 / fp32", "fp16 / fp32"],
                  "rows": []}
    for s in ("eager", "fxpar"):
        time_table["rows"].append([
            "eager PyTorch (torch.autocast)" if s == "eager" else
            "fxpar, 1 rank (Plan(precision=...))",
            *[benchlib.fmt_spread(benchlib.spread(ts[f"{s} {p}"]), digits=3)
              for p in PRECISIONS],
            *[benchlib.fmt_spread(benchlib.spread(tm["ratios"][f"{s} {p}/fp32"]), "x")
              for p in ("bf16", "fp16")]])
    method = (
        f"**(c)** Each system trains 2 steps (SGD with momentum, batch 1, synthetic image) as "
        f"a fresh launch, one thread per rank; every rank reports its peak RSS during the steps "
        f"(Linux's VmHWM, reset after compiling, so the compiler's transient peak is not "
        f"counted) minus its RSS before the model was built (imports and MPI start-up not "
        f"counted; the model, the compiled program and all training state are), and the "
        f"largest rank counts. Systems: plain eager PyTorch in float32 (one process), fxpar "
        f"`Plan(spatial_parts=4)` in float32, and fxpar `Plan(spatial_parts=4, "
        f"precision='bf16', recompute_segments=8)`. The line through the two sizes' peaks "
        f"(activations grow with the pixels) predicts the side that reaches the budget; the "
        f"first and the last system of each model are then launched at that side (their "
        f"peaks are shown), and their largest side is read off the line through the larger "
        f"size and that check instead, two measured points one of which is near the "
        f"budget. AmoebaNet-D "
        f"is ({opts.precision_amoeba}). **(d)** Each round launches, in rotated order, eager "
        f"PyTorch under `torch.autocast` (GradScaler for fp16) and fxpar's 1-rank program "
        f"with `Plan(precision=...)`, each 1 warm-up and 3 timed steps (median).")
    return {"name": "precision", "title": TITLE, "method": method,
            "tables": [mem_table, time_table], "aims": aims,
            "raw": {"memory": mem, "time": tm}}


def main(argv: list[str] | None = None) -> int:
    return benchlib.entry(__doc__.splitlines()[0], add_args, run, argv, worker, worker_parser,
                          rounds=3)


if __name__ == "__main__":
    sys.exit(main())
