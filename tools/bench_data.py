"""Benchmark section ``data``: how long a rank waits for its windows of sampled, augmented
regions (fxpar.data.loader), as a share of the training step, against the limit of no data.

A generated whole-slide image (tools/make_slide.py: a tiled, zlib-compressed pyramidal TIFF,
RGB, with its tissue mask) is the source; 4 ranks train a small segmentation net (four 3x3
convolutions, BatchNorm, 2 classes, float32) under SP4 (2x2 tiles) on regions drawn by the
foreground sampler from a low-resolution copy of the mask and augmented by
``flip,rot90,affine,hed,noise``; each rank reads and augments only its input window (and its
target window of the mask). Three systems, each one ``mpiexec -n 4`` launch per round:

* ``no data (limit)``: one batch made before the steps, reused: the step without data;
* ``loader in the step``: each step's windows read and augmented in the training thread;
* ``prefetch 2``: :class:`fxpar.data.loader.Prefetcher`, 2 steps ahead on one thread.

Each worker reports the median step (wait for the batch + ``train_step``) and the data wait
(seconds blocked on the batch) over its steps after a warm-up, the slowest rank's. ``python
tools/bench_data.py [--quick]`` prints the Section JSON; ``tools/bench.py --only data`` renders
it into docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import benchlib  # noqa: E402

TITLE = "Sampled, augmented windows: data wait per step (SP4)"
SPEC = "flip,rot90,affine,hed,noise"
MODES = {"no data (limit)": "none", "loader in the step": "inline", "prefetch 2": "prefetch"}


def add_args(parser: argparse._ActionsContainer) -> None:
    parser.add_argument("--data-size", type=int, default=512, help="model input side")
    parser.add_argument("--data-slide", type=int, default=4096, help="generated slide side")
    parser.add_argument("--data-steps", type=int, default=8, help="measured steps per launch")


def _net() -> Any:
    from torch import nn

    return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                         nn.Conv2d(16, 16, 3, padding=1), nn.ReLU(),
                         nn.Conv2d(16, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 2, 1))


def _source(folder: Path, size: int, batch: int) -> Any:
    import numpy as np
    import torch

    from fxpar.data.augment import parse_augment
    from fxpar.data.images import open_image
    from fxpar.data.loader import AugmentedBatches, Slide
    from fxpar.data.sampling import Foreground

    image = open_image(folder / "slide.tif", 0)
    labels = open_image(folder / "slide_mask.tif", 0, mask=True)
    low = open_image(folder / "slide_mask.tif", 0, mask=True)
    from fxpar.core.geometry import Rect

    mask = low.read(Rect.whole(low.size))[0][::32, ::32].astype(np.float64)  # low resolution
    low.close()
    return AugmentedBatches([Slide(image, labels)], Foreground([mask]), parse_augment(SPEC),
                            (size, size), batch, seed=1, steps_per_epoch=1000,
                            dtype=torch.float32)


def worker(a: argparse.Namespace) -> None:
    import torch
    import torch.nn.functional as F

    import fxpar
    from fxpar.comm.world import world
    from fxpar.data.loader import prefetch

    torch.manual_seed(0)
    comm = world()
    batch = 2
    shape = (batch, 3, a.size, a.size)
    plan = fxpar.Plan(spatial_parts=comm.size, slice="square")
    rp = fxpar.compile(_net(), plan, torch.empty(shape, device="meta"), loss_fn=F.cross_entropy,
                       optimizer=lambda ps: torch.optim.SGD(ps, lr=0.01)).local(comm)
    src = _source(Path(a.slide), a.size, batch)
    window, target = rp.input_window(), rp.target_window()
    warm, steps = 2, a.steps

    def load(step: int) -> Any:
        return src.batch(step, window, target, targets=rp.needs_targets)

    fixed = load(0)
    feed = prefetch(src, range(warm + steps), window, target, targets=rp.needs_targets,
                    depth=2) if a.mode == "prefetch" else None
    step_s, wait_s = [], []
    for step in range(warm + steps):
        comm.barrier()
        t0 = time.perf_counter()
        x, y = fixed if a.mode == "none" else next(feed) if feed is not None else load(step)
        t1 = time.perf_counter()
        rp.train_step(x, y)
        t2 = time.perf_counter()
        if step >= warm:
            step_s.append(t2 - t0)
            wait_s.append(t1 - t0)
    if feed is not None:
        feed.close()
    mine = {"step_s": statistics.median(step_s), "wait_s": statistics.median(wait_s)}
    rows = comm.gather_object(mine, root=0)
    if rows is not None:
        slow = max(rows, key=lambda r: r["step_s"])
        benchlib.emit({**slow, "wait_share": slow["wait_s"] / slow["step_s"], "ranks": rows})
    rp.close()


def worker_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    p.add_argument("--worker", action="store_true")
    p.add_argument("--mode", choices=sorted(set(MODES.values())), required=True)
    p.add_argument("--slide", required=True)
    p.add_argument("--size", type=int, default=512)
    p.add_argument("--steps", type=int, default=8)
    return p


def run(opts: Any) -> dict[str, Any]:
    import make_slide

    size = 128 if opts.quick else opts.data_size
    side = 1024 if opts.quick else opts.data_slide
    steps = 3 if opts.quick else opts.data_steps
    folder = Path(tempfile.mkdtemp(prefix="bench-data-"))
    make_slide.write(folder, side, 2, size, seed=0)
    env = benchlib.thread_env(1)
    systems = [benchlib.System(name, benchlib.worker_command(
        "bench_data.py", ["--worker", "--mode", mode, "--slide", str(folder), "--size",
                          str(size), "--steps", str(steps)], ranks=4), env,
        limit=mode == "none") for name, mode in MODES.items()]
    method = (f"{side}x{side} generated slide (tiled zlib TIFF), {size}x{size} regions, batch "
              f"2, SP4 (2x2), `--augment {SPEC}`, foreground sampler; {steps} steps per launch "
              f"after 2 warm-up steps, one thread per rank; the slowest rank's median step.")
    section = benchlib.compare(opts, "data", TITLE, systems, baseline="loader in the step",
                               method=method)
    rounds = section["raw"]["rounds"]
    rows = []
    for name in MODES:
        share = benchlib.spread([r[name]["wait_share"] for r in rounds])
        wait = benchlib.spread([r[name]["wait_s"] * 1e3 for r in rounds])
        rows.append([name, benchlib.fmt_spread(wait, digits=1),
                     benchlib.fmt_spread({k: v * 100 if k != "n" else v
                                          for k, v in share.items()}, "%", digits=1)])
    section["tables"].append({"title": "Data wait per step (slowest rank)",
                              "columns": ["system", "wait (ms)", "share of the step"],
                              "rows": rows})
    return section


if __name__ == "__main__":
    sys.exit(benchlib.entry(__doc__.split("\n\n")[0], add_args, run, None, worker,
                            worker_parser, rounds=2))
