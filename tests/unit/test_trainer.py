"""fxpar.Trainer on one process: the loop trains exactly as plain PyTorch does (float64), its
validation, checkpoints, metrics and resume, and the configuration's checks."""

import json

import pytest
import torch
import torch.nn.functional as F
from helpers.equivalence import assert_same, reference_step
from helpers.recipe import train_plain
from torch import nn

import fxpar
from fxpar.data.data import Synthetic
from fxpar.program import checkpoint
from fxpar.train import schedules
from fxpar.train.ema import EMA, decay_at
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
    ({"steps": 3, "lr_schedule": 0.1}, "lr_schedule must be a factory"),
    ({"steps": 3, "schedule_every": "batch"}, "schedule_every 'batch': use 'step' or 'epoch'"),
    ({"steps": 3, "schedule_every": "epoch", "lr_schedule": schedules.constant(1)},
     "schedule_every='epoch' needs lr_schedule and steps_per_epoch"),
    ({"steps": 3, "steps_per_epoch": 0}, "steps_per_epoch must be >= 1"),
    ({"steps": 3, "ema": 1.0}, r"ema 1.0: give a decay in \[0, 1\)"),
    ({"steps": 3, "ema_eval": True}, "ema_eval validates with the averaged weights: give ema"),
    ({"steps": 3, "clip_grad": 0.0}, "clip_grad must be > 0"),
    ({"steps": 3, "clip_value": -1.0}, "clip_value must be > 0"),
    ({"steps": 3, "clip_grad": 1.0, "clip_value": 1.0}, "not both"),
    ({"steps": 3, "accumulate": 0}, "accumulate must be >= 1"),
    ({"steps": 3, "accumulate": 2}, "steps=3 with accumulate=2: make it a multiple of 2"),
    ({"steps": 4, "accumulate": 2, "checkpoint": "ck", "checkpoint_every": 3},
     "checkpoint_every=3 with accumulate=2"),
])
def test_a_bad_configuration_says_what_to_change(fields, message):
    with pytest.raises((ValueError, TypeError, fxpar.PlanError), match=message):
        fxpar.TrainConfig(**fields)


def _adamw(params):
    return torch.optim.AdamW(params, lr=0.02, weight_decay=0.05)


RECIPE = {"lr_schedule": schedules.warmup_cosine(3, warmup=1), "ema": 0.9, "clip_grad": 0.5,
          "accumulate": 2}


def _recipe_trainer(model, steps, **kw):
    config = fxpar.TrainConfig(steps=steps, **{**RECIPE, **kw})
    program = fxpar.compile(model, fxpar.Plan(microbatches=2), SHAPE, optimizer=_adamw)
    return fxpar.Trainer(program.local(), config, _batches)


def test_the_recipe_trains_exactly_as_plain_pytorch(capsys):
    """AdamW, warm-up + cosine, EMA, clipping by norm and accumulation over 2 batches: every
    weight, the optimizer's and scheduler's state and the average equal one process's."""
    model, ref = _model(), _model()
    t = _recipe_trainer(model, 6, log_every=1)
    t.fit()
    plain = train_plain(ref, _adamw, _batches, 6, chunks=2, accumulate=2,
                        schedule=RECIPE["lr_schedule"], ema=0.9, clip_grad=0.5)
    for (name, got), want in zip(model.state_dict().items(), ref.state_dict().values(),
                                 strict=True):
        assert_same(name, got, want, 1e-12, 1e-10)
    for name, p in t.rp.named_parameters():
        want = plain.optimizer.state[dict(ref.named_parameters())[name]]
        for k, v in t.rp.optimizer.state[p].items():
            assert_same(f"{k} of {name}", v, want[k], 1e-12, 1e-10)
    assert t.recipe.schedule.scheduler.state_dict() == plain.scheduler.state_dict()
    assert t.recipe.ema.updates == 3
    full = t.recipe.ema.full_state_dict()
    assert list(full) == list(ref.state_dict())
    for k, v in full.items():
        assert_same(f"ema {k}", v, plain.ema[k], 1e-12, 1e-10)
    lines = [x for x in capsys.readouterr().out.splitlines() if x.startswith("step")]
    assert len(lines) == 6 and "  lr 0.01  " in lines[0] and "grad norm" in lines[1]
    assert f"lr {plain.lrs[1]:.4g}" in lines[2]


