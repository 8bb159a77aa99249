"""tools/bench.py (entry point, JSON merging, docs rendering) and the single/compile sections'
summaries, on synthetic data: no benchmark is run here."""

import argparse
import importlib.util
import json
from pathlib import Path

import pytest

TOOLS = Path(__file__).resolve().parents[2] / "tools"


def _load(name):
    spec = importlib.util.spec_from_file_location(f"_test_{name}", TOOLS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


bench = _load("bench")
MACHINE = {"nproc": 2, "cpu": "Test CPU", "torch": "0.0", "python": "3.x", "cuda": None}


def _section(name, *, met=True, value="1.00x", date="2020-01-01"):
    return {
        "name": name, "title": f"Section {name}",
        "command": f"python tools/bench.py --only {name}", "date": date, "revision": "abc1234",
        "method": f"Method of {name}.", "gpu": None,
        "tables": [{"title": "Times", "columns": ["system", "step s"],
                    "rows": [["eager", 0.25], [f"fxpar-{name}", 0.5]]}],
        "plots": [{"file": f"{name}_plot.png", "title": "t", "xlabel": "x", "ylabel": "y",
                   "kind": "bar", "series": {"a": [["r18", 1.0], ["amoeba", 2.0]],
                                             "b": [["r18", 1.5]]}}],
        "aims": [{"what": f"speed of {name}", "aim": "<= 1.03x", "measured": value, "met": met,
                  "why": "because of the test" if not met else None}],
        "notes": "Generated note.", "raw": {},
    }


def _doc(*sections):
    return {"fxpar_bench": 1, "date": "2020-01-01", "revision": "abc1234", "command": "x",
            "machine": MACHINE, "sections": list(sections)}


def test_report_only_renders_tables_aims_plots_and_notes(tmp_path):
    out, md = tmp_path / "bench.json", tmp_path / "docs" / "benchmarks.md"
    out.write_text(json.dumps(_doc(_section("single"),
                                   _section("compile", met=False, value="4.2 s"))))
    (tmp_path / "docs" / "bench_notes").mkdir(parents=True)
    (tmp_path / "docs" / "bench_notes" / "compile.md").write_text("Hand-written analysis.\n")

    (tmp_path / "tools").mkdir()  # no section modules: rendering needs none
    argv = ["--report-only", "--tools", str(tmp_path / "tools"), "--out", str(out),
            "--md", str(md)]
    assert bench.main(argv) == 0
    text = md.read_text()
    assert "| fxpar-single | 0.5 |" in text and "| fxpar-compile | 0.5 |" in text
    assert "|---|---:|" in text  # the numeric column is right-aligned
    aims = text.split("## Aims", 1)[1].split("\n## ", 1)[0]
    assert "| single | speed of single | <= 1.03x | 1.00x | met |" in aims
    assert "| compile | speed of compile | <= 1.03x | 4.2 s | **missed** |" in aims
    compile_part = text.split("## Section compile", 1)[1]
    assert "Hand-written analysis." in compile_part and "Generated note." in compile_part
    assert "Hand-written analysis." not in text.split("## Section compile", 1)[0]
    assert "because of the test" in compile_part
    assert "GPU: not measured." in compile_part
    assert "`python tools/bench.py --only compile`" in compile_part
    png = tmp_path / "docs" / "bench" / "compile_plot.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "![t](bench/compile_plot.png)" in text
    # the hand-written notes survive a second render unchanged
    assert bench.main(argv) == 0
    assert md.read_text() == text


FAKE = """
TITLE = "Fake {name}"

def add_args(parser):
    parser.add_argument("--{name}-value", default="{name}-default")

def run(opts):
    return {{"name": "{name}", "title": TITLE, "method": "m",
             "tables": [{{"title": "t", "columns": ["v"], "rows": [[opts.{name}_value]]}}],
             "aims": [], "raw": {{"rounds": opts.rounds}}}}
"""


def _fake_tools(tmp_path, names):
    tools = tmp_path / "tools"
    tools.mkdir()
    for n in names:
        (tools / f"bench_{n}.py").write_text(FAKE.format(name=n))
    return tools


def test_only_replaces_its_sections_and_keeps_the_others(tmp_path, monkeypatch):
    import benchlib  # bench.py put tools/ on sys.path

    monkeypatch.setattr(benchlib, "machine", lambda: MACHINE)  # no torch import needed
    tools = _fake_tools(tmp_path, ["alpha", "beta"])
    out, md = tmp_path / "b.json", tmp_path / "b.md"
    out.write_text(json.dumps(_doc(_section("beta", date="1999-12-31"),
                                   _section("alpha", date="1999-12-31"))))
    argv = ["--tools", str(tools), "--only", "alpha", "--rounds", "2", "--alpha-value", "new",
            "--out", str(out), "--md", str(md)]
    assert bench.main(argv) == 0
    doc = json.loads(out.read_text())
    by = {s["name"]: s for s in doc["sections"]}
    assert [s["name"] for s in doc["sections"]] == ["alpha", "beta"]
    assert by["alpha"]["tables"][0]["rows"] == [["new"]] and by["alpha"]["raw"]["rounds"] == 2
    assert "--only alpha" in by["alpha"]["command"] and by["alpha"]["date"] != "1999-12-31"
    assert by["alpha"]["machine"] == MACHINE
    assert by["beta"] == _section("beta", date="1999-12-31")  # untouched
    assert "--only alpha" in doc["command"]
    text = md.read_text()
    assert "| new |" in text and "| fxpar-beta | 0.5 |" in text


def test_unknown_section_and_clashing_option_say_what_to_do(tmp_path):
    tools = _fake_tools(tmp_path, ["alpha"])
    with pytest.raises(SystemExit, match="no section gamma: the sections are alpha"):
        bench.main(["--tools", str(tools), "--only", "gamma", "--out", str(tmp_path / "j")])
    (tools / "bench_bad.py").write_text(
        "def add_args(p):\n    p.add_argument('--rounds')\ndef run(o):\n    return {}\n")
    with pytest.raises(SystemExit, match="prefix its options with --bad-"):
        bench.main(["--tools", str(tools), "--report-only", "--out", str(tmp_path / "j")])


def test_check_section_rejects_ragged_tables_and_bad_plot_names():
    sec = _section("x")
    sec["tables"][0]["rows"].append(["only one cell"])
    with pytest.raises(ValueError, match="2 columns but a row of 1 cells"):
        bench.check_section(sec)
    sec = _section("x")
    sec["plots"][0]["file"] = "sub/p.svg"
    with pytest.raises(ValueError, match="bare name ending in .png"):
        bench.check_section(sec)


def test_single_section_summary_marks_a_slow_round_set_as_missed():
    single = _load("bench_single")
    cfg = {"image": 64, "batch": 4, "steps": 3, "warmup": 1, "filters": 16, "threads": 1}
    rec = {"ratio": 1.10, "times": {"eager": [1.0, 1.0, 1.0], "fxpar": [1.1, 1.1, 1.2]},
           "max_loss_diff": 0.0, "first_loss_diff": 0.0, "compile_s": 0.5, "gpu": None,
           "foreign": 0.1}
    fast = {**rec, "ratio": 1.01, "times": {"eager": [1.0] * 3, "fxpar": [1.01] * 3}}
    rounds = [{"resnet18/cpu": fast, "amoebanet/cpu": rec},
              {"resnet18/cpu": fast, "amoebanet/cpu": {**rec, "ratio": 1.2}}]
    sec = single.section(rounds, [("resnet18", "cpu"), ("amoebanet", "cpu")], cfg,
                         argparse.Namespace())
    bench.check_section(sec)
    met = {a["what"]: a["met"] for a in sec["aims"]}
    assert met == {"fxpar / eager step time, resnet18 on cpu": True,
                   "fxpar / eager step time, amoebanet on cpu": False}
    assert sec["tables"][0]["rows"][1][4] == "1.15x (1.10-1.20x)"
    assert sec["gpu"].startswith("not measured")


def test_compile_section_summary_uses_the_real_weights_build_for_the_aims():
    comp = _load("bench_compile")
    base = {"import_torch_s": 3.0, "import_torchvision_s": 2.0, "import_fxpar_s": 0.5,
            "rss_imports_gb": 0.7, "build_s": 1.0, "rss_build_gb": 0.9, "compile_s": 2.0,
            "rss_compile_gb": 1.0, "for_rank_s": 0.1, "rss_for_rank_gb": 1.0,
            "world_size": 64, "batch": 1, "foreign": 0.0}
    rounds = [{"sp64/meta": {**base, "build": "meta", "compile_s": 9.0},
               "sp64/real": {**base, "build": "real", "rss_compile_gb": 1.6}}]
    sec = comp.section(rounds, [("sp64", "meta"), ("sp64", "real")],
                       argparse.Namespace(compile_image_size=16384, compile_rank=0))
    bench.check_section(sec)
    met = {a["what"]: (a["measured"], a["met"]) for a in sec["aims"]}
    assert met == {"compile time, sp64, real model": ("2.00 s (2.00-2.00 s)", True),
                   "peak RSS after compile (imports included), sp64, real model":
                   ("1.60 GB (1.60-1.60 GB)", False)}
    assert sec["tables"][0]["rows"][1][6] == "0.90 (0.90-0.90)"  # peak - imports


def test_predict_section_limits_overlap_and_accuracy_rows():
    pred = _load("bench_predict")
    cfg = {"size": 2048, "region": 1024, "ranks": [1, 2, 4], "classes": 3, "modes": ["constant"],
           "overlap": 0.25, "check": 2048, "logits_ranks": 2, "nproc": 2, "rounds": 2}
    limit = {"mpx_s": {"2": 20.0, "1": 12.0}}
    fx = {"mpx_s": 10.0, "wall": 2.0, "overlap": 1.25, "line": "wrote x.zarr: ..."}
    monai = {"mpx_s": 8.0, "wall": 4.0, "overlap": 2.25}
    rounds = [{"limit": limit, "fxpar/1": fx, "fxpar/2": {**fx, "mpx_s": 12.0}, "fxpar/4": fx,
               "monai/constant": monai}] * 2
    accuracy = {"fxpar/logits": {"max_abs": 1e-6, "argmax_differs": 0.0}, "fxpar/1": 0.0,
                "fxpar/2": 0.0, "fxpar/4": 0.0,
                "monai/constant": {"max_abs": 0.5, "argmax_differs": 0.02}}
    sec = pred.section(rounds, cfg, {"bytes": 2**20, "seconds": 1.0},
                       {"seconds": 2.0, "mpx_s": 2.0, "wall": 5.0, "peak_rss_gib": 1.0},
                       accuracy, {"seconds": 3.0}, 60.0)
    bench.check_section(sec)
    speed, acc = sec["tables"]
    by = {r[0]: r for r in speed["rows"]}
    # one process uses the 2-thread rate; P single-thread ranks use 1-thread rate x cores used
    assert by["fxpar-predict SP1"][7].startswith("20.00") and by["fxpar-predict SP1"][8] \
        .startswith("16.00")  # 20 / overlap 1.25
    assert by["fxpar-predict SP2"][7].startswith("24.00")
    assert by["fxpar-predict SP4 (4 ranks on 2 cores: oversubscribed)"][7].startswith("24.00")
    assert by["fxpar-predict SP2"][9].startswith("0.62x")  # 12 / (24 / 1.25)
    assert by["fxpar-predict SP1"][5].startswith("2.10")  # 2048² / 1e6 / 2 s wall
    assert [r[4] for r in acc["rows"]] == ["0 (none)"] * 4 + ["83886 px (2 %)"]
    assert acc["rows"][-1][3] == "0.5" and "(2048² image)" in acc["title"]


def test_a_benchmark_of_one_function_runs_interleaved_rounds_beside_its_limit(monkeypatch):
    """``benchlib.compare``: each system launched once per round in a rotated order; the table
    has each figure's median and range, its speed-up over the baseline and its share of the
    limit measured in the same rounds (fake launches: a system's time is its command)."""
    benchlib = importlib.import_module("benchlib")  # as the sections import it (tools/bench.py
    launched = []  # puts tools/ on sys.path)

    def fake_measure(cmd, env, **_):
        launched.append(cmd[0])
        return {"step_s": float(cmd[0]) * (1.0 + 0.1 * (len(launched) > 3))}

    monkeypatch.setattr(benchlib, "measure", fake_measure)
    monkeypatch.setattr(benchlib, "progress", lambda *_a, **_k: None)
    opts = argparse.Namespace(rounds=2, retries=0, max_foreign=0.25, timeout=9.0)
    systems = [benchlib.System("one", ["4.0"], {}), benchlib.System("sp2", ["2.5"], {}),
               benchlib.System("halves", ["2.0"], {}, limit=True)]
    sec = benchlib.compare(opts, "x", "SP2", systems, baseline="one", method="M.")
    assert launched == ["4.0", "2.5", "2.0", "2.5", "2.0", "4.0"]  # round 2 rotated by one
    bench.check_section(sec)
    rows = {r[0]: r[1:] for r in sec["tables"][0]["rows"]}
    assert sec["tables"][0]["columns"][2:] == ["speed-up over one", "share of the limit"]
    assert rows["one"][1] == "1.00x (1.00-1.00x)" and rows["sp2"][1] == "1.60x (1.60-1.60x)"
    assert rows["halves (limit)"][1] == "2.00x (2.00-2.00x)"
    assert rows["sp2"][2] == "0.80x (0.80-0.80x)" and rows["halves (limit)"][2].startswith("1.00x")
    assert rows["sp2"][0] == "2.625 (2.500-2.750)"  # median and range over the two rounds
    assert benchlib.nested([{"r18/sp": {"t": 1}, "r18/ideal": {"t": 2}, "unet/sp": {"t": 3}}]) \
        == [{"r18": {"sp": {"t": 1}, "ideal": {"t": 2}}, "unet": {"sp": {"t": 3}}}]
    with pytest.raises(ValueError, match="baseline 'eager'"):
        benchlib.compare(opts, "x", "SP2", systems, baseline="eager", method="M.")


def test_a_snapshot_imports_all_of_fxpar_from_itself():
    """A commit exported for a before/after comparison (``benchlib.snapshot``) imports
    fxpar.passes and fxpar.models from the export too, not from the working tree that the
    editable install maps them to."""
    import subprocess
    import sys

    spec = importlib.util.spec_from_file_location("benchlib", TOOLS / "benchlib.py")
    benchlib = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("benchlib", benchlib)  # dataclasses look their module up
    spec.loader.exec_module(benchlib)
    folder, _ = benchlib.snapshot("HEAD")
    code = "import fxpar.passes.halo as h, fxpar.models as m; print(h.__file__); print(m.__file__)"
    out = subprocess.run([sys.executable, "-c", code], env=benchlib.thread_env(1, folder),
                         cwd=folder.parent,  # not the repository: `python -c` imports from cwd
                         capture_output=True, text=True, check=True, timeout=300).stdout.split()
    assert all(Path(f).resolve().is_relative_to(folder.resolve()) for f in out), (folder, out)
