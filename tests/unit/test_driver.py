"""fxpar-run's pieces without MPI: flags and MPI4DL aliases, image-folder data and window reads,
synthetic data, input windows, runtime timing and the metrics file. (The driver under mpiexec:
tests/mpi/cases/driver_cases.py.)"""

import json
import re
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

import fxpar
from fxpar.cli import run
from fxpar.core.geometry import Rect
from fxpar.core.schedule import Action
from fxpar.data.data import (
    DataError,
    FolderBatches,
    ImageFolder,
    Synthetic,
    epoch_order,
    whole_batch,
)
from fxpar.runtime.clock import ActionTime
from fxpar.testing import load_case
from fxpar.train.metrics import MetricsError, Recorder, gather, load_metrics, split_times, table

CASES = Path(__file__).parents[1] / "mpi" / "cases" / "driver_cases.py"
write_folder = load_case(f"{CASES}::write_folder")
tiny_net = load_case(f"{CASES}::tiny_net")
FULL = Rect((0, 20), (0, 20))


# -- flags --------------------------------------------------------------------------------------
def test_every_mpi4dl_flag_is_accepted_and_lands_in_the_plan_or_run():
    a = run.parser().parse_args([
        "models:amoebanet", "--split-size", "3", "--num-spatial-parts", "4", "--spatial-size",
        "2", "--parts", "2", "--slice-method", "vertical", "--gems", "--times", "2",
        "--local-DP", "2", "--balance", "5,6,7", "--image-size", "64", "--batch-size", "32",
        "--num-classes", "7", "--num-layers", "2", "--num-filters", "8"])
    plan = run.plan_from_args(a)
    assert plan == fxpar.Plan(stages=3, spatial_parts=4, spatial_stages=2, microbatches=2,
                              slice="vertical", gems=True, gems_times=2, data_parallel=2,
                              balance=(5, 6, 7))
    assert (a.image_size, a.batch_size, a.num_classes, a.num_layers, a.num_filters) == \
        (64, 32, 7, 2, 8)


def test_compile_flag_lands_in_the_plan():
    a = run.parser().parse_args(["models:amoebanet", "--compile", "--spatial-parts", "2"])
    assert run.plan_from_args(a) == fxpar.Plan(spatial_parts=2, compile=True)


def test_compile_with_checkpoint_segments_warns_and_runs_eagerly():
    from fxpar.runtime.inductor import compiled_stages

    stages = {(0, 0): torch.fx.symbolic_trace(torch.nn.ReLU())}
    assert compiled_stages(False, 1, stages) is None
    with pytest.warns(UserWarning, match="checkpoint segments run eagerly"):
        assert compiled_stages(True, 2, stages) is None
    assert set(compiled_stages(True, 1, stages).calls) == {(0, 0)}
    with pytest.warns(UserWarning, match="spatial stages run eagerly"):
        assert compiled_stages(True, 1, {**stages, (0, 1): stages[(0, 0)]}, 1).calls.keys() \
            == {(0, 1)}


def test_plan_defaults_are_the_trivial_plan():
    assert run.plan_from_args(run.parser().parse_args(["models:amoebanet"])) == fxpar.Plan()


