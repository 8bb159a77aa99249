"""Halo exchange on one rank, as plain functions of tensors and a communicator: the window a
tile needs (its own cells, the pieces other tiles send, the border's padding), and backward
the window's gradient sent back to the tiles that own it.

fxpar's custom ops (fxpar.runtime.spatial.library) run these inside their kernels; nothing here
is differentiable by itself.
"""

from __future__ import annotations

import math

import torch

from fxpar.comm.mpi import Comm, Request
from fxpar.comm.ordered import exchange
from fxpar.core.geometry import Exchange, Rect

Pieces = list[tuple[Rect, torch.Tensor]]
"""Received blocks and the cells of the image they cover."""


def memory_format(t: torch.Tensor) -> torch.memory_format:
    """channels_last (channels_last_3d) when ``t`` is laid out so (``Plan(channels_last=True)``),
    else contiguous: windows and gradients the tile ops make keep their input's layout."""
    if t.dim() in (4, 5) and t.shape[1] > 1 and t.stride(1) == 1:
        return torch.channels_last if t.dim() == 4 else torch.channels_last_3d
    return torch.contiguous_format


def empty(like: torch.Tensor, shape: tuple[int, ...], zero: bool = False) -> torch.Tensor:
    """A new tensor of ``shape`` with ``like``'s dtype, device and layout."""
    out = torch.empty(shape, dtype=like.dtype, device=like.device,
                      memory_format=memory_format(like))
    return out.zero_() if zero else out


def region(t: torch.Tensor, holder: Rect, inner: Rect) -> torch.Tensor:
    """The cells ``inner`` of ``t``, which holds the cells ``holder`` of the image."""
    return t[(slice(None), slice(None), *holder.local(inner))]


def piece_numel(like: torch.Tensor, rects: list[Rect]) -> int:
    """How many values the blocks ``rects`` of a tensor shaped like ``like`` hold."""
    n, c = like.shape[:2]
    return sum(n * c * math.prod(r.shape) for r in rects)


def swap(like: torch.Tensor, comm: Comm, tag: int, recvs: list[tuple[int, Rect]],
         sends: list[tuple[int, torch.Tensor]]
         ) -> tuple[torch.Tensor, Pieces, list[Request]]:
    """Post a receive of each ``(source, rect)`` and a send of each ``(destination, tensor)`` in
    the tile group, per peer in the order both ends agree on (fxpar.comm.ordered.exchange):
    the one flat buffer the pieces are received into, the pieces (views of it) and the
    requests to wait for. Forward sends halo cells out and receives the window's pieces;
    backward the reverse."""
    rects = [r for _, r in recvs]
    flat = like.new_empty(piece_numel(like, rects))
    pieces = unflatten(like, flat, rects)
    reqs = exchange(comm, [(src, buf) for (src, _), (_, buf) in zip(recvs, pieces, strict=True)],
                    [(dst, t.contiguous()) for dst, t in sends], tag)
    return flat, pieces, reqs  # type: ignore[return-value]


def unflatten(like: torch.Tensor, flat: torch.Tensor, rects: list[Rect]) -> Pieces:
    """The pieces :func:`swap` received into ``flat`` again (views)."""
    n, c = like.shape[:2]
    pieces: Pieces = []
    at = 0
    for rect in rects:
        size = n * c * math.prod(rect.shape)
        pieces.append((rect, flat[at:at + size].view(n, c, *rect.shape)))
        at += size
    return pieces


def send_halo(x: torch.Tensor, ex: Exchange, comm: Comm, tag: int
              ) -> tuple[torch.Tensor, Pieces, list[Request]]:
    """Start the forward exchange of tile ``x``: its halo cells out, the window's pieces in."""
    return swap(x, comm, tag, ex.recvs, [(dst, region(x, ex.own, rect)) for dst, rect in ex.sends])


def window(x: torch.Tensor, ex: Exchange, comm: Comm | None, replicated: bool, tag: int
           ) -> tuple[torch.Tensor, torch.Tensor, Pieces]:
    """Forward of a halo exchange: this rank's window ``ex.need`` of ``x``, and the pieces
    received from other tiles (flat, and as blocks: to rebuild the window later without
    communicating)."""
    if replicated or comm is None:  # every rank holds the whole tensor: slice, no messages
        return rebuild(x, ex, True, []), x.new_empty(0), []
    flat, pieces, reqs = send_halo(x, ex, comm, tag)
    Comm.waitall(reqs)
    return rebuild(x, ex, False, pieces), flat, pieces


def rebuild(x: torch.Tensor, ex: Exchange, replicated: bool, pieces: Pieces) -> torch.Tensor:
    """The window again, from the tile and the saved pieces (no communication)."""
    n, c = x.shape[:2]
    out = empty(x, (n, c, *ex.need.shape))
    own = Rect.whole(ex.extent) if replicated else ex.own
    for win, img in ex.held(own):  # one block; a wrapping window's pieces, each in its place
        region(out, ex.need, win).copy_(region(x, own, img))
    for rect, buf in pieces:
        region(out, ex.need, rect).copy_(buf)
    if ex.wrap:
        return out  # every cell is the image's (mod its extent): nothing to pad
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


def window_grad(g: torch.Tensor, ex: Exchange, comm: Comm | None, replicated: bool, tag: int
                ) -> torch.Tensor:
    """Backward of a halo exchange: the window's gradient, back on the tiles that own it."""
    n, c = g.shape[:2]
    if replicated or comm is None:
        full = Rect.whole(ex.extent)
        gx = empty(g, (n, c, *ex.extent), zero=True)
        for win, img in ex.held(full):  # a wrapping window may read a cell more than once
            region(gx, full, img).add_(region(g, ex.need, win))
        return gx  # a partial gradient of a replicated tensor
    # the tiles that needed my cells send their gradients back; theirs go back to them
    _, bufs, reqs = swap(g, comm, tag, ex.sends,
                         [(dst, region(g, ex.need, rect)) for dst, rect in ex.recvs])
    held = ex.held()
    if len(held) == 1 and held[0][1] == ex.own:  # the usual case: the window holds the tile
        gx = region(g, ex.need, held[0][0]).clone(memory_format=memory_format(g))
    else:
        gx = empty(g, (n, c, *ex.own.shape), zero=True)
        for win, img in held:
            region(gx, ex.own, img).add_(region(g, ex.need, win))
    Comm.waitall(reqs)
    for rect, buf in bufs:
        region(gx, ex.own, rect).add_(buf)
    return gx
