"""runtime.spatial.haloconv: a tile's convolution split into its own part and halo bands gives
exactly the outputs, input gradients (tile and halo cells) and parameter gradients that the
convolution of the whole image gives on that tile, for every tile of many grids and
geometries (no MPI: the halo pieces are cut from the whole image)."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from fxpar.core.geometry import Grid, Rect, exchange, out_extent, window_rows
from fxpar.runtime.spatial import haloconv

GEOMETRIES = [(k, s, p, d) for k, s, p, d in itertools.product([1, 3, 5], [1, 2, 3], [0, 1, 2],
                                                                [1, 2])
              if p <= (d * (k - 1)) // 2 + 1]


def _cut(x: torch.Tensor, r: Rect) -> torch.Tensor:
    return x[:, :, r.h[0]:r.h[1], r.w[0]:r.w[1]]


@pytest.mark.parametrize("ext,grid_shape", [((13, 17), (1, 2)), ((13, 17), (2, 1)),
                                            ((13, 17), (3, 2)), ((12, 16), (2, 2)),
                                            ((12, 16), (1, 4))])
def test_split_convolution_matches_the_whole_image(ext, grid_shape):
    for k, s, p, d in GEOMETRIES:
        _check(ext, Grid(*grid_shape), k, s, p, d)


def _check(ext: tuple[int, int], grid: Grid, k: int, s: int, p: int, d: int) -> None:
    h, w = ext
    ho, wo = out_extent(h, k, s, p, d), out_extent(w, k, s, p, d)
    if ho < grid.parts[0] or wo < grid.parts[1]:
        return  # more tiles than output rows or columns
    gen = torch.Generator().manual_seed(k * 1000 + s * 100 + p * 10 + d)
    x = torch.randn(1, 2, h, w, dtype=torch.float64, generator=gen)
    weight = torch.randn(3, 2, k, k, dtype=torch.float64, generator=gen, requires_grad=True)
    bias = torch.randn(3, dtype=torch.float64, generator=gen, requires_grad=True)
    cfg = {"stride": (s, s), "dilation": (d, d), "groups": 1}
    needs = [Rect(window_rows(o.h, k, s, p, d), window_rows(o.w, k, s, p, d))
             for o in (grid.tile_rect((ho, wo), t) for t in range(grid.size))]
    splits = 0
    for t in range(grid.size):
        ex = exchange(grid, (h, w), needs, t)
        split = haloconv.plan(ex, (k, k), (s, s), (d, d), min_ratio=0)
        if split is None:
            continue  # this geometry keeps the window path (tested by the MPI suites)
        splits += 1
        tile = _cut(x, ex.own).contiguous()
        pieces = [(r, _cut(x, r).contiguous()) for _, r in ex.recvs]
        out = haloconv.tile_part(tile, split, cfg, (weight.detach(), bias.detach()))
        out = haloconv.add_bands(out, tile, ex, split, pieces, cfg, weight.detach())
        mine = grid.tile_rect((ho, wo), t)
        xr = x.clone().requires_grad_()
        ref = _cut(F.conv2d(xr, weight, bias, s, p, d), mine)
        torch.testing.assert_close(out, ref.detach(), rtol=0, atol=1e-12)

        g = torch.randn(ref.shape, dtype=torch.float64, generator=gen)
        gw_ref, gb_ref, gx_ref = torch.autograd.grad(ref, (weight, bias, xr), g)
        halo, gw_bands = haloconv.band_grads(g, tile, ex, split, pieces, cfg, weight.detach(),
                                             True, True)
        gx, gw, gb = haloconv.tile_grads(g, tile, split, cfg, (weight.detach(), bias.detach()),
                                         (True, True, True))
        if gw_bands is not None:
            gw = gw + gw_bands
        torch.testing.assert_close(gw, gw_ref, rtol=0, atol=1e-10)
        torch.testing.assert_close(gb, gb_ref, rtol=0, atol=1e-10)
        torch.testing.assert_close(gx, _cut(gx_ref, ex.own), rtol=0, atol=1e-10)
        assert halo is not None and len(halo) == len(pieces)
        for (_, r), gh in zip(ex.recvs, halo, strict=True):
            torch.testing.assert_close(gh, _cut(gx_ref, r), rtol=0, atol=1e-10)
    if grid.size > 1 and (k, s, p, d) == (3, 1, 1, 1):
        assert splits == grid.size  # the common 3x3 'same' convolution always splits


def test_resnet_style_geometries_split():
    """3x3 stride 1 and stride 2 (padding 1) and 1x1 convolutions split on every tile of a
    4x4 grid of an even extent; a negative halo (rows dropped) does not."""
    grid = Grid(4, 4)
    for k, s, p in [(3, 1, 1), (3, 2, 1), (1, 1, 0), (1, 2, 0)]:
        o = out_extent(64, k, s, p, 1)
        needs = [Rect(window_rows(r.h, k, s, p, 1), window_rows(r.w, k, s, p, 1))
                 for r in (grid.tile_rect((o, o), t) for t in range(16))]
        for t in range(16):
            assert haloconv.plan(exchange(grid, (64, 64), needs, t), (k, k), (s, s),
                                 (1, 1), min_ratio=0) is not None, (k, s, p, t)
    own = Rect((0, 8), (0, 8))
    dropped = exchange(Grid(1, 1), (8, 8), [Rect((1, 8), (0, 8))], 0)
    assert dropped.own == own
    assert haloconv.plan(dropped, (1, 1), (1, 1), (1, 1), min_ratio=0) is None


def test_thin_tiles_keep_the_window_path():
    """The cost rule: a band may be at most 1/MIN_RATIO of the tile's outputs across."""
    grid = Grid(1, 2)

    def split(width: int) -> haloconv.Split | None:
        needs = [Rect(window_rows(r.h, 3, 1, 1, 1), window_rows(r.w, 3, 1, 1, 1))
                 for r in (grid.tile_rect((8, width), t) for t in range(2))]
        return haloconv.plan(exchange(grid, (8, width), needs, 0), (3, 3), (1, 1), (1, 1))

    ratio = haloconv.MIN_RATIO
    assert split(2 * ratio - 2) is None  # tiles of ratio - 1 columns, a band of 1
    wide = split(2 * ratio)
    assert wide is not None and [b.out.shape for b in wide.bands] == [(8, 1)]