@pytest.mark.parametrize("argv, message", [
    (["--data", "/nonexistent/images"], "--data /nonexistent/images: no such folder"),
    (["--epochs", "2"], "--epochs needs --data DIR"),
    (["--parts", "3"], "batch size 8 does not split into 3 equal chunks"),
    (["--log-every", "0"], "--log-every must be >= 1"),
    (["--checkpoint-every", "2"], "--checkpoint-every K needs --checkpoint DIR"),
    (["--resume", "/nonexistent/ckpt"], "not a (complete) fxpar checkpoint"),
])
def test_user_errors_exit_2_before_anything_runs(capsys, argv, message):
    assert run.main(["models:resnet_v2", "-k", "depth=8", "--image-size", "32", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fxpar-run: error: ") and message in err, err


def test_data_errors_name_the_file_and_the_fix(tmp_path, capsys):
    write_folder(tmp_path / "ok")
    base = ["models:resnet_v2", "-k", "depth=8", "--image-size", "20", "--batch-size", "2",
            "--data"]
    assert run.main([*base, str(tmp_path / "ok"), "--image-size", "24"]) == 2
    err = capsys.readouterr().err
    assert "cat/0.npy: image is 20x20 (HxW) but --image-size is 24" in err
    assert run.main([*base, str(tmp_path / "ok"), "--steps", "3", "--epochs", "1"]) == 2
    assert "give --steps or --epochs, not both" in capsys.readouterr().err
    assert run.main([*base, str(tmp_path / "ok"), "--num-classes", "2"]) == 2
    assert "has 3 classes but the model has --num-classes 2" in capsys.readouterr().err
    assert run.main([*base, str(tmp_path / "ok"), "--batch-size", "8"]) == 2
    assert "has 6 images, fewer than one batch of 8" in capsys.readouterr().err
    (tmp_path / "empty" / "a").mkdir(parents=True)
    assert run.main([*base, str(tmp_path / "empty")]) == 2
    assert "hold no images" in capsys.readouterr().err
    (tmp_path / "flat").mkdir()
    assert run.main([*base, str(tmp_path / "flat")]) == 2
    assert "has no class folders" in capsys.readouterr().err


def test_epochs_set_the_step_count_and_progress_is_printed(tmp_path, capsys):
    write_folder(tmp_path)
    argv = [f"{CASES}:tiny_net", "--num-classes", "3", "--image-size", "20", "--batch-size",
            "2", "--data", str(tmp_path), "--epochs", "2", "--log-every", "2"]
    assert run.main(argv) == 0
    out = capsys.readouterr().out
    steps = [line for line in out.splitlines() if line.startswith("step ")]
    # 2 epochs x 6 images // 2 = 6 steps; lines at step 1 (warm-up), every 2nd, and the last
    assert [s.split()[1] for s in steps] == ["1/6", "2/6", "4/6", "6/6"]
    assert all("loss" in s and "img/s" in s for s in steps)
    assert "data: " + str(tmp_path) + " (6 images, 3 classes, 3 steps per epoch)" in out
    assert "rank  stage  tile" in out and out.splitlines()[-1].startswith("done: median")


# -- image folder -------------------------------------------------------------------------------
def test_image_folder_labels_formats_and_windows(tmp_path):
    write_folder(tmp_path)
    (tmp_path / "dog" / "notes.txt").write_text("not an image")
    data = ImageFolder.scan(tmp_path, 20, 3)
    assert data.classes == ["cat", "dog", "emu"]
    assert [(p.name, label) for p, label in data.samples] == [
        ("0.npy", 0), ("1.npy", 0), ("0.png", 1), ("1.png", 1), ("0.tif", 2), ("1.tif", 2)]
    window = Rect((3, 11), (5, 20))
    for i, (path, _) in enumerate(data.samples):
        whole = data.read(i, FULL, torch.float64)
        if path.suffix == ".npy":
            want = torch.from_numpy(np.load(path))
        else:  # uint8 pixels, (H, W, C) -> (C, H, W), scaled to [0, 1]
            want = torch.from_numpy(np.array(Image.open(path))).permute(2, 0, 1).double() / 255
        assert torch.equal(whole, want.double()), path
        assert torch.equal(data.read(i, window, torch.float64), whole[:, 3:11, 5:20])


def test_image_folder_gray_npy_jpeg_and_conversion(tmp_path):
    (tmp_path / "a").mkdir()
    np.save(tmp_path / "a" / "g.npy", np.arange(64, dtype=np.uint16).reshape(8, 8))
    Image.fromarray(np.full((8, 8, 3), 200, dtype=np.uint8)).save(tmp_path / "a" / "c.jpg")
    gray = ImageFolder.scan(tmp_path, 8, 1)  # the RGB JPEG is converted to one channel
    g = gray.read(1, Rect((0, 8), (2, 4)))
    assert g.shape == (1, 8, 2)
    assert torch.allclose(g, torch.arange(64.).view(8, 8)[:, 2:4] / 65535)
    assert gray.read(0, Rect((0, 8), (0, 8))).shape == (1, 8, 8)
    with pytest.raises(DataError, match=r"g.npy: image has 1 channel\(s\) but the model takes 3"):
        ImageFolder.scan(tmp_path, 8, 3)


def test_folder_batches_fill_only_the_window_and_reshuffle_each_epoch(tmp_path):
    data = ImageFolder.scan(write_folder(tmp_path), 20, 3)
    src = FolderBatches(data, 4, torch.float64, seed=1, fill=float("nan"))
    assert src.steps_per_epoch == 1
    orders = [epoch_order(6, e, 1) for e in range(3)]
    assert all(sorted(o) == list(range(6)) for o in orders) and orders[0] != orders[1]
    assert src.indices(0) == orders[0][:4] and src.indices(2) == orders[2][:4]
    window = Rect((0, 20), (5, 14))
    x, y = src.batch(1, window)
    assert x.shape == (4, 3, 20, 20) and y.tolist() == [data.label(i) for i in src.indices(1)]
    assert not x[..., 5:14].isnan().any()
    assert x[..., :5].isnan().all() and x[..., 14:].isnan().all()
    whole, _ = whole_batch(src, 1, x.shape)
    assert torch.equal(x[..., 5:14], whole[..., 5:14])
    assert src.batch(1, None)[0] is None


def test_synthetic_rows_agree_whatever_window_is_asked():
    src = Synthetic((2, 3, 12, 10), classes=4, dtype=torch.float64, seed=7)
    whole, y = whole_batch(src, 0, (2, 3, 12, 10))
    part, y2 = Synthetic((2, 3, 12, 10), 4, torch.float64, seed=7).batch(5, Rect((2, 9), (3, 8)))
    assert torch.equal(part[..., 2:9, 3:8], whole[..., 2:9, 3:8]) and torch.equal(y, y2)
    assert 0.5 < whole.std() < 1.5 and y.max() < 4
    other, _ = whole_batch(Synthetic((2, 3, 12, 10), 4, torch.float64, seed=8), 0, whole.shape)
    assert not torch.equal(other, whole)
    assert src.batch(0, None)[0] is None


def _status(key: str) -> int:
    """A memory figure of this process from /proc/self/status, in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def _reset_peak() -> bool:
    """Reset this process's peak resident size (Linux: ``5 > /proc/self/clear_refs``)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_a_window_of_a_large_npy_costs_about_the_window_in_memory(tmp_path):
    """One 8192 x 8192 float32 image (256 MiB) and a batch holding one rank's 1/16 strip plus a
    halo (16 MiB): the process's peak resident memory while the batch is built grows by about
    two strips (the mapped rows read, the batch's filled rows), far below one whole image,
    which a whole read would add at least once."""
    (tmp_path / "a").mkdir()
    arr = np.lib.format.open_memmap(tmp_path / "a" / "big.npy", mode="w+", dtype=np.float32,
                                    shape=(1, 8192, 8192))
    arr[0, ::64, :] = 1.0  # some rows with data, written through the map
    arr.flush()
    del arr
    data = ImageFolder.scan(tmp_path, 8192, 1)
    src = FolderBatches(data, 1, torch.float32, shuffle=False)
    window = Rect((4096, 4096 + 512 + 8), (0, 8192))  # 520 rows of 8192 floats: 16.3 MiB
    if not _reset_peak():
        pytest.skip("cannot reset the peak RSS (/proc/self/clear_refs)")
    before = _status("VmRSS")
    x, _ = src.batch(0, window)
    grew = _status("VmHWM") - before
    full, strip = 8192 * 8192 * 4, 520 * 8192 * 4
    assert x.shape == (1, 1, 8192, 8192) and x[0, 0, 4096, 0] == 1.0 and x[0, 0, 4097, 0] == 0
    assert grew < full / 4, f"peak RSS grew {grew / 2**20:.1f} MiB (strip {strip / 2**20:.1f})"
    assert _status("VmRSS") - before < 2 * strip  # what stays: the batch's filled rows


# -- input windows ------------------------------------------------------------------------------
def test_input_window_is_the_tile_plus_halo_clipped_or_whole_or_none():
    example = torch.empty((4, 3, 20, 20), device="meta")
    program = fxpar.compile(tiny_net(), fxpar.Plan(stages=2, spatial_parts=4), example)
    got = [program.for_rank(r).input_window() for r in range(5)]
    assert got == [Rect((0, 11), (0, 11)), Rect((0, 11), (9, 20)), Rect((9, 20), (0, 11)),
                   Rect((9, 20), (9, 20)), None]
    plain = fxpar.compile(tiny_net(), fxpar.Plan(stages=2), example)
    assert [plain.for_rank(r).input_window() for r in range(2)] == [FULL, None]
    gems = fxpar.compile(tiny_net(), fxpar.Plan(stages=2, spatial_parts=2, gems=True), example)
    # rank 2 holds stage 1 of copy 0 and tile 0 of stage 0 of the mirror copy
    assert gems.for_rank(2).input_window() == Rect((0, 20), (0, 11))


def test_target_window_is_the_output_tile_whole_or_not_needed():
    """What part of a mask each rank's loss reads: its output tile when the output stays
    tiled, all of it after a join, nothing on ranks without the last stage."""
    seg = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3, padding=1), torch.nn.ReLU(),
                              torch.nn.Conv2d(4, 2, 1))
    example = torch.empty((4, 3, 20, 20), device="meta")
    loss = lambda out, y: F.cross_entropy(out, y)  # noqa: E731
    sp = fxpar.compile(seg, fxpar.Plan(spatial_parts=4), example, loss_fn=loss)
    got = [sp.for_rank(r).target_window() for r in range(4)]
    assert got == [Rect((0, 10), (0, 10)), Rect((0, 10), (10, 20)), Rect((10, 20), (0, 10)),
                   Rect((10, 20), (10, 20))]
    lp = fxpar.compile(seg, fxpar.Plan(stages=2, spatial_parts=2), example, loss_fn=loss)
    ranks = [lp.for_rank(r) for r in range(3)]
    assert [rp.needs_targets for rp in ranks] == [False, False, True]
    assert ranks[2].target_window() is None  # stage 1 is not spatial: the whole mask
    gems = fxpar.compile(seg, fxpar.Plan(spatial_parts=2, gems=True), example, loss_fn=loss)
    assert gems.for_rank(0).target_window() == Rect((0, 20), (0, 20))  # tiles 0 and 1


