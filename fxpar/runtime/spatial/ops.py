"""Spatial ops on tiles, with exact backward: re-tiling (halo / join), synchronised BatchNorm
(in fxpar.runtime.spatial.batchnorm, re-exported here), global spatial means. Each is a
torch.autograd.Function that talks to its tile group, over the communicator of the rank
program running it (fxpar.runtime.spatial.group).

Gradient convention: a *tiled* tensor's gradient lives with its tile, complete (a halo
exchange sends the gradients of received cells back to their owners, who add them to their
own). A *replicated* tensor (the same full value on every rank of the group) has a *partial*
gradient on each rank: the true gradient is the sum over the group. So:

- a loss computed on a replicated output is scaled by 1/P on each rank; every parameter
  gradient of a spatial stage is summed over its group (one rule for all parameters);
- the join (tiles -> replicated) sums the partial gradients backward (allreduce), then keeps
  this rank's tile; a global mean / BatchNorm statistics likewise sum their partial gradients;
- slicing a replicated tensor (the input image) scatters the window's gradient, unsummed.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from fxpar.comm.mpi import Comm, Request
from fxpar.core.geometry import Exchange, Rect
from fxpar.core.options import flag
from fxpar.runtime.spatial import haloconv
from fxpar.runtime.spatial.batchnorm import TileBatchNorm as TileBatchNorm  # re-export
from fxpar.runtime.spatial.group import TileOp
from fxpar.runtime.spatial.kernels import KERNELS


def group_key(stage: int, copy: int = 0) -> str:
    """Name of the tile group of one spatial stage (of one model copy)."""
    return f"c{copy}s{stage}"


def memory_format(t: torch.Tensor) -> torch.memory_format:
    """channels_last (channels_last_3d) when ``t`` is laid out so (``Plan(channels_last=True)``),
    else contiguous: windows and gradients the tile ops make keep their input's layout."""
    if t.dim() in (4, 5) and t.shape[1] > 1 and t.stride(1) == 1:
        return torch.channels_last if t.dim() == 4 else torch.channels_last_3d
    return torch.contiguous_format


def _empty(like: torch.Tensor, shape: tuple[int, ...], zero: bool = False) -> torch.Tensor:
    out = torch.empty(shape, dtype=like.dtype, device=like.device,
                      memory_format=memory_format(like))
    return out.zero_() if zero else out


def _region(t: torch.Tensor, holder: Rect, inner: Rect) -> torch.Tensor:
    return t[(slice(None), slice(None), *holder.local(inner))]


Pieces = list[tuple[Rect, torch.Tensor]]


def _window(x: torch.Tensor, ex: Exchange, comm: Comm, replicated: bool, tag: int
            ) -> tuple[torch.Tensor, Pieces]:
    """Forward of a halo exchange: this rank's window ``ex.need`` of ``x``, and the pieces
    received from other tiles (to rebuild the window later without communicating)."""
    if replicated:  # every rank holds the whole tensor: slice, no messages
        return _rebuild(x, ex, True, []), []
    pieces, reqs = _swap(x, comm, tag, ex.recvs,
                         [(dst, _region(x, ex.own, rect)) for dst, rect in ex.sends])
    Comm.waitall(reqs)
    return _rebuild(x, ex, False, pieces), pieces


def _swap(like: torch.Tensor, comm: Comm, tag: int, recvs: list[tuple[int, Rect]],
          sends: list[tuple[int, torch.Tensor]]) -> tuple[Pieces, list[Request]]:
    """Post a receive of each ``(source, rect)`` into a fresh buffer and a send of each
    ``(destination, tensor)`` in the tile group; the received pieces and the requests to wait
    for. Forward sends halo cells out and receives the window's pieces; backward the reverse."""
    n, c = like.shape[:2]
    pieces: Pieces = [(rect, like.new_empty((n, c, *rect.shape))) for _, rect in recvs]
    reqs: list[Request] = [comm.irecv(buf, src, tag=tag)
                           for (src, _), (_, buf) in zip(recvs, pieces, strict=True)]
    reqs += [comm.isend(t.contiguous(), dst, tag=tag) for dst, t in sends]
    return pieces, reqs


