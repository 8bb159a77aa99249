"""Benchmark section ``memory``: what a spatial rank holds, and how large an image fits.

(b) Memory vs P: one train step of plain eager PyTorch (P=1) and of fxpar with P=2 (1x2 grid)
    and P=4 (2x2 grid) tiles, ResNet-18 and AmoebaNet-D at 1024x1024, in fresh processes (this
    file's worker; an fxpar rank fills only its input window of the batch, as ``fxpar-run
    --data`` does). Per rank: the bytes saved for backward by the forward pass
    (``torch.autograd.graph.saved_tensors_hooks``, unique storages, parameters excluded) and
    the step's peak RSS growth (peak RSS after it minus RSS before it).
(c) Where the peak goes (ResNet-18, P=1 and P=4): a second launch tracks every live tensor
    storage through the step (``memtrack.PeakTracker``, a TorchDispatchMode) and splits the peak
    RSS growth into gradients, momentum, saved activations, received halo pieces, other live
    tensors, the op running at the peak, glibc's free heap (mallinfo2), library pages and the
    rest; and the same step under other glibc malloc settings.
(d) Largest image: without a GPU, an ESTIMATE from fxpar's memory estimator
    (fxpar/perf/memory.py, what ``fxpar-inspect --memory`` prints) of the largest square image,
    a multiple of 256, whose busiest rank fits a per-rank budget (80 GiB) for P = 1..16 tiles.
    With a GPU, the single-GPU (P=1) value is also measured: real train steps, sizes tried
    until one runs out of memory.

Run through ``tools/bench.py --only memory``, or alone: ``python tools/bench_memory.py --quick``
prints the Section JSON.
"""

from __future__ import annotations

import argparse
import gc
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_spatial  # noqa: E402
import benchlib  # noqa: E402
from memtrack import breakdown_step, saved_step  # noqa: E402

TITLE = "Spatial parallelism: memory per rank and the largest trainable image"
MEMORY_AIM = 0.30  # per-rank / one-process, at P=4
STEP = 256  # image sizes searched: multiples of this
EST_MODELS = {"resnet50": "", "amoebanet": "18,208"}  # AmoebaNet-D (18, 208): GPipe's
PARTS = {1: "square", 2: "vertical", 4: "square"}  # P -> slice of the measured runs
BREAKDOWN_MODEL = "resnet18"
MALLOC_ENVS = {"MALLOC_MMAP_THRESHOLD_=1 MiB": {"MALLOC_MMAP_THRESHOLD_": str(2**20)},
               "MALLOC_ARENA_MAX=1": {"MALLOC_ARENA_MAX": "1"}}
"""glibc settings the breakdown's step also runs under (fxpar sets none): a fixed mmap
threshold stops glibc raising it (up to 32 MiB) after each freed mmapped block, so freed
tile-sized tensors go back to the system instead of staying in the heap; one arena instead of
one per thread."""


def add_args(parser: argparse._ActionsContainer) -> None:
    parser.add_argument("--memory-models", default=",".join(bench_spatial.MODELS),
                        help=f"measured: comma-separated, of {', '.join(bench_spatial.MODELS)}")
    parser.add_argument("--memory-image", type=int, default=1024)
    parser.add_argument("--memory-batch", type=int, default=2)
    parser.add_argument("--memory-amoeba", default="2,64",
                        help="measured AmoebaNet-D num_layers,num_filters")
    parser.add_argument("--memory-budget-gib", type=float, default=80.0,
                        help="per-rank memory of the estimate (an 80 GB GPU)")
    parser.add_argument("--memory-est-models", default=",".join(EST_MODELS),
                        help=f"estimated: comma-separated, of {', '.join(EST_MODELS)}")
    parser.add_argument("--memory-est-parts", default="1,2,4,8,16")


# -- the worker (one launch) -----------------------------------------------------------------
def worker_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="one launch of the memory benchmark")
    p.add_argument("--worker", required=True, choices=["step", "breakdown"])
    p.add_argument("--model", default="resnet18")
    p.add_argument("--amoeba", default="2,64")
    p.add_argument("--image", type=int, default=256)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--parts", type=int, default=1, help="1: plain eager PyTorch")
    p.add_argument("--slice", default="square")
    return p


