"""The batched launches of tests/helpers/launch.py: one launch per rank count (one for all the
files that share) for every file's selected cases, with the files' time limits summed; a file's
results only its own cases."""

from __future__ import annotations

import pytest
from helpers import launch as batches

from fxpar.testing import CaseResult


@pytest.fixture
def launched(monkeypatch):
    calls: list[tuple[list[str], int, float]] = []

    def fake(cases, n, timeout):
        calls.append((list(cases), n, timeout))
        return {c: CaseResult(c, True, "") for c in cases}

    monkeypatch.setattr(batches, "launch", fake)
    monkeypatch.setattr(batches, "BATCHES", [])
    return calls


def test_one_launch_per_rank_count_for_the_selected_cases(launched):
    a = batches.Batch(["a.py::1", "a.py::2"], n=4, timeout=100)
    b = batches.Batch(["b.py::1"], n=4, timeout=50)
    c = batches.Batch(["c.py::1"], n=2, timeout=10)
    b.selected = set()  # every test of b.py deselected
    a.selected = {"a.py::2"}
    assert set(a.results()) == {"a.py::2"}
    assert launched == [(["a.py::2"], 4, 150)]
    assert b.results() == {} and len(launched) == 1  # ran with a's launch
    assert set(c.results()) == {"c.py::1"} and launched[-1] == (["c.py::1"], 2, 10)
    assert batches.limit(4) == 150


def test_a_launch_of_many_files_is_capped_unless_one_file_asks_for_more(launched):
    for _ in range(4):
        batches.Batch(["x.py::1"], n=4, timeout=1500)
    assert batches.limit(4) == batches.LIMIT_CAP
    batches.Batch(["y.py::1"], n=4, timeout=batches.LIMIT_CAP + 100)
    assert batches.limit(4) == batches.LIMIT_CAP + 100


def test_files_that_share_run_in_one_launch_of_the_most_ranks(launched):
    a = batches.Batch(["a.py::1"], n=5, timeout=100, share=True)
    b = batches.Batch(["b.py::1"], n=8, timeout=50, share=True)
    c = batches.Batch(["c.py::1"], n=8, timeout=10)  # its cases use the whole world
    assert set(a.results()) == {"a.py::1"}
    assert launched == [(["a.py::1", "b.py::1"], 8, 150)]
    assert set(b.results()) == {"b.py::1"} and len(launched) == 1
    assert set(c.results()) == {"c.py::1"} and launched[-1] == (["c.py::1"], 8, 10)
    assert batches.limit("shared") == 150 and batches.limit(8) == 10
