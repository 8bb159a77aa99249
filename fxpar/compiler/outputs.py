"""The model output's leaves in the compiled graph (fxpar.core.outputs): each one's layout at
the end of the spatial stages, and the structures a plan cannot carry, refused at compile
time with the leaf named, never at the first step."""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import fx, nn

from fxpar.core import meta
from fxpar.core.meta import TensorInfo
from fxpar.core.outputs import OUT_SPEC, leaf_names, pick, register_types
from fxpar.core.plan import Plan, PlanError
from fxpar.passes.spatial_region import SpatialLayout
from fxpar.passes.split_stages import model_output


class OutputWarning(UserWarning):
    """A leaf of the model output that a plan carries, but not as one process returns it."""


def output_leaves(gm: fx.GraphModule) -> list[Any]:
    """The model output's leaves in order: nodes, or the constants export kept (an int)."""
    packed = next(n for n in gm.graph.nodes if n.target is model_output)
    out = packed.args[0]
    return list(out) if gm.meta.get(OUT_SPEC) is not None else [out]


def leaf_extent(n: Any) -> tuple[int, ...] | None:
    """A leaf's image size when it leaves the spatial region tiled, else None (whole on
    every rank of the tile group: a class head on pooled features)."""
    lay = meta.find(n, SpatialLayout) if isinstance(n, fx.Node) else None
    if lay is None or not lay.tiled:
        return None
    return tuple(meta.get(n, TensorInfo).shape[2:])


def check_outputs(gm: fx.GraphModule, plan: Plan, loss_on_tiles: bool) -> None:
    """PlanError for a leaf the loss on tiles cannot take (a constant: the tiles' loss is
    captured over tensors); an :class:`OutputWarning` for a leaf without a batch dim under a
    plan that cuts the batch (``forward`` returns it once per chunk, stacked)."""
    names = leaf_names(gm.meta.get(OUT_SPEC))
    mb = None
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            mb = meta.get(n, TensorInfo).shape[0]
            break
    for leaf, name in zip(output_leaves(gm), names, strict=True):
        what = f"the model output's leaf {name or '(the output)'}"
        if not isinstance(leaf, fx.Node):
            if loss_on_tiles:
                raise PlanError(f"{what} is {leaf!r} ({type(leaf).__name__}), not a tensor: the "
                                f"loss of a tiled output is captured over tensor leaves; return "
                                f"it as a tensor or leave it out of the output")
            continue
        shape = meta.get(leaf, TensorInfo).shape
        if plan.chunks() > 1 and (not shape or shape[0] != mb):
            warnings.warn(f"{what} has shape {tuple(shape)}, without the batch dim first: this "
                          f"plan cuts the batch into {plan.chunks()} chunks and forward() "
                          f"returns it once per chunk, stacked (one process returns one for "
                          f"the whole batch)", OutputWarning, stacklevel=4)


class OutputLeaf(nn.Module):
    """``model`` returning the one leaf ``key`` of its output names (fxpar.core.outputs.pick:
    ``out``, ``['out']``, ``[0]``, ``.mask``): what ``fxpar.predict(..., output_key=KEY)`` and
    ``fxpar-predict --output-key KEY`` compile for a model that returns a structure."""

    def __init__(self, model: nn.Module, key: str) -> None:
        super().__init__()
        self.model, self.key = model, key
        self.train(model.training)  # the model's mode, not a new module's

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.model(x)
        register_types(out)
        leaves, spec = pytree.tree_flatten(out)
        return leaves[pick(spec, self.key)]


def check_single(gm: fx.GraphModule) -> None:
    """PlanError when a model to predict with returns a structure: name its leaves."""
    spec = gm.meta.get(OUT_SPEC)
    if spec is not None:
        raise PlanError(f"the model returns {spec.num_leaves} tensors (its leaves: "
                        f"{', '.join(leaf_names(spec))}): choose the one to write with "
                        f"output_key= (fxpar-predict --output-key KEY, e.g. "
                        f"{leaf_names(spec)[0]!r})")
