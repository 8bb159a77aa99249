"""The runtime: one interpreter loop over a rank's action list.

All decisions were made at compile time (the schedule and the transfers are data); the runtime
only carries tensors between actions. State for one step lives in :class:`StepState` and is
dropped at the end of the step.

Loss scaling: ``loss_fn(output, *targets)`` is the user's loss of one chunk. The global batch is
cut into ``chunks`` equal parts (data-parallel x GEMS x micro-batches), so each chunk's loss is
divided by ``chunks``; their sum is the mean of the chunks' losses (gradient accumulation over
the chunks, the contract), and the summed gradients are those of that mean. A loss of a spatial
stage is whole on every rank of its tile group (a replicated output, or a tiled output's loss
whose reductions run over the tiles: :class:`LossTiles`), so each rank carries 1/P of it.

Communication: every receive is posted (``irecv``) by its RECV action -- or earlier: the
receives that follow a compute action in the list are posted before it runs, so their data
can land during it -- and waited for by the compute action that needs it; every send is an
``isend`` whose request is completed at the end of the step, so no rank ever blocks in a send.
Both go out through a :class:`fxpar.comm.ordered.Sequencer`, in the order agreed with each
peer (fxpar.core.wire): a receive posted early waits in it until the messages before it are
issued, as NCCL, which ignores tags, needs.

Timing (for ``fxpar-run --metrics``): set ``Runtime.timeline`` to a list and each action appends
an :class:`ActionTime` (perf_counter start/end, and the seconds it sat blocked in request waits,
``Comm.waitall`` or the gradient sync), in the order the actions ran (a receive posted early
before the compute action it follows). With ``timeline`` None (the default) the loop only pays
one ``is None`` test per action and per wait. Halo exchanges and BatchNorm allreduces inside a
spatial stage's F/B run in the stage module (runtime.spatial.ops), so they count as compute here.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import torch
from torch import fx

from fxpar.comm import watchdog
from fxpar.comm.mpi import Comm, Request
from fxpar.comm.ordered import Sequencer
from fxpar.core.geometry import Grid, Rect
from fxpar.core.messages import Message, messages, transfer_kind
from fxpar.core.outputs import from_leaves, leaves_of
from fxpar.core.schedule import Action, Schedule, format_grid, split_keys
from fxpar.core.stages import StageGraph, Transfer
from fxpar.core.wire import Order
from fxpar.runtime.clock import ActionTime, Clock
from fxpar.runtime.inductor import CompiledStages
from fxpar.runtime.recompute import Record, buffers, recording, replaying, restore
from fxpar.runtime.segments import Segmented, segmented
from fxpar.runtime.splitgrad import WeightWork, backward_inputs

LossFn = Callable[[Any, Any], torch.Tensor]
FORWARD = frozenset({"F", "SEND_F", "RECV_F"})
"""The actions of a forward pass alone (inference): ``Runtime.run(state, FORWARD)``."""
Key = tuple[int, int, int]  # (copy, stage, micro-batch)


@dataclass(frozen=True)
class Posted:
    """A receive in flight: into ``buf``, which is ``rect`` of the transfer's whole tensor
    (None: the whole tensor, or this rank's tile of it)."""

    transfer: Transfer
    buf: torch.Tensor
    req: Request
    rect: Rect | None = None


@dataclass(frozen=True)
class LossTiles:
    """How the ranks of a tiled output compute its loss (fxpar.compiler.loss): ``build(tile,
    copy)`` gives the module ``(*output leaves on the tile, *targets) -> loss``, whole on every
    rank of the tile group; ``sliced[i]``: target i is cut to the tile (else passed whole);
    ``joined``: why the output is joined for the loss instead ('' when its reductions run on
    tiles)."""

    build: Callable[[int, int], torch.nn.Module]
    sliced: tuple[bool, ...]
    joined: str = ""
    extents: tuple[tuple[int, ...], ...] = ()
    """Per sliced target, the image size it is cut at (the tiles of the output leaf of that
    size: a deep-supervision target at half size is cut as the half-size head is); empty: the
    output's."""


def targets_of(y: Any) -> tuple[Any, ...]:
    """A chunk's targets as ``loss_fn``'s arguments after the output: a tuple (a target and a
    mask) is several, anything else (a tensor, a list of per-image dicts) one."""
    return y if isinstance(y, tuple) else (y,)


@dataclass(frozen=True)
class Tiling:
    """This rank's place in the spatial layout (absent for non-spatial plans)."""

    grid: Grid
    tiles: dict[int, int]
    """copy -> this rank's tile in that copy's spatial stage."""
    spatial_stages: int
    out_tiled: bool
    """The model output is tiled (a loss on tiles) rather than replicated."""
    out_extent: tuple[int, ...]

    def spatial(self, stage: int) -> bool:
        return stage < self.spatial_stages

    def rect(self, extent: tuple[int, ...], tile: int) -> Rect:
        return self.grid.tile_rect(extent, tile)


@dataclass
class StepState:
    """Everything one step carries between actions."""

    x_chunks: list[torch.Tensor]
    y_chunks: list[Any]
    scale: float
    train: bool = True
    step: int = 0
    """The training step (1-based, as the rank program counts them); 0 for inference."""
    inputs: dict[Key, list[torch.Tensor]] = field(default_factory=dict)
    outputs: dict[Key, tuple[Any, ...]] = field(default_factory=dict)
    losses: list[torch.Tensor] = field(default_factory=list)
    results: dict[int, Any] = field(default_factory=dict)
    recv_f: dict[Key, list[Posted]] = field(default_factory=dict)
    recv_b: dict[Key, list[Posted]] = field(default_factory=dict)
    grads: dict[Key, list[torch.Tensor | None]] = field(default_factory=dict)
    sends: list[Request] = field(default_factory=list)
    records: dict[Key, Record] = field(default_factory=dict)
    """Recomputed stages: what their first forward exchanged (fxpar.runtime.recompute)."""
    weights: dict[Key, WeightWork] = field(default_factory=dict)
    """Split backwards: what each W still has to do (fxpar.runtime.splitgrad)."""


class ActionFailed(RuntimeError):
    """An action raised; the message holds the schedule grid with the failing cell marked."""


@dataclass
class Runtime:
    """Executes one rank's actions for the stages it holds."""

    rank: int
    graph: StageGraph
    stages: dict[tuple[int, int], fx.GraphModule]
    """(copy, stage) -> module, for the stages this rank holds."""
    peer: Callable[[int, int, int], int]
    """(copy, stage, tile) -> the rank that runs it (in this rank's data-parallel replica)."""
    schedule: Schedule
    loss_fn: LossFn
    optimizer: torch.optim.Optimizer | None
    comm: Comm | None
    microbatches: int
    """Micro-batches each model copy runs per step (GEMS rounds included)."""
    tiling: Tiling | None = None
    chunk: Callable[[int, int], int] = lambda copy, mb: mb
    """(copy, micro-batch) -> index of the global batch chunk it trains on."""
    sync: Callable[[], None] = lambda: None
    """Sums gradients over the stage groups (the ALLREDUCE action)."""
    timeline: list[ActionTime] | None = None
    """When a list, every action run appends its :class:`ActionTime` (see the module doc)."""
    clock: Clock | None = None
    """With a timeline: marks each action on the device's queue too (CUDA events)."""
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    """Where receive buffers and zero gradients are made (the stage modules' device)."""
    recompute: frozenset[int] = frozenset()
    """Stages whose forward runs without autograd at F and again, with it, at B
    (``Plan.recompute``; fxpar.runtime.recompute)."""
    before_step: Callable[[StepState], bool] = lambda st: True
    """Called by STEP before the optimizer step, on every rank; False skips the step (a
    float16 loss scale saw an inf, or a NaN with ``nonfinite="skip"``: fxpar.runtime.scale)."""
    fault: Callable[[Action], bool] | None = None
    """``FXPAR_FAULT`` for this step (fxpar.runtime.inject): called before each forward; True
    poisons its inputs with NaN."""
    segments: int = 1
    """Checkpoint segments per stage (``Plan.recompute_segments``; fxpar.runtime.segments)."""
    _segmented: dict[int, Segmented] = field(default_factory=dict, repr=False)
    precision: torch.dtype | None = None
    """The compute dtype of a mixed-precision plan: the loss runs under ``torch.autocast``
    in it, as in a user's autocast block (the stages' casts are graph nodes already:
    fxpar.passes.precision)."""
    tile_loss: Callable[[int, int, tuple[torch.Tensor, ...], Any], torch.Tensor] | None = None
    """(copy, tile, the output's leaves on this tile, the chunk's whole targets) -> the loss,
    whole on every rank of the tile group, for a tiled output (the rank program's
    :class:`LossTiles`)."""
    wire: Callable[[frozenset[str] | None], Order] | None = None
    """This rank's point-to-point messages in the order each peer issues them too, for the
    schedule (or its actions of the given kinds): fxpar.core.wire. None: issued as posted."""
    compiled: CompiledStages | None = None
    """``Plan(compile=True)``: the stage modules through torch.compile (fxpar.runtime.inductor),
    called in their place (not when cut into checkpoint segments)."""
    _waited: float = field(default=0.0, repr=False)
    _p2p: Sequencer | None = field(default=None, repr=False)

    def run(self, state: StepState, only: frozenset[str] | None = None) -> None:
        """The loop: every action of this rank (of the kinds ``only``, when given), in order.
        Point-to-point messages go out in the order agreed with each peer
        (fxpar.comm.ordered.Sequencer), which NCCL needs and MPI does not mind."""
        handlers: dict[str, Callable[[Action, StepState], None]] = {
            "F": self._forward, "B": self._backward, "W": self._weights, "STEP": self._step,
            "SEND_F": self._send_f, "RECV_F": self._recv_f,
            "SEND_B": self._send_b, "RECV_B": self._recv_b, "ALLREDUCE": self._allreduce,
        }
        todo = [a for a in self.schedule[self.rank] if only is None or a.kind in only]
        if self.wire is not None and self.comm is not None:
            self._p2p = Sequencer(self.comm, self.wire(only))
        early: set[int] = set()
        for i, action in enumerate(todo):
            if i in early:
                continue
            watchdog.doing(action, i)
            try:
                if action.kind in ("F", "B"):
                    early.update(self._post_early(todo, i, state, handlers))
                if self.timeline is None:
                    handlers[action.kind](action, state)
                else:
                    self._waited = 0.0
                    first = self.clock.mark() if self.clock is not None else None
                    start = time.perf_counter()
                    handlers[action.kind](action, state)
                    end = time.perf_counter()
                    marks = (first, self.clock.mark()) if self.clock is not None else None
                    self.timeline.append(ActionTime(action, start, end, self._waited, marks))
            except Exception as e:
                mark = (self.rank, i) if only is None else None
                grid = format_grid(self.schedule, mark=mark)
                print(f"[fxpar rank {self.rank}] action {action} failed: "
                      f"{type(e).__name__}: {e}\n{grid}", file=sys.stderr, flush=True)
                when = f"step {state.step}" if state.step else "forward"
                raise ActionFailed(f"rank {self.rank}, {when}, action {action}: "
                                   f"{type(e).__name__}: {e}") from e
        Comm.waitall(state.sends)
        state.sends.clear()
        left = self._p2p.unissued() if self._p2p is not None else []
        if left:
            raise RuntimeError(f"rank {self.rank} ended its step with messages it never "
                               f"issued: {'; '.join(left[:4])} (a bug in fxpar's schedule)")

    def _post_early(self, todo: list[Action], i: int, state: StepState,
                    handlers: dict[str, Callable[[Action, StepState], None]]) -> list[int]:
        """Post the receives listed between compute action ``i`` and the next one before
        running ``i``: their data can then arrive while ``i`` computes. Returns their
        indices (the loop skips them later; a timeline lists them when they ran)."""
        done = []
        for j in range(i + 1, len(todo)):
            kind = todo[j].kind
            if kind in ("F", "B", "STEP", "ALLREDUCE"):
                break
            if kind in ("RECV_F", "RECV_B"):
                start = time.perf_counter()
                handlers[kind](todo[j], state)
                if self.timeline is not None:
                    self.timeline.append(ActionTime(todo[j], start, time.perf_counter(), 0.0))
                done.append(j)
        return done

    def _block(self, wait: Callable[[], object]) -> None:
        """Run a blocking communication call; when recording, its time is the action's wait."""
        if self.timeline is None:
            wait()
            return
        start = time.perf_counter()
        wait()
        self._waited += time.perf_counter() - start

    def _assert_comm(self) -> Comm | Sequencer:
        """What point-to-point messages go through: the step's sequencer, else the
        communicator."""
        if self.comm is None:
            raise RuntimeError("this rank program has no communicator: use program.local() "
                               "under mpiexec")
        return self._p2p if self._p2p is not None else self.comm

    # -- compute ------------------------------------------------------------------------------
    def _forward(self, a: Action, st: StepState) -> None:
        key = (a.copy, a.stage, a.mb)
        module = self.stages[(a.copy, a.stage)]
        poison = self.fault is not None and self.fault(a)
        received: dict[int, torch.Tensor] = {}
        for p in st.recv_f.pop(key, []):
            self._block(p.req.wait)
            if p.rect is None:
                received[p.transfer.id] = p.buf
                continue
            whole = received.setdefault(p.transfer.id, torch.empty(p.transfer.shape,
                                                                   dtype=p.transfer.dtype,
                                                                   device=self.device))
            full = Rect.whole(whole.shape[2:])
            whole[(slice(None), slice(None), *full.local(p.rect))] = p.buf
        ins: list[torch.Tensor] = []
        for src in self.graph.inputs[a.stage]:
            if src.source == "batch":
                x = st.x_chunks[self.chunk(a.copy, a.mb)]
                ins.append(x * math.nan if poison and x.is_floating_point() else x)
            else:
                buf = received[src.index]
                if poison and buf.is_floating_point():
                    buf.mul_(math.nan)
                if st.train and buf.is_floating_point():
                    buf.requires_grad_(True)
                ins.append(buf)
        st.inputs[key] = ins
        if st.train and self.graph.mutated_inputs:
            ins = [x.clone() if i in self.graph.mutated_inputs[a.stage] and x.requires_grad
                   else x for i, x in enumerate(ins)]
        if st.train and a.stage in self.recompute:  # nothing saved: the B recomputes it
            with torch.no_grad(), recording(self.device) as st.records[key]:
                outs = self._run(a, st, module, ins)
            st.outputs[key] = outs
            return
        with torch.set_grad_enabled(st.train):
            st.outputs[key] = self._run(a, st, module, ins)

    def _run(self, a: Action, st: StepState, module: fx.GraphModule,
             ins: list[torch.Tensor]) -> tuple[Any, ...]:
        """The stage's outputs; for the last stage in training, its scaled loss, recorded once
        per step (not again when a recompute runs it a second time)."""
        if self.segments > 1 and st.train and torch.is_grad_enabled():
            outs = segmented(self._segmented, module, self.segments, self.device)(*ins)
        elif self.compiled is not None:
            outs = self.compiled((a.copy, a.stage), module, *ins)
        else:
            outs = module(*ins)
        if a.stage != len(self.graph.modules) - 1:
            return outs
        result = outs[0]
        if not st.train:
            st.results[self.chunk(a.copy, a.mb)] = result
            return outs
        target = st.y_chunks[self.chunk(a.copy, a.mb)]
        if self.precision is None:
            loss = self._loss(a, result, target)
        else:
            with torch.autocast(self.device.type, dtype=self.precision):
                loss = self._loss(a, result, target)
        scale = st.scale * self._loss_share(a)
        if scale != 1.0:
            loss = loss * scale
        if not (torch.is_grad_enabled() and (a.copy, a.stage, a.mb) in st.records):
            st.losses.append(loss.detach())
        return (loss,)

    def _recompute(self, a: Action, st: StepState) -> tuple[Any, ...]:
        """A recomputed stage's forward again, with autograd, replaying its first forward's
        exchanges (fxpar.runtime.recompute); its buffers go back after the backward."""
        key = (a.copy, a.stage, a.mb)
        module = self.stages[(a.copy, a.stage)]
        ins = st.inputs[key]
        if self.graph.mutated_inputs:
            ins = [x.clone() if i in self.graph.mutated_inputs[a.stage] and x.requires_grad
                   else x for i, x in enumerate(ins)]
        with torch.enable_grad(), replaying(st.records[key]):
            outs = self._run(a, st, module, ins)
        del st.records[key]
        return outs

    def _backward(self, a: Action, st: StepState) -> None:
        key = (a.copy, a.stage, a.mb)
        outs = st.outputs.pop(key)
        recomputed = key in st.records
        if not recomputed and self.segments == 1:
            self._backward_of(a, st, outs)
            return
        # a recompute (of the stage, or of its checkpoint segments inside the backward)
        # updates the buffers a second time: they go back once the backward is done
        module = self.stages[(a.copy, a.stage)]
        saved = buffers(module)
        if recomputed:
            outs = self._recompute(a, st)
        try:
            self._backward_of(a, st, outs)
        finally:
            restore(module, saved)

    def _backward_of(self, a: Action, st: StepState, outs: tuple[Any, ...]) -> None:
        key = (a.copy, a.stage, a.mb)
        roots: list[torch.Tensor] = []
        seeds: list[torch.Tensor | None] = []
        if a.stage == len(self.graph.modules) - 1:
            roots, seeds = [outs[0]], [None]
        else:
            grads: list[torch.Tensor | None] = [None] * len(outs)
            for p in st.recv_b.pop(key, []):
                self._block(p.req.wait)
                g = grads[p.transfer.src_out]
                grads[p.transfer.src_out] = p.buf if g is None else g + p.buf
            if self._my_tile(a) != 0:
                # a replicated output's gradient came to tile 0; the other tiles' share is
                # zero, but they must run the same backward (its halos and allreduces)
                for t in self.graph.sends(a.stage):
                    if t.grad and self._kind(t) == "replicated" and grads[t.src_out] is None:
                        grads[t.src_out] = torch.zeros_like(outs[t.src_out])
            pairs = [(o, g) for o, g in zip(outs, grads, strict=True)
                     if g is not None and isinstance(o, torch.Tensor) and o.requires_grad]
            roots, seeds = [o for o, _ in pairs], [g for _, g in pairs]
        if key in self._split:  # input gradients now, weight gradients at the W
            ins = st.inputs.pop(key)
            if not roots:
                st.grads[key], st.weights[key] = [None] * len(ins), WeightWork([])
                return
            module = self.stages[(a.copy, a.stage)]
            st.grads[key], st.weights[key] = backward_inputs(roots, seeds, ins,
                                                             list(module.parameters()))
            return
        if roots:
            torch.autograd.backward(roots, seeds)
        st.grads[key] = [x.grad for x in st.inputs.pop(key)]

    @cached_property
    def _split(self) -> frozenset[Key]:
        """The (copy, stage, micro-batch) whose backward this rank's schedule splits."""
        return split_keys([self.schedule[self.rank]])

    def _weights(self, a: Action, st: StepState) -> None:
        """W: the weight gradients of a split backward (fxpar.runtime.splitgrad)."""
        st.weights.pop((a.copy, a.stage, a.mb)).run()

    def _step(self, a: Action, st: StepState) -> None:
        self._block(lambda: Comm.waitall(st.sends))
        st.sends.clear()
        go = self.before_step(st)
        if self.optimizer is not None and go:
            self.optimizer.step()

    def _allreduce(self, a: Action, st: StepState) -> None:
        """Sum gradients over each stage group (tiles, GEMS copies, replicas)."""
        self._block(lambda: Comm.waitall(st.sends))
        st.sends.clear()
        self._block(self.sync)

    # -- spatial helpers ----------------------------------------------------------------------
    def _loss(self, a: Action, result: Any, target: Any) -> torch.Tensor:
        """The chunk's loss: on a tiled output through :attr:`tile_loss`, else ``loss_fn``."""
        tl, spec = self.tiling, self.graph.out_spec
        leaves = leaves_of(spec, result)
        if tl is not None and tl.spatial(a.stage) and tl.out_tiled:
            if self.tile_loss is None:
                raise RuntimeError("a tiled output needs the rank program's tile_loss")
            return self.tile_loss(a.copy, self._my_tile(a), leaves, target)
        return self.loss_fn(from_leaves(spec, leaves), *targets_of(target))

    def _loss_share(self, a: Action) -> float:
        """The part of the loss this rank carries: 1/P in a spatial stage, where the loss is
        whole on every rank of the tile group."""
        tl = self.tiling
        if tl is None or not tl.spatial(a.stage):
            return 1.0
        return 1.0 / tl.grid.size

    def _kind(self, t: Transfer) -> str:
        """p2p, tile, gather or replicated (fxpar.core.messages.transfer_kind)."""
        return transfer_kind(t, self.tiling.spatial_stages if self.tiling is not None else 0)

    def _my_tile(self, a: Action) -> int:
        return self.tiling.tiles.get(a.copy, 0) if self.tiling is not None else 0

    # -- communication: what each action exchanges is fxpar.core.messages' data ----------------
    def _messages(self, a: Action) -> list[Message]:
        tl = self.tiling
        if tl is None:
            return messages(a, self.graph, self.microbatches)
        return messages(a, self.graph, self.microbatches, tl.grid, tl.spatial_stages,
                        self._my_tile(a))

    def _post(self, a: Action) -> list[Posted]:
        """Post the receives of ``a`` (RECV_F or RECV_B), each into a fresh buffer."""
        comm = self._assert_comm()
        posted: list[Posted] = []
        for m in self._messages(a):
            buf = torch.empty(m.shape, dtype=m.transfer.dtype, device=self.device)
            req = comm.irecv(buf, self.peer(a.copy, m.stage, m.tile), m.tag)
            posted.append(Posted(m.transfer, buf, req, m.rect))
        return posted

    def _recv_f(self, a: Action, st: StepState) -> None:
        st.recv_f[(a.copy, a.stage, a.mb)] = self._post(a)

    def _recv_b(self, a: Action, st: StepState) -> None:
        st.recv_b[(a.copy, a.stage, a.mb)] = self._post(a)

    def _send_f(self, a: Action, st: StepState) -> None:
        comm = self._assert_comm()
        outs = st.outputs[(a.copy, a.stage, a.mb)]
        for m in self._messages(a):
            st.sends.append(comm.isend(outs[m.transfer.src_out].detach(),
                                       self.peer(a.copy, m.stage, m.tile), m.tag))
        if not st.train:
            del st.outputs[(a.copy, a.stage, a.mb)]  # nothing will run backward on it

    def _send_b(self, a: Action, st: StepState) -> None:
        comm = self._assert_comm()
        grads = st.grads.pop((a.copy, a.stage, a.mb))
        wholes: dict[int, torch.Tensor] = {}  # a gathered tensor's gradient, cut per tile
        for m in self._messages(a):
            t = m.transfer
            g = grads[t.dst_in]
            if m.rect is not None:
                if t.id not in wholes:
                    wholes[t.id] = torch.zeros(t.shape, dtype=t.dtype, device=self.device) \
                        if g is None else g
                full = Rect.whole(t.shape[2:])
                g = wholes[t.id][(slice(None), slice(None), *full.local(m.rect))]
            elif g is None:
                g = torch.zeros(m.shape, dtype=t.dtype, device=self.device)
            st.sends.append(comm.isend(g, self.peer(a.copy, m.stage, m.tile), m.tag))
