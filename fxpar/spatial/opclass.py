"""Which ops can run on tiles, and how: pointwise, windowed, BatchNorm, global mean.

:func:`classify` looks at one fx node and returns what the spatial passes need to know; an op
it does not recognise returns None and ends the spatial region (it is never guessed at).
:func:`why_not` says, for error messages, why such an op is refused and what would run on tiles.
"""

from __future__ import annotations

import math
import operator
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx, nn

from fxpar.spatial import aten_ops
from fxpar.spatial.opkind import BatchNorm, Mean, Norm, Op, Pointwise, Window

__all__ = ["BatchNorm", "Mean", "Norm", "Op", "Pointwise", "Window", "classify", "why_not"]

_POINTWISE_MODULES = (nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.ELU, nn.GELU, nn.SiLU, nn.Sigmoid,
                      nn.Tanh, nn.Hardswish, nn.Hardsigmoid, nn.Mish, nn.Identity, nn.Softplus,
                      nn.Dropout, nn.PReLU)
_POINTWISE_FUNCTIONS = {operator.add, operator.sub, operator.mul, operator.truediv, torch.add,
                        torch.sub, torch.mul, torch.div, torch.relu, F.relu, torch.sigmoid,
                        F.silu, F.hardswish, F.hardsigmoid, F.gelu, F.relu6, torch.tanh, F.dropout,
                        F.leaky_relu, torch.neg, operator.neg, F.elu, torch.clamp}
_POINTWISE_METHODS = {"relu", "relu_", "sigmoid", "add", "add_", "mul", "mul_", "sub", "div",
                      "contiguous", "clone", "tanh", "clamp", "neg"}




def _pair(v: Any) -> tuple[int, int]:
    return (v, v) if isinstance(v, int) else (int(v[0]), int(v[1]))


def _arg(n: fx.Node, i: int, name: str, default: Any) -> Any:
    if len(n.args) > i:
        return n.args[i]
    return n.kwargs.get(name, default)


def classify(gm: fx.GraphModule, n: fx.Node) -> Op | None:
    """How ``n`` runs on tiles, or None if it cannot (the region must end before it)."""
    if n.op == "call_module":
        m = gm.get_submodule(str(n.target))
        return aten_ops.classify_module(m, str(n.target)) or _classify_module(m, str(n.target))
    if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload):
        return aten_ops.classify_aten(n)
    if n.op == "call_method":
        if n.target in _POINTWISE_METHODS:
            return Pointwise()
        if n.target == "mean":
            return _mean(n, 1)
        return None
    if n.op != "call_function":
        return None
    f = n.target
    if f in _POINTWISE_FUNCTIONS:
        return Pointwise()
    if f is torch.cat:
        dim = _arg(n, 1, "dim", 0)
        return Pointwise() if dim in (0, 1, -3, -4) else None
    if f is F.conv2d:
        return Window("conv", _pair(_arg(n, 1, "weight", None).meta["fxpar.tensor"].shape[2:]),
                      _pair(_arg(n, 3, "stride", 1)), _pair(_arg(n, 4, "padding", 0)),
                      _pair(_arg(n, 5, "dilation", 1))) \
            if not isinstance(_arg(n, 4, "padding", 0), str) else None
    if f in (F.max_pool2d, torch.max_pool2d):
        if _arg(n, 5, "ceil_mode", False) or _arg(n, 6, "return_indices", False):
            return None
        k = _pair(_arg(n, 1, "kernel_size", None))
        return Window("maxpool", k, _pair(_arg(n, 2, "stride", None) or k),
                      _pair(_arg(n, 3, "padding", 0)), _pair(_arg(n, 4, "dilation", 1)),
                      fill=-math.inf)
    if f is F.adaptive_avg_pool2d:
        return Mean(True) if _pair(_arg(n, 1, "output_size", None)) == (1, 1) else None
    if f is torch.mean:
        return _mean(n, 1)
    return None


def why_not(gm: fx.GraphModule, n: fx.Node) -> str:
    """Why :func:`classify` refuses ``n`` and what would let it run on tiles (for messages)."""
    if n.op == "call_module":
        return _module_why_not(gm.get_submodule(str(n.target)))
    if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload):
        return aten_ops.why_not_aten(n)
    f = n.target
    name = f if isinstance(f, str) else getattr(f, "__name__", str(f))
    if f is torch.cat or name == "cat":
        return ("it concatenates along H or W (dim 2/3): tiles can only be concatenated along "
                "the batch or channel dims")
    if f is F.conv2d:
        return "padding given as a string: give the padding as numbers (e.g. padding=1 for 3x3)"
    if f in (F.max_pool2d, torch.max_pool2d):
        return "ceil_mode=True or return_indices=True on F.max_pool2d: use nn.MaxPool2d"
    if f is F.adaptive_avg_pool2d:
        return "only adaptive average pooling to 1x1 (a global mean) runs on tiles"
    if name in ("mean", "sum", "amax", "amin", "max", "min", "softmax", "log_softmax", "std",
                "var", "norm", "cumsum", "flip", "roll", "argmax"):
        return (f"{name} is a reduction or reordering fxpar does not tile (of these, only a "
                f"mean over both H and W, dim=(2, 3), runs on tiles)")
    if name == "interpolate":
        return "F.interpolate is not tiled: use nn.Upsample(scale_factor=<integer>)"
    if name == "pad":
        return "F.pad is not tiled: use nn.ZeroPad2d, or the padding of the next conv"
    if name in ("view", "reshape", "flatten", "permute", "transpose", "squeeze", "unsqueeze",
                "getitem", "narrow", "split", "chunk", "expand", "unfold", "pixel_shuffle",
                "linear", "matmul", "bmm", "einsum", "size"):
        return f"{name} changes or indexes the H/W layout; fxpar only tiles known ops"
    return f"fxpar does not know how {name} ({n.op}) acts on H and W, so it never guesses"


