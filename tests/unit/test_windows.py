"""Input windows recorded at compile time (fxpar.compiler.windows): each rank's window is what
its stage modules read of the model input -- read off the rewritten tile graphs here (the halo
ops on the input: their windows clipped to the image; any other use: the whole image) -- in
memory, and the same after save + load (program.json, rank.json). Explicit models cover each
way a tile reads the input (a windowed op, a residual add, BatchNorm, a channels-last island,
a pad, an upsampling, a use in a later spatial stage); random CNNs and plans from the fuzzer's
generator (tests/helpers/fuzz/graphs.py) cover their combinations."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
from helpers.fuzz.graphs import build, plans, specs
from hypothesis import HealthCheck, assume, given, reject, settings
from hypothesis import strategies as st
from torch import fx, nn

import fxpar
from fxpar.core import meta
from fxpar.core.geometry import Rect
from fxpar.core.meta import TensorInfo
from fxpar.core.plan import PlanError
from fxpar.passes.halo import bounding
from fxpar.program.layout import rank_folder
from fxpar.program.loader import load
from fxpar.program.program import Program
from fxpar.runtime.spatial.ops import Halo, HaloOp


def reads(program: Program, rank: int) -> Rect | None:
    """What ``rank``'s stage modules read of the model input, from the modules themselves."""
    x = next(n for n in program.traced.graph.nodes if n.op == "placeholder")  # type: ignore
    shape = meta.get(x, TensorInfo).shape
    image = Rect.whole(shape[2:])
    rects: list[Rect] = []
    for (_copy, stage), module in program.stage_modules(rank).items():
        assert isinstance(module, fx.GraphModule)
        placeholders = [n for n in module.graph.nodes if n.op == "placeholder"]
        for i, src in enumerate(program.graph.inputs[stage]):
            if src.source != "batch":
                continue
            ph = placeholders[i]
            for user in ph.users:
                op = module.get_submodule(str(user.target)) if user.op == "call_module" \
                    else None
                if isinstance(op, (Halo, HaloOp)) and op.replicated and \
                        [a for a in user.all_input_nodes if a is ph] == [user.args[0]]:
                    inside = op.exchange.need.intersect(image)
                    if inside is not None:
                        rects.append(inside)
                else:  # the op reads the input as it is
                    rects.append(image)
    return bounding(rects) if rects else None


def windows_match_reads(program: Program) -> None:
    assert program.input_windows is not None
    got = [program.for_rank(r).input_window() for r in range(program.world_size)]
    want = [reads(program, r) for r in range(program.world_size)]
    assert got == want, f"recorded {got}\nread     {want}"


class InputEverywhere(nn.Module):
    """The input read by a strided convolution, a residual add, BatchNorm, a channels-last
    LayerNorm (an island that starts at the input), a pad, an upsampling and a max pool."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 3, 5, stride=2, padding=1)
        self.bn = nn.BatchNorm2d(3)
        self.norm = nn.LayerNorm(3)
        self.same = nn.Conv2d(3, 3, 3, padding=1)
        self.head = nn.Linear(3, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.same(x) + x + self.bn(x)
        b = self.norm(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)
        c = nn.functional.interpolate(nn.functional.max_pool2d(x, 3, 2, 1), scale_factor=2)
        d = nn.functional.pad(x, (2, 1, 0, 3))[:, :, :x.shape[2], :x.shape[3]]
        y = a + b + c[:, :, :x.shape[2], :x.shape[3]] + d
        return self.head((self.conv(y) + self.conv(x)).mean((2, 3)))


class LateInput(nn.Module):
    """The input also enters at the end (a U-Net's last concatenation): with two spatial
    stages, the second stage's tiles read it too."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(*(nn.Sequential(nn.Conv2d(3, 3, 3, padding=1), nn.ReLU())
                                    for _ in range(4)))
        self.out = nn.Conv2d(6, 4, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.cat([self.body(x), x], 1)).mean((2, 3))


def _tiny() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
                         nn.MaxPool2d(2), nn.Conv2d(4, 6, 3, padding=1), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(6, 3))


