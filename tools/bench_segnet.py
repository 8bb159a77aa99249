"""Benchmark section ``segnet``: issue 39's segmentation nets under SP2 on 2 CPU ranks.

(a) SP2 against one process: one train step (float32, batch 1, 1x3x1024x1024, SGD momentum,
    per-pixel cross-entropy against a fixed synthetic label map) of fxpar's
    ``Plan(spatial_parts=2)`` (tiles split along H) under ``mpiexec -n 2`` against plain eager
    PyTorch in one process, next to the limit measured in the same rounds (``mpiexec -n 2``,
    each process trains eager PyTorch on its own half of the rows, no messages). Models: the
    issue's net (:class:`SegNet`), MONAI's UNet and SegResNet, smp's Unet (resnet18 encoder).
(b) fxpar SP2 against PhysicsNeMo's ShardTensor SP2 on the issue's net, in the same rounds.
    PhysicsNeMo is not a dependency of fxpar; install it into the venv for this section only
    (``segnet_systems.INSTALL``). Without it the table says so and the rest runs.

Each round launches every system once, in rotated order, after a quiet spell; a launch runs
every model in turn (warm-up steps, then timed steps; median). After the rounds, one more
launch profiles one SP2 step of the model furthest from its aim (torch.profiler, rank 0).
Run through ``tools/bench.py --only segnet`` or ``python tools/bench_segnet.py [--quick]``
(the Section JSON); ``--worker`` is the per-launch process, ``--worker check`` the float64
exactness check of both SP2 systems against one process.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib  # noqa: E402
from bench_spatial import LR, MOMENTUM, eager_step  # noqa: E402  (the user's loop)
from segnet_systems import INSTALL, Runner, have_physicsnemo  # noqa: E402

TITLE = "Segmentation nets (issue 39): SP2 vs one process and vs PhysicsNeMo ShardTensor"
SPEEDUP_AIM, SHARD_AIM = 1.80, 0.80
CLASSES, SEED = 4, 0
MODELS = ("segnet", "monai_unet", "monai_segresnet", "smp_unet")
QUICK = {"image": 128, "steps": 1, "warmup": 1}
SYSTEMS = {"one": "one process (eager)", "sp2": "fxpar SP2",
           "shard": "PhysicsNeMo ShardTensor SP2", "ideal": "half image each, no messages"}


# -- models and data -----------------------------------------------------------------------
def _block(cin: int, cout: int, stride: int = 1) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.GroupNorm(8, cout),
                         nn.ReLU(inplace=True))


class SegNet(nn.Module):
    """The issue's net: conv3x3 + GroupNorm(8) + ReLU blocks, two stride-2 convolutions, two
    bilinear x2 upsamplings with additive skips, a 1x1 head (logits per pixel)::

        x (3, H) -> enc1 (32, H) = s1 -> down1 s2 (64, H/2) -> enc2 = s2 -> down2 s2 (128, H/4)
          -> mid -> 1x1 (64) -> up x2 + s2 -> dec2 (64, H/2) -> 1x1 (32) -> up x2 + s1
          -> dec1 (32, H) -> head (K, H)
    """

    def __init__(self, classes: int = CLASSES, widths: tuple[int, int, int] = (32, 64, 128)
                 ) -> None:
        super().__init__()
        c1, c2, c3 = widths
        self.enc1 = nn.Sequential(_block(3, c1), _block(c1, c1))
        self.down1, self.enc2 = _block(c1, c2, 2), _block(c2, c2)
        self.down2, self.mid = _block(c2, c3, 2), _block(c3, c3)
        self.proj2, self.dec2 = nn.Conv2d(c3, c2, 1), _block(c2, c2)
        self.proj1, self.dec1 = nn.Conv2d(c2, c1, 1), _block(c1, c1)
        self.head = nn.Conv2d(c1, classes, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s1 = self.enc1(x)
        s2 = self.enc2(self.down1(s1))
        y = self.mid(self.down2(s2))
        y = self.dec2(F.interpolate(self.proj2(y), scale_factor=2, mode="bilinear") + s2)
        y = self.dec1(F.interpolate(self.proj1(y), scale_factor=2, mode="bilinear") + s1)
        return self.head(y)


def build(name: str, classes: int = CLASSES) -> nn.Module:
    """One of ``MODELS``, freshly initialised (the caller seeds torch)."""
    if name == "segnet":
        return SegNet(classes)
    if name == "monai_unet":
        from monai.networks.nets import UNet

        return UNet(spatial_dims=2, in_channels=3, out_channels=classes,
                    channels=(16, 32, 64, 128), strides=(2, 2, 2), num_res_units=2)
    if name == "monai_segresnet":
        from monai.networks.nets import SegResNet

        return SegResNet(spatial_dims=2, in_channels=3, out_channels=classes, init_filters=8)
    if name == "smp_unet":
        import segmentation_models_pytorch as smp

        return smp.Unet(encoder_name="resnet18", encoder_weights=None, classes=classes)
    raise ValueError(f"unknown model {name!r}: choose from {', '.join(MODELS)}")


def batch(side: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """A fixed image (seeded noise) and label map (a checkerboard of 32-pixel squares cycling
    through the classes, so every class covers every tile)."""
    gen = torch.Generator().manual_seed(SEED)
    x = torch.randn(1, 3, side, side, generator=gen, dtype=dtype)
    r = torch.arange(side) // 32
    y = ((r[:, None] + 2 * r[None, :]) % CLASSES)[None]
    return x, y



# -- workers ------------------------------------------------------------------------------------
def worker_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="one launch of the segnet benchmark")
    p.add_argument("--worker", required=True, choices=["time", "profile", "check"])
    p.add_argument("--system", default="one", choices=list(SYSTEMS))
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--widths", default="16,32,64", help="SegNet's channels")
    p.add_argument("--image", type=int, default=128)
    p.add_argument("--steps", type=int, default=1)
    p.add_argument("--warmup", type=int, default=1)
    return p


def _models(a: argparse.Namespace) -> list[str]:
    return [m for m in a.models.split(",") if m]


def _build(a: argparse.Namespace, name: str) -> nn.Module:
    torch.manual_seed(SEED)
    if name == "segnet":
        return SegNet(CLASSES, tuple(int(w) for w in a.widths.split(","))).train()  # type: ignore[arg-type]
    return build(name).train()


def worker_time(a: argparse.Namespace, run: Runner) -> dict[str, Any]:
    """Per model: ``--warmup`` steps, then ``--steps`` timed ones, started together; a model's
    figure is the slowest rank's median (a step of the job ends when its last rank does)."""
    per: dict[str, Any] = {}
    x, y = batch(a.image)
    for name in _models(a):
        step, compile_s = run.step(_build(a, name), x, y)
        for _ in range(a.warmup):
            step()
        run.barrier()
        times = []
        for _ in range(a.steps):
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
        per[name] = {"step_s": statistics.median(times), "times": times,
                     "compile_s": compile_s}
        del step
        run.barrier()
    ranks = run.gather(per)
    if ranks is None:
        return {}
    return {"models": {m: {**ranks[0][m], "step_s": max(r[m]["step_s"] for r in ranks),
                           "rank_step_s": [r[m]["step_s"] for r in ranks]} for m in per}}


