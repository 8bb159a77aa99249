"""The halo arithmetic of tools/bench_volume.py, restated from the model alone: which cells each
tile of an N-D grid must receive for every windowed layer (the minimum traffic), and what a
compiled program's exchanges plan to move. Independent of fxpar's own halo code on purpose: the
benchmark compares the two."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any


def split(extent: int, parts: int, k: int) -> tuple[int, int]:
    """Part ``k`` of ``extent`` in ``parts``: fxpar's even split (DESIGN.md), restated."""
    return (k * extent // parts, (k + 1) * extent // parts)


# -- the minimum halo traffic from the model alone (N-D restatement of bench_spatial's) -----------
@dataclass(frozen=True)
class Window:
    """One windowed layer as the model runs it: batch, channels, element size, the spatial
    extent of its input and output, and per spatial dim its kernel, stride, padding and
    dilation (``transposed``: a transposed conv, whose output o reads input (o + p - j*d) / s)."""

    name: str
    n: int
    c: int
    itemsize: int
    extent: tuple[int, ...]
    out: tuple[int, ...]
    k: tuple[int, ...]
    s: tuple[int, ...]
    p: tuple[int, ...]
    d: tuple[int, ...]
    transposed: bool
    reads_input: bool


def _tuple(v: Any, n: int) -> tuple[int, ...]:
    return tuple(int(x) for x in v) if isinstance(v, (tuple, list)) else (int(v),) * n


def windowed_layers(model: Any, shape: Sequence[int]) -> list[Window]:
    """Every conv, transposed conv, max and average pool (any number of spatial dims) a forward
    pass of ``model`` (built on ``meta``) calls, with the shapes it sees (hooks; no memory)."""
    import torch
    from torch import nn

    x = torch.empty(tuple(shape), device="meta")
    kinds = (nn.modules.conv._ConvNd, nn.modules.pooling._MaxPoolNd,
             nn.modules.pooling._AvgPoolNd)
    found: list[Window] = []

    def hook(name: str) -> Callable[..., None]:
        def record(mod: Any, inp: tuple[Any, ...], out: Any) -> None:
            t, nd = inp[0], inp[0].dim() - 2
            if isinstance(mod.padding, str):
                raise ValueError(f"{name}: padding={mod.padding!r} is not restated here")
            found.append(Window(
                name, t.shape[0], t.shape[1], t.element_size(), tuple(t.shape[2:]),
                tuple(out.shape[2:]), _tuple(mod.kernel_size, nd),
                _tuple(mod.stride or mod.kernel_size, nd), _tuple(mod.padding, nd),
                _tuple(getattr(mod, "dilation", 1), nd),
                bool(getattr(mod, "transposed", False)), t is x))
        return record

    handles = [m.register_forward_hook(hook(n)) for n, m in model.named_modules()
               if isinstance(m, kinds)]
    try:
        with torch.no_grad():
            model(x)
    finally:
        for h in handles:
            h.remove()
    return found


def reads(out: tuple[int, int], k: int, s: int, p: int, d: int, extent: int,
          transposed: bool = False) -> tuple[int, int]:
    """Input cells output cells ``[o0, o1)`` read along one dim, clipped to ``[0, extent)``.
    Forward window: ``[o0*s - p, (o1-1)*s - p + d*(k-1) + 1)``; transposed: the inputs i with
    ``o = i*s - p + j*d`` for a tap j, ``[ceil((o0 + p - d*(k-1)) / s), (o1-1+p) // s + 1)``."""
    if transposed:
        lo, hi = -(-(out[0] + p - d * (k - 1)) // s), (out[1] - 1 + p) // s + 1
    else:
        lo, hi = out[0] * s - p, (out[1] - 1) * s - p + d * (k - 1) + 1
    return (max(lo, 0), min(hi, extent))


def _len(a: tuple[int, int]) -> int:
    return max(0, a[1] - a[0])


def halo_cells(layer: Window, grid: Sequence[int]) -> list[int]:
    """Per tile (row-major over ``grid``, as fxpar numbers them), the input cells (per sample
    and channel) its outputs read that lie in the image but outside its own even share."""
    cells = []
    for pos in itertools.product(*(range(g) for g in grid)):
        outs = [split(o, g, k) for o, g, k in zip(layer.out, grid, pos, strict=True)]
        if not all(_len(o) for o in outs):
            cells.append(0)
            continue
        need = [reads(o, k, s, p, d, e, layer.transposed) for o, k, s, p, d, e in
                zip(outs, layer.k, layer.s, layer.p, layer.d, layer.extent, strict=True)]
        own = [split(e, g, k) for e, g, k in zip(layer.extent, grid, pos, strict=True)]
        inside = math.prod(_len(a) for a in need)
        mine = math.prod(_len((max(a[0], b[0]), min(a[1], b[1]))) for a, b in
                         zip(need, own, strict=True))
        cells.append(inside - mine)
    return cells


def formula_minimum(layers: list[Window], grid: Sequence[int]) -> dict[str, Any]:
    """Forward bytes each tile must receive (``per_tile``) from layers fed by other layers, and
    the total of layers that read the model input (``input``: read from the data instead)."""
    per_tile = [0] * math.prod(grid)
    from_input = 0
    for layer in layers:
        b = layer.n * layer.c * layer.itemsize
        cells = halo_cells(layer, grid)
        if layer.reads_input:
            from_input += sum(cells) * b
        else:
            per_tile = [a + c * b for a, c in zip(per_tile, cells, strict=True)]
    return {"per_tile": per_tile, "input": from_input}


# -- the compiled exchanges (what halo_table prints) -------------------------------------------
def planned_halos(program: Any) -> list[dict[str, int]]:
    """Per tile of the first spatial stage: forward bytes received (``recv``) and sent
    (``sent``) by its halo exchanges, and ``minimum``, computed as ``halo_table`` computes its
    column (the cells of each window inside the image but outside the tile). In the backward
    every halo's gradient goes back to its owner: a tile then sends ``recv`` and receives
    ``sent``. The input-reading halos (``replicated``: sliced from the data) are left out, as
    halo_table leaves them out."""

    from fxpar.core import meta
    from fxpar.core.geometry import Rect
    from fxpar.core.meta import TensorInfo
    from fxpar.runtime.spatial.ops import Halo, HaloOp

    def cell_bytes(module: Any, halo: Any) -> int:  # batch x channels x element size
        for n in module.graph.nodes:
            if n.op == "call_module" and module.get_submodule(str(n.target)) is halo:
                return meta.get(n.args[0], TensorInfo).cell_bytes
        return 0

    out = []
    for (stage, _tile), module in sorted(program.spatial.tiles.items()):
        if stage:
            continue
        rec = {"recv": 0, "sent": 0, "minimum": 0, "halos": 0}
        for h in module.modules():
            if not isinstance(h, (Halo, HaloOp)) or h.replicated:
                continue
            ex, cell = h.exchange, cell_bytes(module, h)
            inside = ex.need.intersect(Rect.whole(ex.extent))
            own = inside.intersect(ex.own) if inside is not None else None
            rec["recv"] += ex.recv_elements() * cell
            rec["sent"] += sum(r.size for _, r in ex.sends) * cell
            rec["minimum"] += ((inside.size if inside else 0) - (own.size if own else 0)) * cell
            rec["halos"] += 1
        out.append(rec)
    return out


# -- worker ---------------------------------------------------------------------------------------
