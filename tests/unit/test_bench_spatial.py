"""The pure parts of tools/bench_spatial.py and tools/bench_memory.py: the halo-minimum formula
(by hand, and against fxpar's compile-time exchanges), the size search, the Section tables.
No MPI and no timing: the benchmarks themselves run through tools/bench.py."""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import fxpar
from fxpar.core.geometry import tile
from fxpar.runtime.spatial.ops import Halo, HaloOp

TOOLS = Path(__file__).resolve().parents[2] / "tools"


def _load(name):
    spec = importlib.util.spec_from_file_location(name, TOOLS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # dataclasses look their module up; bench_memory imports it
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def mods():
    sys.path.insert(0, str(TOOLS))
    try:
        yield _load("bench_spatial"), _load("bench_memory")
    finally:
        for name in ("bench_spatial", "bench_memory"):
            sys.modules.pop(name, None)
        sys.path.remove(str(TOOLS))


def _layer(bs, extent, out, k, s, p, d=1, c=1):
    return bs.Layer("l", 1, c, 4, extent, out, (k, k), (s, s), (p, p), (d, d), False)


def test_split_is_fxpars_rule(mods):
    bs, _ = mods
    for extent in (7, 8, 33, 1024):
        for parts in (1, 2, 3, 4):
            assert [bs.split(extent, parts, k) for k in range(parts)] == \
                [tile(extent, parts, k) for k in range(parts)]


def test_grid_is_plans_rule(mods):
    bs, _ = mods
    for parts in (1, 2, 3, 4, 6, 8, 16):
        for slice_ in ("vertical", "horizontal", "square"):
            plan = fxpar.Plan(spatial_parts=parts, slice=slice_)
            assert bs.grid_of(parts, slice_) == plan.tile_grid()


def test_halo_cells_by_hand(mods):
    bs, _ = mods
    conv3 = _layer(bs, (8, 8), (8, 8), 3, 1, 1)
    assert bs.halo_cells(conv3, (1, 2)) == 2 * 8  # one column of 8 rows each way
    assert bs.halo_cells(conv3, (2, 2)) == 4 * (5 * 5 - 4 * 4)  # row + column + corner
    assert bs.halo_cells(conv3, (1, 1)) == 0
    # stride 2: tile 0's outputs stay inside it; tile 1's first output reads column 3
    assert bs.halo_cells(_layer(bs, (8, 8), (4, 4), 3, 2, 1), (1, 2)) == 8
    assert bs.halo_cells(_layer(bs, (8, 8), (4, 4), 1, 2, 0), (1, 2)) == 0  # 1x1 stride 2
    # dilation 2 reads two columns across; the far tile of 3 still only its neighbours
    assert bs.halo_cells(_layer(bs, (9, 9), (9, 9), 3, 1, 2, d=2), (1, 3)) == 4 * 2 * 9


def test_windowed_layers_and_pad_shift(mods):
    bs, _ = mods
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ZeroPad2d((-1, 1, -1, 1)),
                          nn.Conv2d(4, 4, 1, stride=2), nn.MaxPool2d(2, ceil_mode=True))
    layers = bs.windowed_layers(model.to("meta"), (2, 3, 8, 8))
    assert [lay.name for lay in layers] == ["0", "1", "2", "3"]
    assert [lay.reads_input for lay in layers] == [True, False, False, False]
    pad = layers[1]
    assert (pad.c, pad.p, pad.k, pad.extent, pad.out) == (4, (-1, -1), (1, 1), (8, 8), (8, 8))
    # the shift reads one column ahead: tile 0 takes column 4 for rows 1..7 only
    assert bs.halo_cells(pad, (1, 2)) == 7
    minimum = bs.halo_minimum(layers, (1, 2))
    assert minimum["exchanged"] == 7 * 2 * 4 * 4  # cells x batch x channels x float32
    assert minimum["input"] == 2 * 8 * 2 * 3 * 4  # the first conv reads the image


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(3, 4, 5, stride=2, padding=2), nn.BatchNorm2d(4), nn.ReLU(),
            nn.MaxPool2d(3, 2, padding=1), nn.Conv2d(4, 6, 3, padding=2, dilation=2),
            nn.AvgPool2d(3, 1, padding=1, count_include_pad=False), nn.Conv2d(6, 6, (1, 7),
                                                                               padding=(0, 3)))
        self.fc = nn.Linear(6, 3)

    def forward(self, x):
        return self.fc(self.body(x).mean((2, 3)))


