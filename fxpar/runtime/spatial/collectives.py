"""fxpar's collectives over a tile group as ``torch.library`` custom ops: ``fxpar::allreduce``,
``fxpar::allgather``, ``fxpar::group_extreme`` (a maximum or minimum over the whole image and
its ties) and ``fxpar::sync_batch_norm`` (BatchNorm with the statistics of every tile). Each
takes tensors, the tile group's name and plain numbers or strings, has a fake kernel and an
autograd formula, and is an ordered effect: the pattern of fxpar.runtime.spatial.library,
whose module doc says why.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import Tensor
from torch._higher_order_ops.effects import EffectType
from torch.nn import functional as F

from fxpar.runtime.spatial.group import bound, current, group
from fxpar.runtime.spatial.moments import global_moments, stats_dtype

fxpar_op = functools.partial(torch.library.custom_op, mutates_args=())
"""How fxpar defines an op (here and in fxpar.runtime.spatial.library): no input mutated."""


def _remember(ctx: Any, key: str) -> None:
    """What every op's backward needs: its group and the binding forward ran in."""
    ctx.key, ctx.comms = key, current()


# -- collectives over the tile group ----------------------------------------------------------
@fxpar_op("fxpar::allreduce")
def allreduce(x: Tensor, key: str, op: str) -> Tensor:
    """``x`` reduced (``op``: sum, max, min) over the tile group ``key``, on every rank.
    Differentiable for sum: a replicated result's gradient is partial on each rank, so the
    backward is an allreduce again."""
    return group(key).allreduce(x.clone(memory_format=torch.contiguous_format), op)


