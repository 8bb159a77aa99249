"""Tokens are pixels (fxpar.frontend.rules.tokens, fxpar.passes.tile_tokens) under a real
mpiexec (tests/mpi/cases/tokens_cases.py, one launch of 4 ranks): blocks that flatten the image
into tokens — LayerNorm, MLPs and a position embedding per token, global attention by
``F.scaled_dot_product_attention`` and written out (matmul and einsum), a class token's cross
attention, linear attention, a vector norm over H and W — exact vs one process in float64, with
their spatial coverage, under SP2, SP3, SP4, SP2+PP2 and SP2+DP2."""

import pytest
from helpers.launch import Batch, cases_in, check

CASES, NAMES = cases_in("tokens_cases.py")
pytestmark = pytest.mark.mpi


BATCH = Batch(CASES, n=4, timeout=300, share=True)


@pytest.fixture(scope="module")
def results():
    return BATCH.results()


@pytest.mark.parametrize("case", CASES, ids=NAMES)
def test_tokens_exact(results, case):
    check(results, case)
