"""More ops on tiles (issue 40, item 4), without MPI: the rules of vector norms over H and W,
adaptive max pooling, pixel (un)shuffles and timm's SpaceToDepth / DepthToSpace chains
(fxpar.frontend.rules.aten_ops, .chains), their windows against brute-force index maps, and
the tile reductions (fxpar.runtime.spatial.reduce) on tiles run by threads (tests/helpers/
threads.py) against the whole image: values, ATen's indices and gradients, ties and zero
norms included. tests/mpi/test_ops40.py trains them under mpiexec."""

from __future__ import annotations

import operator

import pytest
import torch
import torch.nn.functional as F
from helpers.threads import ThreadComm, run_threads
from torch import nn

import fxpar
from fxpar.core.geometry import Grid
from fxpar.frontend.rules.opclass import Pointwise, Reduce, Window, classify, why_not
from fxpar.frontend.trace import trace
from fxpar.passes.spatial_region import region_ends, spatial_region
from fxpar.runtime.spatial.group import bound
from fxpar.runtime.spatial.reduce import TileReduce

aten = torch.ops.aten
KEY = "c0s0"


class Around(nn.Module):
    """conv -> f -> conv: the op ``f`` between two tiled ops."""

    def __init__(self, f, cin: int = 3, mid: int = 8, cout: int = 8) -> None:
        super().__init__()
        self.a, self.b, self.f = nn.Conv2d(cin, mid, 3, padding=1), nn.Conv2d(cout, 4, 1), f

    def forward(self, x):
        return self.b(self.f(self.a(x)))


def _ops(gm, packet):
    return [n for n in gm.graph.nodes if getattr(n.target, "overloadpacket", None) is packet]


# -- rules ------------------------------------------------------------------------------------
@pytest.mark.parametrize("f, want", [
    (lambda x: x.norm(p=2, dim=(2, 3), keepdim=True), Reduce("norm", True, (1, 1), 2.0)),
    (lambda x: torch.norm(x, p=2, dim=(-2, -1), keepdim=True), Reduce("norm", True, (1, 1))),
    (lambda x: torch.linalg.vector_norm(x, 3, dim=(3, 2))[..., None, None],
     Reduce("norm", False, (1, 1), 3.0)),
    (lambda x: x.norm(p=float("inf"), dim=(2, 3), keepdim=True),
     Reduce("norm", True, (1, 1), float("inf"))),
    (lambda x: x.norm(dim=1, keepdim=True), Pointwise()),  # over the channels: per pixel
    (lambda x: x.norm(p=0.5, dim=(2, 3), keepdim=True), None),
    (lambda x: x.norm(dim=3, keepdim=True), None),
])
def test_vector_norm_over_h_and_w_is_a_reduction(f, want):
    gm = trace(Around(lambda y: y * f(y)), (2, 3, 8, 8))
    (norm,) = _ops(gm, aten.linalg_vector_norm)
    assert classify(gm, norm) == want
    if want is None:
        assert why_not(gm, norm).startswith("only vector norms over exactly the spatial dims")


def test_global_response_norms_of_timm_and_monai_keep_the_region():
    """timm's GlobalResponseNorm on NCHW (ConvNeXt-V2 in NHWC uses the same rule through its
    channels-last island), MedNeXt's over D, H, W: a Reduce, and the region goes on."""
    from timm.layers.grn import GlobalResponseNorm

    grn = GlobalResponseNorm(8, channels_last=False)
    gm = trace(Around(grn), (2, 3, 12, 10))
    spatial_region(gm, fxpar.Plan(spatial_parts=4))
    assert region_ends(gm) == []
    volume = trace(nn.Sequential(nn.Conv3d(2, 4, 3, padding=1), _MedNeXtGrn()), (1, 2, 6, 8, 8))
    (norm,) = _ops(volume, aten.linalg_vector_norm)
    assert classify(volume, norm) == Reduce("norm", True, (1, 1, 1), 2.0)


