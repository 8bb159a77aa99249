"""Exact global attention over the tokens of a tile group: ``fxpar::ring_attention`` (every
rank's queries against every rank's keys, the keys and values travelling around the ring of the
group's ranks) and ``fxpar::gather_attention`` (a replicated query set, such as a class token,
against the tiled keys). Both are ``torch.library`` custom ops with fake kernels, autograd
formulas and ordered effects, on the pattern of fxpar.runtime.spatial.library.

A model that flattens its image into tokens (one per pixel) leaves each rank its tile's tokens.
Attention over all of them is ``softmax(q K^T s + B) V`` with K and V every rank's keys and
values in rank order and B an optional bias over all of them
(``F.scaled_dot_product_attention(q, K, V, attn_mask=B, scale=s)``: a float bias such as
MaxViT's relative-position bias, which may need its gradient, or a bool mask). A softmax over
the concatenation is a merge of softmaxes over its blocks: block j is this rank's queries
against rank j's keys (and B's columns [offset_j, offset_j + lengths[j])), with normalised
output ``o_j`` and log-sum-exp ``lse_j``, and the whole is ``sum_j exp(lse_j - LSE) o_j`` with
``LSE = logaddexp_j lse_j``. That identity holds in exact arithmetic, so the merged output
differs from one device's only by the rounding of the sums: ~1e-16 relative in float64.
fxpar.runtime.spatial.attention_blocks computes a block: on CPU with the fused flash kernel
that SDPA itself runs in one process, where it applies, else with plain matmul and exp.
Accumulation is float32 for half, bfloat16 and float32 inputs and float64 for float64 ones.

Ring (index letters: r this rank, P the group's size, j the block a rank holds)::

    step s = 0 .. P-1: hold block j = (r - s) mod P; while it is attended to, send it to
    r + 1 and receive block j - 1 from r - 1 (not after the last step)

Backward is flash attention's, from the saved output O and log-sum-exp ``lse`` (never the
attention matrix): ``D = rowsum(dO * O)``; per block ``p = exp(q k^T s + B_j - lse)``,
``dv += p^T dO``, ``ds = p * (dO v^T - D)``, ``dq += ds k s``, ``dk += ds^T q s``, and B's
gradient is each block's ``ds`` in its columns, summed to B's shape (this rank's query rows
only, so it never travels). The block's (dk, dv) accumulators follow its (k, v) around the
ring, one rank behind; after P steps they are back with the owner. A rank's share of a block's
gradient is computed before the partial sum from its neighbour is waited for, so that message
travels during the computation too.

Every message goes through fxpar.comm.ordered.exchange, one exchange per step and direction, so
the ranks issue them in one agreed order (NCCL matches in issue order); forward uses the op's
``tag``, backward ``tag + 1``, like a halo exchange (fxpar.runtime.spatial.tags).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor
from torch._higher_order_ops.effects import EffectType
from torch.utils.flop_counter import (
    register_flop_formula,
    sdpa_backward_flop_count,
    sdpa_flop_count,
)

from fxpar.comm.ordered import exchange
from fxpar.comm.protocol import Comm, Pending
from fxpar.runtime.spatial.attention_blocks import (
    Rows,
    acc_dtype,
    block,
    block_grads,
    columns,
    float_bias,
    merge,
    offsets,
)
from fxpar.runtime.spatial.collectives import fxpar_op
from fxpar.runtime.spatial.group import TileOp, bound, current, group

RING_TAG = 6
"""The default tag of ring attention's messages (backward: 7): below the loss join's 8 and the
halo pass's 10 + 2k (fxpar.runtime.spatial.tags); the compiler may give each op its own."""


