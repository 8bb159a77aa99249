"""Activation recompute under a real mpiexec (tests/cases/recompute_cases.py): exact vs one
process without recompute (float64) on plain, pipelined, spatial, GEMS, data-parallel and volume
plans; a recomputed stage saves nothing during its forward and a step exchanges the same
messages as without recompute. Plus the plan field and the memory estimate, without MPI."""

import pytest
from launch import cases_in, check, launch

import fxpar
from fxpar.compiler.memory import estimate
from fxpar.core.plan import PlanError
from fxpar.runtime.recompute import recomputed_stages

CASES, NAMES = cases_in("recompute_cases.py")


@pytest.fixture(scope="module")
def results():
    return launch(CASES, n=5, timeout=1200)


@pytest.mark.mpi
@pytest.mark.parametrize("case", CASES, ids=NAMES)
def test_recompute_transparency(results, case):
    check(results, case)


def test_plan_field_and_stages():
    assert fxpar.Plan().recompute == "never"
    assert recomputed_stages("always", 3) == {0, 1, 2}
    assert recomputed_stages("except_last", 3) == {0, 1}
    assert recomputed_stages("except_last", 1) == frozenset()
    assert recomputed_stages("never", 3) == frozenset()
    with pytest.raises(PlanError, match=r"Plan.recompute must be one of \('never', 'always', "
                                        r"'except_last'\), got 'sometimes'"):
        fxpar.Plan(recompute="sometimes")
    plan = fxpar.Plan(stages=2, recompute="except_last")
    assert fxpar.Plan(**plan.to_json()) == plan


def test_memory_estimate_keeps_one_microbatch_of_a_recomputed_stage():
    import torch
    from torch import nn

    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1),
                          nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 5))
    x = torch.empty(8, 3, 32, 32, device="meta")
    plain, always = (estimate(fxpar.compile(model, fxpar.Plan(stages=2, microbatches=4,
                                                              recompute=mode), x))
                     for mode in ("never", "always"))
    # GPipe keeps all 4 micro-batches' activations; recompute keeps one
    assert always[0].activations * 4 == plain[0].activations
    assert always[0].params == plain[0].params and always[0].received == plain[0].received
