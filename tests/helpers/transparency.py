"""The transparency check every MPI case uses: a compiled program vs plain PyTorch, on every
rank, in float64 — loss, every gradient, parameters after each optimizer step, BN buffers."""

from __future__ import annotations

import copy
import os
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch import nn

import fxpar
from fxpar.comm.mpi import Comm
from fxpar.comm.world import world
from fxpar.core.options import setting
from fxpar.passes.spatial_region import Coverage
from helpers.equivalence import (
    ATOL64_LATER,
    RTOL64,
    RTOL64_EVAL,
    assert_buffers,
    assert_same,
    atol64,
)
from helpers.reference import Reference

DEVICE = os.environ.get("FXPAR_TEST_DEVICE", "cpu")
"""Where compiled and reference models train (tests/mpi/test_gpu.py sets cuda)."""


@dataclass(frozen=True)
class Case:
    """One model + input shape + plan to check."""

    build: Callable[[], nn.Module]
    shape: tuple[int, ...]
    plan: fxpar.Plan
    classes: int = 5
    segmentation: bool = False
    steps: int = 2
    loss: Callable | None = None
    """The loss both sides train with (default ``F.cross_entropy``)."""
    targets: Callable[[torch.Generator], object] | None = None
    """The global batch's targets from a generator (default: class labels, per pixel for
    ``segmentation``); a tuple of tensors is passed to the loss as several arguments."""
    reference_mode: Callable[[], AbstractContextManager] = nullcontext
    """What the one-process reference trains under (tests/helpers/torchbugs.py: a torch bug's fix,
    where the case shows fxpar right and torch wrong)."""


def sgd(params):
    return torch.optim.SGD(params, lr=0.02, momentum=0.9, weight_decay=1e-4)


def sub_comm(n: int) -> Comm | None:
    """A communicator of the first ``n`` ranks (None on the others, which sit this case out)."""
    w = world()
    sub = w.split(0 if w.rank < n else 1)
    return sub if w.rank < n else None


CAPTURES = fxpar.CaptureCache(setting("capture_cache") or None)
"""One per process, that is per launch of cases: a case whose model has the structure of an
earlier case's (the same classes, settings and tensor shapes) at the same input shape compiles
from that case's capture, as ranks of one job do from rank 0's; with ``FXPAR_CAPTURE_CACHE``
(tests/streams.py sets it for the MPI streams) also from a capture an earlier launch of the run
kept there. A wrong match could only make a comparison fail, never pass: the reference is the
eager model, which no capture touches."""


