"""Spatial parallelism under a real mpiexec, exact vs one process (float64): every op class
at P = 2, 3, 4 over the three slicings with odd image sizes, whole models, SP+LP and SP+PP."""

import pytest
from helpers.launch import CASES as CASE_FILES
from helpers.launch import Batch, cases_in, check, launch

CASES, NAMES = cases_in("spatial_cases.py")
pytestmark = pytest.mark.mpi


BATCH = Batch(CASES, n=5, timeout=1500, share=True)


@pytest.fixture(scope="module")
def results():
    return BATCH.results()


@pytest.mark.parametrize("case", CASES, ids=NAMES)
def test_spatial_transparency(results, case):
    check(results, case)


def test_saved_activations_per_rank_at_p4_are_at_most_030_of_one_process():
    """ResNet-50 at 512x512, batch 1: bytes autograd saves for backward (parameters excluded)
    on each of 4 tiles vs one process (measured with saved-tensor hooks)."""
    case = f"{CASE_FILES / 'memory_cases.py'}::case_resnet50_512_p4_saves_at_most_030"
    res = launch([case], n=4, timeout=600)[case]
    res.check()
    line = next(x for x in res.output.splitlines() if x.startswith("saved-for-backward"))
    print(line)
