"""Exact attention over the tokens of a tile group (fxpar.runtime.spatial.attention) against
``F.scaled_dot_product_attention`` on the whole sequence in one process (run by
tests/mpi/test_attention.py, one launch of 4 ranks; each case takes the first P).

Every rank makes every rank's queries, keys, values and upstream gradients from one seed, runs
the op on its own part over a sub-communicator of P ranks, and computes the reference on the
concatenation itself (float64, autograd through SDPA): the output and the gradients of q, k and
v are compared element by element (tests/helpers/equivalence.assert_same). Ring attention: P =
1 to 4, even and uneven tiles (7 tokens over 3 ranks, a rank holding one token or none), 2-D to
4-D inputs (N, heads, L, d), Lq != Lk and E != Ev, float32 and bfloat16 with the float64
reference, the module and its tags, the fake kernels under ``torch.export`` and
``torch.library.opcheck``; with E == Ev on CPU each block runs in torch's fused kernel
(fxpar.runtime.spatial.attention_blocks), with E != Ev in the plain block code. With a bias
(SDPA's attn_mask over the concatenated keys): a float bias that needs its gradient (compared
too), one broadcast over the batch (heads, Lq, Lk), one that needs none (the fused backward
with a mask) and a bool mask with rows masked out of whole blocks, for P = 2 to 4. Gather
attention: a class token and a few replicated queries, q's per-rank gradients summed over the
group. And the comparison catches a scale off by 1e-9 relative in every tensor it compares,
and a bias whose columns are one block off.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
import torch.nn.functional as F
from helpers.equivalence import assert_same, collect_failures
from helpers.transparency import sub_comm

from fxpar.comm.mpi import Comm
from fxpar.runtime.spatial import attention_blocks
from fxpar.runtime.spatial.attention import GatherAttention, RingAttention, ring_bytes
from fxpar.runtime.spatial.group import bound
from fxpar.runtime.spatial.tags import max_tag

KEY = "attn"
ATOL64, RTOL64 = 1e-13, 1e-11
"""float64: summing the blocks' terms in another order than SDPA does moves the last bits only
(measured on these cases: |diff| at most 6.8e-15, 2.4e-15 of the tensor's largest entry)."""
TOLERANCES = {torch.float64: (ATOL64, RTOL64), torch.float32: (2e-6, 2e-5),
              torch.bfloat16: (3e-2, 3e-2)}
"""(atol, rtol) per input dtype against the float64 reference of the same (rounded) inputs:
float32 and bfloat16 accumulate in float32 and round their outputs and gradients, the fused
kernel each block's too (measured: |diff| at most 2.0e-6, 1e-6 of the tensor's largest entry,
in float32; 1.4e-2 in bfloat16)."""


def _parts(lead: Sequence[int], lq: Sequence[int], lk: Sequence[int], e: int, ev: int,
           seed: int) -> dict[str, list[torch.Tensor]]:
    """Every rank's q, k, v and upstream gradient g (float64), the same on every rank."""
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*lead, *shape, generator=gen, dtype=torch.float64)

    return {"q": [rand(n, e) for n in lq], "k": [rand(n, e) for n in lk],
            "v": [rand(n, ev) for n in lk], "g": [rand(n, ev) for n in lq]}


def _bias(lead: Sequence[int], lq: int, lk: Sequence[int], bool_mask: bool,
          seed: int) -> torch.Tensor:
    """A bias over all queries and keys (*lead, lq, sum(lk)): float64, or a bool mask that
    masks some rows out of whole blocks (never out of all: every row sees the last key)."""
    gen = torch.Generator().manual_seed(seed + 1000)
    if not bool_mask:
        return torch.randn(*lead, lq, sum(lk), generator=gen, dtype=torch.float64)
    mask = torch.rand(*lead, lq, sum(lk), generator=gen) > 0.5
    mask[..., -1] = True
    mask[..., ::2, : sum(lk) - 1] = False  # even rows: only the last key
    return mask


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
               scale: float | None, bias: torch.Tensor | None = None
               ) -> tuple[torch.Tensor | None, ...]:
    """SDPA's output and gradients of (q, k, v) and of a float ``bias`` (else None) for upstream
    gradient ``g`` (float64)."""
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    if bias is not None and bias.is_floating_point():
        bias = bias.detach().double().requires_grad_()
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scale)
    out.backward(g)
    return out.detach(), q.grad, k.grad, v.grad, None if bias is None else bias.grad