def test_a_schedule_per_epoch_steps_after_each_epoch():
    t = _trainer(_model(), fxpar.TrainConfig(
        steps=6, steps_per_epoch=2, schedule_every="epoch",
        lr_schedule=schedules.polynomial(3, power=1.0)))
    t.fit()
    assert t.recipe.schedule.scheduler.last_epoch == 3
    assert t.recipe.lr == 0.0  # after the third of three epochs: (1 - 3/3) * lr


def test_the_ema_decay_warms_up_as_documented():
    assert decay_at(0.999, 0) == 0.1 and decay_at(0.999, 8) == 0.5
    assert decay_at(0.9, 1000) == 0.9 and decay_at(0.5, 0, warmup=False) == 0.5


def test_validation_swaps_the_average_in_and_back():
    model = _model()
    t = _recipe_trainer(model, 2)
    t.fit(0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with t.recipe.evaluating():  # no ema_eval: the weights as trained
        assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    ema = t.recipe.ema
    with ema.applied():
        for k, v in model.state_dict().items():
            assert torch.equal(v, ema.shadow[k]), k
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_resume_continues_the_schedule_and_the_average_exactly(tmp_path):
    straight = _recipe_trainer(_model(), 8)
    straight.fit()
    first = _recipe_trainer(_model(), 4, checkpoint=tmp_path)
    first.fit()
    again = _recipe_trainer(_model(), 8, resume=tmp_path)
    again.fit()
    for (k, a), b in zip(again.rp.state_dict().items(), straight.rp.state_dict().values(),
                         strict=True):
        assert torch.equal(a, b), k
    s, r = straight.recipe, again.recipe
    assert r.schedule.scheduler.state_dict() == s.schedule.scheduler.state_dict()
    assert r.ema.updates == s.ema.updates == 4
    for k, v in r.ema.shadow.items():
        assert torch.equal(v, s.ema.shadow[k]), k
    assert list(checkpoint.export(tmp_path, ema=True)) == list(first.rp.state_dict())


def test_resume_without_the_saved_recipe_state_says_what_to_change(tmp_path, capsys):
    _trainer(_model(), fxpar.TrainConfig(steps=2, checkpoint=tmp_path)).fit()
    t = _recipe_trainer(_model(), 4, resume=tmp_path)
    assert t.resume() is None
    err = capsys.readouterr().err
    assert "saved without the scheduler and ema state" in err and "--lr-schedule" in err
    with pytest.raises(fxpar.program.checkpoint.CheckpointError, match="no moving average"):
        checkpoint.export(tmp_path, ema=True)


def test_a_rank_without_parameters_keeps_the_same_schedule():
    """The placeholder optimizer: the factory's hyper-parameters, the same LR sequence,
    its state saved and restored."""
    program = fxpar.compile(_model(), fxpar.Plan(), SHAPE, optimizer=_adamw)
    rp = program.local()
    sched = schedules.RankSchedule(rp, schedules.one_cycle(5))
    rp.optimizer = None
    empty = schedules.RankSchedule(rp, schedules.one_cycle(5))
    assert empty.placeholder is not None
    for _ in range(3):
        sched.optimizer.step()
        sched.step()
        empty.step()
        assert empty.lr == sched.lr
        assert empty.optimizer.param_groups[0]["betas"] == sched.optimizer.param_groups[0][
            "betas"]
    again = schedules.RankSchedule(rp, schedules.one_cycle(5))
    again.load_state_dict(empty.state_dict())
    again.step()
    empty.step()
    assert again.lr == empty.lr


@pytest.mark.parametrize("make, message", [
    (lambda: schedules.warmup_cosine(0), "total_steps=0"),
    (lambda: schedules.warmup_cosine(4, warmup=4), "warmup=4 with total_steps=4"),
    (lambda: schedules.polynomial(4, power=0), "power=0"),
    (lambda: schedules.one_cycle(4, pct_start=1.0), "pct_start=1.0"),
    (lambda: schedules.by_name("step", 4), "--lr-schedule 'step'"),
])
def test_bad_schedules_say_what_to_change(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_a_schedule_of_another_kind_is_refused():
    rp = fxpar.compile(_model(), fxpar.Plan(), SHAPE, optimizer=_adamw).local()
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau
    with pytest.raises(TypeError, match="ReduceLROnPlateau needs one"):
        schedules.RankSchedule(rp, plateau)
    with pytest.raises(ValueError, match="EMA decay 1.5"):
        EMA(rp, 1.5)
