"""Ops that work on the batch and channel dims only: each pixel on its own, so exact on tiles.

A tiled value keeps its spatial dims (H, W; or D, H, W) last. An op whose dims of work all lie
before them, and whose outputs end in the same spatial dims, reads and writes each pixel on its
own: on a tile it is the op on the tile's pixels (with the tile's sizes where the op names
them: reshape, view, expand). That covers:

- adding and removing size-1 dims (``unsqueeze``, ``squeeze``), views and reshapes that merge
  or split the batch and channel dims only, ``expand`` along them;
- picking channels (``select``, ``index_select``, indexing ``x[:, idx]``, ``gather`` along C);
- reductions and scans over channels or the batch, with or without ``keepdim``: ``max``/``min``
  (values and indices), ``argmax``, ``amax``, ``sum``, ``mean``, ``var``, ``std``, vector
  norms, ``logsumexp``, ``softmax``, ``sort``, ``cumsum``, ``flip``.

``RULES`` is the table, one entry per op: where its dim argument is (and its default), or a
check of its own. Where an op's output keeps the input's rank it stays a plain tiled value
(fxpar.frontend.rules.opclass: Pointwise); where it changes the rank (``x.max(dim=1)`` is
N x H x W) the value lives in a per-pixel island (fxpar.frontend.rules.islands) until an op of
this table brings it back to (N, C, H, W).
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from typing import Any

import torch
from torch import fx

from fxpar.core import meta
from fxpar.core.meta import TensorInfo
from fxpar.frontend.rules.aten_ops import arg
from fxpar.frontend.rules.opkind import SPATIAL_RANKS

aten = torch.ops.aten

ALL = object()
"""A dim argument's default that means every dim (a reduction over everything)."""

DIM_ARGS: dict[Any, tuple[int, Any]] = {
    # reductions (keepdim or not) and scans: the position of ``dim`` and its default
    aten.sum: (1, ALL), aten.mean: (1, ALL), aten.amax: (1, ALL), aten.amin: (1, ALL),
    aten.max: (1, ALL), aten.min: (1, ALL), aten.argmax: (1, ALL), aten.argmin: (1, ALL),
    aten.logsumexp: (1, ALL), aten.var: (1, ALL), aten.std: (1, ALL),
    aten.linalg_vector_norm: (2, ALL), aten.softmax: (1, ALL), aten._softmax: (1, ALL),
    aten.log_softmax: (1, ALL), aten._log_softmax: (1, ALL), aten.sort: (1, -1),
    aten.argsort: (1, -1), aten.cumsum: (1, ALL), aten.flip: (1, ALL),
    # picking along one dim
    aten.select: (1, ALL), aten.index_select: (1, ALL), aten.gather: (1, ALL),
    # size-1 dims
    aten.unsqueeze: (1, ALL), aten.squeeze: (1, ALL),
}
"""Ops that work along the dims their ``dim`` argument names."""

SIZED = {aten.reshape, aten.view, aten._unsafe_view, aten.expand}
"""Ops given the output's sizes: per pixel when those end in the spatial sizes (a tile
substitutes its own)."""


def _shapes(n: Any) -> list[tuple[int, ...]]:
    info = meta.find(n, TensorInfo) if isinstance(n, fx.Node) else None
    return [tuple(s) for s in info.shapes] if info is not None else []


def _dims(v: Any, rank: int) -> list[int] | None:
    """A dim argument as dims 0..rank-1 (None: every dim, or not a plain dim)."""
    if v is None or v is ALL or isinstance(v, (bool, fx.Node)) or \
            (isinstance(v, (list, tuple)) and not v):
        return None
    return [int(d) % rank for d in ([v] if isinstance(v, int) else v)]


def _dim_arg(n: fx.Node, rank: int) -> list[int] | None:
    """The dims a :data:`DIM_ARGS` op ``n`` works along, as 0..rank-1; None for every dim, or
    for an overload without a dim argument there (max of two tensors, var's unbiased flag)."""
    pos, default = DIM_ARGS[n.target.overloadpacket]
    names = [a.name for a in n.target._schema.arguments]
    if pos >= len(names) or names[pos] not in ("dim", "dims"):
        return None
    return _dims(arg(n, pos, default), rank)