CATEGORIES = (  # (category, substrings of profiler op names), first match wins
    ("fxpar comm ops and their backward (waits included)", ("fxpar",)),
    ("convolution fwd+bwd", ("conv",)),
    ("bilinear upsample fwd+bwd", ("upsample",)),
    ("native norm kernels", ("group_norm", "batch_norm", "native_layer_norm")),
    ("copies, pads, cat, slices", ("copy_", "pad", "cat", "slice", "narrow", "contiguous",
                                   "clone", "empty", "zeros", "fill_")),
    ("optimizer", ("_foreach", "sgd", "Optimizer")),
    ("loss", ("nll_loss", "log_softmax", "cross_entropy")),
    ("elementwise and reductions", ("add", "mul", "sub", "div", "relu", "threshold", "sum",
                                    "mean", "var", "sqrt", "rsqrt", "pow", "where", "max",
                                    "min", "exp", "neg", "clamp", "sigmoid")),
)


def categorize(ops: list[tuple[str, float]]) -> dict[str, float]:
    """Self CPU seconds of profiler ops ``(name, seconds)`` summed per :data:`CATEGORIES`."""
    out = dict.fromkeys([c for c, _ in CATEGORIES] + ["other"], 0.0)
    for name, s in ops:
        low = name.lower()
        cat = next((c for c, keys in CATEGORIES if any(k in low for k in keys)), "other")
        out[cat] += s
    return out


