"""Benchmark section ``attention``: global attention on tiles (issue 40, item 6).

Models (tools/attention_models.py): a ViT-style segmentation encoder on a 1024x1024 image
(16x16 patches: 64x64 = 4096 tokens, pre-norm blocks with global multi-head attention through
``F.scaled_dot_product_attention``, which fxpar runs as ring attention over the tile group) and
MONAI's SwinUNETR at 128^3 (windowed attention; its region may end early, so its coverage is
reported next to each of its figures). float32, batch 1, per-pixel (per-voxel) cross-entropy,
SGD with momentum.

(1) Time: one train step (forward, backward, optimizer) of SP2 and SP4 (``mpiexec -n P``, one
    thread per rank) against one process, next to the limit measured in the same rounds: P
    independent processes, each training plain PyTorch on its own tile with no messages. For
    the ViT each limit process attends its tile's queries to its keys and values repeated P
    times: 1/P of the one-process work (a ViT on 1/P of the image alone does 1/P^2 of the
    attention). Each round launches every system as a fresh process, in rotated order.
(2) Bytes: one step under ``mpiexec -n P`` with ``Comm.isend`` counted by tag (ring attention,
    halo exchanges, the rest), per rank, against ``ring_bytes`` summed over the RingAttention
    calls (shapes from forward pre-hooks) and against the minimum: forward, every other tile's
    K and V ((P-1)/P of them); backward, the partial dK, dV of a rank's tokens from every other
    rank (a reduce-scatter), and K and V again unless kept from forward.
(3) Memory: bytes saved for backward by one step (``saved_tensors_hooks``, unique storages,
    parameters excluded: tools/memtrack.py), the busiest rank at P=4 against one process.

Run through ``tools/bench.py --only attention``, or alone: ``python tools/bench_attention.py
--quick`` prints the Section JSON. ``--worker`` is the per-launch process.
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
import attention_models as am  # noqa: E402
import benchlib  # noqa: E402
from bench_spatial import LR, MOMENTUM, eager_step, sgd  # noqa: E402  (the user's loop)

TITLE = "Attention on tiles: ViT ring attention and SwinUNETR, SP2 and SP4"
SHARE_AIM, RING_AIM, MEMORY_AIM, MEMORY_PARTS = 0.85, 1.05, 0.30, 4
AIMS = {"share": SHARE_AIM, "ring_fwd": RING_AIM, "memory": MEMORY_AIM}
"""SP's step at least SHARE_AIM of the limit's speed (limit step / SP step, same P, same
rounds); forward ring bytes at most RING_AIM x the minimum; saved activations of the busiest
rank at P=MEMORY_PARTS at most MEMORY_AIM x one process's."""
MODELS = ("vit", "swin")
SWIN = "feature_size=12;depths=2,2,2,2;num_heads=3,6,12,24;window_size=4"
QUICK = {"vit_size": 128, "swin_size": 64, "vit": "16,2,2,16",
         "swin": "feature_size=12;depths=1,1,1,1;num_heads=1,1,2,2;window_size=4",
         "steps": 1, "warmup": 1}
TRANSPORT = ("mpi4py over the MPICH wheel's `mpiexec` (one host: shared memory), one thread "
             "per rank")


def add_args(parser: argparse._ActionsContainer) -> None:
    parser.add_argument("--attention-models", default=",".join(MODELS),
                        help=f"comma-separated, of {', '.join(MODELS)}")
    parser.add_argument("--attention-parts", default="2,4", help="SP sizes timed")
    parser.add_argument("--attention-vit", default="64,4,4,16",
                        help="the ViT's width,heads,depth,patch")
    parser.add_argument("--attention-vit-size", type=int, default=1024, help="image side")
    parser.add_argument("--attention-swin", default=SWIN,
                        help="SwinUNETR keyword arguments, key=value;... (tuples: 2,2,2,2)")
    parser.add_argument("--attention-swin-size", type=int, default=128, help="volume side")
    parser.add_argument("--attention-slice", default="square",
                        help="Plan.slice of every SP run and the limit's tiles (a volume's "
                        "square cuts H and W)")
    parser.add_argument("--attention-steps", type=int, default=2, help="timed steps per launch")
    parser.add_argument("--attention-warmup", type=int, default=1, help="untimed steps first")


