"""What the compiler emits: a :class:`Program` for the whole job, a :class:`RankProgram` each rank.

A Program is plain data (the plan, the rank map, the stage graphs, the schedule); a RankProgram
binds one rank's share of it to real parameters, an optimizer and a communicator::

    program = fxpar.compile(model, plan, example, loss_fn=..., optimizer=...)
    rp = program.local()          # this MPI rank's program
    loss = rp.train_step(x, y)    # global batch in, global mean loss out, on every rank
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx, nn

from fxpar.comm import Comm
from fxpar.plan import Plan, PlanError, RankMap
from fxpar.runtime import LossFn, Runtime, StepState, Tiling
from fxpar.schedule import Action, Schedule
from fxpar.spatial.geometry import Grid
from fxpar.spatial.ops import Join, group_key, set_group
from fxpar.stages import StageGraph

OptimizerFactory = Callable[[Iterator[nn.Parameter]], torch.optim.Optimizer]


@dataclass(frozen=True)
class SpatialInfo:
    """The tile programs of the spatial stages, and how the model output is laid out."""

    build: Callable[[int, int], fx.GraphModule]
    """(stage, tile) -> that tile's rewritten stage module (built on first use: a rank only
    builds its own tile)."""
    grid: Grid
    spatial_stages: int
    out_tiled: bool
    out_extent: tuple[int, int]
    _cache: dict[tuple[int, int], fx.GraphModule] = field(default_factory=dict)

    def tile(self, stage: int, tile: int) -> fx.GraphModule:
        key = (stage, tile)
        if key not in self._cache:
            self._cache[key] = self.build(stage, tile)
        return self._cache[key]

    @property
    def tiles(self) -> dict[tuple[int, int], fx.GraphModule]:
        """Every tile program (builds them all)."""
        return {(s, t): self.tile(s, t) for s in range(self.spatial_stages)
                for t in range(self.grid.size)}

# Environment variables an MPI launcher sets in every rank (MPICH/Hydra, Open MPI, Slurm).
_LAUNCHER_VARS = ("PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_RANK")


@dataclass(frozen=True)
class Program:
    """The compiled job: every rank's stages and actions. Build rank programs from it."""

    plan: Plan
    rank_map: RankMap
    graph: StageGraph
    schedule: Schedule
    loss_fn: LossFn
    optimizer: OptimizerFactory | None
    batch_size: int
    """The global batch size the program was compiled for."""
    names: tuple[str, ...] = ()
    """The original model's state_dict keys, in its order (rank programs list theirs so)."""
    traced: fx.GraphModule | None = None
    """The whole analysed graph after all passes (per micro-batch shapes), for inspection."""
    spatial: SpatialInfo | None = None

    @property
    def world_size(self) -> int:
        """Ranks the plan needs (``mpiexec -n``)."""
        return self.plan.world_size

    @functools.cached_property
    def name_order(self) -> dict[str, int]:
        return {n: i for i, n in enumerate(self.names)}

    def for_rank(self, rank: int, comm: Comm | None = None) -> RankProgram:
        """Rank ``rank``'s program. Its modules share parameters with the compiled model."""
        if not 0 <= rank < self.world_size:
            raise PlanError(f"rank {rank} is outside this plan's {self.world_size} ranks")
        stages = {}
        for r in self.rank_map.roles_of(rank):
            if self.spatial is not None and r.stage < self.spatial.spatial_stages:
                stages[(r.copy, r.stage)] = self.spatial.tile(r.stage, r.tile)
            else:
                stages[(r.copy, r.stage)] = self.graph.modules[r.stage]
        return RankProgram(self, rank, stages, comm)

    def local(self, comm: Comm | None = None) -> RankProgram:
        """This process's rank program: rank 0 when not launched by MPI and the plan needs one
        rank, else the MPI rank (after checking ``mpiexec -n`` matches the plan).

        comm: run on this communicator instead of every rank of the job."""
        if comm is None and self.world_size == 1 and \
                not any(v in os.environ for v in _LAUNCHER_VARS):
            return self.for_rank(0)
        from fxpar.comm import world

        comm = comm if comm is not None else world()
        if comm.size != self.world_size:
            raise PlanError(
                f"this plan needs {self.world_size} ranks but the job has {comm.size}: "
                f"run with `mpiexec -n {self.world_size}` (or change the plan)")
        return self.for_rank(comm.rank, comm)


