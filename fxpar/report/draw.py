"""Pictures of a compiled program: its stage graphs as DOT, its schedule as a Gantt chart.

``program_dot`` draws what the ranks run, not the traced graph: one cluster per stage holding
that stage's module (a spatial stage's tile-rewritten module, so its halo exchanges, joins and
synchronised BatchNorms are visible), and the tensors sent between stages (the program's
Transfers) as bold red edges labelled with their shape and bytes. Clusters keep graphs of a
thousand nodes (AmoebaNet) readable in ``dot``.

``timeline_bars`` turns a schedule into bars per rank, from the simulator (unit costs or each
stage's FLOPs) or from the metrics of a real run (``fxpar-run --metrics``); ``draw_timeline``
renders them with matplotlib (Agg: no display needed).
"""

from __future__ import annotations

import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch import fx

from fxpar.compiler.driver import links_of
from fxpar.compiler.passdriver import halo_note
from fxpar.compiler.report import op_name, shape_text
from fxpar.core.units import nbytes
from fxpar.perf.simulate import SimResult, simulate
from fxpar.runtime.spatial.norms import TileGroupNorm
from fxpar.runtime.spatial.ops import (
    Halo,
    HaloOp,
    Join,
    TileBatchNorm,
)
from fxpar.runtime.spatial.reduce import TileReduce

if TYPE_CHECKING:
    import graphviz
    from matplotlib.figure import Figure

    from fxpar.perf.simulate import Timing
    from fxpar.program.program import Program

STAGE_COLOURS = ("#a6cee3", "#b2df8a", "#fdbf6f", "#cab2d6", "#ffff99", "#8dd3c7", "#fccde5",
                 "#d9d9d9", "#bebada", "#ccebc5")
"""Fill colour of stage k's ordinary nodes: ``STAGE_COLOURS[k % len]``."""

SPECIAL = {
    "halo": {"shape": "octagon", "fillcolor": "#fb8072", "color": "#b2182b", "penwidth": "2"},
    "join": {"shape": "invtrapezium", "fillcolor": "#80b1d3", "color": "#08519c",
             "penwidth": "2"},
    "sync": {"shape": "hexagon", "fillcolor": "#bc80bd", "color": "#54278f", "penwidth": "2"},
}
"""Node styles of the ops that communicate inside a spatial stage."""
SPECIAL_LABEL = {"halo": "halo exchange (Halo / HaloOp)", "join": "join (gather tiles)",
                 "sync": "BatchNorm / GroupNorm statistics, spatial mean (allreduce)"}
TRANSFER = {"color": "#d62728", "fontcolor": "#d62728", "penwidth": "2.5", "style": "bold"}
"""Edge style of a tensor sent between stages (SEND_F/RECV_F; its gradient goes back)."""


class PictureError(RuntimeError):
    """A picture was asked for and something it needs is not installed."""


class DotMissing(PictureError):
    """The graphviz ``dot`` program is not installed."""


class ExtraMissing(PictureError):
    """A Python package of the ``viz`` extra (graphviz, matplotlib) is not installed."""


def _needs(package: str, what: str) -> Any:
    """Import ``package`` for a picture, or say which extra to install. Text output (tables,
    dumps) never needs these: they are imported only when a picture is asked for."""
    import importlib

    try:
        return importlib.import_module(package)
    except ImportError:
        raise ExtraMissing(f"{what} needs the Python package {package.split('.')[0]!r}, which "
                           f"is not installed: pip install 'fxpar[viz]' (or pip install "
                           f"{package.split('.')[0]})") from None


def special_kind(gm: fx.GraphModule, n: fx.Node) -> str | None:
    """'halo', 'join' or 'sync' for the nodes of a tile module that communicate, else None."""
    if n.op == "call_module":
        mod = gm.get_submodule(str(n.target))
        if isinstance(mod, (Halo, HaloOp)):
            return "halo"
        if isinstance(mod, Join):
            return "join"
        if isinstance(mod, (TileBatchNorm, TileGroupNorm, TileReduce)):
            return "sync"
    return None


def stage_module(program: Program, stage: int, rank: int | None = None) -> fx.GraphModule:
    """The module one rank runs for ``stage``: for a spatial stage the tile of ``rank`` (tile 0
    when ``rank`` is None or holds no tile of it), else the stage module."""
    info = program.spatial
    if info is None or stage >= info.spatial_stages:
        return program.graph.modules[stage]
    tiles = [] if rank is None else [r.tile for r in program.rank_map.roles_of(rank)
                                     if r.stage == stage and r.copy == 0]
    return info.tile(stage, tiles[0] if tiles else 0)


