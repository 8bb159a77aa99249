"""Benchmark section ``single``: what fxpar's machinery costs on one rank.

A single-rank fxpar program (``fxpar.compile(model, Plan(), ...).for_rank(0).train_step``)
runs the traced graph through fxpar's runtime interpreter; the eager step is the loop a user
would write (zero_grad, forward, cross_entropy, backward, SGD step). Both train identical copies
of one model on one fixed batch with the same SGD hyperparameters, so any time difference is
fxpar's overhead. Run through ``tools/bench.py --only single``; ``--worker`` is the
per-round process it launches.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib  # noqa: E402

TITLE = "Single rank: fxpar program vs eager PyTorch"
AIM = 1.03  # the bound on fxpar / eager step time
SEED, CLASSES, LR, MOMENTUM, WD = 0, 10, 0.01, 0.9, 1e-4
MODELS = {  # name -> (zoo spec, factory kwargs); kept small enough for a 1-thread CPU step
    "resnet18": ("torchvision:resnet18", {"num_classes": CLASSES}),
    "amoebanet": ("models:amoebanet", {"num_classes": CLASSES, "num_layers": 2,
                                       "num_filters": 64}),
}
QUICK = {"image": 64, "batch": 4, "steps": 3, "warmup": 1, "amoebanet_filters": 16}


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--single-models", default=",".join(MODELS),
                        help=f"comma-separated, of {', '.join(MODELS)}")
    parser.add_argument("--single-image-size", type=int, default=224)
    parser.add_argument("--single-batch", type=int, default=8)
    parser.add_argument("--single-steps", type=int, default=10,
                        help="timed steps of each system per round (interleaved)")
    parser.add_argument("--single-warmup", type=int, default=2,
                        help="untimed steps of each system first")
    parser.add_argument("--single-threads", type=int, default=1, help="intra-op threads")
    parser.add_argument("--single-device", default="auto", choices=["auto", "cpu", "cuda"],
                        help="auto: cpu, plus cuda when torch sees a GPU")


# -- worker ----------------------------------------------------------------------------------
def _sgd(params: Any) -> Any:
    import torch

    return torch.optim.SGD(params, lr=LR, momentum=MOMENTUM, weight_decay=WD)


def worker(a: argparse.Namespace) -> dict[str, Any]:
    """Warm both systems up, then time them interleaved (ABAB...) on identical weights."""
    import torch
    import torch.nn.functional as F

    import fxpar
    from fxpar.models.zoo import build_model

    torch.set_num_threads(a.threads)
    dev = torch.device(a.device)
    torch.manual_seed(SEED)
    spec, kwargs = MODELS[a.model]
    if a.model == "amoebanet":
        kwargs = {**kwargs, "num_filters": a.filters}
    model = build_model(spec, **kwargs).to(dev).train()
    eager = copy.deepcopy(model)  # fxpar's program shares (and trains) model's parameters
    gen = torch.Generator().manual_seed(SEED)
    x = torch.randn(a.batch, 3, a.image, a.image, generator=gen).to(dev)
    y = torch.randint(0, CLASSES, (a.batch,), generator=gen).to(dev)
    t0 = time.perf_counter()
    rank = fxpar.compile(model, fxpar.Plan(), x, optimizer=_sgd).for_rank(0)
    compile_s = time.perf_counter() - t0
    opt = _sgd(eager.parameters())

    def eager_step() -> float:
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(eager(x), y)
        loss.backward()
        opt.step()
        return loss.item()

    def fxpar_step() -> float:
        return rank.train_step(x, y)

    def timed(step: Any) -> tuple[float, float]:
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        loss = step()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t, loss

    systems = {"eager": eager_step, "fxpar": fxpar_step}
    order = ["fxpar", "eager"] if a.fxpar_first else ["eager", "fxpar"]
    times: dict[str, list[float]] = {"eager": [], "fxpar": []}
    losses: dict[str, list[float]] = {"eager": [], "fxpar": []}
    for i in range(a.warmup + a.steps):
        for name in order:  # same step index, same weights history: losses must agree
            dt, loss = timed(systems[name])
            losses[name].append(loss)
            if i >= a.warmup:
                times[name].append(dt)
    diffs = [abs(e - f) for e, f in zip(losses["eager"], losses["fxpar"], strict=True)]
    return {"times": times, "losses": losses, "first_loss_diff": diffs[0],
            "max_loss_diff": max(diffs), "compile_s": compile_s,
            "ratio": statistics.median(times["fxpar"]) / statistics.median(times["eager"]),
            "peak_rss_mib": benchlib.peak_rss_mib(),
            "gpu": torch.cuda.get_device_name(dev) if dev.type == "cuda" else None}


# -- driver ----------------------------------------------------------------------------------
def _config(opts: argparse.Namespace) -> dict[str, Any]:
    q = bool(getattr(opts, "quick", False))
    return {"image": QUICK["image"] if q else opts.single_image_size,
            "batch": QUICK["batch"] if q else opts.single_batch,
            "steps": QUICK["steps"] if q else opts.single_steps,
            "warmup": QUICK["warmup"] if q else opts.single_warmup,
            "filters": QUICK["amoebanet_filters"] if q else MODELS["amoebanet"][1]["num_filters"],
            "threads": opts.single_threads}


def devices(choice: str) -> list[str]:
    if choice != "auto":
        return [choice]
    import torch

    return ["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"]


def run(opts: argparse.Namespace) -> dict[str, Any]:
    cfg = _config(opts)
    models = [m.strip() for m in opts.single_models.split(",") if m.strip()]
    bad = [m for m in models if m not in MODELS]
    if bad:
        raise ValueError(f"--single-models: unknown {bad}; choose from {', '.join(MODELS)}")
    cases = [(m, d) for m in models for d in devices(opts.single_device)]

    def one(case: tuple[str, str], k: int) -> dict[str, Any]:
        args = ["--worker", "--model", case[0], "--device", case[1],
                *[f"--{key}={val}" for key, val in cfg.items()]]
        if k % 2:  # fxpar and eager alternate which runs first inside the worker
            args.append("--fxpar-first")
        return benchlib.measure(
            benchlib.worker_command("bench_single.py", args),
            benchlib.thread_env(cfg["threads"]), retries=opts.retries,
            max_foreign=opts.max_foreign, timeout=opts.timeout)

    rounds = benchlib.interleave("single", opts.rounds, cases, one, key="/".join)
    return section(rounds, cases, cfg, opts)


def section(rounds: list[dict[str, Any]], cases: list[tuple[str, str]], cfg: dict[str, Any],
            opts: argparse.Namespace) -> dict[str, Any]:
    """The Section dict from the per-round worker records."""
    rows, aims, ratio_plot, bars = [], [], {}, {"eager": [], "fxpar": []}
    summary: dict[str, Any] = {}
    for model, dev in cases:
        key = f"{model}/{dev}"
        recs = [r[key] for r in rounds]
        ratio = benchlib.spread([r["ratio"] for r in recs])
        med = {s: benchlib.spread([statistics.median(r["times"][s]) for r in recs])
               for s in ("eager", "fxpar")}
        diff = max(r["max_loss_diff"] for r in recs)
        summary[key] = {"ratio": ratio, "step_s": med, "max_loss_diff": diff,
                        "first_loss_diff": max(r["first_loss_diff"] for r in recs),
                        "compile_s": benchlib.spread([r["compile_s"] for r in recs])}
        rows.append([model, dev, benchlib.fmt_spread(med["eager"], digits=3),
                     benchlib.fmt_spread(med["fxpar"], digits=3),
                     benchlib.fmt_spread(ratio, "x"), f"{diff:.1e}"])
        aims.append({"what": f"fxpar / eager step time, {model} on {dev}",
                     "aim": f"<= {AIM:.2f}x", "measured": benchlib.fmt_spread(ratio, "x"),
                     "met": ratio["median"] <= AIM,
                     "why": None if ratio["median"] <= AIM else
                     "Median of per-round ratios above the bound; see the notes."})
        ratio_plot[key] = [[i + 1, r["ratio"]] for i, r in enumerate(recs)]
        for s in bars:
            bars[s].append([key, med[s]["median"] * 1000])
    gpu = next((r[k]["gpu"] for r in rounds for k in r if r[k].get("gpu")), None)
    foreign = max((r[k]["foreign"] for r in rounds for k in r), default=0.0)
    method = (
        f"Models: torchvision resnet18 and AmoebaNet-D (num_layers=2, "
        f"num_filters={cfg['filters']}), {CLASSES} classes, float32, batch {cfg['batch']} at "
        f"{cfg['image']}x{cfg['image']}, one fixed synthetic batch, SGD lr {LR} momentum "
        f"{MOMENTUM} weight decay {WD}, {cfg['threads']} intra-op thread(s). Each round is one "
        f"fresh worker process per model and device: it builds the model, deep-copies it for "
        f"the eager loop, compiles the original with `fxpar.Plan()` (one rank), runs "
        f"{cfg['warmup']} warm-up step(s) of each system, then {cfg['steps']} timed steps of "
        f"each, interleaved (eager, fxpar, eager, ...; fxpar first in odd rounds). A step is "
        f"timed to its Python float loss (CUDA synchronised on a GPU). The round's ratio is "
        f"median(fxpar) / median(eager); the tables give the median and range of those ratios "
        f"over {len(rounds)} round(s). Both systems see the same weights history, so their "
        f"losses must agree at every step: the largest difference is in the last column. "
        f"Launches saw at most {foreign:.2f} foreign cores.")
    return {
        "name": "single", "title": TITLE, "method": method,
        "gpu": gpu or "not measured (no GPU on this machine)",
        "tables": [{"title": "Step time, seconds (median over rounds, range)",
                    "columns": ["model", "device", "eager step s", "fxpar step s",
                                "fxpar / eager", "max loss diff"], "rows": rows}],
        "plots": [
            {"file": "single_ratio.png", "title": "fxpar / eager step time per round",
             "xlabel": "round", "ylabel": "ratio", "kind": "line", "series": ratio_plot,
             "hline": AIM},
            {"file": "single_step.png", "title": "median step time", "xlabel": "",
             "ylabel": "ms", "kind": "bar", "series": bars}],
        "aims": aims, "notes": "",
        "raw": {"config": cfg, "summary": summary, "rounds": rounds},
    }


def main() -> None:
    p = argparse.ArgumentParser(description="worker of tools/bench.py --only single")
    p.add_argument("--worker", action="store_true", required=True)
    p.add_argument("--model", choices=list(MODELS), required=True)
    p.add_argument("--device", default="cpu")
    p.add_argument("--image", type=int, default=224)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--filters", type=int, default=64)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--fxpar-first", action="store_true")
    benchlib.emit(worker(p.parse_args()))


if __name__ == "__main__":
    main()
