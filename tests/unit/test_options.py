"""Every environment setting is declared once (fxpar.core.options) and documented from the
declaration; none is read at import time."""

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

from fxpar.core import options

ROOT = Path(__file__).resolve().parents[2]


def _sources():
    for folder in ("fxpar", "passes", "models"):
        yield from (ROOT / folder).rglob("*.py")


def test_every_fxpar_variable_the_code_names_is_declared():
    declared = {o.env for o in options.OPTIONS.values()}
    named = {m for p in _sources() for m in re.findall(r"FXPAR_[A-Z0-9_]*[A-Z0-9]", p.read_text())}
    named -= {"FXPAR_TORCH"}  # the prefix of a message that names both torch options
    assert named and named <= declared, f"undeclared: {sorted(named - declared)}"


def test_the_code_reads_the_environment_only_through_options():
    """No module reads an FXPAR_ variable from os.environ itself (launcher variables such as
    MPI_LOCALRANKID are not fxpar's options)."""
    pattern = re.compile(r"os\.environ(?:\.get)?[\[(]\s*\"FXPAR_")
    found = [str(p.relative_to(ROOT)) for p in _sources()
             if p.name != "options.py" and pattern.search(p.read_text())]
    assert not found


def test_setting_reads_now_and_falls_back_to_the_default(monkeypatch):
    monkeypatch.delenv("FXPAR_POLL", raising=False)
    assert options.setting("poll") == "off"
    monkeypatch.setenv("FXPAR_POLL", "0.001")
    assert options.setting("poll") == "0.001"
    assert options.setting("poll", {}) == "off"
    assert options.flag("force_staging", {"FXPAR_FORCE_STAGING": "1"})
    assert not options.flag("force_staging", {"FXPAR_FORCE_STAGING": "0"})


def test_a_variable_set_after_import_is_heard():
    """The halo window switch used to be read when fxpar.runtime.spatial.ops was imported."""
    code = ("import os, fxpar.runtime.spatial.ops, fxpar.comm.torch_dist\n"
            "from fxpar.core.options import flag, setting\n"
            "os.environ['FXPAR_HALO_WINDOW'] = '1'; os.environ['FXPAR_TORCH_TIMEOUT'] = '5'\n"
            "from fxpar.comm.torch_dist import _timeout\n"
            "assert flag('halo_window') and _timeout().total_seconds() == 5\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


@pytest.mark.parametrize("name", list(options.OPTIONS))
def test_each_option_is_documented(name):
    option = options.OPTIONS[name]
    assert option.env.startswith("FXPAR_") and option.doc.endswith(".") and option.values


def test_docs_options_md_is_rendered_from_the_declarations():
    spec = importlib.util.spec_from_file_location("options_doc", ROOT / "tools" / "options_doc.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert (ROOT / "docs" / "options.md").read_text() == module.render(), \
        "docs/options.md is stale: run python tools/options_doc.py"
