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
``torch.library.opcheck``. Gather attention:
a class token and a few replicated queries, q's per-rank gradients summed over the group. And
the comparison catches a scale off by 1e-9 relative in every tensor it compares.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from helpers.equivalence import assert_same, collect_failures
from helpers.transparency import sub_comm

from fxpar.comm.mpi import Comm
from fxpar.runtime.spatial.attention import GatherAttention, RingAttention, ring_bytes
from fxpar.runtime.spatial.group import bound
from fxpar.runtime.spatial.tags import max_tag

KEY = "attn"
ATOL64, RTOL64 = 1e-13, 1e-11
"""float64: summing the blocks' terms in another order than SDPA does moves the last bits only
(measured on these cases: |diff| at most 1.8e-15, 2.4e-15 of the tensor's largest entry)."""
TOLERANCES = {torch.float64: (ATOL64, RTOL64), torch.float32: (2e-6, 2e-5),
              torch.bfloat16: (3e-2, 3e-2)}
"""(atol, rtol) per input dtype against the float64 reference of the same (rounded) inputs:
float32 and bfloat16 accumulate in float32 and round their outputs and gradients (measured:
|diff| at most 5.2e-7 in float32, 8.2e-3 in bfloat16)."""


def _parts(lead: Sequence[int], lq: Sequence[int], lk: Sequence[int], e: int, ev: int,
           seed: int) -> dict[str, list[torch.Tensor]]:
    """Every rank's q, k, v and upstream gradient g (float64), the same on every rank."""
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*lead, *shape, generator=gen, dtype=torch.float64)

    return {"q": [rand(n, e) for n in lq], "k": [rand(n, e) for n in lk],
            "v": [rand(n, ev) for n in lk], "g": [rand(n, ev) for n in lq]}


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
               scale: float | None) -> tuple[torch.Tensor, ...]:
    """SDPA's output and gradients of (q, k, v) for upstream gradient ``g`` (float64)."""
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, scale=scale)
    out.backward(g)
    return out.detach(), q.grad, k.grad, v.grad


def _run(op: str, comm: Comm, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
         g: torch.Tensor, lengths: Sequence[int], scale: float | None, tag: int = 6
         ) -> tuple[torch.Tensor, ...]:
    """The op on this rank's part, forward inside the binding and backward outside it (the
    autograd context binds the group again)."""
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    module = RingAttention(KEY, lengths, scale, tag) if op == "ring" else \
        GatherAttention(KEY, scale)
    with bound({KEY: comm}):
        out = module(q, k, v)
    out.backward(g.to(out.dtype))
    return out.detach(), q.grad, k.grad, v.grad


def _compare_ring(comm: Comm, lead: Sequence[int], lq: Sequence[int], lk: Sequence[int],
                  e: int = 4, ev: int = 5, dtype: torch.dtype = torch.float64,
                  scale: float | None = 0.7, perturb: float = 0.0, seed: int = 0) -> None:
    """Ring attention on rank r's (q, k, v) against SDPA of all queries over all keys."""
    r = comm.rank
    d = {name: [t.to(dtype) for t in ts]
         for name, ts in _parts(lead, lq, lk, e, ev, seed).items()}
    got = _run("ring", comm, d["q"][r], d["k"][r], d["v"][r], d["g"][r], lk,
               None if scale is None else scale * (1 + perturb))
    want = _reference(torch.cat(d["q"], -2), torch.cat(d["k"], -2), torch.cat(d["v"], -2),
                      torch.cat(d["g"], -2).double(), scale)
    q0, k0 = sum(lq[:r]), sum(lk[:r])
    mine = (want[0].narrow(-2, q0, lq[r]), want[1].narrow(-2, q0, lq[r]),
            want[2].narrow(-2, k0, lk[r]), want[3].narrow(-2, k0, lk[r]))
    atol, rtol = TOLERANCES[dtype]
    for name, a, b in zip(("output", "grad q", "grad k", "grad v"), got, mine, strict=True):
        assert a.dtype == dtype, (name, a.dtype)
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
    out, dq, dk, dv = _run("gather", comm, q, d["k"][r], d["v"][r], d["g"][r], lk,
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
    for module in (m, GatherAttention(KEY, 0.5)):
        graph = str(torch.export.export(module, (q, k, v), strict=False).graph)
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
        for op, args in ((ops.ring_attention.default, (q, k, v, KEY, lk, 0.5, 6)),
                         (ops.ring_attention_grad.default, (g, *saved, KEY, lk, 0.5, 7)),
                         (ops.gather_attention.default, (q, k, v, KEY, 0.5))):
            got = torch.library.opcheck(op, args)
            assert set(got.values()) == {"SUCCESS"}, (op, got)
        try:  # lengths that do not match the tiles: refused on every rank before any message
            ops.ring_attention(q, k, v, KEY, lk[::-1], 0.5, 6)
        except ValueError as e:
            assert "must give every rank's key count in a group of 2" in str(e), e
        else:
            raise AssertionError("ring_attention took lengths that do not match the tiles")


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
