"""fxpar's custom ops (fxpar.runtime.spatial.library) on two tiles run by two threads
(tests/helpers/threads.py, no MPI): each op's fake kernel gives the shapes, dtypes and strides
its real kernel gives (``torch.library.opcheck``'s fake-tensor check, which also runs the
real kernel), and what the tiles compute is the whole image's (float64, exact where the
arithmetic is the same). Under torch.utils.flop_counter.FlopCounterMode (Lightning's
``measure_flops``, MFU counters) each op counts what torch counts for the plain op on the same
shapes (issue 59: ``halo_conv_grad``'s formula raised)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from helpers.threads import ThreadComm, run_threads
from torch.utils.flop_counter import (
    FlopCounterMode,
    flop_registry,
    sdpa_backward_flop_count,
    sdpa_flop_count,
)

from fxpar.core.geometry import Grid, Rect, exchange, out_extent, window_rows
from fxpar.core.values import dumps
from fxpar.runtime.spatial import haloconv
from fxpar.runtime.spatial.group import bound

KEY = "c0s0"
GRID = Grid(1, 2)
EXTENT = (8, 10)


def _cut(x: torch.Tensor, r: Rect) -> torch.Tensor:
    return x[:, :, r.h[0]:r.h[1], r.w[0]:r.w[1]]


def _conv_exchange(t: int, k: int = 3, s: int = 1, p: int = 1):
    h, w = EXTENT
    ho, wo = out_extent(h, k, s, p, 1), out_extent(w, k, s, p, 1)
    needs = [Rect(window_rows(o.h, k, s, p, 1), window_rows(o.w, k, s, p, 1))
             for o in (GRID.tile_rect((ho, wo), u) for u in range(GRID.size))]
    return exchange(GRID, EXTENT, needs, t), GRID.tile_rect((ho, wo), t)


def _on_tiles(fn: Callable[[ThreadComm], Any]) -> list[Any]:
    def rank(comm: ThreadComm) -> Any:
        with bound({KEY: comm}):  # type: ignore[dict-item]
            return fn(comm)
    return run_threads(GRID.size, rank)[0]


def _opcheck(op: Any, args: tuple[Any, ...]) -> None:
    torch.library.opcheck(op, args, test_utils=("test_faketensor",))


X = torch.randn(2, 3, *EXTENT, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
W = torch.randn(4, 3, 3, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
B = torch.randn(4, dtype=torch.float64, generator=torch.Generator().manual_seed(2))


@pytest.mark.parametrize("split", [False, True], ids=["window", "split"])
def test_halo_op_convolution(split, monkeypatch):
    """A 3x3 convolution on each tile's window (assembled, or split into the tile's part and
    halo bands) is the whole image's convolution on that tile; its fake kernel agrees."""
    if split:
        monkeypatch.setattr(haloconv, "MIN_RATIO", 0)
    want = F.conv2d(X, W, B, 1, 1)

    def rank(comm: ThreadComm) -> None:
        ex, mine = _conv_exchange(comm.rank)
        spec = dumps({"exchange": ex, "kind": "conv", "replicated": False, "tag": 10,
                      "cfg": {"stride": (1, 1), "dilation": (1, 1), "groups": 1}})
        tile = _cut(X, ex.own).contiguous()
        out, flat, _ = torch.ops.fxpar.halo_op(tile, W, B, KEY, spec)
        assert torch.allclose(out, _cut(want, mine), rtol=0, atol=1e-12)
        assert flat.numel() == sum(2 * 3 * r.shape[0] * r.shape[1] for _, r in ex.recvs)
        _opcheck(torch.ops.fxpar.halo_op.default, (tile, W, B, KEY, spec))

    _on_tiles(rank)


def test_halo_and_max_pool():
    """A plain halo exchange gives each tile its window of the image (zero outside); a 3x3
    stride-2 max pool on a window is the whole image's pool on that tile."""
    want = F.max_pool2d(X, 3, 2, 1)

    def rank(comm: ThreadComm) -> None:
        ex, _ = _conv_exchange(comm.rank)
        tile = _cut(X, ex.own).contiguous()
        spec = dumps({"exchange": ex, "replicated": False, "tag": 10})
        window = torch.ops.fxpar.halo(tile, KEY, spec)
        padded = F.pad(X, (1, 1, 1, 1))
        n = ex.need
        assert torch.equal(window, padded[:, :, n.h[0] + 1:n.h[1] + 1, n.w[0] + 1:n.w[1] + 1])
        _opcheck(torch.ops.fxpar.halo.default, (tile, KEY, spec))
        pex, mine = _conv_exchange(comm.rank, 3, 2, 1)
        pex = type(pex)(pex.own, pex.need, pex.extent, pex.sends, pex.recvs, float("-inf"))
        spec = dumps({"exchange": pex, "kind": "maxpool", "replicated": False, "tag": 20,
                      "cfg": {"kernel": (3, 3), "stride": (2, 2), "dilation": (1, 1)}})
        out, _, idx = torch.ops.fxpar.halo_op(tile, None, None, KEY, spec)
        assert torch.equal(out, _cut(want, mine)) and idx.dtype == torch.int64
        _opcheck(torch.ops.fxpar.halo_op.default, (tile, None, None, KEY, spec))

    _on_tiles(rank)


