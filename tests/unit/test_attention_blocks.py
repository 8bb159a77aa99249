"""The blocks of exact attention over split keys (fxpar.runtime.spatial.attention_blocks), in
one process, no MPI: the keys cut into blocks, each block's (output, lse) merged and each
block's share of the gradients summed, against ``F.scaled_dot_product_attention`` on the whole
sequence; with the fused CPU kernel and with the plain block code, with and without a bias
(float, bool, broadcast, a row masked out of a whole block)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import pytest
import torch
import torch.nn.functional as F

from fxpar.runtime.spatial.attention_blocks import (
    Rows,
    acc_dtype,
    block,
    block_grads,
    columns,
    float_bias,
    fusable,
    merge,
    offsets,
)


def _blocks(q, k, v, g, bias, lengths: Sequence[int], scale: float, want_ds: bool,
            fused: bool = True):
    """(out, dq, dk, dv, dbias) from the blocks of ``lengths`` keys, as the ring adds them."""
    fb = float_bias(bias, q.dtype, q.dim())
    acc = acc_dtype(q.dtype)
    o = torch.zeros(*q.shape[:-1], v.shape[-1], dtype=acc)
    lse = torch.full(q.shape[:-1], -math.inf, dtype=acc)
    parts = list(zip(offsets(lengths), lengths, strict=True))
    for first, n in parts:
        if n:
            o, lse = merge(o, lse, *block(q, k.narrow(-2, first, n), v.narrow(-2, first, n),
                                          columns(fb, first, n), scale, fused))
    rows = Rows(q, g, o.to(q.dtype), lse, scale)
    dq, dks, dvs, dss = 0, [], [], []
    for first, n in parts:
        gq, dk, dv, ds = block_grads(rows, k.narrow(-2, first, n), v.narrow(-2, first, n),
                                     columns(fb, first, n), want_ds, fused)
        dq, dss = dq + gq, dss + [ds]
        dks.append(dk)
        dvs.append(dv)
    db = torch.cat(dss, -1).sum_to_size(bias.shape) if want_ds else None
    return o, dq, torch.cat(dks, -2), torch.cat(dvs, -2), db


def _reference(q, k, v, g, bias, scale: float):
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    mask = None if bias is None else bias.detach().clone()
    if mask is not None and mask.is_floating_point():
        mask = mask.double().requires_grad_()
    out = F.scaled_dot_product_attention(*leaves, attn_mask=mask, scale=scale)
    out.backward(g.double())
    grads = [t.grad for t in leaves]
    return out.detach(), *grads, None if mask is None else mask.grad


CASES = {  # name: (lead, Lq, lengths, E, Ev, bias shape or None or "bool")
    "plain multihead": ((2, 3), 5, [4, 3, 6], 8, 8, None),
    "E != Ev": ((2,), 4, [3, 5], 4, 6, None),
    "empty block": ((2, 2), 3, [3, 0, 4], 4, 4, None),
    "no leading dims": ((), 6, [2, 5], 4, 4, None),
    "five dims": ((2, 2, 3), 4, [3, 4], 4, 4, (3, 4, 7)),
    "full bias": ((2, 3), 5, [4, 3, 6], 8, 8, (2, 3, 5, 13)),
    "bias over heads": ((2, 3), 5, [4, 3, 6], 8, 8, (3, 5, 13)),
    "bias per key only": ((2, 3), 5, [4, 6], 4, 4, (10,)),
    "bias per query only": ((2, 3), 5, [4, 6], 4, 4, (5, 1)),
    "bias E != Ev": ((2,), 4, [3, 5], 4, 6, (4, 8)),
    "bool mask": ((2, 3), 5, [4, 3, 6], 8, 8, "bool"),
}


def _inputs(lead, lq, lengths, e, ev, bias, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    t = sum(lengths)

    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype)

    q, k, v, g = rand(*lead, lq, e), rand(*lead, t, e), rand(*lead, t, ev), rand(*lead, lq, ev)
    if bias == "bool":
        bias = torch.rand(*lead, lq, t, generator=gen) > 0.3
        bias[..., 0, :] = False
        bias[..., 0, 5] = True  # query 0 sees key 5 only: blocks 0 and 2 mask its whole row
    elif bias is not None:
        bias = rand(*bias)
    return q, k, v, g, bias


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "plain"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("name", CASES)
def test_blocks_merge_to_sdpa_on_the_whole_sequence(name, dtype, fused):
    lead, lq, lengths, e, ev, bias_shape = CASES[name]
    q, k, v, g, bias = _inputs(lead, lq, lengths, e, ev, bias_shape, dtype)
    want_ds = bias is not None and bias.is_floating_point()
    got = _blocks(q, k, v, g, bias, lengths, 0.6, want_ds, fused)
    nograd = _blocks(q, k, v, g, bias, lengths, 0.6, False, fused)  # the fused backward's path
    want = _reference(q, k, v, g, bias, 0.6)
    atol = 1e-13 if dtype == torch.float64 else 3e-5
    for what, a, b in zip(("out", "dq", "dk", "dv", "dbias"), got, want, strict=True):
        if b is None or not want_ds and what == "dbias":
            continue
        diff = (a.double() - b).abs().max().item()
        assert diff <= atol * max(1.0, b.abs().max().item()), (what, diff)
    for a, b in zip(got[:4], nograd[:4], strict=True):
        assert (a.double() - b.double()).abs().max().item() <= atol


def test_fused_where_the_kernel_applies():
    q, k, v = torch.randn(2, 3, 5, 8), torch.randn(2, 3, 4, 8), torch.randn(2, 3, 4, 8)
    assert fusable(q, k, v) and fusable(q.double(), k.double(), v.double())
    assert not fusable(q, k, torch.randn(2, 3, 4, 6))  # one head size only
    assert not fusable(q[..., :0, :], k, v) and not fusable(q, k[..., :0, :], v)  # empty
    assert not fusable(q, k.double(), v)


def test_a_row_masked_out_of_a_block_gets_no_weight():
    """The fused kernel gives such a row lse 0; the block gives -inf and output 0."""
    q, k, v = (torch.randn(1, 2, 3, 4, dtype=torch.float64) for _ in range(3))
    mask = torch.zeros(3, 3, dtype=torch.float64)
    mask[1] = -math.inf
    for fused in (True, False):
        o, lse = block(q, k, v, mask, 0.5, fused)
        assert (lse[..., 1] == -math.inf).all() and (o[..., 1, :] == 0).all(), (fused, lse)
        assert torch.isfinite(lse[..., [0, 2]]).all()


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "plain"])
def test_strided_queries_and_gradients(fused):
    """q and the output's gradient as a model gives them: (N, L, heads, E) transposed."""
    gen = torch.Generator().manual_seed(5)
    q, g = (torch.randn(2, 7, 3, 8, generator=gen, dtype=torch.float64).transpose(1, 2)
            for _ in range(2))
    k, v = (torch.randn(2, 3, 9, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    got = _blocks(q, k, v, g, None, [4, 5], 0.3, False, fused)
    want = _reference(q, k, v, g, None, 0.3)
    for a, b in zip(got[:4], want[:4], strict=True):
        assert (a - b).abs().max().item() <= 1e-14
