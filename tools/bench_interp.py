"""Benchmark section ``interp``: what a tile's interpolation costs (fxpar.runtime.spatial.interp).

One tile of a 2x upsampling in a U-Net decoder: the window the halo exchange brings (the
tile's input rows plus one halo row per inner edge), upsampled, forward and backward, float32,
one thread, in one process. Three ways, interleaved in every round (order rotated):

* ``kernel``: ``TileInterp`` as it runs now: PyTorch's kernel on the window, cut to the tile.
* ``gather``: the index-map path every other map takes (``index_select``, blend and its
  ``index_add`` backward per dim): how nearest and bilinear x2 ran before.
* ``limit``: ``F.interpolate`` of the same window and its backward, without the cut: the aim
  is that a tile costs no more than this.

``python tools/bench_interp.py [--quick]`` prints the Section JSON; ``tools/bench.py --only
interp`` renders it into docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import benchlib  # noqa: E402

TITLE = "Interpolation on tiles"
WAYS = ("kernel", "gather", "limit")
CASES = (("bilinear", 64, 512), ("nearest", 64, 512), ("bilinear", 16, 2048))
"""(mode, channels, image side of the upsampled output)."""


def add_args(parser: argparse._ActionsContainer) -> None:
    parser.add_argument("--interp-reps", type=int, default=5,
                        help="timed forward+backward passes per way and round (median)")


def _one(mode: str, channels: int, side: int, reps: int) -> dict[str, float]:
    import torch
    import torch.nn.functional as F

    from fxpar.core.geometry import tile
    from fxpar.runtime.spatial.interp import AxisMap, TileInterp

    torch.manual_seed(0)
    small = side // 2
    maps = (AxisMap(mode, False, small, side, 2.0), AxisMap(mode, False, small, side, 2.0))
    out = (tile(side, 2, 1), (0, side))  # the lower tile of SP2 along H
    need = (maps[0].needs(out[0]), maps[1].needs(out[1]))
    window = torch.randn(1, channels, need[0][1] - need[0][0], need[1][1] - need[1][0],
                         requires_grad=True)
    fast = TileInterp(maps, out, (need[0][0], need[1][0]))
    slow = TileInterp(maps, out, (need[0][0], need[1][0]))
    slow.factors = None
    corners = False if mode == "bilinear" else None
    runs = {"kernel": lambda: fast(window), "gather": lambda: slow(window),
            "limit": lambda: F.interpolate(window, scale_factor=2.0, mode=mode,
                                           align_corners=corners)}
    torch.testing.assert_close(runs["kernel"](), runs["gather"](), rtol=1e-5, atol=1e-5)
    times: dict[str, float] = {}
    for way, run in runs.items():
        for _ in range(2):  # warm-up
            run().sum().backward()
        ts = []
        for _ in range(reps):
            t = time.perf_counter()
            run().sum().backward()
            ts.append(time.perf_counter() - t)
        times[way] = statistics.median(ts)
    times["window_rows"] = float(window.shape[2])
    return times


def _why(over: dict[str, float]) -> str:
    extra = ("the tile is a cut of the kernel's output on the window: its backward first "
             "writes the whole window's output gradient, zeros included, a pass the kernel "
             "alone does not make")
    if over["min"] <= 1.0:
        return f"the rounds' range reaches below 1.00x (noise on this machine); {extra}"
    return extra


def run(opts: Any) -> dict[str, Any]:
    import torch

    torch.set_num_threads(1)
    reps = 2 if opts.quick else opts.interp_reps
    cases = [(m, c, 128) for m, c, _ in CASES] if opts.quick else list(CASES)
    rounds: list[dict[str, dict[str, float]]] = []
    for r in range(opts.rounds):
        got = {}
        for mode, ch, side in benchlib.rotate(cases, r):
            got[f"{mode} {ch}ch {side}"] = _one(mode, ch, side, reps)
        rounds.append(got)
    rows, summary, aims = [], {}, []
    for mode, ch, side in cases:
        key = f"{mode} {ch}ch {side}"
        t = {w: benchlib.spread([rd[key][w] * 1e3 for rd in rounds]) for w in WAYS}
        over = benchlib.spread([rd[key]["kernel"] / rd[key]["limit"] for rd in rounds])
        gain = benchlib.spread([rd[key]["gather"] / rd[key]["kernel"] for rd in rounds])
        summary[key] = {"ms": t, "kernel_over_limit": over, "gather_over_kernel": gain}
        aims.append({"what": f"a tile's {mode} x2 upsampling ({ch} channels, {side}x{side}) "
                             f"vs the kernel on its window", "aim": "<= 1.00x",
                     "measured": benchlib.fmt_spread(over, "x"), "met": over["median"] <= 1.0,
                     "why": None if over["median"] <= 1.0 else _why(over)})
        rows.append([mode, str(ch), f"{side // 2}x{side} of {side}x{side}",
                     f"{rounds[0][key]['window_rows']:.0f} x {side // 2}",
                     benchlib.fmt_spread(t["kernel"], digits=2),
                     benchlib.fmt_spread(t["gather"], digits=2),
                     benchlib.fmt_spread(t["limit"], digits=2),
                     benchlib.fmt_spread(over, "x"), benchlib.fmt_spread(gain, "x")])
    method = (f"One process, one thread, float32, batch 1. The lower tile of SP2 (split along "
              f"H) of a 2x upsampling; its input window is the tile's rows plus the halo row. "
              f"Forward and backward (`.sum().backward()`), median of {reps} passes per way "
              f"and round after 2 warm-up passes, the three ways one after another in each "
              f"round; {len(rounds)} round(s), median and range over rounds. kernel: "
              f"`TileInterp` now (PyTorch's kernel on the window, cut to the tile); gather: "
              f"the index-map path (what x2 ran before); limit: `F.interpolate` of the same "
              f"window with its backward, uncut.")
    return {
        "name": "interp", "title": TITLE, "method": method,
        "tables": [{"title": "A tile's 2x upsampling, forward + backward (ms)",
                    "columns": ["mode", "channels", "output tile", "input window", "kernel ms",
                                "gather ms", "limit ms", "kernel / limit (aim <= 1.00x)",
                                "gather / kernel"],
                    "rows": rows}],
        "plots": [], "aims": aims, "notes": "",
        "raw": {"summary": summary, "rounds": rounds},
    }


if __name__ == "__main__":
    sys.exit(benchlib.standalone(__doc__.split("\n\n")[0], add_args, run, None, rounds=3))
