"""More ops on tiles (issue 40, item 4) under a real mpiexec, exact vs one process (float64):
global response norms, adaptive max pooling, pixel (un)shuffles, timm's SpaceToDepth, on odd
images and uneven tiles at P = 2 and 4 and on a volume; ConvNeXt-V2 and TResNet from timm under
SP2 and SP4 with their share of work on tiles; a norm missing one cell is caught
(tests/mpi/cases/ops40_cases.py)."""

import pytest
from helpers.launch import Batch, cases_in, check

CASES, NAMES = cases_in("ops40_cases.py")
pytestmark = pytest.mark.mpi


BATCH = Batch(CASES, n=4, timeout=600, share=True)


@pytest.fixture(scope="module")
def results():
    return BATCH.results()


@pytest.mark.parametrize("case", CASES, ids=NAMES)
def test_ops40_transparency(results, case):
    check(results, case)
