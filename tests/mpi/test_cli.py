"""fxpar-inspect and fxpar-run as a user runs them."""

import contextlib
import csv
import io
import json
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fxpar.cli.inspect import main as inspect_main
from fxpar.cli.run import main as run_main
from fxpar.core.geometry import Rect
from fxpar.testing import mpiexec

BIN = Path(sys.executable).parent


def call(main, *args, timeout=None):
    """A CLI's main() in this process (no interpreter start-up), as a finished process."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main([str(a) for a in args])
        except SystemExit as e:  # argparse errors
            code = e.code
    return SimpleNamespace(returncode=code, stdout=out.getvalue(), stderr=err.getvalue())


def run(*args, timeout=120):
    return subprocess.run([*args], capture_output=True, text=True, timeout=timeout,
                          env={"OMP_NUM_THREADS": "1", "PATH": f"{BIN}:/usr/bin:/bin"})


def test_inspect_torchvision_model_prints_table_and_totals():
    r = run(str(BIN / "fxpar-inspect"), "torchvision:resnet18", "--image-size", "224")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].startswith(
        "model: torchvision:resnet18  input: 1x3x224x224 float32  nodes: 193")
    assert lines[1].split() == ["#", "node", "op", "module", "output", "FLOPs", "out", "bytes",
                                "params"]
    conv1 = next(line for line in lines if " conv1 " in line).split()
    assert conv1[2:7] == ["conv2d", "conv1", "1x64x112x112", "236.03", "M"]
    assert conv1[-2:] == ["36.75", "KiB"]  # its weight, read through a get_attr node
    assert lines[-1].startswith("total: 3.63 GFLOP forward")
    assert "11,689,512 values" in lines[-1]


def test_inspect_zoo_model_with_keyword_arguments():
    r = call(inspect_main, "models:amoebanet", "-k", "num_layers=3",
            "-k", "num_filters=16", "--image-size", "64", "--batch-size", "2",
            "--num-classes", "4")
    assert r.returncode == 0, r.stderr
    assert "input: 2x3x64x64" in r.stdout
    assert "max_pool2d" in r.stdout
    assert r.stdout.splitlines()[-2].split()[4] == "2x4"  # output node: batch x classes


def test_inspect_model_from_a_file(tmp_path):
    f = tmp_path / "net.py"
    f.write_text("import torch.nn as nn\n"
                 "def make(width=4):\n"
                 "    return nn.Sequential(nn.Conv2d(1, width, 3, padding=1), nn.ReLU())\n")
    r = call(inspect_main, f"{f}:make", "-k", "width=6",
            "--image-size", "2048", "--channels", "1")
    assert r.returncode == 0, r.stderr
    assert "1x6x2048x2048" in r.stdout and "96.00 MiB" in r.stdout


@pytest.mark.parametrize("spec, message", [
    ("resnet18", "expected torchvision:NAME"),
    ("torchvision:resnet9000", "torchvision has no classification model 'resnet9000'"),
    ("models:nope", "unknown model 'nope'; known models: amoebanet"),
    ("missing.py:make", "is not an existing .py file"),
])
def test_inspect_bad_model_spec_is_a_clear_error(spec, message):
    r = call(inspect_main, spec, "--image-size", "32")
    assert r.returncode == 2
    assert message in r.stderr and "Traceback" not in r.stderr


def test_inspect_too_small_image_names_the_node():
    r = call(inspect_main, "torchvision:vgg11", "--image-size", "16")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "could not capture VGG in module 'features.20' (MaxPool2d)" in r.stderr
    assert "image large enough" in r.stderr


AUGMENT = "flip,rot90,affine,intensity,hed"


def _slides(folder):
    """Four RGB "slides" of 40x48 in a CSV of image,label rows (regions of 32x32 are drawn)."""
    g = np.random.default_rng(0)
    rows = ["image,label"]
    for i in range(4):
        np.save(folder / f"img{i}.npy", g.random((3, 40, 48)).astype(np.float32))
        rows.append(f"img{i}.npy,{i % 2}")
    (folder / "train.csv").write_text("\n".join(rows) + "\n")
    return folder / "train.csv"


def _one_process_losses(folder, steps):
    """fxpar-run's run below on one process, in plain PyTorch: the same model (seed 0), the
    same uniformly drawn, augmented whole regions (seed 0), AdamW with the warm-up and cosine,
    clipping to norm 1, two micro-batches accumulated per step."""
    from fxpar.data.augment import parse_augment
    from fxpar.data.loader import ArrayImage, AugmentedBatches, Slide
    from fxpar.data.sampling import Uniform
    from fxpar.models.zoo import build_model
    from fxpar.train.schedules import by_name

    slides = [Slide(ArrayImage(np.load(folder / f"img{i}.npy")), label=i % 2) for i in range(4)]
    source = AugmentedBatches(slides, Uniform(), parse_augment(AUGMENT), (32, 32), 4, seed=0,
                              steps_per_epoch=1)
    torch.manual_seed(0)
    model = build_model("models:resnet_v2", depth=8, num_classes=10)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.01)
    schedule = by_name("cosine", steps, 1)(opt)
    losses = []
    for step in range(steps):
        x, y = source.batch(step, Rect.whole((32, 32)))
        opt.zero_grad()
        loss = 0.0
        for xc, yc in zip(x.tensor_split(2), y.tensor_split(2), strict=True):
            part = F.cross_entropy(model(xc), yc) / 2
            part.backward()
            loss += part.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        schedule.step()
        losses.append(loss)
    return losses


@pytest.mark.mpi
def test_run_trains_under_mpiexec_with_progress(tmp_path):
    """SP2 x 2 micro-batches on 2 ranks, regions drawn and augmented from --data: each rank
    reads its window of the augmented regions, and the losses are one process's on the whole
    regions; rank 0 alone logs every step's progress values (CSV and JSON lines)."""
    r = run(mpiexec(), "-n", "2", str(BIN / "fxpar-run"), "models:resnet_v2", "-k", "depth=8",
            "--image-size", "32", "--batch-size", "4", "--parts", "2", "--spatial-parts", "2",
            "--steps", "2", "--lr", "0.05", "--optimizer", "adamw", "--lr-schedule", "cosine",
            "--warmup", "1", "--ema", "0.99", "--clip-grad", "1.0",
            "--data", _slides(tmp_path), "--sampler", "uniform", "--augment", AUGMENT,
            "--log-csv", tmp_path / "log.csv", "--log-jsonl", tmp_path / "log.jsonl")
    assert r.returncode == 0, r.stderr
    assert "uniform regions of 32x32, augment flip,rot90,affine,intensity,hed" in r.stdout
    steps = [line for line in r.stdout.splitlines() if line.startswith("step")]
    assert len(steps) == 2 and "loss" in steps[0] and "img/s" in steps[0]
    # warm-up to --lr over 1 step, then the cosine; the norm the clipping measured
    assert "  lr 0.025  grad norm " in steps[0] and "  lr 0.05  grad norm " in steps[1]
    lines = r.stdout.splitlines()
    head = lines.index(next(line for line in lines if line.startswith("rank  stage  tile")))
    assert lines[head + 1].split()[:3] == ["0", "0", "0"]  # the per-rank table
    assert lines[-1].startswith("done: median")
    rows = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    table = list(csv.DictReader((tmp_path / "log.csv").open()))
    assert [row["step"] for row in rows] == [1, 2], "one row per step: rank 0's alone"
    assert [float(row["loss"]) for row in table] == [row["loss"] for row in rows]
    for line, row in zip(steps, rows, strict=True):
        assert f"loss {row['loss']:.6f}  lr {row['lr']:.4g}  grad norm {row['grad_norm']:.4g}" \
            f"  {row['images_per_s']:8.2f} img/s  ({row['step_s']:.3f} s, data " \
            f"{row['data_s']:.3f} s)" in line
    want = _one_process_losses(tmp_path, 2)
    assert [row["loss"] for row in rows] == pytest.approx(want, rel=1e-5), want


