"""Benchmark section ``inductor``: ``Plan(compile=True)`` (torch.compile with Inductor) vs eager.

Two comparisons, each in one fresh worker per case and round (a fresh Inductor cache folder
per launch, so every round pays the cold compile it reports):

* one rank: the eager loop a user writes (zero_grad, forward, cross_entropy, backward, SGD
  step), fxpar's one-rank program, and the same program with ``Plan(compile=True)``, on
  identical copies of one model, interleaved step by step after warm-up;
* SP2 (``mpiexec -n 2``): the same model's SP2 program without and with compile, built side by
  side in one job and stepped in turn.

The compile cost is the first compiled step's time minus the median compiled step. Run through
``tools/bench.py --only inductor`` or ``python tools/bench_inductor.py [--quick]`` (the Section
JSON); ``--worker`` is the per-round process.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib  # noqa: E402
from bench_spatial import eager_step, sgd  # noqa: E402  (the user's loop and optimizer)

TITLE = "Compiled stages: Plan(compile=True) vs eager"
AIM_ONE = 0.85  # compiled one-rank step / eager step
SEED, CLASSES = 0, 10
MODELS = {"resnet18": ("torchvision:resnet18", {"num_classes": CLASSES}),
          "amoebanet": ("models:amoebanet", {"num_classes": CLASSES, "num_layers": 2,
                                             "num_filters": 64})}
CASES = (("resnet18", 1), ("amoebanet", 1))
"""(model, ranks): one rank at --inductor-image batch 8 (SP2 at --inductor-sp-image batch 1:
add ("resnet18", 2) when spatial stages compile again; they run eagerly for now)."""
QUICK = {"image": 64, "sp_image": 64, "steps": 3, "warmup": 1, "filters": 16}


def add_args(parser: argparse._ActionsContainer) -> None:
    parser.add_argument("--inductor-image", type=int, default=224,
                        help="one-rank image side (batch 8)")
    parser.add_argument("--inductor-sp-image", type=int, default=512,
                        help="SP2 image side (batch 1)")
    parser.add_argument("--inductor-steps", type=int, default=8,
                        help="timed steps of each system per round (interleaved)")
    parser.add_argument("--inductor-warmup", type=int, default=2)


# -- worker ----------------------------------------------------------------------------------
def worker(a: argparse.Namespace) -> dict[str, Any] | None:
    import torch

    import fxpar
    from fxpar.models.zoo import build_model

    torch.set_num_threads(1)
    torch.manual_seed(SEED)
    spec, kwargs = MODELS[a.model]
    if a.model == "amoebanet":
        kwargs = {**kwargs, "num_filters": a.filters}
    model = build_model(spec, **kwargs).train()
    batch = 8 if a.ranks == 1 else 1
    gen = torch.Generator().manual_seed(SEED)
    x = torch.randn(batch, 3, a.image, a.image, generator=gen)
    y = torch.randint(0, CLASSES, (batch,), generator=gen)
    systems: dict[str, Any] = {}
    if a.ranks == 1:
        systems["eager"] = eager_step(copy.deepcopy(model), x, y)
        plans = {"fxpar": fxpar.Plan(), "fxpar compiled": fxpar.Plan(compile=True)}
        comm = None
    else:
        from fxpar.comm.world import world

        comm = world()
        plans = {"SP2": fxpar.Plan(spatial_parts=a.ranks),
                 "SP2 compiled": fxpar.Plan(spatial_parts=a.ranks, compile=True)}
    for name, plan in plans.items():
        rp = fxpar.compile(copy.deepcopy(model), plan, x, optimizer=sgd,
                           comm=comm).local(comm)
        systems[name] = lambda rp=rp: rp.train_step(x, y)
    times: dict[str, list[float]] = {s: [] for s in systems}
    first: dict[str, float] = {}
    losses: dict[str, list[float]] = {s: [] for s in systems}
    order = benchlib.rotate(list(systems), a.round)
    for i in range(a.warmup + a.steps):
        for name in order:
            t = time.perf_counter()
            losses[name].append(systems[name]())
            dt = time.perf_counter() - t
            if i == 0:
                first[name] = dt
            elif i >= a.warmup:
                times[name].append(dt)
    if comm is not None and comm.rank != 0:
        return None
    med = {s: statistics.median(v) for s, v in times.items()}
    compiled = next(s for s in systems if s.endswith("compiled"))
    base = "eager" if a.ranks == 1 else "SP2"
    ref = losses[base]
    return {"median_s": med, "times": times, "first_s": first, "losses": losses,
            "compile_s": first[compiled] - med[compiled],
            "ratio": med[compiled] / med[base],
            "first_loss_diff": max(abs(losses[s][0] - ref[0]) for s in systems),
            "max_loss_diff": max(abs(v - w) for s in systems for v, w in
                                 zip(losses[s], ref, strict=True))}


# -- driver ----------------------------------------------------------------------------------
def run(opts: Any) -> dict[str, Any]:
    q = bool(getattr(opts, "quick", False))
    cfg = {"image": QUICK["image"] if q else opts.inductor_image,
           "sp_image": QUICK["sp_image"] if q else opts.inductor_sp_image,
           "steps": QUICK["steps"] if q else opts.inductor_steps,
           "warmup": QUICK["warmup"] if q else opts.inductor_warmup,
           "filters": QUICK["filters"] if q else MODELS["amoebanet"][1]["num_filters"]}

    def one(case: tuple[str, int], k: int) -> dict[str, Any]:
        model, ranks = case
        image = cfg["image"] if ranks == 1 else cfg["sp_image"]
        args = ["--worker", "--model", model, "--ranks", str(ranks), "--image", str(image),
                "--steps", str(cfg["steps"]), "--warmup", str(cfg["warmup"]),
                "--filters", str(cfg["filters"]), "--round", str(k)]
        with tempfile.TemporaryDirectory(prefix="fxpar-inductor-") as cache:
            env = {**benchlib.thread_env(1), "TORCHINDUCTOR_CACHE_DIR": cache}
            return benchlib.measure(
                benchlib.worker_command("bench_inductor.py", args,
                                        ranks if ranks > 1 else None),
                env, retries=opts.retries, max_foreign=opts.max_foreign, timeout=opts.timeout)

    rounds = benchlib.interleave("inductor", opts.rounds, list(CASES), one,
                                 key=lambda c: f"{c[0]}/{c[1]}")
    rows, aims, summary = [], [], {}
    for model, ranks in CASES:
        key = f"{model}/{ranks}"
        recs = [r[key] for r in rounds]
        systems = list(recs[0]["median_s"])
        med = {s: benchlib.spread([r["median_s"][s] for r in recs]) for s in systems}
        ratio = benchlib.spread([r["ratio"] for r in recs])
        comp = benchlib.spread([r["compile_s"] for r in recs])
        diff = max(r["max_loss_diff"] for r in recs)
        first = max(r["first_loss_diff"] for r in recs)
        summary[key] = {"step_s": med, "ratio": ratio, "compile_s": comp, "max_loss_diff": diff,
                        "first_loss_diff": first}
        image = cfg["image"] if ranks == 1 else cfg["sp_image"]
        what = f"{model}, {'one rank, 8' if ranks == 1 else 'SP2, 1'}x{image}^2"
        steps = " / ".join(f"{s} {benchlib.fmt_spread(med[s], digits=3)}" for s in systems)
        rows.append([what, steps, benchlib.fmt_spread(ratio, "x"),
                     benchlib.fmt_spread(comp, " s", digits=1), f"{first:.1e}",
                     f"{diff:.1e}"])
        if ranks == 1:
            aims.append({"what": f"compiled one-rank step / eager PyTorch step, {model}",
                         "aim": f"<= {AIM_ONE:.2f}x", "measured": benchlib.fmt_spread(ratio, "x"),
                         "met": ratio["median"] <= AIM_ONE,
                         "why": None if ratio["median"] <= AIM_ONE else
                         "see the notes of this section"})
        else:
            aims.append({"what": f"SP2 compiled step / SP2 eager step, {model}", "aim": "< 1.00x",
                         "measured": benchlib.fmt_spread(ratio, "x"),
                         "met": ratio["median"] < 1.0,
                         "why": None if ratio["median"] < 1.0 else
                         "see the notes of this section"})
    method = (f"CPU, float32, 1 thread per rank, SGD with momentum, one fixed synthetic batch. "
              f"Each round launches one fresh worker per case with an empty Inductor cache "
              f"folder; it builds the model, copies it per system, runs {cfg['warmup']} "
              f"warm-up step(s) and {cfg['steps']} timed steps of every system interleaved "
              f"(order rotated per round). The ratio is compiled / baseline (eager PyTorch on "
              f"one rank, fxpar's eager SP2 program for SP2), per round, then median and range "
              f"over {len(rounds)} round(s). Compile s: the first compiled step minus the "
              f"median compiled step (cold cache). Loss diffs: the largest difference of any "
              f"system's loss from the baseline's at the first step (same weights: rounding "
              f"alone) and at any step (float32 rounding differences grow with training; the "
              f"float64 tests show the compiled program exact).")
    return {"name": "inductor", "title": TITLE, "method": method,
            "tables": [{"title": "Step time, seconds (median over rounds, range)",
                        "columns": ["case", "step s", "compiled / baseline", "compile s",
                                    "step-1 loss diff", "max loss diff"], "rows": rows}],
            "plots": [], "aims": aims, "notes": "",
            "raw": {"config": cfg, "summary": summary, "rounds": rounds}}


def main() -> None:
    if "--worker" not in sys.argv:
        sys.exit(benchlib.standalone(__doc__.split("\n\n")[0], add_args, run, None, rounds=3))
    p = argparse.ArgumentParser(description="worker of tools/bench.py --only inductor")
    p.add_argument("--worker", action="store_true", required=True)
    p.add_argument("--model", choices=list(MODELS), required=True)
    p.add_argument("--ranks", type=int, default=1)
    p.add_argument("--image", type=int, default=224)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--filters", type=int, default=64)
    p.add_argument("--round", type=int, default=0)
    rec = worker(p.parse_args())
    if rec is not None:
        benchlib.emit(rec)


if __name__ == "__main__":
    main()
