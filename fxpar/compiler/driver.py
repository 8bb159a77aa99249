"""``fxpar.compile``: the recipe trace -> analyze -> passes -> schedule -> emit."""

from __future__ import annotations

import copy
import dataclasses
import functools
import operator
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx, nn

from fxpar.comm.protocol import Comm
from fxpar.compiler.loss import LossFactory
from fxpar.compiler.outputs import OutputLeaf, check_outputs, leaf_extent, output_leaves
from fxpar.compiler.passdriver import HALO, run_passes
from fxpar.compiler.predict import Prediction, predict_regions
from fxpar.compiler.stages import build_stages
from fxpar.compiler.windows import rank_windows
from fxpar.core import meta
from fxpar.core.geometry import Grid
from fxpar.core.lowering import lower
from fxpar.core.messages import check_tags, tag_uses
from fxpar.core.meta import TensorInfo
from fxpar.core.options import setting
from fxpar.core.outputs import OUT_SPEC
from fxpar.core.plan import Plan, PlanError, RankMap
from fxpar.core.roles import chunks_per_copy, stage_groups
from fxpar.core.schedule import Links, Schedule, pipeline, place
from fxpar.core.stages import StageGraph
from fxpar.core.stages import links_of as links_of  # re-exported: inspect, draw, tools
from fxpar.core.wire import agreed_order
from fxpar.frontend.capture import where
from fxpar.frontend.rules.perpixel import mixes_samples
from fxpar.frontend.share import CaptureCache, shared_trace
from fxpar.frontend.trace import check_model
from fxpar.passes.halo import tile_stage
from fxpar.passes.precision import precision
from fxpar.passes.spatial_region import (
    Coverage,
    image_grid,
    limit_region,
    spatial_region,
)
from fxpar.passes.split_stages import split_stages
from fxpar.perf.memory import choose_recompute
from fxpar.perf.simulate import interleave
from fxpar.program.program import OptimizerFactory, Program, SpatialInfo
from fxpar.runtime.loop import LossFn
from fxpar.runtime.materialize import InitFn, meta_model_of
from fxpar.runtime.recompute import recomputed_stages
from fxpar.runtime.spatial.ops import group_key
from fxpar.runtime.spatial.tags import max_tag, tag_owners
from fxpar.runtime.sync import sync_problems

PASSES = [("precision", precision), ("spatial_region", spatial_region),
          ("split_stages", split_stages), ("limit_region", limit_region)]
"""Whole-graph passes, in order."""


def halo(stage: fx.GraphModule, plan: Plan, *, grid: Grid, tile: int, key: str,
         batch: set[int]) -> fx.GraphModule:
    """The halo pass: ``stage`` rewritten for ``tile`` of ``grid`` (fxpar.passes.halo.tile_stage):
    halo exchanges, tile ops, BatchNorm sync and joins in tile group ``key``; ``batch``:
    positions of the stage's inputs that are the model input."""
    return tile_stage(stage, grid, tile, key, batch, plan.halo_fusion)


TILE_PASSES = [(HALO, halo)]
"""Passes on one spatial stage's module, once per (stage, tile, copy), after PASSES and the
stage split. The compiler runs them for tile 0 of each spatial stage (its tags are checked);
the other tiles go through the same driver on first use, on the rank that runs them (tiling
all 64 tiles of ResNet-152 at 16384^2 took 11.3 s, its whole compile 2.8 s, tile 0 0.14 s)."""


def tile_stages(gm: fx.GraphModule, graph: StageGraph, plan: Plan) -> SpatialInfo:
    """How to build each tile's rewritten stage module; what the loss needs to know."""
    grid = image_grid(gm)

    def build(s: int, t: int, copy: int = 0) -> fx.GraphModule:
        batch = {i for i, src in enumerate(graph.inputs[s]) if src.source == "batch"}
        passes = [(name, functools.partial(fn, grid=grid, tile=t, key=group_key(s, copy),
                                           batch=batch))
                  for name, fn in TILE_PASSES]
        return run_passes(graph.modules[s], plan, passes, first=None,
                          where=f"stage {s}, tile {t}, copy {copy}")

    extents = tuple(leaf_extent(n) for n in output_leaves(gm))
    first = next((e for e in extents if e is not None), (0,) * grid.ndim)
    return SpatialInfo(build, grid, plan.spatial_stages, any(e is not None for e in extents),
                       first, extents)


