"""Estimated peak memory of each rank of a compiled program (``fxpar-inspect --memory``).

An estimate from the analysed graph, before anything runs, to choose a plan that fits:

- parameters (and buffers) of the stages the rank holds, per role (a GEMS mirror holds its own
  copy); gradients: one per trainable parameter; optimizer state: one momentum buffer per
  trainable parameter (SGD with momentum; Adam would hold two);
- activations kept for backward: the output bytes of the stage's nodes for one micro-batch
  (``NodeCost.out_bytes``), times the micro-batches in flight on that stage, read off the
  program's schedule (:func:`schedule_in_flight`; GPipe: all m of its copy; 1F1B:
  ``min(m, stages - stage)``; zero bubble: ``min(m, stages)`` on every stage). On a spatial
  stage a tiled node's output is split over the P tiles, and each halo adds what it keeps for
  backward: a fused ``HaloOp`` the pieces it received, a plain ``Halo`` its whole window (the
  op after it saves that);
- received buffers: the tensors received from earlier stages (kept as inputs for backward, so
  also per micro-batch in flight) plus one micro-batch of gradients received from later stages.

Not counted: the model input batch, temporaries inside an op, allocator overhead.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import fx, nn

from fxpar.core import meta
from fxpar.core.geometry import Rect
from fxpar.core.meta import NodeCost, TensorInfo
from fxpar.core.roles import chunks_per_copy
from fxpar.core.schedule import Schedule, split_keys
from fxpar.core.stages import Transfer
from fxpar.core.units import nbytes
from fxpar.passes.spatial_region import SpatialLayout
from fxpar.passes.split_stages import StageAssignment, compute_nodes
from fxpar.runtime.segments import cut
from fxpar.runtime.spatial.ops import Halo, HaloOp

if TYPE_CHECKING:
    from fxpar.program.program import Program

HEADER = ("estimated peak memory per rank\n"
          "  optimizer state: SGD with momentum = 1x the trainable parameters; params include "
          "buffers\n"
          "  activations: one micro-batch's node outputs x micro-batches in flight (from the "
          "schedule: GPipe m, 1F1B min(m, stages - stage), zero bubble min(m, stages)); "
          "spatial stages: 1/P of tiled outputs + halos; "
          "recomputed stages: one micro-batch + the halos of those in flight\n"
          "  received: inputs from earlier stages per micro-batch in flight + one micro-batch "
          "of gradients\n"
          "  not counted: the input batch, temporaries inside ops, allocator overhead")


@dataclass(frozen=True)
class RankMemory:
    """Bytes one rank holds at its peak, by kind."""

    rank: int
    roles: str
    params: int
    grads: int
    optimizer: int
    activations: int
    received: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.activations + self.received


def in_flight(program: Program, stage: int) -> int:
    """Micro-batches whose activations a stage holds at once (per model copy), from the
    program's schedule (:func:`schedule_in_flight`)."""
    return schedule_in_flight(program.schedule).get(stage, chunks_per_copy(program.plan))


def schedule_in_flight(schedule: Schedule) -> dict[int, int]:
    """Per stage, the most micro-batches of one model copy whose activations it holds at once
    on any rank: over each rank's list, the forwards done minus the backwards that freed their
    activations (a W, where the schedule splits the backward: its B frees nothing, W still
    needs them; else the B). Every schedule is covered, whatever its order."""
    split = split_keys(schedule.values())
    out: dict[int, int] = {}
    for acts in schedule.values():
        held: Counter[tuple[int, int]] = Counter()
        for a in acts:
            if a.kind == "F":
                held[a.copy, a.stage] += 1
                out[a.stage] = max(out.get(a.stage, 0), held[a.copy, a.stage])
            elif a.kind == "W" or (a.kind == "B" and (a.copy, a.stage, a.mb) not in split):
                held[a.copy, a.stage] -= 1
    return out