def input_batch(shape: tuple[int, ...], window: Any) -> tuple[Any, Any]:
    """The benchmark's batch (seed 0: the same values for every P) as a rank reading only
    ``window`` (a Rect; None: all) holds it: a full-shape ``torch.empty`` with the window
    filled, one image plane drawn at a time, so the rank never holds the whole batch."""
    import torch

    gen = torch.Generator().manual_seed(0)
    x = torch.empty(shape)
    box = (...,) if window is None else tuple(slice(a, b) for a, b in window.dims)
    for n in range(shape[0]):
        for c in range(shape[1]):
            x[n, c][box] = torch.randn(shape[2:], generator=gen)[box]
    return x, torch.randint(0, bench_spatial.CLASSES, (shape[0],), generator=gen)


def worker(a: argparse.Namespace) -> None:
    """One train step, its first: ``step`` records saved activations and peak RSS growth,
    ``breakdown`` where the peak goes. Rank 0 emits one BENCH line with every rank's record."""
    import math

    import torch

    import fxpar

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = bench_spatial.build(a.model, a.amoeba).train()
    shape = (a.batch, 3, a.image, a.image)
    comm, window = None, None
    if a.parts == 1:
        x, y = input_batch(shape, None)
        step, params = bench_spatial.eager_step(model, x, y), list(model.parameters())
    else:
        plan = fxpar.Plan(spatial_parts=a.parts, slice=a.slice)
        rp = fxpar.compile(model, plan, torch.empty(shape, device="meta"),
                           optimizer=bench_spatial.sgd).local()
        del model  # the rank keeps only its own parameters
        comm, params, window = rp.comm, list(rp.parameters()), rp.input_window()
        x, y = input_batch(shape, window)

        def step() -> float:
            return rp.train_step(x, y)

    area = math.prod(shape[2:]) if window is None else math.prod(window.shape)
    rec = saved_step(step, params) if a.worker == "step" else \
        breakdown_step(step, params, x, shape[0] * shape[1] * area * x.element_size())
    ranks = [rec] if comm is None else comm.gather_object(rec)
    if comm is None or comm.rank == 0:
        benchlib.emit({"ranks": ranks, **ranks[0]})


