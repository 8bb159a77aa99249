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


CONVS = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}
"""The convolution of each number of spatial dims."""
MAX_POOLS = {2: (aten.max_pool2d_with_indices, aten.max_pool2d_with_indices_backward),
             3: (aten.max_pool3d_with_indices, aten.max_pool3d_with_indices_backward)}
"""Max pool (values and argmax) and its backward, by spatial dims."""
AVG_POOLS = {2: (F.avg_pool2d, aten.avg_pool2d_backward),
             3: (F.avg_pool3d, aten.avg_pool3d_backward)}
"""Average pool and its backward, by spatial dims."""


def _lift(t: torch.Tensor) -> torch.Tensor:
    """A sequence (N, C, L) as an image (N, C, 1, L): ATen has no backward ops of 1-D pools
    (torch runs them as 2-D ones too), so a 1-D pool runs over (1, L); others as they are."""
    return t.unsqueeze(2) if t.dim() == 3 else t


def _pool_args(nd: int, c: Cfg, *names: str) -> tuple[list[int], ...]:
    """The per-dim arguments ``names`` of a pool over ``nd`` dims, lifted as :func:`_lift`."""
    lead = [1] if nd == 1 else []
    return tuple(lead + list(per_dim(c[name], nd)) for name in names)


def _conv(window: torch.Tensor, c: Cfg, params: Params
          ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    conv = CONVS[window.dim() - 2]
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
    k, s, d = _pool_args(nd, c, "kernel", "stride", "dilation")
    out, idx = MAX_POOLS[len(k)][0](_lift(window), k, s, [0] * len(k), d)
    return out.squeeze(2) if nd == 1 else out, (idx,)  # the argmax as the lifted pool's


def _maxpool_grad(g: torch.Tensor, window: torch.Tensor | None, shape: torch.Size,
                  saved: tuple[torch.Tensor, ...], c: Cfg, params: Params,
                  need: tuple[bool, ...]) -> Grads:
    if not need[0]:
        return (None,)
    nd = len(shape) - 2
    k, s, d = _pool_args(nd, c, "kernel", "stride", "dilation")
    gx = MAX_POOLS[len(k)][1](_lift(g), _lift(g.new_empty(shape)), k, s, [0] * len(k), d,
                              False, saved[0])
    return (gx.squeeze(2) if nd == 1 else gx,)


def _avgpool(window: torch.Tensor, c: Cfg, params: Params
             ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    nd = window.dim() - 2
    k, s = _pool_args(nd, c, "kernel", "stride")
    out = AVG_POOLS[len(k)][0](_lift(window), k, s, 0, divisor_override=c.get("divisor_override"))
    return out.squeeze(2) if nd == 1 else out, ()


def _avgpool_grad(g: torch.Tensor, window: torch.Tensor | None, shape: torch.Size,
                  saved: tuple[torch.Tensor, ...], c: Cfg, params: Params,
                  need: tuple[bool, ...]) -> Grads:
    if not need[0]:
        return (None,)
    nd = len(shape) - 2
    k, s = _pool_args(nd, c, "kernel", "stride")
    gx = AVG_POOLS[len(k)][1](_lift(g), _lift(g.new_empty(shape)), k, s, [0] * len(k), False,
                              True, c.get("divisor_override"))
    return (gx.squeeze(2) if nd == 1 else gx,)


KERNELS: dict[str, WindowKernel] = {
    "conv": WindowKernel(_conv, _conv_grad, needs_window=True, splits=True),
    "maxpool": WindowKernel(_maxpool, _maxpool_grad, saves=True),
    "avgpool": WindowKernel(_avgpool, _avgpool_grad),
}
"""Every kind a HaloOp runs, by its ``kind``."""
