"""The step guard, fault specs and the watchdog's limits and report, in one process (no MPI).
Whole jobs under mpiexec are in tests/mpi/test_faults.py and tests/mpi/test_fault_matrix.py."""

from __future__ import annotations

import copy
import math
import os
import threading

import pytest
import torch
from torch import nn

import fxpar
from fxpar.comm import failfast, watchdog
from fxpar.comm.watchdog import Limit, Position, Watchdog, parse_limit
from fxpar.core import faults
from fxpar.core.faults import Fault, FaultSpecError
from fxpar.core.schedule import Action, format_grid
from fxpar.runtime.inject import InjectedFault, Injector

SHAPE = (4, 3, 8, 8)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 2)).double()


def _program(model: nn.Module) -> fxpar.RankProgram:
    return fxpar.compile(model, fxpar.Plan(microbatches=2), SHAPE,
                         optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)).local()


def _batch(step: int, nan: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    x = torch.randn(SHAPE, dtype=torch.float64, generator=g)
    if nan:
        x[3, 1, 4, 4] = float("inf")  # one value of one sample, in the second micro-batch
    return x, torch.randint(0, 2, (SHAPE[0],), generator=g)


def _state(rp: fxpar.RankProgram) -> list[torch.Tensor]:
    out = [t.clone() for _, t in sorted(rp.state_dict().items())]
    return out + [rp.optimizer.state[p]["momentum_buffer"].clone()
                  for _, p in rp.named_parameters()]


@pytest.mark.parametrize("policy", ["stop", "skip"])
def test_a_nonfinite_step_is_undone_exactly(monkeypatch, policy):
    """An inf in one sample: the step leaves no trace (parameters, momentum, BatchNorm
    statistics and counts equal those of a run that never saw that batch)."""
    monkeypatch.setenv("FXPAR_NONFINITE", policy)
    rp = _program(_model())
    rp.train_step(*_batch(0))
    if policy == "stop":
        with pytest.raises(fxpar.NonFiniteError, match=r"^step 2: NaN or inf values \(rank 0: "
                                                        r"loss and gradients and buffers\)"):
            rp.train_step(*_batch(1, nan=True))
    else:
        assert not math.isfinite(rp.train_step(*_batch(1, nan=True)))
        assert rp.guard.skipped == 1
    rp.train_step(*_batch(2))
    ref = _program(_model())
    ref.train_step(*_batch(0))
    ref.train_step(*_batch(2))
    assert rp.guard.steps == 3 and ref.guard.steps == 2
    for a, b in zip(_state(rp), _state(ref), strict=True):
        assert torch.equal(a, b)


def test_the_undone_comparison_catches_a_tiny_difference():
    """The harness above compares bit for bit: one update of 1e-12 is seen."""
    rp, ref = _program(_model()), _program(_model())
    rp.train_step(*_batch(0))
    ref.train_step(*_batch(0))
    with torch.no_grad():
        next(ref.parameters()).view(-1)[0] += 1e-12
    assert any(not torch.equal(a, b) for a, b in zip(_state(rp), _state(ref), strict=True))


def test_off_does_not_check(monkeypatch):
    monkeypatch.setenv("FXPAR_NONFINITE", "off")
    rp = _program(_model())
    assert not math.isfinite(rp.train_step(*_batch(1, nan=True)))  # trained on, NaN and all
    assert not torch.isfinite(next(rp.parameters())).all()


def test_a_failed_step_refuses_more_steps():
    rp = _program(_model())
    x, y = _batch(0)
    with pytest.raises(RuntimeError, match="expected target"):
        rp.train_step(x, y.double())
    assert rp.guard.failed is not None and rp.guard.failed.startswith("step 1: ActionFailed")
    with pytest.raises(fxpar.ProgramFailed, match="rank 0's program failed earlier"):
        rp.train_step(x, y)


def test_fault_specs_parse_and_bad_ones_say_the_form():
    assert faults.parse("1:3:raise, 0:2:stall:30,2:1:corrupt-checkpoint:flip") == (
        Fault(1, 3, "raise"), Fault(0, 2, "stall", "30"),
        Fault(2, 1, "corrupt-checkpoint", "flip"))
    assert faults.parse("") == ()
    for bad, why in [("1:x:raise", "STEP >= 1"), ("1:0:raise", "STEP >= 1"),
                     ("1:2", "3 fields"), ("1:2:explode", "unknown kind"),
                     ("1:2:stall:soon", "seconds"), ("1:2:raise:now", "takes no ARG"),
                     ("1:2:corrupt-checkpoint:melt", "truncate or flip")]:
        with pytest.raises(FaultSpecError, match=why):
            faults.parse(bad)
    fs = faults.parse("1:3:slow-rank:0.5,1:2:nan-loss")
    assert faults.find(fs, 1, 5, "slow-rank") == Fault(1, 3, "slow-rank", "0.5")
    assert faults.find(fs, 1, 2, "slow-rank") is None
    assert faults.find(fs, 0, 2, "nan-loss") is None


def test_the_injector_fires_once_per_step_on_its_rank():
    inj = Injector(faults.parse("1:2:raise,1:3:nan-loss,0:2:raise"), rank=1)
    assert inj.hook(1) is None
    hook = inj.hook(2)
    with pytest.raises(InjectedFault, match="FXPAR_FAULT=1:2:raise: injected failure in step "
                                            "2, action 1F0"):
        hook(Action.from_str("1F0"))
    assert hook(Action.from_str("1F1")) is False  # once
    nan = inj.hook(3)
    assert nan(Action.from_str("1F0")) is True and nan(Action.from_str("1F1")) is False


def test_watchdog_limits():
    assert parse_limit("") == parse_limit("auto") == Limit()
    assert parse_limit("0") is None
    assert parse_limit("12.5") == Limit(fixed=12.5)
    assert parse_limit("auto:5") == Limit(floor=5.0, start=5.0)
    auto = Limit()
    assert auto.seconds(None) == 1800 and auto.seconds(2.0) == 300 and auto.seconds(60) == 600
    assert "auto: 10 x the slowest step, 60 s, at least 300 s" in auto.describe(60.0)
    for bad in ("ten minutes", "auto:0", "auto:x"):
        with pytest.raises(ValueError, match="give auto"):
            parse_limit(bad)
    with pytest.raises(ValueError, match="must be >= 0"):
        parse_limit("-1")


def test_watchdog_auto_limit_follows_the_slowest_step():
    dog = Watchdog(Limit(floor=0.1, start=5.0, factor=2.0), lambda: 0)
    assert dog.limit.seconds(dog.slowest) == 5.0
    dog.step_began(1)
    dog.step_ended(0.3)
    dog.step_began(2)
    dog.step_ended(0.2)
    assert dog.limit.seconds(dog.slowest) == pytest.approx(0.6)


def test_watchdog_report_names_every_rank_and_marks_the_grid(capfd, monkeypatch):
    """One process stands in for rank 0; the peers' answers are Positions."""
    fired = threading.Event()
    monkeypatch.setattr(failfast, "_abort", lambda code: (fired.set(), threading.Event().wait()))
    schedule = {0: [Action.from_str(a) for a in ("0F0", "0SEND_F0", "0B0", "STEP")],
                1: [Action.from_str(a) for a in ("1RECV_F0", "1F0", "1B0", "STEP")]}
    dog = Watchdog(Limit(fixed=0.2), lambda: 0)
    dog.grid = lambda here: format_grid(schedule, here=here)
    peer = Position(1, 2, True, "1F0", 1, 7.0, "")
    monkeypatch.setattr(dog, "positions", lambda: {0: dog.position(), 1: peer, 2: None})
    dog.step_began(2)
    dog.doing("0B0", 2)
    with dog.watching(lambda: "receive of (2, 4) float64 from rank 1 (tag 3)"):
        assert fired.wait(5.0)
    err = capfd.readouterr().err
    assert "fxpar watchdog: rank 0 waited 0 s in receive of (2, 4) float64 from rank 1 " \
           "(tag 3) (while running action 0B0)" in err
    assert "The limit was 0.2 s (FXPAR_WATCHDOG=0.2)" in err
    assert "  rank 0: step 2, action 0B0: waiting 0 s in receive of" in err
    assert "  rank 1: step 2, action 1F0: running 7 s, not communicating" in err
    assert "  rank 2: no answer in 3 s (dead, exited" in err
    assert "0B0 <-- HERE" in err and "1F0 <-- HERE" in err


def test_a_long_grid_shows_the_rows_around_the_marks():
    acts = [Action.from_str(f"0F{i}") for i in range(60)]
    text = format_grid({0: acts, 1: copy.copy(acts)}, here={0: 30, 1: 31})
    rows = text.splitlines()
    assert rows[1] == "..." and rows[-1] == "..." and len(rows) < 15
    assert "0F30 <-- HERE" in text and "0F0 " not in text


def test_oversubscription_is_read_from_the_launcher():
    cores = len(os.sched_getaffinity(0))
    mpich = {"PMI_RANK": "0", "PMI_SIZE": "64"}
    assert failfast.oversubscribed({**mpich, "MPI_LOCALNRANKS": str(cores + 1)})
    assert not failfast.oversubscribed({**mpich, "MPI_LOCALNRANKS": str(cores)})
    torchrun = {"TORCHELASTIC_RUN_ID": "x", "RANK": "0", "WORLD_SIZE": "64"}
    assert failfast.oversubscribed({**torchrun, "LOCAL_WORLD_SIZE": str(cores + 1)})
    assert not failfast.oversubscribed({})


def test_watchdog_module_is_off_by_zero(monkeypatch):
    monkeypatch.setattr(watchdog, "_watchdog", None)
    monkeypatch.setattr(watchdog, "_configured", False)
    watchdog.set_watchdog(0)
    assert watchdog.current() is None
    watchdog.set_watchdog("auto:7")
    dog = watchdog.current()
    assert dog is not None and dog.limit == Limit(floor=7.0, start=7.0)
    watchdog.set_watchdog(None)
    assert watchdog.current() is None
