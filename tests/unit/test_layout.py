"""The import-graph check of `make lint` (tools/check_imports.py) holds for the tree, and it fails
on an upward import and on a cycle (each planted in a staged copy of the package)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(300)

_spec = importlib.util.spec_from_file_location(
    "check_imports", Path(__file__).resolve().parents[2] / "tools" / "check_imports.py")
assert _spec is not None and _spec.loader is not None
check_imports = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(check_imports)


def _plant(root: Path, module: str, line: str) -> None:
    path = root / (module.replace(".", "/") + ".py")
    path.write_text(path.read_text() + f"\n{line}\n")


def test_the_tree_keeps_the_layers_and_has_no_cycles(tmp_path):
    status, graph = check_imports.check(check_imports.stage(tmp_path), quiet=True)
    assert status == 0
    assert check_imports.cycles(graph) == []
    # the packages are all there (passes and models from the repository's top-level folders)
    packages = {m.split(".")[1] for m in graph.nodes if m.count(".") >= 1}
    assert {"cli", "train", "planner", "report", "compiler", "data", "perf", "passes",
            "program", "frontend", "runtime", "comm", "core", "models"} <= packages


def test_an_upward_import_breaks_the_contract(tmp_path):
    root = check_imports.stage(tmp_path)
    _plant(root, "fxpar.core.plan", "from fxpar.program import program  # noqa")
    status, _ = check_imports.check(root, quiet=True)
    assert status != 0


def test_a_cycle_inside_a_layer_is_found(tmp_path):
    root = check_imports.stage(tmp_path)
    _plant(root, "fxpar.program.layout", "from fxpar.program import emit  # noqa")
    status, graph = check_imports.check(root, quiet=True)
    assert status == 0  # the layers still hold: both modules are in fxpar.program
    found = check_imports.cycles(graph)
    assert len(found) == 1 and {"fxpar.program.layout", "fxpar.program.emit"} <= set(found[0])


def test_pyproject_installs_every_package_and_only_fxpar():
    """pyproject lists the packages by hand (passes/ and models/ install under fxpar through
    package-dir): a new subpackage must be listed, or a wheel would lack it."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    root = Path(__file__).resolve().parents[2]
    setup = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    dirs = {"fxpar.passes": "passes", "fxpar.models": "models", **setup.get("package-dir", {})}
    found = set()
    for init in root.glob("fxpar/**/__init__.py"):
        found.add(".".join(init.parent.relative_to(root).parts))
    for package, folder in dirs.items():
        for init in (root / folder).glob("**/__init__.py"):
            found.add(".".join([package, *init.parent.relative_to(root / folder).parts]))
    assert set(setup["packages"]) == found
    assert all(p == "fxpar" or p.startswith("fxpar.") for p in setup["packages"])
