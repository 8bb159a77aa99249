"""Benchmark section ``volume``: spatial parallelism on 3-D volumes, with the 3D U-Net of Çiçek
et al. (``fxpar.models.build("unet3d")``, per-voxel cross-entropy over 3 classes, float32,
batch 1, SGD with momentum). Four measurements, each next to its limit measured in the same run:

(1) Memory: bytes saved for backward by one train step, per rank, at P=8 (2x2x2 cube, ``mpiexec
    -n 8``) against one plain-PyTorch process (its own launch), at 128^3. The ideal is 1/8.
(2) Compile: ``fxpar.compile`` of the U-Net built on the meta device, example
    ``torch.empty(1, 1, 1024, 1024, 1024, device="meta")``, ``Plan(spatial_parts=64,
    slice="cube")``: the first compile in a fresh process (cold) and repeats in it (warm).
(3) Speedup: one train step of SP2 (depth slabs, 2 ranks x 1 thread) against one process x 1
    thread, a smaller U-Net at 96^3, in interleaved rounds, next to the limit measured as
    ``tools/bench_spatial.py`` does: two independent processes each training on half the volume.
(4) Halo bytes: per rank and step (forward + backward) for SP2 slab, SP4 pencil and SP8 cube,
    from the compiled exchanges (no MPI) next to the minimum of ``fxpar.compiler.report.
    halo_table``; checked against a formula from the model alone (forward hooks) and against
    the bytes really sent in one step under ``mpiexec`` (the ``Comm.isend`` count of
    ``tools/bench_spatial.py``).

Run through ``tools/bench.py --only volume``, or alone: ``python tools/bench_volume.py --quick``
prints the Section JSON. ``--worker`` is the per-launch process.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib  # noqa: E402
from volume_halos import (  # noqa: E402, F401 - Window, halo_cells, reads: for tests
    Window,
    formula_minimum,
    halo_cells,
    planned_halos,
    reads,
    split,
    windowed_layers,
)

TITLE = "Volumes: 3D U-Net memory per rank, compile time, SP2 speedup and halo traffic"
MEMORY_AIM, COMPILE_AIM, HALO_AIM = 0.16, 5.0, 1.05
CLASSES = 3
GRIDS = (("slab", 2), ("pencil", 4), ("cube", 8))  # item (4): slice, spatial_parts
SYSTEMS = ("eager", "fxpar1", "sp", "ideal")  # item (3); --volume-no-fxpar1 drops fxpar1
TRANSPORT = ("mpi4py over the MPICH wheel's `mpiexec` (one host: shared memory), one thread "
             "per rank")
QUICK = {"size": 32, "model": "4,3", "fallback_model": "", "parts": 8, "compile_size": 256,
         "compile_model": "4,4",
         "compile_parts": 8, "compile_warm": 1, "speed_size": 32, "speed_model": "4,3",
         "steps": 1, "warmup": 1}


def add_args(parser: argparse._ActionsContainer) -> None:
    parser.add_argument("--volume-size", type=int, default=128,
                        help="(1) memory: volume side (D = H = W)")
    parser.add_argument("--volume-model", default="32,4",
                        help="(1) memory: 3D U-Net base,depth (the paper's is 32,4; use 16,4 "
                        "when 32 does not fit)")
    parser.add_argument("--volume-fallback-model", default="16,4",
                        help="(1) base,depth used instead when the --volume-model launches fail "
                        "(out of memory or --timeout); '' to fail instead")
    parser.add_argument("--volume-parts", type=int, default=8,
                        help="(1) memory: ranks of the cube slicing")
    parser.add_argument("--volume-compile-size", type=int, default=1024)
    parser.add_argument("--volume-compile-model", default="32,4", help="(2) base,depth")
    parser.add_argument("--volume-compile-parts", type=int, default=64)
    parser.add_argument("--volume-compile-warm", type=int, default=3,
                        help="(2) warm compiles after the cold one, in each fresh process")
    parser.add_argument("--volume-speed-size", type=int, default=96)
    parser.add_argument("--volume-speed-model", default="8,3",
                        help="(3) and (4): the smaller U-Net's base,depth")
    parser.add_argument("--volume-steps", type=int, default=2, help="(3) timed steps per launch")
    parser.add_argument("--volume-warmup", type=int, default=1, help="(3) untimed steps first")
    parser.add_argument("--volume-no-fxpar1", action="store_true",
                        help="(3) skip fxpar's 1-rank program (a reference) in the timing")
    parser.add_argument("--volume-no-wire", action="store_true",
                        help="(4) skip the one-step launches that count halo bytes on the wire")


# -- models and data ------------------------------------------------------------------------------
def parse_model(spec: str) -> tuple[int, int]:
    """``"32,4"`` -> (base, depth) of the 3D U-Net."""
    try:
        base, depth = (int(v) for v in spec.split(","))
    except ValueError:
        raise ValueError(f"a 3D U-Net is given as base,depth (e.g. 32,4), got {spec!r}") from None
    if base < 1 or depth < 1:
        raise ValueError(f"3D U-Net base and depth must be >= 1, got {spec!r}")
    return base, depth


def check_size(size: int, spec: str, parts: int = 1) -> None:
    """The U-Net needs sides divisible by 2**(depth-1); every tile of every level non-empty."""
    _, depth = parse_model(spec)
    step = 2 ** (depth - 1)
    if size % step or size // step < parts:
        raise ValueError(f"volume side {size} does not suit the 3D U-Net {spec}: it must be a "
                         f"multiple of {step} (2**(depth-1)) with at least {parts} cells per "
                         f"dim at the deepest level")


def build(spec: str, meta: bool = False) -> Any:
    """The zoo's 3D U-Net (1 input channel, ``CLASSES`` classes), on CPU or the meta device."""
    import torch

    import fxpar.models

    base, depth = parse_model(spec)
    with torch.device("meta" if meta else "cpu"):
        return fxpar.models.build("unet3d", in_channels=1, num_classes=CLASSES, base=base,
                                  depth=depth)