def test_join_and_the_collectives():
    """join puts the tiles together; allreduce sums, allgather stacks in rank order,
    group_extreme finds the whole image's maximum and counts its cells; the fake kernels of
    all four agree with the real ones."""
    def rank(comm: ThreadComm) -> None:
        own = GRID.tile_rect(EXTENT, comm.rank)
        tile = _cut(X, own).contiguous()
        rects = tuple(GRID.tile_rect(EXTENT, u) for u in range(GRID.size))
        spec = dumps({"rects": rects, "tile": comm.rank, "tag": 30})
        assert torch.equal(torch.ops.fxpar.join(tile, KEY, spec), X)
        _opcheck(torch.ops.fxpar.join.default, (tile, KEY, spec))
        part = tile.sum((2, 3))
        total = torch.ops.fxpar.allreduce(part, KEY, "sum")
        parts = [_cut(X, r).contiguous().sum((2, 3)) for r in rects]
        assert torch.equal(total, parts[0] + parts[1])
        _opcheck(torch.ops.fxpar.allreduce.default, (part, KEY, "sum"))
        assert torch.equal(torch.ops.fxpar.allgather(part, KEY), torch.stack(parts))
        _opcheck(torch.ops.fxpar.allgather.default, (part, KEY))
        m, at, count = torch.ops.fxpar.group_extreme(tile, KEY, [2, 3], "max")
        assert torch.equal(m, X.amax((2, 3), keepdim=True))
        assert torch.equal(count, (X == m).sum((2, 3), keepdim=True).double())
        _opcheck(torch.ops.fxpar.group_extreme.default, (tile, KEY, [2, 3], "max"))

    _on_tiles(rank)


def test_sync_batch_norm():
    """BatchNorm with the statistics of both tiles is the whole image's, and so are its
    gradients (input, weight, bias: the parameter gradients summed over the tiles)."""
    w, b = torch.rand(3, dtype=torch.float64) + 0.5, torch.randn(3, dtype=torch.float64)
    g = torch.randn_like(X)
    xr, wr, br = (t.clone().requires_grad_() for t in (X, w, b))
    want = F.batch_norm(xr, None, None, wr, br, True, 0.0, 1e-5)
    (want * g).sum().backward()

    def rank(comm: ThreadComm) -> dict[str, torch.Tensor]:
        own = GRID.tile_rect(EXTENT, comm.rank)
        tile = _cut(X, own).contiguous().requires_grad_()
        wt, bt = w.clone().requires_grad_(), b.clone().requires_grad_()
        count = X.numel() // 3
        y, mean, var = torch.ops.fxpar.sync_batch_norm(tile, wt, bt, KEY, count, 1e-5, [])
        torch.testing.assert_close(y, _cut(want, own).detach(), rtol=0, atol=1e-12)
        assert not mean.requires_grad and not var.requires_grad
        (y * _cut(g, own)).sum().backward()
        torch.testing.assert_close(tile.grad, _cut(xr.grad, own), rtol=0, atol=1e-12)
        _opcheck(torch.ops.fxpar.sync_batch_norm.default,
                 (tile.detach(), w, b, KEY, count, 1e-5, []))
        return {"gw": wt.grad, "gb": bt.grad}

    parts = _on_tiles(rank)
    torch.testing.assert_close(parts[0]["gw"] + parts[1]["gw"], wr.grad, rtol=0, atol=1e-12)
    torch.testing.assert_close(parts[0]["gb"] + parts[1]["gb"], br.grad, rtol=0, atol=1e-12)


# -- FLOPs, as torch.utils.flop_counter counts them ---------------------------------------------
def _counted(fn: Callable[[], Any]) -> dict[Any, int]:
    """FLOPs per op (OpOverloadPacket) that FlopCounterMode counts while ``fn`` runs."""
    with FlopCounterMode(display=False) as counter:
        fn()
    return dict(counter.get_flop_counts()["Global"])


