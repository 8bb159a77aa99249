"""Pass: find the spatial region — the nodes that run on image tiles.

The region grows forward from the model's 4-D inputs through ops fxpar knows how to run on tiles
(fxpar.spatial.opclass). It ends before the first op that is not one of them (flatten, view,
linear, an unknown function: it is named in the node's ``SpatialLayout.reason``), and before an
op whose output would leave some rank an empty tile. Global means (adaptive average pooling to
1x1) stay in the region and produce a *replicated* value. Every node gets a
:class:`SpatialLayout`: tiled, or replicated (the same whole value on every rank of the group).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from torch import fx

from fxpar import meta
from fxpar.meta import TensorInfo
from fxpar.plan import Plan, PlanError
from fxpar.spatial.geometry import Grid
from fxpar.spatial.opclass import Mean, Pointwise, classify


@dataclass(frozen=True)
class SpatialLayout:
    """How a node's output lives on the ranks of a spatial stage."""

    KEY: ClassVar[str] = "fxpar.spatial"
    tiled: bool
    reason: str = ""
    """For a replicated node with tiled inputs: why the region ends here."""


def _extent(n: fx.Node) -> tuple[int, int] | None:
    info = meta.find(n, TensorInfo)
    if info is None or len(info.shapes) != 1 or len(info.shape) != 4:
        return None
    return (info.shape[2], info.shape[3])


def _inputs(n: fx.Node) -> list[fx.Node]:
    return [a for a in n.all_input_nodes if a.op != "get_attr"]


def spatial_region(gm: fx.GraphModule, plan: Plan) -> fx.GraphModule:
    """Annotate every node with its SpatialLayout (no-op for plans without spatial parts)."""
    if not plan.spatial:
        return gm
    grid = Grid(*plan.tile_grid())
    tiled: set[fx.Node] = set()
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            ext = _extent(n)
            if ext is not None and grid.fits(ext):
                tiled.add(n)
                meta.put(n, SpatialLayout(True))
            elif ext is not None:
                meta.put(n, SpatialLayout(False, f"the {ext[0]}x{ext[1]} input {n.name!r} is "
                                                 f"smaller than the tile grid"))
            else:
                meta.put(n, SpatialLayout(False))
            continue
        if n.op in ("get_attr", "output"):
            meta.put(n, SpatialLayout(False))
            continue
        ins = [a for a in _inputs(n) if a in tiled]
        if not ins:
            meta.put(n, SpatialLayout(False))
            continue
        op = classify(gm, n)
        ext = _extent(n)
        reason = ""
        if op is None:
            reason = f"{_describe(gm, n)} cannot run on tiles"
        elif isinstance(op, Mean):
            meta.put(n, SpatialLayout(False))  # a global mean: the region goes on past it
            continue
        elif ext is None:
            reason = f"{_describe(gm, n)} does not produce a 4-D image tensor"
        elif not grid.fits(ext):
            reason = (f"its {ext[0]}x{ext[1]} output is smaller than the {grid.rows}x"
                      f"{grid.cols} tile grid")
        elif isinstance(op, Pointwise) and any(_extent(a) not in (ext, None) for a in ins):
            reason = "its tiled inputs have different image sizes"
        if reason:
            meta.put(n, SpatialLayout(False, f"region ends at {n.name!r}: {reason}"))
            continue
        tiled.add(n)
        meta.put(n, SpatialLayout(True))
    if not any(n.op != "placeholder" for n in tiled):
        first = next((n for n in gm.graph.nodes if meta.get(n, SpatialLayout).reason), None)
        why = meta.get(first, SpatialLayout).reason if first is not None else "no 4-D input"
        raise PlanError(f"nothing in this model can run on {grid.rows}x{grid.cols} tiles "
                        f"({why}){_what_fits(gm, plan, grid, first)}")
    return gm


def _describe(gm: fx.GraphModule, n: fx.Node) -> str:
    if n.op == "call_module":
        return f"{type(gm.get_submodule(str(n.target))).__name__} {n.target!r}"
    return f"{getattr(n.target, '__name__', n.target)!s} ({n.op})"


def region_ends(gm: fx.GraphModule) -> list[str]:
    """The reasons the region ends, one per node where it does (for messages and inspect)."""
    return [lay.reason for n in gm.graph.nodes
            if (lay := meta.find(n, SpatialLayout)) is not None and lay.reason]


def limit_region(gm: fx.GraphModule, plan: Plan) -> fx.GraphModule:
    """Pass (after split_stages): the region stops at the end of the last spatial stage; a
    spatial stage with nothing to split is an error."""
    if not plan.spatial:
        return gm
    stage_of = {n: n.meta["fxpar.stage"].stage for n in gm.graph.nodes if "fxpar.stage" in n.meta}
    used = set()
    said = False
    for n in gm.graph.nodes:
        lay = meta.find(n, SpatialLayout)
        if lay is None or not lay.tiled or n.op == "placeholder":
            continue
        if stage_of.get(n, 0) >= plan.spatial_stages:
            reason = "" if said else (f"region ends at {n.name!r}: the first node after the "
                                      f"last spatial stage ({plan.spatial_stages - 1})")
            said = True
            meta.put(n, SpatialLayout(False, reason))
        else:
            used.add(stage_of.get(n, 0))
    missing = sorted(set(range(plan.spatial_stages)) - used)
    if missing:
        ends = region_ends(gm)
        raise PlanError(
            f"spatial stage(s) {missing} would have no tiled work: the spatial region ends "
            f"earlier ({ends[0] if ends else 'at the end of the model'}). Use "
            f"spatial_stages={min(missing)} or cut the stages differently (Plan.balance)")
    return gm


def _what_fits(gm: fx.GraphModule, plan: Plan, grid: Grid, first: fx.Node | None) -> str:
    """': use an image of at least HxW, or spatial_parts <= P' for the op that failed."""
    image = next((_extent(n) for n in gm.graph.nodes if n.op == "placeholder"), None)
    ext = _extent(first) if first is not None else None
    if image is None or ext is None or grid.fits(ext):
        return ": use a larger image or fewer spatial_parts"
    f = max(grid.rows / ext[0], grid.cols / ext[1])
    h, w = -(-image[0] * f // 1), -(-image[1] * f // 1)
    if plan.slice == "vertical":
        most = ext[1]
    elif plan.slice == "horizontal":
        most = ext[0]
    else:
        most = max(p for p in range(1, ext[0] * ext[1] + 1)
                   if Grid(*Plan(spatial_parts=p).tile_grid()).fits(ext))
    return (f": use an image of at least {int(h)}x{int(w)}, or spatial_parts <= {most} "
            f"with slice={plan.slice!r}")
