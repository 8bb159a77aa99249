"""A convolution on a tile plus its halo, without assembling the window.

The plain way (ops.py, ``_rebuild``) copies the tile and the received halo pieces
into one window tensor and convolves it with padding 0: a full copy of the tile before every
convolution, another in backward, and the convolution cannot start before the halo arrived.
A convolution is linear in its input, so split the window into the tile (halo cells zero) and
the halo (tile cells zero)::

    window = [ 0 0 0 0 ]     tile part  [ 0 0 0 0 ]     halo part [ 0 0 0 0 ]
             [ 0 a b h ]  =             [ 0 a b 0 ]  +            [ 0 0 0 h ]
             [ 0 c d h ]                [ 0 c d 0 ]               [ 0 0 0 h ]
             [ 0 0 0 0 ]                [ 0 0 0 0 ]               [ 0 0 0 0 ]

- the tile part is the convolution of the tile with the convolution's own zero padding
  (``padding=(top, left)``, the window's halo widths): no copy, and it runs while the halo
  messages are in flight;
- the halo part is non-zero only for the outputs whose window reaches a received cell: a band
  of ``ceil(width / stride)`` output rows or columns along each side that received something.
  Each band is convolved from a small sub-window (halo pieces, zeros elsewhere) and added.

Backward mirrors it: ``convolution_backward`` on the tile with padding gives the tile's input
gradient and most of the weight gradient directly; the bands give the rest of the weight
gradient and the gradients of the halo cells, which go back to their owners.

The split applies when the tile padded symmetrically by the top/left halo widths yields exactly
the window's outputs (halo widths >= 0; bottom <= top and right <= left, with any extra padding
unread), and when it pays: each band costs a convolution call of its own (weights re-laid-out,
a few output rows over mostly zero input), while the window costs copies of the tile. Measured
on CPU (one thread, 3x3 convolutions, issue 7): bands 1/64 of the tile wide cost 6-11% more
than the window path, 1/128 broke even, 1/256 won 2%; so a band may be at most
``1/MIN_RATIO`` of the tile's outputs along its thin side. Huge images (fxpar's purpose) give
tiles of thousands of rows, where the split also saves a tile-sized transient copy per
convolution. Every other geometry keeps the window path; :func:`plan` says which. Volumes
split the same way, one pair of bands (slabs) per dim.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fxpar.core.geometry import Exchange, Rect

Pieces = list[tuple[Rect, torch.Tensor]]
CONVS = {1: nn.functional.conv1d, 2: nn.functional.conv2d, 3: nn.functional.conv3d}
"""The convolution of each number of spatial dims."""
MIN_RATIO = 128
"""A band is at most 1/MIN_RATIO of the tile's output rows (top/bottom) or columns (sides)."""


@dataclass(frozen=True)
class Band:
    """Outputs ``out`` (output-local boxes: rows x cols, or depth x rows x cols) that read halo
    cells, and the window-local input box ``win`` they read."""

    out: Rect
    win: Rect


@dataclass(frozen=True)
class Split:
    """How one tile's convolution splits: the padding of the tile part, and the bands."""

    padding: tuple[int, ...]
    bands: tuple[Band, ...]


def _span(o0: int, o1: int, s: int, reach: int) -> tuple[int, int]:
    """Window-local input rows that outputs [o0, o1) read (``reach`` = d*(k-1))."""
    return (o0 * s, (o1 - 1) * s + reach + 1)


def _ranges(n_in: int, n_own: int, before: int, got_before: bool, got_after: bool, s: int,
            reach: int) -> tuple[int, int, int]:
    """Along one dim: the number of outputs, the end of the leading band and the start of the
    trailing band (outputs reading received rows before / after the tile)."""
    n_out = (n_in - reach - 1) // s + 1
    lead = min(n_out, math.ceil(before / s)) if got_before else 0
    trail = max(lead, math.ceil((before + n_own - reach) / s)) if got_after else n_out
    return n_out, lead, min(trail, n_out)