CASES: dict[str, tuple[Any, tuple[int, ...], dict[str, Any]]] = {
    "tiny SP4 square + a stage": (_tiny, (4, 3, 20, 20), dict(stages=2, spatial_parts=4)),
    "tiny no spatial": (_tiny, (4, 3, 20, 20), dict(stages=2)),
    "tiny SP2 GEMS": (_tiny, (4, 3, 20, 20), dict(stages=2, spatial_parts=2, gems=True)),
    "tiny SP2 DP2": (_tiny, (4, 3, 20, 20), dict(stages=2, spatial_parts=2, data_parallel=2)),
    "every read SP4 square": (InputEverywhere, (2, 3, 17, 15), dict(spatial_parts=4)),
    "every read SP3 horizontal": (InputEverywhere, (2, 3, 19, 12),
                                  dict(spatial_parts=3, slice="horizontal")),
    "late input, 2 spatial stages": (LateInput, (2, 3, 16, 13),
                                     dict(stages=2, spatial_parts=2, spatial_stages=2,
                                          balance=(6, 5))),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_recorded_windows_are_what_each_rank_reads(case):
    model, shape, plan = case
    program = fxpar.compile(model(), fxpar.Plan(**plan), torch.empty(shape, device="meta"))
    windows_match_reads(program)


def test_windows_cover_more_than_the_tile_where_the_input_is_read_late():
    """The second spatial stage's tiles read the input for the last concatenation's 3x3
    convolution: each rank's window is its two roles' (both tiles) bounding box, not None."""
    model, shape, plan = CASES["late input, 2 spatial stages"]
    program = fxpar.compile(model(), fxpar.Plan(**plan), torch.empty(shape, device="meta"))
    stage1 = {r for r in range(program.world_size)
              if any(role.stage == 1 for role in program.rank_map.roles_of(r))}
    assert stage1 and all(program.input_windows[r] is not None for r in stage1)  # type: ignore


@pytest.mark.parametrize("case", ["tiny SP4 square + a stage", "tiny SP2 GEMS",
                                  "every read SP3 horizontal", "late input, 2 spatial stages"])
def test_saved_and_loaded_windows_equal_the_compiled_ones(tmp_path, case):
    model, shape, plan = CASES[case]
    program = fxpar.compile(model(), fxpar.Plan(**plan), torch.empty(shape, device="meta"))
    program.save(tmp_path)
    info = json.loads((tmp_path / "program.json").read_text())
    want = [program.for_rank(r).input_window() for r in range(program.world_size)]
    as_json = [None if w is None else [list(w.h), list(w.w)] for w in want]
    assert info["input_windows"] == as_json
    for r in range(program.world_size):
        rank_info = json.loads((tmp_path / rank_folder(r) / "rank.json").read_text())
        assert rank_info["input_window"] == as_json[r]
        assert load(tmp_path, rank=r).input_window() == want[r]


def test_a_folder_without_windows_reads_the_whole_image_where_it_reads_the_input(tmp_path):
    """program.json written before windows were recorded: the whole image on the ranks whose
    stages take the input (its size given, as fxpar-run does), None elsewhere."""
    model, shape, plan = CASES["tiny SP4 square + a stage"]
    fxpar.compile(model(), fxpar.Plan(**plan), torch.empty(shape, device="meta")).save(tmp_path)
    path = tmp_path / "program.json"
    info = json.loads(path.read_text())
    del info["input_windows"]
    path.write_text(json.dumps(info))
    full = Rect((0, 20), (0, 20))
    assert [load(tmp_path, rank=r).input_window(image=(20, 20)) for r in range(5)] == \
        [full] * 4 + [None]
    with pytest.raises(ValueError, match="does not record the image size"):
        load(tmp_path, rank=0).input_window()


@settings(max_examples=30, derandomize=True, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                 HealthCheck.filter_too_much])
@given(data=st.data())
@pytest.mark.slow
def test_random_cnns_and_spatial_plans(data):
    spec = data.draw(specs())
    plan = data.draw(plans(spec))
    assume(plan.get("spatial_parts", 1) > 1)
    shape = (spec["batch"], spec["channels"], *spec["size"])
    try:
        program = fxpar.compile(build(spec), fxpar.Plan(**plan), torch.empty(shape,
                                                                             device="meta"))
    except PlanError:
        reject()
    windows_match_reads(program)


@pytest.mark.parametrize("plan", [fxpar.Plan(spatial_parts=8, slice="cube"),
                                  fxpar.Plan(grid=(3, 1, 2)),
                                  fxpar.Plan(stages=2, spatial_parts=4, slice="pencil",
                                             microbatches=2)])
def test_volume_windows_are_each_ranks_block_plus_halo(plan, tmp_path):
    """A volume model (the zoo's 3D U-Net: a 3x3x3 convolution, padding 1, reads the input):
    each spatial rank reads its block of the volume plus one cell on each inner face, edge and
    corner, in memory and after save + load."""
    from fxpar import models

    model = models.build("unet3d", in_channels=1, num_classes=2, base=2, depth=2)
    shape = (2, 1, 14, 8, 10)
    program = fxpar.compile(model, plan, torch.empty(shape, device="meta"))
    windows_match_reads(program)
    grid = program.spatial.grid  # type: ignore[union-attr]
    for rank in range(program.world_size):
        role = program.rank_map.roles_of(rank)[0]
        got = program.for_rank(rank).input_window()
        if role.stage > 0:
            assert got is None
            continue
        block = grid.tile_rect(shape[2:], role.tile)
        want = Rect(*((max(a - 1, 0), min(b + 1, e))
                      for (a, b), e in zip(block.dims, shape[2:], strict=True)))
        assert got == want, (rank, got, want)
    program.save(tmp_path / "job")
    assert [load(tmp_path / "job", rank=r).input_window() for r in range(program.world_size)] \
        == [program.for_rank(r).input_window() for r in range(program.world_size)]