def worker_profile(a: argparse.Namespace, run: Runner) -> dict[str, Any]:
    """One model, ``--warmup`` steps, then one step under torch.profiler on every rank: self
    CPU seconds per op category and the top ops, rank 0's."""
    from torch.profiler import ProfilerActivity, profile

    x, y = batch(a.image)
    (name,) = _models(a)
    step, _ = run.step(_build(a, name), x, y)
    for _ in range(a.warmup):
        step()
    run.barrier()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        step()
        wall = time.perf_counter() - t0
    ops = [(e.key, e.self_cpu_time_total / 1e6) for e in prof.key_averages()]
    top = sorted(ops, key=lambda o: -o[1])[:12]
    rec = {"model": name, "wall_s": wall, "categories": categorize(ops), "top": top}
    ranks = run.gather(rec)
    return {**rec, "ranks": ranks} if ranks is not None else {}


def worker_check(a: argparse.Namespace, run: Runner) -> dict[str, Any]:
    """Exactness in float64: two train steps of ``run.system`` against two eager steps of a
    copy of the same model on the whole image in this process; the largest loss, gradient
    (relative to the largest gradient) and parameter differences, the largest over ranks
    (every rank checks its own parameters)."""
    x, y = batch(a.image, torch.float64)
    out: dict[str, Any] = {}
    for name in _models(a):
        model = _build(a, name).double()
        ref = copy.deepcopy(model)
        step, _ = run.step(model, x, y)
        ref_step = eager_step(ref, x, y)
        losses = [(float(step()), ref_step()) for _ in range(2)]
        pairs = list(zip(model.parameters(), ref.parameters(), strict=True))
        with torch.no_grad():  # the second step's gradients are still in place on both
            out[name] = {
                "loss_diff": max(abs(u - v) for u, v in losses),
                "grad_diff": max(float((p.grad - q.grad).abs().max()) for p, q in pairs) /
                max(float(q.grad.abs().max()) for _, q in pairs),
                "param_diff": max(float((p - q).abs().max()) for p, q in pairs)}
        run.barrier()
    ranks = run.gather(out)
    if ranks is None:
        return {}
    return {"models": {m: {k: max(r[m][k] for r in ranks) for k in out[m]} for m in out}}


WORKERS = {"time": worker_time, "profile": worker_profile, "check": worker_check}


