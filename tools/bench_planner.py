"""Benchmark section ``planner``: the planner's choice against hand plans, and search times.

First this machine is calibrated (``mpiexec -n 2 fxpar-calibrate``, as the costmodel section
does). Then, for ResNet-50, AmoebaNet-D and U-Net, ``fxpar.plan_auto`` picks a plan for 2 ranks
on that profile, and the chosen plan runs next to 20 hand plans of the same 2 ranks (DP, SP in
both directions, LP, PP with 2 to 8 micro-batches and both schedules, GEMS, recompute, halo
fusion) in one ``mpiexec -n 2`` launch per model and round: 1 warm-up step, then timed steps,
the slowest rank's median; rounds rotate the order; the table gives the median over rounds and
the range. The second table times the search itself on the shipped H100 profile for ResNet-101
and AmoebaNet-D (18, 416) at 16384^2 on 64, 512 and 2,048 ranks (80 GiB each): tracing and
analysing the model once, the search, and compiling the chosen plan.

Run through ``tools/bench.py --only planner`` or alone: ``python tools/bench_planner.py
--quick`` prints the Section JSON.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_planauto  # noqa: E402  (the --local-auto worker mode runs its choose)
import benchlib  # noqa: E402
from bench_costmodel import MODELS, _build, _data, calibrate  # noqa: E402

TITLE = "Planner: the chosen plan vs hand plans, and search time"
AIM = 0.05
TOP = 5
"""The planner's predicted top plans whose order is compared with the measured order."""
RANK_AIM = 0.8
"""... by Spearman's rank correlation, at least this."""
HAND = {  # name -> Plan fields, all on 2 ranks
    "DP2": {"data_parallel": 2},
    "DP2 recompute": {"data_parallel": 2, "recompute": "always"},
    "SP2 vertical": {"spatial_parts": 2, "slice": "vertical"},
    "SP2 horizontal": {"spatial_parts": 2, "slice": "horizontal"},
    "SP2 fusion all": {"spatial_parts": 2, "halo_fusion": "all"},
    "SP2 recompute": {"spatial_parts": 2, "recompute": "always"},
    "LP2": {"stages": 2},
    "PP2 m2 gpipe": {"stages": 2, "microbatches": 2},
    "PP2 m2 1f1b": {"stages": 2, "microbatches": 2, "schedule": "1f1b"},
    "PP2 m4 gpipe": {"stages": 2, "microbatches": 4},
    "PP2 m4 1f1b": {"stages": 2, "microbatches": 4, "schedule": "1f1b"},
    "PP2 m8 gpipe": {"stages": 2, "microbatches": 8},
    "PP2 m8 1f1b": {"stages": 2, "microbatches": 8, "schedule": "1f1b"},
    "PP2 m4 1f1b recompute": {"stages": 2, "microbatches": 4, "schedule": "1f1b",
                              "recompute": "always"},
    "GEMS LP2": {"stages": 2, "gems": True},
    "GEMS m2": {"stages": 2, "gems": True, "microbatches": 2},
    "GEMS m2 1f1b": {"stages": 2, "gems": True, "microbatches": 2, "schedule": "1f1b"},
    "GEMS m4 1f1b": {"stages": 2, "gems": True, "microbatches": 4, "schedule": "1f1b"},
    "GEMS times 2": {"stages": 2, "gems": True, "gems_times": 2},
    "PP2 m4 gpipe recompute": {"stages": 2, "microbatches": 4, "recompute": "always"},
}
SEARCH = {  # name -> (zoo spec, keyword arguments)
    "ResNet-101": ("torchvision:resnet101", {"num_classes": 1000}),
    "AmoebaNet-D (18, 416)": ("models:amoebanet", {"num_classes": 1000, "num_layers": 18,
                                                  "num_filters": 416}),
}
WHOLE = ("ResNet-50", "torchvision:resnet50", {"num_classes": 1000}, 8192, 2048)
"""The search-time row with an aim: (name, zoo spec, keyword arguments, image, ranks)."""
WHOLE_AIM = 10.0
"""Seconds plan_auto may take for WHOLE, end to end: tracing, the search, and compiling its
choice (lowering and simulating every rank's messages)."""


def add_args(parser: argparse._ActionsContainer) -> None:
    parser.add_argument("--planner-models", default=",".join(MODELS))
    parser.add_argument("--planner-image", type=int, default=128)
    parser.add_argument("--planner-batch", type=int, default=8)
    parser.add_argument("--planner-steps", type=int, default=3)
    parser.add_argument("--planner-profile", default="",
                        help="use this profile instead of calibrating")
    parser.add_argument("--planner-worlds", default="64,512,2048")


