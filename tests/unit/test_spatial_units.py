"""Spatial arithmetic and region analysis without MPI: windows checked against autograd on
real ops, exchanges on small grids, and the errors a user can hit."""

import itertools
import re
import warnings

import pytest
import torch
import torch.nn.functional as F
import torchvision
from torch import nn

import fxpar
from fxpar import models
from fxpar.core import meta
from fxpar.core.geometry import (
    Grid,
    Rect,
    avg_counts,
    exchange,
    out_extent,
    tile,
    transposed_rows,
    window_rows,
)
from fxpar.frontend.rules.opclass import Reduce, classify
from fxpar.frontend.rules.tokens import TokenLayout
from fxpar.frontend.trace import trace
from fxpar.passes.spatial_region import Coverage, region_ends, spatial_region


def rows_read(op, n, out):
    """Input rows that influence output rows [out) of a 1-D op, by autograd."""
    x = torch.randn(1, 1, n, 1, dtype=torch.float64, requires_grad=True)
    y = op(x)
    y[:, :, out[0]:out[1]].sum().backward()
    nz = (x.grad[0, 0, :, 0] != 0).nonzero().flatten().tolist()
    return (min(nz), max(nz) + 1) if nz else None


def test_floor_formula_tiles_cover_the_extent():
    assert [tile(10, 3, k) for k in range(3)] == [(0, 3), (3, 6), (6, 10)]
    assert [tile(7, 4, k) for k in range(4)] == [(0, 1), (1, 3), (3, 5), (5, 7)]


@pytest.mark.parametrize("k, s, p, d", [(3, 1, 1, 1), (5, 2, 2, 1), (7, 2, 0, 1), (3, 1, 2, 2),
                                        (1, 2, 0, 1), (4, 3, 1, 1)])
