"""Validation under mpiexec (run by tests/mpi/test_evaluate.py, one launch of 4 ranks): the eval
pass of a compiled plan gives the metrics one process computes on the same model, weights and
data, to 1e-10 in float64 -- a spatial + pipelined classifier, GEMS with data parallelism
(several ranks hold the same output rows), a spatial segmenter with mask targets -- and
``fxpar-run --val-data --eval-every --checkpoint --metrics`` prints and writes those numbers
and keeps the best model in DIR/best. Every validation set has a partial last batch (padding)."""

from __future__ import annotations

import contextlib
import copy
import io
import json
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from helpers.transparency import sub_comm
from torch import nn

import fxpar
from fxpar.cli.run import main as fxpar_run
from fxpar.core.geometry import Rect
from fxpar.data.data import ImageFolder
from fxpar.train.evaluate import Validation, evaluate
from fxpar.train.metrics import load_metrics

HERE = Path(__file__)
SIZE = 16
CLASSES = 3
TOL = 1e-10


def tiny_net(num_classes: int = CLASSES) -> nn.Module:
    """A classifier (also ``fxpar-run tests/mpi/cases/eval_cases.py:tiny_net``)."""
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(4, 6, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
        nn.Linear(6, num_classes))


def tiny_segmenter(num_classes: int = CLASSES) -> nn.Module:
    """Fully convolutional: logits (N, K, H, W) for masks (N, H, W)."""
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
        nn.Conv2d(4, 4, 3, padding=2, dilation=2), nn.ReLU(), nn.Conv2d(4, num_classes, 1))


def write_val(root: Path, n: int = 7, size: int = SIZE, seed: int = 1) -> Path:
    """A class folder of ``n`` float .npy images (C, H, W) spread over the classes."""
    rng = np.random.default_rng(seed)
    for i in range(n):
        folder = root / f"class{i % CLASSES}"
        folder.mkdir(parents=True, exist_ok=True)
        np.save(folder / f"{i}.npy", rng.standard_normal((3, size, size)))
    return root


def write_csv(root: Path, n: int, seed: int = 2, masks: bool = True) -> Path:
    """``root/samples.csv`` of ``n`` float .npy images with .npy masks (or labels); returns
    the CSV. Masks have a frequent class 2 on their first rows, so Dice differs by class."""
    rng = np.random.default_rng(seed)
    root.mkdir(parents=True, exist_ok=True)
    rows = ["image,mask" if masks else "image,label"]
    for i in range(n):
        np.save(root / f"img{i}.npy", rng.standard_normal((3, SIZE, SIZE)))
        if masks:
            mask = rng.integers(0, CLASSES, (SIZE, SIZE))
            mask[:4] = 2
            np.save(root / f"mask{i}.npy", mask)
        rows.append(f"img{i}.npy,mask{i}.npy" if masks else f"img{i}.npy,{i % CLASSES}")
    (root / "samples.csv").write_text("\n".join(rows) + "\n")
    return root / "samples.csv"


