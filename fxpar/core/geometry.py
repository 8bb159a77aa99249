"""Spatial arithmetic: tiles, the input window each op needs, and who sends what to whom.

Everything here is pure integer arithmetic on global coordinates (rows and columns of the whole
image at each layer; depth, rows and columns of a volume: every rule is per dim, so the same
code serves both); no tensors, no MPI. DESIGN.md, "Spatial parallelism: the arithmetic":

- tile k of an extent O split in P parts is ``[floor(k*O/P), floor((k+1)*O/P))``;
- a windowed op (kernel k, stride s, padding p, dilation d) computing output rows [o0, o1)
  reads input rows ``[o0*s - p, (o1-1)*s - p + d*(k-1) + 1)``; rows outside [0, extent) are
  padding, filled with the op's pad value by the rank itself;
- a rank's window is assembled from the intersections with every rank's tile: those are the
  messages, computed here once, so halos may reach past the immediate neighbour; on a grid
  split along several dims they include the edge and corner pieces from diagonal tiles;
- a *wrapping* window (circular padding, ``torch.roll``) reads row ``r`` outside [0, extent)
  as row ``r mod extent``: it is cut into pieces that each lie in one copy of the image
  (:func:`wrap_pieces`), and each piece is exchanged like a halo, so a border tile gets the
  opposite border's rows (and a roll's tiles each other's) by the same messages.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

Interval = tuple[int, int]  # [start, stop) in global coordinates; stop may pass the extent


def tile(extent: int, parts: int, k: int) -> Interval:
    """Tile ``k`` of ``extent`` split evenly in ``parts`` (the floor formula)."""
    return (k * extent // parts, (k + 1) * extent // parts)


def intersect(a: Interval, b: Interval) -> Interval | None:
    lo, hi = max(a[0], b[0]), min(a[1], b[1])
    return (lo, hi) if lo < hi else None


@dataclass(frozen=True, init=False)
class Rect:
    """A box in global coordinates: one interval per spatial dim, in the tensor's order (rows x
    columns of an image; depth x rows x columns of a volume). ``Rect(rows, cols)``,
    ``Rect(depth, rows, cols)`` or ``Rect(dims=...)``."""

    dims: tuple[Interval, ...]

    def __init__(self, *dims: Interval, **kw: tuple[Interval, ...]) -> None:
        if "dims" in kw:  # the keyword form (how fxpar.program.emit writes a Rect)
            dims = tuple(kw.pop("dims"))
        if kw or not dims:
            raise TypeError(f"Rect takes one interval per dim, got {dims!r} {kw!r}")
        object.__setattr__(self, "dims", tuple((int(a), int(b)) for a, b in dims))

    @classmethod
    def whole(cls, extent: tuple[int, ...]) -> Rect:
        """All of an extent: ``[0, e)`` along each dim."""
        return cls(*((0, int(e)) for e in extent))

    @property
    def ndim(self) -> int:
        return len(self.dims)

    @property
    def h(self) -> Interval:
        """The rows (the second-to-last dim)."""
        return self.dims[-2]

    @property
    def w(self) -> Interval:
        """The columns (the last dim)."""
        return self.dims[-1]

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(b - a for a, b in self.dims)

    @property
    def size(self) -> int:
        """Cells in the box."""
        return math.prod(self.shape)

    def intersect(self, other: Rect) -> Rect | None:
        parts = [intersect(a, b) for a, b in zip(self.dims, other.dims, strict=True)]
        return None if any(p is None for p in parts) else Rect(*parts)  # type: ignore[arg-type]

    def local(self, inner: Rect) -> tuple[slice, ...]:
        """Slices selecting ``inner`` (global coords) inside a tensor holding ``self``."""
        return tuple(slice(i[0] - o[0], i[1] - o[0])
                     for i, o in zip(inner.dims, self.dims, strict=True))

    def moved(self, origin: tuple[int, ...]) -> Rect:
        """This box in coordinates that start at ``origin``."""
        return Rect(*((a - o, b - o) for (a, b), o in zip(self.dims, origin, strict=True)))

    def __str__(self) -> str:
        names = ("L",) if self.ndim == 1 else DIM_NAMES[-self.ndim:] \
            if self.ndim <= len(DIM_NAMES) else tuple(f"dim{i}" for i in range(self.ndim))
        return " ".join(f"{n} {a}:{b}" for n, (a, b) in zip(names, self.dims, strict=True))

    def __repr__(self) -> str:
        return f"Rect{self.dims!r}" if self.ndim > 1 else f"Rect({self.dims[0]!r})"


DIM_NAMES = ("depth", "rows", "cols")
"""What the spatial dims are called in messages (a volume's three, an image's last two; a
sequence's one is L)."""


@dataclass(frozen=True, init=False)
class Grid:
    """A process grid over the spatial dims: ``parts[i]`` tiles along dim i (``Grid(rows,
    cols)`` for an image, ``Grid(depth, rows, cols)`` for a volume). Tile t sits at the
    row-major position of t (the last dim varies fastest)."""

    parts: tuple[int, ...]

    def __init__(self, *parts: int, **kw: tuple[int, ...]) -> None:
        if "parts" in kw:
            parts = tuple(kw.pop("parts"))
        if kw or not parts or any(int(p) < 1 for p in parts):
            raise TypeError(f"Grid takes one part count >= 1 per dim, got {parts!r} {kw!r}")
        object.__setattr__(self, "parts", tuple(int(p) for p in parts))

    @property
    def ndim(self) -> int:
        return len(self.parts)

    @property
    def size(self) -> int:
        return math.prod(self.parts)

    def position(self, t: int) -> tuple[int, ...]:
        """Tile ``t``'s index along each dim."""
        out = []
        for p in reversed(self.parts):
            out.append(t % p)
            t //= p
        return tuple(reversed(out))

    def tile_rect(self, extent: tuple[int, ...], t: int) -> Rect:
        """The part of an extent (one size per spatial dim) that tile ``t`` owns."""
        if len(extent) != self.ndim:
            raise ValueError(f"a {self} grid splits {self.ndim} spatial dims; the extent "
                             f"{tuple(extent)} has {len(extent)}")
        return Rect(*(tile(e, p, k) for e, p, k in
                      zip(extent, self.parts, self.position(t), strict=True)))

    def fits(self, extent: tuple[int, ...]) -> bool:
        """True when every tile of ``extent`` is non-empty."""
        return len(extent) == self.ndim and all(e >= p for e, p in
                                                zip(extent, self.parts, strict=True))

    def __str__(self) -> str:
        return "x".join(map(str, self.parts))


# -- what each op reads ------------------------------------------------------------------------
def per_dim(v: int | Sequence[int], n: int) -> tuple[int, ...]:
    """A per-dim argument of a windowed op (a kernel size, stride, padding or dilation: an
    int, or a list of 1 or ``n`` ints) as ``n`` ints: what ATen's convolutions and pools read."""
    if isinstance(v, int):
        return (v,) * n
    ints = [int(u) for u in v]
    return tuple(ints) * n if len(ints) == 1 else tuple(ints[-n:])


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
    image: those cells are filled with ``fill``, or with ``wrap`` read from the opposite border).
    sends: (tile, region of own) for every other tile that needs part of this one; recvs:
    (tile, region of need) this rank gets from others. A tile may send to (receive from) one
    peer several pieces: a wrapping window can hold the same image cells twice; both ends list
    them in the same order (the order of :func:`wrap_pieces`).
    """

    own: Rect
    need: Rect
    extent: tuple[int, ...]
    sends: tuple[tuple[int, Rect], ...]
    recvs: tuple[tuple[int, Rect], ...]
    fill: float
    wrap: bool = False
    """``need``'s cells outside the image are the image's cells ``mod extent`` (circular
    padding, torch.roll): received or held, never filled."""

    @property
    def local(self) -> Rect | None:
        """The part of ``need`` this rank already holds, where it does not wrap (:meth:`held`
        in general)."""
        return self.own.intersect(self.need)

    def held(self, own: Rect | None = None) -> list[tuple[Rect, Rect]]:
        """(cells of ``need``, the same cells in the image) that the holder of ``own`` (this
        rank's tile; the whole image for a replicated tensor) already has: at most one piece
        without ``wrap``, one per piece of the wrapped window that meets ``own`` with it."""
        own = self.own if own is None else own
        out = []
        for win, img in _pieces(self.need, self.extent, self.wrap):
            part = own.intersect(img)
            if part is not None:
                out.append((_shift(part, img, win), part))
        return out

    def widths(self) -> tuple[tuple[int, int], ...]:
        """Per dim, the cells beyond the own tile (before, after); negative means cells
        dropped."""
        return tuple((o[0] - n[0], n[1] - o[1])
                     for o, n in zip(self.own.dims, self.need.dims, strict=True))

    def halo_widths(self) -> tuple[int, ...]:
        """:meth:`widths` flattened: (top, bottom, left, right) for an image, (front, back,
        top, bottom, left, right) for a volume."""
        return tuple(w for pair in self.widths() for w in pair)

    def recv_elements(self) -> int:
        """Cells received (per sample and channel)."""
        return sum(r.size for _, r in self.recvs)

    def foreign_elements(self) -> int:
        """Cells of ``need`` that other tiles hold (not padding, not this tile's): the least
        any exchange must bring (:meth:`recv_elements` when nothing is received twice)."""
        pieces = _pieces(self.need, self.extent, self.wrap)
        return sum(w.size for w, _ in pieces) - sum(w.size for w, _ in self.held())

    def pieces_by_kind(self) -> dict[str, tuple[int, int]]:
        """The received pieces by how they touch the own tile, (pieces, cells) of each: on a
        volume ``face``, ``edge``, ``corner`` (beyond the tile along one, two, three dims), on
        an image ``side`` and ``corner`` (:func:`piece_kinds`)."""
        out: dict[str, tuple[int, int]] = {}
        names = piece_kinds(self.own.ndim)
        for _, r in self.recvs:
            beyond = sum(1 for a, o in zip(r.dims, self.own.dims, strict=True)
                         if a[1] <= o[0] or a[0] >= o[1])
            kind = names[beyond - 1] if 0 < beyond <= len(names) else "inside"
            n, cells = out.get(kind, (0, 0))
            out[kind] = (n + 1, cells + r.size)
        return out


def piece_kinds(ndim: int) -> tuple[str, ...]:
    """Names of halo pieces beyond a tile along 1, 2, ... dims: a volume's faces, edges and
    corners; an image's sides and corners; a sequence's sides."""
    return ("side", "corner")[:max(ndim, 1)] if ndim <= 2 else ("face", "edge", "corner")


def wrap_pieces(need: Rect, extent: tuple[int, ...]) -> list[Rect]:
    """``need`` cut at every multiple of ``extent`` along each dim, so each piece lies in one
    copy of the image (row-major order: the last dim varies fastest). A window of a circular
    padding by (2, 1) of 5 rows, rows -2:7, is rows -2:0, 0:5 and 5:7: image rows 3:5, 0:5
    and 0:2 (:func:`unwrap`)."""
    cuts = []
    for (a, b), e in zip(need.dims, extent, strict=True):
        cuts.append([(max(a, k * e), min(b, (k + 1) * e))
                     for k in range(a // e, (b - 1) // e + 1)] if b > a else [])
    return [Rect(*dims) for dims in itertools.product(*cuts)]


def unwrap(piece: Rect, extent: tuple[int, ...]) -> Rect:
    """The image cells a piece of :func:`wrap_pieces` stands for (each dim moved by whole
    extents into [0, extent))."""
    return Rect(*((a - a // e * e, b - a // e * e)
                  for (a, b), e in zip(piece.dims, extent, strict=True)))


def _pieces(need: Rect, extent: tuple[int, ...], wrap: bool) -> list[tuple[Rect, Rect]]:
    """(cells of ``need``, the same cells in the image) for every part of ``need`` that reads
    the image: its pieces when it wraps, else the one part inside the image (if any)."""
    if wrap:
        return [(p, unwrap(p, extent)) for p in wrap_pieces(need, extent)]
    inside = need.intersect(Rect.whole(extent))
    return [] if inside is None else [(inside, inside)]


def _shift(part: Rect, img: Rect, win: Rect) -> Rect:
    """``part`` (inside image piece ``img``) where it sits in window piece ``win``."""
    return part.moved(tuple(i[0] - w[0] for i, w in zip(img.dims, win.dims, strict=True)))


def exchange(grid: Grid, extent: tuple[int, ...], needs: list[Rect], t: int,
             fill: float = 0.0, wrap: bool = False) -> Exchange:
    """The exchange for tile ``t`` when tile ``u`` needs ``needs[u]`` of a tiled tensor;
    ``wrap``: the needs wrap around the image (:func:`wrap_pieces`), else cells outside it are
    padding. Messages between two tiles come in the order of the receiver's pieces."""
    own = grid.tile_rect(extent, t)
    mine = _pieces(needs[t], extent, wrap)
    sends, recvs = [], []
    for u in range(grid.size):
        if u == t:
            continue
        for _, img in _pieces(needs[u], extent, wrap):
            part = own.intersect(img)
            if part is not None:
                sends.append((u, part))
        theirs = grid.tile_rect(extent, u)
        for win, img in mine:
            part = theirs.intersect(img)
            if part is not None:
                recvs.append((u, _shift(part, img, win)))
    return Exchange(own, needs[t], tuple(extent), tuple(sends), tuple(recvs), fill, wrap)


def avg_counts(n: int, n_out: int, k: int, s: int, p: int,
               count_include_pad: bool) -> list[int]:
    """Per output position along one dim, the divisor factor PyTorch's avg_pool uses (the 2-D
    divisor is the product of the dims' factors)."""
    out = []
    for o in range(n_out):
        start = o * s - p
        end = min(start + k, n + p)
        padded = end - start
        start, end = max(start, 0), min(end, n)
        out.append(padded if count_include_pad else end - start)
    return out