def _node_id(stage: int, n: fx.Node) -> str:
    return f"s{stage}_{n.name}"


def _stage_label(program: Program, stage: int, gm: fx.GraphModule, rank: int | None) -> str:
    ranks = sorted({r for r in range(program.world_size)
                    for role in program.rank_map.roles_of(r) if role.stage == stage})
    label = f"stage {stage}  (ranks {', '.join(map(str, ranks))})"
    if program.spatial is not None and stage < program.spatial.spatial_stages:
        g = program.spatial.grid
        label += f"  tile module of a {g} grid: {type(gm).__name__}"
    return label


def program_dot(program: Program, rank: int | None = None) -> graphviz.Digraph:
    """The program's stage graphs as one DOT graph (see the module docstring)."""
    graphviz = _needs("graphviz", "drawing the stage graphs (--dot, --svg)")
    dot = graphviz.Digraph("fxpar", graph_attr={
        "rankdir": "TB", "fontname": "Helvetica", "newrank": "true", "nodesep": "0.15",
        "ranksep": "0.25", "label": f"fxpar program: {program.plan.stages} stage(s) on "
        f"{program.world_size} rank(s)", "labelloc": "t"},
        node_attr={"fontname": "Helvetica", "fontsize": "9", "shape": "box",
                   "style": "filled,rounded", "height": "0.3"},
        edge_attr={"arrowsize": "0.5", "color": "#555555"})
    modules = {s: stage_module(program, s, rank) for s in range(program.plan.stages)}
    for s, gm in modules.items():
        colour = STAGE_COLOURS[s % len(STAGE_COLOURS)]
        with dot.subgraph(name=f"cluster_stage{s}") as c:
            c.attr(label=_stage_label(program, s, gm, rank), style="rounded,filled",
                   fillcolor="#f7f7f7", color=colour, penwidth="3", fontsize="12")
            for n in gm.graph.nodes:
                _add_node(c, s, gm, n, colour)
            for n in gm.graph.nodes:
                for a in n.all_input_nodes:
                    c.edge(_node_id(s, a), _node_id(s, n))
    for t in program.graph.transfers:
        src, dst = modules[t.src], modules[t.dst]
        out = next(n for n in src.graph.nodes if n.op == "output")
        value = out.args[0][t.src_out] if isinstance(out.args[0], (tuple, list)) else None
        tail = value if isinstance(value, fx.Node) else out
        head = [n for n in dst.graph.nodes if n.op == "placeholder"][t.dst_in]
        shape = "x".join(map(str, t.shape))
        tiles = program.plan.group_size(t.src)
        dot.edge(_node_id(t.src, tail), _node_id(t.dst, head),
                 label=f"send {t.src}->{t.dst}\\n{shape}{' (tiled)' if t.tiled else ''}\\n"
                 f"{nbytes(t.nbytes)}{f' from {tiles} tiles' if t.tiled else ''}", **TRANSFER)
    _legend(dot, program.plan.stages, any(special_kind(gm, n) for gm in modules.values()
                                          for n in gm.graph.nodes))
    return dot


def _add_node(c: graphviz.Digraph, s: int, gm: fx.GraphModule, n: fx.Node,
              colour: str) -> None:
    kind = special_kind(gm, n)
    label = f"{n.name}\\n{op_name(gm, n)}"
    if n.op not in ("output", "get_attr"):
        label += f"\\n{shape_text(n)}"
    attrs: dict[str, str] = {"fillcolor": colour}
    if kind is not None:
        attrs = dict(SPECIAL[kind])
        note = halo_note(gm, n)
        label += f"\\n{note.split(' <-')[0]}" if note else ""
    elif n.op == "placeholder":
        attrs["shape"] = "invhouse"
    elif n.op == "output":
        attrs["shape"] = "house"
    elif n.op == "get_attr":
        attrs.update(shape="note", fontsize="7")
    c.node(_node_id(s, n), label=label, **attrs)


def _legend(dot: graphviz.Digraph, stages: int, spatial: bool) -> None:
    with dot.subgraph(name="cluster_legend") as c:
        c.attr(label="legend", style="rounded", color="#999999", fontsize="11")
        for s in range(stages):
            c.node(f"legend_stage{s}", label=f"stage {s}",
                   fillcolor=STAGE_COLOURS[s % len(STAGE_COLOURS)])
        if spatial:
            for kind, attrs in SPECIAL.items():
                c.node(f"legend_{kind}", label=SPECIAL_LABEL[kind], **attrs)
        if stages > 1:
            c.node("legend_send", label="stage a", fillcolor="#ffffff")
            c.node("legend_recv", label="stage b", fillcolor="#ffffff")
            c.edge("legend_send", "legend_recv", label="send/recv: shape, bytes", **TRANSFER)


