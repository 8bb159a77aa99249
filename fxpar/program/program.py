"""What the compiler emits: a :class:`Program` for the whole job, a :class:`RankProgram` each rank.

A Program is plain data (the plan, the rank map, the stage graphs, the schedule); a RankProgram
binds one rank's share of it to real parameters, an optimizer and a communicator::

    program = fxpar.compile(model, plan, example, loss_fn=..., optimizer=...)
    with program.local() as rp:       # this MPI rank's program
        loss = rp.train_step(x, y)    # global batch in, global mean loss out, on every rank

Nothing a rank program needs is process-global: it owns its sub-communicators, the gradient
hooks on its parameters and its hold on the fail-fast exception hook, and ``close()`` (or the
end of the ``with`` block) gives them back, so one process can build and train several.
"""

from __future__ import annotations

import copy
import functools
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import fx, nn

from fxpar.comm import failfast
from fxpar.comm.mpi import Comm
from fxpar.core import meta
from fxpar.core.geometry import Rect
from fxpar.core.messages import check_tags, tag_uses
from fxpar.core.meta import TensorInfo
from fxpar.core.modelkeys import MODEL_KEYS, ModelKeys, attach, complete, with_unused
from fxpar.core.plan import Plan, PlanError, RankMap
from fxpar.core.schedule import Schedule
from fxpar.core.stages import StageGraph
from fxpar.core.wire import Order
from fxpar.program.compiled import SpatialInfo as SpatialInfo  # re-exported: driver, loader
from fxpar.program.rank import RankProgram as RankProgram  # re-exported: fxpar, users
from fxpar.program.rank import to_channels_last as to_channels_last  # re-exported
from fxpar.program.tileloss import LossTilesFactory
from fxpar.runtime.guard import nonfinite_policy
from fxpar.runtime.loop import LossFn
from fxpar.runtime.materialize import InitFn, materialize_stages
from fxpar.runtime.spatial.tags import max_tag

