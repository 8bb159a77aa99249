"""Sequences (N, C, L) as a one-dimensional tile grid (issue 40, item 4), without MPI: the
plan's grid, the rules of the 1-D ATen ops as torch.export captures them (training IR), the
region and its coverage on a 1-D classifier and U-Net, the halo ops on sequence tiles run by
threads (tests/helpers/threads.py) against the whole sequence (forward and backward, split
convolution included), what each rank reads of the input, region-by-region prediction, and
what is refused with its reason. tests/mpi/test_seq1d.py trains them under mpiexec."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import seq1d
from helpers.threads import ThreadComm, run_threads
from torch import nn

import fxpar
from fxpar.core.geometry import Grid, Rect, exchange, out_extent
from fxpar.core.plan import SLICES, PlanError
from fxpar.core.values import dumps
from fxpar.frontend.rules.aten_ops import RULES
from fxpar.frontend.rules.opclass import Norm, Pointwise, Reduce, Window, classify, why_not
from fxpar.frontend.trace import trace
from fxpar.passes.spatial_region import (
    Coverage,
    image_grid,
    region_ends,
    spatial_dims,
    spatial_region,
)
from fxpar.runtime.spatial import haloconv
from fxpar.runtime.spatial.group import bound

aten = torch.ops.aten
KEY = "c0s0"
INF = float("inf")


# -- the plan -----------------------------------------------------------------------------------
@pytest.mark.parametrize("slice", SLICES)
def test_every_slice_cuts_a_sequence_into_parts_along_l(slice):
    assert fxpar.Plan(spatial_parts=3, slice=slice).tile_grid(1) == (3,)


def test_an_explicit_grid_of_a_sequence_has_one_dim():
    assert fxpar.Plan(grid=(4,)).tile_grid(1) == (4,)
    with pytest.raises(PlanError, match=r"has 2 dims but the input is a sequence \(L\)"):
        fxpar.Plan(grid=(2, 2)).tile_grid(1)


# -- rules ----------------------------------------------------------------------------------------
class Ops(nn.Module):
    """One of every 1-D op class between two convolutions."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Conv1d(2, 4, 5, stride=2, padding=2, dilation=1)
        self.t = nn.ConvTranspose1d(4, 4, 3, stride=2, padding=1, output_padding=1)
        self.same = nn.ConvTranspose1d(4, 4, 3, padding=1)
        self.gn = nn.GroupNorm(2, 4)
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        y = self.gn(self.a(x))
        y = F.max_pool1d(y, 3, stride=2, padding=1, ceil_mode=True)
        y = F.avg_pool1d(y, 3, stride=2, padding=1, count_include_pad=False)
        y = self.same(self.t(y))
        y = F.interpolate(y, scale_factor=2, mode="linear", align_corners=False)
        y = F.interpolate(y, size=41, mode="nearest")
        y = F.pad(F.pad(y, (2, 1), mode="reflect"), (1, 0), mode="replicate")
        y = F.adaptive_avg_pool1d(y, 5) + F.adaptive_max_pool1d(y, 5)  # 45: divides
        bins = F.adaptive_avg_pool1d(y, 2) + F.adaptive_max_pool1d(y, 2)  # 5: does not
        return self.fc(y.mean(-1)) + F.adaptive_avg_pool1d(y, 1).sum() + y.amax(2).sum() + \
            bins.sum()


def _classes(gm: torch.fx.GraphModule) -> dict[str, object]:
    return {n.name: classify(gm, n) for n in gm.graph.nodes if n.op == "call_function"}