def _rebuild(x: torch.Tensor, ex: Exchange, replicated: bool, pieces: Pieces) -> torch.Tensor:
    """The window again, from the tile and the saved pieces (no communication)."""
    n, c = x.shape[:2]
    out = _empty(x, (n, c, *ex.need.shape))
    own = Rect.whole(ex.extent) if replicated else ex.own
    local = ex.need.intersect(own)
    if local is not None:
        _region(out, ex.need, local).copy_(_region(x, own, local))
    for rect, buf in pieces:
        _region(out, ex.need, rect).copy_(buf)
    # the tile and the pieces cover the window's part inside the image; pad the rest: along
    # each dim, the slabs before and after the image (over the whole window: a cell outside
    # along several dims is filled more than once, with the same value)
    for i, ((a, b), e) in enumerate(zip(ex.need.dims, ex.extent, strict=True)):
        size = b - a
        before = min(size, max(0, -a))
        after = min(size - before, max(0, b - e))
        for lo, hi in ((0, before), (size - after, size)):
            if hi > lo:
                out.narrow(2 + i, lo, hi - lo).fill_(ex.fill)
    return out


def _window_grad(g: torch.Tensor, ex: Exchange, comm: Comm, replicated: bool, tag: int
                 ) -> torch.Tensor:
    """Backward of a halo exchange: the window's gradient, back on the tiles that own it."""
    n, c = g.shape[:2]
    if replicated:
        full = Rect.whole(ex.extent)
        gx = _empty(g, (n, c, *ex.extent), zero=True)
        inside = ex.need.intersect(full)
        if inside is not None:
            _region(gx, full, inside).copy_(_region(g, ex.need, inside))
        return gx  # a partial gradient of a replicated tensor
    # the tiles that needed my cells send their gradients back; theirs go back to them
    bufs, reqs = _swap(g, comm, tag, ex.sends,
                       [(dst, _region(g, ex.need, rect)) for dst, rect in ex.recvs])
    local = ex.local
    if local == ex.own:  # the usual case: the window holds the whole tile
        gx = _region(g, ex.need, local).clone(memory_format=memory_format(g))
    else:
        gx = _empty(g, (n, c, *ex.own.shape), zero=True)
        if local is not None:
            _region(gx, ex.own, local).add_(_region(g, ex.need, local))
    Comm.waitall(reqs)
    for rect, buf in bufs:
        _region(gx, ex.own, rect).add_(buf)
    return gx


class _Retile(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, ex: Exchange, comm: Comm, replicated: bool,
                tag: int) -> torch.Tensor:
        ctx.ex, ctx.comm, ctx.replicated, ctx.tag = ex, comm, replicated, tag
        return _window(x, ex, comm, replicated, tag)[0]

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor
                 ) -> tuple[torch.Tensor | None, None, None, None, None]:
        if not ctx.needs_input_grad[0]:
            return None, None, None, None, None
        return _window_grad(g, ctx.ex, ctx.comm, ctx.replicated, ctx.tag + 1), None, None, \
            None, None