def _split_conv_flops(comm: ThreadComm) -> dict[str, dict[Any, int]]:
    """FLOPs of forward + backward of this tile's split 3x3 convolution, and of torch's
    convolution (padding 0) on the same haloed window, each under its own FlopCounterMode."""
    ex, _ = _conv_exchange(comm.rank)
    spec = dumps({"exchange": ex, "kind": "conv", "replicated": False, "tag": 10,
                  "cfg": {"stride": (1, 1), "dilation": (1, 1), "groups": 1}})
    tile = _cut(X, ex.own).contiguous().requires_grad_()
    w, b = W.clone().requires_grad_(), B.clone().requires_grad_()
    g = torch.ones((2, 4, *ex.own.shape), dtype=torch.float64)  # 'same': tile-sized outputs
    n = ex.need  # the window in the zero-padded image's coordinates (padding 1 on each side)
    window = F.pad(X, (1, 1, 1, 1))[:, :, n.h[0] + 1:n.h[1] + 1, n.w[0] + 1:n.w[1] + 1]
    window = window.contiguous().requires_grad_()
    wr, br = W.clone().requires_grad_(), B.clone().requires_grad_()
    counts = {
        "split": _counted(lambda: torch.ops.fxpar.halo_op(tile, w, b, KEY, spec)[0].backward(g)),
        "plain": _counted(lambda: F.conv2d(window, wr, br).backward(g))}
    assert tile.grad is not None and w.grad is not None and b.grad is not None
    return counts


@pytest.fixture
def split_flops(monkeypatch) -> list[dict[str, dict[Any, int]]]:
    monkeypatch.setattr(haloconv, "MIN_RATIO", 0)  # split tiles this small
    return _on_tiles(_split_conv_flops)


def test_split_convolution_counts_torchs_flops_on_its_window(split_flops):
    """halo_op counts torch's convolution on the haloed window, halo_conv_grad its
    convolution_backward (input and weight gradients) on the same shapes, on every tile."""
    aten, ops = torch.ops.aten, torch.ops.fxpar
    for counts in split_flops:
        split, plain = counts["split"], counts["plain"]
        assert set(split) == {ops.halo_op, ops.halo_conv_grad}, split
        assert set(plain) == {aten.convolution, aten.convolution_backward}, plain
        assert split[ops.halo_op] == plain[aten.convolution] > 0
        assert split[ops.halo_conv_grad] == plain[aten.convolution_backward] > 0


def test_tiles_of_a_split_convolution_count_the_whole_convolution(split_flops):
    """Summed over the tiles: the whole image's forward and backward FLOPs (torch counts a
    convolution by its outputs, which the tiles partition: the halo cells add none)."""
    aten, ops = torch.ops.aten, torch.ops.fxpar
    x, w, b = (t.clone().requires_grad_() for t in (X, W, B))
    g = torch.ones(2, 4, *EXTENT, dtype=torch.float64)
    whole = _counted(lambda: F.conv2d(x, w, b, 1, 1).backward(g))
    tiles = {op: sum(c["split"][op] for c in split_flops)
             for op in (ops.halo_op, ops.halo_conv_grad)}
    assert tiles[ops.halo_op] == whole[aten.convolution] == 2 * 2 * 4 * 3 * 9 * 8 * 10
    assert tiles[ops.halo_conv_grad] == whole[aten.convolution_backward] \
        == 2 * whole[aten.convolution]


def test_attention_formulas_count_torchs_attention_flops():
    """The attention ops' formulas, called as FlopCounterMode calls them (tensors, the outputs
    as ``out_val``): ring attention counts scaled_dot_product_attention and its backward over
    every rank's keys, gather attention over this rank's own."""
    ops, lengths = torch.ops.fxpar, [5, 7]
    q, k, v = (torch.empty(2, 3, n, 8) for n in (6, 5, 5))
    out, lse = torch.empty(2, 3, 6, 8), torch.empty(2, 3, 6)
    fwd = flop_registry[ops.ring_attention](q, k, v, KEY, lengths, 0.5, 40, out_val=(out, lse))
    bwd = flop_registry[ops.ring_attention_grad](out, q, k, v, out, lse, KEY, lengths, 0.5, 40,
                                                 out_val=(q, k, v, q))
    shapes = ((2, 3, 6, 8), (2, 3, 12, 8), (2, 3, 12, 8))  # torch's, on the whole K and V
    assert fwd == sdpa_flop_count(*shapes) == 2 * (2 * 3 * 6 * 12 * 8 * 2)
    assert bwd == sdpa_backward_flop_count((2, 3, 6, 8), *shapes) == 5 * fwd // 2
    mine = flop_registry[ops.gather_attention](q, k, v, KEY, 0.5, out_val=(out, lse))
    assert mine == sdpa_flop_count((2, 3, 6, 8), (2, 3, 5, 8), (2, 3, 5, 8)) == 5 * fwd // 12


def test_an_unbound_group_is_a_clear_error():
    with pytest.raises(RuntimeError, match="tile group 'c0s0' has no communicator"):
        torch.ops.fxpar.allreduce(torch.ones(2), KEY, "sum")