def csv_set(csv: Path, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The CSV's images and masks (or labels), read directly with numpy, in row order."""
    x = torch.stack([torch.from_numpy(np.load(csv.parent / f"img{i}.npy")) for i in range(n)])
    if (csv.parent / "mask0.npy").exists():
        return x, torch.stack([torch.from_numpy(np.load(csv.parent / f"mask{i}.npy"))
                               for i in range(n)]).long()
    return x, torch.tensor([i % CLASSES for i in range(n)])


def folder_set(root: Path, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every image of the folder, in the order the eval pass reads them, and the labels."""
    data = ImageFolder.scan(root, SIZE, 3)
    assert len(data) == n
    whole = Rect((0, SIZE), (0, SIZE))
    return (torch.stack([data.read(i, whole, torch.float64) for i in range(n)]),
            torch.tensor([data.label(i) for i in range(n)]))


def reference(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict[str, Any]:
    """One process, the whole set at once, eval mode, float64: loss, accuracy (pixel accuracy
    for masks), and per class Dice and IoU for masks, computed directly."""
    model = copy.deepcopy(model).eval()
    with torch.no_grad():
        out = model(x)
    pred = out.argmax(1)
    got: dict[str, Any] = {"loss": float(F.cross_entropy(out, y)), "samples": len(x),
                           "correct": int((pred == y).sum()),
                           "accuracy": float((pred == y).double().mean())}
    if y.dim() == 1:
        return got
    dice, iou = [], []
    for c in range(out.shape[1]):
        p, t = pred == c, y == c
        inter, union = int((p & t).sum()), int((p | t).sum())
        both = int(p.sum()) + int(t.sum())
        dice.append(2 * inter / both if both else None)
        iou.append(inter / union if union else None)
    got["per_class_dice"], got["per_class_iou"] = dice, iou
    got["dice"] = float(np.mean([d for d in dice if d is not None]))
    got["iou"] = float(np.mean([i for i in iou if i is not None]))
    return got


def assert_metrics(got: dict[str, Any], want: dict[str, Any], where: str) -> str:
    """Counts equal, ratios and the loss within TOL; returns what was compared (printed)."""
    for key in ("samples", "correct"):
        assert got[key] == want[key], f"{where}: {key} {got[key]} != {want[key]}"
    for key in ("loss", "accuracy") + (("dice", "iou") if "dice" in want else ()):
        assert abs(got[key] - want[key]) <= TOL, f"{where}: {key} {got[key]!r} != {want[key]!r}"
    if "dice" in want:
        for c, entry in enumerate(got["per_class"]):
            for key in ("dice", "iou"):
                w = want[f"per_class_{key}"][c]
                assert (entry[key] is None) == (w is None), f"{where}: class {c} {key}"
                assert w is None or abs(entry[key] - w) <= TOL, \
                    f"{where}: class {c} {key} {entry[key]!r} != {w!r}"
    keys = ("loss", "accuracy") + (("dice", "iou") if "dice" in want else ())
    return f"{where}: " + ", ".join(
        f"{k} {got[k]:.15g} (one process {want[k]:.15g}, diff {abs(got[k] - want[k]):.1e})"
        for k in keys) + f", {got['correct']} correct of {got.get('pixels', got['samples'])}"


class Tensors:
    """A BatchSource of one sample per step over tensors (what fxpar.data.samples gives for a
    CSV with masks): x with only the window filled (NaN elsewhere), y whole. (A plain class:
    load_case imports this file outside sys.modules, where dataclasses fail.)"""

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x, self.y = x, y
        self.reads: list[Rect | None] = []

    @property
    def steps_per_epoch(self) -> int:
        return len(self.x)

    def batch(self, step: int, window: Rect | None) -> tuple[torch.Tensor | None, torch.Tensor]:
        self.reads.append(window)
        y = self.y[step:step + 1]
        if window is None:
            return None, y
        x = torch.full((1, *self.x.shape[1:]), float("nan"), dtype=self.x.dtype)
        where = (slice(None), *(slice(a, b) for a, b in window.dims))
        x[(0, *where)] = self.x[(step, *where)]
        return x, y


def _compiled_eval(plan: fxpar.Plan, build: Any, x: torch.Tensor, y: torch.Tensor,
                   task: str, batch: int, name: str) -> None:
    """Train one step (so BatchNorm running statistics are not the initial ones), then the
    eval pass of the compiled program against one process with the same weights."""
    comm = sub_comm(plan.world_size)
    if comm is None:
        return
    torch.manual_seed(0)
    model = build().double()
    ref = copy.deepcopy(model)
    shape = (batch, 3, SIZE, SIZE)
    rp = fxpar.compile(model, plan, torch.empty(shape, dtype=torch.float64, device="meta"),
                       optimizer=lambda ps: torch.optim.SGD(ps, lr=0.05), comm=comm).local(comm)
    g = torch.Generator().manual_seed(7)
    xt = torch.randn(shape, dtype=torch.float64, generator=g)
    rp.train_step(xt, y[:batch])
    state = rp.full_state_dict()
    state = comm.bcast_object(state, root=0)
    ref.load_state_dict(state)
    src = Tensors(x, y)
    val = Validation(src, len(x), task, CLASSES, shape, torch.float64, name=name)
    got = evaluate(rp, val, rp.input_window())
    said = assert_metrics(got, reference(ref, x, y), f"{name} rank {comm.rank}")
    if comm.rank == 0:
        print(said, flush=True)
    for k in ("loss", "accuracy"):  # every rank has the same numbers, bit for bit
        assert len(set(comm.allgather_object(got[k]))) == 1
    # a rank reads only its window, or nothing when it neither reads input nor scores
    window = rp.input_window()
    assert all(w == window for w in src.reads), (comm.rank, set(src.reads), window)
    rp.close()


def case_spatial_pipelined_classifier_eval_equals_one_process():
    g = torch.Generator().manual_seed(3)
    x = torch.randn((7, 3, SIZE, SIZE), dtype=torch.float64, generator=g)
    y = torch.randint(0, CLASSES, (7,), generator=g)
    _compiled_eval(fxpar.Plan(stages=2, spatial_parts=2, microbatches=2), tiny_net, x, y,
                   "classify", 4, "SP2+PP2")


def case_gems_with_data_parallel_eval_counts_each_sample_once():
    g = torch.Generator().manual_seed(4)
    x = torch.randn((9, 3, SIZE, SIZE), dtype=torch.float64, generator=g)
    y = torch.randint(0, CLASSES, (9,), generator=g)
    # 4 chunks of 1 row per batch of 4, each computed by one (replica, copy); 3 batches, the
    # last with 1 sample and 3 padding rows: any doubled or padded row moves the counts
    _compiled_eval(fxpar.Plan(stages=2, gems=True, data_parallel=2), tiny_net, x, y,
                   "classify", 4, "GEMS+DP2")


def case_spatial_segmenter_eval_with_masks_equals_one_process():
    g = torch.Generator().manual_seed(5)
    x = torch.randn((5, 3, SIZE, SIZE), dtype=torch.float64, generator=g)
    y = torch.randint(0, CLASSES, (5, SIZE, SIZE), generator=g)
    y[:, :4] = 2  # a frequent class, so dice differs between classes
    _compiled_eval(fxpar.Plan(spatial_parts=2, data_parallel=2), tiny_segmenter, x, y,
                   "segment", 2, "SP2+DP2 segmenter")


def case_fxpar_run_validates_prints_writes_metrics_and_keeps_the_best():
    from fxpar.program.checkpoint import export, read_manifest

    comm = sub_comm(4)
    if comm is None:
        return
    name = tempfile.mkdtemp(prefix="fxpar-eval-") if comm.rank == 0 else None
    root = Path(comm.bcast_object(name))
    if comm.rank == 0:
        write_val(root / "train", n=8, seed=0)
        write_val(root / "val", n=7, seed=1)
    comm.barrier()
    argv = [f"{HERE}:tiny_net", "--image-size", str(SIZE), "--batch-size", "4",
            "--dtype", "float64", "--data", str(root / "train"), "--steps", "4",
            "--lr", "0.1", "--num-classes", str(CLASSES), "--spatial-parts", "2",
            "--data-parallel", "2", "--val-data", str(root / "val"), "--eval-every", "2",
            "--checkpoint", str(root / "ck"), "--best-metric", "accuracy",
            "--metrics", str(root / "m.json")]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert fxpar_run(argv, comm=comm) == 0
    comm.barrier()
    if comm.rank == 0:
        text = out.getvalue()
        lines = [ln for ln in text.splitlines() if ln.startswith("eval ")]
        assert len(lines) == 2 and "step    2/4" in lines[0] and "step    4/4" in lines[1], text
        evals = load_metrics(root / "m.json")["eval"]
        assert [e["step"] for e in evals] == [2, 4]
        for ln, e in zip(lines, evals, strict=True):
            assert float(re.search(r"loss (\S+)", ln).group(1)) == round(e["loss"], 6)
            assert f"({e['correct']}/7)" in ln
        x, y = folder_set(root / "val", 7)
        model = tiny_net().double()
        model.load_state_dict(export(root / "ck"))  # the weights after step 4
        print(assert_metrics(evals[1], reference(model, x, y), "fxpar-run step 4"))
        best = read_manifest(root / "ck" / "best")
        first_best = max(evals, key=lambda e: e["accuracy"])  # the first of equals stays
        assert best["step"] == first_best["step"] and best["extra"]["best_metric"] == "accuracy"
        model.load_state_dict(export(root / "ck" / "best"))
        print(assert_metrics(best["extra"]["eval"], reference(model, x, y), "DIR/best"),
              flush=True)
        assert json.loads(json.dumps(best["extra"]["eval"])) == first_best
        assert "best: step" in text
        shutil.rmtree(root, ignore_errors=True)


def case_fxpar_run_segmentation_from_csv_masks_keeps_the_best_dice():
    from fxpar.program.checkpoint import export, read_manifest

    comm = sub_comm(2)
    if comm is None:
        return
    name = tempfile.mkdtemp(prefix="fxpar-eval-") if comm.rank == 0 else None
    root = Path(comm.bcast_object(name))
    if comm.rank == 0:
        write_csv(root / "train", 4, seed=3)
        write_csv(root / "val", 5, seed=4)
    comm.barrier()
    argv = [f"{HERE}:tiny_segmenter", "--image-size", str(SIZE), "--batch-size", "2",
            "--dtype", "float64", "--data", str(root / "train" / "samples.csv"), "--steps",
            "3", "--lr", "0.2", "--num-classes", str(CLASSES), "--spatial-parts", "2",
            "--val-data", str(root / "val" / "samples.csv"), "--eval-every", "1",
            "--checkpoint", str(root / "ck"), "--best-metric", "dice",
            "--metrics", str(root / "m.json")]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert fxpar_run(argv, comm=comm) == 0
    comm.barrier()
    if comm.rank == 0:
        text = out.getvalue()
        lines = [ln for ln in text.splitlines() if ln.startswith("eval ")]
        assert len(lines) == 3 and all("dice" in ln and "iou" in ln for ln in lines), text
        evals = load_metrics(root / "m.json")["eval"]
        assert [e["step"] for e in evals] == [1, 2, 3] and evals[0]["pixels"] == 5 * SIZE**2
        # training read only each rank's tile of the masks and still trained like one process
        from fxpar.data.samples import open_source

        torch.manual_seed(0)  # fxpar-run's --seed
        ref = tiny_segmenter(CLASSES).double()
        opt = torch.optim.SGD(ref.parameters(), lr=0.2, momentum=0.9)
        train = open_source(root / "train" / "samples.csv", (2, 3, SIZE, SIZE), torch.float64)
        for step in range(3):
            xs, ys = train.batch(step, Rect.whole((SIZE, SIZE)))
            opt.zero_grad()
            F.cross_entropy(ref(xs), ys).backward()
            opt.step()
        trained = export(root / "ck")
        for name, value in ref.state_dict().items():
            torch.testing.assert_close(trained[name], value, rtol=1e-9, atol=1e-11)
        x, y = csv_set(root / "val" / "samples.csv", 5)
        model = tiny_segmenter().double()
        model.load_state_dict(trained)
        print(assert_metrics(evals[-1], reference(model, x, y), "fxpar-run CSV masks step 3"))
        best = read_manifest(root / "ck" / "best")
        top = max(evals, key=lambda e: e["dice"])
        assert best["step"] == top["step"] and best["extra"]["best_metric"] == "dice"
        model.load_state_dict(export(root / "ck" / "best"))
        print(assert_metrics(best["extra"]["eval"], reference(model, x, y), "CSV DIR/best"),
              flush=True)
        shutil.rmtree(root, ignore_errors=True)
