"""The step between backward and the optimizer vs one process (run by tests/mpi/test_recipe.py):
gradient clipping by the whole model's norm (2, 1 and inf) and by value, a user hook
(``RankProgram.before_optimizer_step``) and accumulation over two global batches
(``train_step(accumulate=2)``), in float64 under SP2, SP4 square, SP2+PP2, SP2+DP2 and GEMS.

One program per plan trains :data:`RECIPE` (five calls, four optimizer steps, a new global batch
each call) while the reference does the same with ``torch.nn.utils.clip_grad_norm_`` /
``clip_grad_value_`` on the whole model and gradient accumulation over the chunks
(tests/helpers/equivalence.reference_step). After every call: the loss, every parameter and
BatchNorm buffer on every rank; after every optimizer step also every gradient (both GEMS
copies) and the total norm; at the end the optimizer's momentum buffers. The last case clips
each rank by its own norm instead and shows the check failing.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from helpers.equivalence import (
    RTOL64,
    assert_buffers,
    assert_same,
    atol64,
    collect_failures,
    reference_step,
)
from helpers.reference import Reference
from helpers.transparency import sgd, sub_comm
from torch import nn

import fxpar
from fxpar.program.rank import RankProgram

SHAPE = (4, 3, 16, 16)
INF = float("inf")


def _net() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.Conv2d(8, 8, 3, stride=2, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 5))


Op = tuple[Any, ...]
"""One thing a hook does: ("norm", max_norm, norm_type), ("value", fraction: clip by value at
that fraction of the largest |gradient|, found with an unclipping inf-norm), ("halve",): halve
the gradient of every weight (a user's own change, by parameter name)."""


class Call(NamedTuple):
    """One ``train_step`` call: its ``accumulate``, and what the hook does at its step."""

    accumulate: int = 1
    hook: tuple[Op, ...] = ()


RECIPE = (
    Call(1, (("norm", 0.05, 2.0),)),
    Call(1, (("value", 0.5), ("norm", 0.02, INF))),
    Call(1, (("halve",), ("norm", 0.05, 1.0))),
    Call(2, (("norm", 0.05, 2.0),)),  # the first call of a cycle of 2: no step
    Call(2, (("norm", 0.05, 2.0),)),
)
"""Every max_norm is below the gradients' norm (the reference asserts it): clipping happens."""


class Grads:
    """What a hook works on: the compiled program's clipping, or torch's on the whole model."""

    def __init__(self, named: Callable[[], Iterator[tuple[str, nn.Parameter]]],
                 norm: Callable[[float, float], float], value: Callable[[float], None]) -> None:
        self.named, self.norm, self.value = named, norm, value
        self.norms: list[float] = []
        """Every total norm the hooks computed, in order."""
        self.runs = 0

    def hook(self, ops: tuple[Op, ...], reference: bool) -> None:
        self.runs += 1
        for op in ops:
            if op[0] == "norm":
                total = self.norm(op[1], op[2])
                if reference:
                    assert total > op[1], f"no clipping: norm {total} <= max_norm {op[1]}"
                self.norms.append(total)
            elif op[0] == "value":
                largest = self.norm(INF, INF)  # no clipping: the coefficient clamps to 1
                self.norms.append(largest)
                self.value(op[1] * largest)
            else:
                with torch.no_grad():
                    for name, p in self.named():
                        if name.endswith("weight") and p.grad is not None:
                            p.grad.mul_(0.5)


def _torch_grads(ref: nn.Module) -> Grads:
    return Grads(ref.named_parameters,
                 lambda m, p: float(nn.utils.clip_grad_norm_(ref.parameters(), m, p)),
                 lambda v: nn.utils.clip_grad_value_(ref.parameters(), v))


def _program_grads(rp: RankProgram) -> Grads:
    return Grads(rp.named_parameters, lambda m, p: rp.clip_grad_norm_(m, p),
                 rp.clip_grad_value_)


def _batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(SHAPE, dtype=torch.float64, generator=g),
             torch.randint(0, 5, (SHAPE[0],), generator=g)) for _ in range(n)]


class Worst:
    """The largest |got - want| over a case's comparisons (printed by rank 0)."""

    def __init__(self) -> None:
        self.abs = 0.0

    def same(self, name: str, got: Any, want: Any, atol: float) -> None:
        if isinstance(got, torch.Tensor) and isinstance(want, torch.Tensor) and got.numel():
            self.abs = max(self.abs, float((got.detach() - want.detach()).abs().max()))
        elif isinstance(got, float) and isinstance(want, float):
            self.abs = max(self.abs, abs(got - want))
        assert_same(name, got, want, atol, RTOL64)