def test_rules_of_the_1d_ops_as_torch_export_captures_them():
    """The training IR keeps the 1-D ops (aten.conv1d, aten.max_pool1d, aten.avg_pool1d,
    aten.conv_transpose1d, aten.upsample_linear1d / nearest1d, aten.reflection_pad1d, ...):
    each has its own entry, with the per-dim arguments of one dim."""
    gm = trace(Ops(), (2, 2, 101))
    got = _classes(gm)
    assert got["conv1d"] == Window("conv", (5,), (2,), (2,), (1,))
    assert got["group_norm"] == Norm(2, 1e-5, 2, 3)
    assert got["max_pool1d"] == Window("maxpool", (3,), (2,), (1,), (1,), fill=-INF,
                                       attrs=(("ceil_mode", True),))
    assert got["avg_pool1d"] == Window("avgpool", (3,), (2,), (1,), (1,), attrs=(
        ("ceil_mode", False), ("count_include_pad", False), ("divisor_override", None)))
    assert got["conv_transpose1d"] == Window("convT", (3,), (2,), (1,), (1,),
                                             attrs=(("output_padding", (1,)),))
    assert got["conv_transpose1d_1"] == Window("conv", (3,), (1,), (1,), (1,),
                                               attrs=(("transposed", True),))
    for name in ("upsample_linear1d", "upsample_nearest1d", "pad", "pad_1"):
        op = got[name]
        assert isinstance(op, Window) and op.kind == "interp" and op.ndim == 1, (name, op)
    pool = got["adaptive_avg_pool1d"]  # to a divisor of 45: a pool, kernel = stride = 9
    assert isinstance(pool, Window) and (pool.kind, pool.k, pool.s) == ("avgpool", (9,), (9,))
    # adaptive max pooling to a divisor: rewritten at capture into a max pool
    assert got["max_pool1d_1"] == Window("maxpool", (9,), (9,), (0,), (1,), fill=-INF,
                                         attrs=(("ceil_mode", False),))
    assert got["adaptive_avg_pool1d_1"] == Reduce("bins", True, (2,))
    assert got["adaptive_max_pool1d_1"] == Reduce("maxbins", True, (2,))
    assert got["mean"] == Reduce("mean", False, (1,))
    assert got["amax"] == Reduce("amax", False, (1,))
    assert Reduce("mean", True, (1,)) in got.values()  # adaptive_avg_pool1d to 1


@pytest.mark.parametrize("packet", [
    aten.conv1d, aten.conv_transpose1d, aten.max_pool1d, aten.avg_pool1d,
    aten.upsample_linear1d, aten.upsample_nearest1d, aten.adaptive_avg_pool1d,
    aten.adaptive_max_pool1d, aten.reflection_pad1d, aten.replication_pad1d])
def test_each_1d_op_is_one_entry_of_the_rules(packet):
    assert packet in RULES


def test_channel_ops_on_a_sequence_are_per_position():
    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Conv1d(2, 6, 3, padding=1), nn.Conv1d(6, 4, 1)

        def forward(self, x):
            y = self.a(x)
            p, q = torch.split(y, [2, 4], 1)
            return self.b(torch.cat([p.softmax(1), q], 1) * y.mean(1, keepdim=True))

    gm = trace(M(), (2, 2, 31))
    got = _classes(gm)
    assert got["softmax"] == got["mean"] == got["cat"] == Pointwise()
    spatial_region(gm, fxpar.Plan(spatial_parts=3))
    assert region_ends(gm) == []


# -- the region -----------------------------------------------------------------------------------
@pytest.mark.parametrize("name, shape", [("Classifier", (2, 2, 4099)),
                                         ("UNet1d", (2, 2, 1001)), ("PerPosition", (2, 2, 43))])
def test_the_region_covers_the_1d_models(name, shape):
    """PerPosition: a channels-last block (a token layout, fxpar.frontend.rules.tokens) and a
    max over the channels brought back by unsqueeze (a per-position island, rules.islands)."""
    gm = trace(getattr(seq1d, name)(), shape)
    assert spatial_dims(gm) == 1
    spatial_region(gm, fxpar.Plan(spatial_parts=4, slice="square"))
    assert image_grid(gm) == Grid(4)
    assert region_ends(gm) == []
    assert gm.meta[Coverage.KEY].share >= 0.95


def test_monai_unets_with_one_spatial_dim_run_wholly_on_tiles():
    """MONAI's UNet (strided convolutions, instance norm, PReLU, transposed convolutions,
    residual units) and BasicUNet (max pools, transposed convolutions, padding to the skip's
    length) with ``spatial_dims=1``, unchanged."""
    import monai.networks.nets as mn

    for model, length in ((mn.UNet(spatial_dims=1, in_channels=2, out_channels=3,
                                   channels=(4, 8, 16), strides=(2, 2), num_res_units=1), 1024),
                          (mn.BasicUNet(spatial_dims=1, in_channels=2, out_channels=3,
                                        features=(4, 4, 8, 8, 16, 4)), 1001)):
        gm = trace(model, (2, 2, length))
        spatial_region(gm, fxpar.Plan(spatial_parts=3))
        assert region_ends(gm) == [] and gm.meta[Coverage.KEY].share == 1.0