def check_sync(graph: StageGraph, rank_map: RankMap) -> None:
    """Raise PlanError when a stage whose gradients are summed over several ranks (or GEMS
    copies) cannot be (fxpar.runtime.sync.sync_problems): at compile time, not at the first
    ALLREDUCE."""
    plan = rank_map.plan
    for s, ranks in stage_groups(rank_map).items():
        if len(ranks) > 1 or plan.copies > 1:
            for problem in sync_problems([graph.modules[s]], f"stage {s}"):
                raise PlanError(problem)


COVERAGE_WARN = 0.9
"""A spatial plan whose tiles run less than this share of the spatial stages' forward FLOPs
warns (raises with ``Plan(strict=True)``)."""


class CoverageWarning(UserWarning):
    """A spatial plan that spreads less of the model's work over the tiles than it could."""


def check_coverage(gm: fx.GraphModule, plan: Plan) -> None:
    """Warn (or, with ``plan.strict``, raise) when the spatial region covers too little."""
    cov = gm.meta.get(Coverage.KEY)
    if not plan.spatial or cov is None or cov.share >= COVERAGE_WARN:
        return
    most = f"; the most: {cov.replicated[0][0]}" if cov.replicated else ""
    msg = (f"the spatial region runs only {cov.share:.0%} of the spatial stages' forward "
           f"FLOPs on tiles (the rest runs whole on every rank of the tile group{most}): "
           f"{cov.ended or 'it ends early'}")
    if plan.strict:
        raise PlanError(msg + " (Plan(strict=True); strict=False makes this a warning)")
    warnings.warn(msg, CoverageWarning, stacklevel=3)


class BatchWarning(UserWarning):
    """A model op that mixes the samples of a batch, under a plan that cuts the batch."""


def check_batch_ops(gm: fx.GraphModule, plan: Plan) -> None:
    """Warn when the model reduces, scans or picks along the batch dim (``x.mean(0)``) and the
    plan cuts each batch into chunks: each chunk sees its own samples only (the contract, as
    for BatchNorm's statistics), where one device on the whole batch sees them all."""
    mixing = [n for n in gm.graph.nodes if mixes_samples(n)]
    if not mixing or plan.chunks() == 1:
        return
    warnings.warn(
        f"{len(mixing)} op(s) work along the batch dim, the first {mixing[0].target} "
        f"({where(mixing[0])}): this plan cuts each batch into {plan.chunks()} chunks "
        f"(data parallelism x GEMS copies x micro-batches) and each sees only its own "
        f"samples, as with one device trained on those chunks in turn; one device on the whole "
        f"batch would mix all of them", BatchWarning, stacklevel=3)


def example_shape(example: torch.Tensor | Sequence[int] | None) -> tuple[int, ...]:
    """The shape of ``compile``'s example input, checked: batch first, every size >= 1."""
    if example is None:
        raise TypeError("fxpar.compile needs example_input: a batch or its shape, e.g. "
                        "(8, 3, 1024, 1024); a meta tensor avoids allocating it")
    try:
        if isinstance(example, str):
            raise TypeError(example)
        dims = example.shape if isinstance(example, torch.Tensor) else example
        shape = tuple(operator.index(s) for s in dims)
    except TypeError:
        raise TypeError(f"example_input must be a tensor or a shape of integers such as "
                        f"(8, 3, 1024, 1024), got {example!r}") from None
    if not shape or min(shape) < 1:
        raise ValueError(f"example_input has shape {shape}: give the global batch's shape, "
                         f"batch first, every size >= 1 (e.g. (8, 3, 1024, 1024))")
    return shape


def rank_schedules(rank_map: RankMap, links: Links, sync: bool | None = None) -> Schedule:
    """Every rank's action list: each copy's pipeline over ``links``, a rank's roles merged
    into one order (tile groups meet in one order), then ALLREDUCE when gradients are summed
    (``sync``; None: when the plan needs it) and STEP."""
    plan = rank_map.plan
    per_copy = {c: pipeline(plan.stages, chunks_per_copy(plan), plan.schedule, links, copy=c,
                            per_rank=plan.stages_per_rank)
                for c in range(plan.copies)}  # keyed by pipeline rank (Plan.position)
    roles = [list(dict.fromkeys((r.copy, plan.position(r.stage)) for r in rank_map.roles_of(k)))
             for k in range(plan.world_size)]
    if sync is None:  # gradients to sum: a stage on several ranks, or one rank in both copies
        sync = plan.copies > 1 or any(len(g) > 1 for g in stage_groups(rank_map).values())
    together = rank_map.tile_groups()
    return place(per_copy, roles, sync,
                 lambda queues: interleave(queues, links, together=together))


