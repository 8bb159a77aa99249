"""timm's EfficientViT-B0 on tiles under a real mpiexec (tests/mpi/cases/efficientvit_cases.py,
in the shared launch): its linear attention in an autocast-disabled block, under SP2 and SP4,
vs one process in float64 with at least 95 % of its work on tiles."""

import pytest
from helpers.launch import Batch, cases_in, check

CASES, NAMES = cases_in("efficientvit_cases.py")
pytestmark = pytest.mark.mpi


BATCH = Batch(CASES, n=4, timeout=600, share=True)


@pytest.fixture(scope="module")
def results():
    return BATCH.results()


@pytest.mark.parametrize("case", CASES, ids=NAMES)
def test_efficientvit_transparency(results, case):
    check(results, case)