def worker(a: argparse.Namespace) -> None:
    """Train ``--model`` under each plan of ``--plans`` (JSON {name: fields}), in order."""
    import torch

    import fxpar
    from fxpar.comm.world import world

    torch.set_num_threads(1)
    comm = world()
    plans = json.loads(a.plans)
    extra: dict[str, Any] = {}
    if a.local_auto:  # --plan auto without --profile: this machine's profile, measured now
        fields, chosen, note = bench_planauto.choose(comm)
        plans = {bench_planauto.CHOSEN: fields, **plans}
        extra = {"chosen": chosen, "note": note,
                 "same": _same_plan(fields, bench_planauto.HAND)}
        x = torch.randn(a.batch, 3, a.image, a.image, generator=torch.Generator().manual_seed(0))
        y = torch.randint(0, 10, (a.batch,), generator=torch.Generator().manual_seed(1))
    else:
        x, y = _data(a.model, a.batch, a.image)
    out: dict[str, float] = {}
    for name, fields in plans.items():
        torch.manual_seed(0)
        net = bench_planauto.build() if a.local_auto else _build(a.model)
        program = fxpar.compile(net, fxpar.Plan(**fields),
                                torch.empty(x.shape, device="meta"),
                                optimizer=lambda ps: torch.optim.SGD(ps, lr=0.01, momentum=0.9))
        rp = program.local(comm)
        rp.train_step(x, y)  # warm-up
        comm.barrier()
        times = []
        for _ in range(a.steps):
            t0 = time.perf_counter()
            rp.train_step(x, y)
            times.append(time.perf_counter() - t0)
        slowest = comm.allreduce(torch.tensor(times, dtype=torch.float64), op="max")
        out[name] = float(slowest.median())
        comm.barrier()
    if comm.rank == 0:
        benchlib.emit({"step_s": out, **extra})


def search_times(worlds: list[int], quick: bool) -> tuple[list[list[str]], float]:
    """plan_auto's seconds (analysis, search, compiling the choice, and the whole call) on the
    H100 profile: each model of SEARCH on each of ``worlds``, then WHOLE; with WHOLE's whole
    call, which has an aim."""
    rows = []
    models = list(SEARCH.items())[:1] if quick else list(SEARCH.items())
    image = 2048 if quick else 16384
    for name, (spec, kw) in models:
        for w in worlds:
            rows.append(_search_row(name, spec, kw, image, w)[0])
    name, spec, kw, image, w = WHOLE
    row, whole = _search_row(name, spec, kw, image, w)
    return [*rows, row], whole


def _search_row(name: str, spec: str, kw: dict[str, Any], image: int, w: int
                ) -> tuple[list[str], float]:
    """One row of the search-time table, and the seconds of the whole plan_auto call."""
    import fxpar
    from fxpar.core.plan import PlanError
    from fxpar.models.zoo import build_model
    from fxpar.planner.planner import describe

    benchlib.progress("planner", 1, 1, f"search {name} {image}^2 on {w} ranks")
    model = build_model(spec, meta=True, **kw)
    t0 = time.perf_counter()
    try:
        found = fxpar.plan_auto(model, (8, 3, image, image), w, 80 * 2**30)
    except PlanError as e:  # the search ran; nothing fits
        whole = time.perf_counter() - t0
        return [name, f"{image}^2", str(w), "-", "0", "-", f"{whole:.2f} (all)", "-",
                f"{whole:.2f}", str(e).split(":")[0], "-"], whole
    whole = time.perf_counter() - t0
    a, s, c = found.seconds
    return [name, f"{image}^2", str(w), str(found.searched), str(len(found.ranked)),
            f"{a:.2f}", f"{s:.2f}", f"{c:.2f}", f"{whole:.2f}", describe(found.plan),
            f"{found.ranked[0].step_s:.3f}"], whole


