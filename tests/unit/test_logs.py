"""fxpar.train.logs on one process: the Trainer's CSV / JSON-lines / TensorBoard logs hold the
progress line's values and the evals, logging leaves the training bitwise as it was, a resumed
run appends after its checkpoint's step, and TensorBoard without its package names the extra."""

import csv
import importlib.util
import json
import re

import pytest
import torch
from torch import nn

import fxpar
from fxpar.data.data import Synthetic
from fxpar.train import logs
from fxpar.train.evaluate import Validation

SHAPE = (4, 3, 8, 8)


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 3)).double()


def _batches(step):
    g = torch.Generator().manual_seed(step)
    return torch.randn(SHAPE, dtype=torch.float64, generator=g), \
        torch.randint(0, 3, (SHAPE[0],), generator=g)


def _fit(model, val=False, **config):
    program = fxpar.compile(model, fxpar.Plan(), SHAPE,
                            optimizer=lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9))
    v = Validation(Synthetic((1, 3, 8, 8), 3, torch.float64, seed=5), samples=4,
                   task="classify", classes=3, shape=SHAPE, dtype=torch.float64) if val else None
    return fxpar.Trainer(program.local(), fxpar.TrainConfig(**config), _batches, val=v).fit()


def _csv(path):
    return list(csv.DictReader(path.open()))


def _jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_the_logs_hold_the_progress_lines_and_the_evals(tmp_path, capsys):
    model = _model()
    _fit(model, val=True, steps=3, eval_every=2, log_every=1, log_csv=tmp_path / "log.csv",
         log_jsonl=tmp_path / "log.jsonl")
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("step ")]
    rows, table = _jsonl(tmp_path / "log.jsonl"), _csv(tmp_path / "log.csv")
    assert [r["step"] for r in rows] == [1, 2, 2, 3, 3]  # step 2 and its eval, 3 and its eval
    assert list(table[0]) == list(logs.NAMES)
    train = [r for r in rows if "loss" in r]
    for line, r in zip(lines, train, strict=True):
        assert f"loss {r['loss']:.6f}  lr {r['lr']:.4g}  grad norm {r['grad_norm']:.4g}  " \
               f"{r['images_per_s']:8.2f} img/s  ({r['step_s']:.3f} s, data " \
               f"{r['data_s']:.3f} s)" in line
        assert r["images_per_s"] == pytest.approx(SHAPE[0] / r["step_s"])
    evals = [r for r in rows if "val_loss" in r]
    assert [e["step"] for e in evals] == [2, 3] and set(evals[0]) == {
        "step", "val_loss", "val_accuracy"}
    for t, r in zip(table, rows, strict=True):  # the same values, empty cells for the rest
        assert {k: float(v) for k, v in t.items() if v} == r
    assert table[0]["val_loss"] == "" and table[2]["loss"] == ""


def test_logging_measures_the_norm_and_trains_bitwise_the_same(tmp_path):
    plain, logged = _model(), _model()
    _fit(plain, steps=3)
    _fit(logged, steps=3, log_jsonl=tmp_path / "log.jsonl")
    for (name, got), want in zip(logged.state_dict().items(), plain.state_dict().values(),
                                 strict=True):
        assert torch.equal(got, want), name
    first = _jsonl(tmp_path / "log.jsonl")[0]
    ref = _model()  # the first step's gradient norm, in plain PyTorch
    x, y = _batches(0)
    torch.nn.functional.cross_entropy(ref(x), y).backward()
    want = torch.nn.utils.clip_grad_norm_(ref.parameters(), float("inf"))
    assert first["grad_norm"] == pytest.approx(want.item(), rel=1e-12)


def test_a_resumed_run_appends_after_its_checkpoint(tmp_path):
    files = {"log_csv": tmp_path / "log.csv", "log_jsonl": tmp_path / "log.jsonl"}
    _fit(_model(), steps=3, checkpoint=tmp_path / "ck", checkpoint_every=2, **files)
    _fit(_model(), steps=4, resume=tmp_path / "ck" / "step-00000002", **files)
    text = files["log_csv"].read_text()
    assert text.count("step,loss") == 1, "one header"
    assert [int(r["step"]) for r in _csv(files["log_csv"])] == [1, 2, 3, 4]
    assert [r["step"] for r in _jsonl(files["log_jsonl"])] == [1, 2, 3, 4]  # the first
    # run's step 3, past the checkpoint, is dropped: the resumed run trains it again
    _fit(_model(), steps=1, **files)
    assert [r["step"] for r in _jsonl(files["log_jsonl"])] == [1], "a fresh run starts over"


def test_a_foreign_csv_is_not_appended_to(tmp_path):
    (tmp_path / "log.csv").write_text("epoch,acc\n1,0.5\n")
    _fit(_model(), steps=1, checkpoint=tmp_path / "ck")
    with pytest.raises(ValueError, match="its header is 'epoch,acc', not fxpar's"):
        _fit(_model(), steps=2, resume=tmp_path / "ck", log_csv=tmp_path / "log.csv")


@pytest.mark.skipif(importlib.util.find_spec("tensorboard") is None,
                    reason="tensorboard is not installed (pip install 'fxpar[tensorboard]')")
def test_tensorboard_gets_the_same_scalars(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _fit(_model(), val=True, steps=2, log_jsonl=tmp_path / "log.jsonl",
         tensorboard=tmp_path / "tb")
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    rows = _jsonl(tmp_path / "log.jsonl")
    loss = [(e.step, e.value) for e in events.Scalars("train/loss")]
    assert loss == [(r["step"], pytest.approx(r["loss"], rel=1e-6)) for r in rows
                    if "loss" in r]  # float32 in the event file
    assert [e.step for e in events.Scalars("val/accuracy")] == [2]
    assert {"train/lr", "train/grad_norm", "train/images_per_s", "train/step_s",
            "train/data_s", "val/loss"} <= set(events.Tags()["scalars"])


def test_tensorboard_without_its_package_names_the_extra(tmp_path, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "tensorboard" else real(name, *a))
    with pytest.raises(ValueError, match=re.escape("pip install 'fxpar[tensorboard]'")):
        fxpar.TrainConfig(steps=1, tensorboard=tmp_path / "tb")
