"""fxpar.comm.failfast without MPI: the start-up agreement's decisions and messages, the watchdog's
firing and its message, the hook's installation rules. (What whole jobs do is in
tests/mpi/test_faults.py, under mpiexec.)"""

from __future__ import annotations

import threading
import time

import pytest
import torch
from torch import nn

import fxpar
from fxpar.comm import failfast, launch, watchdog
from fxpar.comm.failfast import Disagreement, agree


class Gathered:
    """A stand-in communicator whose allgather returns what the ranks would send."""

    def __init__(self, everyone: list[object]) -> None:
        self.everyone = everyone

    def allgather_object(self, obj: object) -> list[object]:
        return self.everyone


def test_agreeing_ranks_pass():
    fp = {"plan": "a", "initial weights": "w"}
    agree(Gathered([(fp, None), (dict(fp), None)]), fp)


def test_one_rank_error_stops_every_rank_naming_it():
    with pytest.raises(Disagreement, match=r"^on rank 2: no such folder \(every rank stops"):
        agree(Gathered([({"plan": "a"}, None)] * 2 + [(None, "no such folder")]), {"plan": "a"})


def test_the_same_error_everywhere_is_just_that_error():
    with pytest.raises(Disagreement) as e:
        agree(Gathered([(None, "Plan.stages must be >= 1")] * 3), None, "Plan.stages must be >= 1")
    assert str(e.value) == "Plan.stages must be >= 1"


def test_different_errors_are_listed_per_rank():
    with pytest.raises(Disagreement, match="on rank 0: A; on rank 1: B"):
        agree(Gathered([(None, "A"), (None, "B")]), None, "A")


def test_differing_fingerprints_name_the_parts_and_the_rank_groups():
    a = {"plan": "p", "initial weights": "w0"}
    b = {"plan": "p", "initial weights": "w1"}
    with pytest.raises(Disagreement, match=r"initial weights differ: ranks 0, 2 vs rank 1\)"):
        agree(Gathered([(a, None), (b, None), (a, None)]), a)


def _program(seed: int) -> fxpar.Program:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Flatten(),
                          nn.Linear(4 * 6 * 6, 2))
    return fxpar.compile(model, fxpar.Plan(stages=2), (4, 3, 8, 8))


def test_fingerprint_tells_seeds_and_plans_apart():
    a, b, c = _program(0).fingerprint(), _program(0).fingerprint(), _program(1).fingerprint()
    assert a == b
    assert [k for k in a if a[k] != c[k]] == ["initial weights"]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Flatten(),
                          nn.Linear(4 * 6 * 6, 2))
    d = fxpar.compile(model, fxpar.Plan(stages=2, microbatches=2), (4, 3, 8, 8)).fingerprint()
    assert {k for k in a if a[k] != d[k]} == {"plan", "schedule", "stage transfers"}


@pytest.fixture
def fired(monkeypatch) -> threading.Event:
    """Set when the watchdog aborts (standing in for MPI_Abort; its thread then parks)."""
    event = threading.Event()

    def abort(code: int) -> None:
        event.set()
        threading.Event().wait()

    monkeypatch.setattr(failfast, "_abort", abort)
    return event


def test_watchdog_fires_on_a_long_wait_with_what_and_where(capfd, monkeypatch, fired):
    monkeypatch.setattr(failfast, "_rank_size", lambda: (3, 4))
    watchdog.set_watchdog(0.3)
    try:
        with watchdog.watching(lambda: "receive of (2, 8) float64 from rank 1 (tag 5)"):
            watchdog.doing("1B0")
            time.sleep(0.1)  # short waits never fire
        assert not fired.is_set()
        with watchdog.watching(lambda: "receive of (2, 8) float64 from rank 1 (tag 5)"):
            assert fired.wait(5.0)
    finally:
        watchdog.set_watchdog(None)
    err = capfd.readouterr().err
    assert "fxpar watchdog: rank 3 waited 0 s in receive of (2, 8) float64 from rank 1 " \
           "(tag 5) (while running action 1B0)" in err


def test_watchdog_is_a_shared_no_op_when_off():
    watchdog.set_watchdog(None)
    assert watchdog.watching(lambda: "x") is watchdog.watching(lambda: "y")
    with pytest.raises(ValueError, match="must be >= 0"):
        watchdog.set_watchdog(-1)


def test_bad_watchdog_environment_says_what_to_give(monkeypatch):
    monkeypatch.setenv("FXPAR_WATCHDOG", "ten minutes")
    monkeypatch.setattr(watchdog, "_configured", False)
    with pytest.raises(ValueError, match="FXPAR_WATCHDOG='ten minutes': give auto"):
        watchdog.configure()


def test_hook_is_installed_only_in_multi_rank_launches(monkeypatch):
    for var in launch.VARIABLES:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(failfast, "_installed", False)
    assert failfast.install() is False  # plain python: exceptions behave as usual
    monkeypatch.setenv("PMI_RANK", "0")
    monkeypatch.setenv("PMI_SIZE", "1")
    assert failfast.install() is False  # a one-rank job has nobody to leave waiting
    monkeypatch.setenv("FXPAR_FAILFAST", "0")
    monkeypatch.setenv("PMI_SIZE", "2")
    assert failfast.install() is False  # turned off


def test_watchdog_covers_the_torch_distributed_backend(capfd, monkeypatch, fired):
    from fxpar.comm.torch_dist import Work

    class Stuck:  # a process-group request whose peer never comes
        def wait(self) -> None:
            assert fired.wait(5.0)

    monkeypatch.setattr(failfast, "_rank_size", lambda: (1, 2))
    watchdog.set_watchdog(0.3)
    try:
        Work(Stuck(), None, lambda: "receive of (4,) float32 from rank 0 (tag 3)").wait()
    finally:
        watchdog.set_watchdog(None)
    assert "fxpar watchdog: rank 1 waited 0 s in receive of (4,) float32 from rank 0 (tag 3)" \
        in capfd.readouterr().err