def worker(a: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    run = Runner(a.system)
    rec = WORKERS[a.worker](a, run)
    if run.rank == 0:
        benchlib.emit({"system": a.system, **rec})
    if run.mesh is not None:
        torch.distributed.destroy_process_group()


# -- driver -------------------------------------------------------------------------------------
def add_args(parser: argparse._ActionsContainer) -> None:
    parser.add_argument("--segnet-models", default=",".join(MODELS),
                        help=f"comma-separated, of {', '.join(MODELS)}")
    parser.add_argument("--segnet-image", type=int, default=1024, help="square image side")
    parser.add_argument("--segnet-steps", type=int, default=3, help="timed steps per launch")
    parser.add_argument("--segnet-warmup", type=int, default=1, help="untimed steps first")
    parser.add_argument("--segnet-widths", default="16,32,64", help="SegNet's channels")
    parser.add_argument("--segnet-profile", default="auto",
                        help="model whose SP2 step to profile after the rounds ('auto': the "
                        "lowest SP2 speed-up; 'none': skip)")
    parser.add_argument("--segnet-check-image", type=int, default=64,
                        help="image side of the float64 exactness check (0: skip it)")


def config(opts: argparse.Namespace) -> dict[str, Any]:
    q = bool(getattr(opts, "quick", False))
    models = [m.strip() for m in opts.segnet_models.split(",") if m.strip()]
    bad = [m for m in models if m not in MODELS]
    if bad:
        raise ValueError(f"--segnet-models: unknown {bad}; choose from {', '.join(MODELS)}")
    return {"models": models, "widths": opts.segnet_widths,
            "image": QUICK["image"] if q else opts.segnet_image,
            "steps": QUICK["steps"] if q else opts.segnet_steps,
            "warmup": QUICK["warmup"] if q else opts.segnet_warmup,
            "check_image": opts.segnet_check_image, "profile": opts.segnet_profile,
            "physicsnemo": have_physicsnemo()}


def command(cfg: dict[str, Any], worker_: str, system: str, models: list[str],
            image: int | None = None) -> list[str]:
    args = ["--worker", worker_, "--system", system, "--models", ",".join(models),
            "--widths", cfg["widths"], "--image", str(image or cfg["image"]),
            "--steps", str(cfg["steps"]), "--warmup", str(cfg["warmup"])]
    return benchlib.worker_command("bench_segnet.py", args, None if system == "one" else 2)


def run(opts: argparse.Namespace) -> dict[str, Any]:
    cfg = config(opts)
    models = cfg["models"]
    systems = [benchlib.System(SYSTEMS[s], command(cfg, "time", s, models), {},
                               limit=s == "ideal") for s in ("one", "sp2", "ideal")]
    if cfg["physicsnemo"] and "segnet" in models:
        systems.append(benchlib.System(SYSTEMS["shard"], command(cfg, "time", "shard",
                                                                 ["segnet"]), {}))

    def measure(cmd: list[str]) -> dict[str, Any]:  # a fresh rendezvous port per launch
        return benchlib.measure(cmd, benchlib.thread_env(1), retries=opts.retries,
                                max_foreign=opts.max_foreign, timeout=opts.timeout)

    rounds = benchlib.interleave("segnet", opts.rounds, systems,
                                 lambda s, _k: measure(s.command), key=lambda s: s.name)
    checks: dict[str, Any] = {}
    if cfg["check_image"]:
        for s in ("sp2", "shard") if cfg["physicsnemo"] else ("sp2",):
            ms = models if s == "sp2" else ["segnet"]
            benchlib.progress("segnet", opts.rounds, opts.rounds, f"float64 check {s}")
            checks[s] = benchlib.launch(command(cfg, "check", s, ms, cfg["check_image"]),
                                        benchlib.thread_env(1), opts.timeout)["models"]
    speedup = {m: benchlib.spread([r[SYSTEMS["one"]]["models"][m]["step_s"] /
                                   r[SYSTEMS["sp2"]]["models"][m]["step_s"] for r in rounds])
               for m in models}
    profiled = {}
    target = min(models, key=lambda m: speedup[m]["median"]) if cfg["profile"] == "auto" \
        else cfg["profile"]
    if target in models:
        for s in ("sp2", "ideal"):
            benchlib.progress("segnet", opts.rounds, opts.rounds, f"profile {s} {target}")
            profiled[s] = measure(command(cfg, "profile", s, [target]))
    return section(cfg, rounds, checks, profiled)


def _times(rounds: list[dict[str, Any]], system: str, model: str) -> list[float]:
    return [r[SYSTEMS[system]]["models"][model]["step_s"] for r in rounds]


def _ratio(a: list[float], b: list[float]) -> dict[str, float]:
    return benchlib.spread([u / v for u, v in zip(a, b, strict=True)])


def section(cfg: dict[str, Any], rounds: list[dict[str, Any]], checks: dict[str, Any],
            profiled: dict[str, Any]) -> dict[str, Any]:
    """The Section dict from the timing rounds, the float64 checks and the profiles."""
    f = benchlib.fmt_spread
    rows, aims, summary = [], [], {}
    for m in cfg["models"]:
        t = {s: _times(rounds, s, m) for s in ("one", "sp2", "ideal")}
        sp, lim = _ratio(t["one"], t["sp2"]), _ratio(t["one"], t["ideal"])
        share = _ratio(t["ideal"], t["sp2"])
        comp = statistics.median(r[SYSTEMS["sp2"]]["models"][m]["compile_s"] for r in rounds)
        summary[m] = {"step_s": {s: benchlib.spread(v) for s, v in t.items()}, "speedup": sp,
                      "limit": lim, "share_of_limit": share, "compile_s": comp}
        rows.append([m, *(f(benchlib.spread(t[s]), digits=3) for s in ("one", "sp2", "ideal")),
                     f(sp, "x"), f(lim, "x"), f(share, "x"), f"{comp:.1f}"])
        met = sp["median"] >= SPEEDUP_AIM
        aims.append({"what": f"fxpar SP2 vs one process, {m} train step (1x3x{cfg['image']}^2)",
                     "aim": f">= {SPEEDUP_AIM:.2f}x",
                     "measured": f"{f(sp, 'x')}; limit {f(lim, 'x')}", "met": met,
                     "why": None if met else _speedup_why(m, summary[m], profiled)})
    tables = [{"title": "Train step seconds (median, range over rounds) and speed-ups",
               "columns": ["model", "one process s", "fxpar SP2 s", "ideal 2 procs s",
                           "SP2 speed-up (one / SP2)", "limit (one / ideal)",
                           "SP2 share of the limit (ideal / SP2)", "SP2 compile s"],
               "rows": rows}]
    shard = SYSTEMS["shard"]
    if "segnet" in cfg["models"]:
        srows = [[SYSTEMS["sp2"], f(summary["segnet"]["step_s"]["sp2"], digits=3),
                  f(summary["segnet"]["speedup"], "x"), "1.00x"]]
        if rounds and shard in rounds[0]:
            ts, tf = _times(rounds, "shard", "segnet"), _times(rounds, "sp2", "segnet")
            vs = _ratio(tf, ts)
            summary["segnet"]["fxpar_over_shard"] = vs
            srows.append([shard, f(benchlib.spread(ts), digits=3),
                          f(_ratio(_times(rounds, "one", "segnet"), ts), "x"), f(vs, "x")])
            met = vs["median"] <= SHARD_AIM
            aims.append({"what": "fxpar SP2 step / PhysicsNeMo ShardTensor SP2 step, segnet "
                                 f"(1x3x{cfg['image']}^2)", "aim": f"<= {SHARD_AIM:.2f}x",
                         "measured": f(vs, "x"), "met": met,
                         "why": None if met else _shard_why(summary["segnet"], ts)})
        else:
            srows.append([shard, "skipped: physicsnemo is not installed; install it for this "
                          f"section only with `{INSTALL}`", "-", "-"])
            aims.append({"what": "fxpar SP2 step / PhysicsNeMo ShardTensor SP2 step, segnet",
                         "aim": f"<= {SHARD_AIM:.2f}x", "measured": "not measured "
                         "(physicsnemo not installed)", "met": None})
        srows.append([SYSTEMS["ideal"] + " (limit)", f(summary["segnet"]["step_s"]["ideal"],
                                                        digits=3),
                      f(summary["segnet"]["limit"], "x"), "-"])
        tables.append({"title": "segnet: fxpar SP2 vs PhysicsNeMo ShardTensor SP2, same rounds",
                       "columns": ["system", "step s", "speed-up over one process",
                                   "fxpar SP2 / this"], "rows": srows})
    if checks:
        tables.append({"title": f"Exactness: 2 train steps in float64 at 1x3x"
                                f"{cfg['check_image']}^2 against one process (largest over "
                                f"ranks)",
                       "columns": ["system", "model", "max |loss diff|",
                                   "max |grad diff| / max |grad|", "max |param diff|"],
                       "rows": [[SYSTEMS[s], m, f"{c['loss_diff']:.1e}",
                                 f"{c['grad_diff']:.1e}", f"{c['param_diff']:.1e}"]
                                for s, per in checks.items() for m, c in per.items()]})
    if profiled:
        cats = profiled["sp2"]["categories"]
        base = profiled["ideal"]["categories"]
        tables.append({"title": f"Where one SP2 step of {profiled['sp2']['model']} goes: "
                                f"torch.profiler self CPU seconds on rank 0, against the "
                                f"ideal system's rank 0",
                       "columns": ["op category", "fxpar SP2 s", "ideal s", "SP2 - ideal s"],
                       "rows": [[c, f"{cats[c]:.3f}", f"{base[c]:.3f}",
                                 f"{cats[c] - base[c]:+.3f}"] for c in cats] +
                       [["(profiled step's wall time)", f"{profiled['sp2']['wall_s']:.3f}",
                         f"{profiled['ideal']['wall_s']:.3f}",
                         f"{profiled['sp2']['wall_s'] - profiled['ideal']['wall_s']:+.3f}"]]})
    return {"name": "segnet", "title": TITLE, "method": _method(cfg, len(rounds)),
            "tables": tables, "plots": [], "aims": aims, "notes": "",
            "raw": {"config": cfg, "summary": summary, "rounds": rounds, "checks": checks,
                    "profile": {s: {k: v for k, v in p.items() if k != "ranks"}
                                for s, p in profiled.items()}}}


def _method(cfg: dict[str, Any], n: int) -> str:
    return (
        f"Models: `segnet` (the issue's net, tools/bench_segnet.py `SegNet`, channels "
        f"{cfg['widths']}), MONAI `UNet(spatial_dims=2, channels=(16, 32, 64, 128), strides="
        f"(2, 2, 2), num_res_units=2)`, MONAI `SegResNet(spatial_dims=2, init_filters=8)`, smp "
        f"`Unet(encoder_name='resnet18', encoder_weights=None)`; {CLASSES} classes, float32, "
        f"batch 1 at {cfg['image']}x{cfg['image']}, per-pixel cross-entropy against a fixed "
        f"checkerboard label map, SGD lr {LR} momentum {MOMENTUM}, one thread per process. "
        f"Systems: `one process` (plain eager PyTorch), `fxpar SP2` (`Plan(spatial_parts=2)`: "
        f"two tiles along H, `mpiexec -n 2`), `half image each, no messages` (the limit: "
        f"`mpiexec -n 2`, each process trains eager PyTorch on its own half of the rows, no "
        f"halo, no GroupNorm statistics or gradient reduction) and `PhysicsNeMo ShardTensor "
        f"SP2` (segnet only: the same eager loop on ShardTensor inputs sharded along H, gloo, "
        f"`mpiexec -n 2`). Each of {n} round(s) launches every system once, in rotated order, "
        f"after a quiet spell; a launch runs every model in turn, {cfg['warmup']} warm-up and "
        f"{cfg['steps']} timed step(s), and a model's figure is the slowest rank's median "
        f"step. Ratios are per round, then median (range). After the rounds: a float64 check "
        f"of each SP2 system against one process (untimed) and one profiled step "
        f"(torch.profiler, self CPU time per op category) of fxpar SP2 and of the limit for "
        f"the model with the lowest SP2 speed-up.")


def _profile_excess(profiled: dict[str, Any], top: int = 3) -> str:
    cats, base = profiled["sp2"]["categories"], profiled["ideal"]["categories"]
    diff = sorted(((cats[c] - base[c], c) for c in cats), reverse=True)[:top]
    return ", ".join(f"{c} {d:+.3f} s" for d, c in diff)


def _speedup_why(model: str, s: dict[str, Any], profiled: dict[str, Any]) -> str:
    sp, lim = s["speedup"]["median"], s["limit"]["median"]
    t_sp, t_id = s["step_s"]["sp2"]["median"], s["step_s"]["ideal"]["median"]
    text = (f"{sp:.3f}x is {(1 - sp / SPEEDUP_AIM) * 100:.1f}% short of {SPEEDUP_AIM:.2f}x. "
            f"The limit measured in the same rounds is {lim:.2f}x")
    if t_id > t_sp:
        text += (": its launches ran slower than fxpar's SP2 step, which does everything they "
                 "do and more, so other processes disturbed them; read it as a lower bound "
                 f"(its best round: {s['limit']['max']:.2f}x).")
    else:
        text += (": the aim is above what two processes with no messages at all reach here."
                 if lim < SPEEDUP_AIM else ".")
    text += (f" fxpar's SP2 step takes {t_sp:.3f} s against the limit's {t_id:.3f} s "
             f"({t_sp - t_id:+.3f} s, {s['share_of_limit']['median']:.2f}x of the limit).")
    if profiled and profiled["sp2"]["model"] == model:
        text += (f" The profiled SP2 step's largest excesses over the limit's (self CPU, rank "
                 f"0): {_profile_excess(profiled)}.")
    return text


def _shard_why(s: dict[str, Any], shard_times: list[float]) -> str:
    vs = s["fxpar_over_shard"]["median"]
    return (f"fxpar's SP2 step is {vs:.2f}x ShardTensor's ({s['step_s']['sp2']['median']:.3f} s "
            f"vs {statistics.median(shard_times):.3f} s); the aim needs "
            f"{(1 - SHARD_AIM / vs) * 100:.0f}% off fxpar's step.")


def main(argv: list[str] | None = None) -> int:
    return benchlib.entry(__doc__.split("\n\n")[0], add_args, run, argv, worker,
                          worker_parser)


if __name__ == "__main__":
    raise SystemExit(main())