def test_input_window_of_a_program_loaded_from_disk(tmp_path):
    from fxpar.program.loader import load

    plan = fxpar.Plan(stages=2, spatial_parts=2, slice="horizontal")
    fxpar.compile(tiny_net(), plan, torch.empty((2, 3, 20, 20), device="meta")).save(tmp_path)
    got = [load(tmp_path, rank=r).input_window() for r in range(3)]
    assert got == [Rect((0, 11), (0, 20)), Rect((9, 20), (0, 20)), None]


# -- timing and metrics -------------------------------------------------------------------------
def test_runtime_records_every_action_only_when_asked():
    torch.manual_seed(0)
    rp = fxpar.compile(tiny_net(), fxpar.Plan(microbatches=2),
                       torch.empty((4, 3, 20, 20), device="meta")).local()
    x, y = torch.randn(4, 3, 20, 20), torch.tensor([0, 1, 2, 0])
    rp.train_step(x, y)
    assert rp.runtime.timeline is None
    rec = Recorder(rp)
    start = time.perf_counter()
    loss, took = rec.step(x, y)
    outside = time.perf_counter() - start
    assert rp.runtime.timeline is None  # switched off again
    assert 0 < took <= outside  # the step's own time, measured inside the call
    assert [e["action"] for e in rec.last] == [str(a) for a in rp.actions]
    assert all(0 <= e["start"] <= e["end"] <= took + 1e-6 for e in rec.last)
    assert all(0 <= e["wait"] <= e["end"] - e["start"] + 1e-6 for e in rec.last)
    assert {e["kind"] for e in rec.last} == {"F", "B", "STEP"}  # one rank: nothing to send
    s = rec.steps[0]
    assert s.step_s == took and 0 < s.compute_s and s.compute_s + s.comm_s <= took