def test_window_assembly_pads_exactly_outside_the_image():
    """fxpar.runtime.spatial.exchange.rebuild (the window path) writes the tile and the
    pieces, and the pad value only outside the image, for tiles and for a replicated tensor."""
    from fxpar.runtime.spatial.exchange import rebuild as _rebuild

    gen = torch.Generator().manual_seed(0)
    for (h, w), grid_shape, k, s, p in itertools.product(
            [(13, 17), (8, 8)], [(1, 2), (2, 2), (3, 1)], [1, 3, 5], [1, 2], [0, 1, 2]):
        ho, wo = out_extent(h, k, s, p, 1), out_extent(w, k, s, p, 1)
        grid = Grid(*grid_shape)
        if ho < grid.parts[0] or wo < grid.parts[1]:
            continue
        x = torch.randn(1, 2, h, w, generator=gen)
        needs = [Rect(window_rows(o.h, k, s, p, 1), window_rows(o.w, k, s, p, 1))
                 for o in (grid.tile_rect((ho, wo), t) for t in range(grid.size))]
        for t, fill in itertools.product(range(grid.size), (0.0, float("-inf"))):
            ex = exchange(grid, (h, w), needs, t, fill)
            want = torch.full((1, 2, *ex.need.shape), fill)
            inside = ex.need.intersect(Rect((0, h), (0, w)))
            if inside is not None:
                hs, ws = ex.need.local(inside)
                want[:, :, hs, ws] = _cut(x, inside)
            pieces = [(r, _cut(x, r).contiguous()) for _, r in ex.recvs]
            assert torch.equal(_rebuild(_cut(x, ex.own).contiguous(), ex, False, pieces), want)
            assert torch.equal(_rebuild(x, ex, True, []), want)