def _module_why_not(m: nn.Module) -> str:
    kind = type(m).__name__
    if isinstance(m, (nn.Conv2d, nn.ConvTranspose2d)) and m.padding_mode != "zeros":
        return f"padding_mode={m.padding_mode!r}: only zero padding runs on tiles"
    if isinstance(m, nn.Conv2d) and isinstance(m.padding, str):
        return (f"padding={m.padding!r} given as a string: give the padding as numbers "
                f"(e.g. padding=1 for a 3x3 kernel)")
    if isinstance(m, nn.MaxPool2d) and m.return_indices:
        return "return_indices=True: max-unpooling indices are not tiled"
    if isinstance(m, nn.ConvTranspose2d):
        return ("output_padding, or a stride larger than the dilated kernel, is not handled on "
                "tiles")
    if isinstance(m, nn.Upsample):
        return ("only Upsample(scale_factor=<integer>, mode='nearest' or 'bilinear' with "
                "align_corners=False) runs on tiles, not size=... or fractional scales")
    if isinstance(m, nn.AdaptiveAvgPool2d):
        return "only adaptive average pooling to 1x1 (a global mean) runs on tiles"
    if isinstance(m, (nn.Flatten, nn.Linear, nn.Unflatten, nn.PixelShuffle, nn.Softmax,
                      nn.Softmax2d, nn.AdaptiveMaxPool2d, nn.LocalResponseNorm, nn.GroupNorm,
                      nn.LayerNorm, nn.InstanceNorm2d)):
        return f"{kind} mixes values across H and W (or reshapes them)"
    if isinstance(m, (nn.Conv1d, nn.Conv3d, nn.BatchNorm1d, nn.BatchNorm3d, nn.MaxPool3d,
                      nn.AvgPool3d)):
        return f"{kind} is not a 2-D op: spatial parallelism splits H and W of 4-D tensors"
    return f"fxpar does not know how {kind} acts on H and W, so it never guesses"


def _mean(n: fx.Node, dim_pos: int) -> Mean | None:
    dims = _arg(n, dim_pos, "dim", None)
    dims = (dims,) if isinstance(dims, int) else dims
    if dims is None or sorted(d % 4 for d in dims) != [2, 3]:
        return None
    return Mean(bool(_arg(n, dim_pos + 1, "keepdim", False)))


def _classify_module(m: nn.Module, path: str) -> Op | None:
    if isinstance(m, _POINTWISE_MODULES):
        return Pointwise()
    if isinstance(m, nn.Conv2d):
        if m.padding_mode != "zeros" or isinstance(m.padding, str):
            return None
        return Window("conv", _pair(m.kernel_size), _pair(m.stride), _pair(m.padding),
                      _pair(m.dilation))
    if isinstance(m, nn.MaxPool2d):
        if m.return_indices:
            return None
        return Window("maxpool", _pair(m.kernel_size), _pair(m.stride), _pair(m.padding),
                      _pair(m.dilation), fill=-math.inf, attrs=(("ceil_mode", m.ceil_mode),))
    if isinstance(m, nn.AvgPool2d):
        return Window("avgpool", _pair(m.kernel_size), _pair(m.stride), _pair(m.padding),
                      attrs=(("ceil_mode", m.ceil_mode),
                             ("count_include_pad", m.count_include_pad),
                             ("divisor_override", m.divisor_override)))
    if isinstance(m, nn.ZeroPad2d):
        left, right, top, bottom = m.padding
        return Window("pad", (1, 1), (1, 1), (top, left), attrs=(("pad", m.padding),))
    if isinstance(m, nn.ConvTranspose2d):
        if m.padding_mode != "zeros" or any(o for o in _pair(m.output_padding)):
            return None
        k, s, d = _pair(m.kernel_size), _pair(m.stride), _pair(m.dilation)
        if any(d[i] * (k[i] - 1) < s[i] - 1 for i in range(2)):
            return None  # output rows no tap reaches: not handled
        return Window("convT", k, s, _pair(m.padding), d)
    if isinstance(m, nn.Upsample):
        sf = m.scale_factor
        if sf is None or m.size is not None:
            return None
        factors = sf if isinstance(sf, tuple) else (sf, sf)
        if any(float(v) != int(v) for v in factors):
            return None  # fractional scales: the source index map is not handled
        sf = _pair(tuple(int(v) for v in factors))
        if m.mode == "nearest":
            return Window("nearest", (1, 1), sf, (0, 0))
        if m.mode == "bilinear" and not m.align_corners:
            return Window("bilinear", (1, 1), sf, (0, 0))
        return None
    if isinstance(m, nn.BatchNorm2d):
        return BatchNorm(path)
    if isinstance(m, nn.AdaptiveAvgPool2d):
        return Mean(True) if _pair(m.output_size) == (1, 1) else None
    return None