def test_device_times_of_every_action_from_the_clock():
    """On a GPU the recorder marks each action on the device's queue (CUDA events) and reads
    the marks after the step: here a clock whose marks are counters, 1 ms apart, stands in for
    the events (fxpar.runtime.clock.CudaClock is the real one)."""

    class Counting:
        def __init__(self):
            self.n = 0

        def mark(self):
            self.n += 1
            return self.n

        def seconds(self, start, end):
            return (end - start) * 1e-3

    torch.manual_seed(0)
    rp = fxpar.compile(tiny_net(), fxpar.Plan(microbatches=2),
                       torch.empty((4, 3, 20, 20), device="meta")).local()
    clock = Counting()
    rec = Recorder(rp, clock=clock)
    x, y = torch.randn(4, 3, 20, 20), torch.tensor([0, 1, 2, 0])
    for _ in range(2):
        rec.step(x, y)
    assert clock.n == 2 * 2 * len(rp.actions) and rp.runtime.clock is None
    assert [e["device_s"] for e in rec.last] == [1e-3] * len(rp.actions)
    compute = sum(1 for a in rp.actions if a.kind in ("F", "B", "W", "STEP"))
    assert rec.rank_entry()["device_compute_s"] == pytest.approx(compute * 1e-3)
    plain = Recorder(rp)  # CPU: host times are device times, no marks
    plain.step(x, y)
    assert "device_s" not in plain.last[0] and "device_compute_s" not in plain.rank_entry()


