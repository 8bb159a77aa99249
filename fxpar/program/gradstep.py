"""What a rank program does with its gradients between backward and the optimizer step:
accumulation over several calls of ``train_step``, clipping by the norm of the whole model.

Where the gradients stand at the step (after the ALLREDUCE action; fxpar.runtime.sync): every
rank holds the gradients of its own stages' parameters only, each summed over the stage group
(tiles, both GEMS copies, data-parallel replicas), so every rank that holds a parameter holds
the same gradient, the one one process computes for the mean loss over the global batch.

Clipping by norm is therefore a collective of one allreduce: each parameter is counted once in
the norm, by the rank that holds it as tile 0 of model copy 0 in replica 0 (:func:`counted`);
every rank then scales all of its gradients (every GEMS copy) by the same coefficient, computed
as ``torch.nn.utils.clip_grad_norm_`` does. Clipping by value is element-wise: every rank clips
its own gradients and no rank needs another's.

Accumulation (``train_step(x, y, accumulate=k)``): k consecutive calls make one optimizer step.
Each call's chunks carry 1/(chunks x k) of the loss, so the gradients summed over the k calls
are those of the mean over the k global batches, and the reference is one process accumulating
over the concatenation's chunks. The gradients are summed over the stage groups once, in the
k-th call (the first k-1 calls leave them local, as DDP's ``no_sync``): summing is linear, but a
gradient summed in an earlier call would be summed again with it. BatchNorm running statistics
are merged in every call (each call runs its global batch's chunks in order, as one process).
The :attr:`RankProgram.before_optimizer_step` hooks (clipping) run in the k-th call only.

NaN and inf in a cycle (fxpar.runtime.guard checks every call: the allreduce that returns the
call's loss carries its flags, so it costs nothing more): a NaN in call j of k poisons the
gradients accumulated so far, and so the cycle's step. Call j is undone (its buffer updates;
under ``FXPAR_NONFINITE=stop`` it raises NonFiniteError on every rank), the cycle ends there
with no optimizer step, its gradients are dropped (zeroed by the next call) and the next call
starts a new cycle of k: the batches of calls 1..j are lost, the parameters are those of the
last step taken (:attr:`Accumulation.dropped` counts such cycles). Under float16 the loss scale
unscales and checks the summed gradients once, at the k-th call (torch's GradScaler with
accumulation): an overflow in any call skips that cycle's step and halves the scale once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from fxpar.comm.mpi import Comm
from fxpar.core.plan import RankMap


def counted(rank_map: RankMap, rank: int,
            stages: dict[tuple[int, int], nn.Module]) -> list[nn.Parameter]:
    """The parameters ``rank`` counts in the whole model's gradient norm: those of the stages
    it holds as tile 0 of copy 0 in replica 0, so each stage's parameters are counted by exactly
    one rank of its stage group (the others hold the same summed gradients)."""
    if rank_map.dp_index(rank) != 0:
        return []
    seen: dict[int, nn.Parameter] = {}
    for role in rank_map.roles_of(rank):
        if role.copy == 0 and role.tile == 0:
            for p in stages[(0, role.stage)].parameters():
                seen.setdefault(id(p), p)
    return list(seen.values())


def _by_dtype(grads: list[torch.Tensor]) -> dict[tuple[torch.device, torch.dtype],
                                                 list[torch.Tensor]]:
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for g in grads:
        if g.numel():
            groups.setdefault((g.device, g.dtype), []).append(g)
    return groups


def check_norm_type(norm_type: float) -> float:
    p = float(norm_type)
    if not p > 0:
        raise ValueError(f"clip_grad_norm_(norm_type={norm_type}): use a p-norm with p > 0 "
                         f"(2.0, 1.0, ...) or float('inf')")
    return p


def total_norm(grads: list[torch.Tensor], norm_type: float, comm: Comm | None,
               device: torch.device) -> torch.Tensor:
    """The ``norm_type``-norm of the gradients of every rank of ``comm`` taken together
    (``grads``: this rank's counted ones), as a float64 0-d tensor on ``device``, equal on
    every rank: the norm of the per-tensor norms (torch.nn.utils.get_total_norm's definition),
    their p-th powers summed (their maximum for inf) in one allreduce."""
    p = check_norm_type(norm_type)
    norms = [n.to(device, torch.float64) for group in _by_dtype(grads).values()
             for n in torch._foreach_norm(group, p)]
    part = torch.zeros(1, dtype=torch.float64, device=device)
    if norms:
        stacked = torch.stack(norms)
        part[0] = stacked.max() if math.isinf(p) else stacked.pow(p).sum()
    if comm is not None and comm.size > 1:
        comm.allreduce(part, "max" if math.isinf(p) else "sum")
    return part[0] if math.isinf(p) else part[0].pow(1.0 / p)


@dataclass
class Accumulation:
    """Where a rank program stands in a cycle of ``size`` calls that make one optimizer step."""

    size: int = 1
    """The cycle's ``accumulate``."""
    done: int = 0
    """Calls of the cycle that completed (their gradients are in ``.grad``, local to this
    rank: not yet summed over the stage groups)."""
    dropped: int = 0
    """Cycles that ended without an optimizer step: a NaN or inf in one of their calls, or a
    float16 overflow at their last (with accumulate=1 every such skipped step counts; the
    guard's ``skipped`` and the loss scale's ``skipped`` count them too, by their own rule)."""

    def check(self, accumulate: int) -> None:
        """Before a call: ``accumulate`` is a valid cycle length and that of the cycle under
        way (raised before any communication, alike on every rank)."""
        if not isinstance(accumulate, int) or isinstance(accumulate, bool) or accumulate < 1:
            raise ValueError(f"train_step(accumulate={accumulate!r}): the number of calls per "
                             f"optimizer step, an int >= 1")
        if self.done and accumulate != self.size:
            raise ValueError(
                f"train_step(accumulate={accumulate}) in the middle of a cycle of "
                f"{self.size} calls ({self.done} done): pass the same accumulate to the "
                f"{self.size} calls of one optimizer step")

    def begin(self, accumulate: int) -> bool:
        """A call starts; True when it is the first of its cycle (gradients are zeroed)."""
        self.size = accumulate
        return self.done == 0

    @property
    def last(self) -> bool:
        """The running call is the cycle's last: gradients are summed, the optimizer steps."""
        return self.done == self.size - 1

    def drop(self) -> None:
        """A NaN or inf ended the cycle: its gradients are lost, the next call starts anew."""
        self.done = -1  # end() brings it to 0
        self.dropped += 1

    def end(self) -> None:
        """The call completed: the next one is the cycle's next, or the first of a new one."""
        self.done = 0 if self.done == -1 or self.done + 1 == self.size else self.done + 1
