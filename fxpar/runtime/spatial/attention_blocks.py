"""One block of exact attention over split keys (fxpar.runtime.spatial.attention): a block's
normalised output and log-sum-exp, the merge of blocks, and a block's share of the gradients.

A block is this rank's queries against one rank's keys and values. Its output ``o_j`` (the
softmax over its own keys only) and log-sum-exp ``lse_j`` merge exactly with the others::

    LSE = logaddexp_j lse_j        out = sum_j exp(lse_j - LSE) o_j

and a block's share of the gradients needs only the whole attention's ``out`` and ``LSE``
(flash attention's backward: ``p = exp(q k^T s + bias - LSE)``, ``D = rowsum(dO * out)``,
``ds = p * (dO v^T - D)``; ``dq = ds k s``, ``dk = ds^T q s``, ``dv = p^T dO``, and the bias's
gradient is ``ds`` itself). So a block can be computed by any kernel that returns (o_j, lse_j)
and by any backward that takes (out, LSE): on CPU that is torch's fused flash kernel
(``aten::_scaled_dot_product_flash_attention_for_cpu`` and its ``_backward``, the kernel
``F.scaled_dot_product_attention`` runs in one process; same schema from torch 2.11 on). It is
used when the inputs suit it (:func:`fusable`); otherwise, and always on CUDA, the block is
plain matmul and exp in the accumulation dtype (a fused CUDA block, e.g. the efficient-attention
kernel, is not used: it is untested here, as there is no GPU to check it on). The fused
backward returns no bias gradient, so a bias that needs one takes the plain backward.

Two of the kernel's corners are handled here: it wants one head size (E == Ev), 4-D inputs and
a 2-D or 4-D mask in q's dtype (inputs are viewed as (B, H, L, E), a bool mask becomes 0/-inf);
it crashes on an empty query or key set (those take the plain path); and a row whose mask is
-inf over the whole block comes back with ``lse_j = 0`` rather than -inf (set right here).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

_FUSED_DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)


def _aten(name: str) -> object | None:
    try:
        return getattr(torch.ops.aten, name)
    except (AttributeError, RuntimeError):  # an older torch without the op
        return None


_FLASH = _aten("_scaled_dot_product_flash_attention_for_cpu")
_FLASH_BACKWARD = _aten("_scaled_dot_product_flash_attention_for_cpu_backward")


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype attention accumulates in: float64 for float64 inputs, float32 otherwise."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def fusable(q: Tensor, k: Tensor, v: Tensor) -> bool:
    """Whether the fused CPU kernel can compute this block: CPU, one floating dtype it has, one
    head size, and no empty dimension."""
    return (_FLASH is not None and _FLASH_BACKWARD is not None
            and q.device.type == "cpu" and q.dtype in _FUSED_DTYPES
            and q.dtype == k.dtype == v.dtype and q.shape[-1] == v.shape[-1]
            and q.numel() > 0 and k.numel() > 0)


# -- the bias (SDPA's attn_mask) --------------------------------------------------------------
def float_bias(bias: Tensor | None, dtype: torch.dtype, ndim: int) -> Tensor | None:
    """``bias`` as an additive float bias in ``dtype`` with ``ndim`` dims (leading ones
    added), as SDPA reads its attn_mask: a bool mask (True: attend) becomes 0 / -inf."""
    if bias is None:
        return None
    if bias.dtype == torch.bool:
        bias = torch.zeros(bias.shape, dtype=dtype, device=bias.device).masked_fill(
            ~bias, -math.inf)
    return bias.to(dtype).reshape((1,) * (ndim - bias.dim()) + tuple(bias.shape))


def columns(bias: Tensor | None, offset: int, n: int) -> Tensor | None:
    """The bias of one block: key columns [offset, offset + n) (all of a bias broadcast over
    the keys)."""
    if bias is None or bias.shape[-1] == 1:
        return bias
    return bias.narrow(-1, offset, n)


def offsets(lengths: Sequence[int]) -> list[int]:
    """Each block's first key column: the lengths before it."""
    return [sum(lengths[:j]) for j in range(len(lengths))]


def _as4(t: Tensor, lead: Sequence[int]) -> Tensor:
    """(*lead, L, E) viewed as the kernel's (B, H, L, E) (its last two dims kept as they are:
    a size-1 dim broadcasts)."""
    if len(lead) <= 2:
        return t.reshape((1,) * (2 - len(lead)) + tuple(t.shape))
    return t.expand(*lead, *t.shape[-2:]).reshape(-1, lead[-1], *t.shape[-2:])


