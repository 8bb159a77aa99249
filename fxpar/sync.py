"""Gradient and BatchNorm-statistics synchronisation over each stage group.

A *stage group* is every rank that holds one stage: its tiles, both GEMS copies, every
data-parallel replica (passes.mirror.stage_groups). Gradients are summed over it (each part
already carries its 1/chunks share of the loss), so every copy applies the same update.

Overlap: parameters are cut into buckets of about ``BUCKET_BYTES`` in reverse order (the order
backward produces them). A post-accumulate-grad hook counts each parameter's accumulations;
once every parameter of a bucket has received its last one of the step (one per micro-batch
of each copy on this rank), the bucket's sum starts (nonblocking allreduce) while backward goes
on. Buckets start strictly in index order, so every rank issues the same collectives in the
same order; the ALLREDUCE action waits for them (and starts any that never filled, e.g. with
unused parameters).

BatchNorm running statistics: one device would update them once per chunk, in chunk order
(the reference is gradient accumulation over the chunks). A copy that ran chunks
[j0, j0 + m) of K starting from r0 holds r = a^m r0 + delta with a = 1 - momentum; the reference
is a^K r0 + sum over copies of a^(K - j0 - m) delta. Each stage group sums the weighted deltas
(one allreduce) and every copy takes the result.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn

from fxpar.capture import BatchNormOp
from fxpar.comm import Comm
from fxpar.spatial.ops import TileBatchNorm


def _grad(p: nn.Parameter) -> torch.Tensor:
    return p.grad if p.grad is not None else torch.zeros_like(p)


def _total(slot: tuple[nn.Parameter, ...]) -> torch.Tensor:
    """The sum of one parameter's gradients over this rank's copies of the stage (the
    gradient itself, not a copy, when there is one copy)."""
    if len(slot) == 1:
        return _grad(slot[0])
    total = _grad(slot[0]) + _grad(slot[1])
    for p in slot[2:]:
        total += _grad(p)
    return total


@dataclass(frozen=True)
class RunningStats:
    """One batch norm's running statistics (the tensors themselves) and its momentum."""

    running_mean: torch.Tensor
    running_var: torch.Tensor
    num_batches_tracked: torch.Tensor | None
    momentum: float | None


def running_stats(module: nn.Module) -> list[tuple[str, RunningStats]]:
    """The batch norms of ``module`` that keep running statistics, by name: BatchNorm layers
    of a module-level graph, and the BatchNormOp / TileBatchNorm calls of a captured one
    (named after the owner of their buffers, ``layer1.0.bn1``, each once)."""
    out = [(n, RunningStats(b.running_mean, b.running_var, b.num_batches_tracked, b.momentum))
           for n, b in module.named_modules()
           if isinstance(b, nn.modules.batchnorm._BatchNorm) and b.track_running_stats
           and b.running_mean is not None]
    named = dict(out)
    for m in module.modules():  # a tile module may keep its stage's BatchNormOp unused
        if isinstance(m, (BatchNormOp, TileBatchNorm)) and m.owner and m.owner not in named:
            owner = module.get_submodule(m.owner)
            named[m.owner] = RunningStats(owner.running_mean, owner.running_var,
                                          getattr(owner, "num_batches_tracked", None),
                                          m.momentum)
    return list(named.items())


@dataclass
class Member:
    """One copy of a stage on this rank."""

    module: fx.GraphModule
    first: int
    """Index of the first chunk this copy trains on."""
    count: int
    """Chunks it trains on per step."""
    counts_stats: bool
    """This copy's BatchNorm statistics are added in (tile 0 only: the tiles of one copy hold
    the same global statistics)."""


BUCKET_BYTES = 4 * 2**20

# id(parameter) -> (its newest StageSync, slot); entries leave with their parameter. (Keyed
# by id: tensors compare elementwise, so they cannot be dictionary keys.)
_ROUTE: dict[int, tuple[StageSync, int]] = {}


def _route(p: nn.Parameter) -> None:
    owner = _ROUTE.get(id(p))
    if owner is not None:
        owner[0]._ready(owner[1])