def test_compute_and_comm_split_of_a_timeline():
    def t(text, start, end, wait=0.0):
        return ActionTime(Action.from_str(text), start, end, wait)

    line = [t("0RECV_F0", 0.0, 0.1), t("0F0", 0.1, 1.1, 0.4), t("0SEND_F0", 1.1, 1.2),
            t("ALLREDUCE", 1.2, 1.5, 0.3), t("0B0", 1.5, 2.5, 0.2), t("STEP", 2.5, 2.6, 0.1)]
    compute, comm = split_times(line)
    assert compute == pytest.approx(0.6 + 0.8 + 0.0)
    assert comm == pytest.approx(0.1 + 0.4 + 0.1 + 0.3 + 0.2 + 0.1)


def test_metrics_file_round_trip_and_table(tmp_path):
    torch.manual_seed(0)
    rp = fxpar.compile(tiny_net(), fxpar.Plan(), torch.empty((2, 3, 20, 20),
                                                             device="meta")).local()
    rec = Recorder(rp)
    for _ in range(3):
        rec.step(torch.randn(2, 3, 20, 20), torch.tensor([0, 1]))
    m = gather(rec, "tiny", 2)
    path = tmp_path / "m.json"
    path.write_text(json.dumps(m))
    back = load_metrics(path)
    assert back["steps"] == 3 and back["world_size"] == 1 and back["plan"]["stages"] == 1
    entry = back["ranks"][0]
    assert entry["roles"] == [{"copy": 0, "stage": 0, "tile": 0}]
    assert entry["step_s"] == pytest.approx(sorted(s.step_s for s in rec.steps[1:])[0] / 2 +
                                            sorted(s.step_s for s in rec.steps[1:])[1] / 2)
    lines = table(back).splitlines()
    assert lines[1].split() == ["rank", "stage", "tile", "peak", "mem", "compute", "s",
                                "comm", "s", "step", "s", "comm", "%"]
    assert lines[2].split()[:3] == ["0", "0", "0"] and re.search(r" \d+\.\d\d [KMG]iB ", lines[2])


@pytest.mark.parametrize("edit, message", [
    (lambda m: m.update(fxpar_metrics=2), "not an fxpar metrics file of format 1"),
    (lambda m: m.pop("images_per_s"), "the file has no 'images_per_s'"),
    (lambda m: m["ranks"][0].pop("comm_s"), "ranks[0] has no 'comm_s'"),
    (lambda m: m["ranks"][0]["timeline"][0].pop("wait"), "ranks[0].timeline[0] has no 'wait'"),
    (lambda m: m["ranks"][0]["roles"][0].update(tile="0"), "roles[0]['tile'] = '0'"),
    (lambda m: m.update(world_size=2), "1 rank entries for world_size 2"),
])
def test_load_metrics_says_what_is_wrong(tmp_path, edit, message):
    m = {"fxpar_metrics": 1, "model": "m", "world_size": 1, "plan": {}, "steps": 2,
         "batch_size": 4, "images_per_s": 1.5,
         "ranks": [{"rank": 0, "roles": [{"copy": 0, "stage": 0, "tile": 0}],
                    "peak_memory_bytes": 10, "compute_s": 1.0, "comm_s": 0.5, "step_s": 1.6,
                    "timeline": [{"action": "0F0", "kind": "F", "stage": 0, "mb": 0,
                                  "copy": 0, "start": 0.0, "end": 1.0, "wait": 0.1}]}]}
    path = tmp_path / "m.json"
    path.write_text(json.dumps(m))
    assert load_metrics(path)["ranks"][0]["compute_s"] == 1.0
    edit(m)
    path.write_text(json.dumps(m))
    with pytest.raises(MetricsError) as e:
        load_metrics(path)
    assert message in str(e.value)


