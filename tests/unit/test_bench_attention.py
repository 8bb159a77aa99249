"""The pure parts of tools/bench_attention.py and tools/attention_models.py: option checks, the
limit's tiles and model, the ring byte accounting against ``ring_bytes``, the message kinds of
a compiled program, and the Section built from made-up worker records. No MPI and no timing:
the benchmark itself runs through ``tools/bench.py --only attention``."""

import argparse
import importlib.util
import sys
from pathlib import Path

import pytest
import torch

import fxpar
from fxpar.core.geometry import tile
from fxpar.runtime.spatial.attention import ring_bytes

TOOLS = Path(__file__).resolve().parents[2] / "tools"
NAMES = ("benchlib", "bench", "attention_models", "bench_attention")


@pytest.fixture(scope="module")
def ba():
    sys.path.insert(0, str(TOOLS))
    try:
        for name in NAMES:
            spec = importlib.util.spec_from_file_location(name, TOOLS / f"{name}.py")
            mod = importlib.util.module_from_spec(spec)
            sys.modules[name] = mod
            spec.loader.exec_module(mod)
        yield sys.modules["bench_attention"]
    finally:
        for name in NAMES:
            sys.modules.pop(name, None)
        sys.path.remove(str(TOOLS))


def _opts(ba, **kw):
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--quick", action="store_true")
    ba.add_args(p)
    o = p.parse_args([])
    for k, v in kw.items():
        setattr(o, k, v)
    return o


def test_config_and_its_refusals(ba):
    cfg = ba.config(_opts(ba))
    assert (cfg["vit_size"], cfg["swin_size"], cfg["parts"], cfg["memory_parts"]) == \
        (1024, 128, [2, 4], 4)
    assert ba.systems(cfg) == ["one", "sp2", "limit2", "sp4", "limit4"]
    assert ba._system("limit4") == ("limit", 4) and ba._system("one") == ("one", 1)
    quick = ba.config(_opts(ba, quick=True, rounds=5))
    assert quick["rounds"] == 1 and quick["vit_size"] == 128 and quick["swin_size"] == 64
    with pytest.raises(ValueError, match="unknown"):
        ba.config(_opts(ba, attention_models="vit,bert"))
    with pytest.raises(ValueError, match="SP sizes >= 2"):
        ba.config(_opts(ba, attention_parts="1"))
    with pytest.raises(ValueError, match="divisible by 32"):  # a 2x2 grid of 1008-pixel tiles
        ba.config(_opts(ba, attention_vit_size=1008, attention_models="vit"))
    with pytest.raises(ValueError, match="divisible by 64"):  # SwinUNETR's 2**5, on 2 tiles
        ba.config(_opts(ba, attention_swin_size=96, attention_models="swin"))
    with pytest.raises(ValueError, match="width,heads,depth,patch"):
        ba.config(_opts(ba, attention_vit="64,4"))
    with pytest.raises(ValueError, match="key=value"):
        ba.config(_opts(ba, attention_swin="feature_size"))


def test_model_arguments(ba):
    am = sys.modules["attention_models"]
    assert am.parse_vit("64,4,4,16") == {"width": 64, "heads": 4, "depth": 4, "patch": 16}
    with pytest.raises(ValueError, match="multiple of the heads"):
        am.parse_vit("30,4,2,16")
    assert am.parse_kwargs("feature_size=12; depths=2,2,2,2;use_v2=1;norm_name=batch") == \
        {"feature_size": 12, "depths": (2, 2, 2, 2), "use_v2": 1, "norm_name": "batch"}
    model = am.swin("feature_size=12;depths=1,1,1,1;num_heads=1,1,2,2;window_size=4")
    assert model.swinViT.window_size == (4, 4, 4)


def test_limit_tiles_are_fxpars(ba):
    am = sys.modules["attention_models"]
    for extent in (7, 64, 1024):
        for parts in (1, 2, 3, 4):
            assert [am.split(extent, parts, k) for k in range(parts)] == \
                [tile(extent, parts, k) for k in range(parts)]
    grid = fxpar.Plan(spatial_parts=4, slice="square").tile_grid(2)
    assert grid == (2, 2)
    assert am.box((64, 32), grid, 1) == (slice(0, 32), slice(16, 32))  # row-major: rank 1
    assert am.box((8, 64, 32), (1, 2, 2), 2) == (slice(0, 8), slice(32, 64), slice(0, 16))


