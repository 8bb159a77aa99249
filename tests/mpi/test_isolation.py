"""Nothing process-global (issue 17): a rank program owns its tile groups, gradient hooks and
hold on the fail-fast hook, and ``close()`` gives them back; importing fxpar changes nothing.
The MPI half (programs trained alternately, each exact against one process) is in
cases/isolation_cases.py."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from helpers.launch import PATHS
from torch import nn

import fxpar
from fxpar.comm import failfast, launch
from fxpar.runtime.sync import Member, StageSync
from fxpar.testing import run_cases

CASES_FILE = Path(__file__).parent / "cases" / "isolation_cases.py"
CASES = [f"{CASES_FILE}::{n}" for n in (
    "case_programs_trained_alternately_each_match_one_process",
    "case_close_gives_back_hooks_communicators_and_failfast")]


def test_importing_fxpar_leaves_the_exception_hooks_alone():
    """Even in what looks like a multi-rank launch (where fail-fast would install)."""
    code = ("import sys, threading\n"
            "before = (sys.excepthook, threading.excepthook)\n"
            "import fxpar\n"
            "assert (sys.excepthook, threading.excepthook) == before, 'hooks changed'\n"
            "print('unchanged')\n")
    env = {**os.environ, "PMI_RANK": "0", "PMI_SIZE": "2", "OMP_NUM_THREADS": "1"}
    env.pop("FXPAR_FAILFAST", None)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and "unchanged" in out.stdout, out.stderr[-2000:]


@pytest.fixture
def multi_rank(monkeypatch):
    """Look like rank 0 of a 2-rank launch (fail-fast installs); put everything back after."""
    before = (sys.excepthook, threading.excepthook)
    for var in (*launch.VARIABLES, failfast.FAILFAST_ENV):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("PMI_RANK", "0")
    monkeypatch.setenv("PMI_SIZE", "2")
    monkeypatch.setattr(failfast, "_installed", False)
    monkeypatch.setattr(failfast, "_holders", 0)
    monkeypatch.setattr(failfast, "_previous", None)
    yield before
    sys.excepthook, threading.excepthook = before


def _program() -> fxpar.Program:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten(), nn.Linear(4 * 6 * 6, 2))
    return fxpar.compile(model, fxpar.Plan(), (2, 3, 8, 8))


ONE_RANK = SimpleNamespace(rank=0, size=1, tag_ub=2**31 - 1)
"""A communicator of one rank: a one-rank plan never communicates over it."""


def test_local_installs_failfast_and_close_puts_the_hooks_back(multi_rank):
    program = _program()
    a = program.local(ONE_RANK)
    assert sys.excepthook is failfast._hook and threading.excepthook is failfast._thread_hook
    b = program.local(ONE_RANK)
    a.close()
    a.close()  # idempotent: releases its hold once
    assert failfast.installed()  # b still holds it
    b.close()
    assert (sys.excepthook, threading.excepthook) == multi_rank
    with program.local(ONE_RANK) as rp:
        assert failfast.installed()
        rp.train_step(torch.randn(2, 3, 8, 8), torch.tensor([0, 1]))
    assert rp.closed and (sys.excepthook, threading.excepthook) == multi_rank
    with pytest.raises(RuntimeError, match="was closed"):
        rp.train_step(torch.randn(2, 3, 8, 8), torch.tensor([0, 1]))


def test_failfast_restores_what_was_there_and_leaves_a_later_hook(multi_rank):
    def mine(*_: object) -> None:
        pass

    sys.excepthook = mine
    assert failfast.install() and failfast.install()
    failfast.uninstall()
    assert sys.excepthook is failfast._hook
    failfast.uninstall()
    assert sys.excepthook is mine
    failfast.uninstall()  # more than were installed: nothing happens
    assert failfast.install()
    later = lambda *_: None  # noqa: E731 - someone replaced fail-fast's hook since
    sys.excepthook = later
    failfast.uninstall()
    assert sys.excepthook is later and not failfast.installed()


def test_inspection_programs_install_nothing(multi_rank):
    rp = _program().for_rank(0)
    assert not failfast.installed()
    rp.close()
    assert (sys.excepthook, threading.excepthook) == multi_rank


class Summing:
    """A stand-in 2-rank stage group: records the sums a StageSync starts."""

    rank, size = 0, 2

    def __init__(self) -> None:
        self.started = 0

    def iallreduce(self, t: torch.Tensor) -> SimpleNamespace:
        self.started += 1
        return SimpleNamespace(wait=lambda: None)


def test_stage_sync_hooks_count_only_its_own_steps_and_go_on_close():
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(3, 2), nn.Linear(2, 1))
    comm = Summing()
    sync = StageSync([Member(module, 0, 1, True)], comm, 1)  # type: ignore[arg-type]
    params = list(module.parameters())
    assert all(len(p._post_accumulate_grad_hooks) == 1 for p in params)
    module(torch.randn(4, 3)).sum().backward()  # not in a step of this program: ignored
    assert sync.seen == [0] * len(params) and comm.started == 0
    sync.reset()
    module(torch.randn(4, 3)).sum().backward()
    assert sync.seen == [1] * len(params) and comm.started == len(sync.buckets)
    sync.grads()
    sync.close()
    assert all(not p._post_accumulate_grad_hooks for p in params)


def test_a_dropped_stage_sync_takes_its_hooks_along():
    module = nn.Linear(3, 2)
    sync = StageSync([Member(module, 0, 1, True)], Summing(), 1)  # type: ignore[arg-type]
    assert module.weight._post_accumulate_grad_hooks
    del sync
    import gc

    gc.collect()
    assert not module.weight._post_accumulate_grad_hooks


@pytest.mark.mpi
def test_programs_under_mpiexec():
    results = run_cases(CASES, n=2, timeout=300, pythonpath=PATHS)
    for case in CASES:
        results[case].check()
        print(f"{case.split('::')[1]}: {results[case].seconds:.1f} s on rank 0")
