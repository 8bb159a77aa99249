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
    print(f"{case.split('::')[1]}: {results[case].seconds:.1f} s on rank 0")


def test_saved_activations_per_rank_at_p4_are_at_most_030_of_one_process():
    """ResNet-50 at 512x512, batch 1: bytes autograd saves for backward (parameters excluded)
    on each of 4 tiles vs one process (measured with saved-tensor hooks)."""
    case = f"{FILE.parent / 'memory_cases.py'}::case_resnet50_512_p4_saves_at_most_030"
    res = run_cases([case], n=4, timeout=600, pythonpath=[FILE.parent.parent])[case]
    res.check()
    line = next(x for x in res.output.splitlines() if x.startswith("saved-for-backward"))
    print(line)
