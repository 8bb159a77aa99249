"""``fxpar-run``: train a zoo or user model under ``mpiexec`` with a parallel plan.

    mpiexec -n 1 fxpar-run models:amoebanet -k num_layers=2 -k num_filters=32 \\
        --image-size 256 --batch-size 4 --steps 5

MPI4DL's flag names are accepted as aliases (``--split-size`` for ``--stages``, ``--parts``
for ``--microbatches``, ...). Data is synthetic (fixed seed) unless a dataset is given.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence

import torch

from fxpar.compiler import compile as fx_compile
from fxpar.plan import SCHEDULES, SLICES, Plan, PlanError
from fxpar.trace import TraceError
from fxpar.zoo import ModelSpecError, build_model, parse_kwargs


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fxpar-run", description="Compile a model for a parallel "
                                "plan and train it (run under mpiexec -n WORLD_SIZE).")
    p.add_argument("model", help="torchvision:NAME, models:NAME or path/to/file.py:FACTORY")
    p.add_argument("-k", "--model-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="keyword argument for the model factory (repeatable)")
    p.add_argument("--image-size", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=8, help="global batch per step")
    p.add_argument("--channels", type=int, default=3)
    p.add_argument("--num-classes", type=int, default=10)
    p.add_argument("--num-layers", type=int, help="AmoebaNet-D: normal cells")
    p.add_argument("--num-filters", type=int, help="AmoebaNet-D: filters")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    g = p.add_argument_group("plan (MPI4DL's names in brackets)")
    g.add_argument("--stages", "--split-size", type=int, default=1, help="[--split-size]")
    g.add_argument("--balance", type=str, default=None,
                   help="comma-separated node counts per stage [--balance]")
    g.add_argument("--microbatches", "--parts", type=int, default=1, help="[--parts]")
    g.add_argument("--schedule", choices=SCHEDULES, default="gpipe")
    g.add_argument("--spatial-parts", "--num-spatial-parts", type=int, default=1,
                   help="[--num-spatial-parts]")
    g.add_argument("--slice", "--slice-method", choices=SLICES, default="square",
                   help="[--slice-method]")
    g.add_argument("--spatial-stages", "--spatial-size", type=int, default=1,
                   help="[--spatial-size]")
    g.add_argument("--gems", action="store_true")
    g.add_argument("--times", "--gems-times", type=int, default=1, help="[--times]")
    g.add_argument("--data-parallel", "--local-DP", type=int, default=1, help="[--local-DP]")
    return p


def plan_from_args(a: argparse.Namespace) -> Plan:
    balance = tuple(int(b) for b in a.balance.split(",")) if a.balance else None
    return Plan(stages=a.stages, balance=balance, microbatches=a.microbatches,
                schedule=a.schedule, spatial_parts=a.spatial_parts, slice=a.slice,
                spatial_stages=a.spatial_stages, gems=a.gems, gems_times=a.times,
                data_parallel=a.data_parallel)


def main(argv: Sequence[str] | None = None) -> int:
    a = parser().parse_args(argv)
    torch.manual_seed(a.seed)  # every rank builds the same initial model
    dtype = getattr(torch, a.dtype)
    try:
        plan = plan_from_args(a)
        plan.check_batch(a.batch_size)
        kwargs = parse_kwargs(a.model_arg)
        kwargs.setdefault("num_classes", a.num_classes)
        if a.num_layers is not None:
            kwargs["num_layers"] = a.num_layers
        if a.num_filters is not None:
            kwargs["num_filters"] = a.num_filters
        model = build_model(a.model, **kwargs).to(dtype)
        shape = (a.batch_size, a.channels, a.image_size, a.image_size)
        t0 = time.perf_counter()
        program = fx_compile(model, plan, torch.empty(shape, dtype=dtype, device="meta"),
                             optimizer=lambda ps: torch.optim.SGD(ps, lr=a.lr, momentum=0.9))
        rp = program.local()
    except (PlanError, ModelSpecError, TraceError, ValueError, TypeError) as e:
        print(f"fxpar-run: error: {e}", file=sys.stderr)
        return 2
    lead = rp.rank == 0
    if lead:
        print(f"fxpar-run: {a.model} {'x'.join(map(str, shape))} {a.dtype} on "
              f"{program.world_size} rank(s); compiled in {time.perf_counter() - t0:.2f} s",
              flush=True)
    gen = torch.Generator().manual_seed(a.seed + 1)
    x = torch.randn(shape, generator=gen, dtype=dtype)
    y = torch.randint(0, a.num_classes, (a.batch_size,), generator=gen)
    rates = []
    for step in range(1, a.steps + 1):
        t = time.perf_counter()
        loss = rp.train_step(x, y)
        dt = time.perf_counter() - t
        rates.append(a.batch_size / dt)
        if lead:
            print(f"step {step:>4}/{a.steps}  loss {loss:.4f}  {a.batch_size / dt:8.2f} img/s  "
                  f"({dt:.3f} s)", flush=True)
    if lead and rates:
        steady = sorted(rates[1:] or rates)
        print(f"done: median {steady[len(steady) // 2]:.2f} img/s over steps "
              f"{2 if len(rates) > 1 else 1}..{a.steps} (step 1 includes warm-up)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