def test_an_op_without_a_rule_ends_the_region_and_says_why():
    """max_pool1d with return_indices=True (max_unpool's partner) has no rule."""
    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.fc = nn.Conv1d(2, 4, 3, padding=1), nn.Linear(4, 3)

        def forward(self, x):
            y, _ = F.max_pool1d(self.a(x), 2, return_indices=True)
            return self.fc(y.mean(-1))

    gm = trace(M(), (2, 2, 40))
    spatial_region(gm, fxpar.Plan(spatial_parts=2))
    (end,) = region_ends(gm)
    assert "aten.max_pool1d_with_indices" in end and "cannot run on tiles" in end
    (pool,) = [n for n in gm.graph.nodes if "max_pool1d_with_indices" in n.name]
    assert why_not(gm, pool) == ("fxpar has no tiling rule for aten.max_pool1d_with_indices, "
                                 "so it never guesses")


def test_a_sequence_shorter_than_the_tile_grid_says_what_fits():
    with pytest.raises(PlanError, match=r"\(the 6 input 'input_1' is smaller than the 8 tile "
                                        r"grid\): use a sequence of at least 8, or "
                                        r"spatial_parts <= 6$"):
        fxpar.compile(nn.Sequential(nn.Conv1d(2, 4, 3, padding=1), nn.Conv1d(4, 2, 1)),
                      fxpar.Plan(spatial_parts=8), torch.empty(2, 2, 6, device="meta"))


def test_a_2d_grid_on_a_sequence_is_refused():
    with pytest.raises(PlanError, match=r"has 2 dims but the input is a sequence \(L\)"):
        fxpar.compile(nn.Conv1d(2, 4, 3), fxpar.Plan(grid=(2, 2)),
                      torch.empty(2, 2, 16, device="meta"))


def test_each_rank_reads_its_tile_and_halo_of_the_sequence():
    """The classifier's first convolution (kernel 5, padding 2) reads 2 samples past each
    tile border: RankProgram.input_window is the tile widened by 2, clipped to the sequence."""
    program = fxpar.compile(seq1d.Classifier(), fxpar.Plan(spatial_parts=3),
                            torch.empty(2, 2, 4099, device="meta"))
    windows = [program.for_rank(r).input_window() for r in range(3)]
    assert windows == [Rect((0, 1368)), Rect((1364, 2734)), Rect((2730, 4099))]
    assert str(windows[1]) == "L 1364:2734"


# -- halo ops on sequence tiles, on threads ------------------------------------------------------
CFGS = {"conv": lambda w: {"stride": w.s, "dilation": w.d, "groups": 1},
        "maxpool": lambda w: {"kernel": w.k, "stride": w.s, "dilation": w.d},
        "avgpool": lambda w: {"kernel": w.k, "stride": w.s, "divisor_override": None}}


def _whole(kind: str, x: torch.Tensor, w: Window, params: tuple[torch.Tensor, ...]
           ) -> torch.Tensor:
    k, s, p, d = w.k[0], w.s[0], w.p[0], w.d[0]
    if kind == "conv":
        return F.conv1d(x, *params, stride=s, padding=p, dilation=d)
    if kind == "maxpool":
        return F.max_pool1d(x, k, s, p, d)
    return F.avg_pool1d(x, k, s, p)


@pytest.mark.parametrize("kind, k, s, p, d, parts, split", [
    ("conv", 5, 1, 2, 1, 3, False), ("conv", 4, 2, 1, 3, 4, False),
    ("conv", 3, 1, 1, 1, 2, True),     # the tile part while the halo travels, then the bands
    ("maxpool", 3, 2, 1, 1, 3, False), ("maxpool", 2, 2, 0, 2, 4, False),
    ("avgpool", 3, 2, 1, 1, 3, False), ("avgpool", 4, 3, 0, 1, 2, False)])
