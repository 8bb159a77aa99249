"""``fxpar.compile``: the recipe trace -> analyze -> passes -> schedule -> emit."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from fxpar.passdriver import run_passes
from fxpar.plan import Plan, PlanError, RankMap
from fxpar.program import OptimizerFactory, Program
from fxpar.runtime import LossFn
from fxpar.schedule import Links, pipeline
from fxpar.stages import StageGraph, build_stages
from fxpar.trace import trace
from passes.split_stages import split_stages

PASSES = [("split_stages", split_stages)]


def links_of(graph: StageGraph) -> Links:
    """Which stages each stage sends to (from the transfers)."""
    links: Links = {s: set() for s in range(len(graph.modules))}
    for t in graph.transfers:
        links[t.src].add(t.dst)
    return links


def compile(  # noqa: A001 - the public name the design fixes
    model: nn.Module,
    plan: Plan | None = None,
    example_input: torch.Tensor | Sequence[int] | None = None,
    *,
    loss_fn: LossFn = F.cross_entropy,
    optimizer: OptimizerFactory | None = None,
    leaf_modules: Sequence[type[nn.Module]] = (),
) -> Program:
    """Compile ``model`` for ``plan``.

    example_input: one global batch (real, ``meta`` or fake tensor, or just its shape); only
        shapes and dtypes are read, so a 16384x16384 image costs no memory here. Multi-rank
        programs train on global batches of exactly this size.
    loss_fn: ``loss_fn(output, target)``, the mean over its batch (as ``F.cross_entropy``).
    optimizer: ``optimizer(params) -> torch.optim.Optimizer``; None computes gradients only.
    leaf_modules: module types to keep opaque (not traced into).

    The program's modules share parameters with ``model``: training the program trains it.
    """
    plan = plan if plan is not None else Plan()
    if example_input is None:
        raise TypeError("fxpar.compile needs example_input: a batch or its shape, e.g. "
                        "(8, 3, 1024, 1024); a meta tensor avoids allocating it")
    if plan.spatial or plan.gems or plan.data_parallel > 1:
        raise PlanError(f"this fxpar build runs layer and pipeline parallelism only; {plan} "
                        f"needs spatial/GEMS/data parallelism")
    shape = tuple(example_input.shape if isinstance(example_input, torch.Tensor)
                  else example_input)
    plan.check_batch(int(shape[0]))
    mb_shape = (shape[0] // plan.chunks(), *shape[1:])
    if isinstance(example_input, torch.Tensor):
        example = torch.empty(mb_shape, dtype=example_input.dtype, device="meta")
    else:
        example = torch.empty(mb_shape, device="meta",
                              dtype=next((p.dtype for p in model.parameters()), torch.float32))
    gm = trace(model, example, leaf_modules=leaf_modules)  # shapes are per micro-batch
    gm = run_passes(gm, plan, PASSES)
    graph = build_stages(gm)
    schedule = pipeline(plan.stages, plan.microbatches, plan.schedule, links_of(graph))
    return Program(plan=plan, rank_map=RankMap(plan), graph=graph, schedule=schedule,
                   loss_fn=loss_fn, optimizer=optimizer, batch_size=int(shape[0]),
                   names=tuple(model.state_dict().keys()), traced=gm)
