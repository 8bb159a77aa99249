"""The pure parts of tools/bench_volume.py: the N-D halo-minimum formula (by hand, and against
fxpar's compile-time exchanges and halo_table's columns), the option checks, and the Section
built from made-up worker records. No MPI and no timing: the benchmark itself runs through
``tools/bench.py --only volume``."""

import argparse
import importlib.util
import re
import sys
from pathlib import Path

import pytest
import torch

import fxpar
from fxpar.compiler.report import halo_table
from fxpar.core.geometry import tile, transposed_rows
from fxpar.core.units import nbytes

TOOLS = Path(__file__).resolve().parents[2] / "tools"


@pytest.fixture(scope="module")
def bv():
    sys.path.insert(0, str(TOOLS))
    names = ("benchlib", "bench", "bench_volume")
    try:
        for name in names:
            spec = importlib.util.spec_from_file_location(name, TOOLS / f"{name}.py")
            mod = importlib.util.module_from_spec(spec)
            sys.modules[name] = mod  # dataclasses look their module up
            spec.loader.exec_module(mod)
        yield sys.modules["bench_volume"]
    finally:
        for name in names:
            sys.modules.pop(name, None)
        sys.path.remove(str(TOOLS))


def _win(bv, extent, out, k, s, p, transposed=False, c=1):
    n = len(extent)
    return bv.Window("l", 1, c, 4, extent, out, (k,) * n, (s,) * n, (p,) * n, (1,) * n,
                     transposed, False)


def test_split_is_fxpars_rule(bv):
    for extent in (7, 8, 33, 128):
        for parts in (1, 2, 3, 4):
            assert [bv.split(extent, parts, k) for k in range(parts)] == \
                [tile(extent, parts, k) for k in range(parts)]


def test_transposed_reads_are_fxpars(bv):
    for k, s, p in ((2, 2, 0), (3, 2, 1), (4, 2, 1), (3, 1, 1)):
        for out in ((0, 5), (3, 9), (6, 12)):
            lo, hi = transposed_rows(out, k, s, p, 1)
            assert bv.reads(out, k, s, p, 1, 100, transposed=True) == (max(lo, 0), min(hi, 100))


def test_halo_cells_by_hand(bv):
    conv = _win(bv, (8, 8, 8), (8, 8, 8), 3, 1, 1)
    assert bv.halo_cells(conv, (2, 1, 1)) == [64, 64]  # one 8x8 face each way
    assert bv.halo_cells(conv, (2, 2, 2)) == [5**3 - 4**3] * 8  # 3 faces, 3 edges, 1 corner
    assert bv.halo_cells(conv, (1, 1, 1)) == [0]
    assert bv.halo_cells(_win(bv, (8, 8, 8), (4, 4, 4), 2, 2, 0), (2, 2, 2)) == [0] * 8  # pool
    up = _win(bv, (4, 4, 4), (8, 8, 8), 2, 2, 0, transposed=True)
    assert bv.halo_cells(up, (2, 2, 1)) == [0] * 4  # each output reads one input cell, its own


def test_windowed_layers_of_the_unet(bv):
    layers = bv.windowed_layers(bv.build("2,3", meta=True), (1, 1, 16, 16, 16))
    # 5 levels of two 3x3x3 convs, 2 pools, 2 transposed convs, the 1x1x1 head
    assert len(layers) == 15
    assert [lay.reads_input for lay in layers].count(True) == 1 and layers[0].reads_input
    assert sum(lay.transposed for lay in layers) == 2
    assert layers[0].extent == (16, 16, 16) and layers[0].k == (3, 3, 3)


@pytest.mark.parametrize("slice_,parts", [("slab", 2), ("pencil", 4), ("cube", 8)])
def test_planned_equals_minimum_formula_and_halo_table(bv, slice_, parts):
    """fxpar's exchanges receive exactly halo_table's minimum and the model-only formula, tile
    by tile, send as much as they receive over the grid, and halo_table prints those bytes."""
    shape = (1, 1, 16, 16, 16)
    program = fxpar.compile(bv.build("2,3", meta=True),
                            fxpar.Plan(spatial_parts=parts, slice=slice_),
                            torch.empty(shape, device="meta"))
    tiles = bv.planned_halos(program)
    grid = program.spatial.grid.parts
    formula = bv.formula_minimum(bv.windowed_layers(bv.build("2,3", meta=True), shape), grid)
    assert len(tiles) == parts
    assert [t["recv"] for t in tiles] == [t["minimum"] for t in tiles] == formula["per_tile"]
    assert all(t["recv"] > 0 for t in tiles) and formula["input"] > 0
    assert sum(t["sent"] for t in tiles) == sum(t["recv"] for t in tiles)
    table = halo_table(program)
    for t, rec in enumerate(tiles):
        row = next(ln for ln in table.splitlines() if re.match(rf"0\s+{t}\s", ln))
        assert f"{nbytes(rec['recv'])}  {nbytes(rec['minimum'])}" in re.sub(r" {2,}", "  ",
                                                                            row)