def plan(ex: Exchange, kernel: tuple[int, ...], stride: tuple[int, ...],
         dilation: tuple[int, ...], min_ratio: int | None = None) -> Split | None:
    """The split of this exchange's convolution, or None where the window path is used (the
    geometry does not split, or a band is thicker than 1/``min_ratio`` of the tile; default
    :data:`MIN_RATIO`, read at each call). Any number of spatial dims: along each dim a
    leading and a trailing band; a band spans the middle of the dims before its own and all
    of the dims after it, so the bands cover the shell of outputs that read the halo once
    (an image's top / bottom rows, then its side columns; a volume's front / back slabs,
    then the top / bottom ones of the rest, then the sides)."""
    min_ratio = MIN_RATIO if min_ratio is None else min_ratio
    widths = ex.widths()
    before = [b for b, _ in widths]
    own, win = ex.own.shape, ex.need.shape
    reach = [d * (k - 1) for d, k in zip(dilation, kernel, strict=True)]
    if min(before) < 0 or any(a > b for b, a in widths):
        return None
    n_out = [(n - r - 1) // s + 1 for n, r, s in zip(win, reach, stride, strict=True)]
    padded = [(n + 2 * p - r - 1) // s + 1
              for n, p, r, s in zip(own, before, reach, stride, strict=True)]
    if padded != n_out or min(n_out) <= 0:
        return None
    local = [ex.need.local(r) for _, r in ex.recvs]
    ranges = [_ranges(win[i], own[i], before[i], any(sl[i].stop <= before[i] for sl in local),
                      any(sl[i].start >= before[i] + own[i] for sl in local), stride[i],
                      reach[i]) for i in range(len(own))]
    outs = []
    for i, (n, lead, trail) in enumerate(ranges):
        for lo, hi in ((0, lead), (trail, n)):
            dims = [(r[1], r[2]) if j < i else (lo, hi) if j == i else (0, r[0])
                    for j, r in enumerate(ranges)]
            if all(b > a for a, b in dims):
                outs.append((Rect(*dims), hi - lo, n))
    # a band may be at most 1/min_ratio of the outputs across its thin side
    if any(thick * min_ratio > whole for _, thick, whole in outs):
        return None
    bands = tuple(Band(o, Rect(*(_span(*o.dims[j], stride[j], reach[j])
                                 for j in range(len(own)))))
                  for o, _, _ in outs)
    return Split(tuple(before), bands)


def _origin(ex: Exchange) -> tuple[int, ...]:
    """Where the window starts (its local coordinates' zero)."""
    return tuple(a for a, _ in ex.need.dims)


def _sub(band: Band, ex: Exchange, pieces: Pieces, like: torch.Tensor) -> torch.Tensor:
    """The band's input: the halo cells it covers, zeros elsewhere (tile cells included)."""
    n, c = like.shape[:2]
    sub = like.new_zeros((n, c, *band.win.shape))
    origin = _origin(ex)
    for rect, buf in pieces:
        held = rect.moved(origin)
        part = held.intersect(band.win)
        if part is not None:
            sub[(slice(None), slice(None), *band.win.local(part))] = \
                buf[(slice(None), slice(None), *held.local(part))]
    return sub


def _conv(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, cfg: dict[str, Any],
          padding: tuple[int, ...] | int) -> torch.Tensor:
    conv = CONVS[x.dim() - 2]
    return conv(x, w, b, cfg["stride"], padding, cfg["dilation"], cfg["groups"])


def tile_part(x: torch.Tensor, split: Split, cfg: dict[str, Any],
              params: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """The outputs from the tile alone (bias included): run it before the halo arrives."""
    return _conv(x, params[0], params[1] if len(params) > 1 else None, cfg, split.padding)


def _out_slices(out: torch.Tensor, band: Band) -> tuple[slice, ...]:
    return (slice(None), slice(None), *Rect.whole(tuple(out.shape[2:])).local(band.out))


def add_bands(out: torch.Tensor, x: torch.Tensor, ex: Exchange, split: Split, pieces: Pieces,
              cfg: dict[str, Any], weight: torch.Tensor) -> torch.Tensor:
    """``out`` plus the halo part, band by band (in place)."""
    for band in split.bands:
        out[_out_slices(out, band)] += _conv(_sub(band, ex, pieces, x), weight, None, cfg, 0)
    return out


def band_grads(g: torch.Tensor, x: torch.Tensor, ex: Exchange, split: Split, pieces: Pieces,
               cfg: dict[str, Any], weight: torch.Tensor, want_x: bool, want_w: bool
               ) -> tuple[list[torch.Tensor] | None, torch.Tensor | None]:
    """Backward of the halo part: each received piece's gradient (None when the input needs
    none) -- to be sent back to its owner -- and the bands' share of the weight gradient."""
    stride, dil = list(cfg["stride"]), list(cfg["dilation"])
    zeros = [0] * (g.dim() - 2)
    halo = [torch.zeros_like(buf) for _, buf in pieces] if want_x else None
    gw: torch.Tensor | None = None
    origin = _origin(ex)
    for band in split.bands:
        gs, gws, _ = torch.ops.aten.convolution_backward(
            g[_out_slices(g, band)], _sub(band, ex, pieces, x), weight, None, stride, zeros,
            dil, False, zeros, cfg["groups"], [want_x, want_w, False])
        if want_w:
            gw = gws if gw is None else gw + gws
        if halo is None:
            continue
        for (rect, _), acc in zip(pieces, halo, strict=True):
            held = rect.moved(origin)
            part = held.intersect(band.win)
            if part is not None:
                acc[(slice(None), slice(None), *held.local(part))] += \
                    gs[(slice(None), slice(None), *band.win.local(part))]
    return halo, gw


def tile_grads(g: torch.Tensor, x: torch.Tensor, split: Split, cfg: dict[str, Any],
               params: tuple[torch.Tensor, ...], want: tuple[bool, bool, bool]
               ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Backward of the tile part: the tile's input gradient (the halo cells' gradients from
    other tiles still to be added), the weight and the bias gradients."""
    weight = params[0]
    bias = [weight.shape[0]] if len(params) > 1 else None
    gx, gw, gb = torch.ops.aten.convolution_backward(
        g, x, weight, bias, list(cfg["stride"]), list(split.padding), list(cfg["dilation"]),
        False, [0] * (g.dim() - 2), cfg["groups"], [want[0], want[1],
                                                     want[2] and bias is not None])
    return gx, gw, gb


def conv_weight_of_transposed(w: torch.Tensor, groups: int) -> torch.Tensor:
    """The convolution weight that computes a stride-1 transposed convolution of weight ``w``
    (C_in x C_out/groups x k...): per group, in and out channels swapped, the kernel flipped.
    conv_transpose(x, w, stride 1, padding p, dilation d) = conv(x, this, padding d (k - 1) - p,
    dilation d), so a tile computes its own rows only (fxpar.frontend.rules.aten_ops)."""
    c_in, c_out, *k = w.shape
    w = w.reshape(groups, c_in // groups, c_out, *k).transpose(1, 2)
    return w.reshape(groups * c_out, c_in // groups, *k).flip(list(range(2, 2 + len(k))))
