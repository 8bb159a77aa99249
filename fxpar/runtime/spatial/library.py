"""fxpar's communicating ops as ``torch.library`` custom ops (namespace ``fxpar``).

Every message a spatial stage sends goes through one of these ops: the halo exchange
(``fxpar::halo``), a halo exchange fused with the windowed op that reads it
(``fxpar::halo_op``: a convolution computes its tile's part while the halo travels), the join
of the tiles (``fxpar::join``) and, for backward, ``fxpar::halo_grad`` and
``fxpar::halo_conv_grad``; synchronised BatchNorm and the reductions over the tile group
(``fxpar::sync_batch_norm``, ``fxpar::allreduce``, ``fxpar::allgather``,
``fxpar::group_extreme``) are in fxpar.runtime.spatial.collectives, on the same pattern. A tile
op module (fxpar.runtime.spatial.ops and its neighbours) only calls them, so a stage is an
ordinary graph of ATen and ``fxpar::`` ops:
``torch.export`` captures it (each op has a fake kernel that gives its outputs' shapes without
communicating), ``torch.export.save`` / ``load`` store it, and ``torch.compile`` compiles the
code between the ops without a graph break.

Each op takes its tensors, its tile group's name (``key``) and its static arguments as one JSON
string (``spec``, fxpar.core.values: a halo exchange, a kernel's configuration; the collectives
take plain numbers): nothing that is not a tensor, a string or a number, so an exported graph
holds the whole op. The kernel
finds the communicator by the key in the binding of the rank program running the step
(fxpar.runtime.spatial.group); the autograd context keeps that binding for backward.

What a backward needs from its forward travels as extra outputs, marked non-differentiable:
``halo_op`` returns the received halo pieces (one flat buffer) and what its kernel saves (a
max pool's argmax), ``sync_batch_norm`` the statistics, ``group_extreme`` the cells at the
extreme and their count.

Every op is registered as an ordered effect (``CustomOpDef.register_effect``): AOTAutograd
threads effect tokens through them in graph order, but Inductor's generated code (torch 2.14.1)
does not keep that order, which is why compiled plans keep tiles eager
(fxpar.runtime.inductor). Each rank posts its messages in its graph's order; every rank of a
tile group runs the same stage graph and each exchange has its own MPI tags
(fxpar.runtime.spatial.tags), so an op reordered on one rank only could leave it waiting for a
peer that waits for it.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import Tensor
from torch._higher_order_ops.effects import EffectType
from torch.utils.flop_counter import conv_backward_flop, conv_flop_count, register_flop_formula

from fxpar.comm.mpi import Comm, Request
from fxpar.comm.ordered import exchange
from fxpar.core.geometry import Rect
from fxpar.core.options import flag
from fxpar.core.torchcompat import raw_flop_formula
from fxpar.core.values import loads
from fxpar.runtime.spatial import haloconv
from fxpar.runtime.spatial.collectives import fxpar_op  # and its ops: fxpar::allreduce
from fxpar.runtime.spatial.exchange import (
    Pieces,
    empty,
    piece_numel,
    rebuild,
    region,
    send_halo,
    swap,
    unflatten,
    window,
    window_grad,
)
from fxpar.runtime.spatial.group import bound, current, group
from fxpar.runtime.spatial.kernels import KERNELS


def _params(weight: Tensor | None, bias: Tensor | None) -> tuple[Tensor, ...]:
    return tuple(t for t in (weight, bias) if t is not None)


def _remember(ctx: Any, key: str, spec: str) -> None:
    """What every op's backward needs: its group, its spec and the binding forward ran in."""
    ctx.key, ctx.spec, ctx.comms = key, spec, current()


def _group_of(replicated: bool, key: str) -> Comm | None:
    return None if replicated else group(key)


# -- halo exchange ----------------------------------------------------------------------------
@fxpar_op("fxpar::halo")
def halo(x: Tensor, key: str, spec: str) -> Tensor:
    """This rank's window ``exchange.need`` of tile ``x`` (spec: exchange, replicated, tag)."""
    s = loads(spec)
    return window(x, s["exchange"], _group_of(s["replicated"], key), s["replicated"],
                  s["tag"])[0]