def render_svg(dot: graphviz.Digraph, path: str | Path) -> Path:
    """Render with the graphviz ``dot`` program; :class:`DotMissing` when it is not installed."""
    if shutil.which("dot") is None:
        raise DotMissing(
            "the graphviz 'dot' program is not installed, so the SVG cannot be rendered: "
            "install graphviz (apt-get install graphviz / conda install graphviz / "
            "brew install graphviz), or write the DOT text with --dot FILE and render it "
            "elsewhere (dot -Tsvg FILE -o out.svg)")
    out = Path(path)
    out.write_bytes(dot.pipe(format="svg"))
    return out


# -- timeline ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Bar:
    """One action of one rank on the timeline: ``[start, end)``."""

    rank: int
    action: str
    kind: str
    """F, B, W, send, recv, allreduce or step: what the bar's colour says (W: the weight
    gradients of a backward that a zero-bubble schedule split, B then its input gradients)."""
    start: float
    end: float
    stage: int = -1
    mb: int = -1
    copy: int = 0
    wait: float = 0.0
    """Seconds of the action spent blocked on communication (real runs; drawn pale at the
    start of the bar, where the runtime waits for the data it needs)."""


KIND_COLOURS = {"F": "#4e79a7", "B": "#f28e2b", "W": "#76b7b2", "send": "#59a14f",
                "recv": "#b07aa1", "allreduce": "#e15759", "step": "#7f7f7f"}
KIND_LABELS = {"F": "F (forward)", "B": "B (backward)", "W": "W (weight gradients)",
               "send": "send", "recv": "recv (waiting)", "allreduce": "allreduce", "step": "step"}
"""Legend entries; where a chart has W bars, B is only the input gradients (``SPLIT_B``)."""
SPLIT_B = "B (input gradients)"
COMPUTE = ("F", "B", "W")
"""Bar kinds that carry the micro-batch number."""


def bar_kind(kind: str) -> str:
    """An action kind (``SEND_F``, ``RECV_B``, ``ALLREDUCE``...) as a bar kind."""
    if kind.startswith("SEND"):
        return "send"
    if kind.startswith("RECV"):
        return "recv"
    if kind in COMPUTE:
        return kind
    if kind in ("ALLREDUCE", "STEP"):
        return kind.lower()
    raise ValueError(f"unknown action kind {kind!r} (expected one of F, B, W, SEND_F, RECV_F, "
                     f"SEND_B, RECV_B, ALLREDUCE, STEP)")


def bars_from_sim(result: SimResult) -> dict[int, list[Bar]]:
    """The simulator's spans as bars."""
    return {r: [Bar(r, str(sp.action), bar_kind(sp.action.kind), sp.start, sp.end,
                    sp.action.stage, sp.action.mb, sp.action.copy) for sp in spans]
            for r, spans in result.spans.items()}


def timeline_bars(program: Program, stage_cost: Mapping[int, float] | None = None,
                  timing: Timing | None = None) -> dict[int, list[Bar]]:
    """Simulate one training step of ``program`` (F of stage s costs ``stage_cost[s]``, B
    twice that, or B and W as much as F each where a zero-bubble schedule splits the backward;
    unit costs F=1, B=2 (B=W=1) when None; seconds of a cost model with ``timing``) and
    return each rank's bars."""
    return bars_from_sim(simulate(program.schedule, links_of(program.graph),
                                  stage_cost=stage_cost,
                                  together=program.rank_map.tile_groups(), timing=timing))


def bars_from_metrics(metrics: Mapping[str, Any]) -> dict[int, list[Bar]]:
    """The last step's timeline of each rank of a real run: the ``fxpar-run --metrics`` file,
    as ``fxpar.train.metrics.load_metrics`` returns it (checked)."""
    out: dict[int, list[Bar]] = {}
    for rank in metrics["ranks"]:
        r = int(rank["rank"])
        out[r] = []
        for e in rank["timeline"]:
            out[r].append(Bar(r, e["action"], bar_kind(e["kind"]), float(e["start"]),
                              float(e["end"]), int(e["stage"]), int(e["mb"]), int(e["copy"]),
                              float(e["wait"])))
    return out


