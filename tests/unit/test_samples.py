"""fxpar.data.samples: class folders and CSVs (labels, masks, level / y / x regions of larger
slides) as step-indexed batch sources; each rank's window of a batch equals that window of the
whole batch and is all that is read; bad CSVs name the line and the column."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from fxpar.core.geometry import Grid, Rect
from fxpar.data.data import FolderBatches, ImageFolder, Synthetic, whole_batch
from fxpar.data.errors import DataError
from fxpar.data.samples import describe, open_source, task

tifffile = pytest.importorskip("tifffile")
zarr = pytest.importorskip("zarr")

H, W = 24, 20  # the model's input (the region of each sample)


def slide(tmp: Path, name: str, seed: int, size: tuple[int, int] = (64, 72)) -> np.ndarray:
    """A two-level tiled RGB TIFF (level 1 its own random image); returns [level0, level1]
    as (C, H, W) arrays."""
    rng = np.random.default_rng(seed)
    levels = [rng.integers(0, 255, (size[0] >> k, size[1] >> k, 3), dtype=np.uint8)
              for k in range(2)]
    with tifffile.TiffWriter(tmp / name) as tw:
        kw = dict(tile=(16, 16), compression="zlib", photometric="rgb")
        tw.write(levels[0], subifds=1, **kw)
        tw.write(levels[1], subfiletype=1, **kw)
    return [lv.transpose(2, 0, 1) for lv in levels]


def tiles(size: tuple[int, int], grid: Grid, halo: int = 2) -> list[Rect]:
    """Each tile of a grid over ``size`` widened by a halo, clipped: a rank's input window."""
    out = []
    for t in range(grid.size):
        r = grid.tile_rect(size, t)
        out.append(Rect(*((max(a - halo, 0), min(b + halo, n)) for (a, b), n in
                          zip(r.dims, size, strict=True))))
    return out


def check_windows(source, step: int, shape: tuple[int, ...]):
    """Every window of a 2x2 grid equals the whole batch's window; NaN (fill) elsewhere."""
    x, y = whole_batch(source, step, shape)
    assert not torch.isnan(x).any()
    for window in tiles(shape[2:], Grid(2, 2)):
        xw, yw = source.batch(step, window)
        where = (slice(None), slice(None), *(slice(a, b) for a, b in window.dims))
        torch.testing.assert_close(xw[where], x[where], rtol=0, atol=0)
        assert torch.isnan(xw).sum() == xw.numel() - xw[where].numel()
        assert torch.equal(yw, y)
    assert source.batch(step, None)[0] is None
    return x, y


def test_csv_labels_regions_and_levels(tmp_path):
    s1 = slide(tmp_path, "a.tif", 1)
    s2 = slide(tmp_path, "b.tif", 2)
    rng = np.random.default_rng(3)
    npy = rng.standard_normal((3, H, W)).astype(np.float32)
    np.save(tmp_path / "c.npy", npy)
    png = rng.integers(0, 255, (H, W, 3), dtype=np.uint8)
    (tmp_path / "img").mkdir()
    Image.fromarray(png).save(tmp_path / "img" / "d.png")
    (tmp_path / "s.csv").write_text("image,label,level,y,x,notes\n"
                                    "a.tif,0,0,5,7,top left\n"
                                    "b.tif,2,1,8,16,\n"
                                    "\n"
                                    "c.npy,1,,,,\n"
                                    "img/d.png,1,,,,\n")
    shape = (4, 3, H, W)
    src = open_source(tmp_path / "s.csv", shape, torch.float64, shuffle=False, fill=float("nan"))
    src.reads = []
    assert task(src) == "classify" and len(src) == 4 and src.steps_per_epoch == 1
    x, y = check_windows(src, 0, shape)
    assert y.tolist() == [0, 2, 1, 1] and y.dtype == torch.int64
    want = [s1[0][:, 5:5 + H, 7:7 + W] / 255, s2[1][:, 8:8 + H, 16:16 + W] / 255, npy,
            png.transpose(2, 0, 1) / 255]
    for k, w in enumerate(want):
        torch.testing.assert_close(x[k], torch.from_numpy(np.asarray(w, np.float64)))
    # each read was the rank's window moved to the sample's origin, nothing else
    window = tiles((H, W), Grid(2, 2))[3]
    src.reads.clear()
    src.batch(0, window)
    assert [(p.name, r) for p, r in src.reads] == [
        ("a.tif", window.moved((-5, -7))), ("b.tif", window.moved((-8, -16))),
        ("c.npy", window), ("d.png", window)]
    line = describe(src)
    assert "4 samples" in line and "3 classes" in line and "level 0, 1" in line
    src.close()


