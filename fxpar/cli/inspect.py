"""``fxpar-inspect``: print what fxpar sees in a model.

    fxpar-inspect torchvision:resnet50 --image-size 1024 --batch-size 2
    fxpar-inspect models:amoebanet -k num_layers=6 -k num_filters=64 --image-size 512
    fxpar-inspect path/to/net.py:make_net --image-size 2048 --channels 1
    fxpar-inspect torchvision:resnet18 --image-size 128 --batch-size 32 --stages 2 \
        --microbatches 4 --schedule 1f1b

Views (any of them replaces the default report; see docs/inspect.md):
    --after PASS [--code]   the graph right after a compiler pass, with that pass's metadata
    --rank R                the Python code generated for rank R
    --dot FILE / --svg FILE the stage graphs as DOT / rendered with graphviz's dot
    --timeline FILE.png     the schedule as a Gantt chart (simulated, or --from-metrics RUN.json)
    --memory                estimated peak memory per rank
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence

import torch
from torch import fx, nn

from fxpar.cli.args import bytes_arg, grid_arg, image_size_arg
from fxpar.cli.auto import AutoUsageError, add_args, check_no_layout
from fxpar.compiler.driver import PASSES, links_of
from fxpar.compiler.driver import compile as fx_compile
from fxpar.compiler.passdriver import HALO, TRACE, dump
from fxpar.compiler.report import halo_table, node_table, rank_table, stage_table, totals_line
from fxpar.core.plan import (
    HALO_FUSION,
    PRECISION_DTYPES,
    RECOMPUTE,
    SCHEDULES,
    SLICES,
    Plan,
    PlanError,
)
from fxpar.core.schedule import SCHEDULES as SCHEDULE_RULES
from fxpar.core.schedule import format_grid, split_keys
from fxpar.core.units import nbytes
from fxpar.frontend.trace import TraceError, trace
from fxpar.models.zoo import ModelSpecError, build_model, parse_kwargs
from fxpar.perf.costmodel import timing
from fxpar.perf.memory import memory_table
from fxpar.perf.profile import Profile, ProfileError
from fxpar.perf.simulate import simulate, stage_costs
from fxpar.planner.planner import DEFAULT_PROFILE, plan_auto
from fxpar.program.program import Program
from fxpar.report import draw
from fxpar.train.metrics import load_metrics


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="fxpar-inspect", description="Trace a model on fake tensors (no image memory) and "
        "print its graph: every node's op, output shape, FLOPs and bytes.")
    p.add_argument("model", nargs="?",
                   help="torchvision:NAME, models:NAME or path/to/file.py:FACTORY")
    p.add_argument("-k", "--model-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="keyword argument for the model factory (repeatable)")
    p.add_argument("--image-size", type=image_size_arg, metavar="N|HxW|DxHxW",
                   help="input size (required): N for an N x N image, HxW, or DxHxW for a 3-D "
                   "volume; N with a DxHxW --grid is an N^3 volume")
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
    g.add_argument("--stages-per-rank", type=int, default=1, metavar="V",
                   help="stages each rank holds (--schedule interleaved_1f1b)")
    g.add_argument("--spatial-parts", "--num-spatial-parts", type=int, default=1)
    g.add_argument("--slice", "--slice-method", choices=SLICES, default="square",
                   help="default square; slab, pencil, cube split a volume's D, D x H, D x H x W")
    g.add_argument("--grid", type=grid_arg, metavar="HxW|DxHxW", default=None,
                   help="explicit process grid: tiles per spatial dim (e.g. 2x2x2); "
                   "--spatial-parts defaults to their product")
    g.add_argument("--spatial-stages", "--spatial-size", type=int, default=1)
    g.add_argument("--gems", action="store_true", help="bidirectional GEMS mirror copy")
    g.add_argument("--times", "--gems-times", type=int, default=1)
    g.add_argument("--data-parallel", "--local-DP", type=int, default=1)
    g.add_argument("--recompute", choices=RECOMPUTE, default="never",
                   help="activation recompute per stage: always, except_last, auto (with "
                   "--memory-per-rank); --memory shows the effect")
    g.add_argument("--memory-per-rank", type=bytes_arg, metavar="SIZE", default=None,
                   help="memory budget per rank for --recompute auto, e.g. 4GiB")
    g.add_argument("--recompute-segments", type=int, metavar="K", default=1,
                   help="checkpoint each stage in K segments (--memory shows the effect)")
    g.add_argument("--channels-last", action="store_true",
                   help="convolutions in the channels-last memory format")
    g.add_argument("--precision", choices=tuple(PRECISION_DTYPES), default="fp32",
                   help="compute dtype: bf16 / fp16 show autocast's casts (--after precision) "
                   "and halve activations and messages (--memory)")
    g.add_argument("--halo-fusion", choices=HALO_FUSION, default="off",
                   help="consecutive convolutions / pools share one wider halo exchange "
                   "(--halos lists the fused groups and their widths)")
    v = p.add_argument_group("views (each replaces the default report)")
    v.add_argument("--after", metavar="PASS", help=f"print the graph after PASS, one of: "
                   f"{', '.join(PASS_NAMES)} (halo: the tile modules, tile 0 or --rank's)")
    v.add_argument("--code", action="store_true", help="with --after: also the graph's code")
    v.add_argument("--rank", type=int, default=None,
                   help="print the code generated for this rank (with --after halo: show "
                   "this rank's tiles instead; --dot draws its tiles)")
    v.add_argument("--dot", metavar="FILE", help="write the stage graphs as graphviz DOT")
    v.add_argument("--svg", metavar="FILE", help="render the stage graphs to SVG (needs dot)")
    v.add_argument("--timeline", metavar="FILE.png",
                   help="draw one training step as a Gantt chart, simulated from FLOPs")
    v.add_argument("--from-metrics", metavar="RUN.json",
                   help="with --timeline: draw a real run's last step (fxpar-run --metrics)")
    v.add_argument("--memory", action="store_true", help="estimated peak memory per rank")
    add_args(v, run=False)
    v.add_argument("--profile", metavar="PROFILE",
                   help="a machine profile (fxpar-calibrate's JSON, or h100-nvlink-ib): "
                   "print the predicted step time; --timeline then draws seconds (with "
                   "--from-metrics: the prediction above the measured run)")
    return p


INSPECT_DEFAULTS: dict[str, object] = {
    "stages": None, "balance": None, "microbatches": 1, "schedule": "gpipe", "spatial_parts": 1,
    "stages_per_rank": 1, "grid": None, "spatial_stages": 1, "gems": False, "times": 1,
    "data_parallel": 1,
    "recompute": "never"}
"""fxpar-inspect's defaults of the options the planner chooses."""
PASS_NAMES = (TRACE, *(name for name, _ in PASSES), HALO)


