"""Geometric augmentation as a map from output coordinates to source coordinates, and the
samplers that read a window of the source through it.

A geometric transform is described backwards: ``back(params, p, out, inn)`` takes coordinates
``p`` (float64, shape (..., ndim)) of its *output* (global: cells of the whole augmented
sample) and returns the coordinates of its *input* they come from; ``extent_in`` gives the
input's size. A window of the augmented sample is then computed by mapping just the window's
cells through the chain, reading the bounding box of the source cells they touch (the
transform's halo, clipped to the image) and sampling there. Every step is element-wise in
float64 (no matmul: a blocked sum could round differently for another window size), so a
window equals, bit for bit, the same cells of the whole augmented sample.

Sampling is a gather, not ``torch.nn.functional.grid_sample``: grid_sample takes normalised
coordinates ``x = 2 * i / (n - 1) - 1`` (align_corners=True) and unnormalises them again, which
rounds differently for a window of another size ``n``; the weights here come from the global
coordinate itself. ``linear`` is grid_sample's bilinear / trilinear with ``align_corners=True``
and zeros padding (``fill`` outside the image) up to the order of the sum (checked in
tests/unit/test_augment.py); ``nearest`` (labels) rounds half up.

Transforms (one class each; ``discrete`` ones map cells to cells, so images are not
resampled):

- :class:`Flip` (each axis with probability ``p``), :class:`Rot90` (k * 90 degrees in a random
  plane: any axis pair of a volume), :class:`Transpose` (swap a random axis pair), all as
  torch.flip / torch.rot90 / transpose would do on the whole sample;
- :class:`Offset`: a random integer shift of the region by up to ``pixels``;
- :class:`Affine`: rotation (2-D: one angle; 3-D: one per axis pair), isotropic zoom and a
  translation, about the centre of the sample;
- :class:`Elastic`: a smooth displacement field: random vectors on a coarse grid of control
  points every ``spacing`` cells of the output, interpolated by cubic B-splines at each cell's
  global position (the window evaluates only its cells).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch

from fxpar.core.geometry import Rect

Coords = torch.Tensor  # (..., ndim) float64
Extent = tuple[int, ...]


def grid_of(window: Rect) -> Coords:
    """The global coordinates of every cell of ``window``: shape (*window.shape, ndim)."""
    axes = [torch.arange(a, b, dtype=torch.float64) for a, b in window.dims]
    return torch.stack(torch.meshgrid(*axes, indexing="ij"), dim=-1)


def _planes(ndim: int) -> list[tuple[int, int]]:
    return list(itertools.combinations(range(ndim), 2))


def _swap(extent: Extent, a: int, b: int) -> Extent:
    e = list(extent)
    e[a], e[b] = e[b], e[a]
    return tuple(e)


@dataclass(frozen=True)
class Flip:
    """Mirror each axis with probability ``p``."""

    p: float = 0.5
    discrete: ClassVar[bool] = True

    def draw(self, g: np.random.Generator, out: Extent) -> tuple[bool, ...]:
        return tuple(bool(g.random() < self.p) for _ in out)

    def extent_in(self, params: Any, out: Extent) -> Extent:
        return out

    def back(self, params: tuple[bool, ...], p: Coords, out: Extent, inn: Extent) -> Coords:
        cols = [(n - 1) - p[..., i] if f else p[..., i]
                for i, (f, n) in enumerate(zip(params, out, strict=True))]
        return torch.stack(cols, dim=-1)


@dataclass(frozen=True)
class Rot90:
    """``k`` quarter turns (k uniform in 0..3) in a random axis plane, as ``torch.rot90(x, k,
    dims=plane)``: a non-square plane swaps its sizes, so the region read is transposed."""

    discrete: ClassVar[bool] = True

    def draw(self, g: np.random.Generator, out: Extent) -> tuple[int, tuple[int, int]]:
        planes = _planes(len(out))
        return int(g.integers(0, 4)), planes[int(g.integers(0, len(planes)))]

    def extent_in(self, params: tuple[int, tuple[int, int]], out: Extent) -> Extent:
        k, (a, b) = params
        return _swap(out, a, b) if k % 2 else out

    def back(self, params: tuple[int, tuple[int, int]], p: Coords, out: Extent,
             inn: Extent) -> Coords:
        k, (a, b) = params
        cols = list(p.unbind(-1))
        oa, ob = cols[a], cols[b]
        if k == 1:  # torch.rot90 k=1: out[i, j] = x[j, B - 1 - i]
            cols[a], cols[b] = ob, (out[a] - 1) - oa
        elif k == 2:
            cols[a], cols[b] = (out[a] - 1) - oa, (out[b] - 1) - ob
        elif k == 3:  # out[i, j] = x[A - 1 - j, i]
            cols[a], cols[b] = (out[b] - 1) - ob, oa
        return torch.stack(cols, dim=-1)


@dataclass(frozen=True)
class Transpose:
    """Swap a random axis pair with probability ``p`` (with flips and rot90: the dihedral
    group of the square, or the cube's symmetries)."""

    p: float = 0.5
    discrete: ClassVar[bool] = True

    def draw(self, g: np.random.Generator, out: Extent) -> tuple[int, int] | None:
        planes = _planes(len(out))
        plane = planes[int(g.integers(0, len(planes)))]
        return plane if g.random() < self.p else None

    def extent_in(self, params: tuple[int, int] | None, out: Extent) -> Extent:
        return out if params is None else _swap(out, *params)

    def back(self, params: tuple[int, int] | None, p: Coords, out: Extent,
             inn: Extent) -> Coords:
        if params is None:
            return p
        a, b = params
        cols = list(p.unbind(-1))
        cols[a], cols[b] = cols[b], cols[a]
        return torch.stack(cols, dim=-1)


@dataclass(frozen=True)
class Offset:
    """Shift the region by a random whole number of cells in ``[-pixels, pixels]`` per dim
    (it reads past the region: a real halo of the slide, or ``fill`` past the image)."""

    pixels: int = 8
    discrete: ClassVar[bool] = True

    def draw(self, g: np.random.Generator, out: Extent) -> tuple[int, ...]:
        return tuple(int(g.integers(-self.pixels, self.pixels + 1)) for _ in out)

    def extent_in(self, params: Any, out: Extent) -> Extent:
        return out

    def back(self, params: tuple[int, ...], p: Coords, out: Extent, inn: Extent) -> Coords:
        return p + torch.tensor(params, dtype=torch.float64)


def _rotation(ndim: int, angles: list[float]) -> np.ndarray:
    m = np.eye(ndim)
    for (a, b), t in zip(_planes(ndim), angles, strict=True):
        r = np.eye(ndim)
        r[a, a], r[a, b], r[b, a], r[b, b] = math.cos(t), -math.sin(t), math.sin(t), math.cos(t)
        m = r @ m
    return m


@dataclass(frozen=True)
class Affine:
    """Rotate by up to ``degrees`` (in each axis plane), zoom by a factor in ``[1 - zoom,
    1 + zoom]`` and translate by up to ``shift`` cells, about the sample's centre. The input
    has the output's size; its corners read outside the region (a halo of the source)."""

    degrees: float = 15.0
    zoom: float = 0.1
    shift: float = 4.0
    discrete: ClassVar[bool] = False

    def draw(self, g: np.random.Generator, out: Extent) -> tuple[tuple[tuple[float, ...], ...],
                                                                tuple[float, ...]]:
        n = len(out)
        angles = [math.radians(g.uniform(-self.degrees, self.degrees)) for _ in _planes(n)]
        scale = g.uniform(1 - self.zoom, 1 + self.zoom)
        m = _rotation(n, angles) / scale  # backward: output offsets -> input offsets
        t = [float(g.uniform(-self.shift, self.shift)) for _ in range(n)]
        return tuple(tuple(float(v) for v in row) for row in m), tuple(t)

    def extent_in(self, params: Any, out: Extent) -> Extent:
        return out

    def back(self, params: Any, p: Coords, out: Extent, inn: Extent) -> Coords:
        m, t = params
        d = [p[..., j] - (n - 1) / 2 for j, n in enumerate(out)]
        cols = []
        for i, row in enumerate(m):
            acc = row[0] * d[0]
            for j in range(1, len(d)):
                acc = acc + row[j] * d[j]
            cols.append(acc + ((inn[i] - 1) / 2 + t[i]))
        return torch.stack(cols, dim=-1)


def _bspline(t: torch.Tensor) -> list[torch.Tensor]:
    """The four cubic B-spline weights at fraction ``t`` (element-wise)."""
    s = 1 - t
    return [s * s * s / 6, (3 * t * t * t - 6 * t * t + 4) / 6,
            (-3 * t * t * t + 3 * t * t + 3 * t + 1) / 6, t * t * t / 6]


@dataclass(frozen=True)
class Elastic:
    """A smooth random displacement of up to a few ``sigma`` cells: normal vectors (standard
    deviation ``sigma``) on control points every ``spacing`` output cells (from cell 0, one
    beyond each end), cubic B-spline interpolated at each cell: in = out + field(out)."""

    sigma: float = 4.0
    spacing: int = 32
    discrete: ClassVar[bool] = False

    def draw(self, g: np.random.Generator, out: Extent) -> tuple[tuple[int, ...],
                                                                tuple[float, ...]]:
        shape = (len(out), *((n - 1) // self.spacing + 4 for n in out))
        return shape, tuple(g.normal(0.0, self.sigma, shape).ravel().tolist())

    def extent_in(self, params: Any, out: Extent) -> Extent:
        return out

    def back(self, params: tuple[tuple[int, ...], tuple[float, ...]], p: Coords, out: Extent,
             inn: Extent) -> Coords:
        field = torch.tensor(params[1], dtype=torch.float64).reshape(params[0])
        n = len(out)
        top = torch.tensor([(e - 1) / self.spacing for e in out], dtype=torch.float64)
        u = torch.minimum(torch.clamp(p / self.spacing, min=0.0), top)  # past the ends: held
        base = torch.floor(u)
        weights = [_bspline(t) for t in (u - base).unbind(-1)]
        idx = base.long().unbind(-1)
        disp = torch.zeros_like(p)
        for taps in itertools.product(range(4), repeat=n):
            w = weights[0][taps[0]]
            for d in range(1, n):
                w = w * weights[d][taps[d]]
            where = tuple(i + k for i, k in zip(idx, taps, strict=True))
            disp = disp + w[..., None] * field[(slice(None), *where)].movedim(0, -1)
        return p + disp


# -- reading through the map --------------------------------------------------------------------
def needed(s: Coords, image: Extent, order: str) -> Rect | None:
    """The source cells sampling at ``s`` reads (the halo of the map), inside the image; None
    when none is inside."""
    if s.numel() == 0:
        return None
    f = torch.floor(s + 0.5) if order == "nearest" else torch.floor(s)
    lo = f.reshape(-1, len(image)).amin(0).tolist()
    hi = f.reshape(-1, len(image)).amax(0).tolist()
    reach = 1 if order == "nearest" else 2
    box = Rect(*((int(a), int(b) + reach) for a, b in zip(lo, hi, strict=True)))
    return box.intersect(Rect.whole(image))


def _taps(src: torch.Tensor, box: Rect, idx: list[torch.Tensor], image: Extent,
          fill: float) -> torch.Tensor:
    """``src`` (C, *box.shape, the box of the source) at global cells ``idx`` (one long tensor
    per dim), ``fill`` outside the image."""
    inside = torch.ones(idx[0].shape, dtype=torch.bool)
    local = []
    for i, (a, b), n in zip(idx, box.dims, image, strict=True):
        inside &= (i >= 0) & (i < n)
        local.append((i - a).clamp(0, b - a - 1))
    v = src[(slice(None), *local)]
    return torch.where(inside, v, torch.as_tensor(fill, dtype=src.dtype))


def sample(src: torch.Tensor | None, box: Rect | None, s: Coords, image: Extent, order: str,
           fill: float = 0.0) -> torch.Tensor:
    """The source at coordinates ``s`` (global, (*shape, ndim)): ``order`` "linear" (bilinear /
    trilinear) or "nearest"; ``src`` holds ``box`` of it, (C, *box.shape); ``fill`` outside the
    image. Returns (C, *shape)."""
    shape = s.shape[:-1]
    if src is None or box is None:
        raise ValueError("sample() without a source box: the caller fills a window that reads "
                         "no cell of the image (needed() is None) with the fill value")
    if order == "nearest":
        idx = list(torch.floor(s + 0.5).long().unbind(-1))
        return _taps(src, box, idx, image, fill)
    f = torch.floor(s)
    w = (s - f).unbind(-1)
    base = f.long().unbind(-1)
    out = torch.zeros((src.shape[0], *shape), dtype=src.dtype)
    for corner in itertools.product((0, 1), repeat=len(image)):
        weight = None
        for d, c in enumerate(corner):
            wd = w[d] if c else 1 - w[d]
            weight = wd if weight is None else weight * wd
        idx = [b + c for b, c in zip(base, corner, strict=True)]
        out = out + _taps(src, box, idx, image, fill) * weight
    return out
