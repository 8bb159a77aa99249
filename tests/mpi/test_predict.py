"""Region-by-region inference (fxpar.predict, fxpar-predict): the margins and step the graph
gives, the region / crop arithmetic, exactness in one process (class maps, volumes), resuming,
the TIFF output and clear errors; under mpiexec (tests/mpi/cases/predict_cases.py, one launch of 4
ranks) spatial, data-parallel and layer plans, a library U-Net and the CLI equal the whole
image. A margin one step short is caught."""

import math
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from fractions import Fraction

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers.launch import Batch, cases_in, check
from torch import nn

import fxpar
from fxpar.cli.predict import main as fxpar_predict
from fxpar.compiler import predict as predict_mod
from fxpar.compiler.driver import predict
from fxpar.compiler.predict import ArrayImage
from fxpar.compiler.receptive import Reach, ReachError, reach, reach_model
from fxpar.core.geometry import Rect
from fxpar.data.errors import DataError
from fxpar.data.regions import region_grid
from fxpar.data.writers import PredictionStore
from fxpar.testing import load_case, mpiexec

CASES, _ = cases_in("predict_cases.py")
HERE = CASES[0].split("::")[0]
small_unet, odd_net, SqueezeExcite, AlignCorners = (
    load_case(f"{HERE}::{name}") for name in ("small_unet", "odd_net", "SqueezeExcite",
                                               "AlignCorners"))


BATCH = Batch(CASES, n=4, timeout=600)


@pytest.fixture(scope="module")
def results():
    return BATCH.results()


@pytest.mark.mpi
@pytest.mark.parametrize("case", CASES, ids=[c.split("::")[1] for c in CASES])
def test_predict_under_mpiexec(results, case):
    check(results, case)


def _whole(model, x):
    with torch.no_grad():
        return model.eval()(x[None])[0]


def _x(*shape, seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed),
                       dtype=torch.float64)


# -- margins, step, scale -----------------------------------------------------------------------
def test_reach_of_a_small_net_is_its_hand_computed_receptive_field():
    # conv 3x3 (1) -> pool 2 -> conv 3x3 (1 cell at half resolution = 2) -> nearest x2: an
    # even output row 2a reads input rows 2a - 3 .. 2a + 4 (both rows of the pooled pair)
    m = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.MaxPool2d(2),
                      nn.Conv2d(4, 4, 3, padding=1), nn.Upsample(scale_factor=2),
                      nn.Conv2d(4, 2, 1))
    r = reach(fxpar.trace(m, (1, 3, 64, 64)))
    assert r == Reach((64, 64), (64, 64), (2, 2), (Fraction(1), Fraction(1)), (3, 3), (3, 3))


def test_reach_of_a_strided_class_map_and_a_library_unet():
    m = nn.Sequential(nn.Conv2d(3, 4, 3, stride=2, padding=1), nn.ReLU(),
                      nn.Conv2d(4, 5, 5, stride=2, padding=2))
    r = reach(fxpar.trace(m, (1, 3, 64, 96)))
    assert r.step == (4, 4) and r.scale == (Fraction(1, 4),) * 2 and r.out == (16, 24)
    # output row o reads layer-1 rows 2o-2..2o+2, i.e. input rows 4o-5..4o+5
    assert r.before == (5, 5) and r.after == (2, 2)
    import segmentation_models_pytorch as smp

    unet = smp.Unet("resnet18", encoder_weights=None, classes=2)
    r = reach_model(unet, 3, (512, 512))  # analysed on a larger probe: margins exceed 512/2
    assert r.step == (32, 32) and r.scale == (Fraction(1), Fraction(1))
    assert 200 < r.before[0] < 400 and 200 < r.after[0] < 400


@pytest.mark.parametrize("body, names", [
    (nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.GroupNorm(2, 4)), "per-sample"),
    (nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.InstanceNorm2d(4)), "per-sample"),
    (nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                   nn.Linear(4, 2)), "no spatial dims"),
])
def test_models_that_are_not_local_are_refused_with_the_reason(body, names):
    with pytest.raises(ReachError, match=names):
        reach_model(body, 3, (64, 64))