def volume(size: int) -> tuple[Any, Any]:
    """One fixed synthetic volume (1, 1, s, s, s) and its per-voxel labels (1, s, s, s)."""
    import torch

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, 1, size, size, size, generator=gen)
    y = torch.randint(0, CLASSES, (1, size, size, size), generator=gen)
    return x, y


def worker_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="one launch of tools/bench_volume.py")
    p.add_argument("--worker", required=True, choices=["step", "time", "compile", "halo"])
    p.add_argument("--system", default="eager", choices=["eager", "fxpar1", "sp", "ideal"])
    p.add_argument("--model", default="8,3", help="base,depth")
    p.add_argument("--size", type=int, default=32)
    p.add_argument("--parts", type=int, default=2)
    p.add_argument("--slice", default="slab")
    p.add_argument("--steps", type=int, default=1)
    p.add_argument("--warmup", type=int, default=0)
    p.add_argument("--warm", type=int, default=0, help="compile: repeats after the first")
    p.add_argument("--halo-cases", default="", help="halo: model@size;... (e.g. 8,3@96)")
    return p


def worker(a: argparse.Namespace) -> None:
    """``step``: one first train step with saved-for-backward bytes, memory and halo counters;
    ``time``: warm-up then timed steps; rank 0 emits one BENCH line with every rank's record."""
    import bench_spatial
    import torch

    import fxpar

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = build(a.model).train()
    x, y = volume(a.size)
    comm, counts, compile_s = None, None, 0.0
    rec0: dict[str, Any] = {}
    if a.system == "eager":
        step, params = bench_spatial.eager_step(model, x, y), list(model.parameters())
    elif a.system == "ideal":  # each rank trains alone on its depth slab: no messages at all
        from fxpar.comm.world import world

        comm = world()
        d = slice(*split(a.size, comm.size, comm.rank))
        step = bench_spatial.eager_step(model, x[:, :, d].contiguous(), y[:, d].contiguous())
        params = list(model.parameters())
    else:
        plan = fxpar.Plan() if a.system == "fxpar1" else \
            fxpar.Plan(spatial_parts=a.parts, slice=a.slice)
        t0 = time.perf_counter()
        program = fxpar.compile(model, plan, torch.empty(x.shape, device="meta"),
                                optimizer=bench_spatial.sgd)
        rp = program.local()
        compile_s = time.perf_counter() - t0
        comm, params = rp.comm, list(rp.parameters())
        if a.system == "sp":
            rec0["grid"] = list(plan.tile_grid(3))
            counts = bench_spatial.instrument_halos(list(rp.stages.values()))

        def step() -> float:
            return rp.train_step(x, y)

    bench_spatial.record_steps(a, {"compile_s": compile_s, **rec0}, step, params, comm, counts)


