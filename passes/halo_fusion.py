"""Halo fusion (``Plan(halo_fusion=...)``): consecutive windowed ops share one wider exchange.

Unfused, every convolution or pool of a spatial stage exchanges its own halo (and its gradient
in backward). A *fused group* is a chain ``W1 -> pointwise / BatchNorm ... -> W2 -> ... -> Wk``
of windowed ops where every value between them is read only by the next node of the chain. The
group exchanges once, before W1, the window Wk's tile needs through the whole chain; W1 ... W(k-1)
and the nodes between them then compute a *region* larger than the tile (the tile plus a border
its neighbours own, computed again here: the redundant border compute), and Wk comes back to the
tile. Inside the group each windowed op reads its window locally (``HaloOp(fused=True)``: no
messages), padding past the image with its own fill, as one device does.

Why it stays exact, gradients included: the tile's computation is still a function of the
values it receives, so autograd's chain rule holds as it is. Gradients reaching the border
cells flow back through the group on this rank and leave through the one exchange's backward
to their owners, who add them; weight gradients of the border computations stay on this rank
and are summed over the tiles with the others. Two things need care:

- BatchNorm in a group: its statistics come from the cells the tile owns only (the border is
  someone else's), while every computed cell, border included, is normalised with them and
  contributes to the parameter gradients and to the gradients of the statistics
  (``TileBatchNorm(box=...)``, fxpar.runtime.spatial.batchnorm);
- every region must contain the tile's own cells (a strided op can leave some of a tile's rows
  unread downstream; unfused, the owner still computes them for the statistics), random ops
  (dropout) never join a group (a border copy would draw another mask), and nor does anything
  that reads a second spatial tensor (a residual add ends the chain).

``"auto"`` fuses the next op into a group when, for the slowest tile, the group's one exchange
plus its redundant border compute costs less than the group so far plus the op's own exchange
(``FusionCost``: a round per exchange, a cost per message and per byte, forward and backward;
the border's FLOPs from torch's FlopCounter and its bytes, forward and backward). A fused
exchange can need *more* messages than the ops it replaces (a strided op that reads nothing
from one neighbour unfused reads from it through the chain before it), which the model sees;
``"all"`` fuses every chain it legally can (tests and studies); ``"off"`` none. A border never
reaches past the neighbouring tile. Only ``HaloOp`` kinds form groups: an op that wraps around
the image (circular padding, torch.roll) is not one (fxpar.frontend.rules.opkind.WindowKind
``wraps``), so it ends a chain; its window, read mod the extent, has no border region to
compute again.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import fx

from fxpar.core import meta
from fxpar.core.geometry import Grid, Rect, exchange
from fxpar.core.meta import NodeCost, TensorInfo
from fxpar.frontend.rules.opclass import BatchNorm, Pointwise, Window, classify
from fxpar.passes.spatial_region import SpatialLayout, window_needs


@dataclass(frozen=True)
class FusionCost:
    """What ``"auto"`` weighs, per tile, for the slowest tile. An exchange costs
    ``round_s`` (posting, waiting, the neighbours' skew) when it sends or receives anything,
    ``message_s`` per message and its bytes at ``bytes_per_s``, forward and backward; the
    border costs its FLOPs at ``flops_per_s`` and its output bytes at ``bytes_per_s``, three
    times (forward, and a backward of about twice the forward). Defaults: the order of what
    tools/bench_fusion.py measured on the 2-core CI machine (AmoebaNet-D SP4 at 1024^2: rank 0
    blocked ~0.8 ms per exchange and direction, docs/bench_notes/fusion.md) and of one core's
    convolution rate there."""

    round_s: float = 5e-4
    message_s: float = 5e-5
    flops_per_s: float = 3e10
    bytes_per_s: float = 5e9


FUSION_KEY = "fxpar.halo_fusion"
"""``gm.meta`` key of a tile module's fused groups (a tuple of :class:`GroupInfo`)."""


@dataclass(frozen=True)
class GroupInfo:
    """What ``fxpar-inspect`` shows of one fused group on one tile: its windowed ops (node
    names) and the widths of its one exchange (top bottom left right ...)."""

    ops: tuple[str, ...]
    widths: tuple[int, ...]


@dataclass(frozen=True)
class FusedRegion:
    """``node.meta`` record of a node inside a fused group (not its last windowed op).

    group: the group's number in its stage; head: the node is the group's first windowed op
    (it does the group's one exchange); regions: per tile of the grid, the region of the node's
    output the tile computes (global coordinates; contains the tile's own cells); needs (head
    only): per tile, the window of the head's input the exchange brings (may pass the image)."""

    KEY: ClassVar[str] = "fxpar.fusion"
    group: int
    head: bool
    regions: tuple[Rect, ...]
    needs: tuple[Rect, ...] = ()


@dataclass(frozen=True)
class FusedGroup:
    """One fused group: its windowed ops in order, every node of its chain, and per tile the
    window of the head's input the exchange brings."""

    ops: tuple[fx.Node, ...]
    chain: tuple[fx.Node, ...]
    needs: tuple[Rect, ...]
    regions: dict[fx.Node, tuple[Rect, ...]]

    def widths(self, grid: Grid, t: int = 0) -> tuple[int, ...]:
        """Tile ``t``'s halo widths of the one exchange (top bottom left right ...)."""
        x = self.ops[0].args[0]
        assert isinstance(x, fx.Node)
        own = grid.tile_rect(_extent(x), t)
        return tuple(w for (o0, o1), (n0, n1) in zip(own.dims, self.needs[t].dims, strict=True)
                     for w in (o0 - n0, n1 - o1))


def _extent(n: fx.Node) -> tuple[int, ...]:
    return tuple(meta.get(n, TensorInfo).shape[2:])


def _tiled(n: fx.Node) -> bool:
    lay = meta.find(n, SpatialLayout)
    return lay is not None and lay.tiled and not lay.island


def _spatial(a: fx.Node, nd: int) -> bool:
    """``a`` has a spatial extent (is not a per-channel or scalar operand)."""
    info = meta.find(a, TensorInfo)
    if info is None or len(info.shapes) != 1:
        return True
    shape = info.shape
    return len(shape) >= nd + 2 and any(s != 1 for s in shape[-nd:])


def _passes(gm: fx.GraphModule, u: fx.Node, cur: fx.Node, nd: int) -> bool:
    """Node ``u`` (the only reader of ``cur``) can sit between two windowed ops of a group."""
    if not _tiled(u):
        return False
    op = classify(gm, u)
    if isinstance(op, BatchNorm):
        return u.args[0] is cur and cur not in u.args[1:]
    if not isinstance(op, Pointwise) or u.op != "call_function" or \
            not isinstance(u.target, torch._ops.OpOverload) or \
            torch.Tag.nondeterministic_seeded in u.target.tags:
        return False
    ins = [a for a in u.all_input_nodes if a is not cur]
    return not any(_spatial(a, nd) for a in ins) and \
        sum(1 for a in fx.node.map_aggregate(u.args, lambda v: v) if a is cur) <= 1


def _next(gm: fx.GraphModule, w: fx.Node, nd: int) -> tuple[list[fx.Node], fx.Node] | None:
    """From windowed op ``w``: the nodes up to the next windowed op of a chain, and that op."""
    between: list[fx.Node] = []
    cur = w
    while True:
        users = list(cur.users)
        if len(users) != 1:
            return None
        u = users[0]
        op = classify(gm, u)
        if isinstance(op, Window):
            if op.rule.halo_op and _tiled(u) and u.args[0] is cur and \
                    cur not in u.args[1:]:
                return between, u
            return None
        if not _passes(gm, u, cur, nd):
            return None
        between.append(u)
        cur = u


def _regions(gm: fx.GraphModule, grid: Grid, chain: list[fx.Node]
             ) -> tuple[tuple[Rect, ...], dict[fx.Node, tuple[Rect, ...]]] | None:
    """Per tile, the head's input window and every chain node's region (the last op's is its
    tile); None when a region misses own cells or a border passes the neighbouring tile."""
    regions: dict[fx.Node, list[Rect]] = {}
    needs: list[Rect] = []
    for u in range(grid.size):
        region = grid.tile_rect(_extent(chain[-1]), u)
        for n in reversed(chain):
            own = grid.tile_rect(_extent(n), u)
            if n is not chain[-1]:
                if region.intersect(own) != own or any(
                        o0 - r0 > o1 - o0 or r1 - o1 > o1 - o0
                        for (o0, o1), (r0, r1) in zip(own.dims, region.dims, strict=True)):
                    return None
                regions.setdefault(n, []).append(region)
            op = classify(gm, n)
            if isinstance(op, Window):
                need = Rect(*(op.needs(iv, i) for i, iv in enumerate(region.dims)))
                if n is chain[0]:
                    needs.append(need)
                else:
                    x = n.args[0]
                    assert isinstance(x, fx.Node)
                    inside = need.intersect(Rect.whole(_extent(x)))
                    if inside is None:
                        return None
                    region = inside
    return tuple(needs), {n: tuple(r) for n, r in regions.items()}


def _border_seconds(chain: list[fx.Node], regions: dict[fx.Node, tuple[Rect, ...]],
                    grid: Grid, u: int, cost: FusionCost) -> float:
    """Tile ``u``'s redundant border compute of a chain (the cells of its regions beyond the
    tile), forward and backward."""
    total = 0.0
    for n in chain[:-1]:
        c = meta.find(n, NodeCost)
        whole = Rect.whole(_extent(n)).size
        if c is None or not whole:
            continue
        border = regions[n][u].size - grid.tile_rect(_extent(n), u).size
        total += border / whole * (c.flops / cost.flops_per_s + c.out_bytes / cost.bytes_per_s)
    return 3 * total


def _exchange_seconds(x: fx.Node, grid: Grid, needs: list[Rect] | tuple[Rect, ...], u: int,
                      cost: FusionCost) -> float:
    """Tile ``u``'s cost of exchanging ``needs`` of ``x``, forward and backward (nothing when
    every rank holds ``x`` whole: the model's input image)."""
    if not _tiled(x):
        return 0.0
    ex = exchange(grid, _extent(x), list(needs), u)
    msgs = len(ex.recvs) + len(ex.sends)
    cell = meta.get(x, TensorInfo).cell_bytes
    cells = ex.recv_elements() + sum(r.size for _, r in ex.sends)
    return 2 * ((cost.round_s if msgs else 0.0) + msgs * cost.message_s +
                cells * cell / cost.bytes_per_s)


def _alone(gm: fx.GraphModule, grid: Grid, w: fx.Node, u: int, cost: FusionCost) -> float:
    """Tile ``u``'s exchange cost of windowed op ``w`` on its own (unfused)."""
    op = classify(gm, w)
    assert isinstance(op, Window)
    x = w.args[0]
    assert isinstance(x, fx.Node)
    return _exchange_seconds(x, grid, window_needs(grid, w, op), u, cost)


def _fused_seconds(gm: fx.GraphModule, grid: Grid, chain: list[fx.Node],
                   found: tuple[tuple[Rect, ...], dict[fx.Node, tuple[Rect, ...]]], u: int,
                   cost: FusionCost) -> float:
    """Tile ``u``'s cost of a fused chain: its one exchange and its border compute."""
    x = chain[0].args[0]
    assert isinstance(x, fx.Node)
    return _exchange_seconds(x, grid, found[0], u, cost) + \
        _border_seconds(chain, found[1], grid, u, cost)


def fusion_groups(gm: fx.GraphModule, grid: Grid, mode: str,
                  cost: FusionCost | None = None) -> list[FusedGroup]:
    """The fused groups of spatial stage ``gm`` on ``grid`` (the same on every tile)."""
    if mode == "off" or grid.size < 2:
        return []
    cost = cost or FusionCost()
    nd = grid.ndim
    groups: list[FusedGroup] = []
    taken: set[fx.Node] = set()
    for n in gm.graph.nodes:
        if n in taken or n.op != "call_function" or not _tiled(n):
            continue
        op = classify(gm, n)
        if not isinstance(op, Window) or not op.rule.halo_op:  # a group holds HaloOps
            continue
        chain, ops, best = [n], [n], None
        now = [_alone(gm, grid, n, u, cost) for u in range(grid.size)]  # per tile
        while (step := _next(gm, chain[-1], nd)) is not None:
            between, w = step
            cand = [*chain, *between, w]
            found = _regions(gm, grid, cand)
            if found is None:
                break
            fused = [_fused_seconds(gm, grid, cand, found, u, cost) for u in range(grid.size)]
            unfused = [t + _alone(gm, grid, w, u, cost) for u, t in enumerate(now)]
            if mode == "auto" and max(fused) >= max(unfused):  # the slowest tile sets the pace
                break
            chain, ops, best, now = cand, [*ops, w], found, fused
        if best is not None:
            groups.append(FusedGroup(tuple(ops), tuple(chain), best[0], best[1]))
            taken.update(ops)
    for i, g in enumerate(groups):
        for n, regions in g.regions.items():
            meta.put(n, FusedRegion(i, n is g.ops[0], regions,
                                    g.needs if n is g.ops[0] else ()))
    return groups
