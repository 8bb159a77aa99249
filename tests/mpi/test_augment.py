"""Sampled and augmented windows read per rank under SP2 train exactly as one process on the
whole augmented regions, and windows augmented on their own are caught (under a real mpiexec,
2 ranks: tests/mpi/cases/augment_cases.py)."""

import pytest
from helpers.launch import Batch, cases_in, check

CASES, NAMES = cases_in("augment_cases.py")
BATCH = Batch(CASES, n=2, timeout=300, share=True)


@pytest.fixture(scope="module")
def results():
    return BATCH.results()


@pytest.mark.mpi
@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", CASES, ids=NAMES)
def test_augmented_windows_train_as_one_process(results, case):
    check(results, case)
