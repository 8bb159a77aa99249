"""Which ops can run on tiles, and how: pointwise, windowed, norms, reductions over H and W.

:func:`classify` looks at one node of a captured (ATen-level, fxpar.frontend.capture) graph
and returns
what the spatial passes need to know; an op it does not recognise returns None and ends the
spatial region (it is never guessed at). :func:`why_not` says, for messages, why such an op is
refused and what would run on tiles. The rules themselves are in fxpar.frontend.rules.aten_ops.
"""

from __future__ import annotations

import operator

import torch
from torch import fx

from fxpar.frontend.rules import aten_ops
from fxpar.frontend.rules.opkind import BatchNorm, Norm, Op, Pointwise, Reduce, Window
from fxpar.frontend.rules.perpixel import DIM_ARGS, keeps_layout

__all__ = ["BatchNorm", "Norm", "Op", "Pointwise", "Reduce", "Window", "classify", "why_not"]


def classify(gm: fx.GraphModule, n: fx.Node) -> Op | None:
    """How ``n`` runs on tiles, or None if it cannot (the region must end before it)."""
    if n.op == "call_module":  # fxpar's mode-following BatchNorm / dropout
        return aten_ops.classify_module(gm.get_submodule(str(n.target)), str(n.target))
    if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload):
        op = aten_ops.classify_aten(n)
        return Pointwise() if op is None and keeps_layout(n) else op
    if n.op == "call_function" and n.target is operator.getitem and \
            isinstance(n.args[0], fx.Node) and isinstance(n.args[1], int):
        return Pointwise()  # one output of a channel split (aten.split): per pixel
    return None


def why_not(gm: fx.GraphModule, n: fx.Node) -> str:
    """Why :func:`classify` refuses ``n`` and what would let it run on tiles (for messages)."""
    if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload):
        packet = n.target.overloadpacket
        if packet in DIM_ARGS and packet not in aten_ops.REDUCTIONS:
            return (f"aten.{packet.__name__} works along a spatial dim (or every dim) here; "
                    f"along the batch and channel dims only, it would run on tiles "
                    f"(fxpar.frontend.rules.perpixel)")
        return aten_ops.why_not_aten(n)
    what = type(gm.get_submodule(str(n.target))).__name__ if n.op == "call_module" else \
        getattr(n.target, "__name__", str(n.target))
    return f"fxpar does not know how {what} ({n.op}) acts on H and W, so it never guesses"
