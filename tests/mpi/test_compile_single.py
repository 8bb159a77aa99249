"""The trivial plan (one rank) is exactly eager PyTorch: output, loss, every gradient,
parameters after 3 optimizer steps, BatchNorm buffers (float64, <= 1e-12)."""

import copy
import math
from pathlib import Path

import pytest
import torch
import torchvision
from helpers.equivalence import (
    assert_buffers,
    assert_grads_and_params,
    assert_same,
    reference_step,
)
from helpers.launch import PATHS

import fxpar
from fxpar import models
from fxpar.testing import run_cases


def _models():
    torch.manual_seed(0)
    yield "resnet18", torchvision.models.resnet18(num_classes=5), (8, 3, 48, 48)
    torch.manual_seed(0)
    yield "amoebanet", models.build("amoebanet", num_classes=5, num_layers=2,
                                    num_filters=16), (8, 3, 40, 40)
    torch.manual_seed(0)
    yield "resnet_v2", models.build("resnet_v2", depth=8, num_classes=5), (8, 3, 17, 19)


@pytest.mark.parametrize("name, model, shape", list(_models()), ids=["resnet18", "amoebanet",
                                                                       "resnet_v2"])
@pytest.mark.parametrize("microbatches", [1, 2])
def test_single_rank_program_equals_eager(name, model, shape, microbatches):
    model = model.double()
    ref = copy.deepcopy(model)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(shape, dtype=torch.float64, generator=g)
    y = torch.randint(0, 5, (shape[0],), generator=g)

    def sgd(params):
        return torch.optim.SGD(params, lr=0.01, momentum=0.9, weight_decay=1e-4)

    program = fxpar.compile(model, fxpar.Plan(microbatches=microbatches),
                            torch.empty(shape, dtype=torch.float64, device="meta"),
                            optimizer=sgd)
    assert program.world_size == 1
    rp = program.local()
    ref_opt = sgd(ref.parameters())
    for _ in range(3):
        loss = rp.train_step(x, y)
        ref_loss = reference_step(ref, ref_opt, x, y, chunks=microbatches)
        assert math.isfinite(loss) and abs(loss - ref_loss) <= 1e-12, (loss, ref_loss)
        assert_grads_and_params(dict(rp.named_parameters()), ref)
        assert_buffers(rp.state_dict(), ref)
    assert sorted(rp.full_state_dict()) == sorted(ref.state_dict())
    rp.eval()
    ref.eval()
    assert_same("eval output", rp.forward(x), ref(x))


def test_program_trains_the_compiled_model_in_place():
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.Flatten(),
                                torch.nn.LazyLinear(2))
    model(torch.zeros(1, 3, 6, 6))
    rp = fxpar.compile(model, fxpar.Plan(), (2, 3, 6, 6),
                       optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1)).local()
    before = model[0].weight.detach().clone()
    rp.train_step(torch.randn(2, 3, 6, 6), torch.tensor([0, 1]))
    assert not torch.equal(before, model[0].weight)
    assert [n for n, _ in rp.named_parameters()] == [n for n, _ in model.named_parameters()]


def test_batch_that_does_not_split_is_refused_before_any_work():
    rp = fxpar.compile(torch.nn.Conv2d(3, 2, 1), fxpar.Plan(microbatches=4), (4, 3, 2, 2),
                       loss_fn=lambda out, y: out.mean()).local()
    with pytest.raises(fxpar.PlanError, match="batch size 6 does not split into 4"):
        rp.train_step(torch.randn(6, 3, 2, 2), torch.zeros(6))


def test_compile_needs_an_example_input():
    with pytest.raises(TypeError, match="needs example_input"):
        fxpar.compile(torch.nn.Conv2d(3, 2, 1), fxpar.Plan())


CASES = Path(__file__).parent / "cases" / "single_cases.py"


@pytest.mark.mpi
def test_under_mpiexec_wrong_world_size_is_a_clear_error():
    res = run_cases([f"{CASES}::case_one_rank_plan_on_two_ranks"], n=2, timeout=120,
                    pythonpath=PATHS)
    for r in res.values():
        r.check()
