"""Interpolation on tiles (runtime.spatial.interp): every tile's rows, gathered from the window
its index map asks for, equal the same rows of one device's F.interpolate, for nearest and
bilinear (both align_corners), integer and fractional scales and target sizes; and reflect /
replicate padding, an index map too."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from fxpar.core.geometry import tile
from fxpar.runtime.spatial.interp import AxisMap, TileInterp

CASES = [  # (in H, in W), interpolate kwargs
    ((5, 7), {"scale_factor": 2}),
    ((5, 7), {"scale_factor": 3}),
    ((6, 5), {"scale_factor": 1.5}),
    ((9, 4), {"size": (13, 11)}),
    ((8, 8), {"size": (5, 3)}),
    ((7, 6), {"scale_factor": 0.5}),
]
MODES = [("nearest", None), ("bilinear", False), ("bilinear", True)]


def _maps(x, y, mode, corners, kw):
    sf = kw.get("scale_factor")
    return tuple(AxisMap(mode, bool(corners), x.shape[d], y.shape[d],
                         None if sf is None else float(sf)) for d in (2, 3))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize(("size", "kw"), CASES)
@pytest.mark.parametrize(("mode", "corners"), MODES)
def test_tile_rows_equal_one_device(size, kw, mode, corners, dtype):
    x = torch.randn(2, 3, *size, dtype=dtype)
    y = F.interpolate(x, mode=mode, align_corners=corners, **kw)
    maps = _maps(x, y, mode, corners, kw)
    for parts_h, parts_w in ((1, 2), (3, 1), (2, 2)):
        for a, b in itertools.product(range(parts_h), range(parts_w)):
            rows, cols = tile(y.shape[2], parts_h, a), tile(y.shape[3], parts_w, b)
            if rows[0] == rows[1] or cols[0] == cols[1]:
                continue
            nh, nw = maps[0].needs(rows), maps[1].needs(cols)
            assert 0 <= nh[0] < nh[1] <= x.shape[2] and 0 <= nw[0] < nw[1] <= x.shape[3]
            window = x[:, :, nh[0]:nh[1], nw[0]:nw[1]]
            got = TileInterp(maps, (rows, cols), (nh[0], nw[0]))(window)
            want = y[:, :, rows[0]:rows[1], cols[0]:cols[1]]
            tol = 1e-12 if dtype == torch.float64 else 1e-5
            torch.testing.assert_close(got, want, atol=tol, rtol=tol)


def test_a_wrong_index_map_is_caught():
    """The comparison above fails for a map that is off by half a pixel."""
    x = torch.randn(1, 1, 6, 6, dtype=torch.float64)
    y = F.interpolate(x, scale_factor=2, mode="bilinear", align_corners=False)
    maps = (AxisMap("bilinear", True, 6, 12, 2.0), AxisMap("bilinear", True, 6, 12, 2.0))
    got = TileInterp(maps, ((0, 12), (0, 12)), (0, 0))(x)
    assert not torch.allclose(got, y)


@pytest.mark.parametrize("mode", ["reflect", "replicate"])
@pytest.mark.parametrize("pad", [(1, 1, 1, 1), (2, 0, 1, 3), (0, 3, 0, 0)])
def test_padding_tiles_equal_one_device(mode, pad):
    """Reflect / replicate padding as an index map: each tile of the padded image, gathered
    from its window (which never leaves the image), equals one device's F.pad exactly."""
    x = torch.randn(2, 3, 7, 5, dtype=torch.float64)
    y = F.pad(x, pad, mode=mode)
    left, _, top, _ = pad
    maps = (AxisMap(mode, False, 7, y.shape[2], None, top),
            AxisMap(mode, False, 5, y.shape[3], None, left))
    for parts_h, parts_w in ((1, 2), (3, 1), (2, 3)):
        for a, b in itertools.product(range(parts_h), range(parts_w)):
            rows, cols = tile(y.shape[2], parts_h, a), tile(y.shape[3], parts_w, b)
            nh, nw = maps[0].needs(rows), maps[1].needs(cols)
            assert 0 <= nh[0] < nh[1] <= 7 and 0 <= nw[0] < nw[1] <= 5
            got = TileInterp(maps, (rows, cols), (nh[0], nw[0]))(x[:, :, nh[0]:nh[1],
                                                                  nw[0]:nw[1]])
            assert torch.equal(got, y[:, :, rows[0]:rows[1], cols[0]:cols[1]])


FAST = [("bilinear", {"scale_factor": 2}), ("nearest", {"scale_factor": 2}),
        ("bilinear", {"size": (20, 28)}), ("nearest", {"scale_factor": 4}),
        ("bilinear", {"scale_factor": 8})]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize(("mode", "kw"), FAST)
def test_power_of_two_upsampling_runs_torchs_kernel_on_the_window(mode, kw, dtype):
    """Nearest and bilinear (align_corners=False) by 2, 4, 8, from a scale factor or a size:
    PyTorch's kernel on the window, cut to the tile, gives one device's rows bit for bit, on
    every tile of uneven grids; channels-last and 1-D and 3-D inputs too."""
    corners = False if mode == "bilinear" else None
    for shape in ((2, 3, 5, 7), (1, 2, 5, 7, 3), (2, 3, 9)):
        if "size" in kw and len(shape) != 4:
            continue
        nd = len(shape) - 2
        mode_nd = ("linear", "bilinear", "trilinear")[nd - 1] if mode == "bilinear" else mode
        x = torch.randn(*shape, dtype=dtype)
        if nd == 2:
            x = x.contiguous(memory_format=torch.channels_last)
        y = F.interpolate(x, mode=mode_nd, align_corners=corners, **kw)
        sf = kw.get("scale_factor")
        maps = tuple(AxisMap(mode, False, x.shape[d], y.shape[d], None if sf is None
                             else float(sf)) for d in range(2, 2 + nd))
        for parts in itertools.product((1, 2, 3), repeat=nd):
            for at in itertools.product(*(range(p) for p in parts)):
                out = tuple(tile(y.shape[2 + d], parts[d], at[d]) for d in range(nd))
                if any(a == b for a, b in out):
                    continue
                need = [m.needs(iv) for m, iv in zip(maps, out, strict=True)]
                window = x[(slice(None), slice(None), *(slice(a, b) for a, b in need))]
                t = TileInterp(maps, out, tuple(a for a, _ in need))
                assert t.factors is not None
                got = t(window)
                want = y[(slice(None), slice(None), *(slice(a, b) for a, b in out))]
                assert torch.equal(got, want), (shape, parts, at)


def test_other_maps_keep_the_gather():
    """Scales other than a power of two, align_corners and padding are index maps."""
    assert AxisMap("bilinear", False, 5, 15, 3.0).factor() is None
    assert AxisMap("bilinear", True, 5, 10, 2.0).factor() is None
    assert AxisMap("bilinear", False, 6, 9, 1.5).factor() is None
    assert AxisMap("reflect", False, 5, 7, None, 1).factor() is None
    assert AxisMap("nearest", False, 5, 10, None).factor() == 2
