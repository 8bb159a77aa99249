"""Models from timm, segmentation-models-pytorch, MONAI and torchvision, unchanged, under a
real mpiexec vs one process in float64, with the spatial coverage each SP plan must reach
(tests/mpi/cases/library_cases.py). CI runs every model under SP2 but three whose blocks another
CI case trains (``CI_NOT_SP2``), and each other plan on one model; FXPAR_LIBRARY_MATRIX=1 runs
every (model, plan) pair."""

import os

import pytest
from cases.library_cases import ci_subset
from helpers.launch import Batch, cases_in, check

# one launch of every library case (about 6 min under load on 2 cores): past the 600 s default
pytestmark = [pytest.mark.mpi, pytest.mark.timeout(3000)]
ALL, NAMES = cases_in("library_cases.py")

CHOSEN = NAMES if os.environ.get("FXPAR_LIBRARY_MATRIX") == "1" else ci_subset()
CASES = [c for c, n in zip(ALL, NAMES, strict=True) if n in CHOSEN]


BATCH = Batch(CASES, n=4, timeout=3000)


@pytest.fixture(scope="module")
def results():
    return BATCH.results()


@pytest.mark.parametrize("case", CASES, ids=[c.split("::")[1] for c in CASES])
def test_library_model_transparency(results, case):
    check(results, case)