@pytest.mark.parametrize("ext,grid_shape", [((7, 9, 10), (2, 2, 2)), ((7, 9, 10), (1, 2, 3)),
                                            ((8, 6, 9), (3, 1, 1))])
def test_split_convolution_matches_the_whole_volume(ext, grid_shape):
    """The same split for a 3-D convolution (faces, edges and corners of a box grid): the
    front / back slabs, then top / bottom, then the sides cover every halo output once."""
    grid = Grid(*grid_shape)
    splits = 0
    for k, s, p, d in [(3, 1, 1, 1), (3, 2, 1, 1), (1, 1, 0, 1), (3, 1, 2, 2), (5, 1, 2, 1)]:
        outs = tuple(out_extent(e, k, s, p, d) for e in ext)
        if any(o < g for o, g in zip(outs, grid.parts, strict=True)):
            continue
        gen = torch.Generator().manual_seed(k * 100 + s * 10 + d)
        x = torch.randn(1, 2, *ext, dtype=torch.float64, generator=gen)
        weight = torch.randn(3, 2, k, k, k, dtype=torch.float64, generator=gen,
                             requires_grad=True)
        bias = torch.randn(3, dtype=torch.float64, generator=gen, requires_grad=True)
        cfg = {"stride": (s,) * 3, "dilation": (d,) * 3, "groups": 1}
        needs = [Rect(*(window_rows(iv, k, s, p, d) for iv in o.dims))
                 for o in (grid.tile_rect(outs, t) for t in range(grid.size))]
        for t in range(grid.size):
            ex = exchange(grid, ext, needs, t)
            split = haloconv.plan(ex, (k,) * 3, (s,) * 3, (d,) * 3, min_ratio=0)
            if split is None:
                continue
            splits += 1

            def cut(v: torch.Tensor, r: Rect) -> torch.Tensor:
                return v[(slice(None), slice(None), *Rect.whole(v.shape[2:]).local(r))]

            tile = cut(x, ex.own).contiguous()
            pieces = [(r, cut(x, r).contiguous()) for _, r in ex.recvs]
            out = haloconv.tile_part(tile, split, cfg, (weight.detach(), bias.detach()))
            out = haloconv.add_bands(out, tile, ex, split, pieces, cfg, weight.detach())
            xr = x.clone().requires_grad_()
            ref = cut(F.conv3d(xr, weight, bias, s, p, d), grid.tile_rect(outs, t))
            torch.testing.assert_close(out, ref.detach(), rtol=0, atol=1e-12)
            g = torch.randn(ref.shape, dtype=torch.float64, generator=gen)
            gw_ref, gb_ref, gx_ref = torch.autograd.grad(ref, (weight, bias, xr), g)
            halo, gw_bands = haloconv.band_grads(g, tile, ex, split, pieces, cfg,
                                                 weight.detach(), True, True)
            gx, gw, gb = haloconv.tile_grads(g, tile, split, cfg,
                                             (weight.detach(), bias.detach()),
                                             (True, True, True))
            gw = gw if gw_bands is None else gw + gw_bands
            torch.testing.assert_close(gw, gw_ref, rtol=0, atol=1e-10)
            torch.testing.assert_close(gb, gb_ref, rtol=0, atol=1e-10)
            torch.testing.assert_close(gx, cut(gx_ref, ex.own), rtol=0, atol=1e-10)
            assert halo is not None
            for (_, r), gh in zip(ex.recvs, halo, strict=True):
                torch.testing.assert_close(gh, cut(gx_ref, r), rtol=0, atol=1e-10)
    assert splits > 0
