"""3-D data without MPI (fxpar.data.data, fxpar.data.volumes): volumes from .npy (memory-mapped)
and NIfTI (.nii, .nii.gz through nibabel) read one window at a time, compared with numpy
slicing of the whole array; only the window is read (NaN outside it in the batch, the memmap
slice, the bytes nibabel reads); header checks; synthetic volumes whose windows agree with the
whole; 2-D synthetic data unchanged; fxpar-run's --image-size DxHxW and --grid flags."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image

import fxpar
from fxpar.cli import run
from fxpar.core.geometry import Rect
from fxpar.data.data import (
    DataError,
    FolderBatches,
    ImageFolder,
    Synthetic,
    describe,
    input_window,
    parse_size,
    spatial_size,
    whole_batch,
)

nib = pytest.importorskip("nibabel")

C, D, H, W = 2, 5, 6, 7  # odd sizes: every dim distinct, so a wrong axis order shows
WINDOWS = [Rect((0, D), (0, H), (0, W)), Rect((1, 4), (2, 6), (3, 7)),
           Rect((4, 5), (0, 1), (6, 7)), Rect((0, 2), (1, 6), (0, 7))]


def volume(channels: int = C, seed: int = 0) -> np.ndarray:
    """A (C, D, H, W) float32 volume of distinct values."""
    rng = np.random.default_rng(seed)
    return rng.standard_normal((channels, D, H, W)).astype(np.float32)


def to_xyz(v: np.ndarray) -> np.ndarray:
    """(C, D, H, W) -> NIfTI's (x, y, z, c): W = x, H = y, D = z (the module's mapping)."""
    return np.ascontiguousarray(v.transpose(3, 2, 1, 0))


def save_nifti(path: Path, xyz: np.ndarray) -> None:
    nib.save(nib.Nifti1Image(xyz, np.eye(4)), path)


def write(root: Path, fmt: str, v: np.ndarray, name: str = "v", cls: str = "a") -> Path:
    """``v`` (C, D, H, W) as root/cls/name.<fmt>; gray (C = 1) as a 3-D array."""
    (root / cls).mkdir(parents=True, exist_ok=True)
    gray = v.shape[0] == 1
    if fmt == "npy":
        path = root / cls / f"{name}.npy"
        np.save(path, v[0] if gray else v)
        return path
    path = root / cls / f"{name}.{fmt}"
    xyz = to_xyz(v)
    if fmt.endswith("5d"):  # NIfTI's vector form (x, y, z, 1, c)
        path = root / cls / f"{name}.nii"
        xyz = xyz[:, :, :, None, :]
    save_nifti(path, xyz[..., 0] if gray else xyz)
    return path


# -- windows of each format agree with numpy slicing -------------------------------------------
@pytest.mark.parametrize("fmt", ["npy", "nii", "nii.gz", "nii-5d"])
@pytest.mark.parametrize("channels", [1, C])
def test_volume_windows_are_numpy_slices_of_the_whole(tmp_path, fmt, channels):
    v = volume(channels)
    write(tmp_path, fmt, v)
    data = ImageFolder.scan(tmp_path, (D, H, W), channels)
    assert (data.size, data.ndim, data.kind, len(data)) == ((D, H, W), 3, "volume", 1)
    for window in WINDOWS:
        for dtype in (torch.float32, torch.float64):
            got = data.read(0, window, dtype)
            assert got.dtype == dtype and got.shape == (channels, *window.shape)
            d, h, w = (slice(*iv) for iv in window.dims)
            assert torch.equal(got, torch.from_numpy(v[:, d, h, w]).to(dtype)), (fmt, window)


def test_nifti_axes_are_z_y_x_and_channels_last(tmp_path):
    """Voxel (x, y, z, c) of the file is element (c, z, y, x) of the tensor."""
    xyz = np.arange(W * H * D * C, dtype=np.float64).reshape(W, H, D, C)
    (tmp_path / "a").mkdir()
    save_nifti(tmp_path / "a" / "v.nii", xyz)
    data = ImageFolder.scan(tmp_path, (D, H, W), C)
    t = data.read(0, Rect.whole((D, H, W)), torch.float64)
    for x, y, z, c in [(0, 0, 0, 0), (6, 1, 2, 1), (3, 5, 4, 0)]:
        assert t[c, z, y, x] == xyz[x, y, z, c]


def test_nifti_values_keep_the_header_scaling_and_integers_are_not_rescaled(tmp_path):
    ints = np.arange(W * H * D, dtype=np.int16).reshape(W, H, D) - 100  # e.g. Hounsfield units
    (tmp_path / "a").mkdir()
    img = nib.Nifti1Image(ints, np.eye(4))
    img.header.set_slope_inter(2.0, -1.0)
    nib.save(img, tmp_path / "a" / "ct.nii")
    np.save(tmp_path / "a" / "u8.npy", np.full((D, H, W), 255, dtype=np.uint8))
    data = ImageFolder.scan(tmp_path, (D, H, W), 1)
    t = data.read(0, Rect((1, 3), (0, H), (2, 5)), torch.float64)
    assert torch.equal(t[0], torch.from_numpy(ints.T[1:3, :, 2:5] * 2.0 - 1.0))
    assert torch.equal(data.read(1, Rect((0, 1), (0, 1), (0, 1))),  # .npy: scaled as always
                       torch.ones(1, 1, 1, 1))


def test_two_d_nifti_images_and_volumes_of_depth_one(tmp_path):
    img = np.arange(H * W, dtype=np.float32).reshape(H, W)
    (tmp_path / "a").mkdir()
    save_nifti(tmp_path / "a" / "flat.nii", np.ascontiguousarray(img.T))  # (x, y)
    save_nifti(tmp_path / "a" / "one.nii.gz", np.ascontiguousarray(img.T)[:, :, None])  # z = 1
    data = ImageFolder.scan(tmp_path, (H, W), 1)
    for i in range(2):
        assert torch.equal(data.read(i, Rect((1, 5), (2, 7)))[0], torch.from_numpy(img[1:5, 2:7]))
    cube = ImageFolder.scan(tmp_path, (1, H, W), 1)  # the same files as volumes of depth 1
    for i in range(2):
        assert torch.equal(cube.read(i, Rect((0, 1), (0, H), (3, 4)))[0, 0],
                           torch.from_numpy(img[:, 3:4]))


# -- only the window is read -------------------------------------------------------------------
@pytest.mark.parametrize("fmt", ["npy", "nii", "nii.gz"])
def test_volume_batches_fill_only_the_window(tmp_path, fmt):
    vols = [volume(seed=s) for s in range(4)]
    for i, v in enumerate(vols):
        write(tmp_path, fmt, v, name=str(i), cls="ab"[i % 2])
    data = ImageFolder.scan(tmp_path, (D, H, W), C)
    data.reads = []
    src = FolderBatches(data, 3, torch.float64, seed=2, fill=float("nan"))
    window = Rect((1, 4), (2, 5), (0, 6))
    x, y = src.batch(0, window)
    assert x.shape == (3, C, D, H, W)
    assert y.tolist() == [data.label(i) for i in src.indices(0)]
    inside = x[:, :, 1:4, 2:5, 0:6]
    assert not inside.isnan().any()
    assert x.isnan().sum() == x.numel() - inside.numel()  # every voxel outside: untouched
    for k, i in enumerate(src.indices(0)):
        name = data.samples[i][0].name
        v = vols[int(name.split(".")[0])]
        assert torch.equal(inside[k], torch.from_numpy(v[:, 1:4, 2:5, 0:6]).double())
    assert data.reads == [(str(data.samples[i][0].relative_to(tmp_path)), window)
                          for i in src.indices(0)]
    whole, _ = whole_batch(src, 0, x.shape)
    assert not whole.isnan().any() and torch.equal(whole[:, :, 1:4, 2:5, 0:6], inside)
    assert src.batch(0, None)[0] is None
    assert describe(src) == f"data: {tmp_path} (4 volumes, 2 classes, 1 steps per epoch)"


class _Spy(np.memmap):
    """A memmap that records how the whole map (not its slices) is indexed."""

    keys: list = []
    root: np.memmap | None = None

    def __getitem__(self, key):
        if self is _Spy.root:
            _Spy.keys.append(key)
        return super().__getitem__(key)


@pytest.mark.parametrize("channels", [1, C])
def test_npy_window_read_is_one_slice_of_the_memory_map(tmp_path, monkeypatch, channels):
    write(tmp_path, "npy", volume(channels))
    data = ImageFolder.scan(tmp_path, (D, H, W), channels)
    load = np.load
    maps = []

    def spy_load(*args, **kwargs):
        a = load(*args, **kwargs)
        assert isinstance(a, np.memmap) and kwargs.get("mmap_mode") == "r"  # never read whole
        maps.append(a)
        _Spy.root = a.view(_Spy)
        return _Spy.root

    monkeypatch.setattr(np, "load", spy_load)
    _Spy.keys = []
    window = Rect((1, 3), (2, 4), (3, 6))
    data.read(0, window)
    want = (slice(1, 3), slice(2, 4), slice(3, 6))
    assert _Spy.keys == [want if channels == 1 else (slice(None), *want)], _Spy.keys
    assert len(maps) == 1


def _count_reads(monkeypatch) -> list[int]:
    """Bytes of every read nibabel makes from a file from now on."""
    from nibabel import openers

    got: list[int] = []
    read, readinto = openers.Opener.read, openers.Opener.readinto

    def counted_read(self, *args):
        out = read(self, *args)
        got.append(len(out))
        return out

    def counted_readinto(self, buf):
        n = readinto(self, buf)
        got.append(n)
        return n

    monkeypatch.setattr(openers.Opener, "read", counted_read)
    monkeypatch.setattr(openers.Opener, "readinto", counted_readinto)
    return got


def test_uncompressed_nifti_window_reads_only_the_window_bytes(tmp_path, monkeypatch):
    """A 32^3 float32 volume (128 KiB): a window of whole rows reads exactly its bytes (plus
    the header, read by nib.load); a window of partial rows reads at most its rows, far less
    than the file."""
    n = 32
    xyz = np.arange(n ** 3, dtype=np.float32).reshape(n, n, n)
    (tmp_path / "a").mkdir()
    path = tmp_path / "a" / "v.nii"
    save_nifti(path, xyz)
    data = ImageFolder.scan(tmp_path, (n, n, n), 1)
    got = _count_reads(monkeypatch)
    nib.load(path)
    header = sum(got)
    assert 0 < header < 2048
    got.clear()
    rows = Rect((8, 16), (4, 12), (0, n))  # depth 8, rows 8, every column (x)
    t = data.read(0, rows)
    assert torch.equal(t[0], torch.from_numpy(xyz.T[8:16, 4:12, :]))
    assert sum(got) - header == rows.size * 4  # 8 KiB of a 128 KiB file
    got.clear()
    box = Rect((8, 16), (4, 12), (8, 16))  # partial rows: nibabel may read across short gaps
    t = data.read(0, box)
    assert torch.equal(t[0], torch.from_numpy(xyz.T[8:16, 4:12, 8:16]))
    assert box.size * 4 <= sum(got) - header <= rows.size * 4
    assert sum(got) < path.stat().st_size / 8


# -- header checks -----------------------------------------------------------------------------
def test_scan_reads_headers_only(tmp_path):
    """A NIfTI cut short after its header passes the scan (which reads only headers); reading
    it then fails with a DataError naming the file."""
    path = write(tmp_path, "nii", volume(1))
    path.write_bytes(path.read_bytes()[:400])
    data = ImageFolder.scan(tmp_path, (D, H, W), 1)
    with pytest.raises(DataError, match=r"v.nii: cannot read the window .* replace the file"):
        data.read(0, Rect((0, D), (0, H), (0, 2)))


@pytest.mark.parametrize("fmt", ["npy", "nii", "nii.gz"])
def test_wrong_size_and_channels_are_named(tmp_path, fmt):
    write(tmp_path, fmt, volume())
    with pytest.raises(DataError, match=rf"v.{fmt}: volume is {D}x{H}x{W} \(DxHxW\) but "
                       rf"--image-size is {D}x{H}x{H}: every volume must be {D}x{H}x{H}"):
        ImageFolder.scan(tmp_path, (D, H, H), C)
    with pytest.raises(DataError, match=rf"v.{fmt}: volume has {C} channel\(s\) but the model "
                       r"takes 3 \(--channels\)"):
        ImageFolder.scan(tmp_path, (D, H, W), 3)
    with pytest.raises(DataError, match="volume is .* but --image-size is 6: every volume "
                       "must be 6x6x6"):
        ImageFolder.scan(tmp_path, 6, C, ndim=3)


@pytest.mark.parametrize("name, content, match", [
    ("v.nii", b"not a nifti file" * 40, r"v.nii: not a readable NIfTI file"),
    ("v.nii.gz", b"not gzip" * 40, r"v.nii.gz: not a readable NIfTI file"),
    ("v.npy", b"not numpy" * 40, r"v.npy: not a readable .npy array"),
])
def test_unreadable_files_are_named(tmp_path, name, content, match):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / name).write_bytes(content)
    with pytest.raises(DataError, match=match):
        ImageFolder.scan(tmp_path, (D, H, W), 1)


def test_images_and_volumes_are_not_mixed_up(tmp_path):
    write(tmp_path, "nii", volume(1))
    with pytest.raises(DataError, match=rf"a NIfTI volume of {D}x{H}x{W} .* give --image-size "
                       rf"{D}x{H}x{W} \(DxHxW\)"):
        ImageFolder.scan(tmp_path, (H, W), 1)
    np.save(tmp_path / "a" / "w.npy", volume())
    (tmp_path / "a" / "v.nii").unlink()
    with pytest.raises(DataError, match=r"expected \(C, H, W\) or \(H, W\) \(a volume\? give "
                       r"--image-size DxHxW\)"):
        ImageFolder.scan(tmp_path, (H, W), 1)
    Image.fromarray(np.zeros((H, W), dtype=np.uint8)).save(tmp_path / "a" / "p.png")
    (tmp_path / "a" / "w.npy").unlink()
    with pytest.raises(DataError, match=r"p.png: a .png file is a 2-D image but --image-size "
                       r"5x6x7 asks for volumes"):
        ImageFolder.scan(tmp_path, (D, H, W), 1)
    (tmp_path / "a" / "p.png").unlink()
    (tmp_path / "a" / "notes.gz").write_bytes(b"")  # not .nii.gz: not a sample
    with pytest.raises(DataError, match=r"hold no images .* or volumes \(.npy, .nii, .nii.gz\)"):
        ImageFolder.scan(tmp_path, (D, H, W), 1)


def test_a_window_of_another_rank_count_is_refused(tmp_path):
    write(tmp_path, "npy", volume())
    data = ImageFolder.scan(tmp_path, (D, H, W), C)
    with pytest.raises(ValueError, match="a 2-D window .* of volumes of size 5x6x7"):
        data.read(0, Rect((0, 2), (0, 2)))


# -- sizes -------------------------------------------------------------------------------------
def test_sizes():
    assert spatial_size(8) == (8, 8) and spatial_size(8, 3) == (8, 8, 8)
    assert spatial_size((4, 8, 8)) == (4, 8, 8) and spatial_size([3, 5]) == (3, 5)
    assert parse_size("4x8x16") == (4, 8, 16) and parse_size(" 32 ") == (32,)
    for bad in ("8x", "0x8", "axb", "1x2x3x4", ""):
        with pytest.raises(DataError, match=f"--image-size {bad}: give N, HxW or DxHxW"):
            parse_size(bad)
    with pytest.raises(DataError, match="has 2 dims but 3 were asked for: give DxHxW"):
        spatial_size((4, 4), 3)


# -- synthetic volumes -------------------------------------------------------------------------
def test_synthetic_volume_windows_agree_with_the_whole():
    shape = (2, 3, 5, 6, 7)
    whole, y = whole_batch(Synthetic(shape, 4, torch.float64, seed=3), 0, shape)
    assert whole.shape == shape and 0.7 < whole.std() < 1.3 and y.max() < 4
    for window in WINDOWS[1:]:
        part, y2 = Synthetic(shape, 4, torch.float64, seed=3).batch(7, window)
        d, h, w = (slice(*iv) for iv in window.dims)
        assert torch.equal(part[:, :, d, h, w], whole[:, :, d, h, w]) and torch.equal(y, y2)
    # every row of every depth has its own generator: no two rows alike
    rows = whole.reshape(-1, 7)
    assert len({tuple(r.tolist()) for r in rows}) == rows.shape[0]
    other, _ = whole_batch(Synthetic(shape, 4, torch.float64, seed=4), 0, shape)
    assert not torch.equal(other, whole)
    assert Synthetic(shape, 4).batch(0, None)[0] is None
    with pytest.raises(ValueError, match="a 2-D window"):
        Synthetic(shape, 4).batch(0, Rect((0, 1), (0, 1)))


def test_synthetic_images_are_what_they_always_were():
    """The 2-D generator seeding is unchanged: values recorded before volumes were added."""
    x, y = whole_batch(Synthetic((2, 3, 12, 10), 4, torch.float64, seed=7), 0, (2, 3, 12, 10))
    assert x.sum().item() == pytest.approx(9.455940608519697, abs=1e-12)
    assert x[1, 2, 5, 4].item() == -0.6796997854863779
    assert x[0, 0, 0, 0].item() == -0.028617495085966328 and y.tolist() == [3, 0]
    x, y = whole_batch(Synthetic((1, 1, 5, 6), 3), 0, (1, 1, 5, 6))
    assert x.flatten()[:4].tolist() == [1.5409960746765137, -0.293428897857666,
                                        -2.1787893772125244, 0.5684312582015991]


# -- input windows -----------------------------------------------------------------------------
def test_input_window_of_a_program_without_recorded_windows_is_the_whole_volume():
    def rp(source):
        graph = SimpleNamespace(inputs=[[SimpleNamespace(source=source)]])
        return SimpleNamespace(program=SimpleNamespace(input_windows=None, graph=graph),
                               stages=[(0, 0)], rank=0)

    assert input_window(rp("batch"), image=(4, 8, 8)) == Rect((0, 4), (0, 8), (0, 8))
    assert input_window(rp("batch"), image=(8, 8)) == Rect((0, 8), (0, 8))
    assert input_window(rp("stage"), image=(4, 8, 8)) is None
    with pytest.raises(ValueError, match=r"pass input_window\(image=\(H, W\)\), or \(D, H, W\)"):
        input_window(rp("batch"))


# -- fxpar-run ---------------------------------------------------------------------------------
def test_cli_image_size_and_grid_flags():
    a = run.parser().parse_args(["models:unet", "--image-size", "8x16x16", "--grid", "2x2x2",
                                 "--slice", "cube"])
    assert a.image_size == (8, 16, 16) and a.grid == (2, 2, 2)
    plan = run.plan_from_args(a)
    assert plan == fxpar.Plan(grid=(2, 2, 2), slice="cube") and plan.spatial_parts == 8
    assert run.input_size(a) == (8, 16, 16)
    a = run.parser().parse_args(["models:unet", "--image-size", "64"])
    assert a.image_size == 64 and run.input_size(a) == (64, 64) and a.grid is None
    a = run.parser().parse_args(["models:unet", "--image-size", "16", "--grid", "2x1x2"])
    assert run.input_size(a) == (16, 16, 16)  # an int with a 3-D grid: a cube
    a = run.parser().parse_args(["models:unet", "--image-size", "32x48", "--grid", "2x4",
                                 "--spatial-parts", "8"])
    assert run.input_size(a) == (32, 48) and run.plan_from_args(a).tile_grid(2) == (2, 4)
    assert run.input_size(run.parser().parse_args(["models:unet"])) == (256, 256)
    a = run.parser().parse_args(["models:unet", "--image-size", "32x48", "--grid", "2x2x2"])
    with pytest.raises(DataError, match=r"--grid 2x2x2 splits 3 spatial dims but --image-size "
                       r"32x48 is an image \(HxW\)"):
        run.input_size(a)


@pytest.mark.parametrize("argv, message", [
    (["--image-size", "8x"], "argument --image-size: --image-size 8x: give N, HxW or DxHxW"),
    (["--grid", "4"], "--grid 4: give tiles per spatial dim, HxW or DxHxW (e.g. --grid 1x4); "
                      "for 4 tiles cut by --slice use --spatial-parts 4"),
    (["--grid", "2x0"], "--grid 2x0: give N, HxW or DxHxW with integers >= 1 (e.g. --grid 2x4"),
])
def test_cli_bad_sizes_are_usage_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        run.parser().parse_args(["models:unet", *argv])
    assert e.value.code == 2 and message in capsys.readouterr().err


def _net3d_file(tmp_path: Path) -> Path:
    f = tmp_path / "net3d.py"
    f.write_text("import torch.nn as nn\n"
                 "def make(num_classes=3):\n"
                 "    return nn.Sequential(nn.Conv3d(1, 4, 3, padding=1), nn.BatchNorm3d(4),\n"
                 "                         nn.ReLU(), nn.AdaptiveAvgPool3d(1), nn.Flatten(),\n"
                 "                         nn.Linear(4, num_classes))\n")
    return f


def _volume_job(tmp_path: Path) -> list[str]:
    """A NIfTI folder of 4 volumes (.nii and .nii.gz) and fxpar-run's flags to train on it."""
    for i in range(4):
        write(tmp_path / "data", "nii.gz" if i % 2 else "nii", volume(1, seed=i), name=str(i),
              cls="ab"[i // 2])
    net = _net3d_file(tmp_path)
    return [f"{net}:make", "--image-size", f"{D}x{H}x{W}", "--channels", "1", "--batch-size",
            "2", "--num-classes", "2", "--data", str(tmp_path / "data"), "--epochs", "1",
            "--device", "cpu"]


def test_cli_trains_on_a_nifti_folder_and_saves_its_input_shape(tmp_path, capsys):
    """One process: --image-size DxHxW with a NIfTI folder; the saved program.json records the
    5-D input shape, and a saved program refuses another --image-size."""
    argv = _volume_job(tmp_path)
    assert run.main(argv) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert f"2x1x{D}x{H}x{W} float32 on 1 rank(s)" in out
    assert f"data: {tmp_path / 'data'} (4 volumes, 2 classes, 2 steps per epoch)" in out
    assert len([line for line in out.splitlines() if line.startswith("step ")]) == 2
    prog = tmp_path / "prog"
    assert run.main([*argv, "--save-program", str(prog)]) == 0
    assert json.loads((prog / "program.json").read_text())["input_shape"] == [2, 1, D, H, W]
    capsys.readouterr()
    assert run.main([str(prog), "--image-size", "8", "--device", "cpu"]) == 2
    assert (f"was compiled for inputs of 2x1x{D}x{H}x{W} (N x C x D x H x W), not "
            f"--image-size 8x8x8: drop --image-size") in capsys.readouterr().err


def test_cli_runs_a_saved_volume_program(tmp_path, capsys):
    """The saved program of a volume model trains on the folder without --image-size (its
    program.json gives the shape, and each rank's 3-D input window)."""
    argv = _volume_job(tmp_path)
    prog = tmp_path / "prog"
    assert run.main([*argv, "--save-program", str(prog)]) == 0
    windows = json.loads((prog / "program.json").read_text())["input_windows"]
    assert windows is not None and all(len(w) == 3 for w in windows), windows  # D, H, W
    capsys.readouterr()
    assert run.main([str(prog), "--data", str(tmp_path / "data"), "--steps", "1",
                     "--device", "cpu"]) == 0, capsys.readouterr().err
    assert f"2x1x{D}x{H}x{W}" in capsys.readouterr().out


def test_cli_rejects_a_grid_of_other_dims_than_the_input(capsys):
    assert run.main(["models:unet", "--image-size", "32x32", "--grid", "2x2x2"]) == 2
    assert "--grid 2x2x2 splits 3 spatial dims" in capsys.readouterr().err


def test_namespace_defaults_survive_without_grid():
    """Namespaces built by hand (tools, older callers) have no ``grid``: still an image."""
    a = argparse.Namespace(image_size=None)
    assert run.input_size(a) == (256, 256)
