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
convolution. Every other geometry keeps the window path; :func:`plan` says which.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fxpar.core.geometry import Exchange, Rect

Pieces = list[tuple[Rect, torch.Tensor]]
MIN_RATIO = 128
"""A band is at most 1/MIN_RATIO of the tile's output rows (top/bottom) or columns (sides)."""


@dataclass(frozen=True)
class Band:
    """Outputs ``out`` (output-local rows x cols) that read halo cells, and the window-local
    input rectangle ``win`` they read."""

    out: Rect
    win: Rect


@dataclass(frozen=True)
class Split:
    """How one tile's convolution splits: the padding of the tile part, and the bands."""

    padding: tuple[int, int]
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


def plan(ex: Exchange, kernel: tuple[int, int], stride: tuple[int, int],
         dilation: tuple[int, int], min_ratio: int | None = None) -> Split | None:
    """The split of this exchange's convolution, or None where the window path is used (the
    geometry does not split, or a band is thicker than 1/``min_ratio`` of the tile; default
    :data:`MIN_RATIO`, read at each call)."""
    min_ratio = MIN_RATIO if min_ratio is None else min_ratio
    top, bottom, left, right = ex.halo_widths()
    own_h, own_w = ex.own.shape
    win_h, win_w = ex.need.shape
    reach = (dilation[0] * (kernel[0] - 1), dilation[1] * (kernel[1] - 1))
    if min(top, left) < 0 or bottom > top or right > left:
        return None
    n_out = [(n - r - 1) // s + 1 for n, r, s in zip((win_h, win_w), reach, stride, strict=True)]
    padded = [(n + 2 * p - r - 1) // s + 1
              for n, p, r, s in zip((own_h, own_w), (top, left), reach, stride, strict=True)]
    if padded != n_out or min(n_out) <= 0:
        return None
    local = [ex.need.local(r) for _, r in ex.recvs]
    above = any(h.stop <= top for h, _ in local)
    below = any(h.start >= top + own_h for h, _ in local)
    before = any(w.stop <= left for _, w in local)
    after = any(w.start >= left + own_w for _, w in local)
    ho, lead_h, trail_h = _ranges(win_h, own_h, top, above, below, stride[0], reach[0])
    wo, lead_w, trail_w = _ranges(win_w, own_w, left, before, after, stride[1], reach[1])
    outs = [Rect((0, lead_h), (0, wo)), Rect((trail_h, ho), (0, wo)),
            Rect((lead_h, trail_h), (0, lead_w)), Rect((lead_h, trail_h), (trail_w, wo))]
    # thickness of each band across its long side: rows for top / bottom, columns for sides
    thick = [(outs[0].shape[0], ho), (outs[1].shape[0], ho), (outs[2].shape[1], wo),
             (outs[3].shape[1], wo)]
    kept = [(o, t) for o, t in zip(outs, thick, strict=True)
            if o.shape[0] > 0 and o.shape[1] > 0]
    if any(band * min_ratio > whole for _, (band, whole) in kept):
        return None
    bands = tuple(Band(o, Rect(_span(*o.h, stride[0], reach[0]), _span(*o.w, stride[1],
                                                                       reach[1])))
                  for o, _ in kept)
    return Split((top, left), bands)


def _sub(band: Band, ex: Exchange, pieces: Pieces, like: torch.Tensor) -> torch.Tensor:
    """The band's input: the halo cells it covers, zeros elsewhere (tile cells included)."""
    n, c = like.shape[:2]
    sub = like.new_zeros((n, c, *band.win.shape))
    origin = ex.need.h[0], ex.need.w[0]
    for rect, buf in pieces:
        part = _window_rect(rect, origin).intersect(band.win)
        if part is not None:
            hs, ws = band.win.local(part)
            ph, pw = _window_rect(rect, origin).local(part)
            sub[:, :, hs, ws] = buf[:, :, ph, pw]
    return sub


def _window_rect(rect: Rect, origin: tuple[int, int]) -> Rect:
    """A global rectangle in window-local coordinates."""
    return Rect((rect.h[0] - origin[0], rect.h[1] - origin[0]),
                (rect.w[0] - origin[1], rect.w[1] - origin[1]))


def _conv(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, cfg: dict[str, Any],
          padding: tuple[int, int]) -> torch.Tensor:
    return nn.functional.conv2d(x, w, b, cfg["stride"], padding, cfg["dilation"], cfg["groups"])


def tile_part(x: torch.Tensor, split: Split, cfg: dict[str, Any],
              params: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """The outputs from the tile alone (bias included): run it before the halo arrives."""
    return _conv(x, params[0], params[1] if len(params) > 1 else None, cfg, split.padding)


def add_bands(out: torch.Tensor, x: torch.Tensor, ex: Exchange, split: Split, pieces: Pieces,
              cfg: dict[str, Any], weight: torch.Tensor) -> torch.Tensor:
    """``out`` plus the halo part, band by band (in place)."""
    for band in split.bands:
        hs, ws = Rect((0, out.shape[2]), (0, out.shape[3])).local(band.out)
        out[:, :, hs, ws] += _conv(_sub(band, ex, pieces, x), weight, None, cfg, (0, 0))
    return out


def band_grads(g: torch.Tensor, x: torch.Tensor, ex: Exchange, split: Split, pieces: Pieces,
               cfg: dict[str, Any], weight: torch.Tensor, want_x: bool, want_w: bool
               ) -> tuple[list[torch.Tensor] | None, torch.Tensor | None]:
    """Backward of the halo part: each received piece's gradient (None when the input needs
    none) -- to be sent back to its owner -- and the bands' share of the weight gradient."""
    stride, dil = list(cfg["stride"]), list(cfg["dilation"])
    halo = [torch.zeros_like(buf) for _, buf in pieces] if want_x else None
    gw: torch.Tensor | None = None
    origin = ex.need.h[0], ex.need.w[0]
    out_rect = Rect((0, g.shape[2]), (0, g.shape[3]))
    for band in split.bands:
        hs, ws = out_rect.local(band.out)
        gs, gws, _ = torch.ops.aten.convolution_backward(
            g[:, :, hs, ws], _sub(band, ex, pieces, x), weight, None, stride, [0, 0], dil,
            False, [0, 0], cfg["groups"], [want_x, want_w, False])
        if want_w:
            gw = gws if gw is None else gw + gws
        if halo is None:
            continue
        for (rect, _), acc in zip(pieces, halo, strict=True):
            local = _window_rect(rect, origin)
            part = local.intersect(band.win)
            if part is not None:
                a_h, a_w = local.local(part)
                s_h, s_w = band.win.local(part)
                acc[:, :, a_h, a_w] += gs[:, :, s_h, s_w]
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
        False, [0, 0], cfg["groups"], [want[0], want[1], want[2] and bias is not None])
    return gx, gw, gb