def _by_dim(n: fx.Node, x: tuple[int, ...], nd: int) -> bool:
    if n.target.overloadpacket is aten.squeeze and \
            "dim" not in [a.name for a in n.target._schema.arguments]:
        return True  # squeeze every size-1 dim: the output check keeps the spatial dims
    rank = len(x) + 1 if n.target.overloadpacket is aten.unsqueeze else len(x)
    dims = _dim_arg(n, rank)
    if dims is None:
        return False
    lead = rank - nd  # the dims before the spatial ones
    if n.target.overloadpacket is aten.gather:  # the index must cover the same pixels
        index = _shapes(n.args[2])
        if len(index) != 1 or index[0][-nd:] != x[-nd:]:
            return False
    return all(d < lead for d in dims)


def _sized(n: fx.Node, x: tuple[int, ...], nd: int) -> bool:
    sizes = [int(s) for s in arg(n, 1, [])]
    if len(sizes) < nd:
        return False
    tail = sizes[-nd:]
    if n.target.overloadpacket is aten.expand:
        return all(s in (-1, e) for s, e in zip(tail, x[-nd:], strict=True))
    lead = sizes[:-nd]
    if tail != list(x[-nd:]) or lead.count(-1) > 1:
        return False
    return -1 in lead or math.prod(lead) == math.prod(x[:-nd])


def _index(n: fx.Node, x: tuple[int, ...], nd: int) -> bool:
    """``x[:, idx]``: tensor indices on dims before the spatial ones only."""
    indices = [i for i in arg(n, 1, []) if i is not None]
    return len(arg(n, 1, [])) <= len(x) - nd and bool(indices) and \
        all(len(s) == 1 for i in indices for s in _shapes(i) or [()])


RULES: dict[Any, Callable[[fx.Node, tuple[int, ...], int], bool]] = {
    **{op: _by_dim for op in DIM_ARGS}, **{op: _sized for op in SIZED}, aten.index: _index,
}


def per_pixel(n: fx.Node, nd: int) -> bool:
    """Does ``n`` work on the dims before the last ``nd`` of its first input only, with every
    output ending in the same ``nd`` spatial dims? (getitem of a tuple output: yes.)"""
    if n.op == "call_function" and n.target is operator.getitem:
        return isinstance(n.args[1], int)
    if n.op != "call_function" or not isinstance(n.target, torch._ops.OpOverload):
        return False
    rule = RULES.get(n.target.overloadpacket)
    x = _shapes(n.args[0]) if n.args else []
    if rule is None or len(x) != 1 or len(x[0]) < nd:
        return False
    outs = _shapes(n)
    if not outs or any(len(s) < nd or s[-nd:] != x[0][-nd:] for s in outs):
        return False
    return rule(n, x[0], nd)


def keeps_layout(n: fx.Node) -> bool:
    """:func:`per_pixel` on an (N, C, H, W), (N, C, D, H, W) or (N, C, L) value, giving values
    of the same rank: a plain tiled op."""
    x = _shapes(n.args[0]) if n.args and isinstance(n.args[0], fx.Node) else []
    if len(x) != 1 or len(x[0]) not in SPATIAL_RANKS:
        return False
    rank = len(x[0])
    return per_pixel(n, rank - 2) and all(len(s) == rank for s in _shapes(n))


def mixes_samples(n: fx.Node) -> bool:
    """Does ``n`` reduce, scan or pick along the batch dim of an (N, C, ...) image value
    (``x.mean(0)``, ``x.softmax(0)``, ``x[0]``)? Its result then depends on which samples are
    in the batch: a micro-batch or a data-parallel replica sees only its own."""
    if n.op != "call_function" or not isinstance(n.target, torch._ops.OpOverload):
        return False
    packet = n.target.overloadpacket
    x = _shapes(n.args[0]) if n.args else []
    if packet not in DIM_ARGS or packet in (aten.unsqueeze, aten.squeeze) or len(x) != 1 or \
            len(x[0]) not in SPATIAL_RANKS:
        return False
    dims = _dim_arg(n, len(x[0]))
    return dims is not None and 0 in dims
