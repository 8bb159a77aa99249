"""Check fxpar's import graph: the import-linter layer contract in pyproject.toml, and no cycles.

    python tools/check_imports.py            # what `make lint` runs; exit status 1 on a breach
    python tools/check_imports.py --graph    # also print every package's imports of the others

The repository keeps ``passes/`` and ``models/`` at the top but installs them as
``fxpar.passes`` and ``fxpar.models`` (pyproject's package-dir). import-linter (grimp) reads a
package from one folder, so the check runs on a copy of the installed layout in a temporary
folder. Every import counts: at module level, inside functions, and under ``if TYPE_CHECKING:``
(a type-only import is still a dependency; a circle of them means two modules that cannot be
read, or moved, one without the other).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import networkx as nx

ROOT = Path(__file__).resolve().parent.parent
LAYOUT = {"fxpar": "fxpar", "fxpar/passes": "passes", "fxpar/models": "models"}


def stage(dest: Path) -> Path:
    """Copy the installed layout (fxpar + passes + models, .py files only) under ``dest``."""
    for target, source in LAYOUT.items():
        shutil.copytree(ROOT / source, dest / target, dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    return dest


_GRAPH = """
import json, sys
import grimp
g = grimp.build_graph("fxpar", exclude_type_checking_imports=False, cache_dir=None)
print(json.dumps({m: sorted(g.find_modules_directly_imported_by(m)) for m in g.modules}))
"""


def module_graph(path: Path) -> nx.DiGraph:
    """Every fxpar module -> the fxpar modules it imports at run time (read in a fresh process
    from the staged copy: a process that imported fxpar already would read that one)."""
    env = dict(os.environ, PYTHONPATH=str(path))
    out = subprocess.run([sys.executable, "-c", _GRAPH], env=env, cwd=path,
                         capture_output=True, text=True, check=True)
    g = nx.DiGraph()
    for m, deps in json.loads(out.stdout).items():
        g.add_node(m)
        g.add_edges_from((m, d) for d in deps)
    return g


def cycles(g: nx.DiGraph) -> list[list[str]]:
    """One cycle per strongly connected group of modules (a package's ``__init__`` importing its
    own submodules is not a cycle: Python finishes the submodule first)."""
    out = []
    for comp in nx.strongly_connected_components(g):
        if len(comp) > 1:
            out.append(nx.find_cycle(g.subgraph(comp)))
    return [[a for a, _ in c] + [c[-1][1]] for c in out]


def package_edges(g: nx.DiGraph, depth: int = 2) -> dict[str, set[str]]:
    """fxpar.<package> -> the fxpar packages it imports."""
    def pkg(m: str) -> str:
        return ".".join(m.split(".")[:depth])
    out: dict[str, set[str]] = {}
    for a, b in g.edges:
        if pkg(a) != pkg(b) and pkg(a) != "fxpar":
            out.setdefault(pkg(a), set()).add(pkg(b))
    return out


def check(path: Path, quiet: bool = False) -> tuple[int, nx.DiGraph]:
    """Run the contract on a staged layout under ``path``: (lint-imports' exit status, graph)."""
    env = dict(os.environ, PYTHONPATH=str(path))
    lint = Path(sys.executable).parent / "lint-imports"
    # (run from the copy: lint-imports puts its working folder first on the path)
    contract = subprocess.run([str(lint), str(ROOT / "pyproject.toml"), "--no-cache"],
                              env=env, cwd=path, capture_output=quiet, text=True)
    return contract.returncode, module_graph(path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--graph", action="store_true", help="print each package's imports")
    a = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="fxpar-imports-") as tmp:
        status, g = check(stage(Path(tmp)))
    found = cycles(g)
    for c in found:
        print("import cycle: " + " -> ".join(c))
    print(f"{g.number_of_nodes()} modules, {g.number_of_edges()} imports, "
          f"{len(found)} cycle{'s' * (len(found) != 1)}")
    if a.graph:
        for p, deps in sorted(package_edges(g).items()):
            print(f"  {p:24} -> {', '.join(sorted(deps))}")
    return 1 if status or found else 0


if __name__ == "__main__":
    sys.exit(main())
