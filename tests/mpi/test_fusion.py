"""Halo fusion under a real mpiexec (tests/mpi/cases/fusion_cases.py): exact vs one process
(float64) with fused groups on images and volumes, with PP, GEMS, DP and recompute; fewer
messages; the harness catches statistics taken over the border. Plus the groups the pass
forms and the plan field, without MPI."""

import pytest
import torch
import torchvision
from helpers.launch import Batch, cases_in, check

import fxpar
from fxpar.core.plan import PlanError
from fxpar.passes.halo_fusion import FUSION_KEY

CASES, NAMES = cases_in("fusion_cases.py")


BATCH = Batch(CASES, n=4, timeout=1200, share=True)


@pytest.fixture(scope="module")
def results():
    return BATCH.results()


@pytest.mark.mpi
@pytest.mark.parametrize("case", CASES, ids=NAMES)
def test_fusion_transparency(results, case):
    check(results, case)


def _groups(plan: fxpar.Plan, size: int = 256, tile: int = 0):
    m = torchvision.models.resnet18()
    p = fxpar.compile(m, plan, torch.empty(1, 3, size, size, device="meta"))
    return p.spatial.build(0, tile).meta[FUSION_KEY]


def test_groups_of_resnet18():
    groups = _groups(fxpar.Plan(spatial_parts=4, halo_fusion="all"))
    # the stem's 7x7 convolution with the max pool, and each basic block's two 3x3 convs
    # (conv - bn - relu - conv); the downsampling blocks' residual reads end no chain early
    assert groups[0].ops == ("conv2d_default", "max_pool2d_default")
    assert len(groups) == 9 and all(len(g.ops) == 2 for g in groups)
    # tile 0 of a 2x2 grid: the image border above and left (padding), a neighbour below
    # and right; conv3x3 + conv3x3 need 2 rows from the neighbour (1 + 1)
    assert groups[1].widths == (1, 2, 1, 2)
    assert _groups(fxpar.Plan(spatial_parts=4)) == ()


def test_auto_declines_when_the_border_costs_more():
    """At 2048^2 a 3x3 convolution's border row costs more than an exchange: auto fuses
    less there than at 64^2, where compute is tiny and messages dominate."""
    small = _groups(fxpar.Plan(spatial_parts=4, halo_fusion="auto"), size=64)
    large = _groups(fxpar.Plan(spatial_parts=4, halo_fusion="auto"), size=2048)
    assert len(small) > len(large), (small, large)


def test_plan_field():
    assert fxpar.Plan().halo_fusion == "off"
    with pytest.raises(PlanError, match=r"Plan.halo_fusion must be one of \('off', 'auto', "
                                        r"'all'\), got 'yes'"):
        fxpar.Plan(halo_fusion="yes")