@allreduce.register_fake
def _allreduce_fake(x: Tensor, key: str, op: str) -> Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _allreduce_setup(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    _remember(ctx, inputs[1])
    ctx.op = inputs[2]


def _allreduce_backward(ctx: Any, g: Tensor) -> tuple[Tensor, None, None]:
    if ctx.op != "sum":
        raise RuntimeError(f"fxpar::allreduce with op {ctx.op!r} has no gradient (only a sum "
                           f"has one)")
    with bound(ctx.comms):
        return torch.ops.fxpar.allreduce(g, ctx.key, "sum"), None, None


allreduce.register_autograd(_allreduce_backward, setup_context=_allreduce_setup)


@fxpar_op("fxpar::allgather")
def allgather(x: Tensor, key: str) -> Tensor:
    """Every rank's ``x`` (the same shape on all), stacked in rank order, on every rank."""
    return torch.stack(group(key).allgather(x.contiguous()))


@allgather.register_fake
def _allgather_fake(x: Tensor, key: str) -> Tensor:
    comm = current().get(key)  # unbound (torch.export): the group's size is symbolic
    size = comm.size if comm is not None else torch.library.get_ctx().new_dynamic_size()
    return x.new_empty((size, *x.shape))


def _allgather_setup(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    _remember(ctx, inputs[1])


def _allgather_backward(ctx: Any, g: Tensor) -> tuple[Tensor, None]:
    # each rank's use of the gathered values adds to the gradient of every rank's x
    with bound(ctx.comms):
        total = torch.ops.fxpar.allreduce(g, ctx.key, "sum")
        return total[group(ctx.key).rank], None


allgather.register_autograd(_allgather_backward, setup_context=_allgather_setup)


@fxpar_op("fxpar::group_extreme")
def group_extreme(x: Tensor, key: str, dims: list[int], op: str
                  ) -> tuple[Tensor, Tensor, Tensor]:
    """``amax`` / ``amin`` (``op``: "max" or "min") over ``dims`` of the whole tensor, keeping
    the dims; also the cells of the tile equal to it and their count over the group. Backward
    splits the gradient evenly over those cells on every tile, as one device does."""
    comm = group(key)
    local = x.amax(dim=dims, keepdim=True) if op == "max" else x.amin(dim=dims, keepdim=True)
    m = comm.allreduce(local.contiguous(), op=op)
    at = x == m
    count = comm.allreduce(at.sum(dim=dims, keepdim=True).to(x.dtype))
    return m, at, count


@group_extreme.register_fake
def _group_extreme_fake(x: Tensor, key: str, dims: list[int], op: str
                        ) -> tuple[Tensor, Tensor, Tensor]:
    m = x.amax(dim=dims, keepdim=True).contiguous()
    return m, torch.empty_like(x, dtype=torch.bool), torch.empty_like(m)


def _group_extreme_setup(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    _, at, count = output
    _remember(ctx, inputs[1])
    ctx.save_for_backward(at, count)
    ctx.mark_non_differentiable(at, count)


def _group_extreme_backward(ctx: Any, g: Tensor, _at: Any, _count: Any
                            ) -> tuple[Tensor, None, None, None]:
    at, count = ctx.saved_tensors
    with bound(ctx.comms):
        total = torch.ops.fxpar.allreduce(g, ctx.key, "sum")
    return at * (total / count), None, None, None


group_extreme.register_autograd(_group_extreme_backward, setup_context=_group_extreme_setup)


# -- synchronised BatchNorm -------------------------------------------------------------------
def _box(box: list[int]) -> tuple[slice, ...]:
    """The slices of ``box``: a start and a stop per spatial dim, flat (empty: everything)."""
    return (slice(None), slice(None), *(slice(a, b) for a, b in zip(box[::2], box[1::2],
                                                                      strict=True)))


@fxpar_op("fxpar::sync_batch_norm")
def sync_batch_norm(x: Tensor, weight: Tensor | None, bias: Tensor | None, key: str,
                    count: int, eps: float, box: list[int]) -> tuple[Tensor, Tensor, Tensor]:
    """Training-mode BatchNorm of tile ``x`` with statistics over every tile of the group
    (fxpar.runtime.spatial.moments): ``count`` values per channel in all, statistics of the
    cells ``box`` of the tile (:func:`_box`). Returns the output, the mean and the biased
    variance. Saves only the input and the per-channel statistics, like PyTorch's own kernel,
    so tiles keep 1/P of the memory."""
    mean, var = global_moments(x[_box(box)], group(key))
    y = F.batch_norm(x, mean, var, weight, bias, False, 0.0, eps)
    return y, mean, var


@sync_batch_norm.register_fake
def _sync_batch_norm_fake(x: Tensor, weight: Tensor | None, bias: Tensor | None, key: str,
                          count: int, eps: float, box: list[int]
                          ) -> tuple[Tensor, Tensor, Tensor]:
    c = x.shape[1]
    return (torch.empty_like(x), x.new_empty(c, dtype=stats_dtype(x)),
            x.new_empty(c, dtype=stats_dtype(x)))


def _sync_batch_norm_setup(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    x, weight, _, key, count, eps, box = inputs
    _, mean, var = output
    _remember(ctx, key)
    ctx.count, ctx.eps, ctx.box = count, eps, _box(box)
    ctx.save_for_backward(x, weight, mean, var)
    ctx.mark_non_differentiable(mean, var)


def _sync_batch_norm_backward(ctx: Any, gy: Tensor, _gm: Any, _gv: Any
                              ) -> tuple[Tensor | None, ...]:
    """``native_batch_norm_backward`` in eval form (gy * w * invstd and the local parameter-
    gradient sums) plus one eval-form ``batch_norm`` for the correction terms the global
    statistics add: one allreduce of the two per-channel sums. Written with elementwise ops
    this took ~4x longer per element than one device's BatchNorm (issue 7's profile)."""
    if getattr(ctx, "weight_grads", None) is not None:
        # run again for the weights alone (a zero-bubble W, fxpar.runtime.splitgrad): the
        # first run's local sums, no second allreduce
        gw, gb = ctx.weight_grads
        return None, gw, gb, None, None, None, None
    x, weight, mean, var = ctx.saved_tensors
    eps, count, box = ctx.eps, ctx.count, ctx.box
    w = weight if weight is not None else torch.ones_like(mean)
    invstd = torch.rsqrt(var + eps)
    # the saved statistics too: CPU's eval form ignores them, CUDA's asserts they are there
    # (torch 2.11, H200: "save_mean should always be defined")
    gx, gw_l, gb_l = torch.ops.aten.native_batch_norm_backward(
        gy.contiguous(), x, w, mean, var, mean, invstd, False, eps, [True, True, True])
    with bound(ctx.comms):
        total = torch.ops.fxpar.allreduce(torch.stack([gb_l, gw_l]), ctx.key, "sum")
    # gx = scale * (gy - sum(gy)/count - xhat * sum(gy * xhat)/count): the first term is gx
    # above; the rest is xhat times a per-channel factor plus a per-channel constant (a fused
    # halo group's border cells are not in the statistics: only the box is)
    scale = invstd * w
    gx[box] += F.batch_norm(x[box], mean, var, -scale * total[1] / count,
                            -scale * total[0] / count, False, 0.0, eps)
    # parameter gradients stay local: the stage's ALLREDUCE sums them over the tiles
    gw = gw_l if weight is not None and ctx.needs_input_grad[1] else None
    gb = gb_l if weight is not None and ctx.needs_input_grad[2] else None
    ctx.weight_grads = (gw, gb)
    return gx, gw, gb, None, None, None, None


sync_batch_norm.register_autograd(_sync_batch_norm_backward,
                                  setup_context=_sync_batch_norm_setup)


for _op in (allreduce, allgather, group_extreme, sync_batch_norm):
    _op.register_effect(EffectType.ORDERED)