@pytest.mark.parametrize("parts,slice_", [(2, "vertical"), (4, "square"), (3, "horizontal")])
def test_minimum_equals_fxpars_exchanges(mods, parts, slice_):
    """fxpar's compile-time exchanges receive exactly the formula's cells (it sends no more
    than each layer reads); the image-reading layer is sliced, not exchanged."""
    bs, _ = mods
    shape = (2, 3, 37, 30)
    torch.manual_seed(0)
    model = _Net()
    program = fxpar.compile(model, fxpar.Plan(spatial_parts=parts, slice=slice_),
                            torch.empty(shape, device="meta"))
    got = 0
    for t in range(parts):
        for m in program.spatial.tile(0, t).modules():
            if isinstance(m, (Halo, HaloOp)) and not m.replicated:
                got += m.exchange.recv_elements()
    layers = bs.windowed_layers(_Net().to("meta"), shape)
    want = sum(bs.halo_cells(lay, bs.grid_of(parts, slice_)) for lay in layers
               if not lay.reads_input)
    assert got == want > 0


def test_largest_search(mods):
    _, bm = mods
    calls = []

    def fits(size):
        calls.append(size)
        return size <= 5000

    for guess in (0, 256, 4000, 4864, 5120, 20000, 100000):
        assert bm.largest(fits, guess) == 4864
    calls.clear()
    assert bm.largest(fits, 4864) == 4864 and calls == [4864, 5120]  # a good guess: 2 calls
    assert bm.largest(lambda s: False, 3000) == 0
    assert bm.largest(lambda s: s <= 256, 9000) == 256


def test_sections_tables_and_aims(mods):
    bs, bm = mods
    cfg = {"image": 64, "batch": 1, "steps": 2, "warmup": 1, "amoeba": "2,16",
           "models": ["resnet18"]}
    rounds = [{"resnet18": {"eager": {"step_s": 2.0}, "sp": {"step_s": 1.25, "halo_wait_s": 0.2},
                            "fxpar1": {"step_s": 2.1}}}]
    halos = {"resnet18/1x2": {"model": "resnet18", "grid": (1, 2), "measured": 220.0,
                              "minimum": {"exchanged": 100, "input": 8}, "other": 0.0,
                              "layers": 3}}
    sec = bs.section(rounds, halos, cfg, ["eager", "sp", "fxpar1"])
    for t in sec["tables"]:
        assert all(len(r) == len(t["columns"]) for r in t["rows"])
    speed, halo = sec["aims"]
    assert speed["measured"].startswith("1.60x") and not speed["met"] and "0.100 s" in \
        speed["why"]
    assert halo["measured"] == "1.100x" and not halo["met"] and halo["why"]
    one = {"saved": 400.0, "growth": 1000.0, "raised": True, "param_bytes": 10}
    meas = {"resnet18/1": {**one, "slice": "square"},
            "resnet18/2": {**one, "saved": 210.0, "growth": 600.0, "slice": "vertical"},
            "resnet18/4": {**one, "saved": 110.0, "growth": 400.0, "slice": "square"}}
    est = [{"model": "resnet50", "parts": 1, "size": 5120, "bytes": 2**36}]
    sec = bm.section(meas, est, [], {**cfg, "budget": 80 * 2**30})
    saved, growth = sec["aims"]
    assert saved["met"] and saved["measured"] == "0.275x"
    assert not growth["met"] and growth["measured"] == "0.400x" and growth["why"]
    assert sec["tables"][1]["rows"][0][-1] == "estimated, not measured"


def test_memory_breakdown_tables(mods):
    _, bm = mods
    mib = 2**20

    def launch(parts: dict[str, float], growth: float, live: float) -> dict:
        return {"parts": {k: v * mib for k, v in parts.items()}, "growth": growth * mib,
                "peak_op": "aten.op", "held": {"parameters": 40 * mib, "input": 24 * mib},
                "live_peak_growth": live * mib}

    one = launch({"gradients": 40, "saved activations": 600, "glibc free heap": 300}, 940, 880)
    four = launch({"gradients": 40, "saved activations": 80, "glibc free heap": 200}, 320, 250)
    b = {"1": one, "4": four,
         **{f"{label}/{p}": {"growth": g * mib} for label in bm.MALLOC_ENVS
            for p, g in (("1", 900), ("4", 270))}}
    parts, other = bm.breakdown_tables(b)
    for t in (parts, other):
        assert all(len(r) == len(t["columns"]) for r in t["rows"])
    rows = {r[0]: r[1:] for r in parts["rows"]}
    assert rows["glibc free heap"] == ["300.0", "200.0", "0.667"]
    assert rows["**peak RSS growth (sum)**"] == ["940.0", "320.0", "0.340"]
    assert other["rows"][-1][-1] == f"{250 / 880:.3f}"
    why = bm._growth_why(b)
    assert "200.0 MiB of freed heap" in why and "0.300x" in why
    assert bm.breakdown_tables({}) == [] and bm._growth_why({}) == ""
