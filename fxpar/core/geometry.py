"""Spatial arithmetic: tiles, the input window each op needs, and who sends what to whom.

Everything here is pure integer arithmetic on global coordinates (rows and columns of the whole
image at each layer); no tensors, no MPI. DESIGN.md, "Spatial parallelism: the arithmetic":

- tile k of an extent O split in P parts is ``[floor(k*O/P), floor((k+1)*O/P))``;
- a windowed op (kernel k, stride s, padding p, dilation d) computing output rows [o0, o1)
  reads input rows ``[o0*s - p, (o1-1)*s - p + d*(k-1) + 1)``; rows outside [0, extent) are
  padding, filled with the op's pad value by the rank itself;
- a rank's window is assembled from the intersections with every rank's tile: those are the
  messages, computed here once, so halos may reach past the immediate neighbour.
"""

from __future__ import annotations

from dataclasses import dataclass

Interval = tuple[int, int]  # [start, stop) in global coordinates; stop may pass the extent


def tile(extent: int, parts: int, k: int) -> Interval:
    """Tile ``k`` of ``extent`` split evenly in ``parts`` (the floor formula)."""
    return (k * extent // parts, (k + 1) * extent // parts)


def intersect(a: Interval, b: Interval) -> Interval | None:
    lo, hi = max(a[0], b[0]), min(a[1], b[1])
    return (lo, hi) if lo < hi else None


@dataclass(frozen=True)
class Rect:
    """Rows ``h`` x columns ``w`` in global coordinates."""

    h: Interval
    w: Interval

    @property
    def shape(self) -> tuple[int, int]:
        return (self.h[1] - self.h[0], self.w[1] - self.w[0])

    def intersect(self, other: Rect) -> Rect | None:
        h, w = intersect(self.h, other.h), intersect(self.w, other.w)
        return Rect(h, w) if h and w else None

    def local(self, inner: Rect) -> tuple[slice, slice]:
        """Slices selecting ``inner`` (global coords) inside a tensor holding ``self``."""
        return (slice(inner.h[0] - self.h[0], inner.h[1] - self.h[0]),
                slice(inner.w[0] - self.w[0], inner.w[1] - self.w[0]))

    def __str__(self) -> str:
        return f"rows {self.h[0]}:{self.h[1]} cols {self.w[0]}:{self.w[1]}"


@dataclass(frozen=True)
class Grid:
    """A rows x cols grid of tiles; tile t sits at row t // cols, column t % cols."""

    rows: int
    cols: int

    @property
    def size(self) -> int:
        return self.rows * self.cols

    def tile_rect(self, extent: tuple[int, int], t: int) -> Rect:
        """The part of an (H, W) extent that tile ``t`` owns."""
        return Rect(tile(extent[0], self.rows, t // self.cols),
                    tile(extent[1], self.cols, t % self.cols))

    def fits(self, extent: tuple[int, int]) -> bool:
        """True when every tile of ``extent`` is non-empty."""
        return extent[0] >= self.rows and extent[1] >= self.cols


# -- what each op reads ------------------------------------------------------------------------
def window_rows(out: Interval, k: int, s: int, p: int, d: int) -> Interval:
    """Input rows a convolution / pooling window needs for output rows ``out``."""
    o0, o1 = out
    return (o0 * s - p, (o1 - 1) * s - p + d * (k - 1) + 1)


def out_extent(n: int, k: int, s: int, p: int, d: int, ceil_mode: bool = False) -> int:
    """Output extent of a window op (PyTorch's formula, including its ceil_mode rule that the
    last window must start inside the input or the left padding)."""
    span = n + 2 * p - d * (k - 1) - 1
    o = (span + (s - 1 if ceil_mode else 0)) // s + 1
    if ceil_mode and (o - 1) * s >= n + p:
        o -= 1
    return o


def transposed_rows(out: Interval, k: int, s: int, p: int, d: int) -> Interval:
    """Input rows a transposed convolution needs for output rows ``out``: output o receives
    input i when o = i*s - p + j*d for a tap j in [0, k)."""
    o0, o1 = out
    lo = -((-(o0 + p - d * (k - 1))) // s)  # ceil
    hi = (o1 - 1 + p) // s
    return (lo, hi + 1)


@dataclass(frozen=True)
class Exchange:
    """What one rank does to turn its tile into ``need``: the messages, computed for all ranks.

    own: the region this rank holds; need: the region it must produce (may extend past the
    image: those cells are filled with ``fill``). sends: (tile, region of own) for every other
    tile that needs part of this one; recvs: (tile, region of need) this rank gets from others.
    """

    own: Rect
    need: Rect
    extent: tuple[int, int]
    sends: tuple[tuple[int, Rect], ...]
    recvs: tuple[tuple[int, Rect], ...]
    fill: float

    @property
    def local(self) -> Rect | None:
        """The part of ``need`` this rank already holds."""
        return self.own.intersect(self.need)

    def halo_widths(self) -> tuple[int, int, int, int]:
        """Rows/cols beyond the own tile on each side: (top, bottom, left, right); negative
        means rows dropped."""
        return (self.own.h[0] - self.need.h[0], self.need.h[1] - self.own.h[1],
                self.own.w[0] - self.need.w[0], self.need.w[1] - self.own.w[1])

    def recv_elements(self) -> int:
        return sum(r.shape[0] * r.shape[1] for _, r in self.recvs)


def exchange(grid: Grid, extent: tuple[int, int], needs: list[Rect], t: int,
             fill: float = 0.0) -> Exchange:
    """The exchange for tile ``t`` when tile ``u`` needs ``needs[u]`` of a tiled tensor."""
    image = Rect((0, extent[0]), (0, extent[1]))
    own = grid.tile_rect(extent, t)
    sends, recvs = [], []
    for u in range(grid.size):
        if u == t:
            continue
        part = own.intersect(needs[u])
        if part is not None:
            sends.append((u, part))
        inside = needs[t].intersect(image)
        theirs = grid.tile_rect(extent, u).intersect(inside) if inside is not None else None
        if theirs is not None:
            recvs.append((u, theirs))
    return Exchange(own, needs[t], extent, tuple(sends), tuple(recvs), fill)


def avg_counts(n: int, n_out: int, k: int, s: int, p: int,
               count_include_pad: bool) -> list[int]:
    """Per output position along one dim, the divisor factor PyTorch's avg_pool uses (the 2-D
    divisor is the product of the two dims' factors)."""
    out = []
    for o in range(n_out):
        start = o * s - p
        end = min(start + k, n + p)
        padded = end - start
        start, end = max(start, 0), min(end, n)
        out.append(padded if count_include_pad else end - start)
    return out
