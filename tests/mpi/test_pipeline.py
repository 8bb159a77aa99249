"""Layer and pipeline parallelism under a real mpiexec, exact vs one process (float64):
loss, every gradient, parameters after 2 SGD steps, BatchNorm buffers, eval forward."""

import pytest
from helpers.launch import Batch, cases_in, check

CASES, NAMES = cases_in("pipeline_cases.py")
pytestmark = pytest.mark.mpi


BATCH = Batch(CASES, n=4, timeout=900, share=True)


@pytest.fixture(scope="module")
def results():
    return BATCH.results()


@pytest.mark.parametrize("case", CASES, ids=NAMES)
def test_pipeline_transparency(results, case):
    check(results, case)


