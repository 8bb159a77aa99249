"""Exact global attention over the tokens of a tile group: ``fxpar::ring_attention`` (every
rank's queries against every rank's keys, the keys and values travelling around the ring of the
group's ranks) and ``fxpar::gather_attention`` (a replicated query set, such as a class token,
against the tiled keys). Both are ``torch.library`` custom ops with fake kernels, autograd
formulas and ordered effects, on the pattern of fxpar.runtime.spatial.library.

A model that flattens its image into tokens (one per pixel) leaves each rank its tile's tokens.
Attention over all of them is ``softmax(q K^T s) V`` with K and V every rank's keys and values
in rank order (``F.scaled_dot_product_attention(q, K, V, scale=s)``). A softmax over the
concatenation is a merge of softmaxes over its blocks: with a block's row maximum ``m_j``, sum
``l_j = sum exp(q k^T s - m_j)`` and unnormalised output ``o_j = sum exp(q k^T s - m_j) v``,
the whole is ``sum_j exp(m_j - M) o_j / sum_j exp(m_j - M) l_j`` for any ``M`` (the running
maximum keeps every exponent <= 0). That identity holds in exact arithmetic, so the merged
output differs from one device's only by the rounding of the sums: ~1e-16 relative in float64.
Accumulation is float32 for half, bfloat16 and float32 inputs and float64 for float64 ones.

Ring (index letters: r this rank, P the group's size, j the block a rank holds)::

    step s = 0 .. P-1: hold block j = (r - s) mod P; while it is attended to, send it to
    r + 1 and receive block j - 1 from r - 1 (not after the last step)

Backward is flash attention's, from the saved output O and log-sum-exp ``lse`` (never the
attention matrix): ``D = rowsum(dO * O)``; per block ``p = exp(q k^T s - lse)``,
``dv += p^T dO``, ``ds = p * (dO v^T - D)``, ``dq += ds k s``, ``dk += ds^T q s``. The block's
(dk, dv) accumulators follow its (k, v) around the ring, one rank behind; after P steps they are
back with the owner. A rank's share of a block's gradient is computed before the partial sum from
its neighbour is waited for, so that message travels during the computation too.

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

from fxpar.comm.ordered import exchange
from fxpar.comm.protocol import Comm, Pending
from fxpar.runtime.spatial.collectives import fxpar_op
from fxpar.runtime.spatial.group import TileOp, bound, current, group

RING_TAG = 6
"""The default tag of ring attention's messages (backward: 7): below the loss join's 8 and the
halo pass's 10 + 2k (fxpar.runtime.spatial.tags); the compiler may give each op its own."""


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype attention accumulates in: float64 for float64 inputs, float32 otherwise."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _check(q: Tensor, k: Tensor, v: Tensor, comm: Comm, lengths: Sequence[int] | None) -> None:
    """Shapes that the ring cannot send correctly: say which and what to pass instead."""
    if k.shape[:-1] != v.shape[:-1] or q.shape[:-2] != k.shape[:-2] or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"attention: q {tuple(q.shape)}, k {tuple(k.shape)}, v "
                         f"{tuple(v.shape)} must be (..., Lq, E), (..., Lk, E), (..., Lk, Ev) "
                         f"with the same leading dims")
    if lengths is not None and (len(lengths) != comm.size or lengths[comm.rank] != k.shape[-2]):
        raise ValueError(f"ring attention: lengths {list(lengths)} must give every rank's key "
                         f"count in a group of {comm.size}; rank {comm.rank} holds "
                         f"{k.shape[-2]} keys")


def _wait(reqs: Sequence[Pending]) -> None:
    for req in reqs:
        req.wait()


def _block(q: Tensor, k: Tensor, v: Tensor, scale: float) -> tuple[Tensor, Tensor, Tensor]:
    """One block's row maximum, row sum of exponentials and unnormalised output (acc dtype)."""
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    m = s.amax(-1)
    p = torch.exp(s - m.unsqueeze(-1))
    return m, p.sum(-1), torch.matmul(p, v)


def _block_grads(q: Tensor, k: Tensor, v: Tensor, do: Tensor, lse: Tensor, d: Tensor,
                 scale: float) -> tuple[Tensor, Tensor, Tensor]:
    """One block's share of (dq / scale, dk, dv) from the whole softmax's ``lse`` and
    ``d = rowsum(dO * O)`` (acc dtype, ``lse`` and ``d`` with a trailing 1)."""
    p = torch.exp(torch.matmul(q, k.transpose(-1, -2)) * scale - lse)
    ds = p * (torch.matmul(do, v.transpose(-1, -2)) - d)
    return (torch.matmul(ds, k), torch.matmul(ds.transpose(-1, -2), q) * scale,
            torch.matmul(p.transpose(-1, -2), do))


