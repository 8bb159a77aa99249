"""Windows that wrap around the image (fxpar issue 40): circular padding and torch.roll over the
spatial dims, the window kind ``wrap`` (fxpar.frontend.rules.opkind).

The geometry (fxpar.core.geometry.exchange with ``wrap``) is checked by assembling every
tile's window from its own cells and the messages alone -- each receive matched, in order, with
the send its peer lists for it -- and comparing with the whole image's roll or padding; the
backward sends each received piece's gradient to its owner, who adds it, and must give
autograd's gradient. Then the real ``fxpar::halo`` op on threads (no MPI), the rules that
capture the ops, and the analyses that must handle or refuse the kind."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F
from helpers.threads import ThreadComm, run_threads
from torch import nn

import fxpar
from fxpar.compiler.receptive import ReachError, reach
from fxpar.core import meta
from fxpar.core.geometry import Exchange, Grid, Rect, exchange, unwrap, wrap_pieces
from fxpar.core.meta import TensorInfo
from fxpar.core.values import dumps
from fxpar.frontend.rules.opclass import Pointwise, Window, classify, why_not
from fxpar.frontend.rules.wrap import roll_window
from fxpar.frontend.trace import trace
from fxpar.passes.halo_fusion import FUSION_KEY
from fxpar.perf.costmodel import halo_messages
from fxpar.runtime.spatial.group import bound


def _needs(grid: Grid, out: tuple[int, ...], before: tuple[int, ...]) -> list[Rect]:
    """Per tile, the input window of a wrap op (output o reads input o - before)."""
    return [Rect(*((a - b, c - b) for (a, c), b in zip(grid.tile_rect(out, u).dims, before,
                                                         strict=True)))
            for u in range(grid.size)]


def _reference(x: torch.Tensor, out: tuple[int, ...], before: tuple[int, ...]) -> torch.Tensor:
    """Output cell o of the whole image is input cell (o - before) mod extent, per dim."""
    for i, (o, b) in enumerate(zip(out, before, strict=True)):
        e = x.shape[2 + i]
        x = x.index_select(2 + i, (torch.arange(o) - b) % e)
    return x


def _cut(x: torch.Tensor, r: Rect) -> torch.Tensor:
    return x[(slice(None), slice(None), *(slice(a, b) for a, b in r.dims))]


def _matched(exs: list[Exchange]) -> dict[tuple[int, int], list[tuple[Rect, Rect]]]:
    """(sender, receiver) -> the pairs (cells of the sender's tile, cells of the receiver's
    window) of their messages, matched in the order both list them; asserts every send has
    its receive, of the same shape."""
    out = {}
    for t, u in itertools.permutations(range(len(exs)), 2):
        sent = [r for v, r in exs[t].sends if v == u]
        got = [r for v, r in exs[u].recvs if v == t]
        assert [r.shape for r in sent] == [r.shape for r in got], (t, u, sent, got)
        if sent:
            out[(t, u)] = list(zip(sent, got, strict=True))
    return out


def _simulate(grid: Grid, extent: tuple[int, ...], out: tuple[int, ...],
              before: tuple[int, ...]) -> None:
    """Every tile's window, and the gradient of the tiles, from the messages alone."""
    exs = [exchange(grid, extent, _needs(grid, out, before), t, wrap=True)
           for t in range(grid.size)]
    pairs = _matched(exs)
    x = torch.randn(1, 2, *extent, dtype=torch.float64, requires_grad=True)
    want = _reference(x, out, before)
    g = torch.randn_like(want)
    (want * g).sum().backward()
    grads = [torch.zeros(1, 2, *ex.own.shape, dtype=torch.float64) for ex in exs]
    for t, ex in enumerate(exs):
        assert ex.need.shape == grid.tile_rect(out, t).shape
        win = torch.full((1, 2, *ex.need.shape), float("nan"), dtype=torch.float64)
        g_win = _cut(g, grid.tile_rect(out, t))
        for w, img in ex.held():
            _cut(win, w.moved(tuple(a for a, _ in ex.need.dims))).copy_(_cut(x.detach(), img))
            _cut(grads[t], img.moved(tuple(a for a, _ in ex.own.dims))).add_(
                _cut(g_win, w.moved(tuple(a for a, _ in ex.need.dims))))
        for (u, v), msgs in pairs.items():
            if v != t:
                continue
            for src, dst in msgs:  # forward: u's cells into t's window; backward: back to u
                _cut(win, dst.moved(tuple(a for a, _ in ex.need.dims))).copy_(
                    _cut(x.detach(), src))
                _cut(grads[u], src.moved(tuple(a for a, _ in exs[u].own.dims))).add_(
                    _cut(g_win, dst.moved(tuple(a for a, _ in ex.need.dims))))
        assert torch.equal(win, _cut(want.detach(), grid.tile_rect(out, t))), t
    for t, ex in enumerate(exs):
        assert torch.allclose(grads[t], _cut(x.grad, ex.own), rtol=0, atol=1e-12), t