def check_recipe(plan: fxpar.Plan, what: str, recipe: tuple[Call, ...] = RECIPE) -> bool:
    """``recipe`` compiled with ``plan`` and on one process; everything compared (module doc).
    False on a rank that sat it out."""
    comm = sub_comm(plan.world_size)
    if comm is None:
        return False
    torch.manual_seed(0)
    model = _net().double()
    ref = copy.deepcopy(model)
    batches = _batches(len(recipe))
    chunks = plan.chunks()
    opt = sgd(ref.parameters())
    theirs = _torch_grads(ref)
    calls, done = [], 0
    for c, (x, y) in zip(recipe, batches, strict=True):
        hook = partial(lambda ops, _m: theirs.hook(ops, True), c.hook)
        calls.append(partial(reference_step, ref, opt, x, y, chunks, F.cross_entropy,
                             accumulate=c.accumulate, call=done, before_step=hook))
        done = (done + 1) % c.accumulate
    reference = Reference(comm, ref)
    reference.record(calls)  # on the last rank, while rank 0 traces for everyone
    program = fxpar.compile(model, plan, torch.empty(SHAPE, dtype=torch.float64, device="meta"),
                            optimizer=sgd, loss_fn=F.cross_entropy, comm=comm)
    rp = program.local(comm)
    ours = _program_grads(rp)
    worst = Worst()
    ref_params = dict(ref.named_parameters())
    steps = 0
    for i, (c, (x, y)) in enumerate(zip(recipe, batches, strict=True)):
        rp.before_optimizer_step[:] = [partial(lambda ops, _rp: ours.hook(ops, False), c.hook)]
        runs = ours.runs
        loss = rp.train_step(x, y, accumulate=c.accumulate)
        stepped = rp.accumulation.done == 0
        assert ours.runs == runs + stepped, f"call {i}: the hook ran {ours.runs - runs} times"
        tol = atol64(steps)
        worst.same(f"call {i} loss", loss, reference.step(i), tol)
        for name, p in rp.named_parameters():  # both GEMS copies, where a rank holds two
            if stepped:  # in a cycle's first call the gradients are this rank's share
                worst.same(f"call {i} grad of {name}", p.grad, ref_params[name].grad, tol)
            worst.same(f"call {i} {name}", p.detach(), ref_params[name].detach(), tol)
        assert_buffers(rp.state_dict(), ref, tol, RTOL64)
        if stepped:
            assert rp.grad_norm == ours.norms[-1], (rp.grad_norm, ours.norms)
        steps += stepped
    # the reference's norms and optimizer state, from the rank that trained it
    mine = comm.rank == reference.root
    momentum = {n: opt.state[p]["momentum_buffer"] for n, p in ref.named_parameters()} \
        if mine else None
    norms, momentum = comm.bcast_object((theirs.norms, momentum) if mine else None,
                                        root=reference.root)
    assert len(norms) == len(ours.norms), (norms, ours.norms)
    for j, (got, want) in enumerate(zip(ours.norms, norms, strict=True)):
        worst.same(f"total norm {j}", got, want, atol64(j))
    assert rp.optimizer is not None
    for name, p in rp.named_parameters():
        worst.same(f"momentum of {name}", rp.optimizer.state[p]["momentum_buffer"],
                   momentum[name], atol64(steps))
    largest = max(comm.allgather_object(worst.abs))
    if comm.rank == 0:
        print(f"recipe {what}: max |diff| {largest:.3e} over {len(recipe)} calls", flush=True)
    rp.close()
    return True


def P(**kw: Any) -> fxpar.Plan:  # noqa: N802
    return fxpar.Plan(**kw)


def case_recipe_sp2() -> None:
    check_recipe(P(spatial_parts=2), "SP2")


def case_recipe_sp4_square() -> None:
    check_recipe(P(spatial_parts=4, slice="square"), "SP4 square")


def case_recipe_sp2_pp2() -> None:
    check_recipe(P(stages=2, microbatches=2, spatial_parts=2), "SP2+PP2")


def case_recipe_sp2_dp2() -> None:
    check_recipe(P(spatial_parts=2, data_parallel=2), "SP2+DP2")


def case_recipe_gems() -> None:
    check_recipe(P(stages=2, gems=True), "GEMS")


@contextmanager
def per_rank_clipping() -> Iterator[None]:
    """The mistake the collective norm prevents: each rank clips its own parameters (every
    copy it holds) by their own norm."""
    original = RankProgram.clip_grad_norm_

    def local(self: RankProgram, max_norm: float, norm_type: float = 2.0) -> float:
        total = nn.utils.clip_grad_norm_(list(self.parameters()), max_norm, norm_type)
        self.grad_norm = float(total)
        return self.grad_norm

    RankProgram.clip_grad_norm_ = local  # type: ignore[method-assign]
    try:
        yield
    finally:
        RankProgram.clip_grad_norm_ = original  # type: ignore[method-assign]


def case_per_rank_clipping_is_caught() -> None:
    # where ranks hold different parameters: stages apart (SP2+PP2), and a rank holding one
    # stage in both GEMS copies (3 stages: rank 1), which counts it twice. (Under SP, DP and
    # 2-stage GEMS every rank holds the whole model once: its own norm is the model's.)
    for plan in (P(stages=2, microbatches=2, spatial_parts=2), P(stages=3, gems=True)):
        with collect_failures() as failures, per_rank_clipping():
            took_part = check_recipe(plan, "per-rank clipping (mutated)", RECIPE[:1])
        if not took_part:
            continue
        assert any(f.startswith("call 0 grad of ") for f in failures), failures[:3]
        assert any(f.startswith("total norm 0") for f in failures), failures[:3]


def case_sync_every_call_is_caught() -> None:
    # the gradient sum in every call of a cycle, not only its last: a gradient summed in the
    # first call is summed again, with the second call's, over every rank of its group
    original = RankProgram._sync

    def every_call(self: RankProgram) -> None:
        for sync in self.syncs:
            if not self.accumulation.last:
                sync.reset()  # armed as in a cycle's last call
            sync.grads()
            if self._merge_stats():
                sync.stats()

    RankProgram._sync = every_call  # type: ignore[method-assign]
    try:
        with collect_failures() as failures:
            took_part = check_recipe(P(spatial_parts=2, data_parallel=2),
                                     "sync in every call (mutated)", RECIPE[3:])
    finally:
        RankProgram._sync = original  # type: ignore[method-assign]
    if took_part:
        assert any(f.startswith("call 1 grad of ") for f in failures), failures[:3]