# -- the worker (one launch) ----------------------------------------------------------------------
def worker_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="one launch of tools/bench_attention.py")
    p.add_argument("--worker", required=True, choices=["time", "step"])
    p.add_argument("--system", default="one", choices=["one", "sp", "limit"])
    p.add_argument("--model", default="vit", choices=list(MODELS))
    p.add_argument("--spec", default="16,2,2,16", help="--attention-vit / --attention-swin")
    p.add_argument("--size", type=int, default=128)
    p.add_argument("--parts", type=int, default=1)
    p.add_argument("--slice", default="square")
    p.add_argument("--steps", type=int, default=1)
    p.add_argument("--warmup", type=int, default=0)
    return p


def data(model: str, size: int) -> tuple[Any, Any]:
    """One fixed input (seed 0) and its per-pixel (per-voxel) labels."""
    import torch

    nd = 2 if model == "vit" else 3
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, 3 if nd == 2 else 1, *[size] * nd, generator=gen)
    return x, torch.randint(0, am.CLASSES[model], (1, *[size] * nd), generator=gen)


def build(model: str, spec: str, extents: tuple[int, ...], kv_repeat: int = 1) -> Any:
    """The model for an input of ``extents`` (the ViT's position embedding has one entry per
    token of it)."""
    import torch

    torch.manual_seed(0)
    if model == "swin":
        return am.swin(spec).train()
    v = am.parse_vit(spec)
    tokens = (extents[0] // v["patch"], extents[1] // v["patch"])
    return am.ViT(tokens, v["width"], v["heads"], v["depth"], v["patch"],
                  kv_repeat=kv_repeat).train()


def worker(a: argparse.Namespace) -> None:
    """``time``: warm-up, then timed steps (counters reset in between); ``step``: one first
    step with saved activations, messages and ring calls. Rank 0 emits every rank's record."""
    import torch
    import torch.nn.functional as F

    import fxpar
    from fxpar.passes.spatial_region import Coverage

    torch.set_num_threads(1)
    x, y = data(a.model, a.size)
    nd = x.dim() - 2
    comm, counts, calls, rank = None, None, None, 0
    window = x.numel() * x.element_size()  # the bytes of the input a rank reads
    rec: dict[str, Any] = {"compile_s": 0.0}
    if a.system == "one":
        model = build(a.model, a.spec, tuple(x.shape[2:]))
        step, params = eager_step(model, x, y), list(model.parameters())
    elif a.system == "limit":  # its own tile, no messages: 1/P of the work (module docstring)
        from fxpar.comm.world import world

        comm = world()
        rank = comm.rank
        grid = fxpar.Plan(spatial_parts=comm.size, slice=a.slice).tile_grid(nd)
        cut = am.box(x.shape[2:], grid, rank)
        xt, yt = x[(slice(None), slice(None), *cut)].contiguous(), \
            y[(slice(None), *cut)].contiguous()
        model = build(a.model, a.spec, tuple(xt.shape[2:]), kv_repeat=comm.size)
        step, params = eager_step(model, xt, yt), list(model.parameters())
    else:
        plan = fxpar.Plan(spatial_parts=a.parts, slice=a.slice)
        t0 = time.perf_counter()
        program = fxpar.compile(build(a.model, a.spec, tuple(x.shape[2:])), plan,
                                torch.empty(x.shape, device="meta"), loss_fn=F.cross_entropy,
                                optimizer=sgd)
        rp = program.local()
        rec["compile_s"] = time.perf_counter() - t0
        comm, params, rank = rp.comm, list(rp.parameters()), rp.comm.rank
        box = rp.input_window()
        window = 0 if box is None else window // x[0, 0].numel() * math.prod(box.shape)
        cov = program.traced.meta[Coverage.KEY] if program.traced is not None else None
        rec.update(coverage=cov.share if cov else None, ended=cov.ended[:300] if cov else "",
                   grid=list(plan.tile_grid(nd)))
        stages = list(rp.stages.values())
        counts = am.instrument(stages)
        calls = am.ring_shapes(stages) if a.worker == "step" else None

        def step() -> float:
            return rp.train_step(x, y)

    if a.worker == "step":
        rec.update(am.saved_step(step, params, [(x, window)]))
        if calls is not None:
            rec.update(am.expected_ring(calls, rank), ring_calls=len(calls))
    else:
        for _ in range(a.warmup):
            step()
        if comm is not None:
            comm.barrier()  # the timed steps start together
        if counts is not None:
            am.reset(counts)
        times = []
        for _ in range(a.steps):
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
        rec.update(times=times, step_s=statistics.median(times))
    if counts is not None:
        rec.update(counts)
    ranks = [rec] if comm is None else comm.gather_object(rec)
    if comm is None or comm.rank == 0:
        benchlib.emit(summary(ranks))


def summary(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """The launch's record: rank 0's, every rank's under ``ranks``, and the job's figures: a
    step ends when its slowest rank's does (``step_s``), memory per the busiest rank
    (``saved_max``), bytes per rank as the mean over ranks (``<counter>_rank``)."""
    out: dict[str, Any] = {**ranks[0], "ranks": ranks}
    if all("step_s" in r for r in ranks):
        out["step_s"] = max(r["step_s"] for r in ranks)
    if all("saved_bytes" in r for r in ranks):
        out["saved_max"] = max(r["saved_bytes"] for r in ranks)
    keys = [f"{k}_bytes" for k in am.KINDS] + ["formula_fwd", "formula_bwd", "kv", "min_fwd",
                                               "min_bwd"]
    for k in keys:
        if all(k in r for r in ranks):
            out[f"{k}_rank"] = sum(r[k] for r in ranks) / len(ranks)
    return out


# -- the driver -----------------------------------------------------------------------------------
def config(opts: argparse.Namespace) -> dict[str, Any]:
    """The run's sizes (the options, or the tiny --quick ones), checked before any launch."""
    q = bool(getattr(opts, "quick", False))
    models = [m.strip() for m in opts.attention_models.split(",") if m.strip()]
    bad = [m for m in models if m not in MODELS]
    if bad or not models:
        raise ValueError(f"--attention-models: unknown {bad}; choose from {', '.join(MODELS)}")
    parts = sorted({int(p) for p in opts.attention_parts.split(",") if p.strip()})
    if not parts or min(parts) < 2:
        raise ValueError(f"--attention-parts: SP sizes >= 2, got {opts.attention_parts!r}")
    cfg: dict[str, Any] = {
        "models": models, "parts": parts, "slice": opts.attention_slice,
        "rounds": max(1, int(opts.rounds)), "quick": q,
        "memory_parts": MEMORY_PARTS if MEMORY_PARTS in parts else max(parts),
        **({k: QUICK[k] for k in ("vit_size", "swin_size", "vit", "swin", "steps", "warmup")}
           if q else {"vit_size": opts.attention_vit_size, "swin_size": opts.attention_swin_size,
                      "vit": opts.attention_vit, "swin": opts.attention_swin,
                      "steps": opts.attention_steps, "warmup": opts.attention_warmup})}
    cfg["rounds"] = 1 if q else cfg["rounds"]
    import fxpar

    for p in parts:
        for model in models:
            nd, size = (2, cfg["vit_size"]) if model == "vit" else (3, cfg["swin_size"])
            grid = fxpar.Plan(spatial_parts=p, slice=cfg["slice"]).tile_grid(nd)
            # patches (ViT) or 2**5 (SwinUNETR's five halvings) must tile each limit process's
            unit = am.parse_vit(cfg["vit"])["patch"] if model == "vit" else 32
            if any(size % (g * unit) for g in grid):
                raise ValueError(f"{model}: side {size} on a {grid} grid leaves tiles that are "
                                 f"not multiples of {unit} (the limit trains the model on one "
                                 f"tile): pick a side divisible by {unit * max(grid)}")
    if "swin" in models:
        am.parse_kwargs(cfg["swin"])
    return cfg


def _launch(opts: argparse.Namespace, cfg: dict[str, Any], worker_: str, model: str,
            system: str, parts: int, quiet: bool = True) -> dict[str, Any]:
    spec, size = (cfg["vit"], cfg["vit_size"]) if model == "vit" else \
        (cfg["swin"], cfg["swin_size"])
    args = ["--worker", worker_, "--system", system, "--model", model, "--spec", spec,
            "--size", str(size), "--parts", str(parts), "--slice", cfg["slice"],
            "--steps", str(cfg["steps"]), "--warmup", str(cfg["warmup"])]
    cmd = benchlib.worker_command("bench_attention.py", args, None if system == "one" else parts)
    env = benchlib.thread_env(1)
    if not quiet:  # bytes and saved tensors do not depend on the machine's noise
        return benchlib.launch(cmd, env, opts.timeout)
    return benchlib.measure(cmd, env, retries=opts.retries, max_foreign=opts.max_foreign,
                            timeout=opts.timeout)


def systems(cfg: dict[str, Any]) -> list[str]:
    """``one``, then ``sp<P>`` and ``limit<P>`` for each P."""
    return ["one"] + [f"{s}{p}" for p in cfg["parts"] for s in ("sp", "limit")]


def _system(name: str) -> tuple[str, int]:
    """``"sp4"`` -> ("sp", 4); ``"one"`` -> ("one", 1)."""
    kind = name.rstrip("0123456789")
    return kind, int(name[len(kind):] or 1)


def run(opts: argparse.Namespace) -> dict[str, Any]:
    cfg = config(opts)

    def one(ms: tuple[str, str], _round: int) -> dict[str, Any]:
        kind, parts = _system(ms[1])
        return _launch(opts, cfg, "time", ms[0], kind, parts)

    flat = benchlib.interleave("attention", cfg["rounds"],
                               [(m, s) for m in cfg["models"] for s in systems(cfg)], one,
                               key="/".join)
    rounds = benchlib.nested(flat)
    steps: dict[str, dict[str, Any]] = {}
    for model in cfg["models"]:
        for system in ["one"] + [f"sp{p}" for p in cfg["parts"]]:
            benchlib.progress("attention", cfg["rounds"], cfg["rounds"],
                              f"{model}/{system}: one step, bytes and saved tensors")
            kind, parts = _system(system)
            steps[f"{model}/{system}"] = _launch(opts, cfg, "step", model, kind, parts,
                                                 quiet=False)
    return section(cfg, rounds, steps)


# -- the section ----------------------------------------------------------------------------------
def _mib(b: float) -> str:
    return f"{b / 2**20:.2f}"


def amdahl(share: float | None, parts: int) -> float | None:
    """The speed-up bound when a ``share`` of the forward FLOPs runs on P tiles and the rest
    whole on every rank: ``1 / ((1 - share) + share / P)``."""
    return None if share is None else 1.0 / ((1 - share) + share / parts)


def _coverage(rec: dict[str, Any], parts: int) -> str:
    c = rec.get("coverage")
    if c is None:
        return "-"
    return f"{c:.3f}" + ("" if c >= 0.9995 else f" (bound {amdahl(c, parts):.2f}x)")


def _input(cfg: dict[str, Any], model: str) -> str:
    return f"1x3x{cfg['vit_size']}^2" if model == "vit" else f"1x1x{cfg['swin_size']}^3"


def timing(cfg: dict[str, Any], rounds: list[dict[str, dict[str, Any]]]
           ) -> tuple[list[list[Any]], list[dict[str, Any]], dict[str, list[list[Any]]]]:
    """Table (1)'s rows, its aims and the speed-up plot's series, from the rounds."""
    rows, aims, bars = [], [], {}
    fmt = benchlib.fmt_spread
    for model in cfg["models"]:
        one = [r[model]["one"]["step_s"] for r in rounds]
        rows.append([model, _input(cfg, model), "one process", fmt(benchlib.spread(one),
                                                                   digits=3),
                     "1.00x", "-", "-", "-", "-"])
        for p in cfg["parts"]:
            sp = [r[model][f"sp{p}"]["step_s"] for r in rounds]
            lim = [r[model][f"limit{p}"]["step_s"] for r in rounds]
            speed = benchlib.spread([a / b for a, b in zip(one, sp, strict=True)])
            lspeed = benchlib.spread([a / b for a, b in zip(one, lim, strict=True)])
            share = benchlib.spread([a / b for a, b in zip(lim, sp, strict=True)])
            rec = rounds[0][model][f"sp{p}"]
            rows.append([model, _input(cfg, model), f"SP{p} ({'x'.join(map(str, rec['grid']))})",
                         fmt(benchlib.spread(sp), digits=3), fmt(speed, "x"),
                         fmt(benchlib.spread(lim), digits=3), fmt(lspeed, "x"), fmt(share),
                         _coverage(rec, p)])
            bars.setdefault(f"SP{p}", []).append([model, speed["median"]])
            bars.setdefault(f"limit, {p} processes", []).append([model, lspeed["median"]])
            met = share["median"] >= SHARE_AIM
            why = None if met else _share_why(rec, p, statistics.median(sp),
                                              statistics.median(lim), speed["median"])
            aims.append({"what": f"SP{p}'s share of the limit (limit step / SP step), {model} "
                                 f"{_input(cfg, model)}",
                         "aim": f">= {SHARE_AIM:.2f}",
                         "measured": f"{fmt(share)} (speed-up {fmt(speed, 'x')}, limit "
                                     f"{fmt(lspeed, 'x')}, coverage {_coverage(rec, p)})",
                         "met": met, "why": why})
    return rows, aims, bars


def _share_why(rec: dict[str, Any], parts: int, sp: float, lim: float, speed: float) -> str:
    text = (f"The SP{parts} step took {sp:.3f} s against the limit's {lim:.3f} s: "
            f"{sp - lim:.3f} s is what fxpar adds over {parts} message-free processes.")
    c = rec.get("coverage")
    if c is not None and c < 0.9995:
        text += (f" Only {c:.1%} of the forward FLOPs run on tiles; the rest runs whole on "
                 f"every rank, which bounds the speed-up at {amdahl(c, parts):.2f}x "
                 f"(measured {speed:.2f}x); {rec.get('ended') or 'no reason recorded'}.")
    else:
        text += (" The whole model runs on tiles; the excess is ring attention's messages "
                 "and merges of its blocks, halo exchanges and the gradient allreduce (SP4 "
                 "runs 4 ranks on this machine's 2 cores, as its limit does).")
    return text


def traffic(cfg: dict[str, Any], steps: dict[str, dict[str, Any]]
            ) -> tuple[list[list[Any]], list[dict[str, Any]]]:
    """Table (2)'s rows (per rank: the mean over ranks) and the forward-bytes aims."""
    rows, aims = [], []
    for model in cfg["models"]:
        for p in cfg["parts"]:
            s = steps[f"{model}/sp{p}"]
            halo = _mib(s["halo_fwd_bytes_rank"] + s["halo_bwd_bytes_rank"])
            other = _mib(s["other_bytes_rank"])
            if not s.get("ring_calls"):
                rows.append([model, p, 0, "-", "-", "-", "-", "-", "-", "-", "-", halo, other])
                continue
            fwd, bwd = s["ring_fwd_bytes_rank"], s["ring_bwd_bytes_rank"]
            mfwd, mbwd = s["min_fwd_rank"], s["min_bwd_rank"]
            formula = s["formula_fwd_rank"] + s["formula_bwd_rank"]
            rows.append([model, p, s["ring_calls"], _mib(fwd), _mib(mfwd), f"{fwd / mfwd:.3f}",
                         _mib(bwd), _mib(mbwd), f"{bwd / mbwd:.3f}",
                         f"{(fwd + bwd) / (2 * mfwd):.3f}", f"{(fwd + bwd) / formula:.4f}",
                         halo, other])
            met = fwd / mfwd <= RING_AIM
            aims.append({"what": f"ring attention forward bytes per rank / minimum ((P-1)/P of "
                                 f"K and V), {model} SP{p}", "aim": f"<= {RING_AIM:.2f}x",
                         "measured": f"{fwd / mfwd:.3f}x", "met": met, "why": None if met else
                         f"each rank sent {_mib(fwd - mfwd)} MiB per step more than the other "
                         f"tiles' K and V; ring_bytes predicts {_mib(s['formula_fwd_rank'])}"})
    return rows, aims


def memory(cfg: dict[str, Any], steps: dict[str, dict[str, Any]]
           ) -> tuple[list[list[Any]], list[dict[str, Any]]]:
    """Table (3)'s rows and the memory aims."""
    rows, aims = [], []
    p = cfg["memory_parts"]
    for model in cfg["models"]:
        one, sp = steps[f"{model}/one"], steps[f"{model}/sp{p}"]
        ratio = sp["saved_max"] / one["saved_bytes"]
        mean = statistics.mean(r["saved_bytes"] for r in sp["ranks"]) / one["saved_bytes"]
        whole = max(r.get("saved_storage_bytes", r["saved_bytes"]) for r in sp["ranks"]) / \
            one.get("saved_storage_bytes", one["saved_bytes"])
        rows.append([model, _input(cfg, model), _mib(one["saved_bytes"]), _mib(sp["saved_max"]),
                     f"{ratio:.3f}", f"{mean:.3f}", f"{1 / p:.3f}", _coverage(sp, p),
                     f"{whole:.3f}"])
        met = ratio <= MEMORY_AIM
        cov = sp.get("coverage")
        aims.append({"what": f"saved activations, busiest rank at P={p} / one process, {model}",
                     "aim": f"<= {MEMORY_AIM:.2f}x", "measured": f"{ratio:.3f}x", "met": met,
                     "why": None if met else
                     f"the busiest rank saved {_mib(sp['saved_max'])} MiB against "
                     f"{_mib(one['saved_bytes'] / p)} MiB for an even 1/{p} share"
                     + (f"; {1 - cov:.1%} of the forward FLOPs run whole on every rank "
                        f"(coverage {cov:.3f}), and what they save is not divided"
                        if cov is not None and cov < 0.9995 else "")})
    return rows, aims


def backward_note(parts: list[int]) -> str:
    """How ring attention's backward bytes compare with the minimum, by P (float32)."""
    cells = "; ".join(f"P={p}: backward {(2 * p - 1) / p:.2f} against {2 * (p - 1) / p:.2f} "
                      f"({(2 * p - 1) / (2 * p - 2):.2f}x), the step {(3 * p - 2) / p:.2f} "
                      f"against {2 * (p - 1) / p:.2f} ({(3 * p - 2) / (2 * p - 2):.2f}x)"
                      for p in parts)
    return (
        "Ring attention's backward sends K and V around the ring again ((P-1)/P of them: it "
        "keeps no other tile's blocks from forward, which would cost P times their memory) "
        "and each block's dK, dV accumulator P hops: the last hop brings the total back to "
        "its owner, one more than a reduce-scatter needs ((P-1)/P). In units of one layer's "
        "K and V per rank, its backward sends (P-1)/P + 1 = (2P-1)/P against a minimum of "
        "2(P-1)/P (the fetch again and the reduce-scatter: the backward column's minimum), "
        "and the whole step (3P-2)/P against the 2(P-1)/P of forward and reduce-scatter "
        f"alone, with K and V kept: {cells}. Forward sends exactly the minimum.")


def section(cfg: dict[str, Any], rounds: list[dict[str, dict[str, Any]]],
            steps: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The Section from the timing rounds and the one-step launches (``model/system``)."""
    trows, taims, bars = timing(cfg, rounds)
    brows, baims = traffic(cfg, steps)
    mrows, maims = memory(cfg, steps)
    p = cfg["memory_parts"]
    method = (
        f"Transport: {TRANSPORT}. Models: the ViT-style encoder of tools/attention_models.py "
        f"(width,heads,depth,patch = {cfg['vit']}, a learned position embedding, "
        f"{am.CLASSES['vit']} classes) at {_input(cfg, 'vit')} and MONAI's SwinUNETR "
        f"({cfg['swin']}, {am.CLASSES['swin']} classes) at {_input(cfg, 'swin')}; float32, "
        f"SGD lr {LR} momentum {MOMENTUM}, per-pixel cross-entropy, `Plan(spatial_parts=P, "
        f"slice={cfg['slice']!r})`. **(1) Time**: each of {len(rounds)} round(s) launches, "
        f"per model and in rotated order, a fresh process for each system after a quiet "
        f"spell: one process (plain PyTorch, 1 thread), SP P (`mpiexec -n P`, 1 thread per "
        f"rank) and the limit (`mpiexec -n P`, each process trains plain PyTorch on its own "
        f"tile with no messages; the ViT's processes attend their tile's queries to their own "
        f"keys and values repeated P times, 1/P of the one-process attention). A launch runs "
        f"{cfg['warmup']} warm-up and {cfg['steps']} timed step(s); its figure is the "
        f"slowest rank's median. Ratios are taken per round: speed-up = one / SP, share of "
        f"the limit = limit / SP. Coverage: the share of forward FLOPs fxpar runs on tiles "
        f"(with the speed-up it bounds when below 1). **(2) Bytes**: one step under "
        f"`mpiexec -n P`, every `Comm.isend` counted by tag (a RingAttention or halo module "
        f"sends forward with its tag and backward with tag + 1), mean over ranks; the check "
        f"column divides the ring bytes by `ring_bytes` summed over the calls (shapes from "
        f"forward pre-hooks). **(3) Memory**: one first step per launch, bytes packed by "
        f"`saved_tensors_hooks` outside backward (unique storages, parameters excluded), the "
        f"busiest of P={p} ranks against one process. The input batch counts the bytes of "
        f"the window a rank reads (`RankProgram.input_window`: a loader fills only that part "
        f"of the whole-shape batch), although fxpar's first conv (`fxpar::halo_op`) saves the "
        f"whole batch tensor; the last column counts that tensor's whole storage instead, as "
        f"tools/memtrack.py does.")
    return {
        "name": "attention", "title": TITLE, "method": method,
        "tables": [
            {"title": "(1) Train step seconds (median, range over rounds), speed-up and the "
                      "limit",
             "columns": ["model", "input", "system", "step s", "speed-up over one process",
                         "limit step s", "limit speed-up", "share of the limit", "coverage"],
             "rows": trows},
            {"title": "(2) Bytes sent per rank per step (MiB; mean over ranks)",
             "columns": ["model", "P", "ring calls", "ring fwd", "fwd minimum", "fwd / min",
                         "ring bwd", "bwd minimum", "bwd / min", "step / 2(P-1)/P K,V",
                         "ring / ring_bytes", "halo fwd+bwd", "other"],
             "rows": brows},
            {"title": f"(3) Saved activations (MiB), P={p} against one process",
             "columns": ["model", "input", "one process", f"busiest of {p} ranks",
                         "busiest / one", "mean / one", "1/P", "coverage",
                         "busiest / one, whole input storage"],
             "rows": mrows}],
        "plots": [{"file": "attention_speedup.png", "title": "Speed-up over one process "
                   "(median)", "xlabel": "model", "ylabel": "speed-up (x)", "kind": "bar",
                   "series": bars}],
        "aims": taims + baims + maims,
        "notes": backward_note(cfg["parts"]),
        "raw": {"config": cfg, "rounds": rounds, "steps": steps},
    }


def main(argv: list[str] | None = None) -> int:
    return benchlib.entry(__doc__.split("\n\n")[0], add_args, run, argv, worker,
                          worker_parser)


if __name__ == "__main__":
    raise SystemExit(main())
