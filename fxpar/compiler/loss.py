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

import torch
from torch import fx

from fxpar.core.geometry import Grid
from fxpar.core.plan import PlanError
from fxpar.frontend.loss import CALLS_KEY, LossCaptureError, TensorSpec, capture_loss
from fxpar.frontend.rules.dims import NoRule, propagate
from fxpar.passes.tile_loss import tile_loss
from fxpar.program.tileloss import joined_loss
from fxpar.runtime.loop import LossTiles
from fxpar.runtime.spatial.lossops import image_layout
from fxpar.runtime.spatial.ops import group_key


class LossWarning(UserWarning):
    """A loss on a tiled output that fxpar computes on the joined output (see module doc)."""


def tiled_loss(loss_fn: Callable[..., torch.Tensor], grid: Grid, stage: int, strict: bool,
               output: TensorSpec, targets: Sequence[TensorSpec],
               warn: bool = True, captured: fx.GraphModule | None = None) -> LossTiles:
    """How each tile computes ``loss_fn(output, *targets)`` (specs: one micro-batch, global
    shapes) on the tiles of spatial stage ``stage``'s output.

    captured: ``capture_loss(loss_fn, output, targets)`` made before, to analyse one loss on
    several grids without capturing it again (it is not changed here)."""
    extent = tuple(output[0][2:])
    layouts = [image_layout(s, extent) for s, _ in (output, *targets)]
    sliced = tuple(lay is not None for lay in layouts[1:])
    calls: tuple[tuple[str, str], ...] = ()
    try:
        gm = captured if captured is not None else capture_loss(loss_fn, output, targets)
        calls = gm.meta.get(CALLS_KEY, ())
        prop = propagate(gm, extent, grid.parts, layouts)
    except (LossCaptureError, NoRule) as e:
        reason = _why(e, getattr(loss_fn, "__name__", type(loss_fn).__name__), calls)
        if strict:
            raise PlanError(f"{reason}; Plan(strict=True) refuses to join the output (strict="
                            f"False computes the loss on the joined output, exactly)") from e
        if warn:
            warnings.warn(f"the loss runs on the whole output, joined on every rank of the "
                          f"tile group (exact, but not spread): {reason}", LossWarning,
                          stacklevel=3)
        return joined_loss(loss_fn, grid, extent, stage, sliced, reason)
    return LossTiles(functools.partial(_tiles, gm, prop, grid, extent, stage), sliced)


class LossFactory:
    """:func:`tiled_loss` for one compiled program, made once per output and target shapes
    (the compiler's check of an example target, then every rank program of the process)."""

    def __init__(self, loss_fn: Callable[..., torch.Tensor], grid: Grid, stage: int,
                 strict: bool) -> None:
        self.loss_fn, self.grid, self.stage, self.strict = loss_fn, grid, stage, strict
        self._made: dict[tuple[TensorSpec, ...], LossTiles] = {}

    def __call__(self, output: TensorSpec, targets: Sequence[TensorSpec],
                 warn: bool = True) -> LossTiles:
        key = (output, *targets)
        if key not in self._made:
            self._made[key] = tiled_loss(self.loss_fn, self.grid, self.stage, self.strict,
                                         output, targets, warn)
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
