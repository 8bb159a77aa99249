"""The runtime: one interpreter loop over a rank's action list.

All decisions were made at compile time (the schedule and the transfers are data); the runtime
only carries tensors between actions. State for one step lives in :class:`StepState` and is
dropped at the end of the step.

Loss scaling: ``loss_fn`` returns the mean over its chunk (like ``F.cross_entropy``). The global
batch is cut into ``chunks`` equal parts (data-parallel x GEMS x micro-batches), so each chunk's
loss is divided by ``chunks``; their sum is then exactly the mean over the global batch, and the
summed gradients are those of that mean.

Communication: every receive is posted (``irecv``) by its RECV action and waited for by the
compute action that needs it; every send is an ``isend`` whose request is completed at the end
of the step, so no rank ever blocks in a send.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx

from fxpar.comm import Comm, Request
from fxpar.schedule import Action, Schedule, format_grid
from fxpar.stages import StageGraph, Transfer

LossFn = Callable[[Any, Any], torch.Tensor]
Key = tuple[int, int, int]  # (copy, stage, micro-batch)


@dataclass
class StepState:
    """Everything one step carries between actions."""

    x_chunks: list[torch.Tensor]
    y_chunks: list[Any]
    scale: float
    train: bool = True
    inputs: dict[Key, list[torch.Tensor]] = field(default_factory=dict)
    outputs: dict[Key, tuple[Any, ...]] = field(default_factory=dict)
    losses: list[torch.Tensor] = field(default_factory=list)
    results: dict[int, Any] = field(default_factory=dict)
    recv_f: dict[Key, list[tuple[Transfer, torch.Tensor, Request]]] = field(default_factory=dict)
    recv_b: dict[Key, list[tuple[Transfer, torch.Tensor, Request]]] = field(default_factory=dict)
    grads: dict[Key, list[torch.Tensor | None]] = field(default_factory=dict)
    sends: list[Request] = field(default_factory=list)


class ActionFailed(RuntimeError):
    """An action raised; the message holds the schedule grid with the failing cell marked."""


@dataclass
class Runtime:
    """Executes one rank's actions for the stages it holds."""

    rank: int
    graph: StageGraph
    stages: dict[tuple[int, int], fx.GraphModule]
    """(copy, stage) -> module, for the stages this rank holds."""
    peer: Callable[[int, int], int]
    """(copy, stage) -> the rank that runs it (in this rank's data-parallel replica)."""
    schedule: Schedule
    loss_fn: LossFn
    optimizer: torch.optim.Optimizer | None
    comm: Comm | None
    microbatches: int

    def run(self, state: StepState, actions: list[Action] | None = None) -> None:
        """The loop: every action of this rank, in order."""
        handlers: dict[str, Callable[[Action, StepState], None]] = {
            "F": self._forward, "B": self._backward, "STEP": self._step,
            "SEND_F": self._send_f, "RECV_F": self._recv_f,
            "SEND_B": self._send_b, "RECV_B": self._recv_b,
        }
        todo = self.schedule[self.rank] if actions is None else actions
        for i, action in enumerate(todo):
            try:
                handlers[action.kind](action, state)
            except Exception as e:
                mark = (self.rank, i) if actions is None else None
                grid = format_grid(self.schedule, mark=mark)
                print(f"[fxpar rank {self.rank}] action {action} failed: "
                      f"{type(e).__name__}: {e}\n{grid}", file=sys.stderr, flush=True)
                raise ActionFailed(f"rank {self.rank}, step {i}, action {action}: "
                                   f"{type(e).__name__}: {e}") from e
        Comm.waitall(state.sends)
        state.sends.clear()

    # -- tags: one per (direction, copy, micro-batch, transfer); MPI matches on (source, tag)
    def _tag(self, t: Transfer, a: Action, backward: bool) -> int:
        per_mb = len(self.graph.transfers)
        return (((2 * a.copy + int(backward)) * self.microbatches + a.mb) * per_mb) + t.id

    def _assert_comm(self) -> Comm:
        if self.comm is None:
            raise RuntimeError("this rank program has no communicator: use program.local() "
                               "under mpiexec")
        return self.comm

    # -- compute ------------------------------------------------------------------------------
    def _forward(self, a: Action, st: StepState) -> None:
        key = (a.copy, a.stage, a.mb)
        module = self.stages[(a.copy, a.stage)]
        received: dict[int, torch.Tensor] = {}
        for t, buf, req in st.recv_f.pop(key, []):
            req.wait()
            received[t.id] = buf
        ins: list[torch.Tensor] = []
        for src in self.graph.inputs[a.stage]:
            if src.source == "batch":
                ins.append(st.x_chunks[a.mb])
            else:
                buf = received[src.index]
                if st.train and buf.is_floating_point():
                    buf.requires_grad_(True)
                ins.append(buf)
        st.inputs[key] = ins
        if st.train and self.graph.mutated_inputs:
            ins = [x.clone() if i in self.graph.mutated_inputs[a.stage] and x.requires_grad
                   else x for i, x in enumerate(ins)]
        with torch.set_grad_enabled(st.train):
            outs = module(*ins)
        if a.stage == len(self.graph.modules) - 1:
            result = outs[0]
            if not st.train:
                st.results[a.mb] = result
                return
            loss = self.loss_fn(result, st.y_chunks[a.mb])
            if st.scale != 1.0:
                loss = loss * st.scale
            st.losses.append(loss.detach())
            outs = (loss,)
        st.outputs[key] = outs

    def _backward(self, a: Action, st: StepState) -> None:
        key = (a.copy, a.stage, a.mb)
        outs = st.outputs.pop(key)
        if a.stage == len(self.graph.modules) - 1:
            outs[0].backward()
        else:
            grads: list[torch.Tensor | None] = [None] * len(outs)
            for t, buf, req in st.recv_b.pop(key, []):
                req.wait()
                g = grads[t.src_out]
                grads[t.src_out] = buf if g is None else g + buf
            pairs = [(o, g) for o, g in zip(outs, grads, strict=True)
                     if g is not None and isinstance(o, torch.Tensor) and o.requires_grad]
            if pairs:
                torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        st.grads[key] = [x.grad for x in st.inputs.pop(key)]

    def _step(self, a: Action, st: StepState) -> None:
        Comm.waitall(st.sends)
        st.sends.clear()
        if self.optimizer is not None:
            self.optimizer.step()

    # -- communication ------------------------------------------------------------------------
    def _recv_f(self, a: Action, st: StepState) -> None:
        comm = self._assert_comm()
        posted = []
        for t in self.graph.recvs(a.stage):
            buf = torch.empty(t.shape, dtype=t.dtype)
            req = comm.irecv(buf, self.peer(a.copy, t.src), self._tag(t, a, False))
            posted.append((t, buf, req))
        st.recv_f[(a.copy, a.stage, a.mb)] = posted

    def _send_f(self, a: Action, st: StepState) -> None:
        comm = self._assert_comm()
        outs = st.outputs[(a.copy, a.stage, a.mb)]
        for t in self.graph.sends(a.stage):
            st.sends.append(comm.isend(outs[t.src_out].detach(), self.peer(a.copy, t.dst),
                                       self._tag(t, a, False)))
        if not st.train:
            del st.outputs[(a.copy, a.stage, a.mb)]  # nothing will run backward on it

    def _recv_b(self, a: Action, st: StepState) -> None:
        comm = self._assert_comm()
        posted = []
        for t in self.graph.sends(a.stage):
            if t.grad:
                buf = torch.empty(t.shape, dtype=t.dtype)
                req = comm.irecv(buf, self.peer(a.copy, t.dst), self._tag(t, a, True))
                posted.append((t, buf, req))
        st.recv_b[(a.copy, a.stage, a.mb)] = posted

    def _send_b(self, a: Action, st: StepState) -> None:
        comm = self._assert_comm()
        grads = st.grads.pop((a.copy, a.stage, a.mb))
        for t in self.graph.recvs(a.stage):
            if t.grad:
                g = grads[t.dst_in]
                g = torch.zeros(t.shape, dtype=t.dtype) if g is None else g
                st.sends.append(comm.isend(g, self.peer(a.copy, t.src), self._tag(t, a, True)))
