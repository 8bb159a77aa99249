"""Zero-bubble (split backward) and interleaved schedules under a real mpiexec, exact vs one
process (float64): loss, every gradient, parameters after 2 SGD steps, buffers."""

import pytest
from helpers.launch import Batch, cases_in, check

CASES, NAMES = cases_in("schedule_cases.py")
# the launch runs 19 cases (about 9 min alone on 2 cores): past pytest-timeout's 600 s default
pytestmark = [pytest.mark.mpi, pytest.mark.timeout(1800)]


BATCH = Batch(CASES, n=6, timeout=1700, share=True)


@pytest.fixture(scope="module")
def results():
    return BATCH.results()


@pytest.mark.parametrize("case", CASES, ids=NAMES)
def test_schedule_transparency(results, case):
    check(results, case)
