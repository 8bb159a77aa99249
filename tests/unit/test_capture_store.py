"""Captures kept on disk (fxpar.frontend.capture_store, ``FXPAR_CAPTURE_CACHE``): a later
process compiles from the file instead of tracing, the same program; edited model code, another
input or a damaged file traces anew; a folder others may write to is refused with a warning."""

from __future__ import annotations

import importlib
import importlib.util
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import fxpar
import fxpar.frontend.share as share
from fxpar.frontend.capture_store import CaptureStoreWarning

ROOT = Path(__file__).resolve().parents[2]
SHAPE = (2, 3, 16, 16)
PLAN = fxpar.Plan(spatial_parts=2)
MODEL = """
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.head = nn.Linear(4, 5)

    def forward(self, x):
        y = torch.relu(self.bn(self.conv(x)))
        return self.head(y.mean((2, 3)))
"""


@pytest.fixture()
def userpkg(tmp_path, monkeypatch):
    """A user's model package on sys.path: ``(module, its file)``."""
    pkg = tmp_path / "src" / "usernets"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "net.py").write_text(MODEL)
    monkeypatch.syspath_prepend(str(tmp_path / "src"))
    for name in [n for n in sys.modules if n.partition(".")[0] == "usernets"]:
        monkeypatch.delitem(sys.modules, name)
    return importlib.import_module("usernets.net"), pkg / "net.py"


def _no_trace(monkeypatch):
    def refuse(*_a, **_k):
        raise AssertionError("traced although the folder holds this capture")
    monkeypatch.setattr(share, "trace", refuse)


def _codes(program: fxpar.Program) -> list[str]:
    return [m.code for m in program.graph.modules] + [program.spatial.tile(0, 1).code]


def test_a_later_cache_on_the_folder_compiles_the_same_program_without_tracing(
        userpkg, tmp_path, monkeypatch):
    mod, _ = userpkg
    folder = tmp_path / "captures"
    first = fxpar.CaptureCache(folder)
    a = fxpar.compile(mod.Net().double(), PLAN, SHAPE, captures=first)
    assert (first.hits, first.disk_hits) == (0, 0)
    assert len(list(folder.glob("*.capture"))) == 1
    assert folder.stat().st_mode & 0o777 == 0o700
    _no_trace(monkeypatch)
    later = fxpar.CaptureCache(folder)
    model = mod.Net().double()
    b = fxpar.compile(model, PLAN, SHAPE, captures=later)
    assert (later.hits, later.disk_hits) == (1, 1)
    assert _codes(a) == _codes(b)
    mine = {id(t) for t in model.parameters()}  # built over this model's own tensors
    assert all(id(p) in mine for m in b.graph.modules for p in m.parameters())


def test_the_option_gives_every_compile_the_folder(userpkg, tmp_path, monkeypatch):
    mod, _ = userpkg
    monkeypatch.setenv("FXPAR_CAPTURE_CACHE", str(tmp_path / "c"))
    fxpar.compile(mod.Net().double(), PLAN, SHAPE)
    _no_trace(monkeypatch)
    fxpar.compile(mod.Net().double(), PLAN, SHAPE)
    monkeypatch.delenv("FXPAR_CAPTURE_CACHE")
    with pytest.raises(AssertionError, match="traced although"):  # unset: every compile traces
        fxpar.compile(mod.Net().double(), PLAN, SHAPE)


def test_edited_model_code_another_input_and_a_damaged_file_trace_again(userpkg, tmp_path):
    mod, path = userpkg
    folder = tmp_path / "captures"
    fxpar.compile(mod.Net().double(), PLAN, SHAPE, captures=fxpar.CaptureCache(folder))
    # the same module tree, another forward: the file's source is part of the key
    path.write_text(MODEL.replace("torch.relu", "torch.sigmoid"))
    edited = importlib.reload(mod)
    cache = fxpar.CaptureCache(folder)
    program = fxpar.compile(edited.Net().double(), PLAN, SHAPE, captures=cache)
    assert cache.disk_hits == 0
    assert "sigmoid" in "".join(_codes(program))
    cache = fxpar.CaptureCache(folder)
    fxpar.compile(edited.Net().double(), PLAN, (4, 3, 16, 16), captures=cache)
    assert cache.disk_hits == 0
    for f in folder.glob("*.capture"):  # one changed byte: not read, traced and rewritten
        raw = bytearray(f.read_bytes())
        raw[-10] ^= 1
        f.write_bytes(bytes(raw))
    cache = fxpar.CaptureCache(folder)
    again = fxpar.compile(edited.Net().double(), PLAN, SHAPE, captures=cache)
    assert cache.disk_hits == 0 and _codes(again) == _codes(program)
    cache = fxpar.CaptureCache(folder)
    fxpar.compile(edited.Net().double(), PLAN, SHAPE, captures=cache)
    assert cache.disk_hits == 1


def test_a_folder_others_may_write_to_is_not_used(userpkg, tmp_path):
    mod, _ = userpkg
    folder = tmp_path / "shared"
    folder.mkdir(mode=0o777)
    folder.chmod(0o777)
    with pytest.warns(CaptureStoreWarning, match="others may write to it"):
        cache = fxpar.CaptureCache(folder)
    fxpar.compile(mod.Net().double(), PLAN, SHAPE, captures=cache)
    assert not list(folder.iterdir())


def test_a_second_process_reads_what_the_first_kept(tmp_path):
    """Across processes, as the ranks of a restarted job or the launches of a test run."""
    script = textwrap.dedent(f"""
        import sys, fxpar
        sys.path.insert(0, {str(tmp_path)!r})
        from net import Net
        cache = fxpar.CaptureCache({str(tmp_path / "c")!r})
        fxpar.compile(Net().double(), fxpar.Plan(spatial_parts=2), {SHAPE}, captures=cache)
        print("read from the folder:", cache.disk_hits)
    """)
    (tmp_path / "net.py").write_text(MODEL)
    runs = [subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                           cwd=ROOT, timeout=120) for _ in range(2)]
    assert all(r.returncode == 0 for r in runs), runs[-1].stderr[-3000:]
    assert [r.stdout.split()[-1] for r in runs] == ["0", "1"]  # the first wrote, the second read


def test_a_model_file_loaded_without_a_module_entry_is_keyed_by_its_source(tmp_path):
    """As the test harness loads its case files (importlib.util, no sys.modules entry)."""
    path = tmp_path / "loose_net.py"

    def load():
        spec = importlib.util.spec_from_file_location("loose_net", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    folder = tmp_path / "c"
    path.write_text(MODEL)
    fxpar.compile(load().Net().double(), PLAN, SHAPE, captures=fxpar.CaptureCache(folder))
    path.write_text(MODEL.replace("torch.relu", "torch.tanh"))
    cache = fxpar.CaptureCache(folder)
    program = fxpar.compile(load().Net().double(), PLAN, SHAPE, captures=cache)
    assert cache.disk_hits == 0 and "tanh" in "".join(_codes(program))
