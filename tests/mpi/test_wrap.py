"""Circular padding and torch.roll over the spatial dims under a real mpiexec, exact vs one
process (float64): P = 2, 3, 4 over the three slicings with odd sizes, shifts and pads larger
than a tile, a volume, and a roll off by one that the check must catch (fxpar issue 40)."""

import pytest
from helpers.launch import Batch, cases_in, check

CASES, NAMES = cases_in("wrap_cases.py")
pytestmark = pytest.mark.mpi


BATCH = Batch(CASES, n=4, timeout=300, share=True)


@pytest.fixture(scope="module")
def results():
    return BATCH.results()


@pytest.mark.parametrize("case", CASES, ids=NAMES)
def test_wrap_transparency(results, case):
    check(results, case)
