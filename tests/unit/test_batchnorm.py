"""Synchronised BatchNorm on tiles without MPI: P tiles run in P threads over a communicator
that hands tensors between the threads (same collectives as fxpar.comm.mpi.Comm), checked
against one device's nn.BatchNorm2d in float64: output, input gradient, weight and bias
gradients, running statistics; in float32 on images of mean 1e4 and spread 1, where the
E[x^2] - E[x]^2 formula loses every digit (shown inline as a control)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from helpers.threads import Hub, ThreadComm, run_threads
from torch import nn

from fxpar.core.geometry import Grid
from fxpar.runtime.spatial.batchnorm import batch_norm
from fxpar.runtime.spatial.group import bound
from fxpar.runtime.spatial.moments import local_moments, merge_moments

EPS, MOMENTUM = 1e-5, 0.1


def reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, g: torch.Tensor,
              steps: int) -> dict[str, torch.Tensor]:
    """One device's nn.BatchNorm2d in float64 on the same values: ``steps`` training
    forwards (running statistics), the gradients of the last one for the loss sum(y * g)."""
    bn = nn.BatchNorm2d(x.shape[1], eps=EPS, momentum=MOMENTUM).double().train()
    with torch.no_grad():
        bn.weight.copy_(w)
        bn.bias.copy_(b)
    xd = x.double().clone().requires_grad_()
    for _ in range(steps - 1):
        bn(xd.detach())
    y = bn(xd)
    (y * g.double()).sum().backward()
    assert xd.grad is not None and bn.weight.grad is not None and bn.bias.grad is not None
    return {"y": y.detach(), "gx": xd.grad, "gw": bn.weight.grad, "gb": bn.bias.grad,
            "running_mean": bn.running_mean, "running_var": bn.running_var}


def tiled(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, g: torch.Tensor, grid: Grid,
          steps: int) -> tuple[dict[str, Any], Hub]:
    """The same on the tiles of ``grid``, one thread per tile, in ``x``'s dtype: the whole
    output and input gradient put together, parameter gradients summed over the tiles (the
    stage's ALLREDUCE), each rank's running statistics."""
    extent = (x.shape[2], x.shape[3])
    c = x.shape[1]

    def rank(comm: ThreadComm) -> dict[str, Any]:
        r = grid.tile_rect(extent, comm.rank)
        xt = x[:, :, r.h[0]:r.h[1], r.w[0]:r.w[1]].clone().requires_grad_()
        wt, bt = (v.to(x.dtype).clone().requires_grad_() for v in (w, b))
        rm, rv = torch.zeros(c, dtype=x.dtype), torch.ones(c, dtype=x.dtype)
        nbt = torch.zeros((), dtype=torch.long)
        count = x.shape[0] * extent[0] * extent[1]
        with bound({"c0s0": comm}):  # type: ignore[dict-item]
            for step in range(steps):
                y = batch_norm(xt if step == steps - 1 else xt.detach(), wt, bt, rm, rv, nbt,
                               batch_stats=True, update=True, momentum=MOMENTUM, eps=EPS,
                               key="c0s0", count=count)
            (y * g[:, :, r.h[0]:r.h[1], r.w[0]:r.w[1]].to(x.dtype)).sum().backward()
        return {"rect": r, "y": y.detach(), "gx": xt.grad, "gw": wt.grad, "gb": bt.grad,
                "running_mean": rm, "running_var": rv}

    parts, hub = run_threads(grid.size, rank)
    y, gx = torch.empty_like(x), torch.empty_like(x)
    for p in parts:
        r = p["rect"]
        y[:, :, r.h[0]:r.h[1], r.w[0]:r.w[1]] = p["y"]
        gx[:, :, r.h[0]:r.h[1], r.w[0]:r.w[1]] = p["gx"]
    for key in ("running_mean", "running_var"):  # the same statistics on every rank, bitwise
        assert all(torch.equal(p[key], parts[0][key]) for p in parts), key
    return {"y": y, "gx": gx, "gw": sum(p["gw"] for p in parts),
            "gb": sum(p["gb"] for p in parts), "running_mean": parts[0]["running_mean"],
            "running_var": parts[0]["running_var"]}, hub


def _inputs(dtype: torch.dtype, shape: tuple[int, ...], mean: float
            ) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(0)
    c = shape[1]
    x = (mean + torch.randn(shape, generator=gen, dtype=torch.float64)).to(dtype)
    x[:, 1] = (mean - 3.0 + 0.25 * torch.randn(shape[0], *shape[2:], generator=gen,
                                               dtype=torch.float64)).to(dtype)
    w = 0.5 + torch.rand(c, generator=gen, dtype=torch.float64)
    b = torch.randn(c, generator=gen, dtype=torch.float64)
    g = torch.randn(shape, generator=gen, dtype=torch.float64)
    return x, w, b, g


def _worst(got: dict[str, Any], want: dict[str, torch.Tensor],
           tol: dict[str, tuple[float, float]]) -> dict[str, float]:
    """Per quantity, max over its elements of |got - want| / (atol * max|want| + rtol |want|)
    for its ``(atol, rtol)`` in ``tol``: <= 1 passes."""
    out = {}
    for k, (atol, rtol) in tol.items():
        bound = atol * want[k].abs().max() + rtol * want[k].abs()
        out[k] = float(((got[k].double() - want[k]).abs() / bound).max())
    return out


GRIDS = {"SP2 vertical": Grid(1, 2), "SP2 horizontal": Grid(2, 1), "SP4 square": Grid(2, 2),
         "SP4 horizontal": Grid(4, 1)}
# float32 vs a float64 reference on values near 1e4: the inputs themselves are float32 (spacing
# 1e-3 there) and the normalisation x * alpha + beta rounds at that scale, so y, its input
# gradient and the weight gradient (a sum of gy * xhat) carry ~1e-3 of their scale on one
# device's float32 nn.BatchNorm2d too (2.8e-3 on y, 2.9e-2 of 14 on the weight gradient);
# sums and statistics are relative (atol, rtol: atol is relative to the quantity's maximum)
F32_TOL = {"y": (5e-3, 0.0), "gx": (5e-3, 0.0), "gw": (5e-3, 0.0), "gb": (0.0, 2e-5),
           "running_mean": (0.0, 2e-5), "running_var": (0.0, 2e-5)}
F64_TOL = dict.fromkeys(F32_TOL, (1e-13, 1e-11))


@pytest.mark.parametrize("grid", GRIDS.values(), ids=GRIDS.keys())
def test_float32_statistics_of_a_large_mean_match_float64_one_device(grid):
    """Mean 1e4, spread 1 (and 0.25 in one channel), odd image 9x7: tiles of unequal sizes.
    Two training steps (running statistics updated twice), forward + backward."""
    x, w, b, g = _inputs(torch.float32, (4, 3, 9, 7), 1e4)
    want = reference(x, w, b, g, steps=2)
    got, hub = tiled(x, w, b, g, grid, steps=2)
    worst = _worst(got, want, F32_TOL)
    assert max(worst.values()) <= 1.0, worst
    # per step on each rank: one allgather forward, one allreduce backward (the last step)
    per_rank = {r: [what for u, what in hub.calls if u == r] for r in range(grid.size)}
    assert all(c == ["allgather", "allgather", "allreduce"] for c in per_rank.values()), per_rank

    # the control: E[x^2] - E[x]^2 on the same float32 data fails this tolerance
    mean = x.mean(dim=(0, 2, 3))
    var = (x * x).mean(dim=(0, 2, 3)) - mean * mean
    naive = nn.functional.batch_norm(x, mean, var.clamp_min(0), w.float(), b.float(), False,
                                     0.0, EPS)
    err = _worst({"y": naive}, want, {"y": F32_TOL["y"]})["y"]
    assert err > 10, f"E[x^2] - E[x]^2 came within {err:.3g} of the tolerance"
    exact = torch.var_mean(x.double(), dim=(0, 2, 3), correction=0)[0]
    assert float(((var.double() - exact) / exact).abs().max()) > 0.1


@pytest.mark.parametrize("grid", GRIDS.values(), ids=GRIDS.keys())
def test_float64_is_exact(grid):
    x, w, b, g = _inputs(torch.float64, (3, 4, 11, 6), 2.0)
    want = reference(x, w, b, g, steps=3)
    got, _ = tiled(x, w, b, g, grid, steps=3)
    worst = _worst(got, want, F64_TOL)
    assert max(worst.values()) <= 1.0, worst


def test_merge_of_uneven_and_empty_tiles_is_the_statistics_of_their_union():
    gen = torch.Generator().manual_seed(1)
    pieces = [1e4 + torch.randn(2, 3, h, 5, generator=gen, dtype=torch.float64)
              for h in (1, 4, 0, 7)]
    mean, var, n = merge_moments([local_moments(p) for p in pieces])
    whole = torch.cat(pieces, dim=2)
    want_var, want_mean = torch.var_mean(whole, dim=(0, 2, 3), correction=0)
    assert n == whole.numel() // 3
    torch.testing.assert_close(mean, want_mean, atol=1e-12, rtol=1e-14)
    torch.testing.assert_close(var, want_var, atol=1e-12, rtol=1e-11)


def test_eval_mode_uses_running_statistics_without_a_communicator():
    x = torch.randn(2, 3, 4, 4, dtype=torch.float64)
    rm, rv = torch.randn(3, dtype=torch.float64), torch.rand(3, dtype=torch.float64) + 0.5
    y = batch_norm(x, None, None, rm, rv, None, batch_stats=False, update=False,
                   momentum=MOMENTUM, eps=EPS, key=None, count=32)
    torch.testing.assert_close(y, nn.functional.batch_norm(x, rm, rv, eps=EPS))


def _group_norm(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, g: torch.Tensor,
                groups: int, grid: Grid | None) -> dict[str, torch.Tensor]:
    """Group norm forward + backward of sum(y * g): one device (grid None, F.group_norm in
    x's dtype) or TileGroupNorm on the tiles of ``grid`` (one thread each, put together)."""
    if grid is None:
        xr = x.clone().requires_grad_()
        wr, br = (v.to(x.dtype).clone().requires_grad_() for v in (w, b))
        y = nn.functional.group_norm(xr, groups, wr, br, EPS)
        (y * g.to(x.dtype)).sum().backward()
        return {"y": y.detach(), "gx": xr.grad, "gw": wr.grad, "gb": br.grad}  # type: ignore
    from fxpar.runtime.spatial.norms import TileGroupNorm

    n, c, h, wd = x.shape

    def rank(comm: ThreadComm) -> dict[str, Any]:
        r = grid.tile_rect((h, wd), comm.rank)
        xt = x[:, :, r.h[0]:r.h[1], r.w[0]:r.w[1]].clone().requires_grad_()
        wt, bt = (v.to(x.dtype).clone().requires_grad_() for v in (w, b))
        op = TileGroupNorm(groups, EPS, "c0s0", c // groups * h * wd)
        with bound({"c0s0": comm}):  # type: ignore[dict-item]
            y = op(xt, wt, bt)
            (y * g[:, :, r.h[0]:r.h[1], r.w[0]:r.w[1]].to(x.dtype)).sum().backward()
        return {"rect": r, "y": y.detach(), "gx": xt.grad, "gw": wt.grad, "gb": bt.grad}

    parts, hub = run_threads(grid.size, rank)
    per_rank = {u: [what for v, what in hub.calls if v == u] for u in range(grid.size)}
    assert all(calls == ["allgather", "allreduce"] for calls in per_rank.values()), per_rank
    y, gx = torch.empty_like(x), torch.empty_like(x)
    for p in parts:
        r = p["rect"]
        y[:, :, r.h[0]:r.h[1], r.w[0]:r.w[1]] = p["y"]
        gx[:, :, r.h[0]:r.h[1], r.w[0]:r.w[1]] = p["gx"]
    return {"y": y, "gx": gx, "gw": sum(p["gw"] for p in parts),
            "gb": sum(p["gb"] for p in parts)}


@pytest.mark.parametrize("groups", [2, 4], ids=["group norm", "instance norm"])
@pytest.mark.parametrize("grid", GRIDS.values(), ids=GRIDS.keys())
def test_group_norm_statistics_merge_the_tiles(grid, groups):
    """TileGroupNorm: one allgather forward, one allreduce backward; float64 exact, float32 of
    mean 1e4 as close as float64's reference allows (as BatchNorm above)."""
    x, w, b, g = _inputs(torch.float64, (3, 4, 9, 7), 2.0)
    want = _group_norm(x, w, b, g, groups, None)
    worst = _worst(_group_norm(x, w, b, g, groups, grid), want,
                   {k: F64_TOL[k] for k in want})
    assert max(worst.values()) <= 1.0, worst
    x, w, b, g = _inputs(torch.float32, (3, 4, 9, 7), 1e4)
    want = _group_norm(x.double(), w, b, g, groups, None)
    tol = {k: F32_TOL[k] for k in want}
    worst = _worst(_group_norm(x, w, b, g, groups, grid), want, tol)
    assert max(worst.values()) <= 1.0, worst