class UsageError(ValueError):
    """A bad combination of options; the message says what to change."""


def _views(args: argparse.Namespace) -> bool:
    return any(x is not None and x is not False for x in (
        args.after, args.rank, args.dot, args.svg, args.timeline, args.memory, args.profile,
        args.auto))


def _check_args(args: argparse.Namespace) -> None:
    if args.after is not None and args.after not in PASS_NAMES:
        raise UsageError(f"unknown pass {args.after!r} for --after; valid names: "
                         f"{', '.join(PASS_NAMES)}")
    if args.code and args.after is None:
        raise UsageError("--code prints the graph of --after PASS: add --after")
    if args.from_metrics is not None and args.timeline is None:
        raise UsageError("--from-metrics draws a timeline: add --timeline FILE.png")
    if args.from_metrics is not None and args.profile is not None and \
            (args.model is None or args.image_size is None):
        raise UsageError("--from-metrics with --profile draws the prediction next to the run: "
                         "give the run's model, --image-size and plan options too")
    if args.auto and args.world_size is None:
        raise UsageError("--auto plans for a number of ranks: add --world-size N")
    if args.world_size is not None and not args.auto:
        raise UsageError("--world-size is the ranks --auto plans for: add --auto")
    if args.from_metrics is None and (args.model is None or args.image_size is None):
        raise UsageError("give a model and --image-size (e.g. torchvision:resnet18 "
                         "--image-size 224)")