ROLLS = [  # (grid, extent, shift per dim): a roll keeps the extent
    (Grid(2, 1), (8, 5), (3, 0)),
    (Grid(3, 1), (7, 4), (-2, 0)),       # uneven tiles (2, 2, 3), negative shift
    (Grid(4, 1), (9, 3), (5, 0)),        # a shift larger than a tile (2 or 3 rows)
    (Grid(1, 3), (4, 10), (0, -7)),      # larger than the tile, negative, along W
    (Grid(2, 2), (6, 7), (-1, 4)),       # square: corners wrap too
    (Grid(3, 1), (7, 4), (0, 0)),        # shift 0: no message
    (Grid(3, 1), (7, 4), (7, 0)),        # shift = extent: no message
    (Grid(2, 1), (5, 4), (-13, 2)),      # several turns round
    (Grid(2, 1, 2), (4, 3, 5), (1, -1, 2)),  # a volume
]


@pytest.mark.parametrize("grid, extent, shift", ROLLS, ids=[str(r) for r in ROLLS])
def test_roll_messages_assemble_every_tile_and_send_gradients_back(grid, extent, shift):
    _simulate(grid, extent, extent, shift)
    x = torch.randn(1, 1, *extent)
    assert torch.equal(_reference(x, extent, shift),
                       torch.roll(x, shift, tuple(range(2, 2 + len(extent)))))


PADS = [  # (grid, extent, (before, after) per dim): circular padding
    (Grid(2, 1), (6, 4), ((2, 1), (0, 0))),
    (Grid(1, 3), (5, 7), ((0, 0), (3, 3))),
    (Grid(4, 1), (5, 3), ((5, 5), (1, 0))),   # as much as the image: tiles wider than it
    (Grid(2, 2), (5, 6), ((1, 2), (2, 1))),
    (Grid(3, 1), (6, 4), ((0, 2), (0, 0))),   # one side only
    (Grid(2, 1, 2), (4, 3, 5), ((1, 1), (1, 0), (2, 2))),
]


@pytest.mark.parametrize("grid, extent, pads", PADS, ids=[str(p) for p in PADS])
def test_circular_padding_messages_assemble_every_tile(grid, extent, pads):
    out = tuple(e + a + b for e, (a, b) in zip(extent, pads, strict=True))
    before = tuple(a for a, _ in pads)
    _simulate(grid, extent, out, before)
    x = torch.randn(1, 1, *extent)
    flat = [v for a, b in reversed(pads) for v in (a, b)]
    assert torch.equal(_reference(x, out, before), F.pad(x, flat, mode="circular"))


def test_wrapped_messages_of_a_sample_roll():
    """torch.roll by -3 rows of 8 rows on 2 tiles (rows 0:4, 4:8): tile 0 computes output rows
    0:4, which read input rows 3:7: row 3 its own, rows 4:7 from tile 1; tile 1's rows 4:8 read
    7:11 = rows 7 (its own) and 0:3 (from tile 0, across the border)."""
    grid, extent = Grid(2, 1), (8, 4)
    needs = _needs(grid, extent, (-3, 0))
    a, b = (exchange(grid, extent, needs, t, wrap=True) for t in range(2))
    assert a.need == Rect((3, 7), (0, 4)) and b.need == Rect((7, 11), (0, 4))
    assert a.recvs == ((1, Rect((4, 7), (0, 4))),) and a.sends == ((1, Rect((0, 3), (0, 4))),)
    assert b.recvs == ((0, Rect((8, 11), (0, 4))),) and b.sends == ((0, Rect((4, 7), (0, 4))),)
    assert b.held() == [(Rect((7, 8), (0, 4)), Rect((7, 8), (0, 4)))]
    assert a.foreign_elements() == a.recv_elements() == 12