class StageSync:
    """Sums one stage's gradients (and merges its BN statistics) over its stage group."""

    def __init__(self, members: list[Member], comm: Comm | None, chunks: int) -> None:
        self.members = members
        self.comm = comm
        self.chunks = chunks
        self._start: list[dict[str, tuple[torch.Tensor, torch.Tensor, int]]] = []
        # position i: the i-th parameter of every member (the copies have the same layout)
        per_member = [list(m.module.parameters()) for m in members]
        self.slots = list(zip(*per_member, strict=True))
        self.buckets = self._buckets()
        self.expected = sum(m.count for m in members)  # accumulations per slot per step
        self.seen = [0] * len(self.slots)
        self.pending: list[tuple[torch.Tensor, Any]] = []
        self.next_bucket = 0
        self.early = 0
        """Buckets of the last step whose sum started during backward (overlapped)."""
        if comm is not None and comm.size > 1:
            for i, slot in enumerate(self.slots):
                for p in slot:
                    if id(p) not in _ROUTE:  # one hook per parameter, routed to its newest owner
                        p.register_post_accumulate_grad_hook(_route)
                        weakref.finalize(p, _ROUTE.pop, id(p), None)
                    _ROUTE[id(p)] = (self, i)

    def _buckets(self) -> list[list[int]]:
        """Slot indices in reverse order, cut into buckets of about BUCKET_BYTES."""
        out: list[list[int]] = [[]]
        size = 0
        for i in reversed(range(len(self.slots))):
            p = self.slots[i][0]
            if out[-1] and size + p.numel() * p.element_size() > BUCKET_BYTES:
                out.append([])
                size = 0
            out[-1].append(i)
            size += p.numel() * p.element_size()
        return [b for b in out if b]

    def reset(self) -> None:
        """Start of a step: nothing accumulated, nothing in flight."""
        self.early = 0
        self.seen = [0] * len(self.slots)
        self.pending = []
        self.next_bucket = 0

    def _ready(self, i: int) -> None:
        self.seen[i] += 1
        while self.next_bucket < len(self.buckets) and all(
                self.seen[j] >= self.expected for j in self.buckets[self.next_bucket]):
            self._launch(self.next_bucket)
            self.early += 1

    def _launch(self, k: int) -> None:
        flat = torch.cat([_total(self.slots[j]).reshape(-1) for j in self.buckets[k]])
        assert self.comm is not None
        self.pending.append((flat, self.comm.iallreduce(flat)))
        self.next_bucket += 1

    def grads(self) -> None:
        """Sum the gradients of every copy of this stage over the group; all copies get it."""
        if not self.slots:
            return
        if self.comm is None or self.comm.size == 1:
            if len(self.members) > 1:  # one rank holding the stage in both GEMS copies
                for slot in self.slots:
                    total = sum(_grad(p) for p in slot)
                    for p in slot:
                        p.grad = total.clone()  # type: ignore[union-attr]
            return
        while self.next_bucket < len(self.buckets):
            self._launch(self.next_bucket)
        for k, (flat, req) in enumerate(self.pending):
            req.wait()
            offset = 0
            for j in self.buckets[k]:
                n = self.slots[j][0].numel()
                total = flat[offset:offset + n].view_as(self.slots[j][0])
                self.slots[j][0].grad = total  # a view of the bucket, not a copy
                for p in self.slots[j][1:]:  # other GEMS copies get their own (in-place
                    p.grad = total.clone()   # changes to one must not reach the other)
                offset += n
        self.pending = []

    def _bns(self, m: Member) -> list[tuple[str, RunningStats]]:
        return running_stats(m.module)

    def begin(self) -> None:
        """Remember the running statistics at the start of the step."""
        self._start = [{n: (b.running_mean.clone(), b.running_var.clone(),
                            int(b.num_batches_tracked))  # type: ignore[arg-type]
                        for n, b in self._bns(m)} for m in self.members]

    def stats(self) -> None:
        """Merge the running statistics so every copy holds what one device would."""
        if not self._start or not self._start[0]:
            return
        names = list(self._start[0])
        bns = [dict(self._bns(m)) for m in self.members]
        parts = []
        for name in names:
            mom = bns[0][name].momentum
            if mom is None:
                raise NotImplementedError(
                    f"BatchNorm {name!r} uses momentum=None (a cumulative average): its running "
                    f"statistics cannot be merged across GEMS copies / data-parallel replicas")
            a = 1.0 - mom
            r0_mean, r0_var, _ = self._start[0][name]
            acc_m = torch.zeros_like(r0_mean)
            acc_v = torch.zeros_like(r0_var)
            for m, bn in zip(self.members, bns, strict=True):
                if not m.counts_stats:
                    continue
                w = a ** (self.chunks - m.first - m.count)
                decay = a ** m.count
                acc_m += w * (bn[name].running_mean - decay * r0_mean)
                acc_v += w * (bn[name].running_var - decay * r0_var)
            parts += [acc_m, acc_v]
        flat = torch.cat(parts)
        if self.comm is not None and self.comm.size > 1:
            self.comm.allreduce(flat)
        offset = 0
        for name in names:
            a = 1.0 - bns[0][name].momentum  # type: ignore[operator]
            r0_mean, r0_var, n0 = self._start[0][name]
            c = r0_mean.numel()
            new_m = a ** self.chunks * r0_mean + flat[offset:offset + c]
            new_v = a ** self.chunks * r0_var + flat[offset + c:offset + 2 * c]
            offset += 2 * c
            for bn in bns:
                bn[name].running_mean.copy_(new_m)
                bn[name].running_var.copy_(new_v)
                bn[name].num_batches_tracked.fill_(n0 + self.chunks)  # type: ignore[union-attr]
