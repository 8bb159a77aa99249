"""The spatial coverage figure is what the ranks run: it matches torch's FLOP counter on each
rank of a real SP2 and SP4 job within 1 %; the counter runs around a training step of split
convolutions and counts one process's convolution FLOPs (tests/mpi/cases/coverage_cases.py)."""

import pytest
from helpers.launch import Batch, cases_in, check

CASES, NAMES = cases_in("coverage_cases.py")
pytestmark = pytest.mark.mpi


BATCH = Batch(CASES, n=4, timeout=600)


@pytest.fixture(scope="module")
def results():
    return BATCH.results()


@pytest.mark.parametrize("case", CASES, ids=NAMES)
def test_coverage_matches_the_flop_counter(results, case):
    check(results, case)