def test_halo_ops_on_sequence_tiles_are_the_whole_op(kind, k, s, p, d, parts, split,
                                                        monkeypatch):
    """``fxpar::halo_op`` on each tile of an odd-length sequence: its part of the whole op's
    output, and the gradients that come back to each tile (weights: summed over tiles) are
    autograd's on the whole sequence."""
    if split:
        monkeypatch.setattr(haloconv, "MIN_RATIO", 1)
    length = 29
    w = Window(kind, (k,), (s,), (p,), (d,), fill=-INF if kind == "maxpool" else 0.0)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, length, dtype=torch.float64, generator=gen, requires_grad=True)
    params = (torch.randn(4, 3, k, dtype=torch.float64, generator=gen, requires_grad=True),
              torch.randn(4, dtype=torch.float64, generator=gen, requires_grad=True)) \
        if kind == "conv" else ()
    want = _whole(kind, x, w, params)
    g = torch.randn(want.shape, dtype=torch.float64, generator=gen)
    (want * g).sum().backward()
    out = out_extent(length, k, s, p, d)
    grid = Grid(parts)
    needs = [Rect(w.needs(grid.tile_rect((out,), u).dims[0], 0)) for u in range(parts)]

    def rank(comm: ThreadComm) -> list[torch.Tensor]:
        with bound({KEY: comm}):  # type: ignore[dict-item]
            ex = exchange(grid, (length,), needs, comm.rank, w.fill)
            spec = dumps({"exchange": ex, "kind": kind, "cfg": CFGS[kind](w),
                          "replicated": False, "tag": 10})
            tile = x.detach()[..., slice(*ex.own.dims[0])].clone().requires_grad_()
            mine = [t.detach().clone().requires_grad_() for t in params]
            weight, bias = (*mine, None, None)[:2]
            y = torch.ops.fxpar.halo_op(tile, weight, bias, KEY, spec)[0]
            box = slice(*grid.tile_rect((out,), comm.rank).dims[0])
            assert torch.allclose(y, want.detach()[..., box], rtol=0, atol=1e-12)
            (y * g[..., box]).sum().backward()
            assert torch.allclose(tile.grad, x.grad[..., slice(*ex.own.dims[0])], rtol=0,
                                  atol=1e-12)
            return [t.grad for t in mine]

    per_rank = run_threads(parts, rank)[0]
    for i, t in enumerate(params):  # a weight used by every tile: its gradients summed
        assert torch.allclose(sum(r[i] for r in per_rank), t.grad, rtol=0, atol=1e-12)


# -- region-by-region prediction -----------------------------------------------------------------
class Fcn(nn.Module):
    """Fully convolutional: conv, max pool, conv, linear upsampling by 2 plus a transposed
    convolution, a skip concatenation, a 1x1 head."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Conv1d(2, 4, 5, padding=2), nn.Conv1d(4, 4, 3, padding=1)
        self.up, self.head = nn.ConvTranspose1d(4, 4, 2, 2), nn.Conv1d(8, 3, 1)

    def forward(self, x):
        a = torch.relu(self.a(x))
        b = torch.relu(self.b(F.max_pool1d(a, 2)))
        u = F.interpolate(b, scale_factor=2, mode="linear") + self.up(b)
        return self.head(torch.cat([u, a], 1))


def test_predict_over_regions_of_a_sequence_is_the_whole_output():
    """fxpar.predict on a (C, L) sequence: the receptive field along L gives the regions'
    margins (6 samples each side), and the regions' middles put together are the model's
    output on the whole sequence."""
    torch.manual_seed(0)
    model = Fcn().double().eval()
    seq = torch.randn(2, 3000, dtype=torch.float64)
    pred = fxpar.predict(model, fxpar.Plan(), seq, region=700, dtype=torch.float64,
                         progress=False)
    assert (pred.reach.before, pred.reach.after, pred.regions) == ((6,), (6,), 5)
    with torch.no_grad():
        want = model(seq[None])[0]
    assert torch.allclose(torch.as_tensor(pred.output), want, rtol=0, atol=1e-12)


# -- what the tools print ------------------------------------------------------------------------
def test_reports_name_the_one_dim():
    """The halo table (fxpar-inspect's) says L and its two sides; plan_auto's report writes a
    1-D grid as (P)."""
    from fxpar.compiler.report import halo_table
    from fxpar.planner.planner import describe

    program = fxpar.compile(seq1d.Classifier(), fxpar.Plan(spatial_parts=3),
                            torch.empty(2, 2, 4099, device="meta"))
    table = halo_table(program)
    assert "on a 3 tile grid over (L)" in table and "widest halo (l r)" in table
    assert "L 1366:2732" in table and "sides" in table
    assert describe(fxpar.Plan(spatial_parts=4, data_parallel=2), 1) == "SP4(4)x1 DP2"