def test_the_limits_repeated_keys_change_work_not_values(ba):
    """Attention over keys and values repeated P times gives the same output: the limit's
    ViT does P times the attention work of a ViT on its tile alone, nothing else."""
    am = sys.modules["attention_models"]
    torch.manual_seed(0)
    one = am.ViT((4, 4), width=16, heads=2, depth=2, patch=16).double()
    rep = am.ViT((4, 4), width=16, heads=2, depth=2, patch=16, kv_repeat=4).double()
    rep.load_state_dict(one.state_dict())
    x = torch.randn(1, 3, 64, 64, dtype=torch.float64)
    torch.testing.assert_close(rep(x), one(x))
    assert one(x).shape == (1, 4, 64, 64)


def test_expected_ring_is_ring_bytes_and_the_minimum(ba):
    am = sys.modules["attention_models"]
    calls = [{"lengths": [3, 3, 1], "batch": 2, "e": 8, "ev": 6, "dtype": torch.float64},
             {"lengths": [4, 4], "batch": 1, "e": 4, "ev": 4, "dtype": torch.float32}]
    got = am.expected_ring(calls[:1], 0)
    fwd, bwd = ring_bytes([3, 3, 1], 0, 2, 8, 6, torch.float64)
    assert (got["formula_fwd"], got["formula_bwd"]) == (fwd, bwd)
    row = 2 * 14 * 8  # batch x (e + ev) x itemsize
    assert got["kv"] == 7 * row and got["min_fwd"] == 4 * row
    assert got["min_bwd"] == 4 * 2 * 14 * (8 + 8)  # K, V again and dK, dV (float64 acc)
    both = am.expected_ring(calls, 1)
    assert both["min_fwd"] == 4 * row + 4 * 8 * 4  # rank 1: the other 4 and 4 tokens
    # even tiles: forward is (P-1)/P of K and V, backward adds every block's dK, dV once
    even = am.expected_ring([calls[1]], 0)
    assert even["formula_fwd"] == even["min_fwd"] == even["kv"] / 2
    assert even["formula_bwd"] == even["formula_fwd"] + even["kv"]


def test_message_kinds_of_a_compiled_vit(ba):
    am = sys.modules["attention_models"]
    model = am.ViT((4, 4), width=8, heads=2, depth=2, patch=16)
    program = fxpar.compile(model, fxpar.Plan(spatial_parts=2, slice="vertical"),
                            torch.empty(1, 3, 64, 64, device="meta"))
    tiles = [m for (stage, _), m in program.spatial.tiles.items() if stage == 0]
    kinds = am.tag_kinds(tiles[:1])
    assert sorted(kinds.values()).count("ring_fwd") == 2  # one per block
    assert {"ring_bwd", "halo_fwd", "halo_bwd"} <= set(kinds.values())
    assert all(kinds[t + 1] == k.replace("fwd", "bwd") for t, k in kinds.items()
               if k.endswith("fwd"))


