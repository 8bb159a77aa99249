"""Nearest, bilinear and trilinear interpolation on tiles (any scale, a target size, both
align_corners), and reflect / replicate padding, as index maps (one per spatial dim).

Interpolation is a separable index map: output row o reads input rows ``i0(o)`` and ``i1(o)``
with weights ``1 - l(o)`` and ``l(o)`` (nearest: one row, weight 1). The map is the one
PyTorch's kernels use (ATen/native/UpSample.h), computed in the same precision:

- bilinear, align_corners: ``src = o * (in - 1) / (out - 1)``;
- bilinear, otherwise: ``src = max(0, scale * (o + 0.5) - 0.5)``, ``scale = 1 / scale_factor``
  when the call gave one, else ``in / out``; ``i0 = floor(src)``, ``i1 = i0 + (i0 < in - 1)``;
- nearest: ``o`` when out = in, ``o // 2`` when out = 2 in, else
  ``min(floor(o * scale), in - 1)`` in float32.

Reflect and replicate padding are index maps too (``i0 = i1``, weight 1): output row ``o``
copies input row ``o - before``, reflected (``-i``, ``2 (in - 1) - i``) or clamped at the
border, so only the border tiles pad and the others read a halo as for any window.

A tile's output rows need the input rows from ``i0(first)`` to ``i1(last)``: that window is
what the halo exchange brings (never past the image: every index is inside it); the tile then
gathers its rows from the window with global indices, so every tile computes exactly what one
device computes for those rows.

The common case -- nearest or bilinear (align_corners=False) by a power-of-two factor s, the
decoder upsampling of a U-Net -- runs PyTorch's own kernel on the window instead
(:meth:`AxisMap.factor`): window row ``w`` is image row ``start + w``, so the window's output
row ``o`` is the image's row ``s * start + o``, computed with the same scale (1/s, exact in
binary) and the same weights; rows the window's own border clamps lie outside the tile's and
are cut off. One kernel forward and one backward instead of a gather, blend and index_add per
dim (tools/bench_spatial.py --interp).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from fxpar.core.geometry import Interval

PADS = ("reflect", "replicate")


@dataclass(frozen=True)
class AxisMap:
    """The index map of one spatial dim: ``size_in`` -> ``size_out`` rows."""

    mode: str  # "nearest" | "bilinear" | "reflect" | "replicate" (padding)
    align_corners: bool
    size_in: int
    size_out: int
    scale: float | None  # the call's scale factor, if it gave one
    before: int = 0
    """Padding: rows added before row 0 (``size_out - size_in - before`` after the end)."""

    def _scale(self, dtype: torch.dtype) -> torch.Tensor:
        if self.mode == "bilinear" and self.align_corners:
            if self.size_out > 1:  # (scalar_t)(in - 1) / (out - 1): divided in scalar_t
                return torch.tensor(self.size_in - 1, dtype=dtype) / (self.size_out - 1)
            return torch.tensor(0.0, dtype=dtype)
        if self.scale is not None and self.scale > 0:
            return torch.tensor(1.0 / self.scale, dtype=dtype)
        return torch.tensor(self.size_in, dtype=dtype) / self.size_out

    def indices(self, rows: Interval, dtype: torch.dtype = torch.float64
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(i0, i1, lambda1) for output rows ``rows`` (global input indices)."""
        o = torch.arange(rows[0], rows[1])
        if self.mode in PADS:  # a copy of one input row: reflected or clamped at the border
            i0 = o - self.before
            if self.mode == "reflect":
                i0 = i0.abs()
                i0 = torch.where(i0 >= self.size_in, 2 * (self.size_in - 1) - i0, i0)
            else:
                i0 = i0.clamp(0, self.size_in - 1)
            return i0, i0, torch.zeros(len(o), dtype=dtype)
        if self.mode == "nearest":
            if self.size_out == self.size_in:
                i0 = o
            elif self.size_out == 2 * self.size_in:
                i0 = o // 2
            else:
                scale = self._scale(torch.float32)
                i0 = torch.floor(o.to(torch.float32) * scale).to(torch.int64)
                i0 = i0.clamp_max(self.size_in - 1)
            return i0, i0, torch.zeros(len(o), dtype=dtype)
        opmath = torch.float64 if dtype == torch.float64 else torch.float32
        scale = self._scale(opmath)
        if self.align_corners:
            src = scale * o.to(opmath)
        else:
            src = (scale * (o.to(opmath) + 0.5) - 0.5).clamp_min(0)
        i0 = src.to(torch.int64).clamp_max(self.size_in - 1)
        i1 = i0 + (i0 < self.size_in - 1).to(torch.int64)
        lam = (src - i0.to(opmath)).clamp(0, 1)
        return i0, i1, lam.to(dtype)

    def factor(self) -> int | None:
        """s when this map is PyTorch's kernel run on any window (see the module doc):
        nearest, or bilinear without align_corners, by s = 2^k with the scale 1/s exact in
        both precisions the kernels compute in; else None."""
        if self.mode not in ("nearest", "bilinear") or self.align_corners \
                or self.size_out % self.size_in:
            return None
        s = self.size_out // self.size_in
        if s & (s - 1) or any(float(self._scale(dt)) != 1.0 / s
                              for dt in (torch.float32, torch.float64)):
            return None
        return s

    def needs(self, rows: Interval) -> Interval:
        """Input rows that output rows ``rows`` read."""
        if rows[1] <= rows[0]:
            return (0, 0)
        i0, i1, _ = self.indices(rows)
        return (int(i0.min()), int(i1.max()) + 1)