def compile_worker(a: argparse.Namespace) -> None:
    """A fresh process: imports, a meta-device U-Net, one cold compile, ``--warm`` more."""
    t0 = time.perf_counter()
    import torch

    import fxpar
    import fxpar.models  # noqa: F401

    rec: dict[str, Any] = {"imports_s": time.perf_counter() - t0}
    torch.set_num_threads(1)
    model = build(a.model, meta=True)
    example = torch.empty(1, 1, a.size, a.size, a.size, device="meta")
    plan = fxpar.Plan(spatial_parts=a.parts, slice=a.slice)
    times, program = [], None
    for _ in range(1 + a.warm):
        t0 = time.perf_counter()
        program = fxpar.compile(model, plan, example)
        times.append(time.perf_counter() - t0)
    assert program is not None
    rec.update(cold_s=times[0], warm_s=times[1:], world_size=program.world_size,
               grid=list(plan.tile_grid(3)), rss_gb=benchlib.peak_rss_mib() * 2**20 / 1e9,
               nodes=len(program.traced.graph.nodes) if program.traced is not None else None)
    benchlib.emit(rec)


def halo_worker(a: argparse.Namespace) -> None:
    """Compile only (meta model and input, no MPI): per case and grid, the planned halo bytes,
    halo_table's minimum and the model-only formula."""
    import torch

    import fxpar
    from fxpar.compiler.report import halo_table

    torch.set_num_threads(1)
    out = []
    for case in a.halo_cases.split(";"):
        spec, size = case.split("@")
        shape = (1, 1, int(size), int(size), int(size))
        layers = windowed_layers(build(spec, meta=True), shape)
        for slice_, parts in GRIDS:
            plan = fxpar.Plan(spatial_parts=parts, slice=slice_)
            program = fxpar.compile(build(spec, meta=True), plan,
                                    torch.empty(shape, device="meta"))
            grid = tuple(program.spatial.grid.parts)
            out.append({"model": spec, "size": int(size), "slice": slice_, "parts": parts,
                        "grid": list(grid), "tiles": planned_halos(program),
                        "formula": formula_minimum(layers, grid),
                        "windowed_layers": len(layers), "table": halo_table(program)})
    benchlib.emit({"cases": out})


