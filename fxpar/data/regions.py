"""Regions and crops of region-by-region inference: plain arithmetic, no model, no MPI.

The image (or volume) is cut into *regions* of ``region`` input cells per dim (the last one
of a dim may be shorter); each region is computed on a *crop* that holds it plus the model's
margins (fxpar.compiler.receptive.Reach), starting at a multiple of the model's step. Per dim::

    image   |0 ............................................................. E|
    regions |   r0   |   r1   |   r2   |   r3   | r4 |
    crop 1      [c0 ............... c0 + L)          c0 = step * floor((r1 - before) / step)
    crop 4                          [E - L' .......... E)   the last crops end at the border

All interior crops have one length L = step * ceil((region + before + after + step - 1) /
step), so one compiled program serves them; crops that would run past the border end at it
instead (length L' in [L, L + step)), and an image shorter than L is one crop. A dim thus has
at most two crop lengths, and an image at most 2^dims crop shapes (one program each).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from dataclasses import dataclass
from fractions import Fraction

from fxpar.core.geometry import Interval, Rect


@dataclass(frozen=True)
class Region:
    """One region: its index in the grid, its input box, the crop computed for it and the
    output boxes (global, and inside the crop's output)."""

    index: tuple[int, ...]
    box: Rect
    """The region's input cells (global)."""
    crop: Rect
    """The input cells the model runs on (global)."""
    out: Rect
    """The region's output cells (global)."""
    keep: Rect
    """The same cells in the crop's output."""

    @property
    def crop_shape(self) -> tuple[int, ...]:
        return self.crop.shape


def _align_down(v: int, step: int) -> int:
    return v // step * step


@dataclass(frozen=True)
class RegionGrid:
    """Every region of an image of spatial size ``image`` (see the module doc)."""

    image: tuple[int, ...]
    region: tuple[int, ...]
    """Region size in input cells, a multiple of ``step`` (see :func:`region_grid`)."""
    step: tuple[int, ...]
    scale: tuple[Fraction, ...]
    before: tuple[int, ...]
    after: tuple[int, ...]
    out_image: tuple[int, ...]
    """The whole image's output size."""

    @property
    def counts(self) -> tuple[int, ...]:
        """Regions per dim."""
        return tuple(math.ceil(e / r) for e, r in zip(self.image, self.region, strict=True))

    def __len__(self) -> int:
        return math.prod(self.counts)

    @property
    def crop_length(self) -> tuple[int, ...]:
        """L per dim: the interior crops' length (the image's, when shorter)."""
        return tuple(min(e, math.ceil((r + b + a + s - 1) / s) * s) for e, r, b, a, s in zip(
            self.image, self.region, self.before, self.after, self.step, strict=True))

    def _dim(self, i: int, k: int) -> tuple[Interval, Interval, Interval]:
        """(region, crop, output) intervals of region k along dim i."""
        e, r, s, length = self.image[i], self.region[i], self.step[i], self.crop_length[i]
        r0, r1 = k * r, min(e, (k + 1) * r)
        c0 = max(0, _align_down(r0 - self.before[i], s))
        if c0 + length >= e:
            c0 = max(0, _align_down(e - length, s))
            c1 = e
        else:
            c1 = c0 + length
        sc = self.scale[i]
        o0 = math.floor(r0 * sc)
        o1 = self.out_image[i] if r1 == e else math.floor(r1 * sc)
        return (r0, r1), (c0, c1), (o0, o1)

    def regions(self) -> Iterator[Region]:
        """Every region, in row-major order (the last dim fastest)."""
        per_dim = [[self._dim(i, k) for k in range(n)] for i, n in enumerate(self.counts)]
        for index in itertools.product(*(range(n) for n in self.counts)):
            parts = [per_dim[i][k] for i, k in enumerate(index)]
            box = Rect(*(p[0] for p in parts))
            crop = Rect(*(p[1] for p in parts))
            out = Rect(*(p[2] for p in parts))
            keep = Rect(*((o0 - math.floor(c0 * sc), o1 - math.floor(c0 * sc))
                          for (o0, o1), (c0, _), sc in zip(out.dims, crop.dims, self.scale,
                                                            strict=True)))
            yield Region(tuple(index), box, crop, out, keep)

    def shapes(self) -> list[tuple[int, ...]]:
        """The distinct crop shapes, most frequent first (one compiled program each)."""
        count: dict[tuple[int, ...], int] = {}
        for r in self.regions():
            count[r.crop_shape] = count.get(r.crop_shape, 0) + 1
        return sorted(count, key=lambda s: -count[s])


def region_grid(image: tuple[int, ...], region: int | tuple[int, ...], step: tuple[int, ...],
                scale: tuple[Fraction, ...], before: tuple[int, ...], after: tuple[int, ...],
                out_image: tuple[int, ...]) -> RegionGrid:
    """The regions of ``image`` (spatial size); ``region`` (an int: the same along every dim)
    is rounded up to a multiple of ``step`` and capped at the image. Raises ValueError."""
    sizes = (region,) * len(image) if isinstance(region, int) else tuple(region)
    if len(sizes) != len(image) or any(r < 1 for r in sizes):
        raise ValueError(f"region {region}: give one size >= 1, or one per spatial dim of the "
                         f"image {'x'.join(map(str, image))}")
    sizes = tuple(min(e, math.ceil(r / s) * s) for r, s, e in zip(sizes, step, image,
                                                                  strict=True))
    return RegionGrid(tuple(image), sizes, tuple(step), tuple(scale), tuple(before),
                      tuple(after), tuple(out_image))


def batches(regions: list[Region], size: int) -> Iterator[list[Region]]:
    """Regions grouped by crop shape into lists of at most ``size`` (one forward each), in
    the order of their first region."""
    groups: dict[tuple[int, ...], list[Region]] = {}
    for r in regions:
        groups.setdefault(r.crop_shape, []).append(r)
    for group in groups.values():
        for i in range(0, len(group), size):
            yield group[i:i + size]