def _check(q: Tensor, k: Tensor, v: Tensor, comm: Comm, lengths: Sequence[int] | None,
           bias: Tensor | None = None) -> None:
    """Shapes that the ring cannot send correctly: say which and what to pass instead."""
    if k.shape[:-1] != v.shape[:-1] or q.shape[:-2] != k.shape[:-2] or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"attention: q {tuple(q.shape)}, k {tuple(k.shape)}, v "
                         f"{tuple(v.shape)} must be (..., Lq, E), (..., Lk, E), (..., Lk, Ev) "
                         f"with the same leading dims")
    if lengths is not None and (len(lengths) != comm.size or lengths[comm.rank] != k.shape[-2]):
        raise ValueError(f"ring attention: lengths {list(lengths)} must give every rank's key "
                         f"count in a group of {comm.size}; rank {comm.rank} holds "
                         f"{k.shape[-2]} keys")
    if bias is None or lengths is None:
        return
    want = (*q.shape[:-1], sum(lengths))
    try:
        fits = torch.broadcast_shapes(bias.shape, want) == want
    except RuntimeError:
        fits = False
    if not fits or not (bias.dtype == torch.bool or bias.is_floating_point()):
        raise ValueError(f"ring attention: bias {tuple(bias.shape)} {bias.dtype} must be float "
                         f"or bool and broadcast to {want}: this rank's query rows against "
                         f"every rank's keys, concatenated in rank order")


def _wait(reqs: Sequence[Pending]) -> None:
    for req in reqs:
        req.wait()


def _blank(k: Tensor, v: Tensor, size: int, dtype: torch.dtype | None = None
           ) -> tuple[Tensor, Tensor]:
    """Buffers for a block of ``size`` keys and values (in ``dtype``, default theirs)."""
    return (k.new_empty((*k.shape[:-2], size, k.shape[-1]), dtype=dtype or k.dtype),
            v.new_empty((*v.shape[:-2], size, v.shape[-1]), dtype=dtype or v.dtype))


