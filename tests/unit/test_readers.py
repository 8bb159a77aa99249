"""fxpar.data.images: every format's windows equal numpy's slicing of the ground truth, at every
level, and a reader reads only the tiles its window touches (bytes measured at the file handle,
bounded by the tiles' stored sizes from tifffile's offsets tables).

Every file is written here, in tmp_path: a 20000 x 20000 RGB pyramid (three levels, sub-IFDs;
constant tiles plus a few tiles of a hash-like pattern computable for any pixel, so the file is
a few MB and any window's truth is known), an OME-TIFF (planar CYX, sub-IFD pyramid), a striped
GeoTIFF with its geo tags, an SVS-like file (Aperio description: baseline, thumbnail, levels),
Zarr arrays and multiscale groups (OME axes or none), .npy and PNG."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from fxpar.core.geometry import Rect
from fxpar.data.errors import DataError
from fxpar.data.images import TiffReader, geo_extratags, open_image, to_tensor

tifffile = pytest.importorskip("tifffile")
zarr = pytest.importorskip("zarr")
pytest.importorskip("imagecodecs")  # zstd tiles

N, T = 20000, 256  # the pyramid's level-0 size and tile size
SPECIAL = {0: [(0, 0), (0, 1), (1, 0), (1, 1), (39, 40), (40, 39), (78, 78), (0, 78), (78, 0)],
           1: [(0, 0), (1, 1), (19, 20), (39, 39)],
           2: [(0, 0), (9, 10), (19, 19)]}
"""Tiles (ty, tx) of each level holding the pattern; the others are constant."""


def pattern(level: int, ys: np.ndarray, xs: np.ndarray) -> np.ndarray:
    """A hash of (level, y, x, c) for pixels ys x xs: (3, len(ys), len(xs)) uint8."""
    c = np.arange(3, dtype=np.uint64)[:, None, None]
    y = ys.astype(np.uint64)[None, :, None]
    x = xs.astype(np.uint64)[None, None, :]
    h = (y * np.uint64(73856093)) ^ (x * np.uint64(19349663)) ^ (c * np.uint64(83492791)) \
        ^ np.uint64(level * 2654435761)
    return ((h * np.uint64(2246822519)) >> np.uint64(24)).astype(np.uint8)


def constant(level: int, ty: int, tx: int) -> np.ndarray:
    return np.array([(ty * 31 + tx * 17 + c * 7 + level * 5) % 256 for c in range(3)], np.uint8)


def truth(level: int, window: Rect) -> np.ndarray:
    """The pyramid's pixels in ``window`` at ``level``: (3, h, w)."""
    (y0, y1), (x0, x1) = window.dims
    out = np.empty((3, y1 - y0, x1 - x0), np.uint8)
    for ty in range(y0 // T, (y1 - 1) // T + 1):
        for tx in range(x0 // T, (x1 - 1) // T + 1):
            ya, yb = max(y0, ty * T), min(y1, (ty + 1) * T)
            xa, xb = max(x0, tx * T), min(x1, (tx + 1) * T)
            part = out[:, ya - y0:yb - y0, xa - x0:xb - x0]
            if (ty, tx) in SPECIAL[level]:
                part[...] = pattern(level, np.arange(ya, yb), np.arange(xa, xb))
            else:
                part[...] = constant(level, ty, tx)[:, None, None]
    return out


def _tiles(level: int):
    n = N >> level
    cache: dict[bytes, np.ndarray] = {}
    for ty in range(-(-n // T)):
        for tx in range(-(-n // T)):
            if (ty, tx) in SPECIAL[level]:
                ys, xs = np.arange(ty * T, ty * T + T), np.arange(tx * T, tx * T + T)
                yield pattern(level, ys, xs).transpose(1, 2, 0)
            else:
                v = constant(level, ty, tx)
                key = v.tobytes()
                if key not in cache:  # 256 distinct tiles at most
                    cache[key] = np.broadcast_to(v, (T, T, 3)).copy()
                yield cache[key]


@pytest.fixture(scope="module")
def pyramid(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tiff") / "slide.tif"
    kw = dict(tile=(T, T), compression="zstd", photometric="rgb", dtype=np.uint8)
    with tifffile.TiffWriter(path, bigtiff=True) as tw:
        tw.write(_tiles(0), shape=(N, N, 3), subifds=2, **kw)
        for level in (1, 2):
            n = N >> level
            tw.write(_tiles(level), shape=(n, n, 3), subfiletype=1, **kw)
    return path


WINDOWS = {0: [Rect((200, 600), (100, 700)),
               Rect((39 * T - 50, 41 * T + 10), (40 * T - 3, 41 * T)),
               Rect((N - 100, N), (N - 300, N)), Rect((N - 5, N), (0, 300)), Rect((0, 1), (0, 1))],
           1: [Rect((0, 513), (0, 300)), Rect((19 * T + 7, 21 * T), (20 * T, 20 * T + 9)),
               Rect((9900, 10000), (9800, 10000))],
           2: [Rect((0, 5000), (2300, 2600)), Rect((4800, 5000), (4700, 5000))]}


def stored_bound(path: Path, level: int, window: Rect) -> tuple[int, int]:
    """(tiles touched, their stored bytes) from tifffile's offsets table of that level."""
    with tifffile.TiffFile(path) as tf:
        page = tf.series[0].levels[level].pages[0]
        nx = -(-page.imagewidth // page.tilewidth)
        (y0, y1), (x0, x1) = window.dims
        idx = [ty * nx + tx for ty in range(y0 // page.tilelength, (y1 - 1) // page.tilelength + 1)
               for tx in range(x0 // page.tilewidth, (x1 - 1) // page.tilewidth + 1)]
        return len(idx), sum(page.databytecounts[i] for i in idx)


@pytest.mark.parametrize("level", [0, 1, 2])
def test_pyramid_windows_and_bytes(pyramid, level):
    size = pyramid.stat().st_size
    assert size < 16 * 2**20  # a few MB: constant tiles compress to nothing
    with open_image(pyramid, level, counting=True) as r:
        assert isinstance(r, TiffReader)
        assert r.levels == ((N, N), (N // 2, N // 2), (N // 4, N // 4))
        assert r.shape == (3, N >> level, N >> level) and r.dtype == np.uint8
        assert r.stats.bytes == r.stats.header < size / 4
        for window in WINDOWS[level]:
            before, tiles_before = r.stats.bytes, r.stats.tiles
            a = r.read(window)
            assert a.shape == (3, *window.shape) and a.dtype == np.uint8
            np.testing.assert_array_equal(a, truth(level, window))
            tiles, stored = stored_bound(pyramid, level, window)
            assert r.stats.tiles - tiles_before == tiles
            assert r.stats.bytes - before <= stored + 4096  # only its tiles (+ a little)
            if window.size < T * T:
                assert r.stats.bytes - before < size / 10
        assert r.stats.windows == WINDOWS[level]


def test_pyramid_without_counting_reads_the_same(pyramid):
    window = WINDOWS[0][1]
    with open_image(pyramid, 0) as r:
        np.testing.assert_array_equal(r.read(window), truth(0, window))
        assert r.stats.bytes == 0 and r.stats.tiles == stored_bound(pyramid, 0, window)[0] == 8


def test_pyramid_errors(pyramid):
    with pytest.raises(DataError, match=r"no pyramid level 3.*0: 20000x20000, 1: 10000x10000, "
                                        r"2: 5000x5000.*from 0 to 2"):
        open_image(pyramid, 3)
    with open_image(pyramid, 2) as r, pytest.raises(DataError, match=r"outside the 5000x5000"):
        r.read(Rect((4990, 5001), (0, 10)))


def test_ome_tiff_planar_pyramid(tmp_path):
    rng = np.random.default_rng(0)
    level0 = rng.integers(0, 65535, (2, 300, 260), dtype=np.uint16)
    level1 = level0[:, ::2, ::2].copy()
    path = tmp_path / "cells.ome.tif"
    kw = dict(tile=(64, 64), compression="zlib", photometric="minisblack")
    with tifffile.TiffWriter(path, ome=True) as tw:
        tw.write(level0, subifds=1, metadata={"axes": "CYX"}, **kw)
        tw.write(level1, subfiletype=1, **kw)
    with tifffile.TiffFile(path) as tf:
        assert tf.is_ome and tf.series[0].axes == "CYX"
    for level, data in enumerate((level0, level1)):
        with open_image(path, level, counting=True) as r:
            assert r.levels == ((300, 260), (150, 130)) and r.shape == data.shape
            window = Rect((10, 140), (63, 129))
            np.testing.assert_array_equal(r.read(window), data[:, 10:140, 63:129])
            assert r.stats.tiles == 2 * 3 * 3  # two channel pages x 3 x 3 tiles
            whole = Rect.whole(data.shape[1:])
            np.testing.assert_array_equal(r.read(whole), data)


def test_geotiff_tags_and_strips(tmp_path):
    data = (np.arange(200 * 180, dtype=np.float32).reshape(200, 180) / 7).astype(np.float32)
    geo = {"ModelPixelScaleTag": (10.0, 10.0, 0.0),
           "ModelTiepointTag": (0.0, 0.0, 0.0, 440720.0, 3751320.0, 0.0),
           "GeoKeyDirectoryTag": (1, 1, 0, 3, 1024, 0, 1, 1, 1025, 0, 1, 1, 3072, 0, 1, 32611),
           "GeoDoubleParamsTag": (6378137.0, 298.257223563),
           "GeoAsciiParamsTag": "WGS 84 / UTM zone 11N|"}
    path = tmp_path / "scene.tif"
    tifffile.imwrite(path, data, rowsperstrip=16, compression="zlib",
                     extratags=geo_extratags(geo))
    with open_image(path, counting=True) as r:
        assert r.shape == (1, 200, 180) and r.dtype == np.float32
        assert set(r.geo) == set(geo)
        for name, value in geo.items():
            got = r.geo[name]
            assert (got == value) if isinstance(value, str) else \
                np.allclose(np.asarray(got, float), value)
        window = Rect((30, 50), (5, 170))
        np.testing.assert_array_equal(r.read(window)[0], data[30:50, 5:170])
        assert r.stats.tiles == 3  # strips 16:32, 32:48, 48:64
    # a TIFF without geo tags has geo None
    plain = tmp_path / "plain.tif"
    tifffile.imwrite(plain, data[:8, :8])
    with open_image(plain) as r:
        assert r.geo is None


def test_svs_like(tmp_path):
    rng = np.random.default_rng(1)
    levels = [rng.integers(0, 255, (512 >> k, 640 >> k, 3), dtype=np.uint8) for k in range(3)]
    path = tmp_path / "slide.svs"
    desc = "Aperio Image Library v12.0.15\n640x512 [0,0 640x512] (128x128) ZSTD|AppMag = 20"
    kw = dict(tile=(128, 128), compression="zstd", photometric="rgb", metadata=None)
    with tifffile.TiffWriter(path) as tw:  # metadata=None: no tifffile JSON, so it reads as SVS
        tw.write(levels[0], description=desc, **kw)
        tw.write(levels[2][::2, ::2], description="Aperio thumbnail", photometric="rgb",
                 metadata=None)
        for lv in levels[1:]:
            tw.write(lv, description="Aperio level", **kw)
    with tifffile.TiffFile(path) as tf:
        assert tf.is_svs and tf.series[0].kind == "svs"
    for k, data in enumerate(levels):
        with open_image(path, k) as r:
            assert r.levels == ((512, 640), (256, 320), (128, 160))
            window = Rect((5, 120), (100, 150))
            np.testing.assert_array_equal(r.read(window), data[5:120, 100:150].transpose(2, 0, 1))


def test_zarr_array_and_multiscale(tmp_path):
    rng = np.random.default_rng(2)
    chw = rng.integers(0, 255, (3, 70, 90), dtype=np.uint8)
    plain = zarr.create_array(tmp_path / "chw.zarr", shape=chw.shape, chunks=(3, 16, 16),
                              dtype=chw.dtype)
    plain[:] = chw
    window = Rect((10, 40), (15, 50))
    with open_image(tmp_path / "chw.zarr", counting=True) as r:
        assert r.shape == (3, 70, 90)
        np.testing.assert_array_equal(r.read(window), chw[:, 10:40, 15:50])
        assert r.stats.tiles == 3 * 4  # rows 0:16:32:48, cols 0:16:32:48:64
        assert 0 < r.stats.bytes - r.stats.header <= 12 * (3 * 16 * 16 + 64)
    hwc = zarr.create_array(tmp_path / "hwc.zarr", shape=(70, 90, 3), chunks=(32, 32, 3),
                            dtype=chw.dtype)
    hwc[:] = chw.transpose(1, 2, 0)
    with open_image(tmp_path / "hwc.zarr") as r:
        np.testing.assert_array_equal(r.read(window), chw[:, 10:40, 15:50])
    # OME-Zarr multiscales (axes c, y, x) and a group of arrays 0, 1 without metadata
    for name, attrs in (("ome.zarr", True), ("levels.zarr", False)):
        group = zarr.open_group(tmp_path / name, mode="w")
        data = [chw, chw[:, ::2, ::2].copy()]
        for k, d in enumerate(data):
            group.create_array(str(k), shape=d.shape, chunks=(1, 16, 16), dtype=d.dtype)[:] = d
        if attrs:
            group.attrs["multiscales"] = [{"version": "0.4", "axes": [
                {"name": "c", "type": "channel"}, {"name": "y", "type": "space"},
                {"name": "x", "type": "space"}], "datasets": [{"path": "0"}, {"path": "1"}]}]
        for k, d in enumerate(data):
            with open_image(tmp_path / name, k) as r:
                assert r.levels == ((70, 90), (35, 45))
                w = Rect((3, 30), (7, 41))
                np.testing.assert_array_equal(r.read(w), d[:, 3:30, 7:41])
        with pytest.raises(DataError, match=r"no pyramid level 2.*1: 35x45"):
            open_image(tmp_path / name, 2)


def test_zarr_volumes(tmp_path):
    rng = np.random.default_rng(3)
    vol = rng.standard_normal((2, 9, 20, 22)).astype(np.float32)
    group = zarr.open_group(tmp_path / "vol.zarr", mode="w")
    group.create_array("0", shape=(1, *vol.shape), chunks=(1, 1, 4, 8, 8), dtype=vol.dtype)[:] = \
        vol[None]
    group.attrs["multiscales"] = [{"axes": [{"name": n} for n in "tczyx"],
                                   "datasets": [{"path": "0"}]}]
    window = Rect((2, 7), (5, 19), (0, 22))
    with open_image(tmp_path / "vol.zarr") as r:
        assert r.shape == (2, 9, 20, 22)
        np.testing.assert_array_equal(r.read(window), vol[:, 2:7, 5:19, 0:22])
    dhw = zarr.create_array(tmp_path / "dhw.zarr", shape=(3, 20, 22), chunks=(3, 8, 8),
                            dtype=vol.dtype)
    dhw[:] = vol[0, :3]
    with open_image(tmp_path / "dhw.zarr", ndim=3) as r:  # 3 slices: a volume, not channels
        assert r.shape == (1, 3, 20, 22)
        np.testing.assert_array_equal(r.read(Rect((0, 3), (1, 2), (3, 9)))[0],
                                      vol[0, :3, 1:2, 3:9])
    with open_image(tmp_path / "dhw.zarr") as r:
        assert r.shape == (3, 20, 22)  # without the hint: channels first


def test_npy_and_png(tmp_path):
    rng = np.random.default_rng(4)
    hwc = rng.integers(0, 255, (40, 50, 3), dtype=np.uint8)
    np.save(tmp_path / "a.npy", hwc)
    np.save(tmp_path / "b.npy", hwc.transpose(2, 0, 1).astype(np.float32))
    window = Rect((3, 33), (10, 49))
    want = hwc[3:33, 10:49].transpose(2, 0, 1)
    for name in ("a.npy", "b.npy"):
        with open_image(tmp_path / name, counting=True) as r:
            assert r.shape == (3, 40, 50)
            np.testing.assert_array_equal(r.read(window), want)
            assert r.stats.bytes == want.size * r.dtype.itemsize
    Image.fromarray(hwc).save(tmp_path / "a.png")
    with open_image(tmp_path / "a.png", counting=True) as r:
        assert r.shape == (3, 40, 50) and r.dtype == np.uint8
        np.testing.assert_array_equal(r.read(window), want)
        size = (tmp_path / "a.png").stat().st_size
        assert size <= r.stats.bytes - r.stats.header <= size + 512  # PIL decodes it all
    Image.fromarray(hwc[..., 0]).save(tmp_path / "gray.png")
    with open_image(tmp_path / "gray.png", channels=3) as r:  # as fxpar.data.data converts
        assert r.shape == (3, 40, 50)
        np.testing.assert_array_equal(r.read(window), np.repeat(hwc[None, 3:33, 10:49, 0], 3, 0))
    palette = Image.fromarray((hwc[..., 0] % 5).astype(np.uint8), mode="L").convert("P")
    palette.save(tmp_path / "mask.png")
    with open_image(tmp_path / "mask.png", mask=True) as r:
        assert r.shape == (1, 40, 50)
        np.testing.assert_array_equal(r.read(window)[0], hwc[3:33, 10:49, 0] % 5)


def test_user_errors(tmp_path, monkeypatch):
    with pytest.raises(DataError, match="no such file"):
        open_image(tmp_path / "missing.tif")
    (tmp_path / "a.xyz").write_bytes(b"x")
    with pytest.raises(DataError, match=r"unknown image format '.xyz'.*\.svs"):
        open_image(tmp_path / "a.xyz")
    (tmp_path / "bad.tif").write_bytes(b"not a tiff")
    with pytest.raises(DataError, match="not a readable TIFF"):
        open_image(tmp_path / "bad.tif")
    (tmp_path / "slide.mrxs").write_bytes(b"x")
    monkeypatch.setitem(sys.modules, "openslide", None)
    with pytest.raises(DataError, match="pip install openslide-python openslide-bin"):
        open_image(tmp_path / "slide.mrxs")
    monkeypatch.setitem(sys.modules, "tifffile", None)
    with pytest.raises(DataError, match=r"pip install 'fxpar\[images\]'"):
        open_image(tmp_path / "bad.tif")


def test_openslide_reader_with_a_stand_in(tmp_path, monkeypatch):
    """The OpenSlide path against a stand-in module (openslide-python is not installed here):
    levels from level_dimensions, regions addressed in level-0 coordinates, RGBA to RGB."""
    rng = np.random.default_rng(5)
    base = rng.integers(0, 255, (64, 80, 4), dtype=np.uint8)
    base[..., 3] = 255
    base[:4, :4, 3] = 0  # unscanned: white

    class Slide:
        level_dimensions = ((80, 64), (40, 32))
        level_downsamples = (1.0, 2.0)

        def __init__(self, path: str) -> None:
            self.path = path

        def read_region(self, xy, level, size):
            d = int(self.level_downsamples[level])
            img = base[::d, ::d]
            x, y = xy[0] // d, xy[1] // d
            return Image.fromarray(img[y:y + size[1], x:x + size[0]], "RGBA")

        def close(self) -> None:
            pass

    monkeypatch.setitem(sys.modules, "openslide", types.SimpleNamespace(OpenSlide=Slide))
    (tmp_path / "s.mrxs").write_bytes(b"x")
    want = np.where(base[..., 3:] == 0, 255, base[..., :3]).astype(np.uint8)
    with open_image(tmp_path / "s.mrxs", 1) as r:
        assert r.levels == ((64, 80), (32, 40)) and r.shape == (3, 32, 40)
        np.testing.assert_array_equal(r.read(Rect((1, 20), (3, 30))),
                                      want[::2, ::2][1:20, 3:30].transpose(2, 0, 1))
    with open_image(tmp_path / "s.mrxs") as r:
        np.testing.assert_array_equal(r.read(Rect((0, 10), (0, 10))),
                                      want[:10, :10].transpose(2, 0, 1))


def test_to_tensor():
    a = np.array([[0, 255]], np.uint8)
    assert torch.equal(to_tensor(a, torch.float32), torch.tensor([[0.0, 1.0]]))
    b = np.array([65535], np.uint16)
    assert to_tensor(b, torch.float64).item() == 1.0
    c = np.array([-2.5], np.float32)
    assert to_tensor(c, torch.float32).item() == -2.5