def test_window_rows_match_what_a_convolution_reads(k, s, p, d):
    n = 23
    w = torch.rand(1, 1, k, 1, dtype=torch.float64) + 0.5  # nonzero taps
    op = lambda x: F.conv2d(x, w, padding=(p, 0), stride=(s, 1), dilation=(d, 1))  # noqa: E731
    o = out_extent(n, k, s, p, d)
    assert o == op(torch.zeros(1, 1, n, 1, dtype=torch.float64)).shape[2]
    for out in [(0, 1), (0, o), (o // 2, o), (1, max(2, o // 2))]:
        lo, hi = window_rows(out, k, s, p, d)
        assert rows_read(op, n, out) == (max(lo, 0), min(hi, n))


@pytest.mark.parametrize("n, k, s, p", [(10, 2, 2, 0), (11, 3, 2, 1), (13, 3, 3, 1), (9, 2, 2, 1)])
def test_ceil_mode_extent_matches_pytorch(n, k, s, p):
    y = F.max_pool2d(torch.zeros(1, 1, n, n), k, s, p, ceil_mode=True)
    assert out_extent(n, k, s, p, 1, ceil_mode=True) == y.shape[2]


@pytest.mark.parametrize("k, s, p", [(2, 2, 0), (3, 1, 1), (3, 2, 1), (4, 2, 1)])
def test_transposed_rows_match_what_a_transposed_convolution_reads(k, s, p):
    n = 9
    w = torch.rand(1, 1, k, 1, dtype=torch.float64) + 0.5
    op = lambda x: F.conv_transpose2d(x, w, stride=(s, 1), padding=(p, 0))  # noqa: E731
    o = op(torch.zeros(1, 1, n, 1, dtype=torch.float64)).shape[2]
    for out in [(0, 2), (3, o), (o // 3, 2 * o // 3)]:
        lo, hi = transposed_rows(out, k, s, p, 1)
        assert rows_read(op, n, out) == (max(lo, 0), min(hi, n))


@pytest.mark.parametrize("n, k, s, p, ceil, include", itertools.product(
    [9, 10], [2, 3], [1, 2], [0, 1], [False, True], [False, True]))
def test_avg_divisor_counts_match_pytorch(n, k, s, p, ceil, include):
    if p > k // 2:
        return
    ones = torch.ones(1, 1, n, 1, dtype=torch.float64)
    kw = dict(kernel_size=(k, 1), stride=(s, 1), padding=(p, 0), ceil_mode=ceil)
    summed = F.avg_pool2d(ones, divisor_override=1, **kw)
    avg = F.avg_pool2d(ones, count_include_pad=include, **kw)
    want = (summed / avg)[0, 0, :, 0].round().long().tolist()
    assert avg_counts(n, len(want), k, s, p, include) == want


def test_square_exchange_includes_corners():
    grid = Grid(2, 2)
    ext = (8, 8)
    needs = [Rect(*(lambda r: ((r.h[0] - 1, r.h[1] + 1), (r.w[0] - 1, r.w[1] + 1)))(
        grid.tile_rect(ext, u))) for u in range(4)]
    ex = exchange(grid, ext, needs, 3)
    assert [u for u, _ in ex.recvs] == [0, 1, 2]
    assert dict(ex.recvs)[0] == Rect((3, 4), (3, 4))  # the corner cell from the diagonal tile
    assert ex.halo_widths() == (1, 1, 1, 1)
    assert ex.pieces_by_kind() == {"side": (2, 8), "corner": (1, 1)}


def test_cube_exchange_has_faces_edges_and_corners():
    grid = Grid(2, 2, 2)
    ext = (6, 8, 10)
    needs = [Rect(*((a - 1, b + 1) for a, b in grid.tile_rect(ext, u).dims))
             for u in range(8)]
    ex = exchange(grid, ext, needs, 7)  # the back-bottom-right tile
    assert ex.own == Rect((3, 6), (4, 8), (5, 10))
    assert sorted(u for u, _ in ex.recvs) == list(range(7))
    assert dict(ex.recvs)[0] == Rect((2, 3), (3, 4), (4, 5))  # the corner cell
    assert ex.pieces_by_kind() == {"face": (3, 4 * 5 + 3 * 5 + 3 * 4), "edge": (3, 5 + 4 + 3),
                                   "corner": (1, 1)}
    assert ex.halo_widths() == (1, 1, 1, 1, 1, 1)  # past the border: padding, not received
    assert ex.recv_elements() == 4 * 5 + 3 * 5 + 3 * 4 + 5 + 4 + 3 + 1
    # every tile sends exactly what the others receive from it
    sent = {(t, u): r for t in range(8) for u, r in exchange(grid, ext, needs, t).sends}
    got = {(u, t): r for t in range(8) for u, r in exchange(grid, ext, needs, t).recvs}
    assert sent == got


def test_grid_positions_are_row_major_and_tiles_cover_the_volume():
    grid = Grid(3, 1, 2)
    assert [grid.position(t) for t in range(6)] == [(0, 0, 0), (0, 0, 1), (1, 0, 0), (1, 0, 1),
                                                    (2, 0, 0), (2, 0, 1)]
    ext = (7, 5, 9)
    cells = sum(grid.tile_rect(ext, t).size for t in range(grid.size))
    assert cells == 7 * 5 * 9 and grid.fits(ext) and not grid.fits((2, 5, 9))
    assert not grid.fits((7, 9))  # an image against a volume grid
    with pytest.raises(ValueError, match="splits 3 spatial dims; the extent"):
        grid.tile_rect((7, 9), 0)
    assert str(Rect((0, 2), (1, 3), (4, 5))) == "depth 0:2 rows 1:3 cols 4:5"
    assert eval(repr(Rect((0, 2), (1, 3)))) == Rect((0, 2), (1, 3))
    assert Rect(dims=((0, 2),)) == Rect((0, 2))


def test_halo_reaches_past_the_immediate_neighbour():
    grid = Grid(4, 1)  # tiles of 2 rows
    ext = (8, 4)
    needs = [Rect(window_rows(grid.tile_rect(ext, u).h, 7, 1, 3, 1), (0, 4)) for u in range(4)]
    ex = exchange(grid, ext, needs, 1)  # rows 2:4 need rows -1:7
    assert [u for u, _ in ex.recvs] == [0, 2, 3]
    assert ex.need == Rect((-1, 7), (0, 4))


def test_region_ends_at_an_op_that_cannot_be_tiled_and_says_which():
    """Adaptive max pooling whose indices the model returns (its values alone run on tiles,
    tests/unit/test_ops40.py)."""
    gm = trace(nn.Sequential(nn.Conv2d(3, 4, 3), nn.AdaptiveMaxPool2d(3, return_indices=True)),
               (1, 3, 64, 64))
    spatial_region(gm, fxpar.Plan(spatial_parts=4))
    assert len(region_ends(gm)) == 1 and re.fullmatch(
        r"region ends at 'adaptive_max_pool2d': aten.adaptive_max_pool2d \(module '1' "
        r"\(AdaptiveMaxPool2d\), torch/nn/modules/pooling.py:\d+\) cannot run on tiles",
        region_ends(gm)[0])


def test_adaptive_pooling_to_a_size_that_does_not_divide_the_map_is_a_reduction():
    """VGG's 7x7 adaptive pool of a 2x2 map (64x64 input): bins that overlap, summed from the
    tiles into a replicated value; the region does not end, everything before runs on tiles."""
    gm = trace(torchvision.models.vgg11(), (1, 3, 64, 64))
    spatial_region(gm, fxpar.Plan(spatial_parts=4))
    assert region_ends(gm) == []
    pool = next(n for n in gm.graph.nodes if "adaptive_avg_pool2d" in n.name)
    assert classify(gm, pool) == Reduce("bins", True, (7, 7))
    cov = gm.meta[Coverage.KEY]  # every convolution on tiles; the classifier runs whole
    assert {what.split(" (")[0] for what, _ in cov.replicated} == {"aten.linear"}
    assert cov.image - cov.tiled == sum(f for _, f in cov.replicated)


class _PositionBias(nn.Module):
    """conv + a learned bias map of shape ``bias`` (broadcast against N x 4 x 8 x 8)."""

    def __init__(self, bias):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bias = nn.Parameter(torch.zeros(bias))
        self.head = nn.Conv2d(4, 4, 3, padding=1)

    def forward(self, x):
        return self.head(self.conv(x) + self.bias)


@pytest.mark.parametrize("bias, slice_, cut", [
    ((1, 4, 8, 8), "horizontal", False),   # same extent: each tile slices its part
    ((1, 4, 1, 8), "horizontal", False),   # size 1 along the split H: broadcasts on any tile
    ((1, 4, 8, 1), "vertical", False),     # H is not split by vertical strips
    # 8 rows against a 4-row tile, a map along the split W: each tile takes its cells of it
    # (fxpar.frontend.rules.tokens: a whole operand cut to the tile; tests/mpi/cases/
    # tokens_cases.py trains it)
    ((1, 4, 8, 1), "horizontal", True),
    ((8,), "vertical", True),
])
def test_a_whole_operand_that_varies_along_a_split_dim_is_cut_to_the_tile(bias, slice_, cut):
    gm = trace(_PositionBias(bias), (2, 3, 8, 8))
    spatial_region(gm, fxpar.Plan(spatial_parts=2, slice=slice_))
    assert region_ends(gm) == []
    add = next(n for n in gm.graph.nodes if n.name == "add")
    record = meta.find(add, TokenLayout)
    assert (record is not None and record.sliced == (1,)) == cut


def test_region_end_errors_say_why_the_op_is_not_tiled():
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.Upsample(scale_factor=2,
                                                                    mode="bicubic"),
                          nn.Conv2d(4, 4, 3, padding=1), nn.Flatten())
    with pytest.raises(fxpar.PlanError, match=r"region ends at 'upsample_bicubic2d': "
                       r"aten.upsample_bicubic2d \(module '1' \(Upsample\), "
                       r"torch/nn/modules/upsampling.py:\d+\) cannot run on tiles: fxpar has "
                       r"no tiling rule for aten.upsample_bicubic2d"):
        fxpar.compile(model, fxpar.Plan(stages=2, spatial_parts=2, spatial_stages=2),
                      (2, 3, 8, 8))


def test_region_ends_where_tiles_would_be_empty():
    gm = trace(torchvision.models.resnet18(), (2, 3, 64, 64))
    spatial_region(gm, fxpar.Plan(spatial_parts=4, slice="vertical"))
    ends = region_ends(gm)
    assert ends and "its 2x2 output is smaller than the 1x4 tile grid" in ends[0]


def test_image_too_small_for_the_grid_is_an_error():
    with pytest.raises(fxpar.PlanError, match=r"nothing in this model can run on 1x8 tiles .*"
                       r"use an image of at least 8x8, or spatial_parts <= 6 with "
                       r"slice='vertical'"):
        fxpar.compile(nn.Sequential(nn.Conv2d(3, 3, 3, padding=1), nn.Flatten()),
                      fxpar.Plan(spatial_parts=8, slice="vertical"), (1, 3, 6, 6),
                      loss_fn=lambda o, y: o.mean())


def test_spatial_stage_beyond_the_region_is_an_error():
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.Flatten(), nn.Linear(4 * 64, 8),
                          nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    with pytest.raises(fxpar.PlanError, match=r"spatial stage\(s\) \[1\] would have no tiled "
                       r"work.*Use spatial_stages=1"):
        fxpar.compile(model, fxpar.Plan(stages=3, spatial_parts=2, spatial_stages=2),
                      (2, 3, 8, 8))


def test_tile_programs_print_their_halos():
    program = fxpar.compile(models.build("resnet_v2", depth=8), fxpar.Plan(spatial_parts=4),
                            (2, 3, 32, 32))
    tile3 = program.spatial.tiles[(0, 3)]
    halos = [m for name, m in tile3.named_children() if name.startswith("fxpar_halo")]
    assert halos and "halo top=1 bottom=1 left=1 right=1" in repr(halos[1])
    assert "self.fxpar_syncbn_" in tile3.code and "self.fxpar_reduce_" in tile3.code


def test_coverage_counts_the_flops_on_tiles_and_warns_naming_the_op():
    """Coverage = forward FLOPs of tiled ops / FLOPs of every op the spatial stage runs,
    computed here by hand: only the first convolution runs on tiles (the flatten to 256
    channels, unflattened to 1 x 16 x 16, mixes H and W into the channels); the rest, the
    linear head included, runs whole on every rank."""
    from fxpar.compiler.driver import CoverageWarning
    from fxpar.passes.spatial_region import Coverage

    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.Flatten(),
                          nn.Unflatten(1, (1, 16, 16)),
                          nn.Conv2d(1, 8, 3, padding=1), nn.Conv2d(8, 8, 3, padding=1),
                          nn.Flatten(), nn.Linear(8 * 16 * 16, 3))
    with pytest.warns(CoverageWarning, match=r"runs only 4% of the spatial stages' forward "
                      r"FLOPs on tiles \(the rest runs whole on every rank of the tile group; "
                      r"the most: aten\.conv2d .*region ends at 'flatten': "
                      r"aten\.flatten \(module '1' \(Flatten\)"):
        program = fxpar.compile(model, fxpar.Plan(spatial_parts=2), (4, 3, 8, 8))
    cov = program.traced.meta[Coverage.KEY]
    first = 2 * 4 * 3 * 9 * (4 * 8 * 8)
    rest = 2 * 8 * 1 * 9 * (4 * 16 * 16) + 2 * 8 * 8 * 9 * (4 * 16 * 16)
    head = 2 * 4 * (8 * 16 * 16) * 3
    assert (cov.tiled, cov.image) == (first, first + rest + head)
    assert [f for _, f in cov.replicated] == [2 * 8 * 8 * 9 * (4 * 16 * 16),
                                             2 * 8 * 1 * 9 * (4 * 16 * 16), head]


def test_a_model_tiled_to_its_head_has_full_coverage_and_no_warning():
    import warnings

    from fxpar.passes.spatial_region import Coverage

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        program = fxpar.compile(torchvision.models.resnet18(), fxpar.Plan(spatial_parts=2),
                                (2, 3, 64, 64))
    cov = program.traced.meta[Coverage.KEY]  # all but the classifier, which every rank runs
    assert [what.split(" (")[0] for what, _ in cov.replicated] == ["aten.linear"]
    assert cov.image - cov.tiled == cov.replicated[0][1] == 2 * 2 * 512 * 1000


PER_PIXEL_OPS = {  # each works on N and C only: the region goes on (issue 36, item 4)
    "unsqueeze": lambda x: (x.unsqueeze(1) * 2).squeeze(1),
    "reshape_nc": lambda x: torch.relu(x.reshape(-1, 1, *x.shape[2:])).reshape(x.shape),
    "transpose_hw": lambda x: (x.transpose(2, 3) * 2).transpose(2, 3),
    # H and W flattened and cut back: tokens are pixels (fxpar.frontend.rules.tokens)
    "flatten_hw": lambda x: x.flatten(2).unsqueeze(-1).reshape(x.shape),
    # along the split W: the maximum and the exponentials' sum over the tiles (TileSoftmax)
    "softmax_w": lambda x: x.softmax(3),
    "select": lambda x: x * x[:, 0].unsqueeze(1),
    "index": lambda x: x[:, [3, 1, 0, 2]],
    "max_dim": lambda x: x - x.max(dim=1)[0].unsqueeze(1) + x.max(dim=1)[1].unsqueeze(1),
    "argmax": lambda x: x * x.argmax(1, keepdim=True),
    "gather_sort": lambda x: x.gather(1, x.argsort(1)),
    "var_norm": lambda x: x / (x.var(1, keepdim=True) + x.norm(dim=1, keepdim=True) + 1),
    "batch_sum": lambda x: x - x.sum(0),
    "softmax": lambda x: x.softmax(1) + x.log_softmax(0),
}
NOT_PER_PIXEL = {  # along a split dim: the region must end
    "log_softmax_w": lambda x: x.log_softmax(3),
    "cumsum_w": lambda x: x.cumsum(3),
    "flatten_hw_reversed": lambda x: x.flatten(2).flip(-1).reshape(x.shape),
    "max_over_w": lambda x: x - x.max(dim=3, keepdim=True)[0],
}


class _Around(nn.Module):
    def __init__(self, f) -> None:
        super().__init__()
        self.a, self.b, self.f = nn.Conv2d(3, 4, 3, padding=1), nn.Conv2d(4, 4, 3, padding=1), f

    def forward(self, x):
        return self.b(self.f(self.a(x)))


@pytest.mark.parametrize("name", sorted(PER_PIXEL_OPS) + sorted(NOT_PER_PIXEL))
def test_ops_on_batch_and_channels_keep_the_region(name):
    f = PER_PIXEL_OPS.get(name) or NOT_PER_PIXEL[name]
    program = fxpar.compile(_Around(f), fxpar.Plan(spatial_parts=2, slice="vertical"),
                            torch.empty(2, 3, 8, 10, device="meta"))
    ended = program.traced.meta[Coverage.KEY].ended
    assert (ended == "") == (name in PER_PIXEL_OPS), ended


def test_a_batch_op_under_a_plan_that_cuts_the_batch_warns():
    model = _Around(lambda x: x - x.mean(0, keepdim=True))
    example = torch.empty(4, 3, 8, 10, device="meta")
    with pytest.warns(fxpar.compiler.driver.BatchWarning, match="4 chunks"):
        fxpar.compile(model, fxpar.Plan(stages=2, microbatches=4), example)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the whole batch on every tile: nothing to say
        fxpar.compile(model, fxpar.Plan(spatial_parts=2), example)


def test_a_new_elementwise_op_is_one_entry_and_keeps_the_region_going():
    """The elementwise table (fxpar.frontend.rules.pointwise) serves the model's region and
    the loss alike: ``1 - g``, sin, erf, square and logit keep tiling, so the convolution after
    them gets its halo exchange instead of running whole on every rank (the MPI half is
    spatial_cases.py's ``elementwise`` op case)."""
    from fxpar.frontend.rules.aten_ops import RULES, OpRule, rule
    from fxpar.frontend.rules.dims import RULES as LOSS_RULES
    from fxpar.frontend.rules.pointwise import POINTWISE

    aten = torch.ops.aten
    for packet in (aten.rsub, aten.sin, aten.special_erf, aten.square, aten.logit):
        assert packet in POINTWISE and isinstance(RULES[packet], OpRule)
        assert packet in LOSS_RULES
    with pytest.raises(ValueError, match="two tile rules"):
        rule(aten.rsub)(lambda n: None)

    class Gate(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Conv2d(3, 4, 3, padding=1)
            self.b = torch.nn.Conv2d(4, 4, 3, padding=1)

        def forward(self, x):
            y = self.a(x)
            g = torch.sigmoid(y)
            return self.b((1 - g) * torch.sin(y) + torch.special.erf(y) + torch.square(y)
                          + torch.logit(g, 1e-3)).mean((2, 3))

    program = fxpar.compile(Gate(), fxpar.Plan(spatial_parts=2), torch.empty(2, 3, 16, 16))
    tile = program.stage_modules(0)[(0, 0)]
    halos = [n for n in tile.graph.nodes if n.op == "call_module"
             and type(tile.get_submodule(n.target)).__name__ == "HaloOp"]
    assert len(halos) == 2, tile.graph


def test_every_window_kind_has_one_entry_and_a_tile_op():
    """Window kinds are data (fxpar.frontend.rules.opkind.WINDOW_KINDS): each runs in a HaloOp
    or has its tile op in fxpar.passes.halo.TILE_OPS; its window and receptive scale agree with
    the geometry of fxpar.core.geometry; a kind without an entry is refused where the rule
    makes it, not deep in a pass."""
    from fractions import Fraction

    from fxpar.core.geometry import transposed_rows, window_rows
    from fxpar.frontend.rules.opkind import WINDOW_KINDS, Window
    from fxpar.passes.halo import TILE_OPS
    from fxpar.runtime.spatial.kernels import KERNELS

    in_halo_op = {k for k, rule in WINDOW_KINDS.items() if rule.halo_op}
    assert in_halo_op == set(KERNELS) == {"conv", "maxpool", "avgpool"}  # HaloOp's kernels
    assert set(TILE_OPS) == set(WINDOW_KINDS) - in_halo_op
    conv = Window("conv", (3, 5), (2, 1), (1, 2), (1, 2))
    assert [conv.needs((4, 9), i) for i in range(2)] == \
        [window_rows((4, 9), 3, 2, 1, 1), window_rows((4, 9), 5, 1, 2, 2)]
    assert (conv.scale(0), conv.scale(1)) == (2, 1)
    up = Window("convT", (4,), (2,), (1,))
    assert up.needs((3, 10), 0) == transposed_rows((3, 10), 4, 2, 1, 1)
    assert up.scale(0) == Fraction(1, 2)
    assert Window("pad", (1,), (1,), (3,)).scale(0) == 1
    assert [k for k, rule in WINDOW_KINDS.items() if rule.clamped] == ["interp"]
    with pytest.raises(ValueError, match="'unfold' has no entry in WINDOW_KINDS"):
        Window("unfold", (3,), (1,), (1,))
