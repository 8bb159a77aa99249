"""Programs own their state (issue 17), under mpiexec on 2 ranks (run by
tests/mpi/test_isolation.py):
several compiled programs in one process train alternately, each exactly like its own single
process reference; closing a program gives back its gradient hooks, sub-communicators, tile
groups and fail-fast hook."""

from __future__ import annotations

import copy
import sys
import threading

import pytest
import torch
import torch.nn.functional as F
from helpers.equivalence import ATOL64, RTOL64, assert_buffers, assert_same, reference_step
from helpers.transparency import sgd
from torch import nn

import fxpar
from fxpar.comm import failfast
from fxpar.comm.mpi import Comm
from fxpar.comm.world import world
from fxpar.runtime.spatial.group import current

SHAPE = (4, 3, 16, 16)


def _spatial_net() -> nn.Module:
    """Every kind of tile op: halo convolutions, batch and group norm, max pool, a mean over
    the image."""
    return nn.Sequential(nn.Conv2d(3, 6, 3, padding=1), nn.BatchNorm2d(6), nn.ReLU(),
                         nn.Conv2d(6, 6, 3, padding=1), nn.GroupNorm(2, 6), nn.ReLU(),
                         nn.MaxPool2d(2), nn.Conv2d(6, 8, 3, padding=1),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4))


def _pipeline_net() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.MaxPool2d(2), nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8),
                         nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4))


def _strided_net() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.Conv2d(8, 8, 3, stride=2, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.AvgPool2d(2), nn.Flatten(), nn.Linear(8 * 4 * 4, 4))


class Trained:
    """One compiled program on ``comm`` and its one-process reference, stepped together."""

    def __init__(self, name: str, build, plan: fxpar.Plan, seed: int, comm: Comm) -> None:
        torch.manual_seed(seed)
        model = build().double()
        self.name, self.plan, self.seed = name, plan, seed
        self.ref = copy.deepcopy(model)
        self.ref_opt = sgd(self.ref.parameters())
        self.program = fxpar.compile(model, plan, SHAPE, optimizer=sgd)
        self.comm = comm

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(1000 * self.seed + step)
        return (torch.randn(SHAPE, dtype=torch.float64, generator=g),
                torch.randint(0, 4, (SHAPE[0],), generator=g))

    def step(self, rp: fxpar.RankProgram, step: int) -> None:
        x, y = self.batch(step)
        loss = rp.train_step(x, y)
        want = reference_step(self.ref, self.ref_opt, x, y, self.plan.chunks(), F.cross_entropy)
        where = f"{self.name} step {step}"
        assert_same(f"{where} loss", loss, want, ATOL64, RTOL64)
        ref_params = dict(self.ref.named_parameters())
        for name, p in rp.named_parameters():
            assert_same(f"{where} grad of {name}", p.grad, ref_params[name].grad, ATOL64, RTOL64)
            assert_same(f"{where} {name}", p.detach(), ref_params[name].detach(), ATOL64,
                        RTOL64)
        assert_buffers(rp.state_dict(), self.ref, ATOL64, RTOL64)

    def infer(self, rp: fxpar.RankProgram) -> None:
        x, _ = self.batch(99)
        rp.eval()
        self.ref.eval()
        out = rp.forward(x)
        if out is not None:
            assert_same(f"{self.name} eval forward", out, self.ref(x), ATOL64, RTOL64)
        rp.train()
        self.ref.train()


def _hooks(rp: fxpar.RankProgram) -> int:
    """Post-accumulate-grad hooks on this rank's parameters."""
    return sum(len(p._post_accumulate_grad_hooks or {}) for p in rp.parameters())


def case_programs_trained_alternately_each_match_one_process():
    """A: SP2 over the world; B: a 2-stage pipeline over the world; C: SP2 over the world in
    reverse rank order, so its tile group ``c0s0`` has the same name as A's but other ranks
    (a process-global table of tile groups would send A's halos to the wrong tiles)."""
    comm = world()
    reverse = comm.split(0, key=comm.size - 1 - comm.rank)
    before = (sys.excepthook, threading.excepthook)
    jobs = [Trained("A", _spatial_net, fxpar.Plan(spatial_parts=2, slice="vertical"), 1, comm),
            Trained("B", _pipeline_net, fxpar.Plan(stages=2, microbatches=2), 2, comm),
            Trained("C", _strided_net, fxpar.Plan(spatial_parts=2, slice="horizontal"), 3,
                    reverse)]
    with jobs[0].program.local(comm) as a, jobs[1].program.local(comm) as b, \
            jobs[2].program.local(reverse) as c:
        rps = [a, b, c]
        assert c.rank == comm.size - 1 - comm.rank
        for step in range(3):
            for job, rp in zip(jobs, rps, strict=True):
                job.step(rp, step)
        for job, rp in zip(jobs, rps, strict=True):
            job.infer(rp)
        assert _hooks(a) > 0 and _hooks(c) > 0  # the spatial stages sum gradients over tiles
        assert failfast.installed()
    assert all(rp.closed for rp in rps)
    assert [_hooks(rp) for rp in rps] == [0, 0, 0]
    assert not current(), "a tile group's communicator is still bound after the steps"
    assert (sys.excepthook, threading.excepthook) == before


def case_close_gives_back_hooks_communicators_and_failfast():
    comm = world()
    before = (sys.excepthook, threading.excepthook)
    trained = Trained("A", _spatial_net, fxpar.Plan(spatial_parts=2, slice="vertical"), 4,
                      comm)
    first = trained.program.local(comm)
    assert failfast.installed() and sys.excepthook is not before[0]
    per_program = _hooks(first)
    assert per_program == len(list(first.parameters()))
    # the same Program again: the two rank programs share their tile modules and parameters
    second = trained.program.local(comm)
    assert _hooks(first) == 2 * per_program
    subs = list(second._comms.values())
    assert subs, "a spatial program makes its tile and stage groups"
    x, y = trained.batch(0)
    second.train_step(x, y)
    second.close()
    second.close()  # idempotent
    from mpi4py import MPI

    assert all(s._c == MPI.COMM_NULL for s in subs)  # freed
    assert _hooks(first) == per_program
    assert failfast.installed()  # first still holds it
    with pytest.raises(RuntimeError, match="was closed"):
        second.train_step(x, y)
    first.train_step(x, y)  # its tile ops get its own communicators back
    first.close()
    assert _hooks(first) == 0
    assert not failfast.installed()
    assert (sys.excepthook, threading.excepthook) == before
    # an exception leaving the block keeps a multi-rank program open, fail-fast included, so
    # that (uncaught) it ends the whole job
    with pytest.raises(ValueError, match="injected"):
        with trained.program.local(comm) as third:
            raise ValueError("injected")
    assert not third.closed and failfast.installed()
    third.close()
    assert (sys.excepthook, threading.excepthook) == before
