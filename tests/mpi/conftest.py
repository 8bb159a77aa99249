"""Batched launches (tests/helpers/launch.py): each batch runs only the cases pytest selected,
and a test that may start its launch gets that launch's whole time limit."""

from __future__ import annotations

import pytest
from helpers.launch import BATCHES, limit


@pytest.hookimpl(trylast=True)  # after -k and -m have deselected what they drop
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    chosen = {item.callspec.params["case"] for item in items
              if hasattr(item, "callspec") and "case" in item.callspec.params}
    owner = {c: b for b in BATCHES for c in b.cases}
    for b in BATCHES:
        b.selected = chosen & set(b.cases)
    for item in items:
        case = item.callspec.params.get("case") if hasattr(item, "callspec") else None
        if case in owner:  # the launch's own limit ends first, then pytest's
            item.add_marker(pytest.mark.timeout(limit(owner[case].key) + 300))