def test_global_means_and_size_dependent_interpolation_are_refused():
    with pytest.raises(ReachError, match="whole image"):
        reach_model(SqueezeExcite(), 3, (64, 64))
    with pytest.raises(ReachError, match="align_corners"):
        predict(AlignCorners().double(), fxpar.Plan(), _x(3, 64, 64), region=16,
                dtype=torch.float64, progress=False)


# -- regions and crops --------------------------------------------------------------------------
@pytest.mark.parametrize("image, region, step, before, after", [
    ((100, 203), 32, (4, 4), (7, 7), (5, 5)), ((64, 64), 16, (2, 2), (3, 3), (3, 3)),
    ((37, 50, 41), 8, (2, 2, 2), (3, 4, 5), (2, 2, 2)), ((30, 30), 64, (8, 8), (9, 9), (9, 9))])
def test_regions_tile_the_image_and_crops_hold_their_margins(image, region, step, before, after):
    grid = region_grid(image, region, step, (Fraction(1),) * len(image), before, after, image)
    seen = np.zeros(image, dtype=int)
    for r in grid.regions():
        seen[tuple(slice(a, b) for a, b in r.box.dims)] += 1
        for i, ((r0, r1), (c0, c1)) in enumerate(zip(r.box.dims, r.crop.dims, strict=True)):
            assert c0 % step[i] == 0  # the sampling grids of strided layers line up
            assert c0 == 0 or c0 <= r0 - before[i]
            assert c1 == image[i] or c1 >= r1 + after[i]
        assert r.keep.shape == r.out.shape == r.box.shape
    assert (seen == 1).all()
    assert len(grid.shapes()) <= 2 ** len(image)


def test_a_class_map_region_keeps_its_cells():
    grid = region_grid((64, 100), 16, (4, 4), (Fraction(1, 4),) * 2, (5, 5), (2, 2), (16, 25))
    cells = sum(r.out.size for r in grid.regions())
    assert cells == 16 * 25
    assert max(r.out.dims[1][1] for r in grid.regions()) == 25