def test_csv_masks(tmp_path):
    rng = np.random.default_rng(4)
    s1 = slide(tmp_path, "a.tif", 5)
    mask0 = rng.integers(0, 4, (64, 72), dtype=np.uint8)
    Image.fromarray(mask0, mode="L").convert("P").save(tmp_path / "a_mask.png")  # palette
    mask1 = rng.integers(0, 4, (32, 36), dtype=np.uint16)
    tifffile.imwrite(tmp_path / "a_mask1.tif", mask1)  # level 1's size, one level
    img = rng.integers(0, 60000, (2, 30, 40), dtype=np.uint16)  # a Zarr image and mask pyramid
    z = zarr.create_array(tmp_path / "z.zarr", shape=img.shape, chunks=(2, 8, 8), dtype=img.dtype)
    z[:] = img
    group = zarr.open_group(tmp_path / "zmask.zarr", mode="w")
    zmask = [rng.integers(0, 3, (30, 40), dtype=np.int32), np.zeros((15, 20), np.int32)]
    for k, m in enumerate(zmask):
        group.create_array(str(k), shape=m.shape, chunks=(8, 8), dtype=m.dtype)[:] = m
    (tmp_path / "m.csv").write_text("image,mask,level,y,x\n"
                                    "a.tif,a_mask.png,0,10,30\n"
                                    "a.tif,a_mask1.tif,1,8,16\n"
                                    "z.zarr,zmask.zarr,0,6,20\n")
    with pytest.raises(DataError, match="2 channel"):
        open_source(tmp_path / "m.csv", (3, 3, H, W))
    (tmp_path / "m.csv").write_text("image,mask,level,y,x\n"
                                    "a.tif,a_mask.png,0,10,30\n"
                                    "a.tif,a_mask1.tif,1,8,16\n")
    shape = (2, 3, H, W)
    src = open_source(tmp_path / "m.csv", shape, shuffle=False, fill=float("nan"))
    assert task(src) == "segment" and "masks" in describe(src)
    x, y = check_windows(src, 0, shape)
    assert y.shape == (2, H, W) and y.dtype == torch.int64
    assert torch.equal(y[0], torch.from_numpy(mask0[10:10 + H, 30:30 + W].astype(np.int64)))
    assert torch.equal(y[1], torch.from_numpy(mask1[8:8 + H, 16:16 + W].astype(np.int64)))
    torch.testing.assert_close(x[1], torch.from_numpy(s1[1][:, 8:8 + H, 16:16 + W] / 255).float())
    # a rank's loss reads only its output tile of each mask; a rank without the loss none
    src.reads = []
    for box in tiles((H, W), Grid(2, 2), halo=0):
        _, yt = src.batch(0, None, box)
        where = (slice(None), *(slice(a, b) for a, b in box.dims))
        assert torch.equal(yt[where], y[where])
        assert [r for _, r in src.reads] == [box.moved((-10, -30)), box.moved((-8, -16))]
        src.reads = []
    assert src.batch(0, None, targets=False) == (None, None) and src.reads == []
    src.reads = None
    # two channels, a Zarr image with a Zarr mask pyramid
    (tmp_path / "z.csv").write_text("image,mask,level,y,x\nz.zarr,zmask.zarr,0,6,20\n")
    src = open_source(tmp_path / "z.csv", (1, 2, H, W), shuffle=False, fill=float("nan"))
    x, y = check_windows(src, 0, (1, 2, H, W))
    torch.testing.assert_close(x[0], torch.from_numpy(img[:, 6:6 + H, 20:20 + W] / 65535).float())
    assert torch.equal(y[0], torch.from_numpy(zmask[0][6:6 + H, 20:20 + W].astype(np.int64)))


def test_class_folder(tmp_path):
    rng = np.random.default_rng(6)
    arrays = {}
    for cls, names in (("cat", ["1.png", "2.npy"]), ("dog", ["3.tif", "4.zarr"])):
        (tmp_path / cls).mkdir()
        for name in names:
            a = rng.integers(0, 255, (3, H, W), dtype=np.uint8)
            arrays[name] = a
            p = tmp_path / cls / name
            if name.endswith(".png"):
                Image.fromarray(a.transpose(1, 2, 0)).save(p)
            elif name.endswith(".npy"):
                np.save(p, a)
            elif name.endswith(".tif"):
                tifffile.imwrite(p, a.transpose(1, 2, 0), tile=(16, 16), photometric="rgb")
            else:
                zarr.create_array(p, shape=a.shape, chunks=(3, 8, 8), dtype=a.dtype)[:] = a
    (tmp_path / "dog" / "notes.txt").write_text("ignored")
    shape = (2, 3, H, W)
    src = open_source(tmp_path, shape, seed=3, fill=float("nan"))
    assert src.data.classes == ["cat", "dog"] and len(src) == 4 and src.steps_per_epoch == 2
    assert task(src) == "classify"
    order = []
    for step in range(2):
        x, y = check_windows(src, step, shape)
        for k, i in enumerate(src.indices(step)):
            sample = src.data.samples[i]
            assert y[k] == (0 if sample.image.parent.name == "cat" else 1)
            torch.testing.assert_close(x[k], torch.from_numpy(arrays[sample.image.name] / 255)
                                       .float())
            order.append(i)
    assert sorted(order) == [0, 1, 2, 3]
    again = open_source(tmp_path, shape, seed=3)
    assert again.indices(0) == src.indices(0) and again.indices(1) == src.indices(1)
    with pytest.raises(DataError, match=r"is 24x20 at level 0 but --image-size is 24x24"):
        open_source(tmp_path, (2, 3, H, H))
    with pytest.raises(DataError, match="fewer than one batch of 5"):
        open_source(tmp_path, (5, 3, H, W))