def run(opts: argparse.Namespace) -> dict[str, Any]:
    import fxpar
    from fxpar.perf.profile import Profile
    from fxpar.planner.planner import describe

    q = bool(getattr(opts, "quick", False))
    models = [m.strip() for m in opts.planner_models.split(",") if m.strip()]
    hand = dict(HAND)
    if q:
        models, hand = models[:1], {k: HAND[k] for k in ("DP2", "SP2 vertical", "LP2")}
    image, batch = (64, 4) if q else (opts.planner_image, opts.planner_batch)
    steps = 1 if q else opts.planner_steps
    if opts.planner_profile:
        profile = Profile.load(opts.planner_profile)
    else:
        path = Path(tempfile.mkdtemp(prefix="fxpar-cal-")) / "this-machine.json"
        calibrate(opts, path)
        profile = Profile.load(path)
    worlds = [int(w) for w in opts.planner_worlds.split(",") if w.strip()]
    # first: it needs no quiet machine
    search, whole = search_times(worlds[:1] if q else worlds, q)
    chosen: dict[str, dict[str, Any]] = {}
    predicted: dict[str, dict[str, float]] = {}
    for model in models:
        found = fxpar.plan_auto(_build(model, meta=True), (batch, 3, image, image), 2, None,
                                profile)
        fields = bench_planauto.fields_of(found.plan)
        chosen[model] = {"name": f"planner: {describe(found.plan)}", "fields": fields}
        predicted[model] = {}
        for e in found.ranked:  # by hand plan name where the plan is one of them
            name = _same_plan(bench_planauto.fields_of(e.plan), hand) or describe(e.plan)
            predicted[model].setdefault(name, e.step_s)
    def one(model: str, k: int) -> dict[str, Any]:
        """One launch training every plan of ``model`` in turn (the order rotated by round)."""
        plans = {**hand, chosen[model]["name"]: chosen[model]["fields"]}
        order = dict(benchlib.rotate(list(plans.items()), k))
        args = ["--worker", "--model", model, "--plans", json.dumps(order), "--image",
                str(image), "--batch", str(batch), "--steps", str(steps)]
        return benchlib.measure(benchlib.worker_command("bench_planner.py", args, 2),
                                benchlib.thread_env(1), retries=opts.retries,
                                max_foreign=opts.max_foreign, timeout=opts.timeout)

    measured: dict[tuple[str, str], list[float]] = {}
    for rnd in benchlib.interleave("planner", opts.rounds, models, one):
        for model, rec in rnd.items():
            for name, s in rec["step_s"].items():
                measured.setdefault((model, name), []).append(s)
    rows, summary, aims, orders = [], [], [], []
    for model in models:
        names = [n for (m, n) in measured if m == model]
        pick = chosen[model]["name"]
        same = _same_plan(chosen[model]["fields"], hand)
        if same is not None:  # one plan measured twice: its samples are one plan's
            pooled = measured[(model, pick)] + measured[(model, same)]
            chosen[model]["noise"] = statistics.median(measured[(model, pick)]) / \
                statistics.median(measured[(model, same)]) - 1
            chosen[model]["same_as"] = same
            measured[(model, pick)] = measured[(model, same)] = pooled
        med = {n: statistics.median(measured[(model, n)]) for n in names}
        best_hand = min((n for n in names if n != pick), key=lambda n: med[n])
        for rank, n in enumerate(sorted(names, key=lambda n: med[n]), 1):
            rows.append([model, n, str(rank), benchlib.fmt_spread(
                benchlib.spread(measured[(model, n)]), " s", 3), f"{med[n] / med[best_hand]:.2f}"])
        ratio = med[pick] / med[best_hand]
        twin = (f" (= hand plan {same}; measured apart they differed by "
                f"{chosen[model]['noise']:+.1%})") if same is not None else ""
        summary.append([model, pick.removeprefix("planner: ") + twin, f"{med[pick]:.3f}",
                        best_hand, f"{med[best_hand]:.3f}", f"{ratio:.3f}"])
        aims.append({"what": f"{model}: planner's choice / best of {len(names) - 1} hand plans",
                     "aim": f"<= {1 + AIM:.2f}", "measured": f"{ratio:.3f}",
                     "met": ratio <= 1 + AIM, "why": None if ratio <= 1 + AIM else
                     "the cost model ranks plans with its per-model errors (costmodel section)"})
        top = [n for n in sorted(predicted[model], key=predicted[model].get) if n in med][:TOP]
        rho = spearman([predicted[model][n] for n in top], [med[n] for n in top])
        order = ", ".join(f"{n} ({predicted[model][n]:.3f} / {med[n]:.3f} s)" for n in top)
        orders.append([model, order, f"{rho:.2f}"])
        aims.append({"what": f"{model}: Spearman correlation of the planner's predicted top "
                             f"{len(top)} (hand plans) with their measured order",
                     "aim": f">= {RANK_AIM}", "measured": f"{rho:.2f}", "met": rho >= RANK_AIM,
                     "why": None if rho >= RANK_AIM else
                     f"predicted / measured step: {order}"})
    method = (
        f"This machine calibrated first (`mpiexec -n 2 fxpar-calibrate`, 1 thread per rank). "
        f"Models: ResNet-50 (torchvision), AmoebaNet-D (2, 32) and U-Net (base 16, depth 4), "
        f"batch {batch} at {image}x{image}, float32, SGD with momentum, 2 ranks (this machine's "
        f"2 cores, 1 thread each). The planner (`fxpar.plan_auto(model, example, 2, None, "
        f"profile)`) chooses on the calibrated profile; its plan and {len(hand)} hand plans run "
        f"in one `mpiexec -n 2` launch per model and round after a quiet spell: each plan "
        f"compiled, 1 warm-up step, {steps} timed steps, the slowest rank's median; "
        f"{opts.rounds} round(s), rotated order; median over rounds (range in brackets). "
        f"When the planner's plan is one of the hand plans it is still run as its own entry; "
        f"both entries then show the samples of the two together (one plan), and the "
        f"summary says how far apart the two were: the noise between two runs of one plan. "
        f"Search time: `plan_auto` in one process on the shipped h100-nvlink-ib profile, "
        f"batch 8, 80 GiB per rank; analysis = tracing the model once at one sample; "
        f"search = enumerating and costing every plan; compile = fxpar.compile of the choice "
        f"(what --plan auto then runs anyway); whole = the plan_auto call end to end. The last "
        f"row ({WHOLE[0]} at {WHOLE[3]}^2 on {WHOLE[4]:,} ranks) has an aim.")
    aims.append({"what": f"plan_auto of {WHOLE[0]} at {WHOLE[3]}^2 on {WHOLE[4]:,} ranks, the "
                         f"whole call (the check of its choice included)",
                 "aim": f"<= {WHOLE_AIM:g} s", "measured": f"{whole:.2f} s",
                 "met": whole <= WHOLE_AIM, "why": None if whole <= WHOLE_AIM else
                 "see the profile of plan_auto: tracing twice, lowering every rank"})
    return {
        "name": "planner", "title": TITLE, "method": method,
        "tables": [
            {"title": "Planner's choice vs the best hand plan (2 ranks, measured step s)",
             "columns": ["model", "planner's choice", "measured s", "best hand plan",
                         "measured s", "choice / best"], "rows": summary},
            {"title": "Every plan measured (median step s [range]; vs the best hand plan)",
             "columns": ["model", "plan", "rank", "step s", "vs best hand"], "rows": rows},
            {"title": f"The planner's predicted top {TOP} hand plans, in predicted order "
                      f"(predicted / measured step s)",
             "columns": ["model", "plans", "Spearman"], "rows": orders},
            {"title": "Search time of plan_auto (H100 profile, batch 8, 80 GiB per rank)",
             "columns": ["model", "image", "ranks", "plans searched", "plans that fit",
                         "analysis s", "search s", "compile s", "whole s", "chosen plan",
                         "predicted step s"], "rows": search}],
        "plots": [], "aims": aims, "notes": "",
        "raw": {"profile": profile.to_json(), "chosen": chosen, "predicted": predicted,
                "measured": {f"{m}/{n}": v for (m, n), v in measured.items()}},
    }