def _outputs_fake(q: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    return (q.new_empty((*q.shape[:-1], v.shape[-1])),
            q.new_empty(q.shape[:-1], dtype=acc_dtype(q.dtype)))


# -- ring attention ---------------------------------------------------------------------------
@fxpar_op("fxpar::ring_attention")
def ring_attention(q: Tensor, k: Tensor, v: Tensor, key: str, lengths: list[int],
                   scale: float, tag: int, bias: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Attention of this rank's queries ``q`` (..., Lq, E) over the keys and values of every
    rank of tile group ``key`` in rank order (this rank's: ``k`` (..., lengths[rank], E), ``v``
    (..., lengths[rank], Ev)); messages tagged ``tag`` (backward's ``tag + 1``). ``bias``: an
    additive float bias or bool mask (True: attend) broadcastable to (..., Lq, sum(lengths)),
    as SDPA's attn_mask over the concatenated keys. Returns the output (..., Lq, Ev) in q's
    dtype and the log-sum-exp of each query row (acc dtype), which backward reads."""
    comm = group(key)
    _check(q, k, v, comm, lengths, bias)
    r, n = comm.rank, comm.size
    nxt, prv = (r + 1) % n, (r - 1) % n
    acc = acc_dtype(q.dtype)
    first, fbias = offsets(lengths), float_bias(bias, q.dtype, q.dim())
    o = q.new_zeros((*q.shape[:-1], v.shape[-1]), dtype=acc)
    lse = q.new_full(q.shape[:-1], -math.inf, dtype=acc)
    kc, vc = k.contiguous(), v.contiguous()
    for s in range(n):
        j = (r - s) % n
        reqs: list[Pending] = []
        if s < n - 1:  # the next block travels while this one is attended to
            nk, nv = _blank(k, v, lengths[(j - 1) % n])
            reqs = exchange(comm, [(prv, nk), (prv, nv)], [(nxt, kc), (nxt, vc)], tag)
        if kc.shape[-2]:  # a rank may hold no tokens
            o, lse = merge(o, lse, *block(q, kc, vc, columns(fbias, first[j], lengths[j]),
                                          scale))
        _wait(reqs)
        if s < n - 1:
            kc, vc = nk, nv
    return o.to(q.dtype), lse


@ring_attention.register_fake
def _ring_attention_fake(q: Tensor, k: Tensor, v: Tensor, key: str, lengths: list[int],
                         scale: float, tag: int, bias: Tensor | None = None
                         ) -> tuple[Tensor, Tensor]:
    return _outputs_fake(q, v)


def _ring_attention_setup(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    q, k, v, key, lengths, scale, tag, bias = inputs
    out, lse = output
    ctx.key, ctx.comms, ctx.lengths, ctx.scale, ctx.tag = key, current(), lengths, scale, tag
    ctx.save_for_backward(q, k, v, out, lse, bias)
    ctx.mark_non_differentiable(lse)


def _ring_attention_backward(ctx: Any, g: Tensor, _lse: Any) -> tuple[Tensor | None, ...]:
    q, k, v, out, lse, bias = ctx.saved_tensors
    want = bias is not None and bias.is_floating_point() and ctx.needs_input_grad[7]
    with bound(ctx.comms):
        dq, dk, dv, db = torch.ops.fxpar.ring_attention_grad(
            g, q, k, v, out, lse, ctx.key, ctx.lengths, ctx.scale, ctx.tag + 1, bias, want)
    return dq, dk, dv, None, None, None, None, db if want else None


ring_attention.register_autograd(_ring_attention_backward, setup_context=_ring_attention_setup)


@fxpar_op("fxpar::ring_attention_grad")
def ring_attention_grad(g: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                        key: str, lengths: list[int], scale: float, tag: int,
                        bias: Tensor | None = None, bias_grad: bool = False
                        ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Backward of ``ring_attention``: the gradients of (q, k, v) from the output's ``g``, and
    of ``bias`` if ``bias_grad`` (else an empty tensor). (k, v) travel as in forward; each
    block's (dk, dv) partial sum (acc dtype) follows it from the rank that added its share, and
    its total reaches the owner after the last step."""
    comm = group(key)
    r, n = comm.rank, comm.size
    nxt, prv = (r + 1) % n, (r - 1) % n
    acc = acc_dtype(q.dtype)
    rows, first = Rows(q, g, out, lse, scale), offsets(lengths)
    fbias = float_bias(bias, q.dtype, q.dim())
    dbias = fbias.new_zeros(fbias.shape, dtype=acc) if fbias is not None and bias_grad and \
        bias is not None and bias.is_floating_point() else None
    dq = q.new_zeros(q.shape, dtype=acc)
    kc, vc = k.contiguous(), v.contiguous()
    dk_in = dv_in = dq  # the partial sums received for the block held (from step 1 on)
    acc_reqs: list[Pending] = []
    for s in range(n):
        j = (r - s) % n
        kv_reqs: list[Pending] = []
        if s < n - 1:
            nk, nv = _blank(k, v, lengths[(j - 1) % n])
            kv_reqs = exchange(comm, [(prv, nk), (prv, nv)], [(nxt, kc), (nxt, vc)], tag)
        gq, dk, dv, ds = block_grads(rows, kc, vc, columns(fbias, first[j], lengths[j]),
                                     dbias is not None)
        dq += gq
        if ds is not None and ds.shape[-1]:
            part = columns(dbias, first[j], lengths[j])
            assert part is not None
            part += ds.sum_to_size(part.shape)
        _wait(acc_reqs)  # the neighbour's partial sums of this block (and my last sends)
        if s > 0:
            dk, dv = dk + dk_in, dv + dv_in
        if n > 1:  # on to the next rank: the block it holds at step s + 1 (its owner at the end)
            dk_in, dv_in = _blank(k, v, lengths[(j - 1) % n], acc)
            acc_reqs = exchange(comm, [(prv, dk_in), (prv, dv_in)], [(nxt, dk), (nxt, dv)],
                                tag)
        else:
            dk_in, dv_in = dk, dv
        _wait(kv_reqs)
        if s < n - 1:
            kc, vc = nk, nv
    _wait(acc_reqs)
    db = q.new_empty(0) if dbias is None or bias is None else \
        dbias.reshape(bias.shape).to(bias.dtype)
    return dq.to(q.dtype), dk_in.to(k.dtype), dv_in.to(v.dtype), db


@ring_attention_grad.register_fake
def _ring_attention_grad_fake(g: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor,
                              lse: Tensor, key: str, lengths: list[int], scale: float, tag: int,
                              bias: Tensor | None = None, bias_grad: bool = False
                              ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    db = torch.empty_like(bias) if bias is not None and bias_grad and \
        bias.is_floating_point() else q.new_empty(0)
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), db


# -- a replicated query set against the tiled keys --------------------------------------------
@fxpar_op("fxpar::gather_attention")
def gather_attention(q: Tensor, k: Tensor, v: Tensor, key: str, scale: float
                     ) -> tuple[Tensor, Tensor]:
    """Attention of the replicated queries ``q`` (..., Lq, E), the same on every rank, over
    the keys and values of every rank of tile group ``key`` (this rank's: ``k`` (..., Lk, E),
    ``v`` (..., Lk, Ev)). Each rank attends to its own keys; the partial outputs are merged
    with an allreduce of the maximum log-sum-exp and one of the rescaled sums. Returns the
    replicated output (..., Lq, Ev) and log-sum-exp (acc dtype)."""
    comm = group(key)
    _check(q, k, v, comm, None)
    ob, lb = block(q, k, v, None, scale)  # no tokens here: 0 and -inf, nothing to add
    top = comm.allreduce(lb.clone(memory_format=torch.contiguous_format), "max")
    w = torch.exp(lb - top).unsqueeze(-1)
    sums = comm.allreduce(torch.cat([ob * w, w], -1))
    den = sums[..., -1]
    return (sums[..., :-1] / den.unsqueeze(-1)).to(q.dtype), top + torch.log(den)


@gather_attention.register_fake
def _gather_attention_fake(q: Tensor, k: Tensor, v: Tensor, key: str, scale: float
                           ) -> tuple[Tensor, Tensor]:
    return _outputs_fake(q, v)


def _gather_attention_setup(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    q, k, v, key, scale = inputs
    out, lse = output
    ctx.key, ctx.comms, ctx.scale = key, current(), scale
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.mark_non_differentiable(lse)


def _gather_attention_backward(ctx: Any, g: Tensor, _lse: Any) -> tuple[Tensor | None, ...]:
    """The output is replicated, so ``g`` is this rank's part of its gradient: the whole is
    summed first (an allreduce), then each rank differentiates its own block exactly as the
    ring does. dk, dv are this rank's own; dq is this rank's part (its keys' terms), and the
    parts sum to q's gradient, as fxpar gives a replicated value's gradient
    (fxpar.runtime.spatial.reduce)."""
    q, k, v, out, lse = ctx.saved_tensors
    with bound(ctx.comms):
        total = torch.ops.fxpar.allreduce(g, ctx.key, "sum")
    gq, dk, dv, _ = block_grads(Rows(q, total, out, lse, ctx.scale), k, v, None, False)
    return gq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None


gather_attention.register_autograd(_gather_attention_backward,
                                   setup_context=_gather_attention_setup)


for _op in (ring_attention, ring_attention_grad, gather_attention):
    _op.register_effect(EffectType.ORDERED)


def _as_4d(shape: Any, lk: int | None = None) -> tuple[int, int, int, int]:
    """(1, batch, L, E) of a (..., L, E) shape (``lk``: L replaced by every rank's keys)."""
    return 1, math.prod(shape[:-2]), int(shape[-2] if lk is None else lk), int(shape[-1])


# torch's FlopCounterMode does not look inside a custom op: the FLOPs of attention over every
# rank's keys, as it counts scaled_dot_product_attention (the merges count none)
@register_flop_formula(torch.ops.fxpar.ring_attention)
def _ring_attention_flops(q_shape: Any, k_shape: Any, v_shape: Any, _key: str,
                          lengths: list[int], *args: Any, out_shape: Any = None,
                          **kwargs: Any) -> int:
    lk = sum(lengths)
    return sdpa_flop_count(_as_4d(q_shape), _as_4d(k_shape, lk), _as_4d(v_shape, lk))


@register_flop_formula(torch.ops.fxpar.ring_attention_grad)
def _ring_attention_grad_flops(g_shape: Any, q_shape: Any, k_shape: Any, v_shape: Any,
                               _out: Any, _lse: Any, _key: str, lengths: list[int], *args: Any,
                               out_shape: Any = None, **kwargs: Any) -> int:
    lk = sum(lengths)
    return sdpa_backward_flop_count(_as_4d(g_shape), _as_4d(q_shape), _as_4d(k_shape, lk),
                                    _as_4d(v_shape, lk))


@register_flop_formula(torch.ops.fxpar.gather_attention)
def _gather_attention_flops(q_shape: Any, k_shape: Any, v_shape: Any, *args: Any,
                            out_shape: Any = None, **kwargs: Any) -> int:
    """Attention over this rank's own keys (the merge counts none; its backward is ATen ops,
    which torch counts itself)."""
    return sdpa_flop_count(_as_4d(q_shape), _as_4d(k_shape), _as_4d(v_shape))


# -- modules the compiler puts into a stage graph ---------------------------------------------
def _scale(scale: float | None, q: Tensor) -> float:
    return scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])


class RingAttention(TileOp):
    """``F.scaled_dot_product_attention(q, K, V, attn_mask=bias, scale=scale)`` of this rank's
    queries over the keys and values of every tile of group ``key`` (``lengths``: each rank's
    token count; ``scale`` None: ``1 / sqrt(E)``, as SDPA; ``bias``, optional, forward's
    fourth input: this rank's query rows against all the keys in rank order). Messages:
    ``tag`` forward, ``tag + 1`` backward."""

    def __init__(self, key: str, lengths: Sequence[int], scale: float | None = None,
                 tag: int = RING_TAG) -> None:
        super().__init__()
        self.key, self.lengths, self.scale, self.tag = key, tuple(lengths), scale, tag

    def emit_args(self) -> dict[str, Any]:
        """The constructor's arguments (fxpar.program.emit writes ``RingAttention(**these)``)."""
        return {"key": self.key, "lengths": self.lengths, "scale": self.scale, "tag": self.tag}

    def forward(self, q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None = None) -> Tensor:
        return torch.ops.fxpar.ring_attention(q, k, v, self.key, list(self.lengths),
                                              _scale(self.scale, q), self.tag, bias)[0]

    def extra_repr(self) -> str:
        scale = "1/sqrt(E)" if self.scale is None else f"{self.scale:g}"
        return (f"attention over {sum(self.lengths)} tokens on a ring of {len(self.lengths)} "
                f"tiles {list(self.lengths)}, scale {scale}, tags {self.tag}/{self.tag + 1}")


class GatherAttention(TileOp):
    """``F.scaled_dot_product_attention(q, K, V, scale=scale)`` of replicated queries (a class
    token) over the keys and values of every tile of group ``key``; the output is replicated."""

    def __init__(self, key: str, scale: float | None = None) -> None:
        super().__init__()
        self.key, self.scale = key, scale

    def emit_args(self) -> dict[str, Any]:
        """The constructor's arguments (fxpar.program.emit writes ``GatherAttention(**...)``)."""
        return {"key": self.key, "scale": self.scale}

    def forward(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return torch.ops.fxpar.gather_attention(q, k, v, self.key, _scale(self.scale, q))[0]

    def extra_repr(self) -> str:
        scale = "1/sqrt(E)" if self.scale is None else f"{self.scale:g}"
        return f"replicated queries over the tiles' tokens, scale {scale}"


def ring_bytes(lengths: Sequence[int], rank: int, batch: int, e: int, ev: int,
               dtype: torch.dtype) -> tuple[int, int]:
    """Bytes rank ``rank`` sends in one forward and one backward of ring attention over tiles
    of ``lengths`` tokens (``batch``: the product of the leading dims, N x heads; ``e``, ``ev``:
    the key and value widths; ``dtype``: the inputs'). With T = sum(lengths), b = itemsize and
    a = the accumulation dtype's itemsize (:func:`acc_dtype`)::

        forward  = batch (e + ev) b (T - lengths[rank + 1 mod P])   # P - 1 blocks of K and V
        backward = forward + batch (e + ev) a T                     # and every block's dK, dV

    (even tiles of L tokens: (P - 1) L (e + ev) b batch forward). A group of one sends none."""
    n = len(lengths)
    if n == 1:
        return 0, 0
    b, a = dtype.itemsize, acc_dtype(dtype).itemsize
    forward = batch * (e + ev) * b * (sum(lengths) - lengths[(rank + 1) % n])
    return forward, forward + batch * (e + ev) * a * sum(lengths)
