"""Every user-facing error (tests/helpers/errors_catalogue.py): raised without MPI, of the
documented class, with its own distinctive message; docs/errors.md is exactly what the code
prints."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import helpers.errors_catalogue as cat
import pytest

pytestmark = pytest.mark.slow  # runs every trigger of the catalogue: make test, not test-quick

ROOT = Path(__file__).resolve().parents[2]


def _errors_doc():
    spec = importlib.util.spec_from_file_location("_test_errors_doc",
                                                  ROOT / "tools" / "errors_doc.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


errors_doc = _errors_doc()


@pytest.fixture(scope="module")
def found(tmp_path_factory):
    """Entry id -> (what its trigger raised, the message): every trigger runs once."""
    return errors_doc.messages(cat, tmp_path_factory.mktemp("errors"))


@pytest.mark.parametrize("entry", cat.CATALOGUE, ids=lambda e: e.id)
def test_error_is_raised_with_its_message(entry, found):
    raised, message = found[entry.id]
    if entry.trigger is not None:  # exactly the documented class, not a crash on the way
        assert type(raised) is entry.error, f"{entry.id}: {type(raised).__name__}: {message}"
    assert re.search(entry.match, message), f"{entry.id}: {message!r}"
    assert entry.group in cat.GROUPS


def test_every_message_is_distinct(found):
    """Each entry's distinctive text appears in its own message and in no other."""
    for entry in cat.CATALOGUE:
        others = [e.id for e in cat.CATALOGUE
                  if e is not entry and re.search(entry.match, found[e.id][1])]
        assert not others, f"{entry.id}'s {entry.match!r} also matches {others}"
    assert len({e.id for e in cat.CATALOGUE}) == len(cat.CATALOGUE)


def test_docs_page_is_a_fresh_render(found):
    committed = (ROOT / "docs" / "errors.md").read_text()
    assert committed == errors_doc.render(cat, found), \
        "docs/errors.md is stale: run `python tools/errors_doc.py`"


def test_every_error_class_is_documented():
    """Each exception class defined in fxpar/ or passes/ has an entry (or is listed as
    internal), so a new error type cannot ship undocumented."""
    documented = {e.error.__name__ for e in cat.CATALOGUE if e.error is not None}
    defined = set()
    for path in [*ROOT.glob("fxpar/**/*.py"), *ROOT.glob("passes/*.py")]:
        defined |= set(re.findall(r"^class ([A-Z]\w*)\(\w*(?:Error|Exception|Disagreement)\)",
                                  path.read_text(), re.M))
    assert {"PlanError", "TraceError", "CheckpointError"} <= defined  # the scan works
    missing = defined - documented - set(cat.INTERNAL)
    assert not missing, \
        f"error classes with no entry in tests/helpers/errors_catalogue.py: {missing}"
