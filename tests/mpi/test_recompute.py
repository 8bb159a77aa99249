"""Activation recompute under a real mpiexec (tests/mpi/cases/recompute_cases.py): exact vs one
process without recompute (float64) on plain, pipelined, spatial, GEMS, data-parallel and volume
plans; a recomputed stage saves nothing during its forward and a step exchanges the same
messages as without recompute. Plus the plan field and the memory estimate, without MPI."""

import pytest
from helpers.launch import Batch, cases_in, check

import fxpar
from fxpar.core.plan import PlanError
from fxpar.perf.memory import estimate
from fxpar.runtime.recompute import recomputed_stages

CASES, NAMES = cases_in("recompute_cases.py")


BATCH = Batch(CASES, n=5, timeout=1200, share=True)


@pytest.fixture(scope="module")
def results():
    return BATCH.results()


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
                                        r"'except_last', 'auto'\), got 'sometimes'"):
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


def _three_convs():
    from torch import nn

    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1),
                         nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 5))


def test_auto_recomputes_what_the_budget_needs_and_warns_when_nothing_fits(tmp_path):
    import warnings

    import torch

    from fxpar.perf.memory import MemoryWarning, memory_table
    from fxpar.program.loader import load

    x = torch.empty(8, 3, 64, 64, device="meta")
    model = _three_convs()

    def compiled(**kw):
        return fxpar.compile(model, fxpar.Plan(stages=2, microbatches=4, **kw), x)

    never = estimate(compiled())
    always = estimate(compiled(recompute="always"))
    # a budget between the two: only the ranks over it get recompute
    over = max(never, key=lambda m: m.total)
    under = min(never, key=lambda m: m.total)
    budget = (under.total + over.total) // 2
    assert always[over.rank].total < budget < over.total and under.total <= budget
    program = compiled(recompute="auto", memory_per_rank=budget)
    stage_of = {m.rank: program.rank_map.roles_of(m.rank)[0].stage for m in never}
    assert program.recompute == {stage_of[over.rank]}
    assert all(m.total <= budget for m in estimate(program))
    assert "recomputed stages (auto): " in memory_table(program)
    assert compiled(recompute="auto", memory_per_rank=10**12).recompute == frozenset()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        tight = compiled(recompute="auto", memory_per_rank=1000)
    assert tight.recompute == {0, 1}
    assert [str(w.message) for w in seen if w.category is MemoryWarning][0].startswith(
        "memory_per_rank=1000 B: rank ")
    # the choice is part of the saved program
    program.save(tmp_path / "job")
    assert load(tmp_path / "job", rank=0).program.recompute == program.recompute
    with pytest.raises(PlanError, match='recompute="auto" chooses the stages to recompute '
                                        'for a memory budget: give memory_per_rank'):
        fxpar.Plan(recompute="auto")
    with pytest.raises(PlanError, match="Plan.memory_per_rank must be a number of bytes"):
        fxpar.Plan(memory_per_rank=-1)


def test_memory_per_rank_flag_takes_units():
    import argparse

    from fxpar.cli.args import bytes_arg

    assert bytes_arg("4GiB") == 4 * 2**30 and bytes_arg("512MiB") == 512 * 2**20
    assert bytes_arg("1.5G") == int(1.5 * 2**30) and bytes_arg("4GB") == 4 * 10**9
    assert bytes_arg("1000") == 1000
    with pytest.raises(argparse.ArgumentTypeError, match="is not a size"):
        bytes_arg("lots")


def test_checkpoint_segments_lower_the_memory_estimate():
    """ResNet-50 at 1024^2 on one rank: 8 checkpoint segments keep the boundaries and one
    segment instead of every activation (the estimate; tools/bench_memory measures it)."""
    import torch
    import torchvision

    from fxpar.runtime.segments import cut

    model = torchvision.models.resnet50(num_classes=10).to("meta")
    x = torch.empty(1, 3, 1024, 1024, device="meta")
    plain, seg = (estimate(fxpar.compile(model, fxpar.Plan(recompute_segments=k), x))[0]
                  for k in (1, 8))
    assert seg.activations < plain.activations / 2, (seg.activations, plain.activations)
    assert seg.params == plain.params
    with pytest.raises(PlanError, match="recompute_segments must be an integer >= 1"):
        fxpar.Plan(recompute_segments=0)
    program = fxpar.compile(model, fxpar.Plan(), x)
    segments = cut(program.graph.modules[0], 8)
    assert len(segments) == 8
    body = [n for s in segments for n in s.nodes]
    assert len(body) == len(set(body))  # every node in exactly one segment, in order