def test_a_window_wider_than_the_image_gets_the_same_rows_twice():
    """Circular padding by (2, 4) of 4 rows on 2 tiles: each output tile is 5 rows, more than
    the image. Tile 0 (output rows 0:5) reads rows -2:3 = image rows 2, 3, 0, 1, 2: tile 1
    sends it row 2 twice, in the order of tile 0's pieces; tile 1 (output rows 5:10) reads
    rows 3:8 = 3, 0, 1, 2, 3: its own row 3 twice."""
    grid, extent = Grid(2, 1), (4, 3)
    assert wrap_pieces(Rect((-2, 3), (0, 3)), extent) == [Rect((-2, 0), (0, 3)),
                                                         Rect((0, 3), (0, 3))]
    assert unwrap(Rect((-2, 0), (0, 3)), extent) == Rect((2, 4), (0, 3))
    needs = _needs(grid, (10, 3), (2, 0))
    a, b = (exchange(grid, extent, needs, t, wrap=True) for t in range(2))
    assert a.recvs == ((1, Rect((-2, 0), (0, 3))), (1, Rect((2, 3), (0, 3))))
    assert b.sends == ((0, Rect((2, 4), (0, 3))), (0, Rect((2, 3), (0, 3))))
    assert b.held() == [(Rect((3, 4), (0, 3)), Rect((3, 4), (0, 3))),
                        (Rect((6, 8), (0, 3)), Rect((2, 4), (0, 3)))]


def test_a_wrong_shift_is_caught():
    """The check this file's tests rely on fails for a roll off by one row."""
    grid, extent = Grid(3, 1), (7, 4)
    exs = [exchange(grid, extent, _needs(grid, extent, (-2, 0)), t, wrap=True)
           for t in range(3)]
    x = torch.randn(1, 1, *extent, dtype=torch.float64)
    right, wrong = (_reference(x, extent, (s, 0)) for s in (-2, -1))
    for t, ex in enumerate(exs):
        win = torch.empty(1, 1, *ex.need.shape, dtype=torch.float64)
        origin = tuple(a for a, _ in ex.need.dims)
        for w, img in ex.held():
            _cut(win, w.moved(origin)).copy_(_cut(x, img))
        for _, r in ex.recvs:
            _cut(win, r.moved(origin)).copy_(_cut(x, unwrap(r, extent)))
        mine = grid.tile_rect(extent, t)
        assert torch.equal(win, _cut(right, mine))
        assert not torch.equal(win, _cut(wrong, mine))


# -- the real op, on threads ------------------------------------------------------------------
KEY = "c0s0"


@pytest.mark.parametrize("grid, extent, out, before", [
    (Grid(1, 3), (5, 7), (5, 7), (0, -4)),          # roll along W, uneven tiles
    (Grid(2, 2), (5, 6), (8, 9), (1, 2)),           # circular padding, square
    (Grid(2, 1), (4, 3), (10, 3), (2, 0)),          # the same rows twice
])
def test_halo_op_wraps_forward_and_backward(grid, extent, out, before):
    """``fxpar::halo`` with a wrapping exchange: each tile's window is the whole image's roll
    or padding, and the gradient that comes back to each tile is autograd's."""
    x = torch.randn(2, 3, *extent, dtype=torch.float64, requires_grad=True)
    want = _reference(x, out, before)
    g = torch.randn_like(want)
    (want * g).sum().backward()
    needs = _needs(grid, out, before)

    def rank(comm: ThreadComm) -> None:
        with bound({KEY: comm}):  # type: ignore[dict-item]
            ex = exchange(grid, extent, needs, comm.rank, wrap=True)
            spec = dumps({"exchange": ex, "replicated": False, "tag": 10})
            tile = _cut(x.detach(), ex.own).clone().requires_grad_()
            win = torch.ops.fxpar.halo(tile, KEY, spec)
            mine = grid.tile_rect(out, comm.rank)
            assert torch.equal(win, _cut(want.detach(), mine))
            (win * _cut(g, mine)).sum().backward()
            assert torch.allclose(tile.grad, _cut(x.grad, ex.own), rtol=0, atol=1e-12)
            # the replicated input (the model's image on every rank): sliced, gradient partial
            whole = x.detach().clone().requires_grad_()
            spec = dumps({"exchange": ex, "replicated": True, "tag": 10})
            win = torch.ops.fxpar.halo(whole, KEY, spec)
            assert torch.equal(win, _cut(want.detach(), mine))
            (win * _cut(g, mine)).sum().backward()
            return whole.grad

    partial = run_threads(grid.size, rank)[0]
    assert torch.allclose(sum(partial), x.grad, rtol=0, atol=1e-12)