def test_run_rejects_a_bad_plan_before_starting():
    r = call(run_main, "models:resnet_v2", "--batch-size", "6",
            "--parts", "4")
    assert r.returncode == 2
    assert "batch size 6 does not split into 4 equal chunks" in r.stderr


def test_inspect_stage_table_and_schedule_grid():
    r = call(inspect_main, "torchvision:resnet18", "--image-size",
            "128", "--batch-size", "32", "--stages", "3", "--microbatches", "4", "--schedule",
            "1f1b")
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "(per micro-batch of 8)" in out.splitlines()[0]
    assert "stages: 3 on 3 ranks" in out
    table = out.split("stages: 3 on 3 ranks\n")[1].split("\n\n")[0].splitlines()
    assert table[0].split() == ["stage", "nodes", "FLOPs", "params", "activations"]
    assert sum(int(line.split()[1]) for line in table[1:]) == 69
    assert "0|1" in out and "1|2" in out and "0->1: 8x" in out
    grid = out.split("(one training step, step x rank)\n")[1].splitlines()
    assert grid[0].split() == ["step", "rank", "0", "rank", "1", "rank", "2"]
    assert grid[1].split() == ["0", "0F0", "1RECV_F0", "2RECV_F0"]
    assert "simulated bubble (F=1, B=2 ticks): 33.3%; one copy's formula (p-1)/(m+p-1) = 33.3%" \
        in out


