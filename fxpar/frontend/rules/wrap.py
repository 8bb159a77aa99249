"""Reads that wrap around the image: ``torch.roll`` over spatial dims as the window kind
``wrap`` (fxpar.frontend.rules.opkind), for any layout that names where its spatial dims are.

Circular padding is the same kind (fxpar.frontend.rules.aten_ops, ``_pad``): output row o of a
dim padded by (a, b) reads input row (o - a) mod extent; a roll by s reads (o - s) mod extent.
The window's rows outside [0, extent) are brought by the exchange from the tiles that hold them
(fxpar.core.geometry.exchange with ``wrap``): no tile pads.
"""

from __future__ import annotations

from typing import Any

from fxpar.frontend.rules.opkind import Op, Pointwise, Window


def roll_window(shape: tuple[int, ...], shifts: Any, dims: Any, spatial: tuple[int, ...]
                ) -> Op | None:
    """``torch.roll(x, shifts, dims)`` on a tensor of ``shape`` whose spatial dims sit at
    positions ``spatial`` (2, 3 (, 4) for N, C, (D,) H, W; 1, 2 for a channels-last N, H, W,
    C). Rolling other dims only is per pixel; rolling a spatial dim by s is the window kind
    "wrap": output row o reads input row (o - s) mod extent, every tile's rows come from the
    tiles s rows before it, cyclically. The shift is taken in (-extent/2, extent/2] (the
    same roll, the shorter way round); the other dims' shifts ride along (attr ``roll``: (dim,
    shift) pairs, done on the tile). None for a roll without dims (of the flattened tensor)."""
    shifts = [shifts] if isinstance(shifts, int) else list(shifts)
    dims = [dims] if isinstance(dims, int) else list(dims)
    if not dims or len(dims) != len(shifts) or \
            not all(isinstance(v, int) for v in (*shifts, *dims)):
        return None
    total: dict[int, int] = {}
    for d, s in zip(dims, shifts, strict=True):
        total[d % len(shape)] = total.get(d % len(shape), 0) + s
    if not any(d in spatial for d in total):
        return Pointwise()  # the batch or channel dims: each pixel on its own
    before = []
    for d in spatial:
        e = shape[d]
        s = total.get(d, 0) % e
        before.append(s - e if s > e // 2 else s)
    other = tuple((d, s) for d, s in sorted(total.items())
                  if d not in spatial and s % shape[d])
    nd = len(spatial)
    return Window("wrap", (1,) * nd, (1,) * nd, tuple(before), attrs=(("roll", other),))
