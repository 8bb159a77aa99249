"""Readable tables of an analysed graph (what ``fxpar-inspect`` prints)."""

from __future__ import annotations

from torch import fx, nn

from fxpar import meta
from fxpar.meta import NodeCost, TensorInfo
from fxpar.trace import totals


def si(n: float, unit: str = "") -> str:
    """``1.5e9 -> '1.50 G'`` (decimal prefixes, for FLOPs)."""
    for prefix, scale in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {prefix}{unit}"
    return f"{n:.0f} {unit}".rstrip()


def nbytes(n: float) -> str:
    """``1536 -> '1.50 KiB'`` (binary prefixes, for memory)."""
    for prefix, scale in (("Ti", 2**40), ("Gi", 2**30), ("Mi", 2**20), ("Ki", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {prefix}B"
    return f"{n:.0f} B"


def op_name(gm: fx.GraphModule, n: fx.Node) -> str:
    """What a node does, in a few characters: module type, function or method name."""
    if n.op == "call_module":
        mod: nn.Module = gm.get_submodule(str(n.target))
        return type(mod).__name__
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


def node_table(gm: fx.GraphModule) -> str:
    """One row per node: index, name, op, output shape, FLOPs, output bytes, parameter bytes."""
    rows = [("#", "node", "op", "output", "FLOPs", "out bytes", "params")]
    for i, n in enumerate(gm.graph.nodes):
        c = meta.find(n, NodeCost) or NodeCost(0, 0, 0)
        rows.append((str(i), n.name, op_name(gm, n), shape_text(n),
                     si(c.flops) if c.flops else "0", nbytes(c.out_bytes),
                     nbytes(c.param_bytes) if c.param_bytes else "0"))
    widths = [max(len(r[k]) for r in rows) for k in range(len(rows[0]))]
    right = {0, 4, 5, 6}
    lines = []
    for r in rows:
        cells = [v.rjust(w) if k in right else v.ljust(w)
                 for k, (v, w) in enumerate(zip(r, widths, strict=True))]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)


def totals_line(gm: fx.GraphModule) -> str:
    t = totals(gm)
    params = sum(p.numel() * p.element_size() for p in gm.parameters())
    return (f"total: {si(t.flops, 'FLOP')} forward, {nbytes(t.out_bytes)} of node outputs, "
            f"{nbytes(params)} of parameters ({sum(p.numel() for p in gm.parameters()):,} "
            f"values)")
