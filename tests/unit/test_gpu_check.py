"""tools/gpu_check.py (``make gpu-check``): one line and exit 0 without a GPU; on the CPU with
``--quick``, every measurement section's code path, checked through the document it writes."""

import importlib.util
import math
import os
import re
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tools" / "gpu_check.py"


def _load(name):
    sys.path.insert(0, str(ROOT / "tools"))  # the tools import each other by name
    spec = importlib.util.spec_from_file_location(f"_test_{name}", ROOT / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _run(*args, **env):
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=420,
                          env={**os.environ, "OMP_NUM_THREADS": "1", **env})


def _number(cell):
    m = re.match(r"\s*([-+]?\d+(?:\.\d+)?(?:e[-+]?\d+)?)", cell)
    assert m, f"no number in {cell!r}"
    return float(m.group(1))


def _sections(doc):
    """``## heading`` -> its tables, each a list of rows (dicts by column)."""
    out = {}
    for part in doc.split("\n## ")[1:]:
        heading, _, body = part.partition("\n")
        tables, lines = [], body.splitlines()
        for i, line in enumerate(lines):
            if line.startswith("|---") and i > 0:
                cols = [c.strip() for c in lines[i - 1].strip("|").split("|")]
                rows = []
                for row in lines[i + 1:]:
                    if not row.startswith("|"):
                        break
                    rows.append(dict(zip(cols, (c.strip() for c in row.strip("|").split("|")),
                                         strict=True)))
                tables.append(rows)
        out[heading] = tables
    return out


def _positive(cell):
    v = _number(cell)
    assert math.isfinite(v) and v > 0, cell
    return v


def test_without_a_gpu_it_prints_one_line_and_exits_0():
    out = ROOT / "docs" / "gpu.md"
    before = out.stat().st_mtime if out.exists() else None
    r = _run(CUDA_VISIBLE_DEVICES="")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert len(lines) == 1, r.stdout
    assert lines[0].startswith("fxpar gpu-check: no CUDA device visible (torch ")
    assert lines[0].endswith("CUDA_VISIBLE_DEVICES=<empty>): nothing to check")
    assert (out.stat().st_mtime if out.exists() else None) == before


def test_a_section_out_of_time_is_written_as_not_measured():
    gpu_report, gpu_measure = _load("gpu_report"), _load("gpu_measure")
    facts = {"gpu": {}, "commit": "abc1234", "torch": "2.x", "cuda": None, "date": "today",
             "device": "cpu", "quick": True, "setup": [], "deadline": 450.0, "seconds": 450.0,
             "sizes": asdict(gpu_measure.QUICK)}
    late = {"records": [], "why": "out of time (12 s)", "seconds": 12.0, "cap": 12.0}
    doc = gpu_report.render(facts, None, dict.fromkeys(("single", "sp", "largest", "predict"),
                                                       late))
    for heading, tables in _sections(doc).items():
        if heading.startswith("Transparency"):
            continue
        cells = [c for t in tables for row in t for c in row.values()]
        assert "not measured: out of time (12 s)" in cells, heading


def test_the_largest_image_search_doubles_the_pixels():
    sides = _load("gpu_measure").sides(1024, 8192)
    assert sides == [1024, 1440, 2048, 2912, 4096, 5792, 8192]
    assert all(s % 32 == 0 for s in sides)


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu") / "gpu.md"
    r = _run("--device", "cpu", "--quick", "--skip-tests", "--out", str(out))
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.startswith(f"fxpar gpu-check: wrote {out} in "), r.stdout
    return out.read_text()


@pytest.mark.slow  # about a minute on two cores: a worker process per section, mpiexec for SP
def test_quick_cpu_run_writes_every_section_with_numbers(quick):
    sec = _sections(quick)
    assert "not measured" not in quick
    assert "not run (--skip-tests)" in quick

    single = sec["One rank: fxpar's program vs the eager loop"][0]
    assert {(r["model"], r["precision"]) for r in single} == {
        (m, p) for m in ("resnet18", "unet") for p in ("fp32", "bf16")}
    for r in single:
        _positive(r["eager step ms"]), _positive(r["fxpar step ms"])
        _positive(r["fxpar / eager"])
        if r["precision"] == "fp32":  # the same model, weights and batch: the same loss
            assert _number(r["max loss diff"]) <= 1e-5

    check, overhead = sec["Spatial parallelism with the ranks sharing one GPU"]
    assert [r["plan"] for r in check] == ["SP2"]
    for col in ("loss", "gradients", "parameters", "buffers"):  # float64: exact but for order
        assert 0 <= _number(check[0][col]) <= 1e-12, (col, check[0][col])
    _positive(check[0]["largest gradient"])
    _positive(overhead[0]["one process ms"]), _positive(overhead[0]["SP ms"])

    largest = {r["system"].split(",")[0]: r for r in
               sec["The largest image one GPU trains"][0]}
    one, sp = largest["one process"], largest["SP2 + bf16 + 2 recompute segments"]
    for r in (one, sp):
        side = _positive(r["largest side trained"])
        assert _number(r["pixels"]) == side ** 2
        _positive(r["step s"])
        assert r["search ended by"] == "size limit"  # the quick sizes' limits: 64 and 96
    assert _number(sp["pixels"]) > _number(one["pixels"])

    predict = {r["system"]: r for r in
               next(t for h, t in sec.items() if h.startswith("Inference"))[0]}
    assert len(predict) == 4
    for r in predict.values():
        _positive(r["Mpx/s"]), _positive(r["seconds"])
    fxpar = next(r for k, r in predict.items() if k.startswith("fxpar"))
    assert _number(fxpar["pixels whose class differs"]) <= 2  # exact up to float ties
    monai = [r for k, r in predict.items() if k.startswith("MONAI")]
    assert all(_number(r["pixels whose class differs"]) >= 0 for r in monai)
