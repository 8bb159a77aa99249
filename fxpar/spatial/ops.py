"""Spatial ops on tiles, with exact backward: re-tiling (halo / join), synchronised BatchNorm,
global spatial means. Each is a torch.autograd.Function that talks to its tile group.

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

from fxpar.comm import Comm, Request
from fxpar.spatial.geometry import Exchange, Rect

_GROUPS: dict[str, Comm] = {}


def group_key(stage: int, copy: int = 0) -> str:
    """Name of the tile group of one spatial stage (of one model copy)."""
    return f"c{copy}s{stage}"


def set_group(key: str, comm: Comm | None) -> None:
    """Register the communicator of the tile group ``key`` for this process."""
    if comm is None:
        _GROUPS.pop(key, None)
    else:
        _GROUPS[key] = comm


def group(key: str) -> Comm:
    try:
        return _GROUPS[key]
    except KeyError:
        raise RuntimeError(f"tile group {key!r} has no communicator in this process: run the "
                           f"program with program.local() under mpiexec") from None


def _region(t: torch.Tensor, holder: Rect, inner: Rect) -> torch.Tensor:
    hs, ws = holder.local(inner)
    return t[:, :, hs, ws]


class _Retile(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, ex: Exchange, key: str, replicated: bool,
                tag: int) -> torch.Tensor:
        ctx.ex, ctx.key, ctx.replicated, ctx.tag = ex, key, replicated, tag
        n, c = x.shape[:2]
        out = x.new_full((n, c, *ex.need.shape), ex.fill)
        if replicated:  # every rank holds the whole tensor: slice, no messages
            full = Rect((0, ex.extent[0]), (0, ex.extent[1]))
            inside = ex.need.intersect(full)
            if inside is not None:
                _region(out, ex.need, inside).copy_(_region(x, full, inside))
            return out
        comm = group(key)
        reqs: list[Request] = []
        bufs = []
        for src, rect in ex.recvs:
            buf = x.new_empty((n, c, *rect.shape))
            reqs.append(comm.irecv(buf, src, tag=tag))
            bufs.append((rect, buf))
        for dst, rect in ex.sends:
            reqs.append(comm.isend(_region(x, ex.own, rect).contiguous(), dst, tag=tag))
        local = ex.local
        if local is not None:
            _region(out, ex.need, local).copy_(_region(x, ex.own, local))
        Comm.waitall(reqs)
        for rect, buf in bufs:
            _region(out, ex.need, rect).copy_(buf)
        return out

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor
                 ) -> tuple[torch.Tensor | None, None, None, None, None]:
        ex: Exchange = ctx.ex
        if not ctx.needs_input_grad[0]:
            return None, None, None, None, None
        n, c = g.shape[:2]
        if ctx.replicated:
            full = Rect((0, ex.extent[0]), (0, ex.extent[1]))
            gx = g.new_zeros((n, c, *ex.extent))
            inside = ex.need.intersect(full)
            if inside is not None:
                _region(gx, full, inside).copy_(_region(g, ex.need, inside))
            return gx, None, None, None, None  # a partial gradient of a replicated tensor
        comm = group(ctx.key)
        gx = g.new_zeros((n, c, *ex.own.shape))
        reqs: list[Request] = []
        bufs = []
        for src, rect in ex.sends:  # they needed my cells: their gradients come back
            buf = g.new_empty((n, c, *rect.shape))
            reqs.append(comm.irecv(buf, src, tag=ctx.tag + 1))
            bufs.append((rect, buf))
        for dst, rect in ex.recvs:
            reqs.append(comm.isend(_region(g, ex.need, rect).contiguous(), dst,
                                   tag=ctx.tag + 1))
        local = ex.local
        if local is not None:
            _region(gx, ex.own, local).add_(_region(g, ex.need, local))
        Comm.waitall(reqs)
        for rect, buf in bufs:
            _region(gx, ex.own, rect).add_(buf)
        return gx, None, None, None, None


class Halo(nn.Module):
    """Re-tile a tiled (or replicated) tensor into the window ``exchange.need`` of this rank.

    Halo exchange, scatter (replicated -> tile) and the border padding are all this one op."""

    def __init__(self, exchange: Exchange, key: str, replicated: bool = False,
                 tag: int = 10) -> None:
        super().__init__()
        self.exchange = exchange
        self.key = key
        self.replicated = replicated
        self.tag = tag  # forward messages use tag, backward tag + 1 (unique per halo node)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Retile.apply(x, self.exchange, self.key, self.replicated, self.tag)

    def extra_repr(self) -> str:
        ex = self.exchange
        top, bottom, left, right = ex.halo_widths()
        src = "replicated" if self.replicated else f"tile {ex.own}"
        return (f"{src} -> {ex.need}; halo top={top} bottom={bottom} left={left} "
                f"right={right}; recv from {[u for u, _ in ex.recvs]}, send to "
                f"{[u for u, _ in ex.sends]}, fill={ex.fill}")


class _Join(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, rects: tuple[Rect, ...], t: int, key: str,
                tag: int) -> torch.Tensor:
        ctx.rect, ctx.key = rects[t], key
        comm = group(key)
        n, c = x.shape[:2]
        h = max(r.h[1] for r in rects)
        w = max(r.w[1] for r in rects)
        out = x.new_empty((n, c, h, w))
        full = Rect((0, h), (0, w))
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
        g = group(ctx.key).allreduce(g.clone(memory_format=torch.contiguous_format))
        return _region(g, ctx.full, ctx.rect).contiguous(), None, None, None, None


class Join(nn.Module):
    """Tiles -> the whole tensor on every rank of the group (end of the spatial region)."""

    def __init__(self, rects: tuple[Rect, ...], tile: int, key: str, tag: int = 10) -> None:
        super().__init__()
        self.rects, self.tile, self.key, self.tag = rects, tile, key, tag

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Join.apply(x, self.rects, self.tile, self.key, self.tag)

    def extra_repr(self) -> str:
        return f"tile {self.tile} {self.rects[self.tile]} -> all {len(self.rects)} tiles"


class _SpatialSum(torch.autograd.Function):
    """Sum over H and W of all tiles; replicated output."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, key: str) -> torch.Tensor:
        ctx.shape, ctx.key = x.shape, key
        return group(key).allreduce(x.sum(dim=(2, 3), keepdim=True))

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        g = group(ctx.key).allreduce(g.clone(memory_format=torch.contiguous_format))
        return g.expand(ctx.shape).contiguous(), None