# -- exactness in one process -------------------------------------------------------------------
def test_class_map_and_odd_sizes_equal_the_whole_image():
    m = nn.Sequential(nn.Conv2d(3, 4, 3, stride=2, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
                      nn.Conv2d(4, 5, 5, stride=2, padding=2)).double().eval()
    x = _x(3, 101, 77)
    got = predict(m, fxpar.Plan(), x, region=16, dtype=torch.float64, progress=False)
    ref = _whole(m, x)
    assert got.output.shape == tuple(ref.shape)
    assert np.abs(got.output - ref.numpy()).max() < 1e-12
    assert got.regions == math.ceil(101 / 16) * math.ceil(77 / 16)


def test_volume_equals_the_whole_volume():
    m = nn.Sequential(nn.Conv3d(2, 4, 3, padding=1), nn.ReLU(), nn.MaxPool3d(2),
                      nn.Conv3d(4, 4, 3, padding=1), nn.ConvTranspose3d(4, 3, 2, stride=2)
                      ).double().eval()
    x = _x(2, 24, 40, 36)
    got = predict(m, fxpar.Plan(), x, region=8, dtype=torch.float64, progress=False)
    assert np.abs(got.output - _whole(m, x).numpy()).max() < 1e-12
    assert got.regions == 3 * 5 * 5


class Islands(nn.Module):
    """Per-pixel blocks in other layouts: a ConvNeXt block (channels-last LayerNorm and
    Linear), an FPN merge (torch.stack of same-shape maps, then a sum), in-place Dropout2d."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.dw = nn.Conv2d(8, 8, 7, padding=3, groups=8)
        self.norm = nn.LayerNorm(8)
        self.fc = nn.Linear(8, 8)
        self.down = nn.Conv2d(8, 8, 3, stride=2, padding=1)
        self.drop = nn.Dropout2d(0.2, inplace=True)
        self.head = nn.Conv2d(8, 2, 1)

    def forward(self, x):
        x = self.conv(x)
        y = self.fc(self.norm(self.dw(x).permute(0, 2, 3, 1))).permute(0, 3, 1, 2) + x
        up = F.interpolate(self.down(y), scale_factor=2, mode="nearest")
        merged = torch.stack([y, up]).sum(0)
        return self.head(self.drop(merged))


def test_islands_and_inplace_dropout_equal_the_whole_image():
    m = Islands().double().eval()
    x = _x(3, 60, 84, seed=7)
    r = reach_model(m, 3, (60, 84))
    assert r.step == (2, 2) and r.before[0] >= 5  # the 3x3 and the 7x7 at least
    got = predict(m, fxpar.Plan(), x, region=16, dtype=torch.float64, progress=False)
    assert np.abs(got.output - _whole(m, x).numpy()).max() < 1e-12


def test_one_region_as_large_as_the_image_takes_any_model():
    """Global means and norms over the image cannot be cut into regions, but one region that
    is the whole image is exact (the compiled plan still splits it over the ranks)."""
    m = nn.Sequential(SqueezeExcite(), nn.GroupNorm(2, 4), nn.Conv2d(4, 2, 1)).double().eval()
    x = _x(3, 40, 48, seed=8)
    got = predict(m, fxpar.Plan(), x, region=64, dtype=torch.float64, progress=False)
    assert got.regions == 1 and got.shapes == [(40, 48)]
    assert np.abs(got.output - _whole(m, x).numpy()).max() < 1e-12


def test_a_margin_one_step_short_is_caught(monkeypatch):
    """The harness: with a margin one step too small (less is absorbed by aligning the crops
    to the step), the coverage check says so; skipping that check, the output differs from
    the whole image."""
    m = odd_net()
    x = _x(3, 48, 64, seed=3)
    real = predict_mod.reach_model

    def short(*args, **kwargs):
        r = real(*args, **kwargs)
        short = tuple(b - s for b, s in zip(r.before, r.step, strict=True))
        return Reach(r.image, r.out, r.step, r.scale, short, r.after)

    monkeypatch.setattr(predict_mod, "reach_model", short)
    with pytest.raises(ReachError, match="margins are wrong"):
        predict(m, fxpar.Plan(), x, region=16, dtype=torch.float64, progress=False)
    monkeypatch.setattr(predict_mod, "_check_covered", lambda *a: None)
    got = predict(m, fxpar.Plan(), x, region=16, dtype=torch.float64, progress=False)
    assert np.abs(got.output - _whole(m, x).numpy()).max() > 1e-6


# -- output: Zarr, resume, TIFF -----------------------------------------------------------------
def test_an_interrupted_run_resumes_and_equals_an_uninterrupted_one(tmp_path, monkeypatch):
    import zarr

    m = small_unet()
    x = _x(3, 64, 96, seed=4)
    out = tmp_path / "mask.zarr"
    real = PredictionStore.write
    calls = []

    def crash(self, index, box, values):
        if len(calls) == 5:
            raise KeyboardInterrupt
        calls.append(index)
        real(self, index, box, values)

    monkeypatch.setattr(PredictionStore, "write", crash)
    with pytest.raises(KeyboardInterrupt):
        predict(m, fxpar.Plan(), x, out, region=16, output="argmax", dtype=torch.float64,
                progress=False)
    monkeypatch.setattr(PredictionStore, "write", real)
    got = predict(m, fxpar.Plan(), x, out, region=16, output="argmax", dtype=torch.float64,
                  progress=False)
    assert got.skipped == 5 and got.regions == 24
    want = _whole(m, x).argmax(0, keepdim=True).numpy().astype(np.uint8)
    assert (np.asarray(zarr.open_array(str(out))[:]) == want).all()
    with pytest.raises(DataError, match="other settings"):
        predict(m, fxpar.Plan(), x, out, region=32, output="argmax", dtype=torch.float64,
                progress=False)
    done = predict(m, fxpar.Plan(), x, out, region=16, output="argmax", dtype=torch.float64,
                   progress=False)
    assert done.skipped == 24


def test_softmax_to_a_tiled_tiff_and_reads_stay_in_crops(tmp_path):
    import tifffile

    m = small_unet()
    x = _x(3, 80, 300, seed=5)
    image = ArrayImage(x)
    got = predict(m, fxpar.Plan(), image, tmp_path / "p.tif", region=32, output="softmax",
                  dtype=torch.float64, progress=False)
    with tifffile.TiffFile(got.output) as tif:
        assert tif.pages[0].is_tiled
        probs = tif.asarray()
    want = torch.softmax(_whole(m, x), 0).float().numpy()
    assert probs.shape == want.shape and np.abs(probs - want).max() < 1e-6
    assert not (tmp_path / "p.tif.partial.zarr").exists()
    assert all(any(w.intersect(r.crop) == w for r in got.grid.regions()) for w in image.reads)
    assert max(w.size for w in image.reads) < 80 * 300 / 2


# -- the command line: errors before anything runs ---------------------------------------------
def test_cli_errors_say_what_to_change(tmp_path, capsys):
    np.save(tmp_path / "img.npy", np.zeros((3, 32, 32), np.float32))
    model = f"{CASES[0].split('::')[0]}:small_unet"
    img = str(tmp_path / "img.npy")
    assert fxpar_predict([model, img, str(tmp_path / "o.png")]) == 2
    assert "write a .zarr array or a .tif" in capsys.readouterr().err
    torch.save({"nope": torch.zeros(1)}, tmp_path / "w.pt")
    assert fxpar_predict([model, img, str(tmp_path / "o.zarr"), "--weights",
                          str(tmp_path / "w.pt")]) == 2
    assert "the weights do not fit" in capsys.readouterr().err
    assert fxpar_predict([model, img, str(tmp_path / "o.zarr"), "--data-parallel", "2",
                          "--batch", "3"]) == 2
    assert "multiple" in capsys.readouterr().err
    assert fxpar_predict([model, str(tmp_path / "none.tif"), str(tmp_path / "o.zarr")]) == 2
    assert "no such file" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert fxpar_predict([model, img, str(tmp_path / "o.zarr"), "--device", "cuda"]) == 2
        assert "use --device cpu or auto" in capsys.readouterr().err


def test_cli_one_process_writes_the_exact_map(tmp_path, capsys):
    import zarr

    x = _x(3, 40, 56, seed=6).float()
    np.save(tmp_path / "img.npy", x.numpy())
    model = f"{CASES[0].split('::')[0]}:small_unet"
    assert fxpar_predict([model, str(tmp_path / "img.npy"), str(tmp_path / "o.zarr"),
                          "--region", "16", "--output", "logits", "--dtype", "float64",
                          "--device", "cpu"]) == 0
    printed = capsys.readouterr()
    assert "regions 16x16: 12 in a 3x4 grid" in printed.out
    assert "predict [####################] 12/12 regions 100%" in printed.err
    got = np.asarray(zarr.open_array(str(tmp_path / "o.zarr"))[:])
    assert np.abs(got - _whole(small_unet(), x.double()).numpy()).max() < 1e-12
    assert Rect.whole((40, 56)).size == 40 * 56


def test_geotiff_at_a_pyramid_level_keeps_its_georeference(tmp_path):
    """Level 1 of a GeoTIFF pyramid: the output's pixel scale is the level's (twice level
    0's), the tie point and geo keys are the input's, and the map equals the model on the
    level-1 image."""
    import tifffile

    rng = np.random.default_rng(9)
    levels = [rng.integers(0, 255, (64 >> k, 96 >> k, 3), dtype=np.uint8) for k in range(2)]
    geo = [(33550, "d", 3, (0.5, 0.5, 0.0), True),
           (33922, "d", 6, (0.0, 0.0, 0.0, 500000.0, 4100000.0, 0.0), True),
           (34735, "H", 8, (1, 1, 0, 1, 1024, 0, 1, 1), True)]
    with tifffile.TiffWriter(tmp_path / "scene.tif") as tw:
        tw.write(levels[0], tile=(16, 16), photometric="rgb", subifds=1, extratags=geo)
        tw.write(levels[1], tile=(16, 16), photometric="rgb", subfiletype=1)
    model = f"{CASES[0].split('::')[0]}:small_unet"
    assert fxpar_predict([model, str(tmp_path / "scene.tif"), str(tmp_path / "m.tif"),
                          "--level", "1", "--region", "16", "--dtype", "float64",
                          "--no-progress"]) == 0
    with tifffile.TiffFile(tmp_path / "m.tif") as tif:
        tags = tif.pages[0].tags
        assert tuple(tags[33550].value) == (1.0, 1.0, 0.0)
        assert tuple(tags[33922].value) == (0.0, 0.0, 0.0, 500000.0, 4100000.0, 0.0)
        assert tuple(tags[34735].value)[:4] == (1, 1, 0, 1)
        got = tif.asarray()
    x = torch.from_numpy(levels[1].transpose(2, 0, 1).astype(np.float64) / 255)
    want = _whole(small_unet(), x).argmax(0).numpy()
    assert got.shape == (32, 48) and (got == want).all()


# -- a failing reader or writer thread under mpiexec ends the whole job ---------------------------
HELPER_JOB = """
import sys
import torch
from torch import nn
import fxpar
from fxpar.comm.world import world
from fxpar.compiler.predict import ArrayImage
from fxpar.data.writers import PredictionStore

mode, out = sys.argv[1:]
rank = world().rank


class Image(ArrayImage):
    def read(self, window):
        if mode == "reader" and rank == 1 and len(self.reads) == 2:
            raise OSError("rank 1 cannot read its window")
        return super().read(window)


real = PredictionStore.write


def write(self, index, box, values):
    if mode == "writer" and len(self.done) == 2:
        raise OSError("no space left on device")
    real(self, index, box, values)


PredictionStore.write = write
torch.manual_seed(0)
model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 2, 3, padding=1))
fxpar.predict(model, fxpar.Plan(spatial_parts=2), Image(torch.rand(3, 64, 64)), out,
              region=16, progress=False)
