"""How ATen ops (the graph ``torch.export`` captures, see fxpar.frontend.capture) run on tiles.

The ATen ops that real CNNs use form a small closed set; each is one entry here, mapped to the
op classes of fxpar.frontend.rules.opclass
(Pointwise, Window, BatchNorm, Norm, Reduce). An op that is not
listed returns None and ends the spatial region: it is never guessed at.

Argument positions follow the ATen schemas (``torch.ops.aten.conv2d.default._schema``); a
trailing argument left at its default is absent from ``node.args``, so every read goes through
:func:`_arg` with the schema's default.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import fx

from fxpar.core import meta
from fxpar.core.meta import TensorInfo
from fxpar.frontend.rules.opkind import BatchNorm, Norm, Op, Pointwise, Reduce, Window
from fxpar.runtime.modules import BatchNormOp, DropoutOp
from fxpar.runtime.spatial.interp import PADS, AxisMap

aten = torch.ops.aten

POINTWISE = {getattr(aten, name) for name in (
    # activations and their in-place forms
    "relu", "relu_", "relu6", "silu", "silu_", "sigmoid", "sigmoid_", "tanh", "tanh_", "gelu",
    "gelu_", "hardswish", "hardswish_", "hardsigmoid", "hardsigmoid_", "hardtanh", "hardtanh_",
    "leaky_relu", "leaky_relu_", "elu", "elu_", "mish", "mish_", "softplus", "prelu", "selu",
    "selu_", "celu", "celu_", "log_sigmoid", "threshold", "threshold_",
    # arithmetic
    "add", "add_", "sub", "sub_", "mul", "mul_", "div", "div_", "neg", "abs", "exp", "log",
    "sqrt", "rsqrt", "pow", "clamp", "clamp_", "clamp_min", "clamp_max", "reciprocal",
    "maximum", "minimum", "where",
    # copies and casts
    "clone", "contiguous", "alias", "detach", "_to_copy", "to", "type_as",
)}
"""Ops whose output cell reads the same cell of each input (broadcasting allowed)."""

CHANNEL_SPLITS = {aten.split, aten.split_with_sizes, aten.unsafe_split, aten.chunk,
                  aten.tensor_split}
"""Channel splits (CSPNet, Res2Net, MixConv, selective kernels): one output per piece, each
read per pixel through ``getitem``. ``dim`` is their argument 2."""

CHANNEL_SLICES = {aten.slice: 1, aten.narrow: 1}
"""Slices of the channel (or batch) dim (DPN, ReXNet): the position of ``dim``."""

REDUCTIONS = {aten.mean: "mean", aten.sum: "sum", aten.amax: "amax"}
"""Reductions: over H and W of the whole image (replicated result), or over channels only
with ``keepdim`` (CBAM's spatial attention: per pixel)."""


def arg(n: fx.Node, i: int, default: Any) -> Any:
    """Argument ``i`` of ``n`` by its schema position (or its keyword), else ``default``."""
    if len(n.args) > i:
        return n.args[i]
    target = n.target
    if isinstance(target, torch._ops.OpOverload):
        names = [a.name for a in target._schema.arguments]
        if i < len(names) and names[i] in n.kwargs:
            return n.kwargs[names[i]]
    return default


def _pair(v: Any) -> tuple[int, int]:
    if isinstance(v, int):
        return (v, v)
    v = list(v)
    return (int(v[0]), int(v[-1])) if len(v) in (1, 2) else (int(v[-2]), int(v[-1]))


def _shape(n: Any) -> tuple[int, ...] | None:
    info = meta.find(n, TensorInfo) if isinstance(n, fx.Node) else None
    return info.shape if info is not None and len(info.shapes) == 1 else None


def classify_module(m: torch.nn.Module, path: str) -> Op | None:
    """fxpar's own mode-following modules (fxpar.frontend.capture) in a captured graph."""
    if isinstance(m, BatchNormOp):
        return BatchNorm(path)
    if isinstance(m, DropoutOp):
        return Pointwise()
    return None


def classify_aten(n: fx.Node) -> Op | None:
    """How the ATen op ``n`` runs on tiles, or None."""
    f = n.target
    if not isinstance(f, torch._ops.OpOverload):
        return None
    packet = f.overloadpacket
    if packet in POINTWISE:
        return Pointwise()
    if packet is aten.cat:
        return Pointwise() if arg(n, 1, 0) in (0, 1, -3, -4) else None
    if packet in CHANNEL_SPLITS or packet in CHANNEL_SLICES:
        x = _shape(n.args[0])
        dim = arg(n, CHANNEL_SLICES.get(packet, 2), 0)
        return Pointwise() if x is not None and len(x) == 4 and dim % 4 in (0, 1) else None
    if packet is aten.expand_as:  # a broadcast value (ECA's N x C x 1 x 1) to the image
        return Pointwise()
    if packet in REDUCTIONS:
        return _reduction(n, REDUCTIONS[packet])
    if packet is aten.conv2d:
        padding = arg(n, 4, 0)
        if isinstance(padding, str):
            return None
        w = _shape(n.args[1])
        assert w is not None
        return Window("conv", (w[2], w[3]), _pair(arg(n, 3, 1)), _pair(padding),
                      _pair(arg(n, 5, 1)))
    if packet is aten.convolution:
        return _convolution(n)
    if packet is aten.conv_transpose2d:
        w = _shape(n.args[1])
        assert w is not None
        return _transposed((w[2], w[3]), _pair(arg(n, 3, 1)), _pair(arg(n, 4, 0)),
                           _pair(arg(n, 5, 0)), _pair(arg(n, 7, 1)))
    if packet is aten.max_pool2d:
        k, s = _pair(arg(n, 1, None)), arg(n, 2, None)
        return Window("maxpool", k, _pair(s) if s else k,
                      _pair(arg(n, 3, 0)), _pair(arg(n, 4, 1)), fill=-math.inf,
                      attrs=(("ceil_mode", bool(arg(n, 5, False))),))
    if packet is aten.avg_pool2d:
        k, s = _pair(arg(n, 1, None)), arg(n, 2, None)
        return Window("avgpool", k, _pair(s) if s else k,
                      _pair(arg(n, 3, 0)),
                      attrs=(("ceil_mode", bool(arg(n, 4, False))),
                             ("count_include_pad", bool(arg(n, 5, True))),
                             ("divisor_override", arg(n, 6, None))))
    if packet in (aten.constant_pad_nd, aten.pad):
        return _pad(n)
    if packet in (aten.upsample_nearest2d, aten.upsample_bilinear2d):
        return _upsample(n)
    if packet is aten.group_norm:
        return Norm(int(arg(n, 1, 1)), float(arg(n, 4, 1e-5)), 2, 3)
    if packet is aten.instance_norm:
        x = _shape(n.args[0])
        if x is None or arg(n, 3, None) is not None or not arg(n, 5, True):
            return None  # running statistics: mode-dependent, not handled on tiles
        return Norm(x[1], float(arg(n, 7, 1e-5)), 1, 2)
    if packet is aten.adaptive_avg_pool2d:
        return _adaptive(n)
    return None


def _reduction(n: fx.Node, kind: str) -> Op | None:
    """sum / mean / amax over dims: over exactly H and W a :class:`Reduce` (replicated);
    over the channel dim with ``keepdim`` per pixel; anything else is not tiled."""
    x = _shape(n.args[0])
    dims = arg(n, 1, None)
    if x is None or len(x) != 4 or dims is None or n.target in (aten.sum.default,
                                                                  aten.mean.default):
        return None  # a reduction over everything
    dims = sorted(d % 4 for d in ([dims] if isinstance(dims, int) else dims))
    keepdim = bool(arg(n, 2, False))
    if arg(n, 3, None) is not None:
        return None  # a dtype argument: not handled
    if dims == [2, 3]:
        return Reduce(kind, keepdim)
    return Pointwise() if dims == [1] and keepdim else None


def _convolution(n: fx.Node) -> Op | None:
    w = _shape(n.args[1])
    assert w is not None
    if len(w) != 4:
        return None
    stride, padding, dilation = (_pair(arg(n, i, 1 if i != 4 else 0)) for i in (3, 4, 5))
    if not arg(n, 6, False):
        return Window("conv", (w[2], w[3]), stride, padding, dilation)
    return _transposed((w[2], w[3]), stride, padding, _pair(arg(n, 7, 0)), dilation)


def _transposed(k: tuple[int, int], s: tuple[int, int], p: tuple[int, int],
                output_padding: tuple[int, int], d: tuple[int, int]) -> Op | None:
    if any(d[i] * (k[i] - 1) < s[i] - 1 for i in range(2)):
        return None  # output rows no tap reaches: not handled
    # output_padding only lengthens the output; its rows read the zero fill past the border
    return Window("convT", k, s, p, d, attrs=(("output_padding", output_padding),))


def _pad(n: fx.Node) -> Op | None:
    mode = arg(n, 2, "constant") if n.target.overloadpacket is aten.pad else "constant"
    pad = list(arg(n, 1, []))
    if not any(pad):
        return Pointwise()  # padding by nothing (MONAI's UpCat when the sizes already match)
    left, right, top, bottom = (pad + [0, 0, 0, 0])[:4]
    if len(pad) > 4:  # the channel (or batch) dims too: per pixel if H and W are not padded
        plain = mode == "constant" and not any(pad[:4]) and len(pad) <= 8
        return Pointwise() if plain else None
    if mode in PADS:  # an index map per dim (fxpar.runtime.spatial.interp): border tiles pad
        x, out = _shape(n.args[0]), _shape(n)
        if x is None or out is None or len(x) != 4:
            return None
        maps = tuple(AxisMap(mode, False, x[i], out[i], None, before)
                     for i, before in ((2, top), (3, left)))
        return Window("interp", (1, 1), (1, 1), (0, 0), attrs=(("maps", maps),))
    if mode != "constant":
        return None  # circular: a tile at one border would read the other
    value = arg(n, 3 if n.target.overloadpacket is aten.pad else 2, 0.0)
    return Window("pad", (1, 1), (1, 1), (top, left), fill=float(value or 0.0),
                  attrs=(("pad", (left, right, top, bottom)),))


def _adaptive(n: fx.Node) -> Op | None:
    """Adaptive average pooling: to 1x1 a global mean; to a size that divides the input an
    average pool with kernel = stride = input / output (the same bins, tiled); else its bins
    overlap and vary in size: summed from the tiles into a replicated output."""
    out, x = _pair(arg(n, 1, None)), _shape(n.args[0])
    if out == (1, 1):
        return Reduce("mean")
    if x is None or len(x) != 4:
        return None
    if any(e % o for e, o in zip(x[2:], out, strict=True)):
        return Reduce("bins", True, out)  # overlapping bins of varying size: replicated
    k = (x[2] // out[0], x[3] // out[1])
    return Window("avgpool", k, k, (0, 0), attrs=(("ceil_mode", False),
                                                  ("count_include_pad", True),
                                                  ("divisor_override", None)))


def _upsample(n: fx.Node) -> Op | None:
    x, out = _shape(n.args[0]), _shape(n)
    if x is None or out is None or len(x) != 4:
        return None
    bilinear = n.target.overloadpacket is aten.upsample_bilinear2d
    mode = "bilinear" if bilinear else "nearest"
    corners = bool(arg(n, 2, False)) if bilinear else False
    if n.target in (aten.upsample_bilinear2d.vec, aten.upsample_nearest2d.vec):
        scales = arg(n, 3 if bilinear else 2, None)
        scales = list(scales) if scales is not None else [None, None]
    else:  # .default: separate scales_h, scales_w
        first = 3 if bilinear else 2
        scales = [arg(n, first, None), arg(n, first + 1, None)]
    maps = tuple(AxisMap(mode, corners, x[i], out[i], None if f is None else float(f))
                 for i, f in zip((2, 3), scales, strict=True))
    return Window("interp", (1, 1), (1, 1), (0, 0), attrs=(("maps", maps),))


def why_not_aten(n: fx.Node) -> str:
    """Why :func:`classify_aten` refuses ``n``, and what would let it run on tiles."""
    f = n.target
    name = str(getattr(f, "overloadpacket", f)).removeprefix("aten.")
    if name == "cat":
        return ("it concatenates along H or W (dim 2/3): tiles can only be concatenated along "
                "the batch or channel dims")
    if name in ("conv2d", "convolution") and isinstance(arg(n, 4, 0), str):
        return "padding given as a string ('same'): give the padding as numbers"
    if name == "instance_norm":
        return ("instance norm with running statistics (track_running_stats=True) is not "
                "tiled; without them it is")
    if name == "adaptive_max_pool2d":
        return ("adaptive max pooling is not tiled (adaptive average pooling to any size and "
                "amax over H and W are)")
    if name in ("sum", "mean", "amax"):
        return ("only reductions over exactly H and W (dims 2, 3), or over the channel dim "
                "with keepdim=True, run on tiles")
    if name in ("pad", "constant_pad_nd", "reflection_pad2d", "replication_pad2d"):
        return ("only constant, reflect and replicate padding of H and W run on tiles "
                "(circular padding would make a border tile read the opposite border)")
    if name.startswith("upsample"):
        return "only nearest and bilinear interpolation of H and W run on tiles"
    if name in ("view", "reshape", "flatten", "permute", "transpose", "squeeze", "unsqueeze",
                "linear", "matmul", "bmm", "slice", "select", "split", "expand", "unfold"):
        return f"aten.{name} changes or indexes the H/W layout; fxpar only tiles known ops"
    return f"fxpar has no tiling rule for aten.{name}, so it never guesses"