def peak_bytes(act: Sequence[int], params: Sequence[int], sent: Sequence[int],
               held: Mapping[int, Sequence[int]], flights: Mapping[int, int],
               recompute: bool = False) -> int:
    """The fullest rank's bytes of a plan the planner costs without compiling it
    (fxpar.planner.planspace), with the terms of :func:`estimate`: per rank, for each stage i
    it holds (``held``), ``act[i]`` bytes kept per micro-batch and the ``sent[i - 1]`` bytes it
    received, for each of the ``flights[i]`` micro-batches in flight (only one micro-batch's
    activations when ``recompute``), parameters, gradients and momentum (3 x ``params[i]``),
    and one micro-batch of gradients of what it sends on."""
    k = len(act)
    out = 0
    for stages in held.values():
        total = 0
        for i in stages:
            received = sent[i - 1] if i > 0 else 0
            if recompute:
                total += act[i] + flights[i] * received
            else:
                total += flights[i] * (act[i] + received)
            total += 3 * params[i] + (sent[i] if i < k - 1 else 0)
        out = max(out, total)
    return out


def _tensor_bytes(ts: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


def _area(r: Rect | None) -> int:
    return 0 if r is None else r.size


def halo_bytes(module: fx.GraphModule) -> int:
    """Bytes a tile module's halos keep for backward beyond the tiles themselves, per
    micro-batch: a ``HaloOp`` (halo fused with its conv or pool) keeps only the cells it
    received, a ``Halo`` produces its whole window as a new tensor. Cells x batch x channels."""
    total = 0
    for n in module.graph.nodes:
        if n.op != "call_module":
            continue
        mod = module.get_submodule(str(n.target))
        if not isinstance(mod, (Halo, HaloOp)):
            continue
        cell = meta.get(n.args[0], TensorInfo).cell_bytes
        ex = mod.exchange
        cells = _area(ex.need) if isinstance(mod, Halo) else \
            0 if mod.replicated else ex.recv_elements()
        total += cells * cell
    return total


def activation_bytes(program: Program, stage: int, tile: int = 0) -> int:
    """Bytes of one micro-batch's node outputs on one rank of ``stage`` (halos included)."""
    return _node_bytes(program, stage) + _halo_part(program, stage, tile)


def _halo_part(program: Program, stage: int, tile: int) -> int:
    if program.spatial is not None and stage < program.spatial.spatial_stages:
        return halo_bytes(program.spatial.tile(stage, tile))
    return 0


def kept_bytes(program: Program, stage: int, tile: int = 0) -> int:
    """Activations one rank of ``stage`` keeps at its peak: one micro-batch's node outputs per
    micro-batch in flight; with ``Plan.recompute`` on that stage, only one micro-batch's (the
    one being recomputed) plus the halo pieces each micro-batch in flight received (kept to
    replay them, fxpar.runtime.recompute)."""
    flight = in_flight(program, stage)
    nodes, halos = _node_bytes(program, stage), _halo_part(program, stage, tile)
    if program.plan.recompute_segments > 1:
        nodes = min(nodes, _segment_bytes(program, stage))
    if stage in program.recompute:
        return nodes + halos * flight
    return (nodes + halos) * flight


def _segment_bytes(program: Program, stage: int) -> int:
    """With checkpoint segments (fxpar.runtime.segments): the segments' boundary tensors, kept
    through the forward, plus the largest segment, recomputed at its backward."""
    parts = program.plan.group_size(stage)

    def weight(n: fx.Node) -> float:
        c, lay = meta.find(n, NodeCost), meta.find(n, SpatialLayout)
        if c is None:
            return 0.0
        return c.out_bytes / (parts if lay is not None and lay.tiled else 1)

    segments = cut(program.graph.modules[stage], program.plan.recompute_segments)
    kept = sum(weight(n) for s in segments for n in s.outputs)
    return int(kept + max(sum(weight(n) for n in s.nodes) for s in segments))


def _node_bytes(program: Program, stage: int) -> int:
    gm = program.traced
    assert gm is not None, "the program has no analysed graph"
    parts = program.plan.group_size(stage)
    total = 0.0
    for n in compute_nodes(gm):
        if meta.get(n, StageAssignment).stage != stage:
            continue
        c = meta.find(n, NodeCost)
        lay = meta.find(n, SpatialLayout)
        if c is not None:
            total += c.out_bytes / (parts if lay is not None and lay.tiled else 1)
    return int(total)


def _share(program: Program, t: Transfer, stage: int, tile: int) -> int:
    """Bytes of transfer ``t`` (or of its gradient) that tile ``tile`` of ``stage`` holds: its
    tile of a tiled tensor; a whole tensor that a spatial stage sends comes from (and its
    gradient goes back to) tile 0 only."""
    parts = program.plan.group_size(stage)
    if parts == 1:
        return t.nbytes
    if t.tiled:
        return t.nbytes // parts
    return t.nbytes if tile == 0 or t.dst == stage else 0


def received_bytes(program: Program, stage: int, tile: int = 0) -> int:
    """Inputs from earlier stages for every micro-batch in flight, plus one micro-batch of
    gradients from later stages."""
    g = program.graph
    inputs = sum(_share(program, t, stage, tile) for t in g.recvs(stage))
    grads = sum(_share(program, t, stage, tile) for t in g.sends(stage) if t.grad)
    return inputs * in_flight(program, stage) + grads


def estimate(program: Program) -> list[RankMemory]:
    """One :class:`RankMemory` per rank."""
    out = []
    for rank in range(program.world_size):
        sums = [0, 0, 0, 0]
        names = []
        for role in program.rank_map.roles_of(rank):
            module: nn.Module = program.graph.modules[role.stage]
            trainable = _tensor_bytes([p for p in module.parameters() if p.requires_grad])
            sums[0] += _tensor_bytes([*module.parameters(), *module.buffers()])
            sums[1] += trainable
            sums[2] += kept_bytes(program, role.stage, role.tile)
            sums[3] += received_bytes(program, role.stage, role.tile)
            names.append(f"c{role.copy}.s{role.stage}" +
                         (f".t{role.tile}" if program.plan.group_size(role.stage) > 1 else ""))
        out.append(RankMemory(rank, " ".join(names), sums[0], sums[1], sums[1], sums[2],
                              sums[3]))
    return out


def memory_table(program: Program) -> str:
    """The estimate as a table, one row per rank."""
    rows = [("rank", "roles", "params", "grads", "optimizer", "activations", "received",
             "total")]
    for m in estimate(program):
        rows.append((str(m.rank), m.roles, *(nbytes(v) for v in (
            m.params, m.grads, m.optimizer, m.activations, m.received, m.total))))
    widths = [max(len(r[k]) for r in rows) for k in range(len(rows[0]))]
    lines = ["  ".join(v.ljust(w) if k == 1 else v.rjust(w)
                       for k, (v, w) in enumerate(zip(r, widths, strict=True))).rstrip()
             for r in rows]
    head = HEADER
    if program.recompute:
        head += (f"\n  recomputed stages ({program.plan.recompute}): "
                 f"{', '.join(map(str, sorted(program.recompute)))}")
    return "\n".join([head, *lines])


class MemoryWarning(UserWarning):
    """A plan whose estimated memory per rank exceeds ``Plan.memory_per_rank`` even with every
    stage recomputed."""


def choose_recompute(program: Program, budget: int) -> frozenset[int]:
    """``Plan(recompute="auto")``: the stages to recompute so that every rank's estimate fits
    ``budget`` bytes. Greedy: while a rank is over, recompute the stage it holds that saves the
    most; none when everything fits. Warns (MemoryWarning) when recomputing every stage is not
    enough, naming the rank and what it needs."""
    chosen: frozenset[int] = frozenset()
    while True:
        now = estimate(dataclasses.replace(program, recompute=chosen))
        over = [m for m in now if m.total > budget]
        if not over:
            return chosen
        worst = max(over, key=lambda m: m.total)
        held = {role.stage for role in program.rank_map.roles_of(worst.rank)} - chosen
        if not held:
            warnings.warn(
                f"memory_per_rank={nbytes(budget)}: rank {worst.rank} needs about "
                f"{nbytes(worst.total)} even with every stage it holds recomputed "
                f"({nbytes(worst.params + worst.grads + worst.optimizer)} of parameters, "
                f"gradients and optimizer state, {nbytes(worst.activations)} of activations): "
                f"use more stages or spatial parts, fewer micro-batches in flight, or a larger "
                f"budget", MemoryWarning, stacklevel=3)
            return chosen
        total = sum(m.total for m in now)
        saving = {s: total - sum(m.total for m in estimate(
            dataclasses.replace(program, recompute=chosen | {s}))) for s in sorted(held)}
        chosen = chosen | {max(saving, key=lambda s: saving[s])}