@halo.register_fake
def _halo_fake(x: Tensor, key: str, spec: str) -> Tensor:
    return empty(x, (*x.shape[:2], *loads(spec)["exchange"].need.shape))


def _halo_backward(ctx: Any, g: Tensor) -> tuple[Tensor | None, None, None]:
    if not ctx.needs_input_grad[0] or g is None:
        return None, None, None
    with bound(ctx.comms):
        return torch.ops.fxpar.halo_grad(g, ctx.key, ctx.spec), None, None


def _halo_setup(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    _remember(ctx, inputs[1], inputs[2])


halo.register_autograd(_halo_backward, setup_context=_halo_setup)


@fxpar_op("fxpar::halo_grad")
def halo_grad(g: Tensor, key: str, spec: str) -> Tensor:
    """Backward of a halo exchange: the window's gradient ``g``, back on the tiles that own
    it (messages tagged ``tag + 1``)."""
    s = loads(spec)
    return window_grad(g, s["exchange"], _group_of(s["replicated"], key), s["replicated"],
                       s["tag"] + 1)


@halo_grad.register_fake
def _halo_grad_fake(g: Tensor, key: str, spec: str) -> Tensor:
    s = loads(spec)
    ex = s["exchange"]
    return empty(g, (*g.shape[:2], *(ex.extent if s["replicated"] else ex.own.shape)))


# -- a halo exchange fused with the windowed op that reads it ----------------------------------
@functools.cache
def _split_plan(spec: str, kernel: tuple[int, ...], min_ratio: int) -> haloconv.Split | None:
    s = loads(spec)
    cfg = s["cfg"]
    return haloconv.plan(s["exchange"], kernel, tuple(cfg["stride"]), tuple(cfg["dilation"]),
                         min_ratio)


def _split(spec: str, s: dict[str, Any], weight: Tensor | None) -> haloconv.Split | None:
    """How this convolution splits into tile and halo parts (None: assemble the window; always
    with ``FXPAR_HALO_WINDOW=1``)."""
    if not KERNELS[s["kind"]].splits or s["replicated"] or weight is None \
            or flag("halo_window"):
        return None
    return _split_plan(spec, tuple(int(k) for k in weight.shape[2:]), haloconv.MIN_RATIO)


@fxpar_op("fxpar::halo_op")
def halo_op(x: Tensor, weight: Tensor | None, bias: Tensor | None, key: str, spec: str
            ) -> tuple[Tensor, Tensor, Tensor]:
    """The windowed op ``kind`` (fxpar.runtime.spatial.kernels) on this rank's window of tile
    ``x`` (spec: exchange, kind, cfg, replicated, tag). Returns the output, the received halo
    pieces (flat) and what the kernel saves for backward (empty when nothing)."""
    s = loads(spec)
    ex, cfg, params = s["exchange"], s["cfg"], _params(weight, bias)
    comm = _group_of(s["replicated"], key)
    split = _split(spec, s, weight)
    if split is None:
        kernel = KERNELS[s["kind"]]
        win, flat, _ = window(x, ex, comm, s["replicated"], s["tag"])
        out, saved = kernel.forward(win, cfg, params)
        return out, flat, saved[0] if kernel.saves else x.new_empty(0)
    assert comm is not None
    flat, pieces, reqs = send_halo(x, ex, comm, s["tag"])
    out = haloconv.tile_part(x, split, cfg, params)  # while the halo travels
    Comm.waitall(reqs)
    return haloconv.add_bands(out, x, ex, split, pieces, cfg, params[0]), flat, x.new_empty(0)


@halo_op.register_fake
def _halo_op_fake(x: Tensor, weight: Tensor | None, bias: Tensor | None, key: str, spec: str
                  ) -> tuple[Tensor, Tensor, Tensor]:
    s = loads(spec)
    ex, kernel = s["exchange"], KERNELS[s["kind"]]
    out, saved = kernel.forward(empty(x, (*x.shape[:2], *ex.need.shape)), s["cfg"],
                                _params(weight, bias))
    flat = 0 if s["replicated"] else piece_numel(x, [r for _, r in ex.recvs])
    return out, x.new_empty(flat), saved[0] if kernel.saves else x.new_empty(0)


def _halo_op_setup(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    """Keeps the tile only where backward reads the window (rebuilt from the tile and the
    pieces: never kept itself), so a tile's saved activations stay ~1/P of one device's."""
    x, weight, bias, key, spec = inputs
    _, flat, saved = output
    _remember(ctx, key, spec)
    s = loads(spec)
    ctx.split = _split(spec, s, weight)
    keep = ctx.split is not None or KERNELS[s["kind"]].needs_window
    ctx.save_for_backward(x if keep else None, weight, bias, flat if keep else None, saved)
    ctx.window_shape = torch.Size((*x.shape[:2], *s["exchange"].need.shape))
    ctx.mark_non_differentiable(flat, saved)
    ctx.set_materialize_grads(False)


def _halo_op_backward(ctx: Any, g: Tensor | None, _flat: Any, _saved: Any
                      ) -> tuple[Tensor | None, ...]:
    x, weight, bias, flat, saved = ctx.saved_tensors
    need = ctx.needs_input_grad[:3]
    if g is None:
        return None, None, None, None, None
    s = loads(ctx.spec)
    with bound(ctx.comms):
        if ctx.split is not None:
            grads = torch.ops.fxpar.halo_conv_grad(g, x, weight, bias, flat, ctx.key, ctx.spec,
                                                   list(need))
            return (*(t if want else None for t, want in zip(grads, need, strict=True)),
                    None, None)
        kernel = KERNELS[s["kind"]]
        params = _params(weight, bias)
        win = None
        if kernel.needs_window:
            pieces = [] if s["replicated"] else \
                unflatten(x, flat, [r for _, r in s["exchange"].recvs])
            win = rebuild(x, s["exchange"], s["replicated"], pieces)
        gwin, *gparams = kernel.backward(g, win, ctx.window_shape,
                                         (saved,) if kernel.saves else (), s["cfg"], params,
                                         need[:1 + len(params)])
        gx = None
        if need[0] and gwin is not None:
            gx = torch.ops.fxpar.halo_grad(gwin, ctx.key, ctx.spec)
    gparams += [None] * (2 - len(gparams))
    return gx, gparams[0], gparams[1], None, None


halo_op.register_autograd(_halo_op_backward, setup_context=_halo_op_setup)


@fxpar_op("fxpar::halo_conv_grad")
def halo_conv_grad(g: Tensor, x: Tensor, weight: Tensor, bias: Tensor | None, pieces: Tensor,
                   key: str, spec: str, need: list[bool]) -> tuple[Tensor, Tensor, Tensor]:
    """Backward of a split convolution (``halo_op``): the bands' gradients first, their halo
    part posted to the owners, then the tile's ``convolution_backward`` while those messages
    travel. Returns the gradients of (x, weight, bias), empty where ``need`` says none."""
    s = loads(spec)
    ex, cfg = s["exchange"], s["cfg"]
    split = _split(spec, s, weight)
    assert split is not None
    params = _params(weight, bias)
    got = unflatten(x, pieces, [r for _, r in ex.recvs])
    halo_g, gw_bands = haloconv.band_grads(g, x, ex, split, got, cfg, weight, need[0], need[1])
    reqs: list[Request] = []
    bufs: Pieces = []
    if halo_g is not None:  # the halo part goes to the tiles it came from; mine comes back
        _, bufs, reqs = swap(x, group(key), s["tag"] + 1, ex.sends,
                             [(dst, gh) for (dst, _), gh in zip(ex.recvs, halo_g, strict=True)])
    gx, gw, gb = haloconv.tile_grads(g, x, split, cfg, params,
                                     (need[0], need[1], bias is not None and need[2]))
    if gw is not None and gw_bands is not None:
        gw += gw_bands
    Comm.waitall(reqs)
    if gx is not None:
        for rect, buf in bufs:
            region(gx, ex.own, rect).add_(buf)
    return tuple(t if t is not None else x.new_empty(0)  # type: ignore[return-value]
                 for t in (gx, gw, gb))


@halo_conv_grad.register_fake
def _halo_conv_grad_fake(g: Tensor, x: Tensor, weight: Tensor, bias: Tensor | None,
                         pieces: Tensor, key: str, spec: str, need: list[bool]
                         ) -> tuple[Tensor, Tensor, Tensor]:
    likes = (x, weight, bias)
    return tuple(torch.empty_like(t) if want and t is not None  # type: ignore[return-value]
                 else x.new_empty(0) for t, want in zip(likes, need, strict=True))


# -- join -------------------------------------------------------------------------------------
@fxpar_op("fxpar::join")
def join(x: Tensor, key: str, spec: str) -> Tensor:
    """The whole tensor from every tile of the group (spec: rects, tile, tag)."""
    s = loads(spec)
    rects, t, tag = s["rects"], s["tile"], s["tag"]
    comm = group(key)
    full = _full(rects, t)
    out = empty(x, (*x.shape[:2], *full.shape))
    bufs = [(u, rect, x.new_empty((*x.shape[:2], *rect.shape)))
            for u, rect in enumerate(rects) if u != t]
    mine = x.contiguous()
    reqs = exchange(comm, [(u, buf) for u, _, buf in bufs], [(u, mine) for u, _, _ in bufs],
                    tag)
    region(out, full, rects[t]).copy_(x)
    Comm.waitall(reqs)
    for _, rect, buf in bufs:
        region(out, full, rect).copy_(buf)
    return out


def _full(rects: tuple[Rect, ...], t: int) -> Rect:
    return Rect(*((0, max(r.dims[i][1] for r in rects)) for i in range(rects[t].ndim)))


@join.register_fake
def _join_fake(x: Tensor, key: str, spec: str) -> Tensor:
    s = loads(spec)
    return empty(x, (*x.shape[:2], *_full(s["rects"], s["tile"]).shape))


def _join_setup(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    _remember(ctx, inputs[1], inputs[2])


def _join_backward(ctx: Any, g: Tensor) -> tuple[Tensor, None, None]:
    # g is this rank's partial gradient of the replicated output: sum, keep my tile
    s = loads(ctx.spec)
    with bound(ctx.comms):
        total = torch.ops.fxpar.allreduce(g, ctx.key, "sum")
    rect = s["rects"][s["tile"]]
    return region(total, _full(s["rects"], s["tile"]), rect).contiguous(), None, None


join.register_autograd(_join_backward, setup_context=_join_setup)


# torch's FlopCounterMode does not look inside a custom op: the FLOPs of the convolutions two
# of them run, as it counts a convolution on the window (pools count none, as in torch)
@register_flop_formula(torch.ops.fxpar.halo_op)
def _halo_op_flops(x_shape: Any, w_shape: Any, _bias: Any, _key: str, spec: str, *args: Any,
                   out_shape: Any = None, **kwargs: Any) -> int:
    if w_shape is None:
        return 0
    window = [*x_shape[:2], *loads(spec)["exchange"].need.shape]
    return conv_flop_count(window, list(w_shape), list(out_shape[0]))


_conv_backward_flop = raw_flop_formula(conv_backward_flop)  # out_shape positional


@register_flop_formula(torch.ops.fxpar.halo_conv_grad)
def _halo_conv_grad_flops(g_shape: Any, x_shape: Any, w_shape: Any, _bias: Any, _pieces: Any,
                          _key: str, spec: str, need: list[bool], *args: Any,
                          out_shape: Any = None, **kwargs: Any) -> int:
    """torch's count of ``convolution_backward`` on the window: the window's input gradient
    (halo cells included) and the weight gradient, as ``need`` asks (the bias's counts none).
    ``out_shape`` (the tile's gradient, empty ones where not needed) is replaced by the
    window's shapes."""
    window, weight = [*x_shape[:2], *loads(spec)["exchange"].need.shape], list(w_shape)
    return _conv_backward_flop(list(g_shape), window, weight, None, None, None, None, False,
                               None, None, [need[0], need[1], False], (window, weight, None))


for _op in (halo, halo_grad, halo_op, halo_conv_grad, join):
    _op.register_effect(EffectType.ORDERED)
