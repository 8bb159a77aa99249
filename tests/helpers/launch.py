"""The transparency suites' shared launch: every ``case_`` function of a file in tests/cases,
run in one ``mpiexec`` (tests/mpi/test_pipeline.py, test_spatial.py, test_gems_dp.py)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from fxpar.testing import CaseResult, run_cases

TESTS = Path(__file__).resolve().parents[1]
"""tests/: on PYTHONPATH of every rank (the helpers package)."""
CASES = TESTS / "mpi" / "cases"
"""The MPI case files (tests/mpi/cases)."""
PATHS = (TESTS, TESTS / "mpi")
"""What every rank imports from (its PYTHONPATH): the helpers package, and tests/mpi (the
cases package and the test modules some cases share code with)."""


def cases_in(file: str) -> tuple[list[str], list[str]]:
    """(``"path::name"`` ids, names) of the case functions of ``tests/mpi/cases/<file>``, in
    definition order. Read from the module, not its text: some are made in a loop."""
    path = CASES / file
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    names = [n for n in vars(module) if n.startswith("case_")]
    return [f"{path}::{n}" for n in names], names


def launch(cases: list[str], n: int, timeout: float) -> dict[str, CaseResult]:
    """All ``cases`` in one ``mpiexec -n n`` (helpers importable from tests/)."""
    return run_cases(cases, n=n, timeout=timeout, pythonpath=PATHS)


def check(results: dict[str, CaseResult], case: str) -> None:
    """One case's verdict, and its time on rank 0 (shown with ``pytest -s``)."""
    results[case].check()
    print(f"{case.split('::')[1]}: {results[case].seconds:.1f} s on rank 0")
