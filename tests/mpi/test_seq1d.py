"""1-D spatial parallelism under a real mpiexec, exact vs one process (float64): sequences
(N, C, L) cut into P tiles along L (tests/mpi/cases/seq1d_cases.py). Every 1-D op class at
P = 2, 3, 4 on odd lengths, a 1-D CNN classifier on a 4099-sample sequence (and with halo
fusion), a 1-D U-Net for per-position labels under SP3, SP4, SP2+PP2, SP2+DP2 and
SP2+GEMS+PP2, each with at least 95% of its FLOPs on tiles; a halo one sample short is
caught. One launch of 4 ranks: 25 cases in 21 s on an idle 2-core machine (56 s for 23 of
them while other suites ran)."""

import pytest
from helpers.launch import Batch, cases_in, check

CASES, NAMES = cases_in("seq1d_cases.py")
pytestmark = pytest.mark.mpi


BATCH = Batch(CASES, n=4, timeout=600, share=True)


@pytest.fixture(scope="module")
def results():
    return BATCH.results()


@pytest.mark.parametrize("case", CASES, ids=NAMES)
def test_seq1d_transparency(results, case):
    check(results, case)
