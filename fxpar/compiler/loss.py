"""The loss of a tiled output: captured with the model's layout, or the output joined.

When the model's output leaves the spatial region tiled (segmentation), each rank holds its
tile of the output and of the per-pixel targets. ``loss_fn(output, *targets)`` is then
captured (fxpar.frontend.loss), its layouts propagated (fxpar.frontend.rules.dims) and
rewritten per tile (fxpar.passes.tile_loss): every sum, mean and count over the image becomes
a partial on the tile and one allreduce, so Dice, Tversky, ``ignore_index``, class weights
and masked means equal the loss of the whole output (the contract, DESIGN.md). A loss that
cannot be captured, or uses an op without a tile rule, is computed on the joined output
instead (exact, but every rank of the group holds the whole output): a :class:`LossWarning`
names the op and its source line, and ``Plan(strict=True)`` raises ``PlanError``.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import fx

from fxpar.core.geometry import Grid
from fxpar.core.plan import PlanError
from fxpar.frontend.loss import CALLS_KEY, LossCaptureError, TensorSpec, capture_loss
from fxpar.frontend.rules.dims import NoRule, propagate
from fxpar.passes.tile_loss import tile_loss
from fxpar.program.tileloss import joined_loss
from fxpar.runtime.loop import LossTiles
from fxpar.runtime.spatial.lossops import image_layout, loss_axes, target_extent
from fxpar.runtime.spatial.ops import group_key


class LossWarning(UserWarning):
    """A loss on a tiled output that fxpar computes on the joined output (see module doc)."""


def tiled_loss(loss_fn: Callable[..., torch.Tensor], grid: Grid, stage: int, strict: bool,
               output: TensorSpec | Sequence[TensorSpec], targets: Sequence[TensorSpec],
               warn: bool = True, captured: fx.GraphModule | None = None,
               extents: Sequence[tuple[int, ...] | None] | None = None,
               spec: Any = None) -> LossTiles:
    """How each tile computes ``loss_fn(output, *targets)`` (specs: one micro-batch, global
    shapes) on the tiles of spatial stage ``stage``'s output.

    output: the spec of one tensor, or of each leaf of the output in order (fxpar.core.outputs;
    ``spec`` is then the structure the loss receives); extents: per leaf, its image size when
    it is tiled, None when it is whole on every rank (a class head); default: every leaf is
    tiled at its own size. Leaves of several image sizes (deep supervision) each get grid axes
    of their own (fxpar.runtime.spatial.lossops.loss_axes), and a target is cut at the first
    size it is per-pixel at.
    captured: ``capture_loss(loss_fn, output, targets, spec=spec)`` made before, to analyse one
    loss on several grids without capturing it again (it is not changed here)."""
    single = len(output) == 2 and isinstance(output[1], torch.dtype)
    leaves = (output,) if single else tuple(output)
    sizes_of = tuple(extents) if extents is not None else tuple(
        tuple(s[2:]) for s, _ in leaves)  # type: ignore[misc]
    sizes = loss_axes(sizes_of)
    nd = grid.ndim
    layouts = [None if e is None else image_layout(s, e, nd * sizes.index(e))
               for (s, _), e in zip(leaves, sizes_of, strict=True)]
    cut = [target_extent(tuple(s), sizes) for s, _ in targets]
    layouts += [None if e is None else image_layout(tuple(s), e, nd * sizes.index(e))
                for (s, _), e in zip(targets, cut, strict=True)]
    extent = tuple(v for e in sizes for v in e)
    parts = tuple(grid.parts) * len(sizes)
    calls: tuple[tuple[str, str], ...] = ()
    try:
        gm = captured if captured is not None else capture_loss(
            loss_fn, leaves if spec is not None else leaves[0], targets, spec=spec)
        calls = gm.meta.get(CALLS_KEY, ())
        prop = propagate(gm, extent, parts, layouts)
    except (LossCaptureError, NoRule) as e:
        reason = _why(e, getattr(loss_fn, "__name__", type(loss_fn).__name__), calls)
        if strict:
            raise PlanError(f"{reason}; Plan(strict=True) refuses to join the output (strict="
                            f"False computes the loss on the joined output, exactly)") from e
        if warn:
            warnings.warn(f"the loss runs on the whole output, joined on every rank of the "
                          f"tile group (exact, but not spread): {reason}", LossWarning,
                          stacklevel=3)
        return joined_loss(loss_fn, grid, sizes_of, stage, tuple(cut), reason, spec)
    return LossTiles(functools.partial(_tiles, gm, prop, grid, extent, stage),
                     tuple(e is not None for e in cut), "", tuple(e for e in cut if e is not None))


class LossFactory:
    """:func:`tiled_loss` for one compiled program, made once per output and target shapes
    (the compiler's check of an example target, then every rank program of the process)."""

    def __init__(self, loss_fn: Callable[..., torch.Tensor], grid: Grid, stage: int,
                 strict: bool, extents: Sequence[tuple[int, ...] | None] | None = None,
                 spec: Any = None) -> None:
        self.loss_fn, self.grid, self.stage, self.strict = loss_fn, grid, stage, strict
        self.extents, self.spec = extents, spec
        self._made: dict[tuple[Any, ...], LossTiles] = {}

    def __call__(self, output: TensorSpec | Sequence[TensorSpec], targets: Sequence[TensorSpec],
                 warn: bool = True) -> LossTiles:
        key = (tuple(output), *targets)
        if key not in self._made:
            self._made[key] = tiled_loss(self.loss_fn, self.grid, self.stage, self.strict,
                                         output, targets, warn, extents=self.extents,
                                         spec=self.spec)
        return self._made[key]


def _tiles(gm: fx.GraphModule, prop: object, grid: Grid, extent: tuple[int, ...], stage: int,
           tile: int, copy: int) -> torch.nn.Module:
    return tile_loss(gm, prop, grid, extent, tile, group_key(stage, copy))  # type: ignore[arg-type]


def _why(e: Exception, loss: str, calls: tuple[tuple[str, str], ...] = ()) -> str:
    """What stops ``loss`` running on tiles: the op, the line of the loss that called it (the
    first call of a torch function of that name), why."""
    node = getattr(e, "node", None)
    if node is None:
        return str(e)
    op = getattr(node.target, "overloadpacket", node.target)
    name = getattr(op, "__name__", str(op))
    at = next((line for fn, line in calls if fn.strip("_") == name.strip("_") and line), "")
    return f"aten.{name} in the loss {loss}{f' ({at})' if at else ''}: {e}"