print(f"rank {rank} returned")
"""


@pytest.mark.mpi
def test_a_failing_reader_or_writer_thread_ends_the_whole_job(tmp_path):
    """Rank 1's reader raises on its 3rd window (rank 0 would wait for its halo); the writing
    rank 0's writer raises on its 3rd region: each ends both ranks through fail-fast, with
    the failing rank's traceback naming the thread, long before the harness's timeout."""
    job = tmp_path / "job.py"
    job.write_text(HELPER_JOB)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}

    def launch(mode: str) -> subprocess.CompletedProcess:
        return subprocess.run([mpiexec(), "-n", "2", sys.executable, str(job), mode,
                               str(tmp_path / f"{mode}.zarr")], capture_output=True, text=True,
                              env=env, timeout=240)

    with ThreadPoolExecutor(2) as pool:
        reader, writer = pool.map(launch, ("reader", "writer"))
    for ran, rank, error, thread in ((reader, 1, "rank 1 cannot read its window", "reader"),
                                     (writer, 0, "no space left on device", "writer")):
        out = ran.stdout + ran.stderr
        assert ran.returncode != 0 and "returned" not in out, out[-3000:]
        assert f"fxpar: rank {rank} of 2 failed; ending the whole job" in out, out[-3000:]
        assert f"OSError: {error}" in out and f"fxpar-predict's {thread} thread" in out
