"""Channels-last islands: ``permute(0, 2, 3, 1)`` ... ``permute(0, 3, 1, 2)`` blocks whose ops
only act along the last (channel) dim, as in ConvNeXt::

    x = x.permute(0, 2, 3, 1)          # entry: N, H, W, C
    x = F.layer_norm(x, [C], w, b)     # normalises over C only: per pixel
    x = F.gelu(F.linear(x, w1, b1))    # acts on C only: per pixel
    x = F.linear(x, w2, b2)
    x = x.permute(0, 3, 1, 2)          # exit: N, C, H, W again

Every op of such a block reads and writes each pixel on its own, so on a tile it is exactly
the op on that tile's pixels: the block runs on tiles as it is, with H and W in dims 1 and 2
instead of 2 and 3. :func:`find_islands` returns each member node (entry, inside, exit) of the
blocks of that shape; anything else reading a member (a reshape, a reduction over H or W, the
model output) disqualifies the whole block, which then ends the spatial region as before.
"""

from __future__ import annotations

import torch
from torch import fx

from fxpar import meta
from fxpar.meta import TensorInfo
from fxpar.spatial.aten_ops import POINTWISE, arg

aten = torch.ops.aten
TO_LAST = [0, 2, 3, 1]
TO_FIRST = [0, 3, 1, 2]


def _perm(n: fx.Node) -> list[int] | None:
    if n.op != "call_function" or getattr(n.target, "overloadpacket", None) is not aten.permute:
        return None
    return [int(d) % 4 for d in arg(n, 1, [])]


def _shape(n: object) -> tuple[int, ...] | None:
    info = meta.find(n, TensorInfo) if isinstance(n, fx.Node) else None
    return info.shape if info is not None and len(info.shapes) == 1 else None


def _per_pixel(n: fx.Node, member: set[fx.Node]) -> bool:
    """Does ``n`` (reading a channels-last member) act on each pixel alone?"""
    if n.op != "call_function" or not isinstance(n.target, torch._ops.OpOverload):
        return False
    packet = n.target.overloadpacket
    if packet is aten.layer_norm:
        return len(arg(n, 1, [])) == 1  # normalised over C only
    if packet is aten.linear:
        return n.args[0] in member and not any(a in member for a in n.args[1:])
    if packet in POINTWISE:
        for a in n.all_input_nodes:  # other operands broadcast along H and W
            shape = _shape(a)
            if a not in member and a.op != "get_attr" and shape is not None and \
                    any(s > 1 for s in shape[-3:-1]) and len(shape) >= 3:
                return False
        return True
    return False


def find_islands(gm: fx.GraphModule) -> dict[fx.Node, str]:
    """Members of every channels-last island: node -> "entry" | "inside" | "exit"."""
    out: dict[fx.Node, str] = {}
    for entry in gm.graph.nodes:
        shape = _shape(entry)
        if _perm(entry) != TO_LAST or shape is None or len(shape) != 4:
            continue
        members, exits, todo, ok = {entry}, set(), [entry], True
        while todo and ok:
            for user in todo.pop().users:
                if user in members or user in exits:
                    continue
                if _perm(user) == TO_FIRST:
                    exits.add(user)
                elif _per_pixel(user, members):
                    members.add(user)
                    todo.append(user)
                else:
                    ok = False
                    break
        if ok and exits:
            out.update({m: "inside" for m in members})
            out[entry] = "entry"
            out.update({x: "exit" for x in exits})
    return out
