"""Installing and embedding fxpar as a user would: without the optional extras, and inside a
project that has its own ``models`` and ``passes`` packages (most ML projects have a models/).

"Without the extras" is a real second environment: a fresh venv whose site-packages links every
installed distribution except those of the test and viz extras (a download of torch per test
run would be too slow), so importing graphviz or matplotlib there fails as on a user's machine.
"""

from __future__ import annotations

import ast
import json
import os
import re
import site
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from fxpar.testing import mpiexec

pytestmark = pytest.mark.timeout(600)

EXTRAS = {"graphviz", "matplotlib", "torchvision", "timm", "segmentation_models_pytorch",
          "monai", "pytest", "_pytest", "pytest_timeout", "xdist", "execnet", "hypothesis",
          "importlinter", "import_linter", "grimp", "ruff"}
"""Top-level packages (and distributions) of the test, vision and viz extras."""


def _hidden(entry: str) -> bool:
    name = re.split(r"[-.]", entry, maxsplit=1)[0].lower().replace("-", "_")
    return name in EXTRAS or entry.lower().startswith(("pytest", "py.py"))


@pytest.fixture(scope="module")
def bare_python(tmp_path_factory) -> Path:
    """A venv with fxpar and its required dependencies only (its python)."""
    root = tmp_path_factory.mktemp("bare")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root / "venv")],
                   check=True, timeout=120)
    python = root / "venv" / "bin" / "python"
    purelib = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig."
                                   "get_paths()['purelib'])"], capture_output=True, text=True,
                                  check=True).stdout.strip())
    ours = Path(sysconfig.get_paths()["purelib"])
    assert ours in map(Path, site.getsitepackages()), ours
    for entry in ours.iterdir():
        if not _hidden(entry.name):
            (purelib / entry.name).symlink_to(entry)
    # the mpich wheel's libraries live in the environment's lib/ (mpi4py finds them there)
    lib = root / "venv" / "lib"
    for entry in (Path(sys.prefix) / "lib").iterdir():
        if not entry.name.startswith("python") and not (lib / entry.name).exists():
            (lib / entry.name).symlink_to(entry)
    return python


def _env(tmp: Path) -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONDONTWRITEBYTECODE="1")
    env.pop("PYTHONPATH", None)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return env


def _run(python: Path, args: list[str], cwd: Path, n: int | None = None
         ) -> subprocess.CompletedProcess[str]:
    cmd = [str(python), "-m", *args]
    if n is not None:
        cmd = [mpiexec(), "-n", str(n), *cmd]
    return subprocess.run(cmd, cwd=cwd, env=_env(cwd), capture_output=True, text=True,
                          timeout=300)


def test_the_bare_venv_has_fxpar_but_not_the_extras(bare_python, tmp_path):
    r = subprocess.run([str(bare_python), "-c", "import fxpar, torch, mpi4py; "
                        "print(fxpar.__version__)"], env=_env(tmp_path), capture_output=True,
                       text=True, cwd=tmp_path, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    for package in ("graphviz", "matplotlib", "torchvision", "timm", "pytest"):
        r = subprocess.run([str(bare_python), "-c", f"import {package}"], env=_env(tmp_path),
                           capture_output=True, text=True, cwd=tmp_path, timeout=300)
        assert r.returncode == 1 and "ModuleNotFoundError" in r.stderr, package


def test_without_extras_inspect_prints_tables_and_a_picture_names_its_extra(bare_python,
                                                                          tmp_path):
    r = _run(bare_python, ["fxpar.cli.inspect", "torchvision:resnet18", "--image-size", "64"],
             tmp_path)  # fxpar itself needs no torchvision: only a torchvision model does
    assert r.returncode == 2 and "pip install 'fxpar[vision]'" in r.stderr, r.stderr[-2000:]
    assert "Traceback" not in r.stderr
    r = _run(bare_python, ["fxpar.cli.inspect", "models:resnet_v2", "--image-size", "64",
              "--batch-size", "2", "--stages", "2", "--spatial-parts", "2", "--memory"],
             tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "c0.s0.t0" in r.stdout and "estimated peak memory per rank" in r.stdout, r.stdout
    assert "Traceback" not in r.stderr
    for flag, package in (("--dot", "graphviz"), ("--timeline", "matplotlib")):
        out = tmp_path / ("g.dot" if flag == "--dot" else "t.png")
        r = _run(bare_python, ["fxpar.cli.inspect", "models:resnet_v2", "--image-size",
                               "64", "--stages", "2", flag, str(out)], tmp_path)
        assert r.returncode == 2, (flag, r.stdout[-1000:], r.stderr[-2000:])
        assert f"needs the Python package '{package}'" in r.stderr, r.stderr[-2000:]
        assert "pip install 'fxpar[viz]'" in r.stderr and "Traceback" not in r.stderr
        assert not out.exists()


USER_PACKAGE = "raise ImportError('the user project\\'s own {} package was imported by fxpar')\n"


def test_a_project_with_its_own_models_and_passes_runs_fxpar(bare_python, tmp_path):
    """From a folder holding its own ``models`` and ``passes`` packages (first on sys.path with
    ``python -m``), without the extras: compile, train, save the per-rank programs, and run the
    saved programs under mpiexec; the saved code imports only ``fxpar.*``."""
    for name in ("models", "passes"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text(USER_PACKAGE.format(name))
    common = ["--image-size", "32", "--batch-size", "4", "--steps", "2", "--num-classes", "3",
              "--stages", "2", "--spatial-parts", "2", "--spatial-stages", "1"]
    saved = tmp_path / "job"
    r = _run(bare_python, ["fxpar.cli.run", "models:resnet_v2", "-k", "depth=8", *common,
                           "--save-program", str(saved)], tmp_path)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    sources = [p.read_text() for p in saved.rglob("*.py")]
    assert sources, "no generated code was saved"
    imported = set()
    for s in sources:
        for node in ast.walk(ast.parse(s)):
            if isinstance(node, ast.Import):
                imported |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                imported.add(node.module.split(".")[0])
    assert imported <= {"fxpar", "torch", "__future__", "pathlib", "operator", "math",
                        "builtins", "typing"}, imported
    world = json.loads((saved / "program.json").read_text())["world_size"]
    metrics = tmp_path / "m.json"
    r = _run(bare_python, ["fxpar.cli.run", str(saved), "--steps", "2", "--metrics",
                           str(metrics)], tmp_path, n=world)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert "Traceback" not in r.stderr
    assert metrics.exists()