def as_plan(plan: object) -> Plan:
    """``plan`` as a Plan: a Plan, None (one rank, ``Plan()``), or what ``fxpar.plan_auto``
    returns (an AutoPlan: its chosen plan, the one it ranked first)."""
    if plan is None:
        return Plan()
    chosen = plan if isinstance(plan, Plan) else getattr(plan, "plan", None)
    if not isinstance(chosen, Plan):
        raise TypeError(f"fxpar.compile needs plan=fxpar.Plan(...) or what fxpar.plan_auto "
                        f"returns, got {type(plan).__name__}: build one with "
                        f"fxpar.Plan(**fields)")
    return chosen


def compile(  # noqa: A001 - the public name the design fixes
    model: nn.Module,
    plan: Plan | Any = None,
    example_input: torch.Tensor | Sequence[int] | None = None,
    *,
    loss_fn: LossFn = F.cross_entropy,
    target: Any = None,
    optimizer: OptimizerFactory | None = None,
    init: InitFn | None = None,
    seed: int = 0,
    after_pass: Callable[[str, fx.GraphModule], None] | None = None,
    comm: Comm | None = None,
    captures: CaptureCache | None = None,
) -> Program:
    """Compile ``model`` for ``plan``.

    example_input: one global batch (real, ``meta`` or fake tensor, or just its shape); only
        shapes and dtypes are read, so a 16384x16384 image costs no memory here. Multi-rank
        programs train on global batches of exactly this size.
    loss_fn: ``loss_fn(output, *targets)``, the loss the model trains with (cross-entropy, a
        MONAI or smp loss, a masked mean...): ``train_step(x, y)`` calls it with ``y``, or with
        ``*y`` when ``y`` is a tuple of tensors (a target and a mask). On a tiled output it is
        captured and its sums and means run over the tiles (fxpar.compiler.loss); one that
        cannot be, runs on the joined output with a LossWarning (PlanError under
        ``Plan(strict=True)``).
    target: an example of the global batch's targets (a tensor, meta or fake, or a tuple of
        them; only shapes and dtypes are read): the loss is then captured and checked here
        instead of at the first step.
    optimizer: ``optimizer(params) -> torch.optim.Optimizer``; None computes gradients only.
    init, seed: for a model built on the ``meta`` device, each rank materialises only its own
        stages' modules (in ``program.for_rank``), each by ``reset_parameters()`` -- or
        ``init(qualified_name, module)`` when given -- under a seed from ``seed`` and the
        module's name; ``fxpar.runtime.materialize.materialize_model(model, seed, init)`` gives the
        same values on one process.
    after_pass: ``after_pass(name, gm)`` sees the graph right after tracing ("trace") and
        after each pass of ``PASSES`` (``fxpar-inspect --after`` prints it there), then
        ("halo") tile 0's module of each spatial stage.
    comm: the ranks that compile this program together, each from its own copy of the same
        model (a collective over them): rank 0 captures the model and sends the traced graph to
        the others (fxpar.frontend.share), instead of every rank capturing it -- most of a
        compile, done once per job where ranks share a node's cores. None: this process
        captures the model itself.
    captures: a :class:`fxpar.CaptureCache`: a model of the same structure as one compiled
        before with it, for an input of the same shape and dtype, is not captured again (rank 0
        looks it up, and sends it as above). None: one kept in the folder ``FXPAR_CAPTURE_CACHE``
        names, when set (fxpar.frontend.capture_store), else none.

    Before it returns, every rank's messages and collectives of one step are simulated
    together (fxpar.core.lowering, and fxpar.core.wire for the order NCCL issues them in): a
    schedule that would deadlock or cross its messages raises ScheduleError here; tags above
    MPI's guaranteed bound raise PlanError.

    The program's modules share parameters with ``model``: training the program trains it.
    """
    check_model(model)
    plan = as_plan(plan)
    shape = example_shape(example_input)
    plan.check_batch(shape[0])
    mb_shape = (shape[0] // plan.chunks(), *shape[1:])
    if isinstance(example_input, torch.Tensor):
        example = torch.empty(mb_shape, dtype=example_input.dtype, device="meta")
    else:
        example = torch.empty(mb_shape, device="meta",
                              dtype=next((p.dtype for p in model.parameters()), torch.float32))
    if captures is None and setting("capture_cache"):
        captures = CaptureCache(setting("capture_cache"))
    gm = shared_trace(model, example, comm, captures,  # shapes are per micro-batch
                      plan.to_json())
    gm = run_passes(gm, plan, PASSES, after=after_pass)
    check_coverage(gm, plan)
    check_batch_ops(gm, plan)
    graph = build_stages(gm)
    rank_map = RankMap(plan)
    check_sync(graph, rank_map)
    spatial = tile_stages(gm, graph, plan) if plan.spatial else None
    check_outputs(gm, plan, spatial is not None and spatial.out_tiled and
                  plan.spatial_stages == plan.stages)
    halo_tags = {}
    for s in range(plan.spatial_stages if spatial is not None else 0):
        tile0 = spatial.tile(s, 0)  # type: ignore[union-attr]
        halo_tags[s] = max_tag(tile0)
        tag_owners(tile0)  # each tile op's messages its own tags
        if after_pass is not None:
            after_pass(HALO, tile0)
    check_tags(tag_uses(plan, len(graph.transfers), halo_tags))
    schedule = rank_schedules(rank_map, links_of(graph))
    # matching and deadlock, every rank, with MPI's tags and in NCCL's issue order
    order = agreed_order(lower(schedule, graph, rank_map,
                               spatial.grid if spatial is not None else None), schedule)
    program = Program(plan=plan, rank_map=rank_map, graph=graph, schedule=schedule,
                      loss_fn=loss_fn, optimizer=optimizer, batch_size=int(shape[0]),
                      names=tuple(model.state_dict().keys()), traced=gm, spatial=spatial,
                      meta_model=meta_model_of(model, init), init=init, seed=seed,
                      input_windows=rank_windows(gm, graph, rank_map,
                                                 spatial.grid if spatial is not None else None),
                      recompute=recomputed_stages(plan.recompute, plan.stages),
                      predictor=functools.partial(predict, model, plan, loss_fn=loss_fn),
                      loss_tiles=loss_factory(gm, plan, loss_fn, spatial, target),
                      orders={None: order})
    if plan.recompute == "auto":
        assert plan.memory_per_rank is not None  # Plan validates it
        program = dataclasses.replace(program,
                                      recompute=choose_recompute(program, plan.memory_per_rank))
    return program


def loss_factory(gm: fx.GraphModule, plan: Plan, loss_fn: LossFn, spatial: SpatialInfo | None,
                 target: Any) -> LossFactory | None:
    """How a tiled output's tiles compute the loss (None when the output is not tiled); with
    an example ``target``, made and checked now (a LossWarning or PlanError at compile)."""
    if spatial is None or not spatial.out_tiled or plan.spatial_stages < plan.stages:
        return None
    factory = LossFactory(loss_fn, spatial.grid, plan.stages - 1, plan.strict,
                          spatial.out_extents, gm.meta.get(OUT_SPEC))
    if target is not None:
        infos = [meta.get(n, TensorInfo) for n in output_leaves(gm)]
        chunks = plan.chunks()
        examples = target if isinstance(target, (tuple, list)) else (target,)
        specs = tuple(((int(t.shape[0]) // chunks, *map(int, t.shape[1:])), t.dtype)
                      for t in examples)
        factory(tuple((tuple(i.shape), i.dtype) for i in infos), specs)
    return factory


def predict(model: nn.Module, plan: Plan, image: Any, out: str | Path | None = None,
            loss_fn: Callable[..., torch.Tensor] = F.cross_entropy, **kwargs: Any) -> Prediction:
    """``fxpar.predict``: run ``model`` over the whole ``image`` (C, H, W) or (C, D, H, W), an
    array or a reader of fxpar.data.images, region by region, each region compiled for ``plan``
    and spread over its ranks; the output equals the model on the whole image (see
    fxpar.compiler.predict, where the keyword arguments are: region, batch, output, dtype,
    comm, overwrite, progress, ...; ``output_key``: the leaf of a structured output to write,
    fxpar.core.outputs.pick). ``RankProgram.predict`` does the same with a trained program's
    model."""
    state = kwargs.pop("state", None)
    key = kwargs.pop("output_key", None)
    if state is not None:  # RankProgram.predict: the trained weights of every stage
        with torch.no_grad():
            current = model.state_dict()
            for name, value in state.items():
                if name in current:
                    current[name].copy_(value)
    dtype = kwargs.get("dtype", torch.float32)
    if any(p.dtype != dtype for p in model.parameters()):
        # the model the regions are compiled from, not only the one predict_regions checks
        # (a float32 model asked for float64 compiled float32 weights against float64 inputs)
        model = copy.deepcopy(model).to(dtype)
    if key is not None:  # after the weights: the wrapper's names are not the model's
        model = OutputLeaf(model, str(key))
    return predict_regions(model, plan, image, out, compile_crop=lambda example: compile(
        model, plan, example, loss_fn=loss_fn), **kwargs)
