"""What the step guard costs: step time with the NaN/inf check (``FXPAR_NONFINITE=stop``, the
default) against none (``off``), in interleaved steps of one job, next to its parts measured in
the same run (one allreduce of a flag per rank, the snapshot of the buffers, the finiteness
scan of gradients and buffers).

    python tools/bench_guard.py --ranks 2 --rounds 20

launches ``mpiexec -n RANKS`` on torchvision's ResNet-18 (float32, 64x64, batch 8, two
pipeline stages, two micro-batches: ``--plan`` for another) and prints a Markdown table. The
policy is switched on every rank between steps (the same on all ranks, as it must be); the
order alternates per round. The watchdog thread runs in both (it cannot be detached).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _worker(a: argparse.Namespace) -> None:
    import torch
    import torchvision

    import fxpar
    from fxpar.runtime.guard import _flags

    torch.manual_seed(0)
    plan = fxpar.Plan(**json.loads(a.plan))
    shape = (a.batch, 3, a.size, a.size)
    program = fxpar.compile(torchvision.models.resnet18(num_classes=10), plan, shape,
                            optimizer=lambda ps: torch.optim.SGD(ps, lr=0.01, momentum=0.9))
    rp = program.local()
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(shape, generator=g), torch.randint(0, 10, (a.batch,), generator=g)
    for _ in range(2):
        rp.train_step(x, y)  # warm-up
    times: dict[str, list[float]] = {"stop": [], "off": []}
    for r in range(a.rounds):
        for policy in (("stop", "off") if r % 2 == 0 else ("off", "stop")):
            rp.guard.policy = policy
            rp.comm.barrier() if rp.comm is not None else None
            t = time.perf_counter()
            rp.train_step(x, y)
            times[policy].append(time.perf_counter() - t)
    flag = torch.zeros(rp.comm.size if rp.comm is not None else 1, dtype=torch.float64)
    parts: dict[str, list[float]] = {"allreduce": [], "snapshot": [], "scan": []}
    bufs, grads = rp._buffers(), rp._grads()
    for _ in range(a.rounds):
        if rp.comm is not None:
            rp.comm.barrier()
            t = time.perf_counter()
            rp.comm.allreduce(flag)
            parts["allreduce"].append(time.perf_counter() - t)
        t = time.perf_counter()
        _ = [b.detach().clone() for b in bufs]
        parts["snapshot"].append(time.perf_counter() - t)
        t = time.perf_counter()
        _flags([], grads, [b for b in bufs if b.is_floating_point()])
        parts["scan"].append(time.perf_counter() - t)
    rows = rp.comm.gather_object({**times, **parts}, root=0) if rp.comm is not None else \
        [{**times, **parts}]
    if rows is not None:
        print("RESULT " + json.dumps(rows), flush=True)
    rp.close()


def _table(rows: list[dict[str, list[float]]], a: argparse.Namespace) -> str:
    def med(vs: list[float]) -> str:
        return f"{statistics.median(vs) * 1e3:.1f} ms ({min(vs) * 1e3:.1f}-{max(vs) * 1e3:.1f})"

    lines = [f"ResNet-18, {a.size}x{a.size}, batch {a.batch}, plan {a.plan}, {a.ranks} ranks, "
             f"{a.rounds} interleaved rounds; median (min-max) per rank", "",
             "| rank | step, check on (stop) | step, check off | on / off | one flag allreduce "
             "| buffer snapshot | finiteness scan |", "|---|---|---|---|---|---|---|"]
    for r, row in enumerate(rows):
        ratio = statistics.median(row["stop"]) / statistics.median(row["off"])
        lines.append(f"| {r} | {med(row['stop'])} | {med(row['off'])} | {ratio:.3f} | "
                     f"{med(row['allreduce']) if row['allreduce'] else '-'} | "
                     f"{med(row['snapshot'])} | {med(row['scan'])} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--size", type=int, default=64)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--plan", default='{"stages": 2, "microbatches": 2}')
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        _worker(a)
        return
    mpiexec = Path(sys.executable).parent / "mpiexec"
    cmd = [str(mpiexec), "-n", str(a.ranks), sys.executable, __file__, "--worker",
           "--rounds", str(a.rounds), "--size", str(a.size), "--batch", str(a.batch),
           "--plan", a.plan]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    got = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    if out.returncode != 0 or not got:
        sys.exit(f"the benchmark job failed ({out.returncode}):\n{out.stdout[-3000:]}"
                 f"\n{out.stderr[-3000:]}")
    print(_table(json.loads(got[0][len("RESULT "):]), a))


if __name__ == "__main__":
    main()
