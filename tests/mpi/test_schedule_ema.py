"""The training recipe (LR schedules, EMA of the weights, clipping, accumulation, resume) under
a real mpiexec (4 ranks, each case on the ranks its plan needs), exact vs one process in
float64: tests/mpi/cases/schedule_ema_cases.py."""

import pytest
from helpers.launch import Batch, cases_in, check

CASES, NAMES = cases_in("schedule_ema_cases.py")

BATCH = Batch(CASES, n=4, timeout=600, share=True)


@pytest.fixture(scope="module")
def results():
    return BATCH.results()


@pytest.mark.mpi
@pytest.mark.parametrize("case", CASES, ids=NAMES)
def test_recipe_transparency(results, case):
    check(results, case)
