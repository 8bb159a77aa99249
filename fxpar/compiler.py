"""``fxpar.compile``: the recipe trace -> analyze -> passes -> schedule -> emit."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from fxpar.plan import Plan, PlanError, RankMap
from fxpar.program import OptimizerFactory, Program
from fxpar.runtime import LossFn
from fxpar.schedule import single_rank
from fxpar.trace import trace


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
        shapes and dtypes are read, so a 16384x16384 image costs no memory here.
    loss_fn: ``loss_fn(output, target)``, the mean over its batch (as ``F.cross_entropy``).
    optimizer: ``optimizer(params) -> torch.optim.Optimizer``; None computes gradients only.
    leaf_modules: module types to keep opaque (not traced into).

    The program's modules share parameters with ``model``: training the program trains it.
    """
    plan = plan if plan is not None else Plan()
    if example_input is None:
        raise TypeError("fxpar.compile needs example_input: a batch or its shape, e.g. "
                        "(8, 3, 1024, 1024); a meta tensor avoids allocating it")
    gm = trace(model, example_input, leaf_modules=leaf_modules)
    if plan.world_size != 1 or plan.gems:
        raise PlanError(f"this fxpar build runs single-rank plans only; {plan} needs "
                        f"layer/pipeline/spatial/GEMS/data parallelism")
    return Program(plan=plan, rank_map=RankMap(plan), stages=(gm,),
                   schedule=single_rank(plan.microbatches), loss_fn=loss_fn,
                   optimizer=optimizer)
