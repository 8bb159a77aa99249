"""HaloNet's halo attention on tiles under a real mpiexec, exact vs one process in float64
(tests/mpi/cases/halonet_cases.py, in the shared 4-rank launch): a small HaloAttn block at
stride 1 and 2, overlapping unfold windows on uneven tiles, timm's halonet26t at 256 x 256
under SP2 and SP4 with at least 95 % of its work on tiles; a halo one column short is
caught."""

import pytest
from helpers.launch import Batch, cases_in, check

CASES, NAMES = cases_in("halonet_cases.py")
pytestmark = pytest.mark.mpi


BATCH = Batch(CASES, n=4, timeout=600, share=True)


@pytest.fixture(scope="module")
def results():
    return BATCH.results()


@pytest.mark.parametrize("case", CASES, ids=NAMES)
def test_halonet_exact(results, case):
    check(results, case)
