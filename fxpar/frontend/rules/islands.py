"""Per-pixel islands: blocks that leave the (N, C, H, W) layout, only act on each pixel on its
own, and come back. Two shapes occur in real CNNs:

ConvNeXt's channels-last block (H, W in dims 1, 2)::

    x = x.permute(0, 2, 3, 1)          # entry: N, H, W, C
    x = F.layer_norm(x, [C], w, b)     # normalises over C only: per pixel
    x = F.gelu(F.linear(x, w1, b1))    # acts on C only: per pixel
    x = x.permute(0, 3, 1, 2)          # exit: N, C, H, W again

ResNeSt's split attention (a channel dim split in two, H, W stay last); selective kernels and
FPN's merge (``torch.stack`` of same-shape maps, then a sum); ShuffleNet's channel shuffle (a
transpose of two dims before H and W)::

    x = x.reshape(N, R, C // R, H, W)  # entry
    x = x * attention                  # attention: N, R, C // R, 1, 1 (broadcast)
    x = x.sum(dim=1)                   # exit: N, C // R, H, W

Every op of such a block reads and writes each pixel on its own, so on a tile it is exactly
the op on that tile's pixels: the block runs on tiles as it is (a reshape with the tile's H and
W). :func:`find_islands` returns each member node (entry, inside, exit); anything else reading
a member (a reduction over H or W, a reshape that mixes them, the model output) disqualifies
the whole block, which then ends the spatial region as before.
"""

from __future__ import annotations

import torch
from torch import fx

from fxpar.core import meta
from fxpar.core.meta import TensorInfo
from fxpar.frontend.rules.aten_ops import POINTWISE, arg
from fxpar.frontend.rules.perpixel import keeps_layout, per_pixel

aten = torch.ops.aten
TO_LAST = [0, 2, 3, 1]
TO_FIRST = [0, 3, 1, 2]
Dims = tuple[int, ...]  # where H and W (D, H, W) are, counted from the end (NCHW: (-2, -1))


def _packet(n: fx.Node) -> object:
    return getattr(n.target, "overloadpacket", None) if n.op == "call_function" else None


def _shape(n: object) -> tuple[int, ...] | None:
    info = meta.find(n, TensorInfo) if isinstance(n, fx.Node) else None
    return info.shape if info is not None and len(info.shapes) == 1 else None


def _last(dims: Dims) -> bool:
    """Are the spatial dims the last ones, in order ((-2, -1), or (-3, -2, -1) for a volume)?"""
    return dims == tuple(range(-len(dims), 0))


def _swap(n: fx.Node) -> bool:
    """H and W swapped: ``transpose(2, 3)``, ``permute(0, 1, 3, 2)`` of an (N, C, H, W) value."""
    if _packet(n) is aten.transpose:
        return sorted(int(arg(n, i, 0)) % 4 for i in (1, 2)) == [2, 3]
    return _packet(n) is aten.permute and [int(d) % 4 for d in arg(n, 1, [])] == [0, 1, 3, 2]


def _entry(n: fx.Node, ranks: tuple[int, ...]) -> Dims | None:
    """Where H and W go if ``n`` starts an island from a value of one of ``ranks``, else
    None."""
    x = n.args[0] if n.args and isinstance(n.args[0], fx.Node) else None
    xs = _shape(x)
    if xs is not None and len(xs) in ranks and per_pixel(n, len(xs) - 2) and \
            not keeps_layout(n):  # x.max(dim=1), x.unsqueeze(1), x[:, 0], x.sum(0)
        return tuple(range(2 - len(xs), 0))
    if 4 not in ranks:
        return None  # the layouts below are an image's
    if xs is not None and len(xs) == 4 and _swap(n):
        return (-1, -2)
    if _packet(n) is aten.stack:  # N x C x H x W pieces stacked along a dim before H
        pieces, out = n.args[0], _shape(n)
        shapes = {_shape(a) for a in pieces}
        dim = int(arg(n, 1, 0))
        ok = out is not None and len(out) == 5 and len(shapes) == 1 and \
            None not in shapes and dim % 5 < 3
        return (-2, -1) if ok else None
    if xs is not None and len(xs) == 4 and _packet(n) is aten.permute and \
            [int(d) % 4 for d in arg(n, 1, [])] == TO_LAST:
        return (-3, -2)
    return None