def _print_views(args: argparse.Namespace, program: Program, dumps: dict[str, str]) -> None:
    """Everything the view options ask for, in the order of --help."""
    plan = program.plan
    if args.rank is not None and not 0 <= args.rank < program.world_size:
        raise UsageError(f"--rank {args.rank} is outside this plan's {program.world_size} "
                         f"rank(s): use 0..{program.world_size - 1}")
    if args.after == HALO:
        if program.spatial is None:
            raise UsageError("--after halo shows the tile-rewritten spatial stages; this plan "
                             "has none: add --spatial-parts P (P > 1)")
        for s in range(program.spatial.spatial_stages):
            gm = draw.stage_module(program, s, args.rank)
            print(f"after pass 'halo': stage {s}, {type(gm).__name__} "
                  f"({len(gm.graph.nodes)} nodes)")
            print(dump(HALO, gm, args.code))
    elif args.after is not None:
        print(f"after pass {args.after!r}:")
        print(dumps[args.after])
    if args.rank is not None and args.after is None:
        from fxpar.program.emit import rank_sources

        for name, text in rank_sources(program, args.rank).items():
            print(f"# ---- rank {args.rank}: {name} ----")
            print(text.rstrip("\n"))
    if args.dot is not None or args.svg is not None:
        dot = draw.program_dot(program, args.rank)
        if args.dot is not None:
            with open(args.dot, "w") as f:
                f.write(dot.source)
            print(f"wrote {args.dot} (DOT, {len(dot.source):,} characters)")
        if args.svg is not None:
            print(f"wrote {draw.render_svg(dot, args.svg)} (SVG)")
    if args.profile is not None:
        _predict(args, program)
    elif args.timeline is not None:
        costs = {s: f / 1e9 for s, f in stage_costs(program).items()}
        unit = not any(costs.values())
        split = split_keys(program.schedule.values())
        draw.draw_timeline(
            draw.timeline_bars(program, None if unit else costs), args.timeline,
            f"{args.model}: {plan.schedule}, {plan.stages} stage(s), {plan.microbatches} "
            f"micro-batch(es){', GEMS' if plan.gems else ''} (simulated)",
            f"simulated time: ticks ({_tick_costs(split)})" if unit else
            f"simulated time: forward GFLOP per rank "
            f"({'B = W = F' if split else 'B = 2x F'}; communication free)")
        print(f"wrote {args.timeline} (simulated timeline of {program.world_size} rank(s))")
    if args.memory:
        print(memory_table(program))


def _predict(args: argparse.Namespace, program: Program) -> None:
    """``--profile``: the step the cost model predicts; with --timeline its Gantt chart (and
    the measured run's below it with --from-metrics)."""
    profile = Profile.load(args.profile)
    tm = timing(program, profile)
    sim = simulate(program.schedule, links_of(program.graph),
                   together=program.rank_map.tile_groups(), timing=tm)
    plan = program.plan
    print(f"predicted step on {profile.name!r}: {sim.makespan:.4f} s, bubble {sim.bubble:.1%}")
    split = split_keys(program.schedule.values())
    for s, st in tm.stages.items():
        back = f"B {st.b / 2 * 1e3:.3f} ms, W {st.b / 2 * 1e3:.3f} ms" if split else \
            f"B {st.b * 1e3:.3f} ms"
        comm = f"halos and statistics {st.comm_f * 1e3:.3f} ms each way" if not st.sent_f \
            else (f"halos, statistics and attention over the tiles {st.comm_f * 1e3:.3f} ms "
                  f"forward, {st.comm_b * 1e3:.3f} ms backward; {nbytes(st.sent_f)} / "
                  f"{nbytes(st.sent_b)} sent")
        print(f"  stage {s}: F {st.f * 1e3:.3f} ms, {back} per micro-batch ({comm})")
    if args.timeline is None:
        return
    title = (f"{args.model}: {plan.schedule}, {plan.stages} stage(s), {plan.microbatches} "
             f"micro-batch(es), {program.world_size} rank(s)")
    predicted = draw.bars_from_sim(sim)
    if args.from_metrics is not None:
        measured = draw.bars_from_metrics(load_metrics(args.from_metrics))
        draw.comparison_figure(predicted, measured, title, "seconds").savefig(args.timeline,
                                                                             dpi=110)
        print(f"wrote {args.timeline} (predicted on {profile.name!r} above "
              f"{args.from_metrics})")
        return
    draw.draw_timeline(predicted, args.timeline, f"{title} (predicted on {profile.name!r})",
                       "predicted seconds")
    print(f"wrote {args.timeline} (predicted timeline of {program.world_size} rank(s))")


def _uninitialised(name: str, module: nn.Module) -> None:
    """fxpar-inspect's ``init``: leave a materialised module's memory as it is."""


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        return _main(args)
    except (ModelSpecError, TraceError, PlanError, ValueError, TypeError,
            draw.PictureError, OSError, ProfileError, AutoUsageError) as e:
        print(f"fxpar-inspect: error: {e}", file=sys.stderr)
        return 2


