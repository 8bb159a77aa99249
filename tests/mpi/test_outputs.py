"""Model outputs that are structures (tuples, lists, dicts, NamedTuples, dataclasses), each
leaf in its own layout, with the loss captured over the structure (issue 59, item 1): the cases
of tests/mpi/cases/output_cases.py under a real mpiexec, and what fxpar says of a structure it
cannot carry."""

import pytest
from helpers.launch import Batch, cases_in, check

CASES, NAMES = cases_in("output_cases.py")
BATCH = Batch(CASES, n=4, timeout=900, share=True)


@pytest.fixture(scope="module")
def results():
    return BATCH.results()


@pytest.mark.mpi
@pytest.mark.parametrize("case", CASES, ids=NAMES)
def test_structured_outputs_are_transparent(results, case):
    check(results, case)
