"""Gradient and BatchNorm-statistics synchronisation over each stage group.

A *stage group* is every rank that holds one stage: its tiles, both GEMS copies, every
data-parallel replica (passes.mirror.stage_groups). Gradients are summed over it (each part
already carries its 1/chunks share of the loss), so every copy applies the same update.

BatchNorm running statistics: one device would update them once per chunk, in chunk order
(the reference is gradient accumulation over the chunks). A copy that ran chunks
[j0, j0 + m) of K starting from r0 holds r = a^m r0 + delta with a = 1 - momentum; the reference
is a^K r0 + sum over copies of a^(K - j0 - m) delta. Each stage group sums the weighted deltas
(one allreduce) and every copy takes the result.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import fx, nn

from fxpar.comm import Comm


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


class StageSync:
    """Sums one stage's gradients (and merges its BN statistics) over its stage group."""

    def __init__(self, members: list[Member], comm: Comm | None, chunks: int) -> None:
        self.members = members
        self.comm = comm
        self.chunks = chunks
        self._start: list[dict[str, tuple[torch.Tensor, torch.Tensor, int]]] = []

    def _params(self, m: Member) -> list[nn.Parameter]:
        return [p for p in m.module.parameters()]

    def grads(self) -> None:
        """Sum the gradients of every copy of this stage over the group; all copies get it."""
        per_member = [self._params(m) for m in self.members]
        flats = []
        for params in per_member:
            flats.append(torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p))
                                    .reshape(-1) for p in params]) if params else None)
        if flats[0] is None:
            return
        total = flats[0].clone()
        for f in flats[1:]:
            total += f
        if self.comm is not None and self.comm.size > 1:
            self.comm.allreduce(total)
        for params in per_member:
            offset = 0
            for p in params:
                n = p.numel()
                p.grad = total[offset:offset + n].view_as(p).clone()
                offset += n

    def _bns(self, m: Member) -> list[tuple[str, nn.modules.batchnorm._BatchNorm]]:
        return [(n, b) for n, b in m.module.named_modules()
                if isinstance(b, nn.modules.batchnorm._BatchNorm) and b.track_running_stats
                and b.running_mean is not None]

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
