"""Gradient and BatchNorm-statistics synchronisation over each stage group.

A *stage group* is every rank that holds one stage: its tiles, both GEMS copies, every
data-parallel replica (fxpar.core.roles.stage_groups). Gradients are summed over it (each part
already carries its 1/chunks share of the loss), so every copy applies the same update.

Overlap: parameters are cut into buckets of about ``BUCKET_BYTES`` in the reverse of the order
the stage's forward first reads them (:func:`forward_order`, from the job's stage graph, so
every rank of the group cuts the same buckets), the order backward produces their gradients. A
post-accumulate-grad hook counts each parameter's accumulations; once every parameter of a
bucket has received its last one of the step (one per micro-batch of each copy on this rank),
the bucket's sum starts (nonblocking allreduce) while backward goes on. Buckets start strictly
in index order, so every rank issues the same collectives in the same order; the ALLREDUCE
action waits for them (and starts any that never filled, e.g. with unused parameters). The
hooks belong to the StageSync (so to its rank program): they count only during its own steps
(between :meth:`StageSync.reset` and :meth:`StageSync.grads`), so programs sharing parameters
(compiled from one model) never start each other's sums, and :meth:`StageSync.close` removes
them.

BatchNorm running statistics: one device would update them once per chunk, in chunk order
(the reference is gradient accumulation over the chunks). A copy that ran chunks
[j0, j0 + m) of K starting from r0 holds r = a^m r0 + delta with a = 1 - momentum; the reference
is a^K r0 + sum over copies of a^(K - j0 - m) delta. Each stage group sums the weighted deltas
(one allreduce) and every copy takes the result.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn
from torch.utils.hooks import RemovableHandle

from fxpar.comm.mpi import Comm
from fxpar.core.modelkeys import lookup
from fxpar.core.plan import PlanError
from fxpar.runtime.modules import BatchNormOp
from fxpar.runtime.spatial.ops import TileBatchNorm


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
    unread: tuple[str, ...] = ()
    """Parameters the model's forward never uses (fxpar.core.modelkeys): never summed, so
    their gradient stays None as on one process (a zero would let weight decay move them)."""

    def parameters(self) -> list[nn.Parameter]:
        """The parameters whose gradients are summed."""
        skip = {id(t) for n in self.unread if (t := lookup(self.module, n)) is not None}
        return [p for p in self.module.parameters() if id(p) not in skip]


BUCKET_BYTES = 4 * 2**20


def _accumulated(sync: weakref.ref[StageSync], i: int) -> Callable[[nn.Parameter], None]:
    """The post-accumulate-grad hook of slot ``i``: counts for ``sync`` while it runs a step.
    It holds ``sync`` weakly, so a parameter does not keep a dropped program alive."""
    def hook(_: nn.Parameter) -> None:
        owner = sync()
        if owner is not None and owner.armed:
            owner._ready(i)
    return hook


def _remove(handles: list[RemovableHandle]) -> None:
    for h in handles:
        h.remove()
    handles.clear()


def sync_problems(modules: list[nn.Module], stage: str) -> list[str]:
    """Why the gradients of ``stage`` ("stage 2"), held as ``modules`` (its copies on one
    rank, or the stage module), cannot be summed over a stage group: checked by the compiler
    and when a StageSync is made, so it fails before any communication instead of at the
    first ALLREDUCE. Empty when they can."""
    out: list[str] = []
    layouts = [[(n, tuple(p.shape), p.dtype) for n, p in m.named_parameters()]
               for m in modules]
    if any(lay != layouts[0] for lay in layouts[1:]):
        out.append(f"the copies of {stage} on one rank hold different parameters: "
                   f"their gradients cannot be summed slot by slot")
    dtypes = sorted({str(d).removeprefix("torch.") for _, _, d in layouts[0]} if layouts
                    else set())
    if len(dtypes) > 1:
        out.append(f"{stage}'s parameters have several dtypes ({', '.join(dtypes)}): "
                   f"gradients are summed over the stage group in flat buckets of one dtype; "
                   f"give the model one parameter dtype (model.to(dtype)) or put the layers "
                   f"of another dtype in a stage of their own (Plan.balance)")
    return out


def forward_order(gm: fx.GraphModule) -> list[str]:
    """The names of the tensors ``gm``'s graph reads (``get_attr``), in the order of their first
    use (a stage module's registration order is not its forward order)."""
    index = {n: i for i, n in enumerate(gm.graph.nodes)}
    first = {str(n.target): min((index[u] for u in n.users), default=len(index))
             for n in gm.graph.nodes if n.op == "get_attr"}
    return sorted(first, key=first.__getitem__)


class StageSync:
    """Sums one stage's gradients (and merges its BN statistics) over its stage group."""

    def __init__(self, members: list[Member], comm: Comm | None, chunks: int,
                 order: list[str] | None = None) -> None:
        """``order``: parameter names in the order the stage's forward first reads them
        (:func:`forward_order`; the same on every rank of the group), else the module's."""
        self.members = members
        self.comm = comm
        self.chunks = chunks
        self._start: list[dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = []
        if comm is not None and comm.size > 1 or len(members) > 1:
            for problem in sync_problems([m.module for m in members], "this stage")[:1]:
                raise PlanError(problem)
        # position i: the i-th parameter of every member (the copies have the same layout)
        per_member = [m.parameters() for m in members]
        self.slots = list(zip(*per_member, strict=True))
        if order and members:
            at = {n: i for i, n in enumerate(order)}
            names = {id(p): n for n, p in members[0].module.named_parameters()}
            self.slots.sort(key=lambda slot: at.get(names.get(id(slot[0]), ""), len(at)))
        self.buckets = self._buckets()
        self.expected = sum(m.count for m in members)  # accumulations per slot per step
        self.seen = [0] * len(self.slots)
        self.pending: list[tuple[torch.Tensor, Any]] = []
        self.next_bucket = 0
        self.missing: set[int] = set()
        self.early = 0
        """Buckets of the last step whose sum started during backward (overlapped)."""
        self.started_at: list[int] = []
        """Per bucket of the last step, the gradient accumulations this rank had seen when its
        sum started (of ``len(slots) x expected``): below the total, backward was still
        producing gradients, so the sum overlapped it."""
        self.armed = False
        """In a step of this StageSync: its hooks count accumulations."""
        self.hooks: list[RemovableHandle] = []
        if comm is not None and comm.size > 1:
            me = weakref.ref(self)
            self.hooks = [p.register_post_accumulate_grad_hook(_accumulated(me, i))
                          for i, slot in enumerate(self.slots) for p in slot]
        # removed by close(), or when this StageSync is collected without it
        self._unhook = weakref.finalize(self, _remove, self.hooks)

    def close(self) -> None:
        """Remove this StageSync's gradient hooks from its parameters (idempotent)."""
        self.armed = False
        self._unhook()

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
        self.armed = True
        self.early = 0
        self.started_at = []
        self.seen = [0] * len(self.slots)
        self.pending = []
        self.next_bucket = 0
        self.missing = set()  # slots this rank has no gradient for (the sum says if any has)

    def _ready(self, i: int) -> None:
        self.seen[i] += 1
        while self.next_bucket < len(self.buckets) and all(
                self.seen[j] >= self.expected for j in self.buckets[self.next_bucket]):
            self.started_at.append(sum(self.seen))
            self._launch(self.next_bucket)
            self.early += 1

    def _launch(self, k: int) -> None:
        """Start bucket ``k``'s sum. The bucket is a copy: each parameter's gradient becomes
        its view of the bucket now (the sum lands there, :meth:`grads`), so the step never
        holds a gradient twice; nothing reads it before the ALLREDUCE action waits."""
        slots = [self.slots[j] for j in self.buckets[k]]
        # after the gradients, one count per slot of the ranks that have it: a parameter no
        # rank's backward reached (a head whose output the loss never reads) keeps None
        has = [any(p.grad is not None for p in slot) for slot in slots]
        self.missing.update(j for j, h in zip(self.buckets[k], has, strict=True) if not h)
        has = torch.tensor([float(h) for h in has], dtype=slots[0][0].dtype,
                           device=slots[0][0].device)
        flat = torch.cat([*(_total(slot).reshape(-1) for slot in slots), has])
        assert self.comm is not None
        self.pending.append((flat, self.comm.iallreduce(flat)))
        self.next_bucket += 1
        offset = 0
        for j in self.buckets[k]:
            slot = self.slots[j]
            n = slot[0].numel()
            slot[0].grad = flat[offset:offset + n].view_as(slot[0])
            for p in slot[1:]:  # the other copies get theirs in grads()
                p.grad = None
            offset += n

    def grads(self) -> None:
        """Sum the gradients of every copy of this stage over the group; all copies get it."""
        self.armed = False  # the step's backward is over
        if not self.slots:
            return
        if self.comm is None or self.comm.size == 1:
            if len(self.members) > 1:  # one rank holding the stage in both GEMS copies
                for slot in self.slots:
                    if all(p.grad is None for p in slot):
                        continue  # no copy's backward reached it: None, as on one process
                    total = sum(_grad(p) for p in slot)
                    for p in slot:
                        p.grad = total.clone()  # type: ignore[union-attr]
            return
        while self.next_bucket < len(self.buckets):
            self._launch(self.next_bucket)
        for k, (flat, req) in enumerate(self.pending):
            req.wait()  # the sum lands in the bucket, whose views the gradients are (_launch)
            bucket = self.buckets[k]
            counts = [1.0] * len(bucket)  # this rank has a gradient: the sum has one
            unsure = [i for i, j in enumerate(bucket) if j in self.missing]
            if unsure:  # a host read only for a parameter whose gradient this rank lacks
                tail = flat[len(flat) - len(bucket):]
                for i, c in zip(unsure, tail[unsure].tolist(), strict=True):
                    counts[i] = c
            for j, count in zip(bucket, counts, strict=True):
                total = self.slots[j][0].grad if count else None
                self.slots[j][0].grad = total
                for p in self.slots[j][1:]:  # other GEMS copies get their own (in-place
                    # changes to one must not reach the other)
                    p.grad = None if total is None else total.clone()
        self.pending = []

    def _bns(self, m: Member) -> list[tuple[str, RunningStats]]:
        return running_stats(m.module)

    def begin(self) -> None:
        """Remember the running statistics at the start of the step (copies on the device:
        nothing is read back to the host)."""
        self._start = [{n: (b.running_mean.clone(), b.running_var.clone(),
                            b.num_batches_tracked.clone())  # type: ignore[union-attr]
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
                bn[name].num_batches_tracked.copy_(n0 + self.chunks)  # type: ignore[union-attr]
