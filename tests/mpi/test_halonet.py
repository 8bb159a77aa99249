"""HaloNet's halo attention on tiles under a real mpiexec, exact vs one process in float64
(tests/mpi/cases/halonet_cases.py, in the shared 4-rank launch): a small HaloAttn block at
stride 1 and 2 under SP2 and SP4, overlapping unfold windows on uneven tiles, timm's
halonet26t at 256 x 256 under SP2 (and SP4 with ``FXPAR_LIBRARY_MATRIX=1``: 41 s of a 4-rank
launch; tools/models_matrix.py trains it under every plan) with at least 95 % of its work on
tiles; a halo one column short is caught."""

import pytest
from helpers.launch import Batch, check, ci_cases

CASES, NAMES = ci_cases("halonet_cases.py", ("case_halonet26t_256_p4",),
                        "FXPAR_LIBRARY_MATRIX")
pytestmark = pytest.mark.mpi


BATCH = Batch(CASES, n=4, timeout=600, share=True)


@pytest.fixture(scope="module")
def results():
    return BATCH.results()


@pytest.mark.parametrize("case", CASES, ids=NAMES)
def test_halonet_exact(results, case):
    check(results, case)