def _run(op: str, comm: Comm, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
         g: torch.Tensor, lengths: Sequence[int], scale: float | None, tag: int = 6,
         bias: torch.Tensor | None = None, bias_grad: bool = True
         ) -> tuple[torch.Tensor | None, ...]:
    """The op on this rank's part, forward inside the binding and backward outside it (the
    autograd context binds the group again). Returns (out, dq, dk, dv, d bias or None)."""
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    if bias is not None:
        bias = bias.detach().clone().requires_grad_(bias_grad and bias.is_floating_point())
    with bound({KEY: comm}):
        if op == "ring":
            out = RingAttention(KEY, lengths, scale, tag)(q, k, v, bias)
        else:
            out = GatherAttention(KEY, scale)(q, k, v)
    out.backward(g.to(out.dtype))
    return out.detach(), q.grad, k.grad, v.grad, None if bias is None else bias.grad


def _compare_ring(comm: Comm, lead: Sequence[int], lq: Sequence[int], lk: Sequence[int],
                  e: int = 4, ev: int = 5, dtype: torch.dtype = torch.float64,
                  scale: float | None = 0.7, perturb: float = 0.0, seed: int = 0,
                  bias: Sequence[int] | None = None, bool_mask: bool = False,
                  bias_grad: bool = True, bias_shift: int = 0) -> None:
    """Ring attention on rank r's (q, k, v) against SDPA of all queries over all keys. With
    ``bias`` (its leading dims, broadcast against ``lead``): SDPA's attn_mask of shape
    (*bias, sum(lq), sum(lk)), rank r given its query rows; ``bias_shift``: the columns the
    op is given are rolled by that many (a wrong bias, for the harness test)."""
    r = comm.rank
    d = {name: [t.to(dtype) for t in ts]
         for name, ts in _parts(lead, lq, lk, e, ev, seed).items()}
    q0, k0 = sum(lq[:r]), sum(lk[:r])
    whole = None if bias is None else _bias(bias, sum(lq), lk, bool_mask, seed)
    if whole is not None and whole.is_floating_point():
        whole = whole.to(dtype)  # the op reads it in q's dtype, as SDPA would
    mine_bias = None if whole is None else whole.narrow(-2, q0, lq[r]).roll(bias_shift, -1)
    got = _run("ring", comm, d["q"][r], d["k"][r], d["v"][r], d["g"][r], lk,
               None if scale is None else scale * (1 + perturb), bias=mine_bias,
               bias_grad=bias_grad)
    want = _reference(torch.cat(d["q"], -2), torch.cat(d["k"], -2), torch.cat(d["v"], -2),
                      torch.cat(d["g"], -2).double(), scale, whole)
    mine = (want[0].narrow(-2, q0, lq[r]), want[1].narrow(-2, q0, lq[r]),
            want[2].narrow(-2, k0, lk[r]), want[3].narrow(-2, k0, lk[r]),
            None if want[4] is None or not bias_grad else want[4].narrow(-2, q0, lq[r]))
    atol, rtol = TOLERANCES[dtype]
    names = ("output", "grad q", "grad k", "grad v", "grad bias")
    for name, a, b in zip(names, got, mine, strict=True):
        assert a is None or a.dtype == dtype, (name, a.dtype)
        if name == "grad bias" and a is not None:  # rolled back: the columns it belongs to
            a = a.roll(-bias_shift, -1)
        assert_same(f"ring P={comm.size} {dtype} rank {r}: {name}", a, b, atol, rtol)


