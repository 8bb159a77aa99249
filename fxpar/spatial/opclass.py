"""Which ops can run on tiles, and how: pointwise, windowed, BatchNorm, global mean.

:func:`classify` looks at one fx node and returns what the spatial passes need to know; an op
it does not recognise returns None and ends the spatial region (it is never guessed at).
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx, nn

from fxpar.spatial.geometry import (
    Interval,
    nearest_rows,
    transposed_rows,
    window_rows,
)

_POINTWISE_MODULES = (nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.ELU, nn.GELU, nn.SiLU, nn.Sigmoid,
                      nn.Tanh, nn.Hardswish, nn.Hardsigmoid, nn.Mish, nn.Identity, nn.Softplus,
                      nn.Dropout, nn.PReLU)
_POINTWISE_FUNCTIONS = {operator.add, operator.sub, operator.mul, operator.truediv, torch.add,
                        torch.sub, torch.mul, torch.div, torch.relu, F.relu, torch.sigmoid,
                        F.silu, F.hardswish, F.hardsigmoid, F.gelu, F.relu6, torch.tanh, F.dropout,
                        F.leaky_relu, torch.neg, operator.neg, F.elu, torch.clamp}
_POINTWISE_METHODS = {"relu", "relu_", "sigmoid", "add", "add_", "mul", "mul_", "sub", "div",
                      "contiguous", "clone", "tanh", "clamp", "neg"}


@dataclass(frozen=True)
class Pointwise:
    """Each output cell depends on the same cell of each input (broadcasting allowed)."""


@dataclass(frozen=True)
class Window:
    """A windowed op. ``kind``: conv, maxpool, avgpool, pad, convT, nearest, bilinear.

    Per dim (0 = H, 1 = W): kernel k, stride s, padding p (the leading side), dilation d.
    """

    kind: str
    k: tuple[int, int]
    s: tuple[int, int]
    p: tuple[int, int]
    d: tuple[int, int] = (1, 1)
    fill: float = 0.0
    attrs: tuple[tuple[str, Any], ...] = ()

    def attr(self, name: str, default: Any = None) -> Any:
        return dict(self.attrs).get(name, default)

    def needs(self, out: Interval, dim: int) -> Interval:
        """Input interval (global; may pass the borders) for output interval ``out``."""
        k, s, p, d = self.k[dim], self.s[dim], self.p[dim], self.d[dim]
        if self.kind == "convT":
            return transposed_rows(out, k, s, p, d)
        if self.kind == "nearest":
            return nearest_rows(out, s)
        if self.kind == "bilinear":  # one extra row each side: interpolation reads neighbours
            lo, hi = nearest_rows(out, s)
            return (lo - 1, hi + 1)
        return window_rows(out, k, s, p, d)


@dataclass(frozen=True)
class BatchNorm:
    """BatchNorm2d: global statistics over all tiles in training mode."""

    path: str


@dataclass(frozen=True)
class Mean:
    """Mean over H and W (global average pooling); the result is replicated."""

    keepdim: bool


Op = Pointwise | Window | BatchNorm | Mean


def _pair(v: Any) -> tuple[int, int]:
    return (v, v) if isinstance(v, int) else (int(v[0]), int(v[1]))


def _arg(n: fx.Node, i: int, name: str, default: Any) -> Any:
    if len(n.args) > i:
        return n.args[i]
    return n.kwargs.get(name, default)


def classify(gm: fx.GraphModule, n: fx.Node) -> Op | None:
    """How ``n`` runs on tiles, or None if it cannot (the region must end before it)."""
    if n.op == "call_module":
        return _classify_module(gm.get_submodule(str(n.target)), str(n.target))
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
