"""fxpar.Trainer on one process: the loop trains exactly as plain PyTorch does (float64), its
validation, checkpoints, metrics and resume, and the configuration's checks."""

import json

import pytest
import torch
import torch.nn.functional as F
from helpers.equivalence import assert_same, reference_step
from torch import nn

import fxpar
from fxpar.data.data import Synthetic
from fxpar.train.evaluate import Validation

SHAPE = (4, 3, 12, 12)


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 6, 3, padding=1), nn.BatchNorm2d(6), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(6, 3)).double()


def _sgd(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def _batches(step):  # a different fixed batch per step
    g = torch.Generator().manual_seed(step)
    return torch.randn(SHAPE, dtype=torch.float64, generator=g), \
        torch.randint(0, 3, (SHAPE[0],), generator=g)


def _trainer(model, config, val=None):
    program = fxpar.compile(model, fxpar.Plan(microbatches=2), SHAPE, optimizer=_sgd)
    return fxpar.Trainer(program.local(), config, _batches, val=val)


def test_fit_trains_exactly_as_plain_pytorch(tmp_path, capsys):
    model = _model()
    ref = _model()
    opt = _sgd(ref.parameters())
    val = Validation(Synthetic((1, 3, 12, 12), 3, torch.float64, seed=5), samples=6,
                     task="classify", classes=3, shape=SHAPE, dtype=torch.float64)
    config = fxpar.TrainConfig(steps=4, eval_every=2, checkpoint=tmp_path / "ck",
                               metrics=tmp_path / "m.json", log_every=1)
    metrics = _trainer(model, config, val).fit()
    for step in range(4):
        reference_step(ref, opt, *_batches(step), chunks=2, loss_fn=F.cross_entropy)
    for (name, got), want in zip(model.state_dict().items(), ref.state_dict().values(),
                                 strict=True):
        assert_same(name, got, want, 1e-10, 1e-7)
    assert [e["step"] for e in metrics["eval"]] == [2, 4]
    assert json.loads((tmp_path / "m.json").read_text())["eval"][1]["step"] == 4
    assert (tmp_path / "ck" / "best").is_dir()
    out = capsys.readouterr().out
    assert "step    4/4" in out and "checkpoint: step 4" in out


def test_resume_continues_where_the_checkpoint_stopped(tmp_path):
    straight = _model()
    _trainer(straight, fxpar.TrainConfig(steps=5)).fit()
    resumed = _model()
    _trainer(resumed, fxpar.TrainConfig(steps=3, checkpoint=tmp_path)).fit()
    again = _model()
    _trainer(again, fxpar.TrainConfig(steps=5, resume=tmp_path)).fit()
    for (name, got), want in zip(again.state_dict().items(), straight.state_dict().values(),
                                 strict=True):
        assert_same(name, got, want, 1e-10, 1e-7)


def test_the_nonfinite_setting_reaches_the_guard():
    t = _trainer(_model(), fxpar.TrainConfig(steps=1, nonfinite="skip"))
    assert t.rp.guard.policy == "skip"


@pytest.mark.parametrize("fields,message", [
    ({"steps": -1}, "steps must be >= 0"),
    ({"steps": 3, "eval_every": 0}, "eval_every must be >= 1"),
    ({"steps": 3, "checkpoint_every": 2}, "checkpoint_every needs checkpoint"),
    ({"steps": 3, "best_metric": "f1"}, "best_metric 'f1'"),
    ({"steps": 3, "nonfinite": "ignore"}, "FXPAR_NONFINITE='ignore'"),
])
def test_a_bad_configuration_says_what_to_change(fields, message):
    with pytest.raises((ValueError, fxpar.PlanError), match=message):
        fxpar.TrainConfig(**fields)
