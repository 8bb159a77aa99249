"""A rank program's loss on its tiles of a tiled output (the runtime's ``tile_loss``).

The first step that brings targets of a new shape asks the program how the tiles compute the
loss (``Program.loss_tiles``, fxpar.compiler.loss: the loss captured and rewritten per tile, or
the output joined), builds this rank's module for each (copy, tile) it holds, binds it to the
tile group and keeps it. A program without the compiler's factory (one loaded from disk) joins
the output: exact for any loss.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from fxpar.core.geometry import Grid, Rect
from fxpar.runtime.loop import LossFn, LossTiles, targets_of
from fxpar.runtime.spatial.lossops import JoinedLoss, loss_axes, target_extent
from fxpar.runtime.spatial.ops import group_key

Spec = tuple[tuple[int, ...], torch.dtype]
LossTilesFactory = Callable[..., LossTiles]
"""``(leaf specs, target specs, warn) -> LossTiles`` (fxpar.compiler.loss.tiled_loss with the
loss, grid, stage, strictness, the leaves' image sizes and the output's structure bound)."""


def joined_loss(loss_fn: LossFn, grid: Grid, leaves: tuple[tuple[int, ...] | None, ...],
                stage: int, targets: tuple[tuple[int, ...] | None, ...], reason: str,
                spec: Any = None) -> LossTiles:
    """The loss on the joined output of spatial stage ``stage``: every tiled leaf (``leaves``:
    each one's image size, None for a whole one) joined, and so every per-pixel target
    (``targets``: the size each is cut at, or None); exact for any loss (fxpar.compiler.loss's
    fallback, and a program loaded from disk)."""
    sliced = tuple(e is not None for e in targets)
    return LossTiles(functools.partial(_joined, loss_fn, grid, leaves, targets, stage, spec),
                     sliced, reason, tuple(e for e in targets if e is not None))


def _joined(loss_fn: LossFn, grid: Grid, leaves: tuple[tuple[int, ...] | None, ...],
            targets: tuple[tuple[int, ...] | None, ...], stage: int, spec: Any, tile: int,
            copy: int) -> nn.Module:
    def rects(e: tuple[int, ...] | None) -> tuple[Rect, ...] | None:
        return None if e is None else tuple(grid.tile_rect(e, u) for u in range(grid.size))

    return JoinedLoss(loss_fn, tuple(map(rects, leaves)), tile, group_key(stage, copy),
                      tuple(map(rects, targets)), spec)


class TileLoss:
    """``(copy, tile, output leaves on the tile, whole targets) -> loss`` for one rank
    program. extents: per leaf of the output, its image size when tiled (None: whole);
    spec: the output's structure (fxpar.core.outputs)."""

    def __init__(self, factory: LossTilesFactory | None, loss_fn: LossFn, grid: Grid,
                 extents: tuple[tuple[int, ...] | None, ...], stage: int,
                 device: Callable[[], torch.device], speaks: bool, spec: Any = None) -> None:
        self.factory, self.loss_fn, self.grid, self.extents = factory, loss_fn, grid, extents
        self.stage, self.device, self.speaks, self.spec = stage, device, speaks, spec
        self.plans: dict[tuple[Any, ...], LossTiles] = {}
        self.modules: dict[tuple[Any, ...], nn.Module] = {}

    def plan(self, leaves: tuple[Spec, ...], targets: tuple[Spec, ...]) -> LossTiles:
        """How the tiles compute the loss for these shapes (made once per shapes)."""
        key = (leaves, targets)
        if key not in self.plans:
            if self.factory is not None:
                self.plans[key] = self.factory(leaves, targets, warn=self.speaks)
            else:  # no compiler here: join the output and the per-pixel targets
                sizes = loss_axes(self.extents)
                self.plans[key] = joined_loss(
                    self.loss_fn, self.grid, self.extents, self.stage,
                    tuple(target_extent(s, sizes) for s, _ in targets),
                    "a program loaded from disk joins its output", self.spec)
        return self.plans[key]

    def __call__(self, copy: int, tile: int, leaves: tuple[torch.Tensor, ...],
                 target: Any) -> torch.Tensor:
        targets = targets_of(target)
        if not all(isinstance(t, torch.Tensor) for t in targets):
            raise TypeError(f"the loss of a tiled output takes tensors as targets (a tensor, or "
                            f"a tuple of tensors such as (target, mask)), got "
                            f"{[type(t).__name__ for t in targets]}")
        specs = tuple(((*x.shape[:x.dim() - len(e)], *e) if e is not None else tuple(x.shape),
                       x.dtype) for x, e in zip(leaves, self.extents, strict=True))
        tspecs = tuple((tuple(t.shape), t.dtype) for t in targets)
        plan = self.plan(specs, tspecs)
        key = (copy, tile, specs, tspecs)
        module = self.modules.get(key)
        if module is None:
            module = self.modules[key] = plan.build(tile, copy).to(self.device())
        cuts = iter(plan.extents)
        local = [t[(..., *(slice(*iv) for iv in self.grid.tile_rect(next(cuts), tile).dims))]
                 if cut else t for t, cut in zip(targets, plan.sliced, strict=True)]
        return module(*leaves, *local)