class _MedNeXtGrn(nn.Module):
    def forward(self, x):  # MONAI's MedNeXtBlock, global_resp_norm=True, 3-D
        gx = torch.norm(x, p=2, dim=(-3, -2, -1), keepdim=True)
        return x * (gx / (gx.mean(dim=1, keepdim=True) + 1e-6)) + x


@pytest.mark.parametrize("size, shape, want", [
    (1, (2, 3, 15, 13), Reduce("maxbins", True, (1, 1))),
    ((4, 5), (2, 3, 15, 13), Reduce("maxbins", True, (4, 5))),  # bins overlap: replicated
    ((5, 4), (2, 3, 15, 12), Window("maxpool", (3, 3), (3, 3), (0, 0), (1, 1),
                                    fill=-float("inf"), attrs=(("ceil_mode", False),))),
])
def test_adaptive_max_pooling(size, shape, want):
    """To 1 or to overlapping bins a replicated reduction; to a divisor of the map a max pool
    with kernel = stride (rewritten at capture: the same bins and ties, one output)."""
    gm = trace(Around(lambda y: F.adaptive_max_pool2d(y, size).sum((2, 3), keepdim=True) * y),
               shape)
    pools = _ops(gm, aten.adaptive_max_pool2d) + _ops(gm, aten.max_pool2d)
    assert len(pools) == 1 and classify(gm, pools[0]) == want


def test_adaptive_max_pooling_whose_indices_are_read_ends_the_region_and_says_why():
    def f(y):
        values, where = F.adaptive_max_pool2d(y, 2, return_indices=True)
        return F.max_unpool2d(values, where, 4, output_size=y.shape[2:])

    gm = trace(Around(f), (2, 3, 8, 8))
    (pool,) = _ops(gm, aten.adaptive_max_pool2d)
    assert classify(gm, pool) is None
    assert why_not(gm, pool) == ("adaptive max pooling runs on tiles when only its values are "
                                 "read; here its indices (return_indices=True) are used too")


@pytest.mark.parametrize("f, packet, want", [
    (lambda y: F.pixel_shuffle(y, 2), aten.pixel_shuffle, Window("shuffle", (2, 2), (2, 2),
                                                                 (0, 0))),
    (lambda y: F.pixel_unshuffle(y, 2), aten.pixel_unshuffle, Window("unshuffle", (2, 2),
                                                                     (2, 2), (0, 0))),
])
def test_pixel_shuffles_are_windows(f, packet, want):
    gm = trace(Around(f, mid=8, cout=2 if packet is aten.pixel_shuffle else 32), (2, 3, 8, 8))
    (op,) = _ops(gm, packet)
    assert classify(gm, op) == want


def test_pixel_shuffle_of_a_volume_is_refused_with_the_reason():
    gm = trace(nn.Sequential(nn.Conv3d(2, 4, 1), nn.PixelShuffle(2)), (1, 2, 4, 6, 6))
    (op,) = _ops(gm, aten.pixel_shuffle)
    assert classify(gm, op) is None and "of a volume they would take D" in why_not(gm, op)


@pytest.mark.parametrize("kind, r", [("unshuffle", 2), ("unshuffle", 3), ("shuffle", 2),
                                     ("shuffle", 3)])