def _main(args: argparse.Namespace) -> int:
    _check_args(args)
    if args.from_metrics is not None and args.profile is None:
        metrics = load_metrics(args.from_metrics)
        draw.draw_timeline(draw.bars_from_metrics(metrics), args.timeline,
                           f"{metrics.get('model', '')}: last step of a real run on "
                           f"{len(metrics['ranks'])} rank(s)",
                           "seconds since the step's start on each rank")
        print(f"wrote {args.timeline} (timeline of {args.from_metrics})")
        return 0
    views = _views(args)
    dumps: dict[str, str] = {}

    def after_pass(name: str, gm: fx.GraphModule) -> None:
        if name == args.after:  # passes annotate in place: render now, not at the end
            dumps[name] = dump(name, gm, args.code)

    kwargs = parse_kwargs(args.model_arg)
    if args.num_classes is not None:
        kwargs["num_classes"] = args.num_classes
    model = build_model(args.model, meta=True, **kwargs)  # no parameter memory
    dtype = getattr(torch, args.dtype)
    model = model.to(dtype)
    size = args.image_size
    if isinstance(size, int):
        size = (size,) * (3 if args.grid is not None and len(args.grid) == 3 else 2)
    shape = (args.batch_size, args.channels, *size)
    example = torch.empty(shape, dtype=dtype, device="meta")
    start = time.perf_counter()
    program = None
    if args.auto:
        check_no_layout(args, INSPECT_DEFAULTS)
        found = plan_auto(model, example, args.world_size, args.memory_per_rank,
                          args.profile or DEFAULT_PROFILE, max_stages=args.max_stages)
        print(f"model: {args.model}  input: {'x'.join(map(str, shape))} {args.dtype}")
        print(found.report())
        return 0
    if not views and args.stages is None and args.spatial_parts == 1 and args.grid is None \
            and not args.gems and args.data_parallel == 1 and args.precision == "fp32" \
            and args.recompute_segments == 1 and args.halo_fusion == "off":
        gm = trace(model, example)
    else:
        balance = tuple(int(b) for b in args.balance.split(",")) if args.balance else None
        plan = Plan(stages=args.stages or 1, balance=balance,
                    microbatches=args.microbatches, schedule=args.schedule,
                    stages_per_rank=args.stages_per_rank,
                    spatial_parts=args.spatial_parts, slice=args.slice, grid=args.grid,
                    spatial_stages=args.spatial_stages, gems=args.gems,
                    gems_times=args.times, data_parallel=args.data_parallel,
                    recompute=args.recompute, memory_per_rank=args.memory_per_rank,
                    recompute_segments=args.recompute_segments,
                    channels_last=args.channels_last, precision=args.precision,
                    halo_fusion=args.halo_fusion)
        # the model is on meta; inspecting never computes with weights, so a rank's modules
        # get memory without values (no reset_parameters: a module with none is fine here)
        program = fx_compile(model, plan, example, after_pass=after_pass,
                             init=_uninitialised)
        assert program.traced is not None
        gm = program.traced
    took = time.perf_counter() - start
    per = "" if program is None else f" (per micro-batch of {shape[0] // program.plan.chunks()})"
    print(f"model: {args.model}  input: {'x'.join(map(str, shape))} {args.dtype}  "
          f"nodes: {len(gm.graph.nodes)}  (traced and analysed in {took:.2f} s){per}")
    if program is not None and views:
        _print_views(args, program, dumps)
    else:
        _print_report(gm, program)
    return 0


def _print_report(gm: fx.GraphModule, program: Program | None) -> None:
    """The default output: node table, totals; with a plan, its tiles, ranks, stages and
    schedule."""
    print(node_table(gm))
    print(totals_line(gm))
    if program is None:
        return
    plan = program.plan
    if program.spatial is not None:
        print()
        print(halo_table(program))
    if program.world_size > 1:
        print(f"\nrank map ({program.world_size} ranks):")
        print(rank_table(program))
    if plan.stages > 1:
        print(f"\nstages: {plan.stages} on {program.world_size} ranks")
        print(stage_table(gm, program.graph))
    if plan.stages > 1 or plan.gems:
        print(f"\nschedule: {plan.schedule}, {plan.microbatches} micro-batches"
              f"{', GEMS x2 copies' if plan.gems else ''} (one training step, step x rank)")
        print(format_grid(program.schedule))
        sim = simulate(program.schedule, links_of(program.graph),
                       together=program.rank_map.tile_groups())
        formula, value = bubble_formula(plan.schedule, plan.stages, plan.microbatches,
                                        plan.stages_per_rank)
        print(f"simulated bubble ({_tick_costs(split_keys(program.schedule.values()))} ticks): "
              f"{sim.bubble:.1%}; one copy's formula {formula} = {value:.1%}")


def _tick_costs(split: frozenset[tuple[int, int, int]]) -> str:
    """The simulator's unit costs: a backward split into B (input gradients) and W (weight
    gradients) costs one tick each."""
    return "F=1, B=1, W=1" if split else "F=1, B=2"


def bubble_formula(schedule: str, p: int, m: int, per_rank: int = 1) -> tuple[str, float]:
    """The published idle fraction of one copy's schedule of ``p`` stages (``per_rank`` on
    each pipeline rank) with m micro-batches, as text and value: the schedule's own entry
    (fxpar.core.schedule.SCHEDULES, ``bubble`` over p / per_rank pipeline ranks)."""
    return SCHEDULE_RULES[schedule].bubble(p // per_rank, m, per_rank)

if __name__ == "__main__":
    sys.exit(main())
