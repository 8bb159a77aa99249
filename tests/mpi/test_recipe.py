"""The step between backward and the optimizer: clipping by the whole model's norm and by
value, the before-optimizer-step hook, accumulation over several global batches.

Under a real mpiexec (tests/mpi/cases/recipe_cases.py, 4 ranks, sharing the launch of the other
files whose cases take the ranks they need): float64, compiled vs one process, under SP2, SP4,
SP2+PP2, SP2+DP2 and GEMS, and a per-rank clipping mutation the check catches. In one process:
the same against torch for a micro-batched program, a NaN inside an accumulation cycle, misuse."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from helpers.equivalence import ATOL64, RTOL64, assert_same, reference_step
from helpers.launch import Batch, cases_in, check
from torch import nn

import fxpar
from fxpar.runtime.guard import NonFiniteError

CASES, NAMES = cases_in("recipe_cases.py")


BATCH = Batch(CASES, n=4, timeout=300, share=True)


@pytest.fixture(scope="module")
def results():
    return BATCH.results()


@pytest.mark.mpi
@pytest.mark.parametrize("case", CASES, ids=NAMES)
def test_recipe_transparency(results, case):
    check(results, case)


# -- one process ---------------------------------------------------------------------------------
SHAPE = (4, 3, 8, 8)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 2)).double()


def _sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _program(model: nn.Module, **plan) -> fxpar.RankProgram:
    return fxpar.compile(model, fxpar.Plan(microbatches=2, **plan), SHAPE,
                         optimizer=_sgd).local()


def _batch(i: int, nan: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(i)
    x = torch.randn(SHAPE, dtype=torch.float64, generator=g)
    if nan:
        x[3, 1, 4, 4] = float("inf")
    return x, torch.randint(0, 2, (SHAPE[0],), generator=g)


def _same_state(rp: fxpar.RankProgram, ref: nn.Module, atol: float = ATOL64) -> None:
    ref_params = dict(ref.named_parameters())
    for name, p in rp.named_parameters():
        assert_same(name, p.detach(), ref_params[name].detach(), atol, RTOL64)
        assert_same(f"grad of {name}", p.grad, ref_params[name].grad, atol, RTOL64)
    for name, b in rp.state_dict().items():
        assert_same(name, b, ref.state_dict()[name], atol, RTOL64)


def test_accumulated_clipped_steps_equal_one_process():
    model = _model()
    ref = copy.deepcopy(model)
    rp, opt = _program(model), _sgd(ref.parameters())
    norms: list[float] = []
    rp.before_optimizer_step.append(lambda rp: rp.clip_grad_norm_(0.05))
    clip = lambda m: norms.append(float(nn.utils.clip_grad_norm_(m.parameters(), 0.05)))  # noqa: E731
    for i in range(6):  # two cycles of 3
        loss = rp.train_step(*_batch(i), accumulate=3)
        want = reference_step(ref, opt, *_batch(i), 2, F.cross_entropy, accumulate=3,
                              call=i % 3, before_step=clip)
        assert_same(f"loss {i}", loss, want, ATOL64, RTOL64)
        assert rp.accumulation.done == (i + 1) % 3
        if i % 3 == 2:
            _same_state(rp, ref, 1e-8)
            assert norms[-1] > 0.05 and abs(rp.grad_norm - norms[-1]) <= 1e-10 * norms[-1]


@pytest.mark.parametrize("policy", ["stop", "skip"])
def test_a_nan_in_a_cycle_drops_the_cycle(monkeypatch, policy):
    monkeypatch.setenv("FXPAR_NONFINITE", policy)
    model = _model()
    ref = copy.deepcopy(model)
    rp, opt = _program(model), _sgd(ref.parameters())
    hooks: list[int] = []
    rp.before_optimizer_step.append(lambda rp: hooks.append(rp.guard.steps))
    rp.train_step(*_batch(0), accumulate=3)
    if policy == "stop":
        with pytest.raises(NonFiniteError):
            rp.train_step(*_batch(1, nan=True), accumulate=3)
    else:
        assert not math.isfinite(rp.train_step(*_batch(1, nan=True), accumulate=3))
    assert (rp.accumulation.done, rp.accumulation.dropped, hooks) == (0, 1, [])
    # as one process that ran batch 0 (its BatchNorm statistics moved) and dropped its
    # gradients: the next three calls are a new cycle
    reference_step(ref, opt, *_batch(0), 2, F.cross_entropy, accumulate=3, call=0)
    for i in range(2, 5):
        assert_same(f"loss {i}", rp.train_step(*_batch(i), accumulate=3),
                    reference_step(ref, opt, *_batch(i), 2, F.cross_entropy, accumulate=3,
                                   call=i - 2), ATOL64, RTOL64)
    assert hooks == [4]  # in the fifth call (four completed)
    _same_state(rp, ref)


def test_accumulate_stays_the_same_within_a_cycle():
    rp = _program(_model())
    rp.train_step(*_batch(0), accumulate=2)
    with pytest.raises(ValueError, match="in the middle of a cycle of 2 calls"):
        rp.train_step(*_batch(1), accumulate=3)
    for bad in (0, 1.5, True):
        with pytest.raises(ValueError, match="an int >= 1"):
            rp.train_step(*_batch(1), accumulate=bad)
    rp.train_step(*_batch(1), accumulate=2)  # refused before anything ran: trains on
    assert rp.accumulation.done == 0 and rp.guard.steps == 2
    with pytest.raises(ValueError, match="norm_type"):
        rp.clip_grad_norm_(1.0, 0.0)


def _norm(rp: fxpar.RankProgram) -> float:
    return float(torch.stack([p.grad.double().norm() for p in rp.parameters()]).norm())


def test_fp16_clips_the_unscaled_gradients_and_an_overflow_skips_the_cycle():
    model = _model().float()
    unclipped = _program(copy.deepcopy(model), precision="fp16")
    unclipped.before_optimizer_step.append(lambda rp: rp.clip_grad_norm_(float("inf")))
    rp = _program(model, precision="fp16")
    rp.before_optimizer_step.append(lambda rp: rp.clip_grad_norm_(1e-3))
    x, y = _batch(0)
    for p in (unclipped, rp):
        p.train_step(x.float(), y)
    scale = rp.loss_scale.scale
    assert scale == 2.0 ** 16
    # the norm is that of the unscaled gradients, and they are clipped to max_norm
    assert abs(unclipped.grad_norm - _norm(unclipped)) <= 1e-5 * _norm(unclipped)
    assert abs(rp.grad_norm - unclipped.grad_norm) <= 1e-5 * unclipped.grad_norm
    assert rp.grad_norm > 1e-3 and abs(_norm(rp) - 1e-3) <= 1e-5 * 1e-3
    # an inf in the first call of two: the cycle's step is skipped at its last call, once
    before = [p.detach().clone() for p in rp.parameters()]
    xs = [_batch(1, nan=True)[0].float(), _batch(2)[0].float()]
    for xi in xs:
        rp.train_step(xi, y, accumulate=2)
    assert rp.loss_scale.scale == scale / 2 and rp.loss_scale.skipped == 1
    assert rp.accumulation.dropped == 1 and rp.grad_norm is None
    assert all(torch.equal(a, p) for a, p in zip(before, rp.parameters(), strict=True))
