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

from fxpar.core.geometry import Grid
from fxpar.runtime.loop import LossFn, LossTiles, targets_of
from fxpar.runtime.spatial.lossops import JoinedLoss, image_layout
from fxpar.runtime.spatial.ops import group_key

Spec = tuple[tuple[int, ...], torch.dtype]
LossTilesFactory = Callable[..., LossTiles]
"""``(output spec, target specs, warn) -> LossTiles`` (fxpar.compiler.loss.tiled_loss with the
loss, grid, stage and strictness bound)."""


def joined_loss(loss_fn: LossFn, grid: Grid, extent: tuple[int, ...], stage: int,
                sliced: tuple[bool, ...], reason: str) -> LossTiles:
    """The loss on the joined output of spatial stage ``stage``, the per-pixel targets
    (``sliced``) joined too: exact for any loss (fxpar.compiler.loss's fallback, and a
    program loaded from disk)."""
    rects = tuple(grid.tile_rect(extent, u) for u in range(grid.size))
    return LossTiles(functools.partial(_joined, loss_fn, rects, stage, sliced), sliced, reason)


def _joined(loss_fn: LossFn, rects: tuple, stage: int, sliced: tuple[bool, ...], tile: int,
            copy: int) -> nn.Module:
    return JoinedLoss(loss_fn, rects, tile, group_key(stage, copy), sliced)


class TileLoss:
    """``(copy, tile, output tile, whole targets) -> loss`` for one rank program."""

    def __init__(self, factory: LossTilesFactory | None, loss_fn: LossFn, grid: Grid,
                 extent: tuple[int, ...], stage: int,
                 device: Callable[[], torch.device], speaks: bool) -> None:
        self.factory, self.loss_fn, self.grid, self.extent = factory, loss_fn, grid, extent
        self.stage, self.device, self.speaks = stage, device, speaks
        self.plans: dict[tuple[Spec, ...], LossTiles] = {}
        self.modules: dict[tuple[Any, ...], nn.Module] = {}

    def plan(self, output: Spec, targets: tuple[Spec, ...]) -> LossTiles:
        """How the tiles compute the loss for these shapes (made once per shapes)."""
        key = (output, *targets)
        if key not in self.plans:
            if self.factory is not None:
                self.plans[key] = self.factory(output, targets, warn=self.speaks)
            else:  # no compiler here: join the output and the per-pixel targets
                sliced = tuple(image_layout(s, self.extent) is not None for s, _ in targets)
                self.plans[key] = joined_loss(self.loss_fn, self.grid, self.extent, self.stage,
                                              sliced, "a program loaded from disk joins its "
                                              "output")
        return self.plans[key]

    def __call__(self, copy: int, tile: int, output: torch.Tensor, target: Any) -> torch.Tensor:
        targets = targets_of(target)
        if not all(isinstance(t, torch.Tensor) for t in targets):
            raise TypeError(f"the loss of a tiled output takes tensors as targets (a tensor, or "
                            f"a tuple of tensors such as (target, mask)), got "
                            f"{[type(t).__name__ for t in targets]}")
        spec = ((output.shape[0], output.shape[1], *self.extent), output.dtype)
        specs = tuple((tuple(t.shape), t.dtype) for t in targets)
        plan = self.plan(spec, specs)
        key = (copy, tile, spec, *specs)
        module = self.modules.get(key)
        if module is None:
            module = self.modules[key] = plan.build(tile, copy).to(self.device())
        box = self.grid.tile_rect(self.extent, tile).dims
        local = [t[(..., *(slice(*iv) for iv in box))] if cut else t
                 for t, cut in zip(targets, plan.sliced, strict=True)]
        return module(output, *local)
