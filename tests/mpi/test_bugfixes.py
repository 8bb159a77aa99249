"""Fixed bugs under a real mpiexec, exact vs one process (float64): parameters the forward
never uses, and tensors the model reaches under two names (tests/mpi/cases/bugfix_cases.py)."""

import pytest
from helpers.launch import Batch, cases_in, check

CASES, NAMES = cases_in("bugfix_cases.py")
pytestmark = [pytest.mark.mpi, pytest.mark.timeout(900)]  # the launch's own limit ends first


BATCH = Batch(CASES, n=4, timeout=600)


@pytest.fixture(scope="module")
def results():
    return BATCH.results()


@pytest.mark.parametrize("case", CASES, ids=NAMES)
def test_bugfix(results, case):
    check(results, case)