def test_inspect_bad_balance_is_a_clear_error():
    r = call(inspect_main, "torchvision:resnet18", "--image-size",
            "64", "--batch-size", "2", "--stages", "2", "--balance", "3,4")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "make it sum to 69" in r.stderr


def test_inspect_rank_map_and_gems_grid():
    r = call(inspect_main, "torchvision:resnet18", "--image-size",
            "64", "--batch-size", "8", "--stages", "3", "--gems", "--data-parallel", "2")
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "rank map (6 ranks):" in out
    rows = out.split("rank map (6 ranks):\n")[1].split("\n\n")[0].splitlines()
    assert rows[0].split() == ["rank", "dp", "copy", "stage", "tile"]
    assert rows[1].split() == ["0", "0", "0", "0", "0"] and rows[2].split() == ["0", "0", "1",
                                                                               "2", "0"]
    assert rows[-1].split() == ["5", "1", "1", "0", "0"]
    assert "GEMS x2 copies" in out and "c1.0F0" in out


def test_run_trains_a_segmentation_model_with_a_library_loss():
    """--loss dicece on a U-Net: synthetic masks (one label per pixel) and the loss's value."""
    r = call(run_main, "models:unet", "--image-size", "32", "--batch-size", "2",
             "--num-classes", "3", "--steps", "2", "--loss", "dicece", "--class-weights",
             "0.2,1,2", "--device", "cpu")
    assert r.returncode == 0, r.stderr
    steps = [line for line in r.stdout.splitlines() if line.startswith("step")]
    assert len(steps) == 2 and 0.5 < float(steps[0].split()[3]) < 3.0  # Dice + CE of 3 classes


@pytest.mark.parametrize(("args", "message"), [
    (("torchvision:resnet18", "--loss", "dice"),
     "--loss dice compares per-pixel masks, but torchvision:resnet18 gives 8x10 outputs"),
    (("models:unet", "--loss", "tversky", "--class-weights", "1,2"),
     "--loss tversky has no --class-weights"),
    (("models:unet", "--loss", "focal", "--ignore-index", "1"),
     "--loss focal has no --ignore-index (ce and dice have)"),
    (("models:unet", "--num-classes", "3", "--class-weights", "1,2"),
     "--class-weights has 2 values for 3 classes: give one per class"),
    (("models:unet", "--class-weights", "a,b"), "--class-weights a,b: give one number per"),
])
def test_run_loss_options_are_checked_with_what_to_change(args, message):
    r = call(run_main, *args, "--image-size", "32", "--steps", "1", "--device", "cpu")
    assert r.returncode == 2 and message in r.stderr, r.stderr


