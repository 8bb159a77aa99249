"""The pure summaries of tools/bench_pipeline.py: bubble arithmetic, ratios, aims, config.
No MPI and no timing: the benchmark itself is run by hand (tools/bench.py)."""

import argparse
import importlib.util
import sys
from pathlib import Path

import pytest

TOOLS = Path(__file__).resolve().parents[1] / "tools"


@pytest.fixture(scope="module")
def bp():
    sys.path.insert(0, str(TOOLS))  # bench_pipeline imports benchlib as a sibling
    try:
        spec = importlib.util.spec_from_file_location("bench_pipeline",
                                                      TOOLS / "bench_pipeline.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules["bench_pipeline"] = mod  # dataclasses look their module up
        spec.loader.exec_module(mod)
        yield mod
    finally:
        sys.modules.pop("bench_pipeline", None)
        sys.path.remove(str(TOOLS))


def test_formula(bp):
    assert bp.bubble_formula(2, 1) == pytest.approx(0.5)
    assert bp.bubble_formula(2, 4) == pytest.approx(0.2)
    assert bp.bubble_formula(4, 4) == pytest.approx(3 / 7)


def test_busy_time_counts_fb_minus_wait_only(bp):
    actions = [("RECV_F", 0.0, 0.1, 0.0), ("F", 0.1, 0.6, 0.2), ("B", 0.6, 1.0, 0.0),
               ("SEND_B", 1.0, 1.1, 0.0), ("STEP", 1.1, 1.3, 0.05),
               ("F", 1.3, 1.4, 0.5)]  # a wait longer than the action never goes negative
    assert bp.busy_time(actions) == pytest.approx(0.3 + 0.4)


def test_ideal_pipeline_matches_formula(bp):
    """Equal stages of F = B = 1 s, m micro-batches, p = 2: wall = 2(m + 1), busy = 2m."""
    m = 4
    ranks = [{"wall": [2.0 * (m + 1)] * 3, "busy": [2.0 * m] * 3} for _ in range(2)]
    b = bp.launch_bubble(ranks)
    assert b["bubble"] == pytest.approx(bp.bubble_formula(2, m))
    assert b["imbalance"] == pytest.approx(1.0)
    assert b["img_per_s"] == pytest.approx(bp.BATCH / 10.0)


def test_bubble_uses_slower_rank_and_median(bp):
    ranks = [{"wall": [10.0, 4.0, 4.0], "busy": [3.0, 3.0, 3.0]},
             {"wall": [9.0, 5.0, 4.0], "busy": [2.0, 1.0, 2.0]}]
    b = bp.launch_bubble(ranks)
    # per step, over the slower wall: 1 - 5/20, 1 - 4/10, 1 - 5/8 -> median 0.6
    assert b["bubble"] == pytest.approx(0.6)
    assert b["imbalance"] == pytest.approx(1.5)  # median of 1.5, 3, 1.5


def test_summarize_ratios_per_round(bp):
    def rec(t):
        return {"times": [t, t, t]}

    rounds = [{"fxpar": rec(1.0), "torch": rec(2.0), "single": rec(4.0), "single-mb": rec(4.0)},
              {"fxpar": rec(2.0), "torch": rec(2.0), "single": rec(4.0), "single-mb": rec(8.0)}]
    s = bp.summarize(rounds, bp.SYSTEMS)
    assert s["ratios"]["fxpar/torch"]["median"] == pytest.approx(1.5)  # rounds: 2.0, 1.0
    assert s["ratios"]["fxpar/torch"]["min"] == pytest.approx(1.0)
    assert s["img_per_s"]["fxpar"]["max"] == pytest.approx(bp.BATCH)
    assert s["ratios"]["fxpar/single-mb"]["max"] == pytest.approx(4.0)


def test_aim_row_met_and_missed(bp):
    met = bp.aim_row("gpipe", 4, {"median": 1.2, "min": 1.1, "max": 1.3})
    missed = bp.aim_row("1f1b", 4, {"median": 0.97, "min": 0.9, "max": 1.05})
    assert met["met"] and not met["why"]
    assert not missed["met"] and missed["why"]
    assert missed["measured"] == "0.97x (0.90-1.05x)"


def test_bubble_rows_and_plot(bp):
    bubble = {"gpipe": {2: [{"bubble": 0.35, "imbalance": 1.1, "img_per_s": 9.0},
                            {"bubble": 0.37, "imbalance": 1.2, "img_per_s": 8.0}]}}
    rows = bp.bubble_rows(bubble)
    assert rows == [["`gpipe`", "2", "16", "33.3%", "36.0% (35.0-37.0%)", "1.15", "8.5", "2"]]
    plot = bp.bubble_plot(bubble)
    assert plot["series"]["fxpar gpipe, measured"] == [[2, pytest.approx(36.0)]]


def test_config_quick_and_validation(bp):
    cfg = bp.config(argparse.Namespace(quick=True, rounds=5))
    assert (cfg.rounds, cfg.warmup, cfg.steps, cfg.bubble_ms, cfg.bubble_rounds) == (
        1, 1, 2, (2, 4), 1)
    full = bp.config(argparse.Namespace(rounds=2, quick=False))
    assert full.bubble_ms == (1, 2, 4, 8) and full.bubble_rounds == 2
    with pytest.raises(SystemExit, match="divide the batch"):
        bp.config(argparse.Namespace(pipeline_bubble_microbatches="3"))


def test_section_contract_and_disturbed_launches(bp, monkeypatch):
    """A whole Section from synthetic launch records: the keys tools/bench.py reads, the aim
    rows, and a launch disturbed by other processes named in the notes."""
    monkeypatch.setattr(bp, "machine", dict)  # no torch import for this
    cfg = bp.config(argparse.Namespace(quick=True, max_foreign=0.25))
    ranks = [{"wall": [2.0, 2.0], "busy": [1.6, 1.6], "opt": [0.0, 0.0]}] * 2

    def rec(t, foreign=0.0):
        return {"times": [t, t], "foreign": foreign, "attempt": 0, "stage_params": [1, 2],
                "transport": "x", "balance": [34, 35], "fxpar": "/src/fxpar", "ranks": ranks}

    single = {"single": rec(3.0), "single-mb": rec(3.0)}
    comp = {"gpipe": [{"fxpar": rec(2.0), "torch": rec(2.0), **single}],
            "1f1b": [{"fxpar": rec(1.0), "torch": rec(2.0, foreign=0.9), **single}]}
    bubble = {s: {4: [bp.launch_bubble(ranks)]} for s in comp}
    sec = bp.section(cfg, comp, bubble, [], "test")
    assert {"name", "title", "command", "method", "tables", "plots", "aims", "notes",
            "raw"} <= sec.keys()
    assert [a["met"] for a in sec["aims"]] == [False, True]  # 1.00x, 2.00x
    assert "`1f1b` round 1 torch (0.90 cores)" in sec["notes"]
    assert "outside +-10%" in sec["notes"]
    assert sec["tables"][-1]["rows"][0][4] == "20.0% (20.0-20.0%)"  # 1 - 3.2 / (2 x 2)


def test_fxpar_balance_starts_stage_1_at_the_split_module(bp):
    """The benchmark's split (stage 1 from ``layer3``) is found in the captured graph by module
    path; the torch side cuts at the same module, so both pipelines hold the same parameters."""
    import torchvision

    import fxpar
    from fxpar.core.meta import module_path
    from fxpar.passes.split_stages import compute_nodes

    model = torchvision.models.resnet18(num_classes=10)
    first, rest = bp.fxpar_balance(model)
    nodes = compute_nodes(fxpar.trace(model, (8, 3, bp.IMAGE, bp.IMAGE)))
    assert first + rest == len(nodes)
    assert module_path(nodes[first]).startswith(f"{bp.SPLIT}.0")
    assert not any(module_path(n).startswith(bp.SPLIT) for n in nodes[:first])
