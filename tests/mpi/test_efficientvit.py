"""timm's EfficientViT-B0 on tiles under a real mpiexec (tests/mpi/cases/efficientvit_cases.py,
in the shared launch): its linear attention in an autocast-disabled block, vs one process in
float64 with at least 95 % of its work on tiles: timm's float32 attention under SP2, the
attention in float64 under SP4 (each under the other plan too with ``FXPAR_LIBRARY_MATRIX=1``;
tools/models_matrix.py trains the float64 form under every plan)."""

import pytest
from helpers.launch import Batch, check, ci_cases

CASES, NAMES = ci_cases("efficientvit_cases.py",
                        ("case_efficientvit_b0_sp4", "case_efficientvit_b0_float64_attention_sp2"),
                        "FXPAR_LIBRARY_MATRIX")
pytestmark = pytest.mark.mpi


BATCH = Batch(CASES, n=4, timeout=600, share=True)


@pytest.fixture(scope="module")
def results():
    return BATCH.results()


@pytest.mark.parametrize("case", CASES, ids=NAMES)
def test_efficientvit_transparency(results, case):
    check(results, case)