# -- driver ---------------------------------------------------------------------------------------
def config(opts: argparse.Namespace) -> dict[str, Any]:
    """The run's sizes: the options, or the tiny --quick ones (plumbing only)."""
    q = bool(getattr(opts, "quick", False))
    cfg = dict(QUICK) if q else {
        "size": opts.volume_size, "model": opts.volume_model, "parts": opts.volume_parts,
        "fallback_model": opts.volume_fallback_model,
        "compile_size": opts.volume_compile_size, "compile_model": opts.volume_compile_model,
        "compile_parts": opts.volume_compile_parts, "compile_warm": opts.volume_compile_warm,
        "speed_size": opts.volume_speed_size, "speed_model": opts.volume_speed_model,
        "steps": opts.volume_steps, "warmup": opts.volume_warmup}
    cfg["rounds"] = max(1, int(opts.rounds))
    cfg["systems"] = [s for s in SYSTEMS
                      if s != "fxpar1" or not getattr(opts, "volume_no_fxpar1", False)]
    cfg["wire"] = not getattr(opts, "volume_no_wire", False)
    for spec in filter(None, (cfg["model"], cfg["fallback_model"])):
        check_size(cfg["size"], spec, round(cfg["parts"] ** (1 / 3)))
    check_size(cfg["compile_size"], cfg["compile_model"],
               round(cfg["compile_parts"] ** (1 / 3)))
    check_size(cfg["speed_size"], cfg["speed_model"], 2)
    check_size(cfg["speed_size"] // 2, cfg["speed_model"])  # the limit's half volumes
    return cfg


def _launch(opts: argparse.Namespace, args: list[str], ranks: int | None = None,
            threads: int = 1, quiet: bool = True) -> dict[str, Any]:
    cmd = benchlib.worker_command("bench_volume.py", args, ranks)
    env = benchlib.thread_env(threads)
    if not quiet:  # counts bytes, not seconds: no need to wait for a quiet machine
        return benchlib.launch(cmd, env, opts.timeout)
    return benchlib.measure(cmd, env, retries=opts.retries, max_foreign=opts.max_foreign,
                            timeout=opts.timeout)


def _step_args(worker_: str, system: str, spec: str, size: int, parts: int = 1,
               slice_: str = "cube", steps: int = 1, warmup: int = 0) -> list[str]:
    return ["--worker", worker_, "--system", system, "--model", spec, "--size", str(size),
            "--parts", str(parts), "--slice", slice_, "--steps", str(steps), "--warmup",
            str(warmup)]


def run(opts: argparse.Namespace) -> dict[str, Any]:
    cfg = config(opts)
    rounds = cfg["rounds"]
    # (4) halo bytes, compile only, for the speed model and the memory model
    benchlib.progress("volume", 0, rounds, "halo tables (compile only)")
    cases = ";".join(dict.fromkeys([f"{cfg['speed_model']}@{cfg['speed_size']}",
                                    f"{cfg['model']}@{cfg['size']}"]))
    halos = _launch(opts, ["--worker", "halo", "--halo-cases", cases], quiet=False)["cases"]
    wire: dict[str, Any] = {}
    if cfg["wire"]:
        for slice_, parts in GRIDS:
            benchlib.progress("volume", 0, rounds, f"halo bytes on the wire, {slice_} {parts}")
            wire[f"{cfg['speed_model']}@{cfg['speed_size']}/{slice_}"] = _launch(
                opts, _step_args("step", "sp", cfg["speed_model"], cfg["speed_size"], parts,
                                 slice_), ranks=parts, quiet=False)
    # (2) compile time: one fresh process per round
    compiles = []
    for k in range(rounds):
        benchlib.progress("volume", k + 1, rounds, "compile (fresh process)")
        compiles.append(_launch(opts, [
            "--worker", "compile", "--model", cfg["compile_model"], "--size",
            str(cfg["compile_size"]), "--parts", str(cfg["compile_parts"]), "--slice", "cube",
            "--warm", str(cfg["compile_warm"])]))
    # (3) SP2 speedup and its limit, interleaved rounds in rotated order
    timing = benchlib.interleave("volume", rounds, cfg["systems"], lambda system, _k: _launch(
        opts, _step_args("time", system, cfg["speed_model"], cfg["speed_size"], 2, "slab",
                         cfg["steps"], cfg["warmup"]),
        ranks=2 if system in ("sp", "ideal") else None))
    # (1) memory: one process, then P ranks; separate launches, the heaviest part last
    memory: dict[str, Any] = {}
    cfg["memory_model"], cfg["memory_fallback"] = cfg["model"], None
    for spec in filter(None, dict.fromkeys([cfg["model"], cfg["fallback_model"]])):
        try:
            for system, parts in (("eager", 1), ("sp", cfg["parts"])):
                benchlib.progress("volume", rounds, rounds,
                                  f"memory: {_unet(spec)}, {system}, {parts} rank(s)")
                memory[system] = _launch(opts, _step_args("step", system, spec, cfg["size"],
                                                          parts, "cube"),
                                         ranks=parts if system == "sp" else None)
            cfg["memory_model"] = spec
            break
        except RuntimeError as e:
            if spec == cfg["fallback_model"] or not cfg["fallback_model"]:
                raise
            tail = " ".join(str(e).split())[-300:]
            cfg["memory_fallback"] = f"{_unet(spec)} failed ({tail})"
            print(f"volume: memory with {_unet(spec)} failed; trying "
                  f"{_unet(cfg['fallback_model'])}", file=sys.stderr, flush=True)
    return section(cfg, memory, compiles, timing, halos, wire)


# -- the Section ----------------------------------------------------------------------------------
def _mib(b: float, digits: int = 1) -> float:
    return round(b / 2**20, digits)


def _unet(spec: str) -> str:
    base, depth = parse_model(spec)
    return f"3D U-Net base {base} depth {depth}"


def memory_rows(cfg: dict[str, Any], memory: dict[str, Any]) -> tuple[list[list[Any]],
                                                                       dict[str, Any]]:
    """Rows of table (1) and the summary: the largest rank's saved bytes over one process's."""
    one, sp = memory["eager"], memory["sp"]
    parts = cfg["parts"]
    top = max(sp["ranks"], key=lambda r: r["saved_bytes"])
    low = min(sp["ranks"], key=lambda r: r["saved_bytes"])
    grow = max(r["peak_growth"] for r in sp["ranks"])
    s = {"one_saved": one["saved_bytes"], "max_saved": top["saved_bytes"],
         "min_saved": low["saved_bytes"], "ratio": top["saved_bytes"] / one["saved_bytes"],
         "ideal": 1 / parts, "one_growth": one["peak_growth"], "max_growth": grow,
         "growth_ratio": grow / one["peak_growth"], "param_bytes": one["param_bytes"],
         "input_bytes": 4 * cfg["size"] ** 3, "one_step_s": one["step_s"],
         "sp_step_s": max(r["step_s"] for r in sp["ranks"])}
    vol = f"1x{cfg['size']}^3"
    rows = [[_unet(cfg["memory_model"]), vol, "one process (plain PyTorch)", 1,
             _mib(s["one_saved"]), 1.0, 1.0, _mib(s["one_growth"]), 1.0,
             round(s["one_step_s"], 1)],
            [_unet(cfg["memory_model"]), vol, f"SP{parts} cube {_grid(sp['grid'])}, largest "
             f"rank", parts, _mib(s["max_saved"]), round(s["ratio"], 3), round(s["ideal"], 3),
             _mib(grow), round(s["growth_ratio"], 3), round(s["sp_step_s"], 1)]]
    return rows, s


def _grid(g: Sequence[int]) -> str:
    return "x".join(map(str, g))


def halo_rows(halos: list[dict[str, Any]], wire: dict[str, Any]) -> tuple[list[list[Any]],
                                                                          list[dict[str, Any]]]:
    """Rows of table (4): per rank and step, forward + backward (the largest rank); totals."""
    rows, out = [], []
    for h in halos:
        tiles = h["tiles"]
        per_rank = [t["recv"] + t["sent"] for t in tiles]  # fwd receive + bwd receive
        minimum = [2 * t["minimum"] for t in tiles]  # halo_table: the backward returns it
        formula = [2 * b for b in h["formula"]["per_tile"]]
        total, need = sum(per_rank), sum(minimum)
        w = wire.get(f"{h['model']}@{h['size']}/{h['slice']}")
        wired = None if w is None else \
            sum(r["halo_fwd_bytes"] + r["halo_bwd_bytes"] for r in w["ranks"])
        wired_max = None if w is None else \
            max(r["halo_fwd_bytes"] + r["halo_bwd_bytes"] for r in w["ranks"])
        rec = {"model": h["model"], "size": h["size"], "slice": h["slice"],
               "parts": h["parts"], "grid": h["grid"], "per_rank_max": max(per_rank),
               "minimum_max": max(minimum), "total": total, "minimum_total": need,
               "formula_total": sum(formula), "formula_max": max(formula), "wire_total": wired,
               "wire_max": wired_max, "ratio": total / need if need else float("nan"),
               "wire_ratio": wired / need if wired is not None and need else None,
               "input_fwd": h["formula"]["input"], "halos": tiles[0]["halos"]}
        out.append(rec)
        rows.append([_unet(h["model"]), f"{h['size']}^3", f"SP{h['parts']} {h['slice']} "
                     f"{_grid(h['grid'])}", _mib(rec["per_rank_max"], 2),
                     _mib(rec["minimum_max"], 2), _mib(rec["formula_max"], 2),
                     round(rec["ratio"], 3), None if wired_max is None else _mib(wired_max, 2),
                     None if rec["wire_ratio"] is None else round(rec["wire_ratio"], 3),
                     _mib(total, 2), _mib(rec["input_fwd"], 2)])
    return rows, out


def section(cfg: dict[str, Any], memory: dict[str, Any], compiles: list[dict[str, Any]],
            timing: list[dict[str, Any]], halos: list[dict[str, Any]],
            wire: dict[str, Any]) -> dict[str, Any]:
    """The Section dict from the workers' records."""
    fmt = benchlib.fmt_spread
    aims: list[dict[str, Any]] = []
    # (1) memory
    mrows, mem = memory_rows(cfg, memory)
    met = mem["ratio"] <= MEMORY_AIM
    aims.append({
        "what": f"bytes saved for backward per rank at P={cfg['parts']} (cube) / one process, "
                f"{_unet(cfg['memory_model'])}, 1x{cfg['size']}^3 (ideal {mem['ideal']:.3f})",
        "aim": f"<= {MEMORY_AIM:.2f}x", "measured": f"{mem['ratio']:.3f}x", "met": met,
        "why": None if met else
        f"The largest rank saves {_mib(mem['max_saved'])} MiB against 1/{cfg['parts']} of one "
        f"process's {_mib(mem['one_saved'])} MiB = {_mib(mem['one_saved'] * mem['ideal'])} "
        f"MiB; the excess is what does not shrink with P (the whole input volume on every "
        f"rank, {_mib(mem['input_bytes'])} MiB, halo-padded copies of each conv input)."})
    # (2) compile
    cold = benchlib.spread([c["cold_s"] for c in compiles])
    warm_all = [w for c in compiles for w in c["warm_s"]]
    warm = benchlib.spread(warm_all) if warm_all else None
    rss = benchlib.spread([c["rss_gb"] for c in compiles])
    imports = benchlib.spread([c["imports_s"] for c in compiles])
    crow = [_unet(cfg["compile_model"]), f"1x{cfg['compile_size']}^3 (meta)",
            f"SP{cfg['compile_parts']} cube {_grid(compiles[0]['grid'])}",
            compiles[0]["world_size"], fmt(cold), fmt(warm) if warm else "-",
            fmt(rss), fmt(imports), compiles[0]["nodes"]]
    aims.append({"what": f"compile time, {_unet(cfg['compile_model'])} at "
                         f"{cfg['compile_size']}^3 on {cfg['compile_parts']} ranks (meta model; "
                         f"first compile in a fresh process)",
                 "aim": f"<= {COMPILE_AIM:g} s", "measured": fmt(cold, " s"),
                 "met": cold["median"] <= COMPILE_AIM, "why": None})
    # (3) SP2 speedup next to its limit
    systems = cfg["systems"]
    t = {s: benchlib.spread([r[s]["step_s"] for r in timing]) for s in systems}
    speedup = benchlib.spread([r["eager"]["step_s"] / r["sp"]["step_s"] for r in timing])
    limit = benchlib.spread([r["eager"]["step_s"] / r["ideal"]["step_s"] for r in timing])
    share = benchlib.spread([r["ideal"]["step_s"] / r["sp"]["step_s"] for r in timing])
    halo_wait = statistics.median(
        max(x["halo_wait_s"] for x in r["sp"]["ranks"]) / cfg["steps"] for r in timing)
    srow = [_unet(cfg["speed_model"]), f"1x{cfg['speed_size']}^3",
            *(fmt(t[s], digits=3) if s in t else "-" for s in ("eager", "fxpar1", "sp",
                                                               "ideal")),
            fmt(speedup, "x"), fmt(limit, "x"), fmt(share, "x"), f"{halo_wait:.3f}"]
    # (4) halos; the memory launch of the cube counted its halo bytes too
    wire = dict(wire)
    for h in halos:
        if (h["model"], h["size"], h["grid"]) == (cfg["memory_model"], cfg["size"],
                                                  memory["sp"].get("grid")):
            wire.setdefault(f"{h['model']}@{h['size']}/{h['slice']}", memory["sp"])
    hrows, hsum = halo_rows(halos, wire)
    for h in hsum:
        if h["wire_ratio"] is None:
            continue
        ok = h["wire_ratio"] <= HALO_AIM
        aims.append({"what": f"halo bytes sent per step (measured) / halo_table minimum, "
                             f"{_unet(h['model'])} at {h['size']}^3, SP{h['parts']} "
                             f"{h['slice']}", "aim": f"<= {HALO_AIM:.2f}x",
                     "measured": f"{h['wire_ratio']:.3f}x", "met": ok,
                     "why": None if ok else
                     f"{_mib(h['wire_total'] - h['minimum_total'])} MiB per step above the "
                     f"minimum over all ranks: halos wider than the layers read."})
    base, _ = parse_model(cfg["memory_model"])
    narrowed = base != 32
    method = (
        f"Model: `fxpar.models.build(\"unet3d\", in_channels=1, num_classes={CLASSES}, base, "
        f"depth)` (Çiçek et al.; every conv 3x3x3 + BatchNorm3d + ReLU, 2x2x2 max pools and "
        f"transposed convs), per-voxel `F.cross_entropy`, float32, batch 1, synthetic data, "
        f"SGD lr 0.01 momentum 0.9. Transport: {TRANSPORT}. "
        f"**(1) Memory**: {_unet(cfg['memory_model'])}"
        f"{' (narrower than the paper width 32)' if narrowed else ''} at "
        f"{cfg['size']}^3; one launch of a plain-PyTorch process (1 thread) and one of "
        f"`mpiexec -n {cfg['parts']}` with `Plan(spatial_parts={cfg['parts']}, slice=\"cube\")` "
        f"(1 thread per rank, {cfg['parts']} ranks on this machine's cores), each running ONE "
        f"train step, its first. Saved bytes: unique storages packed by "
        f"`torch.autograd.graph.saved_tensors_hooks` outside backward, parameters excluded "
        f"(`tools/memtrack.py`'s `saved_step`; fxpar's halo and BatchNorm autograd "
        f"Functions go through the same hooks); the largest rank over the one process, next to "
        f"the ideal 1/{cfg['parts']}. Peak RSS growth: peak RSS after the step minus RSS before. "
        f"**(2) Compile**: {_unet(cfg['compile_model'])} built under `torch.device(\"meta\")`, "
        f"`fxpar.compile(model, Plan(spatial_parts={cfg['compile_parts']}, slice=\"cube\"), "
        f"torch.empty(1, 1, {cfg['compile_size']}, {cfg['compile_size']}, "
        f"{cfg['compile_size']}, device=\"meta\"))`; each of {len(compiles)} fresh process(es) "
        f"times its first compile (cold: torch.export and fxpar's caches start empty; imports "
        f"and model construction not included) and then {cfg['compile_warm']} more in the same "
        f"process (warm). Peak RSS includes the interpreter and torch (GB = 10^9 bytes). "
        f"**(3) SP2 speedup**: {_unet(cfg['speed_model'])} at {cfg['speed_size']}^3; each of "
        f"{len(timing)} round(s) launches, in rotated order, `eager` (plain PyTorch, 1 process x "
        f"1 thread){', `fxpar1` (fxpar Plan(), 1 rank)' if 'fxpar1' in systems else ''}, `sp` "
        f"(`Plan(spatial_parts=2, slice=\"slab\")`, `mpiexec -n 2`, 1 thread per rank) and "
        f"`ideal` (the limit, as in `tools/bench_spatial.py`: under `mpiexec -n 2` each process "
        f"trains plain PyTorch on its own half of the depth, no messages), each as a fresh "
        f"process after a quiet spell; {cfg['warmup']} warm-up and {cfg['steps']} timed "
        f"step(s) per launch (median). Ratios are per round; median and range over rounds. "
        f"SP / limit = ideal step / SP step. **(4) Halo bytes**: per rank and train step, "
        f"forward + backward, the largest rank. Planned: from the compiled program (no MPI), "
        f"each halo exchange's received cells plus the cells it sends (the backward returns "
        f"the gradients of both) x batch x channels x 4 bytes. Minimum: twice "
        f"`halo_table`'s \"minimum\" column (the cells of each window inside the volume but "
        f"outside the tile; the backward sends the same amount back). Formula: the same "
        f"minimum restated from the model alone (forward hooks on a meta run record every "
        f"conv, transposed conv and pool; per tile the input cells its even share of outputs "
        f"reads minus its even share of the input, faces, edges and corners included), layers "
        f"reading the model input excluded (each rank reads its window of the data; listed "
        f"apart, forward only). Measured: one train step of {_unet(cfg['speed_model'])} under "
        f"`mpiexec -n P`, every `Comm.isend` of a halo node counted by tag "
        f"(`bench_spatial.instrument_halos`), forward + backward, the largest rank.")
    notes = ""
    if cfg.get("memory_fallback"):
        notes = (f"(1) ran with {_unet(cfg['memory_model'])}: {cfg['memory_fallback']}.")
    elif narrowed:
        notes = (f"(1) uses base {base} instead of the paper's 32 (`--volume-model`).")
    return {
        "name": "volume", "title": TITLE, "method": method,
        "tables": [
            {"title": "(1) Bytes saved for backward per rank, one train step (MiB; largest "
                      "rank)",
             "columns": ["model", "volume", "system", "ranks", "saved MiB", "/ one process",
                         "ideal 1/P", "peak RSS growth MiB", "/ one process", "step s"],
             "rows": mrows},
            {"title": "(2) fxpar.compile on meta tensors (s; median and range over fresh "
                      "processes)",
             "columns": ["model", "volume", "plan", "ranks", "cold compile s", "warm compile s",
                         "peak RSS GB", "imports s", "graph nodes"], "rows": [crow]},
            {"title": "(3) SP2 train step vs one process, and the limit (s; median and range "
                      "over rounds)",
             "columns": ["model", "volume", "eager 1 proc s", "fxpar 1 rank s", "SP2 slab s",
                         "ideal 2 procs s", "speedup eager/SP2", "limit eager/ideal",
                         "SP2 / limit", "halo wait s/step (max rank)"], "rows": [srow]},
            {"title": "(4) Halo bytes per rank per train step, forward + backward (MiB; "
                      "largest rank)",
             "columns": ["model", "volume", "plan", "planned", "minimum (halo_table)",
                         "formula (model only)", "planned / minimum", "measured (mpiexec)",
                         "measured / minimum (all ranks)", "planned, all ranks",
                         "input windows (not exchanged, fwd, all ranks)"], "rows": hrows}],
        "plots": [
            {"file": "volume_speedup.png",
             "title": f"SP2 on {cfg['speed_size']}^3 volumes: speedup and limit",
             "xlabel": "", "ylabel": "x over one process", "kind": "bar",
             "series": {"eager / SP2": [["SP2 slab", speedup["median"]]],
                        "eager / ideal (limit)": [["SP2 slab", limit["median"]]]}},
            {"file": "volume_halo.png", "title": "Halo bytes per rank per step / minimum",
             "xlabel": "plan", "ylabel": "x minimum", "kind": "bar", "hline": HALO_AIM,
              "series": {f"{_unet(m)} {n}^3 (planned)": [
                 [f"SP{h['parts']} {h['slice']}", h["ratio"]] for h in hsum
                 if (h["model"], h["size"]) == (m, n)]
                 for m, n in dict.fromkeys((h["model"], h["size"]) for h in hsum)}}],
        "aims": aims, "notes": notes,
        "raw": {"config": cfg, "memory_summary": mem, "memory": memory, "compiles": compiles,
                "timing": timing, "step_s": t, "speedup": speedup, "limit": limit,
                "sp_over_limit": share, "halo_wait_s": halo_wait, "halos": hsum,
                "halo_tables": [h["table"] for h in halos], "wire": wire},
    }


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--worker" in argv:
        a = worker_parser().parse_args(argv)
        {"compile": compile_worker, "halo": halo_worker}.get(a.worker, worker)(a)
        return 0
    return benchlib.standalone(__doc__.split("\n\n")[0], add_args, run, argv, rounds=3)


if __name__ == "__main__":
    raise SystemExit(main())
