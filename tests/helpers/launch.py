"""The transparency suites' shared launch: the ``case_`` functions of the files in
tests/mpi/cases, run under ``mpiexec``.

A test file declares its cases with :class:`Batch` at import; its module fixture asks for their
results. The first file to ask launches the cases of every file of this pytest process that
runs in the same launch (those pytest selected, tests/mpi/conftest.py): the files on as many
ranks, or, for files whose cases take only the ranks they need (``share``), every such file in
one launch of the most ranks any of them needs. One launch instead of one per file: each rank
imports torch and the model libraries, and warms up torch.export, once. Each launch's time
limit is the sum of its files' limits, capped (:data:`LIMIT_CAP`)."""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass, field
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


def ci_cases(file: str, matrix_only: tuple[str, ...], variable: str
             ) -> tuple[list[str], list[str]]:
    """:func:`cases_in` without the cases named in ``matrix_only``, unless environment
    variable ``variable`` is "1" (a long matrix: every case)."""
    cases, names = cases_in(file)
    if os.environ.get(variable) == "1":
        return cases, names
    kept = [(c, n) for c, n in zip(cases, names, strict=True) if n not in matrix_only]
    return [c for c, _ in kept], [n for _, n in kept]


def launch(cases: list[str], n: int, timeout: float) -> dict[str, CaseResult]:
    """All ``cases`` in one ``mpiexec -n n`` (helpers importable from tests/)."""
    return run_cases(cases, n=n, timeout=timeout, pythonpath=PATHS)


def check(results: dict[str, CaseResult], case: str) -> None:
    """One case's verdict, and its time on rank 0 (shown with ``pytest -s``)."""
    results[case].check()
    print(f"{case.split('::')[1]}: {results[case].seconds:.1f} s on rank 0")


@dataclass(eq=False)
class Batch:
    """The cases of one test file, run in the one launch of their rank count."""

    cases: list[str]
    n: int
    timeout: float
    """This file's share of the launch's time limit, seconds."""
    share: bool = False
    """Its cases take the ranks they need from the launch (helpers.transparency.sub_comm;
    none uses the whole world), so it runs in one launch with every other such file of the
    pytest process, on the most ranks any of them needs. False: with the files of exactly
    ``n`` ranks."""
    selected: set[str] | None = None
    """The cases pytest will run (tests/mpi/conftest.py); None: all."""
    done: dict[str, CaseResult] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        BATCHES.append(self)

    @property
    def key(self) -> int | str:
        """Which launch it runs in: "shared", or its rank count."""
        return "shared" if self.share else self.n

    def wanted(self) -> list[str]:
        return [c for c in self.cases if self.selected is None or c in self.selected]

    def results(self) -> dict[str, CaseResult]:
        """Every case's result; launched now, with the other waiting batches of its launch
        (:attr:`key`), unless an earlier file's request ran them."""
        if self.done is None:
            group = [b for b in BATCHES if b.key == self.key and b.done is None]
            cases = [c for b in group for c in b.wanted()]
            got = launch(cases, max(b.n for b in group), limit(self.key)) if cases else {}
            for b in group:
                b.done = {c: got[c] for c in b.wanted()}
        return self.done


BATCHES: list[Batch] = []
"""Every batch this pytest process declared, in import order."""


LIMIT_CAP = 3600.0
"""Seconds a batched launch may take at most, however many files' limits it adds up (the
4-rank launch of ``make test`` sums to 9,840 s and takes about 920 s under load): a case that
hangs past the watchdog still ends its launch within the hour. A single file's larger limit
(a long matrix) wins over it."""


def limit(key: int | str) -> float:
    """The time limit of the launch ``key`` (:attr:`Batch.key`): its batches' limits together,
    at most :data:`LIMIT_CAP` unless one of them alone asks for more."""
    mine = [b.timeout for b in BATCHES if b.key == key]
    return min(sum(mine), max([LIMIT_CAP, *mine]))