def launch(opts: argparse.Namespace, cfg: dict[str, Any], worker_: str, model: str,
           parts: int, slice_: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    """One measured worker launch: ``mpiexec -n parts`` for P > 1, one process for P = 1."""
    args = ["--worker", worker_, "--model", model, "--amoeba", cfg["amoeba"], "--image",
            str(cfg["image"]), "--batch", str(cfg["batch"]), "--parts", str(parts), "--slice",
            slice_]
    cmd = benchlib.worker_command("bench_memory.py", args, parts if parts > 1 else None)
    return benchlib.measure(cmd, {**benchlib.thread_env(1), **(env or {})},
                            retries=opts.retries, max_foreign=opts.max_foreign,
                            timeout=opts.timeout)


# -- the largest image -------------------------------------------------------------------------
def largest(fits: Callable[[int], bool], guess: int, step: int = STEP) -> int:
    """The largest multiple of ``step`` for which ``fits`` (monotone: true up to some size)
    holds, 0 if not even ``step`` fits. Gallops from ``guess`` then bisects, so a good guess
    costs two calls."""
    s = max(step, guess // step * step)
    if fits(s):
        lo, jump = s, step
        while fits(lo + jump):
            lo, jump = lo + jump, jump * 2
        hi = lo + jump
    else:
        hi, jump = s, step
        while True:
            lo = hi - jump
            if lo < step:
                if not fits(step):
                    return 0
                lo = step
                break
            if fits(lo):
                break
            hi, jump = lo, jump * 2
    while hi - lo > step:  # fits(lo), not fits(hi)
        mid = (lo + hi) // 2 // step * step
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def estimated_bytes(model: Any, parts: int, size: int) -> dict[str, int]:
    """fxpar's estimate for the busiest rank training ``model`` on one ``size``x``size`` image
    over ``parts`` tiles (square grid), plus the input tile it reads (the estimator leaves the
    input batch out)."""
    import torch

    import fxpar
    from fxpar.perf.memory import estimate

    plan = fxpar.Plan() if parts == 1 else fxpar.Plan(spatial_parts=parts, slice="square")
    program = fxpar.compile(model, plan, torch.empty(1, 3, size, size, device="meta"),
                            optimizer=bench_spatial.sgd)
    ranks = estimate(program)
    top = max(ranks, key=lambda m: m.total)
    rows, cols = bench_spatial.grid_of(parts, "square")
    tile = 3 * -(-size // rows) * -(-size // cols) * 4
    return {"total": top.total + tile, "fixed": top.params + top.grads + top.optimizer,
            "varying": top.activations + top.received + tile}


def estimate_table(name: str, parts_list: list[int], budget: float) -> list[dict[str, Any]]:
    """Largest image per P for one model, by the estimator. A 1024^2 compile at P=1 predicts
    each P's size (the varying part grows with the area, divided by P); ``largest`` checks it."""
    model = bench_spatial.build(name, EST_MODELS[name], meta=True, classes=1000)
    ref = estimated_bytes(model, 1, 1024)
    out = []
    for parts in parts_list:
        calls: dict[int, int] = {}

        def fits(size: int, parts: int = parts, calls: dict[int, int] = calls) -> bool:
            if size not in calls:
                calls[size] = estimated_bytes(model, parts, size)["total"]
            return calls[size] <= budget

        guess = int(1024 * ((budget - ref["fixed"]) * parts / ref["varying"]) ** 0.5)
        size = largest(fits, guess)
        out.append({"model": name, "parts": parts, "size": size,
                    "bytes": calls.get(size, 0), "compiles": len(calls), "guess": guess})
        print(f"memory: {name} P={parts}: {size}^2 (estimated)", file=sys.stderr, flush=True)
    return out


def cuda_largest(name: str, guess: int) -> dict[str, Any]:
    """The largest square image (multiple of 256) one real train step fits on this GPU, batch
    1: sizes tried from ``guess`` until out of memory. Only runs where torch sees a GPU."""
    import torch
    import torch.nn.functional as F

    model = bench_spatial.build(name, EST_MODELS[name], classes=1000).cuda().train()
    opt = bench_spatial.sgd(model.parameters())

    def fits(size: int) -> bool:
        try:
            x = torch.randn(1, 3, size, size, device="cuda")
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(model(x), torch.zeros(1, dtype=torch.long, device="cuda")).backward()
            opt.step()
            torch.cuda.synchronize()
            return True
        except torch.cuda.OutOfMemoryError:
            return False
        finally:
            x = None
            gc.collect()
            torch.cuda.empty_cache()

    size = largest(fits, guess)
    return {"model": name, "size": size, "gpu": torch.cuda.get_device_name(0),
            "gpu_bytes": torch.cuda.get_device_properties(0).total_memory}


# -- driver ------------------------------------------------------------------------------------
def config(opts: argparse.Namespace) -> dict[str, Any]:
    q = bool(getattr(opts, "quick", False))
    return {"image": 256 if q else opts.memory_image, "batch": 1 if q else opts.memory_batch,
            "amoeba": "2,16" if q else opts.memory_amoeba, "steps": 1, "warmup": 0,
            "models": _names(opts.memory_models, bench_spatial.MODELS, "--memory-models"),
            "est_models": ["resnet50"] if q else
            _names(opts.memory_est_models, tuple(EST_MODELS), "--memory-est-models"),
            "est_parts": [1, 4] if q else [int(p) for p in opts.memory_est_parts.split(",")],
            "budget": opts.memory_budget_gib * 2**30}


def _names(text: str, known: tuple[str, ...], flag: str) -> list[str]:
    names = [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in names if m not in known]
    if bad:
        raise ValueError(f"{flag}: unknown {bad}; choose from {', '.join(known)}")
    return names


def run(opts: argparse.Namespace) -> dict[str, Any]:
    cfg = config(opts)
    measured: dict[str, dict[str, Any]] = {}
    for model in cfg["models"]:
        for parts, slice_ in PARTS.items():
            rec = launch(opts, cfg, "step", model, parts, slice_)
            measured[f"{model}/{parts}"] = {"model": model, "parts": parts, "slice": slice_,
                                            **_per_rank_max(rec)}
    breakdown: dict[str, dict[str, Any]] = {}
    if BREAKDOWN_MODEL in cfg["models"]:
        for parts in (1, 4):
            print(f"memory: breakdown P={parts}", file=sys.stderr, flush=True)
            rec = launch(opts, cfg, "breakdown", BREAKDOWN_MODEL, parts, PARTS[parts])
            breakdown[str(parts)] = {**max(rec["ranks"], key=lambda r: r["growth"]),
                                     "ranks": [r["growth"] for r in rec["ranks"]]}
            for label, env in MALLOC_ENVS.items():
                rec = launch(opts, cfg, "step", BREAKDOWN_MODEL, parts, PARTS[parts], env)
                breakdown[f"{label}/{parts}"] = _per_rank_max(rec)
    cfg["breakdown"] = breakdown
    est = [row for name in cfg["est_models"]
           for row in estimate_table(name, cfg["est_parts"], cfg["budget"])]
    real = []
    import torch

    if torch.cuda.is_available():
        real = [cuda_largest(r["model"], r["size"]) for r in est if r["parts"] == 1]
    return section(measured, est, real, cfg)


def _per_rank_max(rec: dict[str, Any]) -> dict[str, Any]:
    ranks = rec["ranks"]
    return {"saved": max(r["saved_bytes"] for r in ranks),
            "growth": max(r["peak_growth"] for r in ranks),
            "raised": all(r["raised"] for r in ranks), "param_bytes": ranks[0]["param_bytes"],
            "ranks": ranks, "foreign": rec["foreign"]}


def _label(name: str) -> str:
    """``amoebanet (18,208)``: the estimate's AmoebaNet-D is not the measured one."""
    return f"{name} ({EST_MODELS[name]})" if EST_MODELS.get(name) else name


def _mib(b: float) -> str:
    return f"{b / 2**20:.1f}"


def section(measured: dict[str, dict[str, Any]], est: list[dict[str, Any]],
            real: list[dict[str, Any]], cfg: dict[str, Any]) -> dict[str, Any]:
    rows, aims, plot = [], [], {}
    for model in cfg["models"]:
        one = measured[f"{model}/1"]
        for parts in PARTS:
            m = measured[f"{model}/{parts}"]
            m["saved_ratio"], m["growth_ratio"] = m["saved"] / one["saved"], \
                m["growth"] / one["growth"]
            rows.append([model, parts, m["slice"] if parts > 1 else "eager, 1 process",
                         _mib(m["saved"]), f"{m['saved_ratio']:.3f}", _mib(m["growth"]),
                         f"{m['growth_ratio']:.3f}" + ("" if m["raised"] else " (lower bound)")])
            plot.setdefault(f"{model} saved activations", []).append([parts, m["saved_ratio"]])
            plot.setdefault(f"{model} peak RSS growth", []).append([parts, m["growth_ratio"]])
        m4 = measured[f"{model}/4"]
        img = cfg["batch"] * 3 * cfg["image"] ** 2 * 4
        for what, key in (("saved activations", "saved"), ("peak RSS growth", "growth")):
            r = m4[f"{key}_ratio"]
            ideal = one[key] / 4
            why = (f"P=4 keeps {_mib(m4[key])} MiB per rank against a quarter of one "
                   f"process's {_mib(one[key])} MiB = {_mib(ideal)} MiB; the "
                   f"{_mib(m4[key] - ideal)} MiB above it do not shrink with P.")
            why += (f" The first layer's halo op keeps the rank's input batch, full-shape "
                    f"({_mib(img)} MiB of storage, counted whole here) with only its window "
                    f"filled." if key == "saved" else
                    _growth_why(cfg.get("breakdown", {})) if model == BREAKDOWN_MODEL else
                    f" Gradients ({_mib(m4['param_bytes'])} MiB) are allocated on every rank "
                    f"whatever P, and glibc keeps freed tile-sized blocks in its heap.")
            aims.append({"what": f"{what} per rank at P=4 / one process, {model}",
                         "aim": f"<= {MEMORY_AIM:.2f}x", "measured": f"{r:.3f}x",
                         "met": r <= MEMORY_AIM, "why": None if r <= MEMORY_AIM else why})
    budget = cfg["budget"] / 2**30
    erows = [[_label(r["model"]), r["parts"], f"{r['size']}^2", f"{r['bytes'] / 2**30:.1f}",
              "estimated, not measured"] for r in est]
    erows += [[_label(r["model"]), 1, f"{r['size']}^2", f"{r['gpu_bytes'] / 2**30:.1f} (GPU)",
               f"measured on {r['gpu']}"] for r in real]
    eplot: dict[str, list[list[float]]] = {}
    for r in est:
        eplot.setdefault(f"{_label(r['model'])} (estimated)", []).append([r["parts"], r["size"]])
    method = (
        f"**Memory vs P** (transport: {bench_spatial.TRANSPORT}): torchvision resnet18 and "
        f"AmoebaNet-D (num_layers,num_filters = {cfg['amoeba']}), float32, batch "
        f"{cfg['batch']} at {cfg['image']}x{cfg['image']}, SGD with momentum. Each system is a "
        f"fresh process (or `mpiexec -n P`) running ONE train step, its first (launched after a "
        f"quiet spell): P=1 is plain eager PyTorch, P=2 a 1x2 and P=4 a 2x2 tile grid, each "
        f"rank filling only its input window of a full-shape batch (as `fxpar-run --data` "
        f"does). Saved "
        f"activations: the bytes of the unique storages (views counted once, by data pointer) "
        f"that `torch.autograd.graph.saved_tensors_hooks` sees packed outside backward during "
        f"the step, parameters excluded; custom autograd Functions' `ctx.save_for_backward` "
        f"(fxpar's halo and BatchNorm ops) goes through the same hooks. Peak memory: the "
        f"process's peak RSS after the step (`ru_maxrss`) minus its RSS just before it, i.e. "
        f"what the step added at its peak (activations, gradients, momentum, temporaries; "
        f"'lower bound' where the step did not raise the process's earlier peak). Ratios are "
        f"the largest rank's value over the P=1 value. **Where the peak goes** (ResNet-18, "
        f"P=1 and P=4): another launch runs the step under a TorchDispatchMode that holds every "
        f"tensor storage an op returns by weak reference; at the op during which the peak RSS "
        f"(VmHWM, reset after `malloc_trim` just before the step) last rose, the storages live "
        f"when it began are sorted into components, and the rest of the growth into that op's "
        f"outputs and workspace, glibc's free heap (`mallinfo2`), library and shared-memory "
        f"pages (/proc/self/status) and what remains; the same step also runs untracked under "
        f"other glibc malloc settings. **Largest image**: estimated, not "
        f"measured: fxpar's estimator (`fxpar/perf/memory.py`, `fxpar-inspect --memory`: "
        f"parameters, gradients, momentum, saved node outputs split over the tiles plus halos, "
        f"received buffers), plus the rank's input tile, for one image (batch 1) of a "
        f"1000-class model compiled on the meta device; the largest multiple of {STEP} whose "
        f"busiest rank stays within {budget:.0f} GiB. Not counted there: temporaries inside "
        f"ops, allocator overhead, the CUDA context, so real limits are lower. AmoebaNet-D here "
        f"is GPipe's (18, 208); ResNet-50 is torchvision's.")
    return {
        "name": "memory", "title": TITLE, "method": method,
        "tables": [
            {"title": "Memory per rank, one train step (largest rank; MiB)",
             "columns": ["model", "P", "tiles", "saved activations", "/ P=1",
                         "peak RSS growth", "/ P=1"], "rows": rows},
            {"title": f"Largest square image per rank count, {budget:.0f} GiB per rank "
                      f"(estimated, not measured)",
             "columns": ["model", "P", "largest image", "GiB at that size", "source"],
             "rows": erows}, *breakdown_tables(cfg.get("breakdown", {}))],
        "plots": [
            {"file": "memory_vs_p.png", "title": "Per-rank memory / one process",
             "xlabel": "spatial parts P", "ylabel": "ratio to P=1", "kind": "line",
             "series": plot, "hline": MEMORY_AIM},
            {"file": "memory_largest_image.png",
             "title": f"Largest image within {budget:.0f} GiB per rank (estimated)",
             "xlabel": "spatial parts P", "ylabel": "image side (pixels)", "kind": "line",
             "series": eplot}],
        "aims": aims, "notes": "",
        "raw": {"config": cfg, "measured": measured, "estimated": est, "cuda": real},
    }


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.3f}" if b else "-"


def breakdown_tables(b: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """The breakdown launches' tables (none when they did not run): the components of the
    peak RSS growth at P=1 and P=4, and the growth under other glibc settings and as live
    tensor bytes."""
    if "1" not in b or "4" not in b:
        return []
    one, four = b["1"], b["4"]
    rows = [[f"{k} (held before the step)", _mib(one["held"][k]), _mib(four["held"][k]),
             _ratio(four["held"][k], one["held"][k])] for k in ("parameters", "input")]
    rows += [[k, _mib(v), _mib(four["parts"][k]), _ratio(four["parts"][k], v)]
             for k, v in one["parts"].items()]
    rows.append(["**peak RSS growth (sum)**", _mib(one["growth"]), _mib(four["growth"]),
                 _ratio(four["growth"], one["growth"])])
    rows.append(["the op at the peak", one["peak_op"], four["peak_op"], ""])
    other = [["peak RSS growth, glibc defaults (this launch)", one["growth"], four["growth"]]]
    other += [[f"peak RSS growth, {label}", b[f"{label}/1"]["growth"],
               b[f"{label}/4"]["growth"]] for label in MALLOC_ENVS if f"{label}/1" in b]
    other.append(["live tensor bytes at their peak (the CPU counterpart of "
                  "`torch.cuda.max_memory_allocated`)", one["live_peak_growth"],
                  four["live_peak_growth"]])
    return [
        {"title": f"Where the peak RSS growth goes, {BREAKDOWN_MODEL}, one train step (MiB; "
                  f"P=4: its rank with the largest growth; tracked launch)",
         "columns": ["component", "P=1 MiB", "P=4 MiB", "P=4/P=1"], "rows": rows},
        {"title": f"Peak growth per rank by other measures, {BREAKDOWN_MODEL} (MiB)",
         "columns": ["measure", "P=1 MiB", "P=4 MiB", "P=4/P=1"],
         "rows": [[k, _mib(u), _mib(v), _ratio(v, u)] for k, u, v in other]}]


def _growth_why(b: dict[str, dict[str, Any]]) -> str:
    """What the breakdown launches say holds the P=4 rank's growth above a quarter."""
    if "1" not in b or "4" not in b:
        return ""
    one, four = b["1"]["parts"], b["4"]["parts"]
    heap, grads = "glibc free heap", "gradients"
    text = (f" At its peak ({b['4']['peak_op']}) the P=4 rank held {_mib(four[grads])} MiB of "
            f"gradients (P=1: {_mib(one[grads])}), {_mib(four['saved activations'])} MiB of "
            f"saved activations (P=1: {_mib(one['saved activations'])}) and "
            f"{_mib(four[heap])} MiB of freed heap glibc had not returned (P=1: "
            f"{_mib(one[heap])}; tile-sized blocks fall under glibc's self-raising mmap "
            f"threshold and stay in the heap, one process's larger blocks are mmapped and "
            f"returned).")
    fixed = [label for label in MALLOC_ENVS if "MMAP" in label and f"{label}/4" in b]
    if fixed:
        r = b[f"{fixed[0]}/4"]["growth"] / b[f"{fixed[0]}/1"]["growth"]
        text += f" With {fixed[0]} the same step's ratio is {r:.3f}x"
    lp = b["4"]["live_peak_growth"] / b["1"]["live_peak_growth"]
    return text + f"; counted as live tensor bytes (what a GPU's allocator reports) {lp:.3f}x."


def main(argv: list[str] | None = None) -> int:
    return benchlib.entry(__doc__.split("\n\n")[0], add_args, run, argv, worker,
                          worker_parser)


if __name__ == "__main__":
    raise SystemExit(main())