# -- capture rules and the analyses -----------------------------------------------------------
class Rolls(nn.Module):
    def forward(self, x):
        x = F.pad(x, (1, 2, 3, 0), mode="circular")
        x = torch.roll(x, shifts=(-2, 9), dims=(2, 3))
        x = torch.roll(x, 1, 1)               # channels only: per pixel
        x = torch.roll(x, (1, 1), (1, -1))    # channels and W
        return torch.roll(x, 1)               # no dims: the flattened tensor


def test_rules_capture_circular_padding_and_rolls():
    gm = trace(Rolls(), (1, 3, 8, 8))
    ops = [n for n in gm.graph.nodes if n.op == "call_function"]
    got = [classify(gm, n) for n in ops]
    assert [o.kind if isinstance(o, Window) else o for o in got] == \
        ["wrap", "wrap", Pointwise(), "wrap", None]
    pad, roll, _, both, _ = got
    assert (pad.p, pad.attr("pad")) == ((3, 1), (1, 2, 3, 0))
    assert roll.p == (-2, -2)  # 9 columns of 11 is -2: the shorter way round
    assert roll.needs((0, 4), 0) == (2, 6)
    assert (both.p, both.attr("roll")) == ((0, 1), ((1, 1),))
    assert "without dims rolls the flattened tensor" in why_not(gm, ops[-1])
    # the rule takes where the spatial dims are: Swin's roll of a channels-last N, H, W, C
    swin = roll_window((1, 8, 10, 3), (-3, -3), (1, 2), (1, 2))
    assert isinstance(swin, Window) and (swin.kind, swin.p, swin.attr("roll")) == \
        ("wrap", (-3, -3), ())
    assert roll_window((1, 8, 10, 3), 1, 3, (1, 2)) == Pointwise()


class SwinLike(nn.Module):
    """conv -> roll(-s) -> conv -> roll(+s), then a circular-padded conv."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Conv2d(3, 4, 3, padding=1)
        self.b = nn.Conv2d(4, 4, 3, padding=1)
        self.c = nn.Conv2d(4, 2, 3, padding=1, padding_mode="circular")

    def forward(self, x):
        y = torch.roll(self.a(x), (-3, -3), (2, 3))
        return self.c(torch.roll(self.b(y), (3, 3), (2, 3)))


def test_the_region_goes_through_rolls_and_the_tiles_wrap():
    gm = trace(SwinLike(), (1, 3, 12, 10))
    program = fxpar.compile(SwinLike(), fxpar.Plan(spatial_parts=4, halo_fusion="all"),
                            torch.empty(1, 3, 12, 10, device="meta"))
    assert program.spatial is not None
    tile = program.spatial.tile(0, 3)
    halos = [m for m in tile.modules() if type(m).__name__ == "Halo"]
    assert len(halos) == 3 and all(h.exchange.wrap for h in halos)
    assert "wrapping around the image" in str(tile)
    # the last tile's first roll reads from tile 0, across both borders
    ex = halos[0].exchange
    assert 0 in [u for u, _ in ex.recvs]
    # halo_fusion="all" fuses no conv -> roll -> conv chain (a wrapping op is not a HaloOp)
    assert tile.meta[FUSION_KEY] == ()
    # the cost model counts the exchange's own messages
    traced = program.traced
    roll = next(n for n in traced.graph.nodes if n.target is torch.ops.aten.roll.default)
    cell = meta.get(roll.args[0], TensorInfo).cell_bytes
    assert halo_messages(traced, roll, Grid(2, 2), 3) == (
        len(ex.sends) + len(ex.recvs), max(r.size for _, r in (*ex.sends, *ex.recvs)) * cell,
        ex.recv_elements() * cell)
    with pytest.raises(ReachError, match="wrapped around from the opposite border"):
        reach(gm)


class PadFirst(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 2, 3)

    def forward(self, x):
        return self.conv(F.pad(x, (1, 1, 3, 0), mode="circular"))


def test_a_wrapping_op_on_the_input_reads_the_opposite_border_of_it():
    """What each rank reads of the model input (``Program.input_windows``, for loaders that
    give a rank only its part): tile 0 of 2 row tiles reads the last 3 rows too."""
    program = fxpar.compile(PadFirst(), fxpar.Plan(spatial_parts=2, slice="horizontal"),
                            torch.empty(1, 3, 8, 6, device="meta"))
    # padded rows 0:5 read rows -3:2 = 5:8 and 0:2; padded rows 5:11 read rows 2:8
    assert program.input_windows == (Rect((0, 8), (0, 6)), Rect((2, 8), (0, 6)))
