"""The spatial coverage figure is what the ranks run: it matches torch's FLOP counter on each
rank of a real SP2 and SP4 job within 1 % (tests/mpi/cases/coverage_cases.py)."""

import pytest
from helpers.launch import cases_in, check, launch

CASES, NAMES = cases_in("coverage_cases.py")
pytestmark = pytest.mark.mpi


@pytest.fixture(scope="module")
def results():
    return launch(CASES, n=4, timeout=600)


@pytest.mark.parametrize("case", CASES, ids=NAMES)
def test_coverage_matches_the_flop_counter(results, case):
    check(results, case)