def test_saved_step_counts_the_input_by_the_window_a_rank_reads(ba):
    am = sys.modules["attention_models"]
    conv = torch.nn.Conv2d(3, 4, 3, padding=1)
    x = torch.randn(1, 3, 8, 8)

    def step():
        loss = conv(x).relu().sum()
        loss.backward()
        return float(loss.detach())

    got = am.saved_step(step, list(conv.parameters()), [(x, x.nbytes // 4)])
    relu = 4 * 8 * 8 * 4  # relu's output, saved for its backward
    assert got["saved_input_bytes"] == x.nbytes // 4
    assert got["saved_bytes"] == relu + x.nbytes // 4
    assert got["saved_storage_bytes"] == relu + x.nbytes
    assert got["param_bytes"] == (4 * 3 * 9 + 4) * 4


def _step(parts, saved, ring=True, coverage=1.0, **extra):
    rec = {"saved_bytes": saved, "coverage": coverage, "ended": "" if coverage == 1.0 else
           "region ends at 'permute_2'", "grid": [1, parts], "ring_calls": 4 if ring else 0,
           "halo_fwd_bytes": 100.0, "halo_bwd_bytes": 100.0, "other_bytes": 0.0,
           "ring_fwd_bytes": 0.0, "ring_bwd_bytes": 0.0, **extra}
    if ring:
        kv = 2.0**20
        rec.update(ring_fwd_bytes=kv * (parts - 1) / parts, min_fwd=kv * (parts - 1) / parts,
                   ring_bwd_bytes=kv * (2 * parts - 1) / parts,
                   formula_fwd=kv * (parts - 1) / parts, formula_bwd=kv * (2 * parts - 1) / parts,
                   min_bwd=2 * kv * (parts - 1) / parts, kv=kv)
    return ba_summary([rec] * parts)


def ba_summary(ranks):
    return sys.modules["bench_attention"].summary(ranks)


def test_summary_takes_the_slowest_rank_and_the_mean_bytes(ba):
    out = ba.summary([{"step_s": 1.0, "saved_bytes": 10, "ring_fwd_bytes": 4.0},
                      {"step_s": 1.5, "saved_bytes": 30, "ring_fwd_bytes": 8.0}])
    assert out["step_s"] == 1.5 and out["saved_max"] == 30 and out["ring_fwd_bytes_rank"] == 6.0
    assert len(out["ranks"]) == 2


def test_section_from_records(ba, tmp_path):
    bench = sys.modules["bench"]
    cfg = ba.config(_opts(ba, rounds=2))
    rec = {"grid": [1, 2], "coverage": 1.0, "ended": ""}
    swin = {"grid": [1, 1, 2], "coverage": 0.8, "ended": "region ends at 'permute_2'"}
    rounds = [{"vit": {"one": {"step_s": 4.0}, "sp2": {"step_s": 2.5, **rec},
                       "limit2": {"step_s": 2.2}, "sp4": {"step_s": 2.0, **rec},
                       "limit4": {"step_s": 1.9}},
               "swin": {"one": {"step_s": 10.0}, "sp2": {"step_s": 8.0, **swin},
                        "limit2": {"step_s": 5.5}, "sp4": {"step_s": 7.0, **swin},
                        "limit4": {"step_s": 3.0}}}] * 2
    steps = {"vit/one": ba_summary([{"saved_bytes": 1000}]),
             "vit/sp2": _step(2, 520), "vit/sp4": _step(4, 260),
             "swin/one": ba_summary([{"saved_bytes": 1000}]),
             "swin/sp2": _step(2, 700, ring=False, coverage=0.8),
             "swin/sp4": _step(4, 450, ring=False, coverage=0.8)}
    sec = bench.check_section(ba.section(cfg, rounds, steps))
    vit2, vit4, swin2, swin4 = sec["aims"][:4]
    assert vit2["measured"].startswith("0.88") and vit2["met"]  # 2.2 / 2.5
    assert swin4["measured"].startswith("0.43") and not swin4["met"]
    assert "Only 80.0% of the forward FLOPs" in swin4["why"] and "2.50x" in swin4["why"]
    assert vit4["met"] and not swin2["met"] and "bound" in swin2["measured"]
    ring2, ring4, mem_vit, mem_swin = sec["aims"][4:]
    assert ring2["measured"] == "1.000x" and ring2["met"] and ring4["met"]
    assert mem_vit["measured"] == "0.260x" and mem_vit["met"]
    assert mem_swin["measured"] == "0.450x" and not mem_swin["met"]
    assert "coverage 0.800" in mem_swin["why"]
    timing, traffic, memory = sec["tables"]
    assert timing["rows"][1][4].startswith("1.60x") and timing["rows"][1][8] == "1.000"
    assert timing["rows"][5][8] == "0.800 (bound 2.50x)"
    # P=2: fwd 0.5, bwd 1.5 of K, V: step 2.0 against 2(P-1)/P = 1; ring_bytes matches
    assert traffic["rows"][0][3:11] == ["0.50", "0.50", "1.000", "1.50", "1.00", "1.500",
                                        "2.000", "1.0000"]
    assert traffic["rows"][2][3] == "-" and traffic["rows"][2][11] == "0.00"  # swin: halos
    assert memory["rows"][0][4:7] == ["0.260", "0.260", "0.250"]
    assert memory["rows"][0][8] == "0.260"  # no whole-storage count recorded: the same
    assert "(3P-2)/P" in sec["notes"]
    assert "P=4: backward 1.75 against 1.50 (1.17x), the step 2.50 against 1.50 (1.67x)" in \
        sec["notes"]
    md = bench.section_md(sec, {"machine": None}, tmp_path / "b.md", tmp_path / "plots",
                          tmp_path / "notes")
    assert "(2) Bytes sent per rank per step" in md
    assert (tmp_path / "plots" / "attention_speedup.png").exists()


def test_worker_parser_takes_what_the_driver_passes(ba):
    cfg = ba.config(_opts(ba, quick=True))
    a = ba.worker_parser().parse_args(
        ["--worker", "time", "--system", "limit", "--model", "swin", "--spec", cfg["swin"],
         "--size", str(cfg["swin_size"]), "--parts", "4", "--slice", "square", "--steps", "1",
         "--warmup", "1"])
    assert (a.system, a.parts, a.spec) == ("limit", 4, cfg["swin"])
