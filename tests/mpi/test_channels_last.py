"""``Plan(channels_last=True)`` under a real mpiexec, exact vs one process in the default layout
(tests/mpi/cases/layout_cases.py), and the plan field."""

import pytest
from helpers.launch import Batch, cases_in, check

import fxpar
from fxpar.core.plan import PlanError

CASES, NAMES = cases_in("layout_cases.py")


BATCH = Batch(CASES, n=4, timeout=900)


@pytest.fixture(scope="module")
def results():
    return BATCH.results()


@pytest.mark.mpi
@pytest.mark.parametrize("case", CASES, ids=NAMES)
def test_channels_last_transparency(results, case):
    check(results, case)


def test_plan_field():
    assert fxpar.Plan().channels_last is False
    with pytest.raises(PlanError, match="Plan.channels_last must be True or False, got 1"):
        fxpar.Plan(channels_last=1)


def test_the_plan_lays_out_convolution_weights_channels_last():
    import torch
    import torchvision

    x = torch.empty(2, 3, 32, 32, device="meta")
    for flag in (False, True):
        model = torchvision.models.resnet18(num_classes=5)
        with fxpar.compile(model, fxpar.Plan(channels_last=flag), x).local() as rp:
            weights = [p for _, p in rp.named_parameters() if p.dim() == 4 and p[0, 0].numel() > 1]
            assert weights and all(
                p.is_contiguous(memory_format=torch.channels_last) == flag
                and p.is_contiguous() != flag for p in weights), flag
            out = rp.forward(torch.randn(2, 3, 32, 32))
            assert out.shape == (2, 5)
