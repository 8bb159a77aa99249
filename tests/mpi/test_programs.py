"""Emitted programs, fxpar-run's driver, checkpoints and meta-device compilation under a real
mpiexec (4 ranks, the batched launch of tests/helpers/launch.py): each case compares against one
process in float64, or bitwise where the claim is bitwise (resume, save/load)."""

from pathlib import Path

import pytest
from helpers.launch import Batch

HERE = Path(__file__).parent / "cases"
FILES = [HERE / f"{name}_cases.py" for name in ("emit", "checkpoint", "meta", "driver", "inductor",
                                                  "calibrate")]
CASES = [f"{f}::{line.split('(')[0][4:]}" for f in FILES if f.exists()
         for line in f.read_text().splitlines() if line.startswith("def case_")]
IDS = [c.split("/")[-1].replace("_cases.py::", ":") for c in CASES]

pytestmark = pytest.mark.mpi
BATCH = Batch(CASES, n=4, timeout=900)


@pytest.fixture(scope="module")
def results():
    return BATCH.results()


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_program_case(results, case):
    results[case].check()
    print(f"{case.split('::')[1]}: {results[case].seconds:.1f} s on rank 0")