def _exit(n: fx.Node, dims: Dims, member: set[fx.Node]) -> bool:
    """Does ``n`` take a member back to (N, C, H, W)?"""
    if dims == (-1, -2):
        return _swap(n)
    if _last(dims) and per_pixel(n, len(dims)) and \
            all(len(s) == len(dims) + 2 for s in meta.get(n, TensorInfo).shapes):
        return True
    if _last(dims) and _packet(n) in POINTWISE:  # x - x.sum(0): broadcast back to N, C, H, W
        out, nd = _shape(n), len(dims)
        return out is not None and len(out) == nd + 2 and all(
            s is not None and (s[-nd:] == out[-nd:] and (a in member or len(s) == nd + 2)
                               or all(v == 1 for v in s[-nd:]))
            for a, s in ((a, _shape(a)) for a in n.all_input_nodes))
    out = _shape(n)  # channels last: back by the inverse permute
    return dims == (-3, -2) and out is not None and len(out) == 4 and \
        _packet(n) is aten.permute and [int(d) % 4 for d in arg(n, 1, [])] == TO_FIRST


def _per_pixel(n: fx.Node, member: set[fx.Node], dims: Dims) -> bool:
    """Does ``n`` (reading a member) act on each pixel alone?"""
    if _last(dims) and n.args and n.args[0] in member and per_pixel(n, len(dims)):
        return True  # works on the dims before H and W (fxpar.frontend.rules.perpixel)
    if n.op != "call_function" or not isinstance(n.target, torch._ops.OpOverload):
        return False
    packet = n.target.overloadpacket
    last = dims == (-3, -2)  # channels last: ops along the last dim are per pixel
    if packet is aten.layer_norm:
        return last and len(arg(n, 1, [])) == 1  # normalised over C only
    if packet is aten.linear:
        return last and n.args[0] in member and not any(a in member for a in n.args[1:])
    if packet in (aten.transpose, aten.permute) and not last:  # ShuffleNet's channel shuffle
        x = _shape(n.args[0])
        if x is None:
            return False
        keep = [len(x) - 2, len(x) - 1]  # H and W stay where they are
        if packet is aten.transpose:
            return not {int(arg(n, i, 0)) % len(x) for i in (1, 2)} & set(keep)
        return [int(d) % len(x) for d in arg(n, 1, [])][-2:] == keep
    if packet in POINTWISE:
        for a in n.all_input_nodes:  # other operands broadcast along H and W
            shape = _shape(a)
            if a in member or a.op == "get_attr" or shape is None:
                continue
            if len(shape) >= -dims[0] and any(shape[d] > 1 for d in dims):
                return False
        return True
    return False


def find_islands(gm: fx.GraphModule, ndim: int = 2) -> dict[fx.Node, str]:
    """Members of every per-pixel island: node -> "entry" | "inside" | "exit". ``ndim``: the
    model input's spatial dims; a sequence's islands (1) start from (N, C, L) values only (a
    3-D value of an image model is a token layout's, fxpar.frontend.rules.tokens), an image's
    or a volume's (2, 3) from (N, C, H, W) and (N, C, D, H, W) values."""
    ranks = (3,) if ndim == 1 else (4, 5)
    out: dict[fx.Node, str] = {}
    for entry in gm.graph.nodes:
        dims = _entry(entry, ranks)
        if dims is None:
            continue
        members, exits, todo, ok = {entry}, set(), [entry], True
        while todo and ok:
            for user in todo.pop().users:
                if user in members or user in exits:
                    continue
                if _exit(user, dims, members):
                    exits.add(user)
                elif _per_pixel(user, members, dims):
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