class _HaloOp(torch.autograd.Function):
    """Halo exchange fused with the windowed op that reads it (its kernel:
    fxpar.runtime.spatial.kernels). The window (tile + halo) is not kept for backward: only the
    tile (which the previous op saves anyway), the small received pieces and what the kernel
    saves are, so a tile's saved activations stay ~1/P of one device's.

    A convolution whose geometry allows it never builds the window (haloconv.py):
    the tile's own part runs while the halo travels, the halo's part is added band by band,
    and backward sends the halo gradients off before the tile's big convolution_backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, spec: HaloOp, *params: torch.Tensor
                ) -> torch.Tensor:
        split = spec.split(params)
        ctx.spec, ctx.split, ctx.comm = spec, split, spec.group()
        if split is None:
            kernel = KERNELS[spec.kind]
            window, pieces = _window(x, spec.exchange, ctx.comm, spec.replicated, spec.tag)
            out, saved = kernel.forward(window, spec.cfg, params)
            ctx.window_shape, ctx.n_params = window.shape, len(params)
            # the window is rebuilt from the tile and the pieces when backward reads it
            ctx.pieces = pieces if kernel.needs_window else None
            ctx.save_for_backward(*((x,) if kernel.needs_window else ()), *params, *saved)
            return out
        ctx.save_for_backward(x, *params)
        ex = spec.exchange
        ctx.pieces, reqs = _swap(x, ctx.comm, spec.tag, ex.recvs,
                                 [(dst, _region(x, ex.own, rect)) for dst, rect in ex.sends])
        out = haloconv.tile_part(x, split, spec.cfg, params)  # while the halo travels
        Comm.waitall(reqs)
        return haloconv.add_bands(out, x, ex, split, ctx.pieces, spec.cfg, params[0])

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:
        spec: HaloOp = ctx.spec
        if ctx.split is not None:
            x, *params = ctx.saved_tensors
            return (*_split_backward(ctx, g, x, tuple(params)),)
        kernel = KERNELS[spec.kind]
        tensors = ctx.saved_tensors
        window = None
        if kernel.needs_window:
            window = _rebuild(tensors[0], spec.exchange, spec.replicated, ctx.pieces)
            tensors = tensors[1:]
        params, saved = tensors[:ctx.n_params], tuple(tensors[ctx.n_params:])
        need = (ctx.needs_input_grad[0], *ctx.needs_input_grad[2:])
        gwindow, *gparams = kernel.backward(g, window, ctx.window_shape, saved, spec.cfg,
                                            params, need)
        gx = None
        if need[0] and gwindow is not None:
            gx = _window_grad(gwindow, spec.exchange, ctx.comm, spec.replicated, spec.tag + 1)
        return (gx, None, *gparams)


def _split_backward(ctx: Any, g: torch.Tensor, x: torch.Tensor,
                    params: tuple[torch.Tensor, ...]) -> list[torch.Tensor | None]:
    """Backward of a split convolution: band gradients first, their halo part posted to the
    owners, then the tile's convolution_backward while those messages travel."""
    spec: HaloOp = ctx.spec
    ex = spec.exchange
    need = ctx.needs_input_grad
    want_x, want_w = need[0], need[2]
    halo, gw_bands = haloconv.band_grads(g, x, ex, ctx.split, ctx.pieces, spec.cfg, params[0],
                                         want_x, want_w)
    reqs: list[Request] = []
    bufs: Pieces = []
    if halo is not None:  # the halo part goes to the tiles it came from; mine comes back
        bufs, reqs = _swap(x, ctx.comm, spec.tag + 1, ex.sends,
                           [(dst, gh) for (dst, _), gh in zip(ex.recvs, halo, strict=True)])
    gx, gw, gb = haloconv.tile_grads(g, x, ctx.split, spec.cfg, params,
                                     (want_x, want_w, len(params) > 1 and need[3]))
    if gw is not None and gw_bands is not None:
        gw += gw_bands
    Comm.waitall(reqs)
    if gx is not None:
        for rect, buf in bufs:
            _region(gx, ex.own, rect).add_(buf)
    return [gx, None, gw, gb][:2 + len(params)]


SIDES = {2: ("top", "bottom", "left", "right"),
         3: ("front", "back", "top", "bottom", "left", "right")}
"""Names of the sides of a tile, in :meth:`Exchange.halo_widths` order."""


def widths(ex: Exchange) -> str:
    """``top=1 bottom=1 left=1 right=1`` (a volume: front and back too)."""
    w = ex.halo_widths()
    names = SIDES.get(len(w) // 2, tuple(f"s{i}" for i in range(len(w))))
    return " ".join(f"{n}={v}" for n, v in zip(names, w, strict=True))


class Halo(TileOp):
    """Re-tile a tiled (or replicated) tensor into the window ``exchange.need`` of this rank.

    Halo exchange, scatter (replicated -> tile) and the border padding are all this one op."""

    def __init__(self, exchange: Exchange, key: str, replicated: bool = False,
                 tag: int = 10) -> None:
        super().__init__()
        self.exchange = exchange
        self.key = key
        self.replicated = replicated
        self.tag = tag  # forward messages use tag, backward tag + 1 (unique per halo node)

    def emit_args(self) -> dict[str, Any]:
        """The constructor's arguments (fxpar.program.emit writes ``Halo(**these)`` as code)."""
        return {"exchange": self.exchange, "key": self.key, "replicated": self.replicated,
                "tag": self.tag}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Retile.apply(x, self.exchange, self.group(), self.replicated, self.tag)

    def extra_repr(self) -> str:
        ex = self.exchange
        src = "replicated" if self.replicated else f"tile {ex.own}"
        return (f"{src} -> {ex.need}; halo {widths(ex)}; recv from {[u for u, _ in ex.recvs]}, "
                f"send to {[u for u, _ in ex.sends]}, fill={ex.fill}")


class _Join(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, rects: tuple[Rect, ...], t: int, comm: Comm,
                tag: int) -> torch.Tensor:
        ctx.rect, ctx.comm = rects[t], comm
        n, c = x.shape[:2]
        full = Rect(*((0, max(r.dims[i][1] for r in rects)) for i in range(rects[t].ndim)))
        out = _empty(x, (n, c, *full.shape))
        reqs, bufs = [], []
        for u, rect in enumerate(rects):
            if u == t:
                continue
            buf = x.new_empty((n, c, *rect.shape))
            reqs.append(comm.irecv(buf, u, tag=tag))
            bufs.append((rect, buf))
            reqs.append(comm.isend(x.contiguous(), u, tag=tag))
        _region(out, full, rects[t]).copy_(x)
        Comm.waitall(reqs)
        for rect, buf in bufs:
            _region(out, full, rect).copy_(buf)
        ctx.full = full
        return out

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None, None, None, None]:
        # g is this rank's partial gradient of the replicated output: sum, keep my tile
        g = ctx.comm.allreduce(g.clone(memory_format=torch.contiguous_format))
        return _region(g, ctx.full, ctx.rect).contiguous(), None, None, None, None