@pytest.mark.mpi
def test_the_readme_trainer_script_trains_and_validates_under_sp_and_pp():
    """examples/train_timm.py (the README's script): a timm model, SP2 + PP2 on 3 ranks,
    fxpar.Trainer with validation every 3 steps."""
    script = Path(__file__).resolve().parents[2] / "examples" / "train_timm.py"
    r = run(mpiexec(), "-n", "3", sys.executable, str(script), timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    lines = r.stdout.splitlines()
    assert sum(line.startswith("step ") for line in lines) == 6
    assert sum(line.startswith("eval  step") for line in lines) == 2, r.stdout
    assert lines[-1].startswith("done: median")


def _tiny(tmp_path):
    f = tmp_path / "tiny.py"
    f.write_text("import torch.nn as nn\n"
                 "def make(num_classes=10):\n"
                 "    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1, bias=False),\n"
                 "        nn.BatchNorm2d(4), nn.ReLU(), nn.AdaptiveAvgPool2d(1),\n"
                 "        nn.Flatten(), nn.Linear(4, num_classes))\n")
    return f"{f}:make"


def test_run_recipe_flags_resume_exactly(tmp_path):
    """SGD with Nesterov momentum, one-cycle, EMA, clipping by value and accumulation over 2
    batches: a run resumed from its step-2 checkpoint ends bitwise where the whole run ends,
    the moving average included."""
    from fxpar.program.checkpoint import export

    common = (_tiny(tmp_path), "--image-size", "16", "--batch-size", "4", "--steps", "4",
              "--dtype", "float64", "--device", "cpu", "--nesterov", "--weight-decay", "1e-4",
              "--lr-schedule", "onecycle", "--ema", "0.9", "--clip-value", "0.5",
              "--accumulate", "2", "--log-every", "1")
    whole = call(run_main, *common, "--checkpoint", tmp_path / "a", "--checkpoint-every", "2")
    assert whole.returncode == 0, whole.stderr
    steps = [line for line in whole.stdout.splitlines() if line.startswith("step")]
    assert len(steps) == 4 and all("  lr " in line for line in steps)
    again = call(run_main, *common, "--checkpoint", tmp_path / "b", "--resume",
                 tmp_path / "a" / "step-00000002")
    assert again.returncode == 0, again.stderr
    assert "resumed from" in again.stdout and "step    3/4" in again.stdout
    for ema in (False, True):
        want, got = export(tmp_path / "a", ema=ema), export(tmp_path / "b", ema=ema)
        assert list(want) == list(got)
        assert all(torch.equal(got[k], v) for k, v in want.items()), ema
    plain = call(run_main, *common[:11], "--steps", "2", "--checkpoint", tmp_path / "c")
    assert plain.returncode == 0, plain.stderr
    missing = call(run_main, *common, "--resume", tmp_path / "c")
    assert missing.returncode == 2, missing.stderr
    assert "saved without the scheduler and ema state" in missing.stderr


@pytest.mark.parametrize("args, message", [
    (("--optimizer", "adamw", "--momentum", "0.5"), "--momentum: SGD's, not adamw's"),
    (("--optimizer", "adamw", "--nesterov"), "--nesterov: SGD's, not adamw's"),
    (("--ema", "0.9", "--ema-eval"), "--ema-eval validates with the averaged weights: give "
                                     "--val-data"),
    (("--accumulate", "2", "--steps", "3"), "--steps 3 with --accumulate 2: make the steps"),
    (("--lr-schedule", "cosine", "--warmup", "5", "--steps", "4"),
     "warmup=5 with total_steps=4"),
    (("--clip-grad", "1", "--clip-value", "1"), "not both"),
    (("--ema", "1.5",), r"ema 1.5: give a decay in \[0, 1\)"),
    (("--warmup", "-1",), "--warmup must be >= 0"),
])
def test_run_recipe_flags_are_checked_with_what_to_change(args, message):
    r = call(run_main, "models:resnet_v2", "--image-size", "32", "--device", "cpu", *args)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert re.search(message, r.stderr), r.stderr


def _data_csvs(folder):
    """The CSVs the data-flag checks read: labels (+ a foreground column), masks, and one
    that fixes its regions."""
    labels = _slides(folder)
    g = np.random.default_rng(1)
    rows, fg = ["image,mask"], ["image,label,foreground"]
    for i in range(4):
        np.save(folder / f"mask{i}.npy", g.integers(0, 2, (1, 40, 48)).astype(np.uint8))
        np.save(folder / f"fg{i}.npy", (g.random((5, 6)) > 0.5).astype(np.float32))
        rows.append(f"img{i}.npy,mask{i}.npy")
        fg.append(f"img{i}.npy,{i % 2},fg{i}.npy")
    (folder / "masks.csv").write_text("\n".join(rows) + "\n")
    (folder / "fg.csv").write_text("\n".join(fg) + "\n")
    (folder / "fixed.csv").write_text("image,label,y,x\nimg0.npy,0,0,0\nimg1.npy,1,4,8\n")
    return {"labels": labels, "masks": folder / "masks.csv", "fg": folder / "fg.csv",
            "fixed": folder / "fixed.csv"}


@pytest.mark.parametrize("data, args, message", [
    (None, ("--augment", "flip"), "--augment draws and augments regions of the --data images, "
                                  "but the data is synthetic"),
    (None, ("--sampler", "uniform"), "--sampler draws and augments regions"),
    ("labels", ("--sampler", "foreground"), "add a 'foreground' column to the --data CSV"),
    ("labels", ("--sampler", "balanced"), "--sampler balanced centres regions on positive / "
                                          "negative pixels of each image's mask"),
    ("labels", ("--augment", "flip,blur"), "unknown transform 'blur'"),
    ("labels", ("--augment", "affine:turn=3"), "affine takes degrees=<number>"),
    ("labels", ("--sampler", "uniform", "--pos-neg", "3"), "--pos-neg 3: give pos:neg"),
    ("labels", ("--augment", "flip", "--prefetch", "-1"), "give --prefetch >= 0"),
    ("labels", ("--augment", "flip", "--no-shuffle"), "drop --no-shuffle"),
    ("fixed", ("--sampler", "uniform"), r"fixed.csv:3: the row fixes its region \(origin "
                                        r"\(4, 8\)\), but --sampler draws the regions"),
])
def test_run_data_flags_are_checked_with_what_to_change(tmp_path, data, args, message):
    given = () if data is None else ("--data", _data_csvs(tmp_path)[data])
    r = call(run_main, "models:resnet_v2", "--image-size", "32", "--batch-size", "2",
             "--steps", "1", "--device", "cpu", *given, *args)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert re.search(message, r.stderr), r.stderr


def test_run_draws_regions_by_a_tissue_mask_and_by_the_labels(tmp_path, monkeypatch):
    """--sampler foreground (a CSV's foreground column) and balanced (its masks) train on one
    process; --tensorboard without its package names the extra."""
    csvs = _data_csvs(tmp_path)
    r = call(run_main, _tiny(tmp_path), "--image-size", "24x32", "--batch-size", "2",
             "--steps", "2", "--device", "cpu", "--data", csvs["fg"], "--sampler",
             "foreground", "--augment", "flip,affine,hed", "--prefetch", "0")
    assert r.returncode == 0, r.stderr
    assert "foreground regions of 24x32, augment flip,affine,hed, no prefetch" in r.stdout
    r = call(run_main, "models:unet", "--image-size", "32", "--batch-size", "2",
             "--num-classes", "2", "--steps", "2", "--device", "cpu", "--data", csvs["masks"],
             "--sampler", "balanced", "--pos-neg", "2:1", "--augment", "rot90,intensity")
    assert r.returncode == 0, r.stderr
    assert "(4 images, masks), balanced 2:1 regions of 32x32, augment rot90,intensity, " \
           "prefetch 2, 2 steps per epoch" in r.stdout
    assert sum(line.startswith("step ") for line in r.stdout.splitlines()) == 2
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "tensorboard" else real(name, *a))
    r = call(run_main, "models:resnet_v2", "--image-size", "32", "--device", "cpu",
             "--tensorboard", tmp_path / "tb")
    assert r.returncode == 2
    assert f"--tensorboard {tmp_path / 'tb'} writes TensorBoard events, which needs the " \
           "tensorboard package: pip install 'fxpar[tensorboard]'" in r.stderr, r.stderr