def check(case: Case, atol: float | None = None, rtol: float = RTOL64
          ) -> fxpar.RankProgram | None:
    """Train ``case`` compiled and plain for ``case.steps`` steps and compare everything.

    Tolerances are float64 ones, element-wise (tests/helpers/equivalence.py): summing the same
    terms in another order (gradients of a tensor used by two stages, per-chunk accumulation) moves
    the last bits, and BatchNorm on tiny micro-batches amplifies that over steps, so the first
    step is compared with ``ATOL64`` and everything after it with ``ATOL64_LATER`` (``atol``,
    when given, for all), the eval forward after training with ``RTOL64_EVAL``; a missing or
    doubled term shows up as O(|value|) in the element it touches."""
    comm = sub_comm(case.plan.world_size)
    if comm is None:
        return None
    torch.manual_seed(0)
    model = case.build().double()
    ref = copy.deepcopy(model)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(case.shape, dtype=torch.float64, generator=g)
    n = case.shape[0]
    if case.targets is not None:
        y = case.targets(g)
    elif case.segmentation:
        y = torch.randint(0, case.classes, (n, *case.shape[2:]), generator=g)
    else:
        y = torch.randint(0, case.classes, (n,), generator=g)
    loss_fn = case.loss or F.cross_entropy
    dev = torch.device("cpu")
    if DEVICE != "cpu":
        from fxpar.comm.device import bind

        dev = bind(None, DEVICE)  # GPU by the launcher's node-local rank
        ref.to(dev)
        x = x.to(dev)
        y = tuple(t.to(dev) for t in y) if isinstance(y, tuple) else y.to(dev)
    # the last rank trains the reference while rank 0 traces the model for every rank
    reference = Reference(comm, ref)
    reference.train(case.steps, sgd(ref.parameters()), x, y, case.plan.chunks(), loss_fn,
                    case.reference_mode)
    program = fxpar.compile(model, case.plan, torch.empty(case.shape, dtype=torch.float64,
                                                          device="meta"), optimizer=sgd,
                            loss_fn=loss_fn, comm=comm,  # rank 0 traces for every rank
                            captures=CAPTURES)
    rp = program.local(comm)
    if DEVICE != "cpu":
        rp.to(dev)
    ref_params = dict(ref.named_parameters())
    for step in range(case.steps):
        loss = rp.train_step(x, y)
        ref_loss = reference.step(step)
        tol = (atol64(step) if atol is None else atol, rtol)
        assert_same(f"step {step} loss", loss, ref_loss, *tol)
        for name, p in rp.named_parameters():  # both GEMS copies, where a rank holds two
            assert_same(f"step {step} grad of {name}", p.grad, ref_params[name].grad, *tol)
            assert_same(f"step {step} {name}", p.detach(), ref_params[name].detach(), *tol)
        assert_buffers(rp.state_dict(), ref, *tol)
    tol = (ATOL64_LATER if atol is None else atol, rtol)
    # every parameter lives on the ranks of exactly one stage (each tile of a spatial stage
    # holds the stage's parameters; otherwise one rank)
    owned = comm.allgather_object(sorted(dict(rp.named_parameters())))
    flat = [name for names in owned for name in names]
    assert set(flat) == set(ref_params), "parameters lost across ranks"
    plan = case.plan
    if not plan.spatial and not plan.gems and plan.data_parallel == 1:
        assert len(flat) == len(ref_params), "parameters duplicated across ranks"
    full = rp.full_state_dict()
    if comm.rank == 0:
        assert full is not None and list(full) == list(ref.state_dict())
        for k, v in ref.state_dict().items():
            assert_same(f"full_state_dict[{k}]", full[k], v, *tol)
    rp.eval()
    ref.eval()
    out = rp.forward(x)
    if out is not None:
        assert_tree("eval forward", out, ref(x), tol[0], max(rtol, RTOL64_EVAL))
    assert any(comm.allgather_object(out is not None)), "no rank returned the eval output"
    return rp


def assert_tree(name: str, got: object, want: object, atol: float, rtol: float) -> None:
    """``got`` has ``want``'s structure (a tensor, or tuples, lists, dicts, NamedTuples,
    dataclasses of tensors: the same types and keys) and every leaf equals (assert_same)."""
    got_leaves, got_spec = pytree.tree_flatten_with_path(got)
    want_leaves, want_spec = pytree.tree_flatten_with_path(want)
    assert got_spec == want_spec, f"{name}: structure {got_spec} != {want_spec}"
    for (path, g), (_, w) in zip(got_leaves, want_leaves, strict=True):
        assert_same(f"{name}{pytree.keystr(path)}", g, w, atol, rtol)


def assert_covers(rp: fxpar.RankProgram | None, what: str, least: float = 0.95) -> None:
    """The spatial region of ``rp``'s plan spreads at least ``least`` of the forward FLOPs on
    image tensors (rank 0 prints the share); nothing for a rank that sat the case out or a
    plan with no spatial stage."""
    if rp is None or not rp.plan.spatial:
        return
    cov = rp.program.traced.meta[Coverage.KEY]
    if rp.rank == 0:
        print(f"coverage {what}: {cov.share:.4f} ({cov.ended or 'whole model'})", flush=True)
    assert cov.share >= least, f"{what}: coverage {cov.share:.1%}: {cov.ended}"