def _opts(bv, **kw):
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--quick", action="store_true")
    bv.add_args(p)
    o = p.parse_args([])
    for k, v in kw.items():
        setattr(o, k, v)
    return o


def test_config(bv):
    cfg = bv.config(_opts(bv))
    assert (cfg["size"], cfg["model"], cfg["parts"], cfg["compile_size"],
            cfg["compile_parts"], cfg["speed_size"]) == (128, "32,4", 8, 1024, 64, 96)
    assert cfg["systems"] == ["eager", "fxpar1", "sp", "ideal"]
    assert cfg["wire"] and cfg["rounds"] == 3
    quick = bv.config(_opts(bv, quick=True, rounds=0))
    assert quick["size"] == 32 and quick["rounds"] == 1
    with pytest.raises(ValueError, match="multiple of 8"):
        bv.config(_opts(bv, volume_size=100))
    with pytest.raises(ValueError, match="base,depth"):
        bv.config(_opts(bv, volume_speed_model="8"))
    with pytest.raises(ValueError, match="at least 4 cells"):
        bv.config(_opts(bv, volume_compile_size=16, volume_compile_model="2,4"))


def _ranks(n, **rec):
    return {"ranks": [dict(rec) for _ in range(n)], **rec}


def test_section_from_records(bv, tmp_path):
    bench = sys.modules["bench"]
    cfg = bv.config(_opts(bv, rounds=2))
    cfg.update(memory_model="32,4", memory_fallback=None)
    memory = {"eager": _ranks(1, saved_bytes=8000, peak_growth=10000, param_bytes=10,
                              step_s=100.0),
              "sp": _ranks(8, saved_bytes=1040, peak_growth=1600, param_bytes=10, step_s=60.0,
                           grid=[2, 2, 2], halo_fwd_bytes=50.0, halo_bwd_bytes=50.0)}
    compiles = [{"cold_s": c, "warm_s": [0.25, 0.3], "rss_gb": 1.0, "imports_s": 2.0,
                 "world_size": 64, "grid": [4, 4, 4], "nodes": 147} for c in (1.4, 1.6)]
    timing = [{"eager": {"step_s": 2.0}, "ideal": {"step_s": 1.1}, "fxpar1": {"step_s": 2.1},
               "sp": {"step_s": 1.25, "ranks": [{"halo_wait_s": 0.1}] * 2}}] * 2
    tiles = [{"recv": 50, "sent": 50, "minimum": 50, "halos": 9}] * 8
    halos = [{"model": m, "size": s, "slice": "cube", "parts": 8, "grid": [2, 2, 2],
              "tiles": tiles, "formula": {"per_tile": [50] * 8, "input": 7},
              "windowed_layers": 15, "table": "..."} for m, s in (("8,3", 96), ("32,4", 128))]
    wire = {"8,3@96/cube": _ranks(8, halo_fwd_bytes=60.0, halo_bwd_bytes=60.0)}
    sec = bench.check_section(bv.section(cfg, memory, compiles, timing, halos, wire))
    mem, comp, *halo = sec["aims"]
    assert mem["measured"] == "0.130x" and mem["met"]
    assert comp["measured"].startswith("1.50 s") and comp["met"]
    assert [h["measured"] for h in halo] == ["1.200x", "1.000x"]  # wire, then memory's launch
    assert not halo[0]["met"] and halo[0]["why"] and halo[1]["met"]
    speed = sec["tables"][2]["rows"][0]
    assert speed[6].startswith("1.60x") and speed[7].startswith("1.82x")
    assert sec["tables"][3]["rows"][0][3:7] == [0.0, 0.0, 0.0, 1.0]  # MiB of 100 bytes
    md = bench.section_md(sec, {"machine": None}, tmp_path / "b.md", tmp_path / "plots",
                          tmp_path / "notes")
    assert "(1) Bytes saved for backward" in md and (tmp_path / "plots/volume_halo.png").exists()
