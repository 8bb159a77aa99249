"""Activation recompute for a stage (``Plan(recompute=...)``), without a second exchange.

A recomputed stage runs its forward twice: at F without autograd (nothing is saved for
backward, only the stage's inputs are kept), and again at B with autograd, right before its
backward. The second forward must compute exactly what the first did and must not talk to any
other rank: the peers ran their forward long ago and are not sending again. So the first
forward **records** what the tile ops' communicators gave it (received halo pieces,
allreduce / allgather results of the norm statistics and reductions, joined tensors), in call
order, and the second **replays** them: its receives are filled from the record, its sends and
collectives are skipped. Once the replayed forward has consumed the record the communicator
goes back to the real one, so the backward of the recomputed graph (halo gradients back to
their owners, the statistics' allreduce) communicates as usual: the messages of a step are
the same with or without recompute (no extra message, so no new way to deadlock).

What else the first forward changed is put back around the second: the random number
generator (dropout draws the same mask) and the module's buffers (BatchNorm's running
statistics and ``num_batches_tracked`` are updated once, by the first forward: the caller puts
them back after the backward, since BatchNorm's backward reads them).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from fxpar.comm.mpi import Comm
from fxpar.runtime.spatial.group import bound, current


def recomputed_stages(mode: str, stages: int) -> frozenset[int]:
    """The stages ``Plan.recompute`` recomputes: every one ("always"), all but the last
    ("except_last": its outputs are the loss, recomputing it saves little), or none ("never";
    "auto" is chosen at compile time, fxpar.perf.memory.choose_recompute)."""
    if mode == "always":
        return frozenset(range(stages))
    if mode == "except_last":
        return frozenset(range(stages - 1))
    return frozenset()


class _Done:
    """A request that completed when it was made (a replayed receive, a skipped send)."""

    def wait(self) -> None:
        pass

    def test(self) -> bool:
        return True


class _Recording:
    """A communicator that passes every call through and records what it returned."""

    def __init__(self, real: Comm, log: list[Any]) -> None:
        self.real, self.log = real, log

    @property
    def rank(self) -> int:
        return self.real.rank

    @property
    def size(self) -> int:
        return self.real.size

    def isend(self, t: torch.Tensor, dst: int, tag: int = 0) -> Any:
        return self.real.isend(t, dst, tag)

    def irecv(self, t: torch.Tensor, src: int, tag: int = 0) -> Any:
        self.log.append(t)  # the buffer itself: filled once the request is waited for
        return self.real.irecv(t, src, tag)

    def allreduce(self, t: torch.Tensor, op: str = "sum") -> torch.Tensor:
        out = self.real.allreduce(t, op)
        self.log.append(out.clone())
        return out

    def allgather(self, t: torch.Tensor) -> list[torch.Tensor]:
        out = self.real.allgather(t)
        self.log.append([x.clone() for x in out])
        return out


class _Replaying(_Recording):
    """A communicator that answers from a record while ``replaying``, then is the real one."""

    def __init__(self, real: Comm, log: list[Any]) -> None:
        super().__init__(real, list(reversed(log)))
        self.replaying = True

    def _next(self, what: str) -> Any:
        if not self.log:
            raise RuntimeError(f"recompute: the replayed forward asks for a {what} the first "
                               f"forward did not make (the stage computes differently the "
                               f"second time)")
        return self.log.pop()

    def isend(self, t: torch.Tensor, dst: int, tag: int = 0) -> Any:
        return _Done() if self.replaying else self.real.isend(t, dst, tag)

    def irecv(self, t: torch.Tensor, src: int, tag: int = 0) -> Any:
        if not self.replaying:
            return self.real.irecv(t, src, tag)
        t.copy_(self._next("receive"))
        return _Done()

    def allreduce(self, t: torch.Tensor, op: str = "sum") -> torch.Tensor:
        if not self.replaying:
            return self.real.allreduce(t, op)
        return self._next("allreduce").clone()

    def allgather(self, t: torch.Tensor) -> list[torch.Tensor]:
        if not self.replaying:
            return self.real.allgather(t)
        return [x.clone() for x in self._next("allgather")]


@dataclass
class Record:
    """What a stage's first forward did that its recompute must repeat: per communicator of
    its tile ops, the results in call order; the random number generator's state."""

    logs: dict[int, list[Any]] = field(default_factory=dict)
    rng: torch.Tensor | None = None
    cuda_rng: list[torch.Tensor] | None = None


def _wrapped(make: Callable[[Comm], _Recording]) -> dict[str, Any]:
    """The current tile-group binding with each communicator wrapped once by ``make``."""
    comms = current()
    wrap: dict[int, _Recording] = {}
    for comm in comms.values():
        if id(comm) not in wrap:
            wrap[id(comm)] = make(comm)
    return {key: wrap[id(comm)] for key, comm in comms.items()}


@contextmanager
def recording(device: torch.device) -> Iterator[Record]:
    """The first forward of a recomputed stage: run it inside; the record comes back."""
    rec = Record(rng=torch.get_rng_state(),
                 cuda_rng=torch.cuda.get_rng_state_all() if device.type == "cuda" else None)
    with bound(_wrapped(lambda c: _Recording(c, rec.logs.setdefault(id(c), [])))):
        yield rec


def buffers(module: nn.Module) -> dict[str, torch.Tensor]:
    """A copy of ``module``'s buffers (before a recompute updates them a second time)."""
    return {name: b.clone() for name, b in module.named_buffers()}


def restore(module: nn.Module, saved: dict[str, torch.Tensor]) -> None:
    """``module``'s buffers back to ``saved`` (after the recomputed graph's backward). Written
    through ``.data``: BatchNorm's backward node keeps the running statistics (unused in
    training mode) and checks their version, and a zero-bubble W runs that node again after
    this (fxpar.runtime.splitgrad)."""
    with torch.no_grad():
        for name, b in module.named_buffers():
            b.data.copy_(saved[name])


@contextmanager
def replaying(rec: Record) -> Iterator[None]:
    """The recompute: run the stage's forward again inside (with autograd on). It sees the
    first forward's messages and random numbers, and its tile ops keep a communicator that is
    the real one again afterwards (for the backward of what it built). Buffers: see
    :func:`buffers` and :func:`restore`."""
    comms = _wrapped(lambda c: _Replaying(c, rec.logs.get(id(c), [])))
    wrap: list[_Replaying] = list({id(w): w for w in comms.values()}.values())
    rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if rec.cuda_rng is not None else None
    assert rec.rng is not None
    torch.set_rng_state(rec.rng)
    if rec.cuda_rng is not None:
        torch.cuda.set_rng_state_all(rec.cuda_rng)
    try:
        with bound(comms):
            yield
            for w in wrap:
                if w.log:
                    raise RuntimeError("recompute: the replayed forward made fewer exchanges "
                                       "than the first forward (the stage computes "
                                       "differently the second time)")
    finally:
        for w in wrap:
            w.replaying = False  # the backward of the recomputed graph talks for real
        torch.set_rng_state(rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)