def _outputs_fake(q: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    return (q.new_empty((*q.shape[:-1], v.shape[-1])),
            q.new_empty(q.shape[:-1], dtype=acc_dtype(q.dtype)))


# -- ring attention ---------------------------------------------------------------------------
@fxpar_op("fxpar::ring_attention")
def ring_attention(q: Tensor, k: Tensor, v: Tensor, key: str, lengths: list[int],
                   scale: float, tag: int) -> tuple[Tensor, Tensor]:
    """Attention of this rank's queries ``q`` (..., Lq, E) over the keys and values of every
    rank of tile group ``key`` in rank order (this rank's: ``k`` (..., lengths[rank], E), ``v``
    (..., lengths[rank], Ev)); messages tagged ``tag`` (backward's ``tag + 1``). Returns the
    output (..., Lq, Ev) in q's dtype and the log-sum-exp of each query row (acc dtype), which
    backward reads."""
    comm = group(key)
    _check(q, k, v, comm, lengths)
    r, n = comm.rank, comm.size
    nxt, prv = (r + 1) % n, (r - 1) % n
    acc = acc_dtype(q.dtype)
    qa = q.to(acc)
    m = qa.new_full(q.shape[:-1], -math.inf)
    den = qa.new_zeros(q.shape[:-1])  # the softmax's row sums
    o = qa.new_zeros((*q.shape[:-1], v.shape[-1]))
    kc, vc = k.contiguous(), v.contiguous()
    for s in range(n):
        reqs: list[Pending] = []
        if s < n - 1:  # the next block travels while this one is attended to
            size = lengths[(r - s - 1) % n]
            nk, nv = k.new_empty((*k.shape[:-2], size, k.shape[-1])), \
                v.new_empty((*v.shape[:-2], size, v.shape[-1]))
            reqs = exchange(comm, [(prv, nk), (prv, nv)], [(nxt, kc), (nxt, vc)], tag)
        if kc.shape[-2]:  # a rank may hold no tokens
            mb, lb, ob = _block(qa, kc.to(acc), vc.to(acc), scale)
            top = torch.maximum(m, mb)
            a, b = torch.exp(m - top), torch.exp(mb - top)
            m, den, o = top, den * a + lb * b, o * a.unsqueeze(-1) + ob * b.unsqueeze(-1)
        _wait(reqs)
        if s < n - 1:
            kc, vc = nk, nv
    return (o / den.unsqueeze(-1)).to(q.dtype), m + torch.log(den)


@ring_attention.register_fake
def _ring_attention_fake(q: Tensor, k: Tensor, v: Tensor, key: str, lengths: list[int],
                         scale: float, tag: int) -> tuple[Tensor, Tensor]:
    return _outputs_fake(q, v)


def _ring_attention_setup(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    q, k, v, key, lengths, scale, tag = inputs
    out, lse = output
    ctx.key, ctx.comms, ctx.lengths, ctx.scale, ctx.tag = key, current(), lengths, scale, tag
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.mark_non_differentiable(lse)


def _ring_attention_backward(ctx: Any, g: Tensor, _lse: Any) -> tuple[Tensor | None, ...]:
    q, k, v, out, lse = ctx.saved_tensors
    with bound(ctx.comms):
        dq, dk, dv = torch.ops.fxpar.ring_attention_grad(g, q, k, v, out, lse, ctx.key,
                                                         ctx.lengths, ctx.scale, ctx.tag + 1)
    return dq, dk, dv, None, None, None, None


ring_attention.register_autograd(_ring_attention_backward, setup_context=_ring_attention_setup)


@fxpar_op("fxpar::ring_attention_grad")
def ring_attention_grad(g: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                        key: str, lengths: list[int], scale: float, tag: int
                        ) -> tuple[Tensor, Tensor, Tensor]:
    """Backward of ``ring_attention``: the gradients of (q, k, v) from the output's ``g``.
    (k, v) travel as in forward; each block's (dk, dv) partial sum (acc dtype) follows it from
    the rank that added its share, and its total reaches the owner after the last step."""
    comm = group(key)
    r, n = comm.rank, comm.size
    nxt, prv = (r + 1) % n, (r - 1) % n
    acc = acc_dtype(q.dtype)
    qa, do = q.to(acc), g.to(acc)
    d = (do * out.to(acc)).sum(-1, keepdim=True)
    lse1 = lse.unsqueeze(-1)
    dq = torch.zeros_like(qa)
    kc, vc = k.contiguous(), v.contiguous()
    dk_in = dv_in = dq  # the partial sums received for the block held (from step 1 on)
    acc_reqs: list[Pending] = []
    for s in range(n):
        kv_reqs: list[Pending] = []
        if s < n - 1:
            size = lengths[(r - s - 1) % n]
            nk, nv = k.new_empty((*k.shape[:-2], size, k.shape[-1])), \
                v.new_empty((*v.shape[:-2], size, v.shape[-1]))
            kv_reqs = exchange(comm, [(prv, nk), (prv, nv)], [(nxt, kc), (nxt, vc)], tag)
        gq, dk, dv = _block_grads(qa, kc.to(acc), vc.to(acc), do, lse1, d, scale)
        dq += gq
        _wait(acc_reqs)  # the neighbour's partial sums of this block (and my last sends)
        if s > 0:
            dk, dv = dk + dk_in, dv + dv_in
        if n > 1:  # on to the next rank: the block it holds at step s + 1 (its owner at the end)
            size = lengths[(r - s - 1) % n]
            dk_in, dv_in = dq.new_empty((*k.shape[:-2], size, k.shape[-1])), \
                dq.new_empty((*v.shape[:-2], size, v.shape[-1]))
            acc_reqs = exchange(comm, [(prv, dk_in), (prv, dv_in)], [(nxt, dk), (nxt, dv)],
                                tag)
        else:
            dk_in, dv_in = dk, dv
        _wait(kv_reqs)
        if s < n - 1:
            kc, vc = nk, nv
    _wait(acc_reqs)
    return (dq * scale).to(q.dtype), dk_in.to(k.dtype), dv_in.to(v.dtype)


@ring_attention_grad.register_fake
def _ring_attention_grad_fake(g: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor,
                              lse: Tensor, key: str, lengths: list[int], scale: float, tag: int
                              ) -> tuple[Tensor, Tensor, Tensor]:
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


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
    acc = acc_dtype(q.dtype)
    qa = q.to(acc)
    if k.shape[-2]:
        mb, lb, ob = _block(qa, k.to(acc), v.to(acc), scale)
    else:  # no tokens here: nothing to add
        mb, lb = qa.new_full(q.shape[:-1], -math.inf), qa.new_zeros(q.shape[:-1])
        ob = qa.new_zeros((*q.shape[:-1], v.shape[-1]))
    top = comm.allreduce(mb.clone(), "max")
    w = torch.exp(mb - top)
    sums = comm.allreduce(torch.cat([ob * w.unsqueeze(-1), (lb * w).unsqueeze(-1)], -1))
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
    acc = acc_dtype(q.dtype)
    do = total.to(acc)
    d = (do * out.to(acc)).sum(-1, keepdim=True)
    gq, dk, dv = _block_grads(q.to(acc), k.to(acc), v.to(acc), do, lse.unsqueeze(-1), d,
                              ctx.scale)
    return (gq * ctx.scale).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None


gather_attention.register_autograd(_gather_attention_backward,
                                   setup_context=_gather_attention_setup)


for _op in (ring_attention, ring_attention_grad, gather_attention):
    _op.register_effect(EffectType.ORDERED)


# -- modules the compiler puts into a stage graph ---------------------------------------------
def _scale(scale: float | None, q: Tensor) -> float:
    return scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])


class RingAttention(TileOp):
    """``F.scaled_dot_product_attention(q, K, V, scale=scale)`` of this rank's queries over
    the keys and values of every tile of group ``key`` (``lengths``: each rank's token count;
    ``scale`` None: ``1 / sqrt(E)``, as SDPA). Messages: ``tag`` forward, ``tag + 1``
    backward."""

    def __init__(self, key: str, lengths: Sequence[int], scale: float | None = None,
                 tag: int = RING_TAG) -> None:
        super().__init__()
        self.key, self.lengths, self.scale, self.tag = key, tuple(lengths), scale, tag

    def emit_args(self) -> dict[str, Any]:
        """The constructor's arguments (fxpar.program.emit writes ``RingAttention(**these)``)."""
        return {"key": self.key, "lengths": self.lengths, "scale": self.scale, "tag": self.tag}

    def forward(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return torch.ops.fxpar.ring_attention(q, k, v, self.key, list(self.lengths),
                                              _scale(self.scale, q), self.tag)[0]

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
