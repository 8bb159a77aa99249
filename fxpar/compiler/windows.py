"""What each rank reads of the model input, worked out at compile time.

A spatial stage's tile reads its tile of the image plus the halo of the first windowed ops
(fxpar.passes.halo.input_windows, for all tiles at once, without building the tile modules);
a non-spatial stage that takes the model input reads all of it; a later stage none. A rank's
window is the bounding box over its roles (a GEMS rank holds one of each copy). The Program
records it per rank (``Program.input_windows``, written to program.json by fxpar.program.emit), so
a data loader asks ``RankProgram.input_window()`` and reads only that part of each image
(fxpar.data.data).
"""

from __future__ import annotations

from torch import fx

from fxpar.core import meta
from fxpar.core.geometry import Grid, Rect
from fxpar.core.meta import TensorInfo
from fxpar.core.plan import RankMap
from fxpar.core.stages import StageGraph
from fxpar.frontend.rules.opkind import SPATIAL_RANKS
from fxpar.passes.halo import bounding, input_windows


def rank_windows(gm: fx.GraphModule, graph: StageGraph, rank_map: RankMap, grid: Grid | None
                 ) -> tuple[Rect | None, ...] | None:
    """Per rank, the box of the model input its stages read (rows x columns, or depth x rows x
    columns; the positions along L of a sequence; bounding box, halo included, clipped to the
    image), None for a rank that never reads it; None (nothing recorded) when the model input
    is not one image batch (N, C, H, W), volume batch (N, C, D, H, W) or sequence batch
    (N, C, L).

    gm: the whole analysed graph (its first placeholder is the model input); grid: the tile
    grid of a spatial plan."""
    x = next((n for n in gm.graph.nodes if n.op == "placeholder"), None)
    info = meta.find(x, TensorInfo) if x is not None else None
    if info is None or len(info.shapes) != 1 or len(info.shapes[0]) not in SPATIAL_RANKS:
        return None
    image = Rect.whole(info.shapes[0][2:])
    plan = rank_map.plan
    reads = [{i for i, src in enumerate(ins) if src.source == "batch"} for ins in graph.inputs]
    tiles: dict[int, list[Rect | None]] = {}
    for s in range(plan.spatial_stages if grid is not None else 0):
        if reads[s]:
            per_tile = input_windows(graph.modules[s], grid, reads[s])  # type: ignore[arg-type]
            if per_tile is None:
                return None
            tiles[s] = per_tile
    out: list[Rect | None] = []
    for rank in range(plan.world_size):
        rects: list[Rect] = []
        for role in rank_map.roles_of(rank):
            window = tiles[role.stage][role.tile] if role.stage in tiles else \
                image if reads[role.stage] else None
            if window is not None:
                rects.append(window)
        out.append(bounding(rects) if rects else None)
    return tuple(out)