def spearman(xs: list[float], ys: list[float]) -> float:
    """Spearman's rank correlation of ``xs`` and ``ys`` (Pearson's of their ranks, ties
    sharing the mean rank); NaN (not met) for fewer than 2 values or a constant side."""
    def ranks(vs: list[float]) -> list[float]:
        order = sorted(range(len(vs)), key=vs.__getitem__)
        out = [0.0] * len(vs)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and vs[order[j + 1]] == vs[order[i]]:
                j += 1
            for k in order[i:j + 1]:
                out[k] = (i + j) / 2 + 1
            i = j + 1
        return out

    if len(xs) < 2 or len(set(xs)) < 2 or len(set(ys)) < 2:
        return math.nan
    return statistics.correlation(ranks(xs), ranks(ys))


def _same_plan(fields: dict[str, Any], hand: dict[str, dict[str, Any]]) -> str | None:
    """The hand plan that is the planner's plan (the same Plan, one-stage balance aside)."""
    import fxpar

    mine = fxpar.Plan(**fields)
    if mine.stages == 1:
        mine = fxpar.Plan(**{**fields, "balance": None})
    return next((n for n, f in hand.items() if fxpar.Plan(**f) == mine), None)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--worker" in argv:
        p = argparse.ArgumentParser()
        p.add_argument("--worker", action="store_true")
        p.add_argument("--model", required=True)
        p.add_argument("--plans", required=True)
        p.add_argument("--image", type=int, default=128)
        p.add_argument("--batch", type=int, default=8)
        p.add_argument("--steps", type=int, default=3)
        p.add_argument("--local-auto", action="store_true",
                       help="first choose a plan on this machine's profile (bench_planauto)")
        worker(p.parse_args(argv))
        return 0
    return benchlib.standalone(__doc__.split("\n\n")[0], add_args, run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
