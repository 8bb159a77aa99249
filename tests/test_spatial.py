"""Spatial parallelism under a real mpiexec, exact vs one process (float64): every op class
at P = 2, 3, 4 over the three slicings with odd image sizes, whole models, SP+LP and SP+PP."""

from pathlib import Path

import pytest

from fxpar.testing import run_cases

FILE = Path(__file__).parent / "cases" / "spatial_cases.py"


def _names() -> list[str]:
    """The case functions (some are generated in a loop, so read them from the module)."""
    import importlib.util
    import sys

    sys.path.insert(0, str(FILE.parent.parent))
    spec = importlib.util.spec_from_file_location("spatial_cases", FILE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return [n for n in vars(module) if n.startswith("case_")]


NAMES = _names()
CASES = [f"{FILE}::{n}" for n in NAMES]

pytestmark = pytest.mark.mpi


@pytest.fixture(scope="module")
def results():
    return run_cases(CASES, n=5, timeout=1500, pythonpath=[FILE.parent.parent])


@pytest.mark.parametrize("case", CASES, ids=NAMES)
def test_spatial_transparency(results, case):
    results[case].check()