# -- forward ----------------------------------------------------------------------------------
def block(q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None, scale: float,
          fused: bool = True) -> tuple[Tensor, Tensor]:
    """One block's normalised output (..., Lq, Ev) and log-sum-exp (..., Lq), acc dtype; ``bias``
    from :func:`float_bias` in q's dtype, this block's columns; ``fused``: in the fused kernel
    where it applies (False: always the plain code). A row with no key to attend to gets
    output 0 and lse -inf, so that :func:`merge` gives it no weight."""
    acc = acc_dtype(q.dtype)
    if not k.shape[-2]:  # no keys in this block
        return (q.new_zeros((*q.shape[:-1], v.shape[-1]), dtype=acc),
                q.new_full(q.shape[:-1], -math.inf, dtype=acc))
    if not (fused and fusable(q, k, v)):
        qa = q.to(acc)
        s = torch.matmul(qa, k.to(acc).transpose(-1, -2)) * scale
        if bias is not None:
            s = s + bias.to(acc)
        m = s.amax(-1, keepdim=True).clamp_min(torch.finfo(acc).min)  # -inf rows: p = 0
        p = torch.exp(s - m)
        den = p.sum(-1, keepdim=True)
        out = torch.matmul(p, v.to(acc)) / den.clamp_min(torch.finfo(acc).tiny)
        return out, (m + torch.log(den)).squeeze(-1)
    lead = q.shape[:-2]
    mask = None if bias is None else _as4(bias, lead)
    o4, lse4 = _FLASH(_as4(q, lead), _as4(k, lead), _as4(v, lead), 0.0, False,  # type: ignore[operator]
                      attn_mask=mask, scale=scale)
    if mask is not None:  # the kernel's lse for a row masked out here is 0, not -inf
        lse4 = torch.where(mask.amax(-1) == -math.inf, -math.inf, lse4)
    return o4.reshape(q.shape[:-1] + v.shape[-1:]).to(acc), lse4.reshape(q.shape[:-1]).to(acc)


def merge(o: Tensor, lse: Tensor, ob: Tensor, lb: Tensor) -> tuple[Tensor, Tensor]:
    """The running (output, lse) with one more block's: exact by the lse (no weight for -inf)."""
    new = torch.logaddexp(lse, lb)
    top = new.clamp_min(torch.finfo(new.dtype).min)  # exp(-inf - top) = 0, never nan
    a, b = torch.exp(lse - top).unsqueeze(-1), torch.exp(lb - top).unsqueeze(-1)
    return o * a + ob * b, new


# -- backward ---------------------------------------------------------------------------------
@dataclass
class Rows:
    """This rank's query rows in one backward: the queries, the output's gradient ``g``, the
    whole attention's ``out`` (both in q's dtype) and ``lse`` (acc dtype); the acc-dtype forms
    the plain block needs are made once."""

    q: Tensor
    g: Tensor
    out: Tensor
    lse: Tensor
    scale: float

    @functools.cached_property
    def acc(self) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """(q, dO, D = rowsum(dO * out), lse with a trailing 1), acc dtype."""
        acc = acc_dtype(self.q.dtype)
        do = self.g.to(acc)
        d = (do * self.out.to(acc)).sum(-1, keepdim=True)
        return self.q.to(acc), do, d, self.lse.to(acc).unsqueeze(-1)


def block_grads(rows: Rows, k: Tensor, v: Tensor, bias: Tensor | None, want_ds: bool,
                fused: bool = True) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """One block's share of (dq, dk, dv) (acc dtype) and, if ``want_ds``, its ``ds`` (the
    softmax input's gradient, the bias's gradient over this block's columns); ``fused`` as
    for :func:`block`."""
    acc = acc_dtype(rows.q.dtype)
    if want_ds or not (fused and fusable(rows.q, k, v)):
        qa, do, d, lse = rows.acc
        s = torch.matmul(qa, k.to(acc).transpose(-1, -2)) * rows.scale
        if bias is not None:
            s = s + bias.to(acc)
        p = torch.exp(s - lse)
        ds = p * (torch.matmul(do, v.to(acc).transpose(-1, -2)) - d)
        return (torch.matmul(ds, k.to(acc)) * rows.scale,
                torch.matmul(ds.transpose(-1, -2), qa) * rows.scale,
                torch.matmul(p.transpose(-1, -2), do), ds if want_ds else None)
    lead = rows.q.shape[:-2]
    g4, out4 = _as4(rows.g.to(rows.q.dtype).contiguous(), lead), _as4(rows.out, lead)
    lse4 = _as4(rows.lse.to(acc).unsqueeze(-1), lead)[..., 0]
    dq, dk, dv = _FLASH_BACKWARD(  # type: ignore[operator]
        g4, _as4(rows.q, lead), _as4(k, lead), _as4(v, lead), out4, lse4, 0.0, False,
        attn_mask=None if bias is None else _as4(bias, lead), scale=rows.scale)
    return (dq.reshape(rows.q.shape).to(acc), dk.reshape(k.shape).to(acc),
            dv.reshape(v.shape).to(acc), None)