def spatial_mean(x: torch.Tensor, key: str, count: int, keepdim: bool = True) -> torch.Tensor:
    """Mean over H and W of the whole image (``count`` = H*W), from this rank's tile."""
    out = _SpatialSum.apply(x, key) / count
    return out if keepdim else out.flatten(2).squeeze(-1)


class _GroupSum(torch.autograd.Function):
    """Allreduce-sum of per-tile partial values; backward sums the partial gradients."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, key: str) -> torch.Tensor:
        ctx.key = key
        return group(key).allreduce(x.clone())

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        return group(ctx.key).allreduce(g.clone(memory_format=torch.contiguous_format)), None


def sync_batch_norm(x: torch.Tensor, bn: nn.modules.batchnorm._BatchNorm, key: str,
                    count: int) -> torch.Tensor:
    """BatchNorm over the whole image: statistics are sums over all tiles (``count`` = N*H*W
    values per channel); running statistics updated as one device would. In eval mode (or
    without batch statistics) it is the ordinary, local BatchNorm."""
    if not (bn.training or bn.running_mean is None):
        return nn.functional.batch_norm(x, bn.running_mean, bn.running_var, bn.weight, bn.bias,
                                        False, 0.0, bn.eps)
    sums = torch.stack([x.sum(dim=(0, 2, 3)), (x * x).sum(dim=(0, 2, 3))])
    sums = _GroupSum.apply(sums, key)
    mean = sums[0] / count
    var = sums[1] / count - mean * mean
    if bn.training and bn.track_running_stats and bn.running_mean is not None:
        with torch.no_grad():
            if bn.num_batches_tracked is not None:
                bn.num_batches_tracked.add_(1)
            if bn.momentum is None:
                m = 1.0 / float(bn.num_batches_tracked)
            else:
                m = bn.momentum
            bn.running_mean.mul_(1 - m).add_(mean.detach(), alpha=m)
            unbiased = var.detach() * (count / max(count - 1, 1))
            bn.running_var.mul_(1 - m).add_(unbiased, alpha=m)
    shape = (1, -1, 1, 1)
    y = (x - mean.view(shape)) * torch.rsqrt(var.view(shape) + bn.eps)
    if bn.weight is not None:
        y = y * bn.weight.view(shape) + bn.bias.view(shape)
    return y


class AvgDivisor(nn.Module):
    """Divides a tile's sum-pool by its slice of the global divisor map (separable: the outer
    product of the per-row and per-column window counts), so average pooling with
    ``count_include_pad=False`` or ``ceil_mode`` matches one device at every border."""

    def __init__(self, rows: list[int], cols: list[int]) -> None:
        super().__init__()
        self.register_buffer("rows", torch.tensor(rows, dtype=torch.float64).view(-1, 1),
                             persistent=False)
        self.register_buffer("cols", torch.tensor(cols, dtype=torch.float64).view(1, -1),
                             persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x / (self.rows * self.cols).to(x.dtype)