class RankProgram:
    """One rank's share of a Program, ready to train."""

    def __init__(self, program: Program, rank: int,
                 stages: dict[tuple[int, int], fx.GraphModule], comm: Comm | None) -> None:
        self.program = program
        self.rank = rank
        self.stages = stages
        self.comm = comm
        params = list(self.parameters())
        self.optimizer = program.optimizer(iter(params)) if program.optimizer else None
        rank_map, dp = program.rank_map, program.rank_map.dp_index(rank)
        self.runtime = Runtime(
            rank, program.graph, stages,
            lambda copy, stage, tile: rank_map.rank_of(dp, copy, stage, tile),
            program.schedule, program.loss_fn, self.optimizer, comm, program.plan.microbatches,
            self._tiling())

    def _tiling(self) -> Tiling | None:
        """This rank's tile and tile group (a collective over all ranks: every rank calls it
        once, in rank-program construction)."""
        info = self.program.spatial
        if info is None:
            return None
        role = self.program.rank_map.roles_of(self.rank)[0]
        plan = self.program.plan
        group = None
        if self.comm is not None:
            spatial = role.stage < plan.spatial_stages
            color = (self.program.rank_map.dp_index(self.rank) * plan.stages + role.stage
                     if spatial else plan.world_size + self.rank)
            group = self.comm.split(color, key=role.tile)
            if spatial:
                set_group(group_key(role.stage, role.copy), group)
        return Tiling(info.grid, role.tile, plan.spatial_stages, info.out_tiled,
                      info.out_extent, group)

    @property
    def plan(self) -> Plan:
        return self.program.plan

    def _modules(self) -> list[nn.Module]:
        seen: dict[int, nn.Module] = {}
        for m in self.stages.values():
            seen.setdefault(id(m), m)
        return list(seen.values())

    def parameters(self) -> Iterator[nn.Parameter]:
        """This rank's parameters (each once)."""
        for _, p in self.named_parameters():
            yield p

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """This rank's parameters under the original model's names."""
        seen: dict[int, tuple[str, nn.Parameter]] = {}
        for m in self._modules():
            for name, p in m.named_parameters():
                seen.setdefault(id(p), (name, p))
        yield from sorted(seen.values(), key=lambda item: self._order(item[0]))

    def _order(self, name: str) -> int:
        return self.program.name_order.get(name, len(self.program.names))

    def train(self, mode: bool = True) -> RankProgram:
        """Put this rank's modules in training (or eval) mode, like ``nn.Module.train``."""
        for m in self._modules():
            m.train(mode)
        return self

    def eval(self) -> RankProgram:
        return self.train(False)

    def train_step(self, x: torch.Tensor, y: Any) -> float:
        """One optimizer step on the global batch ``(x, y)``; returns the global mean loss.

        Gradients are zeroed first and left in place afterwards (for inspection)."""
        n = self._check_batch(x)
        for p in self.parameters():
            p.grad = None
        state = StepState(list(torch.tensor_split(x, n)), list(_split_target(y, n)),
                          scale=1.0 / n)
        self.runtime.run(state)
        total = sum(state.losses, torch.zeros((), dtype=torch.float64))
        if self.comm is not None and self.comm.size > 1:
            self.comm.allreduce(total)  # only the last stage's ranks hold losses
        return float(total)

    def _check_batch(self, x: torch.Tensor) -> int:
        batch = int(x.shape[0])
        self.plan.check_batch(batch)
        if self.program.graph.transfers and batch != self.program.batch_size:
            raise PlanError(f"this program was compiled for a global batch of "
                            f"{self.program.batch_size}, got {batch}: compile with an example "
                            f"of the batch size you train with")
        return self.plan.chunks()

    def forward(self, x: torch.Tensor) -> Any:
        """Inference on ``x`` with the modules' current mode; the output (concatenated over
        micro-batches) on the last stage's ranks, None elsewhere."""
        n = self._check_batch(x)
        state = StepState(list(torch.tensor_split(x, n)), [None] * n, scale=1.0, train=False)
        actions = [a for a in self.program.schedule[self.rank]
                   if a.kind in ("F", "SEND_F", "RECV_F")]
        with torch.no_grad():
            self.runtime.run(state, actions)
        if not state.results:
            return None
        outs = [state.results[i] for i in sorted(state.results)]
        if not isinstance(outs[0], torch.Tensor):
            return outs
        out = torch.cat(outs)
        info, tiling = self.program.spatial, self.runtime.tiling
        if info is not None and tiling is not None and info.out_tiled and \
                tiling.spatial(self.plan.stages - 1):  # tiles of the output: join them
            rects = tuple(info.grid.tile_rect(info.out_extent, u) for u in range(info.grid.size))
            with torch.no_grad():
                out = Join(rects, tiling.tile, group_key(self.plan.stages - 1))(out)
        return out

    @property
    def actions(self) -> list[Action]:
        """This rank's action list for one training step."""
        return self.program.schedule[self.rank]

    def state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's parameters and buffers under the original model's names."""
        out: dict[str, torch.Tensor] = {}
        for m in self._modules():
            out.update(m.state_dict())
        return {k: out[k] for k in sorted(out, key=self._order)}

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """Collective: the whole model's state_dict on rank 0, None on the other ranks."""
        local = self.state_dict()
        if self.comm is None:
            return local
        parts = self.comm.gather_object(local, root=0)
        if parts is None:
            return None
        merged: dict[str, torch.Tensor] = {}
        for part in parts:
            merged.update(part)
        return {k: merged[k] for k in sorted(merged, key=self._order)}


def _split_target(y: Any, n: int) -> list[Any]:
    if isinstance(y, torch.Tensor):
        return list(torch.tensor_split(y, n))
    if n == 1:
        return [y]
    raise TypeError(f"targets of type {type(y).__name__} cannot be split into {n} chunks: "
                    f"pass a tensor whose first dimension is the batch")