def test_volume_regions(tmp_path):
    rng = np.random.default_rng(7)
    vol = rng.standard_normal((1, 10, 12, 14)).astype(np.float32)
    zarr.create_array(tmp_path / "v.zarr", shape=vol.shape, chunks=(1, 4, 4, 4),
                      dtype=vol.dtype)[:] = vol
    (tmp_path / "v.csv").write_text("image,label,z,y,x\nv.zarr,1,2,3,4\n")
    shape = (1, 1, 6, 8, 9)
    src = open_source(tmp_path / "v.csv", shape, fill=float("nan"))
    x, y = whole_batch(src, 0, shape)
    assert torch.equal(x[0], torch.from_numpy(vol[:, 2:8, 3:11, 4:13]))
    window = Rect((1, 5), (0, 8), (3, 9))
    xw, _ = src.batch(0, window)
    assert torch.equal(xw[0, :, 1:5, 0:8, 3:9], x[0, :, 1:5, 0:8, 3:9])


def test_bad_csvs_name_the_line_and_column(tmp_path):
    slide(tmp_path, "a.tif", 8)
    np.save(tmp_path / "m.npy", np.zeros((10, 10), np.uint8))
    np.save(tmp_path / "rgb.npy", np.zeros((3, 64, 72), np.uint8))
    shape = (1, 3, H, W)
    cases = [
        ("image,class\na.tif,1\n", r"columns \['image', 'class'\].*'label'.*'mask'"),
        ("image,label,mask\na.tif,1,m.npy\n", r"either 'label'"),
        ("image,label\na.tif,1\na.tif,cat\n", r"b.csv:3: column 'label': 'cat' is not an int"),
        ("image,label\na.tif,-1\n", r"b.csv:2: column 'label': '-1'"),
        ("image,label,y,x\na.tif,0,-3,0\n", r"b.csv:2: column 'y': '-3'"),
        ("image,label,y,x\na.tif,0,50,0\n",
         r"b.csv:2: columns y, x: the region rows 50:74 cols 0:20 .* passes the edge.*64x72"),
        ("image,label,level\na.tif,0,2\n",
         r"b.csv:2: column 'image'.*no pyramid level 2.*0: 64x72, 1: 32x36"),
        ("image,label\nnope.tif,0\n", r"b.csv:2: column 'image'.*nope.tif: no such file"),
        ("image,label\n,0\n", r"b.csv:2: column 'image' is empty"),
        ("image,label\na.tif\n", r"b.csv:2: 1 cells but the header has 2"),
        ("image,label\n", r"no rows after the header"),
        ("image,mask\na.tif,m.npy\n",
         r"b.csv:2: column 'mask': .*m.npy is 10x10 but its image is 64x72 at level 0"),
        ("image,mask\na.tif,rgb.npy\n", r"b.csv:2: column 'mask': .*has 3 channels"),
        ("image,mask\na.tif,\n", r"b.csv:2: column 'mask' is empty"),
    ]
    for text, match in cases:
        (tmp_path / "b.csv").write_text(text)
        with pytest.raises(DataError, match=match):
            open_source(tmp_path / "b.csv", shape)
    with pytest.raises(DataError, match="give a folder of class folders"):
        open_source(tmp_path / "none.csv", shape)
    np.save(tmp_path / "frac.npy", np.full((64, 72), 0.5, np.float32))
    (tmp_path / "b.csv").write_text("image,mask\na.tif,frac.npy\n")
    src = open_source(tmp_path / "b.csv", shape)
    with pytest.raises(DataError, match="b.csv:2: column 'mask': .*fractions"):
        src.batch(0, None)


def test_task_and_describe_of_other_sources(tmp_path):
    assert task(Synthetic((2, 3, 8, 8), 4)) == "classify"
    assert describe(Synthetic((2, 3, 8, 8), 4)) == "data: synthetic (one fixed batch)"
    (tmp_path / "a").mkdir()
    np.save(tmp_path / "a" / "x.npy", np.zeros((3, 8, 8), np.float32))
    folder = FolderBatches(ImageFolder.scan(tmp_path, 8), 1)
    assert task(folder) == "classify" and describe(folder).startswith(f"data: {tmp_path}")
