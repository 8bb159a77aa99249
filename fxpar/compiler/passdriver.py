"""Run compiler passes in order; lint and recompile after each; dump the graph after any.

A pass is ``fn(gm, plan) -> gm`` that records its decisions in ``node.meta`` (see fxpar.core.meta).
User errors (PlanError, TraceError) pass through unchanged; anything else is a compiler bug and
is reported with the pass that raised it and the passes that ran before it.

The ``after`` hook sees the graph under the name ``"trace"`` before the first pass (the traced,
analysed graph) and then under each pass's name. Passes annotate the graph in place, so a dump
must be taken inside the hook: :func:`dump` renders it as text at that moment (the node table
plus the column of metadata that pass writes), which is what ``fxpar-inspect --after`` prints.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import fx, nn

from fxpar.compiler.report import listed, node_table
from fxpar.core import meta
from fxpar.core.geometry import Exchange
from fxpar.core.plan import Plan, PlanError
from fxpar.frontend.trace import TraceError
from fxpar.passes.spatial_region import SpatialLayout
from fxpar.passes.split_stages import StageAssignment
from fxpar.runtime.spatial.attention import GatherAttention, RingAttention
from fxpar.runtime.spatial.lossops import TileReduceDims
from fxpar.runtime.spatial.norms import TileGroupNorm
from fxpar.runtime.spatial.ops import (
    Halo,
    HaloOp,
    Join,
    TileBatchNorm,
)
from fxpar.runtime.spatial.reduce import TileReduce
from fxpar.runtime.spatial.tokens import TileCells

Pass = Callable[[fx.GraphModule, Plan], fx.GraphModule]
After = Callable[[str, fx.GraphModule], None]

TRACE = "trace"
"""The name under which ``after`` sees the graph before any pass."""
HALO = "halo"
"""The per-tile pass: rewrites one spatial stage's module for one tile (fxpar.passes.halo);
run through :func:`run_passes` like the whole-graph passes (fxpar.compiler.driver.TILE_PASSES)."""


class PassError(RuntimeError):
    """A pass failed on a valid model and plan: a bug in fxpar."""


def run_passes(gm: fx.GraphModule, plan: Plan, passes: Sequence[tuple[str, Pass]],
               after: After | None = None, *, first: str | None = TRACE,
               where: str = "") -> fx.GraphModule:
    """Apply ``passes``; ``after(name, gm)`` is called on the input (as ``first``, unless it
    is None) and after each pass (for dumps). ``where``: what the passes run on, for errors
    (e.g. "stage 0, tile 3")."""
    if after is not None and first is not None:
        after(first, gm)
    done: list[str] = []
    for name, fn in passes:
        try:
            gm = fn(gm, plan)
            gm.graph.lint()
            if after is not None:  # a dump reads the code; passes read only the graph
                gm.recompile()
        except (PlanError, TraceError):
            raise
        except Exception as e:
            on = f" on {where}" if where else ""
            raise PassError(f"pass {name!r} failed{on} (after {done or 'no passes'}): "
                            f"{type(e).__name__}: {e}\nThis is a bug in fxpar, not in your "
                            f"model: please report it with this message, the model and the "
                            f"plan.") from e
        done.append(name)
        if after is not None:
            after(name, gm)
    if after is None and done:
        gm.recompile()  # the code once, after the last pass
    return gm


# -- dumps -------------------------------------------------------------------------------------
def _layout(n: fx.Node) -> str:
    lay = meta.find(n, SpatialLayout)
    if lay is None:
        return "-"
    return ("tiled" if lay.tiled else "replicated") + (f" ({lay.reason})" if lay.reason else "")


def _stage(n: fx.Node) -> str:
    a = meta.find(n, StageAssignment)
    return "-" if a is None else str(a.stage)


def halo_widths(ex: Exchange) -> str:
    """``t=1 b=1 l=1 r=1``; a volume's front and back first: ``fr=1 bk=1 t=1 ...``."""
    w = ex.halo_widths()
    names = ("fr", "bk", "t", "b", "l", "r")[-len(w):] if len(w) <= 6 else \
        tuple(f"s{i}" for i in range(len(w)))
    return " ".join(f"{k}={v}" for k, v in zip(names, w, strict=True))