OptimizerFactory = Callable[[Iterator[nn.Parameter]], torch.optim.Optimizer]


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
    meta_model: nn.Module | None = None
    """The original model when it was built on the meta device: ``for_rank`` materialises the
    part its rank uses (runtime.materialize), each module under a seed
    from ``seed`` and its name."""
    init: InitFn | None = None
    """``init(qualified_name, module)`` used instead of ``reset_parameters`` when materialising."""
    seed: int = 0
    input_windows: tuple[Rect | None, ...] | None = None
    """Per rank, the rows x columns of the model input its stages read, worked out at compile
    time (fxpar.compiler.windows; saved in program.json); None when not recorded (an input
    that is not one image batch, or a folder saved before fxpar recorded them)."""
    recompute: frozenset[int] = frozenset()
    """The stages whose activations are recomputed (``Plan.recompute`` resolved at compile
    time: "auto" chooses them for ``Plan.memory_per_rank``; saved in program.json)."""
    predictor: Callable[..., Any] | None = None
    """``fxpar.predict`` bound to the compiled model and plan (None for a program loaded from
    disk): what :meth:`RankProgram.predict` runs."""
    loss_tiles: LossTilesFactory | None = None
    """How the tiles of a tiled output compute the loss, per output and target shapes
    (fxpar.compiler.loss); None: the output is joined for the loss (a program loaded from
    disk)."""
    keys: ModelKeys | None = None
    """The model's aliased and unused state_dict keys (fxpar.core.modelkeys), as saved with a
    program on disk; None: read from ``traced`` (:attr:`model_keys`)."""
    orders: dict[frozenset[str] | None, dict[int, Order]] = field(default_factory=dict,
                                                                    compare=False, repr=False)
    """Every rank's point-to-point order (fxpar.core.wire.agreed_order), per set of action
    kinds (None: the whole step), as the compile's schedule check found it or a rank program
    first needed it (fxpar.program.groups.rank_order): not derived again per rank."""

    @property
    def world_size(self) -> int:
        """Ranks the plan needs (``mpiexec -n``)."""
        return self.plan.world_size

    @property
    def output_shape(self) -> tuple[int, ...] | None:
        """The model output's shape for one micro-batch, from the compiled graph; None for a
        loaded program (which keeps no graph) or a model returning several tensors."""
        gm = self.traced
        out = next((n for n in gm.graph.nodes if n.op == "output"), None) if gm else None
        value = out.args[0] if out is not None else None
        if isinstance(value, (tuple, list)) and len(value) == 1:
            value = value[0]
        info = None
        while isinstance(value, fx.Node) and info is None:  # through the stage cutter's marker
            info = meta.find(value, TensorInfo)
            value = value.args[0] if len(value.args) == 1 else None
        return None if info is None else tuple(info.shape)

    @functools.cached_property
    def name_order(self) -> dict[str, int]:
        return {n: i for i, n in enumerate(self.names)}

    @functools.cached_property
    def model_keys(self) -> ModelKeys:
        """The model's aliases (recorded at capture) and the canonical keys of the tensors no
        stage's graph reads (fxpar.core.modelkeys)."""
        if self.keys is not None:
            return self.keys
        if self.traced is None:
            return ModelKeys()
        return with_unused(self.traced.meta.get(MODEL_KEYS, ModelKeys()), self.names,
                           self.traced, self.graph.modules)

    def complete_stages(self) -> None:
        """Give every stage module the aliases of its tensors, and the last one the tensors no
        stage reads (the model's own, from ``traced``): every parameter and buffer of the model
        then lives in exactly one stage, the last for the unused ones. Once, before anything
        materialises or copies a stage module; a program loaded from disk has them already."""
        if self.traced is None or self.__dict__.get("_stages_complete"):
            return
        complete(self.graph.modules, self.model_keys, self.traced)
        self.__dict__["_stages_complete"] = True  # frozen: as functools.cached_property does

    def _complete(self, module: nn.Module, stage: int) -> nn.Module:
        """``module`` (a tile or GEMS copy of ``stage``) completed as its stage's module."""
        self.complete_stages()
        last = stage == len(self.graph.modules) - 1
        attach(module, self.model_keys, self.graph.modules[stage] if last else None)
        return module

    def for_rank(self, rank: int, comm: Comm | None = None) -> RankProgram:
        """Rank ``rank``'s program. Its modules share parameters with the compiled model (a
        meta-built model gets real memory for this rank's stages only, first)."""
        self.complete_stages()  # before materialising: the unused tensors materialise too
        if 0 <= rank < self.world_size:
            self.materialize(rank)
        stages = self.stage_modules(rank)
        if comm is not None:  # before any message: would this MPI take every tag we use?
            bound = comm.tag_ub
            halo = {s: max_tag(m) for (_, s), m in stages.items()}
            check_tags(tag_uses(self.plan, len(self.graph.transfers), halo), bound,
                       f"this MPI's MPI_TAG_UB ({bound})")
        return RankProgram(self, rank, stages, comm)

    def materialize(self, rank: int) -> None:
        """For a model built on the meta device: give the original-model modules rank
        ``rank``'s stages use real memory, and re-point its stage modules (and the tile modules
        already built) at them; other stages stay on meta. Before the rank's modules are copied
        (GEMS mirror) or trained. Nothing for a model built with memory."""
        if self.meta_model is None:
            return
        roles = self.rank_map.roles_of(rank)
        stages = sorted({r.stage for r in roles})
        info = self.spatial
        tiles = [] if info is None else [
            info.tile(s, t) for s in stages if s < info.spatial_stages
            for t in range(info.grid.size)
            if any(r.stage == s and r.tile == t and r.copy == 0 for r in roles)]
        materialize_stages(self.meta_model, [self.graph.modules[s] for s in stages], tiles,
                           self.seed, self.init)

    def stage_modules(self, rank: int) -> dict[tuple[int, int], nn.Module]:
        """Rank ``rank``'s stage modules, ``{(copy, stage): module}``: tile modules for spatial
        stages, a copy for the GEMS mirror. Touches no communicator."""
        if not 0 <= rank < self.world_size:
            raise PlanError(f"rank {rank} is outside this plan's {self.world_size} ranks")
        self.complete_stages()
        stages = {}
        for r in self.rank_map.roles_of(rank):
            spatial = self.spatial is not None and r.stage < self.spatial.spatial_stages
            if r.copy == 0:
                module = self._complete(self.spatial.tile(r.stage, r.tile), r.stage) \
                    if spatial else self.graph.modules[r.stage]  # type: ignore[union-attr]
            else:  # the GEMS mirror trains its own parameters (kept equal by the sync)
                module = copy.deepcopy(
                    self._complete(self.spatial.build(r.stage, r.tile, r.copy), r.stage)
                    if spatial else self.graph.modules[r.stage])  # type: ignore[union-attr]
            stages[(r.copy, r.stage)] = module
        return stages

    def save(self, folder: str | os.PathLike[str]) -> Path:
        """Write every rank's program as plain files: generated stage code, weights, action
        lists, the plan and rank layout (see fxpar.program.emit); ``fxpar-run FOLDER`` runs it."""
        from fxpar.program.emit import save

        return save(self, folder)

    def local(self, comm: Comm | None = None, device: str | None = None) -> RankProgram:
        """This process's rank program: rank 0 when not launched by MPI and the plan needs one
        rank, else the MPI rank (after checking ``mpiexec -n`` matches the plan).

        comm: run on this communicator instead of every rank of the job (default: the world of
        ``FXPAR_COMM``, see fxpar.comm.world.world).
        device: "auto", "cpu", "cuda" or "cuda:N": bind this rank to it (GPU by node-local
        rank, comm.device.bind) before the communicator is made, and move the program there.

        In a job of more than one rank this installs the fail-fast hook (fxpar.comm.failfast)
        before the first communication; the rank program holds it until closed."""
        launched = failfast.launched()
        if device is not None:
            from fxpar.comm.device import bind
            from fxpar.comm.world import node_comm

            where = bind(node_comm(), device)
            return self.local(comm).to(where)
        if comm is None and self.world_size == 1 and not launched:
            return self.for_rank(0)
        from fxpar.comm.world import world

        comm = comm if comm is not None else world()
        if comm.size != self.world_size:
            raise PlanError(
                f"this plan needs {self.world_size} ranks but the job has {comm.size}: "
                f"run with `mpiexec -n {self.world_size}` or `torchrun --nproc-per-node "
                f"{self.world_size}` (or change the plan)")
        held = failfast.install()  # a rank failing from here on ends the whole job
        if comm.size > 1:  # the job's first communication: do all ranks hold the same program?
            failfast.agree(comm, self.fingerprint())
        rp = self.for_rank(comm.rank, comm)
        failfast.uninstall(held)  # the rank program holds its own
        return rp

    def fingerprint(self) -> dict[str, str]:
        """A hash of what every rank must hold alike: the plan, batch size, state_dict names,
        every rank's actions, the transfers between stages, torch's version, and (for a model
        each rank built itself, not on the meta device) a checksum of its initial weights and
        buffers -- ranks that built the model under different seeds would train different
        models without any error."""
        self.complete_stages()  # the same tensors on every rank, whatever it did before
        weights: list[float] = []
        modules = [] if self.meta_model is not None else \
            [m for m in self.graph.modules if m is not None]
        with torch.no_grad():
            for m in modules:
                for t in (*m.parameters(), *m.buffers()):
                    if t.is_floating_point() and t.device.type != "meta":
                        weights.append(float(t.detach().double().sum()))
        return {"plan": failfast.digest(self.plan.to_json(), self.batch_size),
                "model (state_dict names)": failfast.digest(self.names),
                "schedule": failfast.digest(sorted(self.schedule.items())),
                "stage transfers": failfast.digest(self.graph.transfers),
                "NaN policy (FXPAR_NONFINITE)": nonfinite_policy(),
                "torch version": torch.__version__,
                "initial weights": failfast.digest(weights)}
