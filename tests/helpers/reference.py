"""The one-process reference of a transparency check, trained once per job instead of on every
rank.

Every rank compares its own part of the compiled program (its stages' parameters, gradients,
buffers, its output) against plain PyTorch on the whole batch. Training that reference on each
of P oversubscribed ranks does the same work P times; here one rank (the last: rank 0 traces the
model for everyone meanwhile, fxpar.frontend.share) trains it and every rank receives, after
each step, the reference's loss and every parameter, gradient and buffer into its own copy of
the model. The comparisons then run on every rank against that copy, exactly as before.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager

import torch
from torch import nn

from fxpar.comm.mpi import Comm
from helpers.equivalence import reference_step

Snapshot = tuple[dict[torch.dtype, torch.Tensor], list[bool]]
"""A reference's state after a step: its tensors flattened by dtype (the loss first among the
float64 ones, then parameters, gradients, buffers), and which parameters have a gradient."""


def _parts(ref: nn.Module) -> list[torch.Tensor]:
    """Every tensor a snapshot holds, in its order: parameters, gradients (zeros in place of
    a missing one), buffers."""
    params = list(ref.parameters())
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    return [*(p.detach() for p in params), *grads, *ref.buffers()]


def _snapshot(ref: nn.Module, loss: float) -> Snapshot:
    device = next(ref.parameters()).device
    groups: dict[torch.dtype, list[torch.Tensor]] = {
        torch.float64: [torch.tensor([loss], dtype=torch.float64, device=device)]}
    for t in _parts(ref):
        groups.setdefault(t.dtype, []).append(t.reshape(-1))
    return ({dt: torch.cat(ts) for dt, ts in groups.items()},
            [p.grad is not None for p in ref.parameters()])


def _load(ref: nn.Module, snap: Snapshot) -> float:
    """Put ``snap`` into ``ref``; its loss."""
    flat, has_grad = snap
    offsets = {dt: 0 for dt in flat}
    loss = float(flat[torch.float64][0])
    offsets[torch.float64] = 1
    params = list(ref.parameters())
    with torch.no_grad():
        for i, t in enumerate(_parts(ref)):
            k = offsets[t.dtype]
            value = flat[t.dtype][k:k + t.numel()].view(t.shape)
            offsets[t.dtype] = k + t.numel()
            if len(params) <= i < 2 * len(params):  # a gradient
                p = params[i - len(params)]
                if not has_grad[i - len(params)]:
                    p.grad = None
                elif p.grad is None:
                    p.grad = value.clone()
                else:  # the memory of the step before: no fresh pages to fault in
                    p.grad.copy_(value)
            else:
                t.copy_(value)
    return loss


def _empty_like(snap_of: nn.Module) -> dict[torch.dtype, torch.Tensor]:
    """Buffers to receive a snapshot of ``snap_of`` into: one per dtype, of the snapshot's
    size (the loss, then each parameter twice, as itself and as its gradient, then buffers)."""
    sizes: dict[torch.dtype, int] = {torch.float64: 1}
    for t in [*snap_of.parameters(), *snap_of.parameters(), *snap_of.buffers()]:
        sizes[t.dtype] = sizes.get(t.dtype, 0) + t.numel()
    device = next(snap_of.parameters()).device
    return {dt: torch.empty(n, dtype=dt, device=device) for dt, n in sizes.items()}


class Reference:
    """Plain PyTorch on the whole batch, trained by ``comm``'s last rank and shared.

    ``train(steps, ...)`` (on the training rank: every step now, each state kept) and
    ``step(s)`` (on every rank: the reference's state after step ``s`` put into ``ref``,
    and its loss)."""

    def __init__(self, comm: Comm, ref: nn.Module) -> None:
        self.comm, self.ref = comm, ref
        self.root = comm.size - 1
        self._states: list[Snapshot] = []
        self._received: dict[torch.dtype, torch.Tensor] | None = None
        """Where the other ranks receive a snapshot: allocated once, for every step."""

    def train(self, steps: int, opt: torch.optim.Optimizer, x: torch.Tensor,
              y: object, chunks: int, loss_fn: Callable,
              mode: Callable[[], AbstractContextManager]) -> None:
        """On the training rank, every reference step now (the others' compile meanwhile)."""
        if self.comm.rank != self.root:
            return
        for _ in range(steps):
            with mode():
                loss = reference_step(self.ref, opt, x, y, chunks, loss_fn)
            self._states.append(_snapshot(self.ref, loss))

    def record(self, calls: list[Callable[[], float]]) -> None:
        """On the training rank, run ``calls`` now (each one reference ``train_step``, or one
        call of an accumulation cycle: equivalence.reference_step; it returns its loss) and
        keep the state after each, for :meth:`step`."""
        if self.comm.rank != self.root:
            return
        for call in calls:
            self._states.append(_snapshot(self.ref, call()))

    def step(self, s: int) -> float:
        """The reference after step ``s`` in ``ref`` on every rank; its loss."""
        if self.comm.rank == self.root:
            snap = self._states[s]
            flat = snap[0]
        else:
            if self._received is None:
                self._received = _empty_like(self.ref)
            flat = self._received
        has_grad = self.comm.bcast_object(snap[1] if self.comm.rank == self.root else None,
                                          root=self.root)
        for dt in sorted(flat, key=str):
            self.comm.bcast(flat[dt], root=self.root)
        return _load(self.ref, (flat, has_grad))