def _compare_gather(comm: Comm, lead: Sequence[int], lq: int, lk: Sequence[int], e: int = 4,
                    ev: int = 3, dtype: torch.dtype = torch.float64, scale: float | None = 0.7,
                    perturb: float = 0.0, seed: int = 1) -> None:
    """Gather attention: replicated q (the same on every rank), tiled k and v, a different
    upstream gradient on each rank (its part: the whole is their sum)."""
    r = comm.rank
    d = {name: [t.to(dtype) for t in ts]
         for name, ts in _parts(lead, [lq] * comm.size, lk, e, ev, seed).items()}
    q = d["q"][0]
    out, dq, dk, dv, _ = _run("gather", comm, q, d["k"][r], d["v"][r], d["g"][r], lk,
                           None if scale is None else scale * (1 + perturb))
    dq_all = comm.allreduce(dq.double().contiguous())  # the parts sum to q's gradient
    want = _reference(q, torch.cat(d["k"], -2), torch.cat(d["v"], -2),
                      torch.stack([g.double() for g in d["g"]]).sum(0), scale)
    k0 = sum(lk[:r])
    mine = (want[0], want[1], want[2].narrow(-2, k0, lk[r]), want[3].narrow(-2, k0, lk[r]))
    atol, rtol = TOLERANCES[dtype]
    for name, a, b in zip(("output", "grad q summed", "grad k", "grad v"),
                          (out, dq_all, dk, dv), mine, strict=True):
        assert_same(f"gather P={comm.size} {dtype} rank {r}: {name}", a, b, atol, rtol)


# -- ring attention ---------------------------------------------------------------------------
def case_ring_one_rank() -> None:
    if (comm := sub_comm(1)) is not None:
        _compare_ring(comm, (2,), [5], [6])


def case_ring_two_ranks_multihead() -> None:
    """(N, heads, L, d) with the queries of the keys' own tiles, and Lq != Lk per rank."""
    if (comm := sub_comm(2)) is not None:
        _compare_ring(comm, (2, 3), [4, 4], [4, 4], e=8, ev=8, scale=None)
        _compare_ring(comm, (2, 3), [3, 6], [5, 2], seed=2)


def case_ring_three_ranks_seven_tokens() -> None:
    """7 tokens over 3 ranks as fxpar tiles them ([2, 2, 3]), and a rank holding one."""
    if (comm := sub_comm(3)) is not None:
        _compare_ring(comm, (2, 2), [2, 2, 3], [2, 2, 3], seed=3)
        _compare_ring(comm, (1,), [5, 1, 1], [5, 1, 1], seed=4)
        _compare_ring(comm, (), [1, 4, 2], [3, 3, 1], e=6, ev=2, seed=5)  # no leading dims


def case_ring_four_ranks_uneven_and_empty() -> None:
    """A rank with no keys (and one with no queries) still forwards the others' blocks."""
    if (comm := sub_comm(4)) is not None:
        _compare_ring(comm, (2, 2), [3, 3, 3, 3], [3, 3, 3, 3], seed=6)
        _compare_ring(comm, (2, 3), [4, 2, 1, 3], [5, 1, 0, 3], seed=7)
        _compare_ring(comm, (2,), [4, 0, 1, 3], [2, 6, 1, 1], seed=8)


def case_ring_float32_and_bfloat16() -> None:
    if (comm := sub_comm(4)) is not None:
        _compare_ring(comm, (2, 2), [5, 3, 4, 2], [4, 6, 1, 3], dtype=torch.float32, seed=9)
        _compare_ring(comm, (2, 2), [5, 3, 4, 2], [4, 6, 1, 3], dtype=torch.bfloat16, seed=9)
    if (comm := sub_comm(3)) is not None:
        _compare_ring(comm, (3,), [3, 3, 2], [7, 1, 2], e=16, ev=16, dtype=torch.float32,
                      scale=None, seed=10)


def case_ring_module_tags_and_fake_kernels() -> None:
    """The module's arguments, repr and tags; the ops' fake kernels under torch.export (no
    communicator bound: nothing is sent); the bytes a rank sends."""
    m = RingAttention(KEY, (3, 3, 1), 0.5, tag=40)
    assert RingAttention(**m.emit_args()).extra_repr() == m.extra_repr()
    assert "7 tokens on a ring of 3 tiles [3, 3, 1]" in m.extra_repr(), m.extra_repr()
    assert max_tag(m) == 41
    q, k, v = torch.randn(2, 4, 8), torch.randn(2, 3, 8), torch.randn(2, 3, 6)
    for module, args in ((m, (q, k, v)), (GatherAttention(KEY, 0.5), (q, k, v)),
                         (m, (q, k, v, torch.randn(4, 7)))):  # a bias over the 7 keys
        graph = str(torch.export.export(module, args, strict=False).graph)
        assert "fxpar" in graph, graph
    # P = 3, tiles [3, 3, 1]: rank 0 sends its block and rank 2's, never rank 1's
    assert ring_bytes([3, 3, 1], 0, 2, 8, 6, torch.float64) == (2 * 14 * 8 * 4,
                                                               2 * 14 * 8 * 4 + 2 * 14 * 8 * 7)
    assert ring_bytes([3, 3, 1], 1, 2, 8, 6, torch.bfloat16) == (2 * 14 * 2 * 6,
                                                                2 * 14 * 2 * 6 + 2 * 14 * 4 * 7)
    assert ring_bytes([5], 0, 2, 8, 6, torch.float32) == (0, 0)


