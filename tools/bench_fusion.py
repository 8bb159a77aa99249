"""Benchmark section ``fusion``: halo fusion's messages and step time (issue 19, table (b)).

AmoebaNet-D at 1024x1024 on a 2x2 tile grid (SP4, ``mpiexec -n 4``, one thread per rank),
``Plan(halo_fusion=...)`` "off", "auto" and "all", in interleaved rounds (each round launches
every system as a fresh process, in rotated order, after a quiet spell; ``benchlib.measure``),
next to the machine's limit in the same rounds: four processes training plain eager PyTorch on
a quarter of the image each (vertical strips), no messages at all. Per system: halo exchanges
per step (the halo nodes that send), halo messages per step and rank 0's seconds blocked on
them (``Comm.isend`` / ``waitall`` counted by tag while the timed steps run), step time.

Run through ``tools/bench.py --only fusion`` or alone: ``python tools/bench_fusion.py --quick``
prints the Section JSON.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_spatial  # noqa: E402
import benchlib  # noqa: E402

TITLE = "Halo fusion: messages and step time (AmoebaNet-D, SP4)"
MODES = ("off", "auto", "all")


def add_args(parser: argparse._ActionsContainer) -> None:
    parser.add_argument("--fusion-models", default="amoebanet",
                        help="comma-separated, of resnet18, resnet50, amoebanet")
    parser.add_argument("--fusion-image", type=int, default=1024)
    parser.add_argument("--fusion-amoeba", default="2,64",
                        help="AmoebaNet-D num_layers,num_filters")
    parser.add_argument("--fusion-steps", type=int, default=2)


def _launch(opts: argparse.Namespace, cfg: dict[str, Any], model: str, system: str,
            mode: str) -> dict[str, Any]:
    args = ["--worker", "time", "--system", system, "--model", model, "--amoeba",
            cfg["amoeba"], "--image", str(cfg["image"]), "--batch", "1", "--parts", "4",
            "--slice", "square", "--steps", str(cfg["steps"]), "--warmup", "1",
            "--fusion", mode]
    cmd = benchlib.worker_command("bench_spatial.py", args, 4)
    return benchlib.measure(cmd, benchlib.thread_env(1), retries=opts.retries,
                            max_foreign=opts.max_foreign, timeout=opts.timeout)


def run(opts: argparse.Namespace) -> dict[str, Any]:
    q = bool(getattr(opts, "quick", False))
    cfg = {"image": 128 if q else opts.fusion_image, "amoeba": "2,16" if q else
           opts.fusion_amoeba, "steps": 1 if q else opts.fusion_steps,
           "models": [m.strip() for m in opts.fusion_models.split(",") if m.strip()]}
    systems = [*MODES, "ideal"]
    flat = benchlib.interleave(
        "fusion", opts.rounds, [(m, s) for m in cfg["models"] for s in systems],
        lambda ms, _k: _launch(opts, cfg, ms[0], "ideal" if ms[1] == "ideal" else "sp",
                               "off" if ms[1] == "ideal" else ms[1]), key="/".join)
    rounds = benchlib.nested(flat)
    return section(rounds, cfg)


def section(rounds: list[dict[str, dict[str, Any]]], cfg: dict[str, Any]) -> dict[str, Any]:
    rows, summary = [], {}
    steps = cfg["steps"]
    for model in cfg["models"]:
        t = {s: benchlib.spread([r[model][s]["step_s"] for r in rounds])
             for s in (*MODES, "ideal")}
        summary[model] = {"step_s": t}
        for mode in MODES:
            ranks = rounds[0][model][mode]["ranks"]
            msgs = sum(r["halo_msgs"] for r in ranks) / steps
            wait = benchlib.spread([r[model][mode]["halo_wait_s"] / steps for r in rounds])
            ratio = benchlib.spread([r[model]["off"]["step_s"] / r[model][mode]["step_s"]
                                     for r in rounds])
            limit = benchlib.spread([r[model]["ideal"]["step_s"] / r[model][mode]["step_s"]
                                     for r in rounds])
            summary[model][mode] = {"exchanges": ranks[0]["exchanges"], "messages": msgs,
                                    "speedup_vs_off": ratio, "ideal_over": limit}
            rows.append([model, mode, f"{ranks[0]['exchanges']:.0f}", f"{msgs:.0f}",
                         benchlib.fmt_spread(wait, digits=3),
                         benchlib.fmt_spread(t[mode], digits=3),
                         benchlib.fmt_spread(ratio, "x"), benchlib.fmt_spread(limit, "x")])
        rows.append([model, "ideal (limit)", "0", "0", "-",
                     benchlib.fmt_spread(t["ideal"], digits=3), "-", "1.00x"])
    method = (
        f"Transport: {bench_spatial.TRANSPORT}; 4 ranks on this machine's cores "
        f"(oversubscribed where it has fewer). Model: AmoebaNet-D (num_layers,num_filters = "
        f"{cfg['amoeba']}) and the others listed, 10 classes, float32, one synthetic image of "
        f"{cfg['image']}x{cfg['image']}, SGD; `Plan(spatial_parts=4, slice='square', "
        f"halo_fusion=MODE)`. {len(rounds)} round(s); each launches every system as a fresh "
        f"`mpiexec -n 4` in rotated order after a quiet spell, 1 warm-up and {steps} timed "
        f"step(s) (median). Exchanges: the halo nodes of rank 0's tile program that send "
        f"(forward; each also sends its gradients back in backward). Messages: halo "
        f"`isend`s of all ranks per step, forward and backward. Wait: seconds per step rank "
        f"0 is blocked in a `waitall` holding halo messages. `ideal`: each rank trains plain "
        f"eager PyTorch on a quarter of the image (vertical strip), no messages: the limit.")
    return {
        "name": "fusion", "title": TITLE, "method": method,
        "tables": [{"title": "Halo fusion, SP4 2x2 (per step; time median and range over "
                             "rounds)",
                    "columns": ["model", "halo_fusion", "exchanges (rank 0)",
                                "halo messages (all ranks)", "halo wait s (rank 0)",
                                "step s", "off / this", "ideal / this (limit 1.00x)"],
                    "rows": rows}],
        "plots": [], "aims": [], "notes": "",
        "raw": {"config": cfg, "summary": summary, "rounds": rounds},
    }


def main(argv: list[str] | None = None) -> int:
    return benchlib.standalone(__doc__.split("\n\n")[0], add_args, run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