def halo_note(gm: fx.GraphModule, n: fx.Node) -> str:
    """What a node of a tile-rewritten stage does across tiles ('' for a local op)."""
    if n.op == "call_module":
        mod = gm.get_submodule(str(n.target))
        if isinstance(mod, (Halo, HaloOp)):
            ex = mod.exchange
            if mod.replicated:
                return f"scatter: slice {ex.need} of the whole tensor"
            if getattr(mod, "fused", False):
                return f"fused halo group: region {ex.own} -> window {ex.need}, local"
            recvs, sends = sorted(u for u, _ in ex.recvs), sorted(u for u, _ in ex.sends)
            widths = f"halo {halo_widths(ex)}"
            if not recvs and not sends:
                return f"{widths} (no exchange)"
            return f"{widths} <- tiles {recvs} -> tiles {sends}"
        if isinstance(mod, Join):
            return f"join: gather {len(mod.rects)} tiles"
        if isinstance(mod, TileBatchNorm):
            own = f" (owned box {mod.box} of a fused group's region)" if mod.box else ""
            return f"BatchNorm statistics: allgather over tiles{own}"
        if isinstance(mod, TileGroupNorm):
            return "GroupNorm statistics: allgather over tiles"
        if isinstance(mod, TileReduce):
            return f"{mod.kind} over the spatial dims: allreduce over tiles"
        return _token_note(mod)
    if n.target is torch.ops.fxpar.allreduce.default:
        return f"{n.args[2]} over tiles (allreduce): a product over split tokens"
    return ""


def _token_note(mod: nn.Module) -> str:
    """What a tile op of a token block (fxpar.passes.tile_tokens) does across tiles."""
    if isinstance(mod, RingAttention):
        p = len(mod.lengths)
        return (f"ring attention over {p} tiles' tokens {list(mod.lengths)}: K, V go round "
                f"in {p - 1} step(s), dK, dV back in {p}; tags {mod.tag}/{mod.tag + 1}")
    if isinstance(mod, GatherAttention):
        return "replicated queries over every tile's tokens: 2 allreduces (backward 1)"
    if isinstance(mod, TileReduceDims):
        return f"{mod.kind} over dims {list(mod.dims)} (split tokens): allreduce over tiles"
    if isinstance(mod, TileCells):
        return f"this tile's cells of a whole operand (dim {mod.dim})"
    return ""


COLUMNS: dict[str, tuple[str, Callable[[fx.GraphModule, fx.Node], str]]] = {
    "spatial_region": ("layout", lambda gm, n: _layout(n)),
    "split_stages": ("stage", lambda gm, n: _stage(n)),
    "limit_region": ("stage, layout", lambda gm, n: f"{_stage(n)}  {_layout(n)}"),
    HALO: ("across tiles", halo_note),
}
"""Per pass: the header and value of the metadata column its dump adds to the node table."""


def dump(name: str, gm: fx.GraphModule, code: bool = False) -> str:
    """The graph as it is now: the node table (as ``fxpar-inspect`` prints it) plus the column
    of the pass ``name``; ``code`` appends the graph's generated Python (``gm.code``)."""
    lines = node_table(gm).splitlines()
    if name in COLUMNS:
        header, value = COLUMNS[name]
        width = max(len(line) for line in lines)
        extra = [header, *(value(gm, n) for n in listed(gm))]
        lines = [f"{line.ljust(width)}  {x}".rstrip() for line, x in zip(lines, extra,
                                                                           strict=True)]
    text = "\n".join(lines)
    if code:
        text += "\n\n" + gm.code.strip("\n")
    return text