def case_ops_pass_opcheck() -> None:
    """torch.library.opcheck on 2 ranks: schemas, fake kernels against the real outputs,
    autograd registration, AOTAutograd (every rank makes the same calls in the same order)."""
    if (comm := sub_comm(2)) is None:
        return
    lk = [3, 5]
    gen = torch.Generator().manual_seed(50 + comm.rank)
    q, k, v = (torch.randn(2, 2, n, 4, generator=gen, dtype=torch.float64, requires_grad=True)
               for n in (4, lk[comm.rank], lk[comm.rank]))
    ops = torch.ops.fxpar
    with bound({KEY: comm}):
        out, lse = ops.ring_attention(q, k, v, KEY, lk, 0.5, 6)
        g = torch.randn(out.shape, generator=gen, dtype=torch.float64)
        saved = (q.detach(), k.detach(), v.detach(), out.detach(), lse)
        bias = torch.randn(2, 1, 4, sum(lk), generator=gen, dtype=torch.float64,
                           requires_grad=True)
        mask = torch.rand(4, sum(lk), generator=gen) > 0.3
        for op, args in ((ops.ring_attention.default, (q, k, v, KEY, lk, 0.5, 6)),
                         (ops.ring_attention_grad.default, (g, *saved, KEY, lk, 0.5, 7)),
                         (ops.ring_attention.default, (q, k, v, KEY, lk, 0.5, 6, bias)),
                         (ops.ring_attention.default, (q, k, v, KEY, lk, 0.5, 6, mask)),
                         (ops.ring_attention_grad.default,
                          (g, *saved, KEY, lk, 0.5, 7, bias.detach(), True)),
                         (ops.gather_attention.default, (q, k, v, KEY, 0.5))):
            got = torch.library.opcheck(op, args)
            assert set(got.values()) == {"SUCCESS"}, (op, got)
        try:  # lengths that do not match the tiles: refused on every rank before any message
            ops.ring_attention(q, k, v, KEY, lk[::-1], 0.5, 6)
        except ValueError as e:
            assert "must give every rank's key count in a group of 2" in str(e), e
        else:
            raise AssertionError("ring_attention took lengths that do not match the tiles")
        try:  # a bias over this rank's keys only
            ops.ring_attention(q, k, v, KEY, lk, 0.5, 6, bias[..., : lk[comm.rank]])
        except ValueError as e:
            assert "every rank's keys, concatenated in rank order" in str(e), e
        else:
            raise AssertionError("ring_attention took a bias over this rank's keys only")


# -- ring attention with a bias (SDPA's attn_mask over the concatenated keys) ----------------
def case_ring_bias_with_grad() -> None:
    """A float bias that needs its gradient (MaxViT's relative-position bias), per batch and
    head or broadcast over the batch (heads, Lq, Lk) or over all leading dims, uneven tiles and
    a rank with no keys, P = 2 to 4: E == Ev runs the fused forward and the plain backward
    (the fused one gives no bias gradient), E != Ev the plain block both ways."""
    if (comm := sub_comm(2)) is not None:
        _compare_ring(comm, (2, 3), [4, 4], [4, 4], e=8, ev=8, bias=(2, 3), seed=60)
        _compare_ring(comm, (2, 3), [3, 6], [5, 2], bias=(3,), seed=61)
    if (comm := sub_comm(3)) is not None:
        _compare_ring(comm, (2, 2), [2, 2, 3], [2, 2, 3], e=4, ev=4, bias=(2,), seed=62)
        _compare_ring(comm, (), [1, 4, 2], [3, 3, 1], e=6, ev=6, bias=(), seed=63)
    if (comm := sub_comm(4)) is not None:
        _compare_ring(comm, (2, 3), [4, 2, 1, 3], [5, 1, 0, 3], e=4, ev=4, bias=(3,), seed=64)
        for dtype in (torch.float32, torch.bfloat16):
            _compare_ring(comm, (2, 2), [5, 3, 4, 2], [4, 6, 1, 3], e=8, ev=8, bias=(2,),
                          dtype=dtype, seed=65)


