"""The runtime: one interpreter loop over a rank's action list.

All decisions were made at compile time (the schedule is data); the runtime only carries
tensors between actions. State for one step lives in :class:`StepState` and is dropped at
the end of the step.

Loss scaling: ``loss_fn`` returns the mean over its chunk (like ``F.cross_entropy``). The global
batch is cut into ``chunks`` equal parts (data-parallel x GEMS x micro-batches), so each chunk's
loss is divided by ``chunks``; their sum is then exactly the mean over the global batch, and the
summed gradients are those of that mean.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx

from fxpar.schedule import Action, Schedule, format_grid

LossFn = Callable[[Any, Any], torch.Tensor]


@dataclass
class Stage:
    """One stage of one model copy, as held by a rank."""

    index: int
    module: fx.GraphModule
    first: bool
    last: bool


@dataclass
class StepState:
    """Everything one training step carries between actions."""

    x_chunks: list[torch.Tensor]
    y_chunks: list[Any]
    scale: float
    inputs: dict[tuple[int, int, int], tuple[torch.Tensor, ...]] = field(default_factory=dict)
    outputs: dict[tuple[int, int, int], Any] = field(default_factory=dict)
    losses: list[torch.Tensor] = field(default_factory=list)


class ActionFailed(RuntimeError):
    """An action raised; the message holds the schedule grid with the failing cell marked."""


@dataclass
class Runtime:
    """Executes one rank's actions for its stages."""

    rank: int
    stages: dict[tuple[int, int], Stage]
    schedule: Schedule
    loss_fn: LossFn
    optimizer: torch.optim.Optimizer | None

    def run(self, state: StepState) -> None:
        """The loop: every action of this rank, in order."""
        handlers: dict[str, Callable[[Action, StepState], None]] = {
            "F": self._forward, "B": self._backward, "STEP": self._step,
        }
        for i, action in enumerate(self.schedule[self.rank]):
            try:
                handlers[action.kind](action, state)
            except Exception as e:
                grid = format_grid(self.schedule, mark=(self.rank, i))
                print(f"[fxpar rank {self.rank}] action {action} failed: "
                      f"{type(e).__name__}: {e}\n{grid}", file=sys.stderr, flush=True)
                raise ActionFailed(f"rank {self.rank}, step {i}, action {action}: "
                                   f"{type(e).__name__}: {e}") from e

    def _forward(self, a: Action, st: StepState) -> None:
        stage = self.stages[(a.copy, a.stage)]
        if stage.first:
            ins: tuple[torch.Tensor, ...] = (st.x_chunks[a.mb],)
        else:
            raise NotImplementedError("multi-stage input comes with layer parallelism")
        st.inputs[(a.copy, a.stage, a.mb)] = ins
        out = stage.module(*ins)
        if stage.last:
            loss = self.loss_fn(out, st.y_chunks[a.mb])
            if st.scale != 1.0:
                loss = loss * st.scale
            st.losses.append(loss.detach())
            out = loss
        st.outputs[(a.copy, a.stage, a.mb)] = out

    def _backward(self, a: Action, st: StepState) -> None:
        stage = self.stages[(a.copy, a.stage)]
        out = st.outputs.pop((a.copy, a.stage, a.mb))
        if stage.last:
            out.backward()
        else:
            raise NotImplementedError("multi-stage backward comes with layer parallelism")
        st.inputs.pop((a.copy, a.stage, a.mb), None)

    def _step(self, a: Action, st: StepState) -> None:
        if self.optimizer is not None:
            self.optimizer.step()
