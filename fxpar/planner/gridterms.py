"""The planner's fast estimate, per tile grid (fxpar.planner.planspace): per compute node of
the analysed model, its halo messages on the middle tile (``costmodel.halo_messages``), the
runtime's tile ops and statistics, and its attention messages (``attention_comm.
attention_traffic``: a ring's K and V blocks, forward and backward, their bytes sent one after
another), as the full cost model (fxpar.perf.costmodel) charges them on a compiled program."""

from __future__ import annotations

import math
from dataclasses import dataclass

from torch import fx

from fxpar.core import meta
from fxpar.core.geometry import Grid
from fxpar.core.meta import TensorInfo
from fxpar.core.plan import PlanError
from fxpar.passes.split_stages import compute_nodes
from fxpar.perf.attention_comm import Traffic, attention_traffic
from fxpar.perf.costmodel import _middle_tile, _tile_bytes, halo_messages
from fxpar.perf.profile import Profile


@dataclass(frozen=True)
class Halos:
    """One tile grid's halo terms per compute node, per sample: latency seconds (messages x
    alpha, tile-op and statistics costs included), bytes of the largest message, bytes the
    halo keeps for backward (its window: the tile's part of the input and what it received, as
    ``memory.halo_bytes`` counts a plain ``Halo``)."""

    fixed: tuple[float, ...]
    largest: tuple[int, ...]
    received: tuple[int, ...]
    tiled: tuple[bool, ...]
    """Tiled on this grid: the analysis' region, ended at the first output too small to give
    every tile a cell (the rest is replicated, as the spatial region pass does)."""
    ops: tuple[float, ...]
    """The runtime's fixed seconds of the node's tile op (``Profile.tile_op`` of no bytes)."""
    op_per_sample: tuple[float, ...]
    """... and its seconds per sample of the tile (slowed down like compute)."""
    ring_fixed: tuple[tuple[float, ...], tuple[float, ...]] = ((), ())
    """(forward, backward) latency seconds of the node's ring / gathered attention messages
    (``attention_comm.attention_traffic``); 0 for other nodes."""
    ring_bytes: tuple[tuple[int, ...], tuple[int, ...]] = ((), ())
    """... and the bytes they put on the wire per sample, one message after another."""


NO_TRAFFIC = (Traffic(), Traffic())


def grid_terms(gm: fx.GraphModule, shape: tuple[int, ...], profile: Profile,
               tiled_nodes: list[bool], norms: list[bool], grid: Grid) -> Halos | None:
    """The :class:`Halos` of ``grid`` for analysed graph ``gm`` of input ``shape`` (its compute
    nodes tiled or not, norms or not); None when its tiles are too small for some window."""
    ndim = len(shape) - 2
    if not grid.fits(tuple(shape[2:])):
        return None
    tile = _middle_tile(grid)
    p2p, ar = profile.p2p_intra, profile.allreduce_intra
    fixed, largest, received, flags = [], [], [], []
    ring_fixed: tuple[list[float], list[float]] = ([], [])
    ring_bytes: tuple[list[int], list[int]] = ([], [])
    ops: list[float] = []
    per_sample: list[float] = []
    ended = False
    for n, tiled, norm in zip(compute_nodes(gm), tiled_nodes, norms, strict=True):
        info = meta.find(n, TensorInfo)
        if tiled and info is not None and len(info.shapes) == 1 and \
                len(info.shape) == 2 + ndim and \
                not grid.fits(tuple(info.shape[2:])):
            ended = True
        tiled = tiled and not ended
        count, big, recv = 0, 0, 0
        if tiled:
            try:
                count, big, recv = halo_messages(gm, n, grid, tile)
            except (ValueError, AssertionError, PlanError):
                return None  # a window larger than the neighbouring tile
        op = bool(count or (tiled and norm))  # a tile op: the runtime's work, per sample
        tile_bytes = _tile_bytes(n, 1.0 / grid.size) if op else 0.0  # its input's tile
        if count:  # a Halo keeps its whole window: the tile and what it received
            recv += int(tile_bytes)
        f = count * p2p.alpha
        ring = (attention_traffic(gm, n, grid, tile) if tiled else None) or NO_TRAFFIC
        for d, tr in enumerate(ring):  # one sample's K and V blocks, one after another
            ring_fixed[d].append(tr.messages * p2p.alpha)
            ring_bytes[d].append(tr.nbytes)
        ops.append(profile.tile_op(0.0) if op else 0.0)
        per_sample.append(profile.tile_op(tile_bytes) - ops[-1] if op else 0.0)
        if tiled and norm:
            f += math.ceil(math.log2(grid.size)) * ar.alpha
        fixed.append(f)
        largest.append(big)
        received.append(recv)
        flags.append(tiled)
    return Halos(tuple(fixed), tuple(largest), tuple(received), tuple(flags), tuple(ops),
                 tuple(per_sample), (tuple(ring_fixed[0]), tuple(ring_fixed[1])),
                 (tuple(ring_bytes[0]), tuple(ring_bytes[1])))