@contextlib.contextmanager
def _blocks_fused(fused: bool) -> Iterator[None]:
    """The ring's blocks in the fused kernel where it applies (as always), or (False) in the
    plain block code: the kernel is declared unfit for every block meanwhile."""
    original = attention_blocks.fusable
    if not fused:
        attention_blocks.fusable = lambda *args: False  # type: ignore[assignment]
    try:
        yield
    finally:
        attention_blocks.fusable = original


def case_ring_bias_without_grad_and_bool_mask() -> None:
    """A float bias that needs no gradient (the fused backward, given the mask) and a bool mask
    (True: attend; some rows masked out of whole blocks), P = 2 to 4, float64 and float32; and
    the same in the plain block code."""
    for n, lq, lk in ((2, [3, 6], [5, 2]), (3, [2, 2, 3], [2, 2, 3]),
                      (4, [4, 2, 1, 3], [5, 1, 0, 3])):
        if (comm := sub_comm(n)) is None:
            continue
        for fused in (True, False):
            with _blocks_fused(fused):
                _compare_ring(comm, (2, 2), lq, lk, e=4, ev=4, bias=(2,), bias_grad=False,
                              seed=70 + n)
                _compare_ring(comm, (2, 2), lq, lk, e=4, ev=4, bias=(2, 2), bool_mask=True,
                              seed=74 + n)
        _compare_ring(comm, (2,), lq, lk, e=4, ev=4, bias=(), bool_mask=True,
                      dtype=torch.float32, seed=78 + n)


# -- gather attention -------------------------------------------------------------------------
def case_gather_class_token() -> None:
    """One replicated query (a class token) over the tiles' tokens, for P = 2, 3, 4."""
    for n, lk in ((2, [5, 4]), (3, [2, 2, 3]), (4, [6, 1, 0, 2])):
        if (comm := sub_comm(n)) is not None:
            _compare_gather(comm, (2, 3), 1, lk, seed=20 + n)


def case_gather_queries_float32() -> None:
    if (comm := sub_comm(3)) is not None:
        _compare_gather(comm, (2,), 4, [3, 1, 5], e=5, ev=7, scale=None, seed=30)
        _compare_gather(comm, (2, 2), 3, [4, 2, 3], dtype=torch.float32, seed=31)


# -- the comparison catches a small error -----------------------------------------------------
def case_scale_off_by_1e9_is_caught() -> None:
    """The same comparisons with the ops' scale moved by 1e-9 relative: every tensor compared
    (output, grad q, grad k, grad v) fails, on every rank, for both ops."""
    if (comm := sub_comm(3)) is None:
        return
    for what, compare in (("ring", lambda: _compare_ring(comm, (2, 2), [3, 2, 2], [2, 4, 1],
                                                         perturb=1e-9, seed=40)),
                          ("gather", lambda: _compare_gather(comm, (2,), 2, [3, 1, 4],
                                                             perturb=1e-9, seed=41))):
        with collect_failures() as failures:
            compare()
        named = {f.split(":")[1].split(" elements")[0].strip() for f in failures}
        assert len(failures) == 4, (what, failures)
        assert all(" differ; worst at index " in f for f in failures), failures
        assert len(named) == 4, named


def case_bias_one_block_off_is_caught() -> None:
    """The op given the bias with its columns one block off (rank r's block read as rank
    r + 1's): every tensor compared (output, the gradients of q, k, v and the bias) fails on
    every rank."""
    if (comm := sub_comm(3)) is None:
        return
    with collect_failures() as failures:
        _compare_ring(comm, (2, 2), [3, 3, 3], [3, 3, 3], e=4, ev=4, bias=(2, 2),
                      bias_shift=3, seed=80)
    named = {f.split(":")[1].split(" elements")[0].strip() for f in failures}
    assert len(failures) == 5 and len(named) == 5, failures
