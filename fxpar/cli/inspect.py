"""``fxpar-inspect``: print what fxpar sees in a model.

    fxpar-inspect torchvision:resnet50 --image-size 1024 --batch-size 2
    fxpar-inspect models:amoebanet -k num_layers=6 -k num_filters=64 --image-size 512
    fxpar-inspect path/to/net.py:make_net --image-size 2048 --channels 1
    fxpar-inspect torchvision:resnet18 --image-size 128 --batch-size 32 --stages 2 \
        --microbatches 4 --schedule 1f1b
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence

import torch

from fxpar.compiler import compile as fx_compile
from fxpar.compiler import links_of
from fxpar.plan import SCHEDULES, SLICES, Plan, PlanError
from fxpar.report import halo_table, node_table, rank_table, stage_table, totals_line
from fxpar.schedule import format_grid
from fxpar.simulate import simulate
from fxpar.trace import TraceError, trace
from fxpar.zoo import ModelSpecError, build_model, parse_kwargs


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="fxpar-inspect", description="Trace a model on fake tensors (no image memory) and "
        "print its graph: every node's op, output shape, FLOPs and bytes.")
    p.add_argument("model", help="torchvision:NAME, models:NAME or path/to/file.py:FACTORY")
    p.add_argument("-k", "--model-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="keyword argument for the model factory (repeatable)")
    p.add_argument("--image-size", type=int, required=True, help="input height and width")
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--channels", type=int, default=3, help="input channels (default 3)")
    p.add_argument("--num-classes", type=int, default=None,
                   help="passed to the factory as num_classes")
    p.add_argument("--dtype", choices=("float32", "float64", "bfloat16", "float16"),
                   default="float32")
    g = p.add_argument_group("plan: with --stages, also print the stage table and the schedule")
    g.add_argument("--stages", "--split-size", type=int, default=None)
    g.add_argument("--balance", default=None, help="comma-separated node counts per stage")
    g.add_argument("--microbatches", "--parts", type=int, default=1)
    g.add_argument("--schedule", choices=SCHEDULES, default="gpipe")
    g.add_argument("--spatial-parts", "--num-spatial-parts", type=int, default=1)
    g.add_argument("--slice", "--slice-method", choices=SLICES, default="square")
    g.add_argument("--spatial-stages", "--spatial-size", type=int, default=1)
    g.add_argument("--gems", action="store_true", help="bidirectional GEMS mirror copy")
    g.add_argument("--times", "--gems-times", type=int, default=1)
    g.add_argument("--data-parallel", "--local-DP", type=int, default=1)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        kwargs = parse_kwargs(args.model_arg)
        if args.num_classes is not None:
            kwargs["num_classes"] = args.num_classes
        model = build_model(args.model, meta=True, **kwargs)  # no parameter memory
        dtype = getattr(torch, args.dtype)
        model = model.to(dtype)
        shape = (args.batch_size, args.channels, args.image_size, args.image_size)
        example = torch.empty(shape, dtype=dtype, device="meta")
        start = time.perf_counter()
        program = None
        if args.stages is None and args.spatial_parts == 1 and not args.gems and \
                args.data_parallel == 1:
            gm = trace(model, example)
        else:
            balance = tuple(int(b) for b in args.balance.split(",")) if args.balance else None
            plan = Plan(stages=args.stages or 1, balance=balance,
                        microbatches=args.microbatches, schedule=args.schedule,
                        spatial_parts=args.spatial_parts, slice=args.slice,
                        spatial_stages=args.spatial_stages, gems=args.gems,
                        gems_times=args.times, data_parallel=args.data_parallel)
            program = fx_compile(model, plan, example)
            assert program.traced is not None
            gm = program.traced
        took = time.perf_counter() - start
    except (ModelSpecError, TraceError, PlanError, ValueError, TypeError) as e:
        print(f"fxpar-inspect: error: {e}", file=sys.stderr)
        return 2
    per = "" if program is None else f" (per micro-batch of {shape[0] // program.plan.chunks()})"
    print(f"model: {args.model}  input: {'x'.join(map(str, shape))} {args.dtype}  "
          f"nodes: {len(gm.graph.nodes)}  (traced and analysed in {took:.2f} s){per}")
    print(node_table(gm))
    print(totals_line(gm))
    if program is not None and program.spatial is not None:
        print()
        print(halo_table(program))
    if program is not None and program.world_size > 1:
        print(f"\nrank map ({program.world_size} ranks):")
        print(rank_table(program))
    if program is not None and program.plan.stages > 1:
        print(f"\nstages: {program.plan.stages} on {program.world_size} ranks")
        print(stage_table(gm, program.graph))
    if program is not None and (program.plan.stages > 1 or program.plan.gems):
        print(f"\nschedule: {program.plan.schedule}, {program.plan.microbatches} micro-batches"
              f"{', GEMS x2 copies' if plan.gems else ''} (one training step, step x rank)")
        print(format_grid(program.schedule))
        sim = simulate(program.schedule, links_of(program.graph))
        print(f"simulated bubble (F=1, B=2 ticks): {sim.bubble:.1%}; one copy's formula "
              f"(p-1)/(m+p-1) = "
              f"{(plan.stages - 1) / (plan.microbatches + plan.stages - 1):.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