def test_saved_program_refuses_plan_and_model_flags(tmp_path, capsys):
    fxpar.compile(tiny_net(), fxpar.Plan(), torch.empty((2, 3, 20, 20),
                                                        device="meta")).save(tmp_path)
    assert run.main([str(tmp_path), "--split-size", "2", "--num-layers", "3"]) == 2
    err = capsys.readouterr().err
    assert "drop --stages/--split-size, --num-layers" in err
    if "input_shape" not in json.loads((tmp_path / "program.json").read_text()):
        assert run.main([str(tmp_path), "--steps", "1"]) == 2
        assert "does not record the input size: give --image-size" in capsys.readouterr().err
    assert run.main([str(tmp_path), "--image-size", "20", "--num-classes", "3",
                     "--steps", "2"]) == 0
    out = capsys.readouterr().out
    assert len([line for line in out.splitlines() if line.startswith("step ")]) == 2


def test_a_rank_without_input_gets_no_batch_and_the_loss_rank_needs_targets():
    program = fxpar.compile(tiny_net(), fxpar.Plan(stages=2),
                            torch.empty((2, 3, 20, 20), device="meta"))
    with pytest.raises(ValueError, match="read the model input: pass x"):
        program.for_rank(0).train_step(None, torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="holds the last stage, which computes the loss"):
        program.for_rank(1).train_step(None, None)


def test_save_program_without_mpiexec_writes_every_rank_and_says_how_to_run(tmp_path, capsys):
    out = tmp_path / "prog"
    argv = ["torchvision:resnet18", "--image-size", "32", "--batch-size", "2", "--stages", "2",
            "--spatial-parts", "2", "--save-program", str(out)]
    assert run.main(argv) == 0
    said = capsys.readouterr().out
    assert f"wrote the programs of 3 rank(s) to {out}; run them with `mpiexec -n 3 " \
        f"fxpar-run {out}`" in said
    info = json.loads((out / "program.json").read_text())
    assert info["input_shape"] == [2, 3, 32, 32] and info["world_size"] == 3
    assert all((out / f"rank0000{r}" / "actions.txt").is_file() for r in range(3))


def test_level_flag_trains_on_a_pyramid_level_of_every_image(tmp_path):
    """``--level 1``: a class folder of two-level TIFFs is read at level 1 (its size must be
    --image-size), for the training set and the validation set alike."""
    tifffile = pytest.importorskip("tifffile")
    rng = np.random.default_rng(0)
    truth = {}
    for label in ("a", "b"):
        (tmp_path / label).mkdir()
        for k in range(2):
            levels = [rng.integers(0, 255, (32 >> i, 32 >> i, 3), dtype=np.uint8)
                      for i in range(2)]
            with tifffile.TiffWriter(tmp_path / label / f"{k}.tif") as tw:
                tw.write(levels[0], subifds=1, tile=(16, 16), photometric="rgb")
                tw.write(levels[1], subfiletype=1, tile=(16, 16), photometric="rgb")
            truth[(label, k)] = levels[1]
    a = run.parser().parse_args(
        [f"{CASES}:tiny_net", "--data", str(tmp_path), "--val-data", str(tmp_path),
         "--image-size", "16", "--batch-size", "2", "--level", "1", "--no-shuffle",
         "--steps", "1", "--num-classes", "3"])
    job = run.setup(a)
    x, y = job.source.batch(0, Rect((0, 16), (0, 16)))
    torch.testing.assert_close(x[0], torch.from_numpy(truth[("a", 0)].transpose(2, 0, 1))
                               .float() / 255)
    assert y.tolist() == [0, 0]
    assert job.val is not None
    with pytest.raises(DataError, match="no pyramid level 2"):
        run.setup(run.parser().parse_args(
            [f"{CASES}:tiny_net", "--data", str(tmp_path), "--image-size", "16",
             "--batch-size", "2", "--level", "2"]))