def test_shuffle_windows_are_what_the_index_map_reads(kind, r):
    """For every output interval, the input rows the window kind names are exactly the rows
    the op reads (brute force over one dim of ATen's own op on a ramp)."""
    n = 12
    x = torch.arange(n * n, dtype=torch.float64).view(1, 1, n, n).repeat(1, r * r, 1, 1)
    y = F.pixel_unshuffle(x, r) if kind == "unshuffle" else F.pixel_shuffle(x, r)
    rows = (y // n).long()  # the input row each output cell came from
    op = Window(kind, (r, r), (r, r), (0, 0))
    for o0 in range(y.shape[2]):
        for o1 in range(o0 + 1, y.shape[2] + 1):
            read = rows[:, :, o0:o1]
            assert op.needs((o0, o1), 0) == (int(read.min()), int(read.max()) + 1)


# -- chains -----------------------------------------------------------------------------------
def test_space_to_depth_and_depth_to_space_become_pixel_shuffles_exactly():
    """timm's SpaceToDepth / DepthToSpace (views and a permute) are rewritten at capture into
    pixel_unshuffle / pixel_shuffle and a per-pixel channel reorder: the same values and
    gradients, and the region runs through them (no view of H and W is left)."""
    from timm.layers.space_to_depth import DepthToSpace, SpaceToDepth

    model = nn.Sequential(SpaceToDepth(4), nn.Conv2d(48, 24, 3, padding=1), DepthToSpace(2),
                          nn.Conv2d(6, 4, 1)).double()
    gm = trace(model, (2, 3, 16, 24))
    assert len(_ops(gm, aten.pixel_unshuffle)) == len(_ops(gm, aten.pixel_shuffle)) == 1
    assert all(len(n.meta["val"].shape) <= 5 for n in gm.graph.nodes if "val" in n.meta)
    x = torch.randn(2, 3, 16, 24, dtype=torch.float64, requires_grad=True)
    mine, ref = gm(x), model(x)
    assert torch.equal(mine, ref)
    g = torch.randn_like(ref)
    assert torch.equal(torch.autograd.grad(mine, x, g)[0], torch.autograd.grad(ref, x, g)[0])
    spatial_region(gm, fxpar.Plan(spatial_parts=4))
    assert region_ends(gm) == []


def test_a_view_permute_view_that_is_not_a_known_chain_is_left_alone():
    def f(y):  # pixel_shuffle's own decomposition: (c, i, j) channels, not SpaceToDepth's
        n, c, h, w = y.shape
        y = y.view(n, c // 4, 2, 2, h, w).permute(0, 1, 4, 2, 5, 3)
        return y.reshape(n, c // 4, 2 * h, 2 * w)

    gm = trace(Around(f, mid=8, cout=2), (2, 3, 8, 8))
    assert not _ops(gm, aten.pixel_shuffle) and len(_ops(gm, aten.permute)) == 1


# -- tile reductions on threads ----------------------------------------------------------------
def _tiles(grid: Grid, x: torch.Tensor, kind: str, out=(1, 1), ord: float = 2.0):
    """(output, input gradient) of TileReduce ``kind`` on each tile of ``grid``, for a fixed
    output gradient; the whole input's gradient is the tiles' put together."""
    ext = tuple(x.shape[2:])
    g = torch.randn(*x.shape[:2], *out, dtype=x.dtype, generator=torch.Generator().manual_seed(3))

    def rank(comm: ThreadComm):
        with bound({KEY: comm}):  # type: ignore[dict-item]
            box = grid.tile_rect(ext, comm.rank)
            tile = x[(slice(None), slice(None), *(slice(*iv) for iv in box.dims))]
            tile = tile.detach().clone().requires_grad_()
            y = TileReduce(kind, KEY, ext, box.dims, True, out, ord)(tile)
            values = y[0] if isinstance(y, tuple) else y
            # each rank holds its share of a replicated value's gradient: here rank 0 all
            values.backward(g if comm.rank == 0 else torch.zeros_like(g))
            return y, box, tile.grad

    results = run_threads(grid.size, rank)[0]
    grad = torch.zeros_like(x)
    for _, box, tg in results:
        grad[(slice(None), slice(None), *(slice(*iv) for iv in box.dims))] = tg
    return [r[0] for r in results], grad, g


@pytest.mark.parametrize("ord", [2.0, 1.0, 3.0, float("inf")])
def test_tile_vector_norm_and_its_gradient_are_the_whole_images(ord):
    x = torch.randn(2, 3, 7, 9, dtype=torch.float64)
    x[:, 1] = 0  # a zero norm: torch's gradient there is 0
    outs, grad, g = _tiles(Grid(2, 2), x, "norm", ord=ord)
    whole = x.clone().requires_grad_()
    want = torch.linalg.vector_norm(whole, ord, dim=(2, 3), keepdim=True)
    want.backward(g)
    for y in outs:
        torch.testing.assert_close(y, want, rtol=1e-13, atol=0)
    torch.testing.assert_close(grad, whole.grad, rtol=1e-12, atol=1e-15)
    assert not grad.isnan().any() and torch.equal(grad[:, 1], torch.zeros_like(grad[:, 1]))


@pytest.mark.parametrize("grid, shape, out", [
    (Grid(2, 2), (2, 3, 7, 9), (1, 1)),
    (Grid(1, 3), (2, 3, 7, 10), (3, 4)),   # bins that overlap and cross tiles
    (Grid(2, 1, 2), (1, 2, 5, 4, 7), (2, 3, 2)),
])
@pytest.mark.parametrize("ties", [False, True])
def test_tile_adaptive_max_pool_gives_atens_values_indices_and_gradient(grid, shape, out,
                                                                        ties):
    """Values, ATen's indices (row-major over the image) and the gradient on the first maximum
    of each bin, also when the maximum ties over many cells on several tiles."""
    x = torch.randn(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    if ties:
        x = x.clamp(max=0.3)
    outs, grad, g = _tiles(grid, x, "maxbins", out)
    whole = x.clone().requires_grad_()
    pool = F.adaptive_max_pool2d if len(out) == 2 else F.adaptive_max_pool3d
    values, indices = pool(whole, out, return_indices=True)
    values.backward(g)
    for y, where in outs:
        assert torch.equal(y, values) and torch.equal(where, indices)
    assert torch.equal(grad, whole.grad)


def test_tile_reduce_prints_what_it_reduces():
    assert "norm (ord 2) over the spatial dims of the 8x8 image" in \
        repr(TileReduce("norm", KEY, (8, 8), ((0, 4), (0, 8))))
    assert "adaptive max pool to 3x2 of the 8x8 image" in \
        repr(TileReduce("maxbins", KEY, (8, 8), ((0, 4), (0, 8)), out=(3, 2)))


def test_getitem_reads_the_values_of_adaptive_max_pooling():
    """The rule checks every user of the pool: only ``getitem`` 0 (or an unused 1)."""
    gm = trace(Around(lambda y: y * F.adaptive_max_pool2d(y, 1)), (2, 3, 8, 8))
    (pool,) = _ops(gm, aten.adaptive_max_pool2d)
    assert {u.args[1] for u in pool.users if u.target is operator.getitem} <= {0, 1}
    assert classify(gm, pool) == Reduce("maxbins", True, (1, 1))


def test_adaptive_max_pooling_of_a_volume_to_a_divisor_is_a_max_pool_exactly():
    model = nn.Sequential(nn.Conv3d(2, 3, 1), nn.AdaptiveMaxPool3d((2, 3, 1))).double()
    gm = trace(model, (1, 2, 4, 9, 5))
    (pool,) = _ops(gm, aten.max_pool3d)
    assert not _ops(gm, aten.adaptive_max_pool3d)
    assert classify(gm, pool) == Window("maxpool", (2, 3, 5), (2, 3, 5), (0, 0, 0), (1, 1, 1),
                                        fill=-float("inf"), attrs=(("ceil_mode", False),))
    x = torch.randn(1, 2, 4, 9, 5, dtype=torch.float64).clamp(max=0.2).requires_grad_()
    mine, ref = gm(x), model(x)
    assert torch.equal(mine, ref)
    assert torch.equal(torch.autograd.grad(mine.sum(), x)[0], torch.autograd.grad(ref.sum(), x)[0])
