"""The pure summaries of tools/bench_pipeline.py (driver), tools/pipeline_report.py (summaries)
and tools/pipeline_workers.py (cuts, busy time): bubble arithmetic, ratios, aims, config.
No MPI and no timing: the benchmark itself is run by hand (tools/bench.py)."""

import argparse
import importlib.util
import sys
from pathlib import Path

import pytest

TOOLS = Path(__file__).resolve().parents[2] / "tools"
SIBLINGS = ("benchlib", "pipeline_workers", "pipeline_report")


@pytest.fixture(scope="module")
def bp():
    """The driver; it imports its siblings (benchlib, pipeline_report, pipeline_workers) from
    tools/, which is not a package."""
    sys.path.insert(0, str(TOOLS))
    try:
        spec = importlib.util.spec_from_file_location("bench_pipeline",
                                                      TOOLS / "bench_pipeline.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules["bench_pipeline"] = mod  # dataclasses look their module up
        spec.loader.exec_module(mod)
        yield mod
    finally:
        for name in ("bench_pipeline", *SIBLINGS):
            sys.modules.pop(name, None)
        sys.path.remove(str(TOOLS))


@pytest.fixture(scope="module")
def rep(bp):
    return sys.modules["pipeline_report"]


@pytest.fixture(scope="module")
def wk(bp):
    return sys.modules["pipeline_workers"]


def test_formula(rep):
    assert rep.bubble_formula(2, 1) == pytest.approx(0.5)
    assert rep.bubble_formula(2, 4) == pytest.approx(0.2)
    assert rep.bubble_formula(4, 4, "gpipe") == pytest.approx(3 / 7)
    assert rep.bubble_formula(2, 4, "zero_bubble") == pytest.approx(1 / 13)
    assert rep.bubble_formula(4, 4, "zero_bubble") == pytest.approx(3 / 15)
    assert rep.bubble_formula(2, 4, "interleaved_1f1b", 2) == pytest.approx(1 / 9)
    assert rep.bubble_formula(4, 4, "interleaved_1f1b", 2) == pytest.approx(3 / 11)
    assert rep.bubble_formula(2, 4, "zero_bubble_v", 2) is None  # the simulator's column only


@pytest.mark.parametrize("p", [2, 4])
@pytest.mark.parametrize("m", [4, 8])
@pytest.mark.parametrize("name,v", [("gpipe", 1), ("1f1b", 1), ("zero_bubble", 1),
                                    ("interleaved_1f1b", 2)])
def test_formula_is_the_simulators_unit_cost_bubble(rep, p, m, name, v):
    """Where the formulas hold (m >= p, m a multiple of p when interleaved), fxpar's simulator
    with unit costs gives them exactly: the table's two columns agree on an ideal machine."""
    from fxpar.core.schedule import chain, pipeline
    from fxpar.perf.simulate import simulate

    n = p * v
    sim = simulate(pipeline(n, m, name, chain(n), per_rank=v), chain(n))
    assert sim.bubble == pytest.approx(rep.bubble_formula(p, m, name, v))


def test_busy_time_counts_fbw_minus_wait_only(wk):
    actions = [("RECV_F", 0.0, 0.1, 0.0), ("F", 0.1, 0.6, 0.2), ("B", 0.6, 1.0, 0.0),
               ("SEND_B", 1.0, 1.1, 0.0), ("W", 1.1, 1.3, 0.0), ("STEP", 1.3, 1.5, 0.05),
               ("F", 1.5, 1.6, 0.5)]  # a wait longer than the action never goes negative
    assert wk.busy_time(actions) == pytest.approx(0.3 + 0.4 + 0.2)


def test_ideal_pipeline_matches_formula(rep):
    """Equal stages of F = B = 1 s, m micro-batches, p = 2: wall = 2(m + 1), busy = 2m."""
    m = 4
    ranks = [{"wall": [2.0 * (m + 1)] * 3, "busy": [2.0 * m] * 3} for _ in range(2)]
    b = rep.launch_bubble(ranks)
    assert b["bubble"] == pytest.approx(rep.bubble_formula(2, m))
    assert b["imbalance"] == pytest.approx(1.0)
    assert b["img_per_s"] == pytest.approx(rep.BATCH / 10.0)


def test_bubble_uses_slowest_rank_and_median(rep):
    ranks = [{"wall": [10.0, 4.0, 4.0], "busy": [3.0, 3.0, 3.0]},
             {"wall": [9.0, 5.0, 4.0], "busy": [2.0, 1.0, 2.0]}]
    b = rep.launch_bubble(ranks)
    # per step, over the slower wall: 1 - 5/20, 1 - 4/10, 1 - 5/8 -> median 0.6
    assert b["bubble"] == pytest.approx(0.6)
    assert b["imbalance"] == pytest.approx(1.5)  # median of 1.5, 3, 1.5
    four = rep.launch_bubble([{"wall": [4.0], "busy": [b]} for b in (1.0, 3.0, 2.0, 2.0)])
    assert four["bubble"] == pytest.approx(1 - 8 / 16)
    assert four["imbalance"] == pytest.approx(3.0)  # slowest / fastest, not first / last


def _rec(t):
    return {"times": [t, t, t]}


def test_summarize_ratios_per_round(rep):
    """Per round: each system over torch's best, fxpar's best over torch's best, and each
    fxpar schedule over torch's same-named one; a system missing from a round is left out."""
    rounds = [{"fxpar:1f1b": _rec(1.0), "fxpar:zero_bubble": _rec(2.0),
               "torch:1f1b": _rec(2.0), "torch:gpipe": _rec(4.0), "single": _rec(4.0),
               "torch:zbv": _rec(0.5)},
              {"fxpar:1f1b": _rec(2.0), "fxpar:zero_bubble": _rec(1.0),
               "torch:1f1b": _rec(4.0), "torch:gpipe": _rec(1.0), "single": _rec(8.0)}]
    keys = ("fxpar:1f1b", "fxpar:zero_bubble", "torch:1f1b", "torch:gpipe", "single",
            "torch:zbv")
    s = rep.summarize(rounds, keys)
    assert "torch:zbv" not in s["img_per_s"]  # not in round 2
    # fxpar's best 32, 32 img/s; torch's best 16 (1f1b), 32 (gpipe): 2.0 and 1.0
    assert s["best"]["ratio"]["median"] == pytest.approx(1.5)
    assert s["best"]["ratio"]["min"] == pytest.approx(1.0)
    assert s["best"]["torch"] in ("torch:1f1b", "torch:gpipe")
    assert s["pairs"]["1f1b"]["ratio"]["median"] == pytest.approx(2.0)  # 2.0, 2.0
    assert set(s["pairs"]) == {"1f1b"}  # zero_bubble's twin did not run
    assert s["vs_torch_best"]["single"]["max"] == pytest.approx(0.5)
    assert s["img_per_s"]["fxpar:1f1b"]["max"] == pytest.approx(rep.BATCH)


def test_tables_and_aim(rep):
    rounds = [{"fxpar:1f1b": _rec(1.0), "torch:1f1b": _rec(1.2)}]
    s = rep.summarize(rounds, ("fxpar:1f1b", "torch:1f1b"))
    aim = rep.aim_row(2, 4, s)
    assert aim["met"] and not aim["why"] and aim["measured"] == "1.20x (1.20-1.20x)"
    missed = rep.aim_row(4, 4, rep.summarize(
        [{"fxpar:1f1b": _rec(1.0), "torch:1f1b": _rec(1.1)}], ("fxpar:1f1b", "torch:1f1b")))
    assert missed["met"] is False and "torch `Schedule1F1B`" in missed["why"]
    assert "oversubscribed" in missed["what"]
    none = rep.aim_row(2, 4, rep.summarize([{"torch:1f1b": _rec(1.0)}], ("torch:1f1b",)))
    assert none["met"] is None
    t = rep.throughput_table(4, 4, s, {"torch:zbv": "RuntimeError: pair not connected"})
    assert t["rows"][-1][:3] == ["torch `ScheduleZBVZeroBubble`, 2 stages/rank", "8 (2/rank, V)",
                                 "failed"]
    assert "oversubscribed" in t["title"]
    assert all(len(r) == len(t["columns"]) for r in t["rows"])
    pt = rep.pairs_table(2, 4, s)
    assert pt["rows"] == [["`1f1b`", "32.0", "`Schedule1F1B`", "26.7", "1.20x (1.20-1.20x)"]]


def test_same_cut_names_parameter_mismatches_only(rep):
    first = {2: {"fxpar:1f1b": {"stage_params": [1, 2]}, "torch:1f1b": {"stage_params": [1, 2]},
                 "fxpar:interleaved_1f1b": {"stage_params": [3, 4]},
                 "torch:interleaved_1f1b": {"stage_params": [4, 3]},
                 "torch:zbv": {"stage_params": [9, 9]}, "single": {"stage_params": [3]}}}
    assert rep.same_cut(first) == [
        "2 ranks, 2 stage(s)/rank: fxpar:interleaved_1f1b [3, 4] vs torch:interleaved_1f1b "
        "[4, 3]"]


def test_throughput_plot_labels_and_long_failures(rep):
    s = rep.summarize([{"fxpar:zero_bubble": _rec(1.0), "single": _rec(2.0)}],
                      ("fxpar:zero_bubble", "single"))
    plot = rep.throughput_plot({2: s})
    assert plot["series"]["2 ranks"] == [["fxpar\nZB", 32.0], ["one\nprocess", 16.0]]
    row = rep.throughput_table(2, 4, s, {"torch:zbv": "x" * 300})["rows"][-1]
    assert len(row[-1]) == 120 and row[-1].endswith("…")


def test_bubble_rows_and_plot(rep):
    bubble = {2: {"gpipe": {2: [{"bubble": 0.35, "imbalance": 1.1, "img_per_s": 9.0,
                                 "sim": 1 / 3},
                                {"bubble": 0.37, "imbalance": 1.2, "img_per_s": 8.0,
                                 "sim": 1 / 3}]},
                  "zero_bubble": {4: [{"bubble": 0.1, "imbalance": 1.0, "img_per_s": 9.0,
                                       "sim": None}]},
                  "zero_bubble_v": {4: [{"bubble": 0.1, "imbalance": 1.0, "img_per_s": 9.0,
                                         "sim": 0.05}]}}}
    rows = rep.bubble_rows(bubble, {"zero_bubble_v": 2})
    assert rows[0] == ["2", "`gpipe`", "2", "(p-1)/(m+p-1) = 33.3%", "33.3%",
                       "36.0% (35.0-37.0%)", "1.15", "8.5", "2"]
    assert rows[1][3:5] == ["(p-1)/(3m+p-1) = 7.7%", "-"]
    assert rows[2][3:5] == ["-", "5.0%"]
    plot = rep.bubble_plot(2, bubble[2], {"zero_bubble_v": 2})
    assert "fxpar zero_bubble_v, measured" in plot["series"]
    assert not any("None" in k for k in plot["series"])
    assert plot["series"]["fxpar gpipe, measured"] == [[2, pytest.approx(36.0)]]
    assert plot["series"]["formula (p-1)/(3m+p-1)"][1] == [4, pytest.approx(100 / 13)]


def test_config_quick_and_validation(bp):
    cfg = bp.config(argparse.Namespace(quick=True, rounds=5))
    assert (cfg.rounds, cfg.warmup, cfg.steps, cfg.bubble_ms, cfg.bubble_rounds) == (
        1, 1, 2, (2,), 1)
    assert cfg.ranks == (2, 4) and "torch:zbv" in cfg.systems
    full = bp.config(argparse.Namespace(rounds=2, quick=False))
    assert full.bubble_ms == (1, 2, 4, 8) and full.bubble_rounds == 2
    with pytest.raises(SystemExit, match="divide the batch"):
        bp.config(argparse.Namespace(pipeline_bubble_microbatches="3"))
    with pytest.raises(SystemExit, match="missing: \\[3, 6\\]"):
        bp.config(argparse.Namespace(pipeline_ranks="3"))
    with pytest.raises(SystemExit, match="unknown: \\['torch:nope'\\]"):
        bp.config(argparse.Namespace(pipeline_systems="torch:nope"))


def test_reason_picks_the_last_exception_line(bp):
    err = ("worker failed (rc 1):\n[rank1]: Traceback (most recent call last):\n"
           "[rank1]:   File x\n[rank1]: RuntimeError: [enforce fail] Pair is not connected\n"
           "=====\nYOUR APPLICATION TERMINATED WITH THE EXIT STRING: Terminated\n")
    assert bp.reason(err) == "RuntimeError: [enforce fail] Pair is not connected"
    assert bp.reason("just this\n") == "just this"


def test_section_contract_failures_and_disturbed_launches(bp, monkeypatch):
    """A whole Section from synthetic launch records: the keys tools/bench.py reads, the aim
    rows, a failed system and a launch disturbed by other processes named in the notes."""
    monkeypatch.setattr(bp, "machine", dict)  # no torch import for this
    cfg = bp.config(argparse.Namespace(quick=True, max_foreign=0.25,
                                       pipeline_systems="fxpar:1f1b,torch:1f1b,torch:zbv,single"))

    def rec(t, p, foreign=0.0):
        ranks = [{"wall": [t, t], "busy": [0.8 * t, 0.8 * t], "opt": [0.0, 0.0]}] * p
        return {"times": [t, t], "foreign": foreign, "attempt": 0, "stage_params": [1] * p,
                "transport": "x", "balance": [34, 35], "fxpar": "/src/fxpar", "ranks": ranks,
                "sim_bubble": 0.2}

    single = rec(3.0, 1)
    comp = {2: [{"fxpar:1f1b": rec(2.0, 2), "torch:1f1b": rec(2.0, 2), "single": single}],
            4: [{"fxpar:1f1b": rec(1.0, 4), "torch:1f1b": rec(2.0, 4, foreign=0.9),
                 "single": single}]}
    bubble = {p: {"1f1b": {4: [{**bp.launch_bubble(c[0]["fxpar:1f1b"]["ranks"]), "sim": 0.2}]}}
              for p, c in comp.items()}
    failed = {2: {}, 4: {"torch:zbv": "m = 4: RuntimeError: Pair is not connected"}}
    sec = bp.section(cfg, comp, bubble, [], failed, "test")
    assert {"name", "title", "command", "method", "tables", "plots", "aims", "notes",
            "raw"} <= sec.keys()
    assert [a["met"] for a in sec["aims"]] == [False, True]  # 1.00x, 2.00x
    assert "4 ranks round 1 torch:1f1b (0.90 cores)" in sec["notes"]
    assert "failed** and is left out: m = 4: RuntimeError: Pair" in sec["notes"]
    assert "gloo has no connection from a rank to itself" in sec["notes"]  # the known hint
    assert "same parameters on every rank wherever" in sec["notes"]
    assert sec["tables"][-1]["rows"][0][5] == "20.0% (20.0-20.0%)"  # 1 - 0.8
    assert [p["file"] for p in sec["plots"]] == ["pipeline_throughput.png",
                                                 "pipeline_bubble.png"]
    for t in sec["tables"]:
        assert all(len(r) == len(t["columns"]) for r in t["rows"]), t["title"]


def test_balance_of_starts_a_stage_at_each_cut(wk):
    paths = ["conv1", "bn1", "layer1.0.conv1", "layer1.1.conv1", "layer2.0.conv1",
             "layer2.0.downsample.0", "layer20.x", "fc"]
    assert wk.balance_of(paths, ("layer1.1", "layer2")) == (3, 1, 4)  # layer20 is not layer2
    with pytest.raises(ValueError, match="no compute node"):
        wk.balance_of(paths, ("layer3",))
    with pytest.raises(ValueError, match="not increasing"):
        wk.balance_of(paths, ("layer2", "layer1"))


def test_stage_placement(wk):
    assert wk.stage_ranks(wk.SYSTEMS["torch:1f1b"], 4) == [[0], [1], [2], [3]]
    assert wk.stage_ranks(wk.SYSTEMS["torch:interleaved_1f1b"], 2) == [[0, 2], [1, 3]]
    assert wk.stage_ranks(wk.SYSTEMS["torch:zbv"], 2) == [[0, 3], [1, 2]]
    for p in (2, 4):  # every configuration's systems have a cut
        assert all(p * s.per_rank in wk.CUTS for s in wk.SYSTEMS.values())


def test_fxpar_balance_starts_stages_at_the_cut_modules(wk):
    """The benchmark's cuts are found in the captured graph by module path; the torch side
    cuts at the same modules, so both pipelines hold the same parameters per stage."""
    import torchvision

    import fxpar
    from fxpar.core.meta import module_path
    from fxpar.passes.split_stages import compute_nodes

    model = torchvision.models.resnet18(num_classes=10)
    nodes = compute_nodes(fxpar.trace(model, (8, 3, wk.IMAGE, wk.IMAGE)))
    for n, cuts in wk.CUTS.items():
        balance = wk.fxpar_balance(model, cuts)
        assert len(balance) == n and sum(balance) == len(nodes)
        edge = 0
        for cut, size in zip(cuts, balance, strict=False):
            edge += size
            assert module_path(nodes[edge]).startswith(f"{cut}.")
            assert not any(module_path(x).startswith(f"{cut}.") for x in nodes[:edge])
