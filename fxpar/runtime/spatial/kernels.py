"""The windowed ops a ``HaloOp`` runs (fxpar.runtime.spatial.ops), one entry per kind.

A HaloOp exchanges the halo and runs its op on the assembled window (tile + halo) with padding
0; the window itself is not kept for backward (a tile's saved activations stay about 1/P of one
device's). Each kind says how its op runs on the window, what its backward needs besides the
window's shape, and how it computes the window's gradient from that: a convolution rebuilds
the window from the tile and the received pieces (``needs_window``); a max pool keeps its
argmax, as on one device; an average pool needs nothing. The kinds are those of
fxpar.frontend.rules.opkind.WINDOW_KINDS marked ``halo_op`` (a test checks both name the same):
a new one is an entry there and one here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.nn import functional as F

from fxpar.core.geometry import per_dim

Cfg = dict[str, Any]
Params = Sequence[torch.Tensor]
Grads = tuple[torch.Tensor | None, ...]
aten = torch.ops.aten


@dataclass(frozen=True)
class WindowKernel:
    """How one kind of windowed op runs on a HaloOp's window."""

    forward: Callable[[torch.Tensor, Cfg, Params], tuple[torch.Tensor, tuple[torch.Tensor, ...]]]
    """``(window, cfg, params) -> (output, saved)``: ``saved`` is what backward needs besides
    the window's shape (and the window, with :attr:`needs_window`)."""
    backward: Callable[[torch.Tensor, torch.Tensor | None, torch.Size, tuple[torch.Tensor, ...],
                        Cfg, Params, tuple[bool, ...]], Grads]
    """``(grad_out, window or None, window_shape, saved, cfg, params, need) -> (grad of the
    window, *grads of params)``; ``need``: which of (window, *params) want a gradient."""
    needs_window: bool = False
    """Backward reads the window's values (rebuilt from the tile and the received pieces), not
    only its shape."""
    saves: bool = False
    """Forward saves one tensor for backward (``saved`` holds one, else none)."""
    splits: bool = False
    """The op may run its tile part while the halo travels and add the halo's part band by band
    (fxpar.runtime.spatial.haloconv), never building the window."""


def _conv(window: torch.Tensor, c: Cfg, params: Params
          ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    conv = F.conv3d if window.dim() == 5 else F.conv2d
    return conv(window, params[0], params[1] if len(params) > 1 else None, c["stride"], 0,
                c["dilation"], c["groups"]), ()


def _conv_grad(g: torch.Tensor, window: torch.Tensor | None, shape: torch.Size,
               saved: tuple[torch.Tensor, ...], c: Cfg, params: Params,
               need: tuple[bool, ...]) -> Grads:
    assert window is not None
    weight, nd = params[0], window.dim() - 2
    bias = len(params) > 1
    gx, gw, gb = aten.convolution_backward(
        g, window, weight, [weight.shape[0]] if bias else None, list(c["stride"]), [0] * nd,
        list(c["dilation"]), False, [0] * nd, c["groups"],
        [need[0], need[1], bias and need[2]])
    return (gx, *[gw, gb][:len(params)])


def _maxpool(window: torch.Tensor, c: Cfg, params: Params
             ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    nd = window.dim() - 2
    op = aten.max_pool3d_with_indices if nd == 3 else aten.max_pool2d_with_indices
    out, idx = op(window, per_dim(c["kernel"], nd), per_dim(c["stride"], nd), [0] * nd,
                  per_dim(c["dilation"], nd))
    return out, (idx,)


def _maxpool_grad(g: torch.Tensor, window: torch.Tensor | None, shape: torch.Size,
                  saved: tuple[torch.Tensor, ...], c: Cfg, params: Params,
                  need: tuple[bool, ...]) -> Grads:
    if not need[0]:
        return (None,)
    nd = len(shape) - 2
    op = aten.max_pool3d_with_indices_backward if nd == 3 else \
        aten.max_pool2d_with_indices_backward
    return (op(g, g.new_empty(shape), per_dim(c["kernel"], nd), per_dim(c["stride"], nd),
               [0] * nd, per_dim(c["dilation"], nd), False, saved[0]),)


def _avgpool(window: torch.Tensor, c: Cfg, params: Params
             ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    pool = F.avg_pool3d if window.dim() == 5 else F.avg_pool2d
    return pool(window, c["kernel"], c["stride"], 0,
                divisor_override=c.get("divisor_override")), ()


def _avgpool_grad(g: torch.Tensor, window: torch.Tensor | None, shape: torch.Size,
                  saved: tuple[torch.Tensor, ...], c: Cfg, params: Params,
                  need: tuple[bool, ...]) -> Grads:
    if not need[0]:
        return (None,)
    nd = len(shape) - 2
    op = aten.avg_pool3d_backward if nd == 3 else aten.avg_pool2d_backward
    return (op(g, g.new_empty(shape), per_dim(c["kernel"], nd), per_dim(c["stride"], nd),
               [0] * nd, False, True, c.get("divisor_override")),)


KERNELS: dict[str, WindowKernel] = {
    "conv": WindowKernel(_conv, _conv_grad, needs_window=True, splits=True),
    "maxpool": WindowKernel(_maxpool, _maxpool_grad, saves=True),
    "avgpool": WindowKernel(_avgpool, _avgpool_grad),
}
"""Every kind a HaloOp runs, by its ``kind``."""
