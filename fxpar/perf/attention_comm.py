"""What attention over split tokens sends, per node of the analysed graph: ring attention's
blocks and gathered attention's allreduces (fxpar.runtime.spatial.attention), for the cost
model (fxpar.perf.costmodel) and the compiler's reports.

A node whose token layout (fxpar.frontend.rules.tokens) says ``ring`` or ``gather`` becomes one
``RingAttention`` or ``GatherAttention`` on each tile (fxpar.passes.tile_tokens). On P tiles,
for one rank and one chunk (E, Ev: the key and value widths; T: tokens in all; b, a: the
itemsize of the inputs and of the accumulation dtype)::

    ring     forward   P - 1 steps, each sending the K and V blocks held to the next tile and
                       receiving the next ones: 4 (P - 1) messages sent and received,
                       ``ring_bytes(...)[0]`` bytes sent
             backward  the same P - 1 steps of K and V, and P steps of the (dK, dV) partial
                       sums that follow them (acc dtype): 4 (P - 1) + 4 P messages,
                       ``ring_bytes(...)[1]`` bytes sent
    gather   forward   an allreduce of each query row's maximum (a per row) and one of the
                       rescaled sums ((Ev + 1) a per row)
             backward  an allreduce of the output's gradient (Ev b per row)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import fx

from fxpar.core import meta
from fxpar.core.geometry import Grid
from fxpar.core.meta import TensorInfo
from fxpar.frontend.rules.tokens import TokenLayout
from fxpar.passes.tile_tokens import attention_chain, key_axes, local_size
from fxpar.perf.profile import Link
from fxpar.runtime.spatial.attention import acc_dtype, ring_bytes

ATTENTION_ACTIONS = ("ring", "gather")
"""Token actions (fxpar.frontend.rules.tokens) whose rewrite is an attention over the tiles."""


@dataclass(frozen=True)
class Traffic:
    """One direction (forward or backward) of one tile op on one rank, per chunk."""

    messages: int = 0
    """Point-to-point messages sent and received."""
    sent: int = 0
    """Bytes sent point to point."""
    allreduces: tuple[int, ...] = ()
    """Bytes of each allreduce's buffer."""

    @property
    def nbytes(self) -> int:
        """Bytes this rank puts on the wire: what it sends, and each allreduce's buffer."""
        return self.sent + sum(self.allreduces)

    def seconds(self, p2p: Link, allreduce: Link, ranks: int) -> float:
        """One latency per message and the bytes sent one after another (a ring's steps wait
        for each other); an allreduce of small buffers: ``ceil(log2 ranks)`` rounds of its
        whole buffer (recursive doubling)."""
        rounds = math.ceil(math.log2(ranks)) if ranks > 1 else 0
        return (self.messages * p2p.alpha + self.sent * p2p.beta +
                sum(rounds * allreduce.seconds(b) for b in self.allreduces))


def operands(gm: fx.GraphModule, n: fx.Node) -> tuple[fx.Node, fx.Node, fx.Node]:
    """(q, k, v) of attention node ``n``: ``scaled_dot_product_attention``'s arguments, or
    those of an attention written out that ends at ``n`` (``probs @ v``)."""
    if n.target is torch.ops.aten.scaled_dot_product_attention.default:
        q, k, v = n.args[:3]
    else:
        q, k, v, _scale, _dead = attention_chain(gm, n)
    assert all(isinstance(x, fx.Node) for x in (q, k, v)), f"attention {n.name!r}"
    return q, k, v  # type: ignore[return-value]


def attention_traffic(gm: fx.GraphModule, n: fx.Node, grid: Grid, tile: int
                      ) -> tuple[Traffic, Traffic] | None:
    """(forward, backward) of attention node ``n`` of the analysed graph on ``tile`` of
    ``grid`` (module doc); None for a node that is no attention over the tiles."""
    info = meta.find(n, TokenLayout)
    if info is None or info.action not in ATTENTION_ACTIONS or grid.size < 2:
        return None
    q, k, v = operands(gm, n)
    qi, ki, vi = (meta.get(x, TensorInfo) for x in (q, k, v))
    if info.action == "ring":
        p = grid.size
        lengths = [local_size(key_axes(k), grid, u) for u in range(p)]
        forward, backward = ring_bytes(lengths, tile, math.prod(ki.shape[:-2]), ki.shape[-1],
                                       vi.shape[-1], ki.dtype)
        return Traffic(4 * (p - 1), forward), Traffic(4 * (p - 1) + 4 * p, backward)
    rows, ev = math.prod(qi.shape[:-1]), vi.shape[-1]
    a = acc_dtype(qi.dtype).itemsize
    return (Traffic(allreduces=(rows * a, rows * (ev + 1) * a)),
            Traffic(allreduces=(rows * ev * qi.dtype.itemsize,)))