def timeline_figure(bars: Mapping[int, list[Bar]], title: str, xlabel: str) -> Figure:
    """A Gantt chart: one row per rank (rank 0 on top), one bar per action, coloured by kind
    (a zero-bubble schedule's W, the weight gradients, in its own colour), the micro-batch
    number in F/B/W bars, GEMS copy 1 hatched, receives (time spent waiting)
    and the part of other actions blocked on communication (``Bar.wait``) pale. Zero-length
    actions (a send in the simulator) get a thin sliver so they show."""
    Figure = _needs("matplotlib.figure", "drawing a timeline (--timeline)").Figure
    Patch = _needs("matplotlib.patches", "drawing a timeline (--timeline)").Patch

    ranks = sorted(bars)
    fig = Figure(figsize=(12, 0.55 * len(ranks) + 1.6))
    _gantt(fig.subplots(), bars, title, xlabel, Patch)
    fig.tight_layout()
    return fig


def comparison_figure(predicted: Mapping[int, list[Bar]], measured: Mapping[int, list[Bar]],
                      title: str, xlabel: str) -> Figure:
    """The predicted timeline above the measured one, on one time axis."""
    Figure = _needs("matplotlib.figure", "drawing a timeline (--timeline)").Figure
    Patch = _needs("matplotlib.patches", "drawing a timeline (--timeline)").Patch
    n = max(len(predicted), len(measured))
    fig = Figure(figsize=(12, 2 * (0.55 * n + 1.2)))
    top, bottom = fig.subplots(2, 1, sharex=True)
    end = lambda bars: max((b.end for bs in bars.values() for b in bs), default=0.0)  # noqa: E731
    _gantt(top, predicted, f"{title}: predicted ({end(predicted):.3f} s)", "", Patch)
    _gantt(bottom, measured, f"measured ({end(measured):.3f} s)", xlabel, Patch,
           legend=False)
    top.set_xlim(0, max(end(predicted), end(measured), 1e-9) * 1.01)
    fig.tight_layout()
    return fig


def _gantt(ax: Any, bars: Mapping[int, list[Bar]], title: str, xlabel: str, Patch: Any,
           legend: bool = True) -> None:
    """One Gantt chart on ``ax`` (:func:`timeline_figure`)."""
    ranks = sorted(bars)
    end = max((b.end for bs in bars.values() for b in bs), default=1.0) or 1.0
    sliver = end * 0.004
    for r in ranks:
        for b in bars[r]:
            width = max(b.end - b.start, sliver)
            ax.barh(r, width, left=b.start, height=0.7, color=KIND_COLOURS[b.kind],
                    alpha=0.45 if b.kind == "recv" else 1.0, edgecolor="black",
                    linewidth=0.3, hatch="///" if b.copy == 1 else None)
            if b.wait > 0 and b.kind != "recv":
                ax.barh(r, min(b.wait, width), left=b.start, height=0.7,
                        color=KIND_COLOURS["recv"], alpha=0.6, linewidth=0)
            if b.kind in COMPUTE and b.mb >= 0 and width > end * 0.012:
                ax.text(b.start + width / 2, r, str(b.mb), ha="center", va="center",
                        fontsize=7, color="white")
    ax.set_yticks(ranks, [f"rank {r}" for r in ranks])
    ax.set_ylim(max(ranks, default=0) + 0.6, min(ranks, default=0) - 0.6)
    ax.set_xlim(0, end * 1.01)
    ax.set_xlabel(xlabel)
    ax.set_title(title)
    if not legend:
        return
    split = any(b.kind == "W" for bs in bars.values() for b in bs)
    handles = [Patch(color=c, alpha=0.45 if k == "recv" else 1.0,
                     label=SPLIT_B if k == "B" and split else KIND_LABELS[k])
               for k, c in KIND_COLOURS.items() if k != "W" or split]
    if any(b.copy == 1 for bs in bars.values() for b in bs):
        handles.append(Patch(facecolor="white", edgecolor="black", hatch="///",
                             label="GEMS copy 1"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize=8,
              frameon=False)


def draw_timeline(bars: Mapping[int, list[Bar]], path: str | Path, title: str,
                  xlabel: str) -> Path:
    """Write :func:`timeline_figure` as an image (PNG, SVG, PDF: from the file's suffix)."""
    out = Path(path)
    timeline_figure(bars, title, xlabel).savefig(out, dpi=110)
    return out