class TileInterp(nn.Module):
    """This tile's output cells of an interpolation (or reflect / replicate padding): along
    each spatial dim i the output interval ``out[i]``, from a window of the input that starts
    at global index ``start[i]``. One gather (and blend) per dim: trilinear is bilinear with
    one more dim."""

    def __init__(self, maps: tuple[AxisMap, ...], out: tuple[Interval, ...],
                 start: tuple[int, ...]) -> None:
        super().__init__()
        if not len(maps) == len(out) == len(start):
            raise ValueError(f"TileInterp: one map, interval and start per dim, got "
                             f"{len(maps)}, {len(out)}, {len(start)}")
        self.maps = tuple(maps)
        self.out = tuple(tuple(iv) for iv in out)
        self.start = tuple(start)
        factors = tuple(m.factor() for m in self.maps)
        same = len({m.mode for m in self.maps}) == 1
        self.factors = factors if same and None not in factors else None
        """Per dim s: PyTorch's kernel on the window, cut to the tile (module doc); None:
        the gather."""

    def emit_args(self) -> dict[str, Any]:
        return {"maps": self.maps, "out": self.out, "start": self.start}

    def _gather(self, x: torch.Tensor, dim: int, m: AxisMap, out: Interval,
                start: int) -> torch.Tensor:
        i0, i1, lam = m.indices(out, x.dtype)
        a = x.index_select(dim, (i0 - start).to(x.device))
        if m.mode == "nearest" or m.mode in PADS:
            return a
        b = x.index_select(dim, (i1 - start).to(x.device))
        shape = [1] * x.dim()
        shape[dim] = -1
        lam = lam.to(x.device).reshape(shape)
        return a * (1 - lam) + b * lam

    def _kernel(self, x: torch.Tensor, factors: tuple[int, ...]) -> torch.Tensor | None:
        """PyTorch's interpolation of the whole window, cut to this tile's rows (None when the
        window does not reach them, and the gather runs instead)."""
        cut = []
        for (a, b), start, s, n in zip(self.out, self.start, factors, x.shape[2:], strict=True):
            if a < s * start or b > s * (start + n):
                return None
            cut.append(slice(a - s * start, b - s * start))
        linear = self.maps[0].mode == "bilinear"
        mode = ("linear", "bilinear", "trilinear")[x.dim() - 3] if linear else "nearest"
        y = F.interpolate(x, scale_factor=[float(s) for s in factors], mode=mode,
                          align_corners=False if linear else None)
        return y[(slice(None), slice(None), *cut)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.factors is not None:
            y = self._kernel(x, self.factors)
            if y is not None:
                return y
        for i, (m, out, start) in enumerate(zip(self.maps, self.out, self.start, strict=True)):
            x = self._gather(x, 2 + i, m, out, start)
        return x

    def extra_repr(self) -> str:
        m = self.maps[0]
        corners = ", align_corners" if m.align_corners else ""
        mode = "trilinear" if m.mode == "bilinear" and len(self.maps) == 3 else m.mode
        cells = " x ".join(f"{a}:{b}" for a, b in self.out)
        return f"{mode}{corners}: output {cells} from a window at {self.start}"
