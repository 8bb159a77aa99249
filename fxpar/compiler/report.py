"""Readable tables of an analysed graph (what ``fxpar-inspect`` prints)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import fx, nn

from fxpar.core import meta
from fxpar.core.geometry import piece_kinds
from fxpar.core.meta import NodeCost, TensorInfo, module_path
from fxpar.core.stages import StageGraph
from fxpar.core.units import nbytes, si
from fxpar.frontend.rules.opkind import SPATIAL_RANKS
from fxpar.frontend.trace import totals
from fxpar.passes.halo_fusion import FUSION_KEY, GroupInfo
from fxpar.passes.spatial_region import Coverage, SpatialLayout, region_ends
from fxpar.passes.split_stages import StageAssignment, compute_nodes
from fxpar.runtime.modules import BatchNormOp, DropoutOp
from fxpar.runtime.spatial.ops import Halo, HaloOp

if TYPE_CHECKING:
    from fxpar.program.program import Program


def op_name(gm: fx.GraphModule, n: fx.Node) -> str:
    """What a node does, in a few characters: module type, function or method name."""
    if n.op == "call_module":
        mod: nn.Module = gm.get_submodule(str(n.target))
        if isinstance(mod, (BatchNormOp, DropoutOp)):
            return "batch_norm" if isinstance(mod, BatchNormOp) else mod.kind
        return type(mod).__name__
    if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload):
        return n.target.overloadpacket.__name__  # aten.conv2d.default -> conv2d
    if n.op == "call_function":
        return getattr(n.target, "__name__", str(n.target))
    if n.op == "call_method":
        return f".{n.target}"
    return n.op


def shape_text(n: fx.Node) -> str:
    info = meta.find(n, TensorInfo)
    if info is None or not info.shapes:
        return "-"
    return ", ".join("x".join(map(str, s)) for s in info.shapes)


def listed(gm: fx.GraphModule) -> list[fx.Node]:
    """The nodes a table shows: all but the parameter reads (``get_attr``), whose bytes are
    shown on the ops that use them."""
    return [n for n in gm.graph.nodes if n.op != "get_attr"]


def _params(n: fx.Node) -> int:
    own = meta.find(n, NodeCost)
    total = own.param_bytes if own is not None else 0
    for a in n.all_input_nodes:
        c = meta.find(a, NodeCost)
        if a.op == "get_attr" and c is not None:
            total += c.param_bytes
    return total


def node_table(gm: fx.GraphModule) -> str:
    """One row per listed node: its index in the graph, name, op, the model module it comes
    from, output shape, FLOPs, output bytes, bytes of the parameters it reads."""
    rows = [("#", "node", "op", "module", "output", "FLOPs", "out bytes", "params")]
    index = {n: i for i, n in enumerate(gm.graph.nodes)}
    for n in listed(gm):
        c = meta.find(n, NodeCost) or NodeCost(0, 0, 0)
        p = _params(n)
        rows.append((str(index[n]), n.name, op_name(gm, n), module_path(n) or "-",
                     shape_text(n), si(c.flops) if c.flops else "0", nbytes(c.out_bytes),
                     nbytes(p) if p else "0"))
    return "\n".join(_columns(rows, right={0, 5, 6, 7}))


def totals_line(gm: fx.GraphModule) -> str:
    t = totals(gm)
    params = sum(p.numel() * p.element_size() for p in gm.parameters())
    return (f"total: {si(t.flops, 'FLOP')} forward, {nbytes(t.out_bytes)} of node outputs, "
            f"{nbytes(params)} of parameters ({sum(p.numel() for p in gm.parameters()):,} "
            f"values)")


def stage_table(gm: fx.GraphModule, graph: StageGraph) -> str:
    """Per stage: nodes, forward FLOPs, parameter bytes, activation bytes; then per cut: the
    tensors and bytes that cross it (per micro-batch, each direction)."""
    stats = {k: [0, 0, 0, 0] for k in range(len(graph.modules))}
    for n in compute_nodes(gm):
        k = meta.get(n, StageAssignment).stage
        c = meta.get(n, NodeCost)
        stats[k][0] += 1
        stats[k][1] += c.flops
        stats[k][3] += c.out_bytes
    for k, m in enumerate(graph.modules):
        stats[k][2] = sum(p.numel() * p.element_size() for p in m.parameters())
    rows = [("stage", "nodes", "FLOPs", "params", "activations")]
    rows += [(str(k), str(v[0]), si(v[1]), nbytes(v[2]), nbytes(v[3])) for k, v in stats.items()]
    lines = _columns(rows, right={1, 2, 3, 4})
    lines.append("")
    cut_rows = [("cut", "tensors", "bytes", "transfers (src->dst: shape)")]
    for k in range(1, len(graph.modules)):
        crossing = [t for t in graph.transfers if t.src < k <= t.dst]
        detail = ", ".join(f"{t.src}->{t.dst}: {'x'.join(map(str, t.shape))}" for t in crossing)
        cut_rows.append((f"{k - 1}|{k}", str(len(crossing)),
                         nbytes(sum(t.nbytes for t in crossing)), detail))
    lines += _columns(cut_rows, right={1, 2})
    return "\n".join(lines)


def _columns(rows: list[tuple[str, ...]], right: set[int]) -> list[str]:
    widths = [max(len(r[k]) for r in rows) for k in range(len(rows[0]))]
    return ["  ".join(v.rjust(w) if k in right else v.ljust(w)
                      for k, (v, w) in enumerate(zip(r, widths, strict=True))).rstrip()
            for r in rows]


def halo_table(program: Program) -> str:
    """The spatial region, the process grid and, per tile of each spatial stage, its block of
    the input, its halos with their widest widths (per side: top bottom left right, and
    front back first for a volume), the pieces received by how they touch the tile (a
    volume's faces, edges, corners; an image's sides, corners; over all halos) and the bytes
    received per forward, against the minimum: the cells of each window that lie in the image
    but outside its own tile."""
    info = program.spatial
    assert info is not None and program.traced is not None
    gm = program.traced
    grid = info.grid
    tiled = sum(1 for n in gm.graph.nodes
                if (lay := meta.find(n, SpatialLayout)) is not None and lay.tiled)
    dims = ("L",) if grid.ndim == 1 else ("D", "H", "W")[-grid.ndim:] if grid.ndim <= 3 else ()
    over = f" over ({', '.join(dims)})" if dims else ""
    lines = [f"spatial region: {tiled} of {len(gm.graph.nodes)} nodes on a {grid} tile "
             f"grid{over} ({'tiled' if info.out_tiled else 'replicated'} model output)"]
    cov = gm.meta.get(Coverage.KEY)
    if cov is not None:
        lines.append(f"spatial coverage: {cov.share:.1%} of the spatial stages' forward FLOPs "
                     f"run on tiles ({cov.tiled / 1e9:.3g} of {cov.image / 1e9:.3g} GFLOP)")
        if cov.replicated:
            lines.append("  run whole on every rank of the tile group (forward FLOPs): " +
                         ", ".join(f"{what} {flops / 1e6:.3g} M" for what, flops in
                                   cov.replicated))
    lines += [f"  {reason}" for reason in region_ends(gm)]
    image = _input_extent(gm)
    sides = {1: "l r", 3: "f b t b l r"}.get(grid.ndim, "t b l r")
    kinds = piece_kinds(grid.ndim)
    rows = [("stage", "tile", "input block", "halos", "/".join(f"{k}s" for k in kinds),
             "received", "minimum", "ratio", f"widest halo ({sides})")]
    for (stage, t), module in sorted(info.tiles.items()):
        got = need = 0
        widest: tuple[int, ...] = ()
        pieces: dict[str, int] = {}
        halos = [m for m in module.modules() if isinstance(m, (Halo, HaloOp))
                 and not m.replicated and not getattr(m, "fused", False)]
        for h in halos:
            ex = h.exchange
            per_cell = _halo_cell_bytes(module, h)
            got += ex.recv_elements() * per_cell
            need += ex.foreign_elements() * per_cell
            widest = tuple(max(a, b) for a, b in zip(widest or ex.halo_widths(),
                                                      ex.halo_widths(), strict=True))
            for kind, (count, _cells) in ex.pieces_by_kind().items():
                pieces[kind] = pieces.get(kind, 0) + count
        block = str(grid.tile_rect(image, t)) if stage == 0 and image is not None else "-"
        ratio = f"{got / need:.2f}" if need else "-"
        rows.append((str(stage), str(t), block, str(len(halos)),
                     "/".join(str(pieces.get(k, 0)) for k in kinds), nbytes(got),
                     nbytes(need), ratio, " ".join(map(str, widest))))
    lines += _columns(rows, right={3, 5, 6, 7})
    lines.append(f"(bytes per micro-batch forward; the backward sends the same amount back; "
                 f"{'/'.join(f'{k}s' for k in kinds)}: pieces received from tiles beyond this "
                 f"one along {'/'.join(str(i + 1) for i in range(len(kinds)))} dims)")
    lines += fusion_lines(program, sides)
    return "\n".join(lines)


FUSION_SHOWN = 12
"""Fused groups ``fxpar-inspect`` lists per stage (the rest are counted)."""


def fusion_lines(program: Program, sides: str) -> list[str]:
    """``Plan(halo_fusion=...)``: per spatial stage, tile 0's fused groups (their windowed
    ops, which share one exchange, and its widths)."""
    info = program.spatial
    if info is None or program.plan.halo_fusion == "off":
        return []
    lines = []
    for (stage, t), module in sorted(info.tiles.items()):
        groups: tuple[GroupInfo, ...] = module.meta.get(FUSION_KEY, ())
        if t != 0:
            continue
        ops = sum(len(g.ops) for g in groups)
        lines.append(f"halo fusion ({program.plan.halo_fusion}), stage {stage}: "
                     f"{len(groups)} group(s) share one exchange each for {ops} windowed ops "
                     f"({ops - len(groups)} exchanges fewer); tile 0's widths ({sides}):")
        lines += [f"  {' + '.join(g.ops)}: {' '.join(map(str, g.widths))}"
                  for g in groups[:FUSION_SHOWN]]
        if len(groups) > FUSION_SHOWN:
            lines.append(f"  ... {len(groups) - FUSION_SHOWN} more")
    return lines


def _input_extent(gm: fx.GraphModule) -> tuple[int, ...] | None:
    """The spatial sizes of the model's image (or volume, or sequence) input."""
    x = next((n for n in gm.graph.nodes if n.op == "placeholder"), None)
    info = meta.find(x, TensorInfo) if x is not None else None
    if info is None or len(info.shapes) != 1 or len(info.shapes[0]) not in SPATIAL_RANKS:
        return None
    return tuple(info.shapes[0][2:])


def _halo_cell_bytes(module: fx.GraphModule, halo: Halo) -> int:
    """Bytes of one (row, col) cell of the halo's input: batch x channels x element size."""
    for n in module.graph.nodes:
        if n.op == "call_module" and module.get_submodule(str(n.target)) is halo:
            return meta.get(n.args[0], TensorInfo).cell_bytes
    return 0


def rank_table(program: Program) -> str:
    """rank -> data-parallel replica, model copy, stage and tile, one row per role."""
    rows = [("rank", "dp", "copy", "stage", "tile")]
    for row in program.rank_map.describe():
        rows.append(tuple(str(row[k]) for k in ("rank", "dp", "copy", "stage", "tile")))
    return "\n".join(_columns(rows, right={0, 1, 2, 3, 4}))
