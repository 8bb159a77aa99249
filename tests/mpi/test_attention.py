"""Exact attention over a tile group's tokens (fxpar.runtime.spatial.attention) under a real
mpiexec (tests/mpi/cases/attention_cases.py, one launch of 4 ranks): ring and gather attention
vs ``F.scaled_dot_product_attention`` on the whole sequence, output and gradients element by
element, and a scale off by 1e-9 caught."""

import pytest
from helpers.launch import Batch, cases_in, check

CASES, NAMES = cases_in("attention_cases.py")
pytestmark = pytest.mark.mpi


BATCH = Batch(CASES, n=4, timeout=300, share=True)


@pytest.fixture(scope="module")
def results():
    return BATCH.results()


@pytest.mark.parametrize("case", CASES, ids=NAMES)
def test_attention_exact(results, case):
    check(results, case)
