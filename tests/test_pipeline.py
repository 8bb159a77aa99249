"""Layer and pipeline parallelism under a real mpiexec, exact vs one process (float64):
loss, every gradient, parameters after 2 SGD steps, BatchNorm buffers, eval forward."""

from pathlib import Path

import pytest

from fxpar.testing import run_cases

FILE = Path(__file__).parent / "cases" / "pipeline_cases.py"
NAMES = [line.split("(")[0][4:] for line in FILE.read_text().splitlines()
         if line.startswith("def case_")]
CASES = [f"{FILE}::{n}" for n in NAMES]

pytestmark = pytest.mark.mpi


@pytest.fixture(scope="module")
def results():
    return run_cases(CASES, n=4, timeout=900, pythonpath=[FILE.parent.parent])


@pytest.mark.parametrize("case", CASES, ids=NAMES)
def test_pipeline_transparency(results, case):
    results[case].check()
    print(f"{case.split('::')[1]}: {results[case].seconds:.1f} s on rank 0")