class Join(TileOp):
    """Tiles -> the whole tensor on every rank of the group (end of the spatial region)."""

    def __init__(self, rects: tuple[Rect, ...], tile: int, key: str, tag: int = 10) -> None:
        super().__init__()
        self.rects, self.tile, self.key, self.tag = rects, tile, key, tag

    def emit_args(self) -> dict[str, Any]:
        return {"rects": self.rects, "tile": self.tile, "key": self.key, "tag": self.tag}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Join.apply(x, self.rects, self.tile, self.group(), self.tag)

    def extra_repr(self) -> str:
        return f"tile {self.tile} {self.rects[self.tile]} -> all {len(self.rects)} tiles"


class AvgDivisor(nn.Module):
    """Divides a tile's sum-pool by its slice of the global divisor map (separable: the outer
    product of the per-dim window counts: rows and columns, or depth, rows and columns), so
    average pooling with ``count_include_pad=False`` or ``ceil_mode`` matches one device at
    every border."""

    def __init__(self, counts: tuple[list[int], ...]) -> None:
        super().__init__()
        self.counts = tuple(list(c) for c in counts)
        div = torch.ones((), dtype=torch.float64)
        for i, c in enumerate(self.counts):
            shape = [1] * len(self.counts)
            shape[i] = -1
            div = div * torch.tensor(c, dtype=torch.float64).view(shape)
        self.register_buffer("divisor", div, persistent=False)

    def emit_args(self) -> dict[str, Any]:
        return {"counts": self.counts}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x / self.divisor.to(x.dtype)


class HaloOp(TileOp):
    """A windowed op on this rank's tile, halo included: ``kind`` names its kernel
    (fxpar.runtime.spatial.kernels.KERNELS: conv, args weight and bias; maxpool; avgpool),
    which runs with padding 0 on the exchanged window."""

    def __init__(self, exchange: Exchange, key: str, kind: str, cfg: dict[str, Any],
                 replicated: bool = False, tag: int = 10, fused: bool = False) -> None:
        super().__init__()
        self.exchange, self.key, self.kind, self.cfg = exchange, key, kind, cfg
        self.replicated, self.tag = replicated, tag
        self.fused = fused  # inside a fused halo group: the window is local, no messages

    def emit_args(self) -> dict[str, Any]:
        return {"exchange": self.exchange, "key": self.key, "kind": self.kind,
                "cfg": self.cfg, "replicated": self.replicated, "tag": self.tag,
                "fused": self.fused}

    def split(self, params: tuple[torch.Tensor, ...]) -> haloconv.Split | None:
        """How this convolution splits into tile and halo parts (None: assemble the window);
        worked out once, from the weight's kernel size."""
        if not KERNELS[self.kind].splits or self.replicated:
            return None
        if not hasattr(self, "_split"):  # FXPAR_HALO_WINDOW=1: assemble every window
            if flag("halo_window"):
                return None
            kernel = tuple(int(k) for k in params[0].shape[2:])
            self._split = haloconv.plan(self.exchange, kernel, tuple(self.cfg["stride"]),
                                        tuple(self.cfg["dilation"]))
        return self._split

    def forward(self, x: torch.Tensor, *params: torch.Tensor) -> torch.Tensor:
        return _HaloOp.apply(x, self, *params)

    def extra_repr(self) -> str:
        ex = self.exchange
        if self.fused:
            return (f"{self.kind} {self.cfg} on region {ex.own} -> window {ex.need} (fused: "
                    f"local, no messages)")
        src = "replicated" if self.replicated else f"tile {ex.own}"
        return (f"{self.kind} {self.cfg} on {src} -> window {ex.need}; halo {widths(ex)}; "
                f"recv from {[u for u, _ in ex.recvs]}, send to {[u for u, _ in ex.sends]}")
