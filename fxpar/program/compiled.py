"""What a compiled program is to the code that writes it out (fxpar.program.emit): the
:class:`CompiledProgram` protocol, which ``fxpar.program.program.Program`` implements, and the tile
programs of its spatial stages (:class:`SpatialInfo`). Emission reads a program through this
protocol, so it depends on no module above it (``Program.save`` calls it)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

from torch import fx, nn

from fxpar.core.geometry import Grid, Rect
from fxpar.core.modelkeys import ModelKeys
from fxpar.core.plan import Plan, RankMap
from fxpar.core.schedule import Schedule
from fxpar.core.stages import StageGraph


@dataclass(frozen=True)
class SpatialInfo:
    """The tile programs of the spatial stages, and how the model output is laid out."""

    build: Callable[..., fx.GraphModule]
    """(stage, tile[, copy]) -> that tile's rewritten stage module, by the halo pass through
    the pass driver (fxpar.compiler.driver.TILE_PASSES): the compiler builds tile 0 of each
    spatial stage, a rank its own tiles on first use."""
    grid: Grid
    spatial_stages: int
    out_tiled: bool
    """Some leaf of the model output leaves the spatial stages tiled (a loss on tiles)."""
    out_extent: tuple[int, ...]
    """The image size of the first tiled leaf (what :meth:`RankProgram.target_window` cuts)."""
    out_extents: tuple[tuple[int, ...] | None, ...] = ()
    """Per leaf of the model output (fxpar.core.outputs), its image size when it is tiled,
    None when it is whole on every rank of the tile group (a class head on pooled features);
    empty: one leaf, tiled at ``out_extent`` when ``out_tiled``."""
    _cache: dict[tuple[int, int], fx.GraphModule] = field(default_factory=dict)

    @property
    def leaf_extents(self) -> tuple[tuple[int, ...] | None, ...]:
        """:attr:`out_extents`, with the one-leaf default spelled out."""
        if self.out_extents:
            return self.out_extents
        return (self.out_extent if self.out_tiled else None,)

    def tile(self, stage: int, tile: int) -> fx.GraphModule:
        key = (stage, tile)
        if key not in self._cache:
            self._cache[key] = self.build(stage, tile)
        return self._cache[key]

    @property
    def tiles(self) -> dict[tuple[int, int], fx.GraphModule]:
        """Every tile program (builds them all)."""
        return {(s, t): self.tile(s, t) for s in range(self.spatial_stages)
                for t in range(self.grid.size)}


class CompiledProgram(Protocol):
    """The parts of a compiled job emission writes: plan and rank layout, stage graphs and
    schedules, the model's state_dict names and keys, and per-rank stage modules."""

    plan: Plan
    rank_map: RankMap
    graph: StageGraph
    schedule: Schedule
    loss_fn: Callable[..., Any]
    batch_size: int
    names: tuple[str, ...]
    traced: fx.GraphModule | None
    spatial: SpatialInfo | None
    input_windows: tuple[Rect | None, ...] | None
    recompute: frozenset[int]

    @property
    def world_size(self) -> int: ...

    @property
    def output_shape(self) -> tuple[int, ...] | None: ...

    @property
    def model_keys(self) -> ModelKeys: ...

    def complete_stages(self) -> None: ...

    def materialize(self, rank: int) -> None: ...

    def stage_modules(self, rank: int) -> dict[tuple[int, int], nn.Module]: ...


class RunnableProgram(CompiledProgram, Protocol):
    """What a rank program reads of its compiled program (fxpar.program.rank.RankProgram), beyond
    what emission reads: the optimizer factory, how a tiled output's loss runs, the bound
    predictor, a meta-built model's modules, and each state_dict name's position."""

    optimizer: Callable[..., Any] | None
    loss_tiles: Any
    predictor: Callable[..., Any] | None
    meta_model: nn.Module | None

    @property
    def name_order(self) -> dict[str, int]: ...


def input_window_of(program: Any, stages: Iterable[tuple[int, int]], rank: int,
                    image: tuple[int, ...] | None = None) -> Rect | None:
    """The box of the model input that ``rank``'s ``stages`` ((copy, stage) pairs) read, as
    ``program`` recorded it (``input_windows``); without records, the whole input of spatial
    size ``image`` where a stage reads it, None where none does (RankProgram.input_window)."""
    windows = program.input_windows
    if windows is not None:
        return windows[rank]
    if not any(src.source == "batch" for _copy, stage in stages
               for src in program.graph.inputs[stage]):
        return None
    if image is None:
        raise ValueError(f"rank {rank} reads the whole model input but its program does not "
                         f"record the image size: pass input_window(image=(H, W)), or "
                         f"(D, H, W) for a volume")
    return Rect.whole(tuple(image))
