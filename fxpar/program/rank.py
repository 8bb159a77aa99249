"""One rank's share of a compiled Program, ready to train: :class:`RankProgram`.

It binds the rank's stage modules to its parameters, an optimizer and a communicator (the
sub-communicators it makes, the gradient hooks on its parameters, its hold on the fail-fast
hook), and runs the rank's action list (fxpar.runtime.loop). It reads the program through
:class:`fxpar.program.compiled.RunnableProgram`; ``Program.for_rank`` / ``Program.local`` make one.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from types import TracebackType
from typing import Any

import torch
from torch import fx, nn

from fxpar.comm import failfast, watchdog
from fxpar.comm.mpi import Comm
from fxpar.core.geometry import Rect
from fxpar.core.plan import PRECISION_DTYPES, Plan, PlanError
from fxpar.core.roles import chunks_per_copy, first_chunk
from fxpar.core.schedule import Action, format_grid, split_keys
from fxpar.core.wire import Order
from fxpar.program import gradstep
from fxpar.program.batches import joined_outputs, load_stages, output_of, split_targets
from fxpar.program.compiled import RunnableProgram, input_window_of
from fxpar.program.groups import communicators, rank_order, stage_syncs, tile_groups
from fxpar.program.tileloss import TileLoss
from fxpar.runtime.guard import StepGuard
from fxpar.runtime.inductor import compiled_stages
from fxpar.runtime.loop import FORWARD, Runtime, StepState, Tiling
from fxpar.runtime.scale import LossScale


def to_channels_last(params: list[nn.Parameter]) -> None:
    """``Plan(channels_last=True)``: convolution weights (4-D, 5-D) laid out channels-last, in
    place (the values do not change). oneDNN and cuDNN then run every convolution that reads
    them channels-last, and the outputs, the tile ops' windows and gradients keep that layout
    (fxpar.runtime.spatial.ops.memory_format); inputs and messages stay as they are."""
    with torch.no_grad():
        for p in params:
            if p.dim() == 4:
                p.data = p.data.contiguous(memory_format=torch.channels_last)
            elif p.dim() == 5:
                p.data = p.data.contiguous(memory_format=torch.channels_last_3d)


class RankProgram:
    """One rank's share of a Program, ready to train.

    ``optimizer`` is the factory's optimizer over this rank's parameters, or None when the
    program was compiled without one, or when this rank's stages own no parameter (a stage of
    only ReLUs and pools): guard LR schedulers with ``if rp.optimizer is not None``.

    With a communicator, it owns the sub-communicators it makes (tile and stage groups), the
    gradient hooks on its parameters and a hold on the fail-fast hook; :meth:`close` (or leaving
    ``with program.local() as rp:``) releases them."""

    def __init__(self, program: RunnableProgram, rank: int,
                 stages: dict[tuple[int, int], fx.GraphModule], comm: Comm | None) -> None:
        # before any communication: a rank failing from here on ends the whole job
        self._failfast = failfast.install() if comm is not None else False
        self._closed = False
        self.program = program
        self.rank = rank
        self.stages = stages
        self.comm = comm
        self.device = torch.device("cpu")
        params = list(self.parameters())
        if program.plan.channels_last:
            to_channels_last(params)
        # a rank whose stages own no parameter (only ReLUs and pools) has nothing to step:
        # torch optimizers refuse an empty parameter list
        self.optimizer = program.optimizer(iter(params)) \
            if program.optimizer and params else None
        self.loss_scale = LossScale() if program.plan.precision == "fp16" else None
        """float16's dynamic loss scale (fxpar.runtime.scale), None for other precisions;
        its fields (``scale``, ``growth_interval``, ...) may be set before training."""
        self.before_optimizer_step: list[Callable[[RankProgram], None]] = []
        """Hooks ``fn(rp)``, run in order on every rank at the STEP action, just before the
        optimizer step (e.g. ``rp.before_optimizer_step.append(lambda rp:
        rp.clip_grad_norm_(12.0))``); only when the step goes ahead (not for a step skipped for
        NaN/inf or a float16 overflow, not in the first k-1 calls of ``accumulate=k``). There,
        each parameter's ``.grad`` on this rank (this rank's parameters only: its stages, each
        GEMS copy it holds) is the whole model's gradient of that parameter, as one process has
        it: summed over the tiles, GEMS copies and replicas that hold it (identical on every
        rank that does), of the mean loss over the global batch (over the k batches of an
        accumulation cycle: of the mean of their means), unscaled under float16 and finite; None
        for a parameter the forward never reads. BatchNorm statistics are merged already. A hook
        that communicates must run alike on every rank (:meth:`clip_grad_norm_` does)."""
        self.grad_norm: float | None = None
        """The whole model's gradient norm of the last optimizer step, when a hook computed it
        (:meth:`clip_grad_norm_`); None for a step without (or skipped, or not yet taken)."""
        self.accumulation = gradstep.Accumulation()
        """Where ``train_step(..., accumulate=k)`` stands in its cycle (fxpar.program.gradstep)."""
        rank_map, dp = program.rank_map, program.rank_map.dp_index(rank)
        plan = program.plan
        self._orders: dict[frozenset[str] | None, Order] = {}
        self._comms = communicators(program, rank, comm)
        self.syncs = stage_syncs(program, rank, stages, self._comms)
        self.groups = tile_groups(program, rank, self._comms)
        self.tile_loss = self._make_tile_loss()
        """The loss on this rank's tiles of a tiled output (fxpar.program.tileloss), else None."""
        self.runtime = Runtime(
            rank, program.graph, stages,
            lambda copy, stage, tile: rank_map.rank_of(dp, copy, stage, tile),
            program.schedule, program.loss_fn, self.optimizer, comm, chunks_per_copy(plan),
            self._tiling(),
            chunk=lambda copy, mb: first_chunk(plan, dp, copy) + mb,
            sync=self._sync, recompute=program.recompute,
            precision=PRECISION_DTYPES[plan.precision], before_step=self._before_step,
            segments=plan.recompute_segments, tile_loss=self.tile_loss, wire=self._wire,
            compiled=compiled_stages(plan.compile, plan.recompute_segments, stages,
                                     plan.spatial_stages if plan.spatial else 0,
                                     frozenset(k[:2] for k in split_keys(
                                         [program.schedule[rank]]))))
        self.guard = StepGuard(rank, comm, self._buffers, self._grads)
        """Failed steps, NaN/inf, injected faults, the watchdog's clock (fxpar.runtime.guard)."""
        dog = watchdog.current()
        if self._failfast and dog is not None:  # its report draws this program's grid
            dog.grid = lambda here: format_grid(program.schedule, here=here)

    def _wire(self, only: frozenset[str] | None) -> Order:
        """This rank's messages to each peer in the order both issue them (fxpar.core.wire)."""
        if only not in self._orders:
            self._orders[only] = rank_order(self.program, self.rank, only)
        return self._orders[only]

    def _make_tile_loss(self) -> TileLoss | None:
        info, plan = self.program.spatial, self.plan
        last = plan.stages - 1
        if info is None or not info.out_tiled or last >= info.spatial_stages:
            return None
        roles = self.program.rank_map.roles_of(self.rank)
        speaks = self.program.rank_map.dp_index(self.rank) == 0 and any(
            r.copy == 0 and r.tile == 0 and r.stage == last for r in roles)
        return TileLoss(self.program.loss_tiles, self.program.loss_fn, info.grid,
                        info.leaf_extents, last, lambda: self.device, speaks,
                        self.program.graph.out_spec)

    def _buffers(self) -> list[torch.Tensor]:
        seen: dict[int, torch.Tensor] = {}
        for m in self._modules():
            for b in m.buffers():
                seen.setdefault(id(b), b)
        return list(seen.values())

    def _grads(self) -> list[torch.Tensor]:
        return [p.grad for p in self.parameters() if p.grad is not None]

    def _before_step(self, st: StepState) -> bool:
        """With a loss scale: unscale this rank's gradients, agree with every rank on whether
        all are finite (one allreduce), update the scale; False skips the step everywhere.
        Otherwise the guard's NaN/inf check (one allreduce, unless FXPAR_NONFINITE=off).
        Then, when the step goes ahead, the :attr:`before_optimizer_step` hooks. Accumulating,
        False in a cycle's first k-1 calls (fxpar.program.gradstep)."""
        cycle = self.accumulation
        if self.loss_scale is None:
            go = self.guard.finite(st.losses)
        elif cycle.last:  # GradScaler's rule: unscaled and checked once, at the step
            go = self.loss_scale.unscale(self._grads(), self.comm, self.device, st.losses)
            self.guard.total = self.loss_scale.total  # read with the flag: one host read
        else:
            go = True
        if not go:
            cycle.drop()
            self.grad_norm = None
            return False
        if not cycle.last:
            return False
        self.grad_norm = None
        for hook in self.before_optimizer_step:
            hook(self)
        return True

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> float:
        """Collective (every rank alike, e.g. in a :attr:`before_optimizer_step` hook): clip
        the whole model's gradients as ``torch.nn.utils.clip_grad_norm_(model.parameters(),
        max_norm, norm_type)`` on one process (norm_type may be inf), each parameter counted
        once however many ranks hold it (one allreduce: fxpar.program.gradstep). Returns the
        total norm before clipping, also kept in :attr:`grad_norm`."""
        grads = [p.grad for p in gradstep.counted(self.program.rank_map, self.rank, self.stages)
                 if p.grad is not None]
        total = gradstep.total_norm(grads, norm_type, self.comm, self.device)
        torch.nn.utils.clip_grads_with_norm_(list(self.parameters()), max_norm, total)
        self.grad_norm = float(total)
        return self.grad_norm

    def clip_grad_value_(self, clip_value: float) -> None:
        """``torch.nn.utils.clip_grad_value_`` on this rank's gradients (each GEMS copy):
        element-wise, so no communication; call it alike on every rank (a hook)."""
        torch.nn.utils.clip_grad_value_(list(self.parameters()), clip_value)

    def _merge_stats(self) -> bool:
        return self.plan.copies > 1 or self.plan.data_parallel > 1

    def _sync(self) -> None:
        for sync in self.syncs:
            if self.accumulation.last:  # gradients summed once per cycle (gradstep)
                sync.grads()
            if self._merge_stats():
                sync.stats()

    def _tiling(self) -> Tiling | None:
        """This rank's tile(s)."""
        info = self.program.spatial
        if info is None:
            return None
        roles = self.program.rank_map.roles_of(self.rank)
        plan = self.program.plan
        return Tiling(info.grid, {r.copy: r.tile for r in roles}, plan.spatial_stages,
                      info.out_tiled, info.out_extent)

    def close(self) -> None:
        """Give back what this program holds in the process: the gradient hooks on its
        parameters, its tile ops' communicators, the sub-communicators it made (every rank
        closes its program, in the same order as its peers) and its hold on the fail-fast hook
        (the last holder puts back the hooks found before). Idempotent; a closed program no
        longer trains. The world communicator it was given stays open.

        Closing a program whose step failed ends the whole job (its peers wait in that step)."""
        if self._closed:
            return
        if self.guard.failed is not None and self._failfast:
            failfast.end_failed()
        self._closed = True
        for sync in self.syncs:
            sync.close()
        for sub in self._comms.values():
            sub.free()
        self._comms = {}
        failfast.uninstall(self._failfast)
        self._failfast = False

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> RankProgram:
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 tb: TracebackType | None) -> None:
        # an exception leaving a multi-rank program keeps it open, fail-fast hook included:
        # uncaught, it ends the whole job instead of leaving the other ranks waiting
        if kind is None or not self._failfast:
            self.close()

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
        keys = self.program.model_keys
        seen: dict[int, tuple[str, nn.Parameter]] = {}
        for m in self._modules():
            for name, p in m.named_parameters():  # as the model names it (not an alias)
                seen.setdefault(id(p), (keys.canonical(name), p))
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

    def to(self, device: torch.device | str) -> RankProgram:
        """Move this rank's modules (every GEMS copy) to ``device``; receive buffers and
        batches follow. Before the first step: optimizer state made earlier would stay behind."""
        device = torch.device(device)
        if self.optimizer is not None and self.optimizer.state:
            raise RuntimeError("move a rank program before its first step: its optimizer "
                               "already holds state on the old device")
        for m in self._modules():
            m.to(device)
        self.device = self.runtime.device = device
        return self

    def _on_device(self, v: Any) -> Any:
        """A batch tensor (or a tuple of them) on this rank's device (anything else as it
        is)."""
        if isinstance(v, tuple):
            return tuple(self._on_device(t) for t in v)
        if isinstance(v, torch.Tensor) and v.device != self.device:
            return v.to(self.device)
        return v

    def train_step(self, x: torch.Tensor | None, y: Any, *, accumulate: int = 1) -> float:
        """One optimizer step on the global batch ``(x, y)``; returns the global mean loss.

        Gradients are zeroed first and left in place afterwards (for inspection).
        accumulate: k > 1 makes k consecutive calls (the same k in each) one optimizer step,
        taken in the k-th, on the k batches together; each call returns its own batch's mean
        loss. Gradients are zeroed in a cycle's first call, summed over the ranks in its last
        (until then ``.grad`` holds this rank's own share); NaN/inf and float16 overflows end
        a cycle: fxpar.program.gradstep.
        x: the whole batch's shape, but only :meth:`input_window` of it is read (a loader may
        fill just that part of a ``torch.empty``); None on a rank whose window is None.
        y: None on a rank that does not hold the last stage (only the loss reads targets).

        A NaN or inf anywhere raises ``fxpar.runtime.guard.NonFiniteError`` on every rank
        after undoing the step (``FXPAR_NONFINITE``: fxpar.runtime.guard). Any other exception
        marks the program failed: leaving the process then ends the whole job."""
        self.accumulation.check(accumulate)
        step, self.runtime.fault = self.guard.begin()
        try:
            loss = self._train_step(x, y, step, accumulate)
        except BaseException as e:
            self.guard.fail(step, e)
            raise
        finally:
            self.runtime.fault = None
        self.guard.end(step)
        return loss

    def _train_step(self, x: torch.Tensor | None, y: Any, step: int, k: int = 1) -> float:
        self._check_omitted(x, y)
        n = self._check_batch(x)
        x, y = self._on_device(x), self._on_device(y)
        if self.accumulation.begin(k):
            for p in self.parameters():
                p.grad = None
        xs = [None] * n if x is None else list(torch.tensor_split(x, n))
        factor = self.loss_scale.scale if self.loss_scale is not None else 1.0
        state = StepState(xs, list(split_targets(y, n)),  # type: ignore[arg-type]
                          scale=factor / (n * k), step=step)
        for sync in self.syncs:
            if self.accumulation.last:
                sync.reset()
            if self._merge_stats():
                sync.begin()
        with self.groups.bound():  # the tile ops' communicators, for this step
            self.runtime.run(state)
        self.accumulation.end()
        if self.guard.total is not None:  # read with the NaN/inf flags: one host read
            return self.guard.total * k / factor
        total = sum(state.losses, torch.zeros((), dtype=torch.float64))
        if self.comm is not None and self.comm.size > 1:
            self.comm.allreduce(total)  # only the last stage's ranks hold losses
        return float(total) * k / factor

    def _check_omitted(self, x: torch.Tensor | None, y: Any) -> None:
        stages = {s for _, s in self.stages}
        if x is None and any(i.source == "batch" for s in stages
                             for i in self.program.graph.inputs[s]):
            raise ValueError(f"rank {self.rank}'s stages {sorted(stages)} read the model input: "
                             f"pass x (at least its input_window())")
        if y is None and self.plan.stages - 1 in stages:
            raise ValueError(f"rank {self.rank} holds the last stage, which computes the loss: "
                             f"pass the targets y")

    def input_window(self, image: tuple[int, ...] | None = None) -> Rect | None:
        """The box of the model input this rank's stages read (rows x columns, or depth x rows
        x columns; bounding box, halo included, clipped to the image); None when they never
        read the input. A data loader need read only this part of each image (see
        fxpar.data.data).

        image: the input's spatial sizes ((H, W) or (D, H, W)), used only when the program
        records no windows (``Program.input_windows`` is None): then a rank that reads the
        input reads all of it."""
        return input_window_of(self.program, self.stages, self.rank, image)

    @property
    def needs_targets(self) -> bool:
        """Whether this rank computes the loss (holds the last stage): only those ranks read
        the targets ``y``; the others may pass None to :meth:`train_step`."""
        return self.plan.stages - 1 in {s for _, s in self.stages}

    def target_window(self) -> Rect | None:
        """The box of a per-pixel target (a mask of the input's size) this rank's loss reads:
        its output tiles when the output stays tiled (bounding box over its roles), None when
        it reads the whole target (a non-spatial last stage) or none (:attr:`needs_targets` is
        False). A loader need read only this part of each mask."""
        info, tiling = self.program.spatial, self.runtime.tiling
        last = self.plan.stages - 1
        if not self.needs_targets or info is None or tiling is None or not info.out_tiled \
                or not tiling.spatial(last):
            return None
        rects = [tiling.rect(info.out_extent, t) for t in tiling.tiles.values()]
        return Rect(*((min(r.dims[i][0] for r in rects), max(r.dims[i][1] for r in rects))
                      for i in range(rects[0].ndim)))

    def _check_batch(self, x: torch.Tensor | None) -> int:
        if self._closed:
            raise RuntimeError(f"rank {self.rank}'s program was closed: build another with "
                               f"program.local()")
        batch = self.program.batch_size if x is None else int(x.shape[0])
        self.plan.check_batch(batch)
        if self.program.graph.transfers and batch != self.program.batch_size:
            raise PlanError(f"this program was compiled for a global batch of "
                            f"{self.program.batch_size}, got {batch}: compile with an example "
                            f"of the batch size you train with")
        if self.comm is None and self.program.world_size > 1:
            raise PlanError(
                f"rank {self.rank}'s program has no communicator: a {self.program.world_size}"
                f"-rank program trains under `mpiexec -n {self.program.world_size}` with "
                f"program.local() (program.for_rank(r) without comm= is for inspection)")
        return self.plan.chunks()

    def forward(self, x: torch.Tensor | None) -> Any:
        """Inference on ``x`` with the modules' current mode; the output (concatenated over
        micro-batches) on the last stage's ranks, None elsewhere. x: None on a rank whose
        :meth:`input_window` is None (as for :meth:`train_step`). An exception marks the
        program failed, as in :meth:`train_step`."""
        try:
            return self._forward(x)
        except BaseException as e:
            self.guard.fail(self.guard.steps, e, f"forward after step {self.guard.steps}")
            raise

    def _forward(self, x: torch.Tensor | None) -> Any:
        self._check_omitted(x, 0)
        n = self._check_batch(x)
        x = self._on_device(x)
        xs = [None] * n if x is None else list(torch.tensor_split(x, n))
        state = StepState(xs, [None] * n, scale=1.0, train=False)  # type: ignore[arg-type]
        with self.groups.bound(), torch.no_grad():
            self.runtime.run(state, FORWARD)
        results = joined_outputs(self.program, self.runtime.tiling, self.groups, state.results)
        if self.comm is not None and (self.plan.copies > 1 or self.plan.data_parallel > 1):
            merged: dict[int, Any] = {}  # each copy / replica has its own chunks' outputs
            for part in self.comm.allgather_object(results):
                merged.update(part)
            results = merged if state.results else {}
        return output_of(self.program.graph.out_spec, results)

    def predict(self, image: Any, out: str | os.PathLike[str] | None = None,
                **kwargs: Any) -> Any:
        """Collective: run the trained model over a whole ``image`` (an array (C, H, W) or a
        reader of fxpar.data.images) region by region with this program's plan, on this
        program's ranks, exactly as one process would on the whole image (``fxpar.predict``;
        keyword arguments as there: region, batch, output, dtype, progress, ...). The ranks
        first share their stages' current weights and buffers, so every rank predicts with
        the trained model whichever stages it held. Returns a ``Prediction``."""
        if self.program.predictor is None:
            raise PlanError("this program was loaded from disk and keeps no model to compile "
                            "crops from: build the model, load the weights "
                            "(fxpar.program.checkpoint.export) and call fxpar.predict")
        if self.program.meta_model is not None:
            raise PlanError("this program was compiled from a model on the meta device: build "
                            "the model on CPU, load the full state_dict and call "
                            "fxpar.predict")
        state = self.state_dict()
        if self.comm is not None and self.comm.size > 1:
            for part in self.comm.allgather_object(state):
                state.update({k: v for k, v in part.items() if k not in state})
        return self.program.predictor(image, out, comm=self.comm, state=state, **kwargs)

    @property
    def actions(self) -> list[Action]:
        """This rank's action list for one training step."""
        return self.program.schedule[self.rank]

    def state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's parameters and buffers under the original model's names (of its first
        model copy: GEMS copies are kept identical)."""
        out: dict[str, torch.Tensor] = {}
        for (copy_, _stage), m in self.stages.items():
            if copy_ == 0:
                out.update(m.state_dict())
        return {k: out[k] for k in sorted(out, key=self._order)}

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """Collective: the whole model's state_dict on rank 0, None on the other ranks: the
        keys of ``model.state_dict()`` in its order, aliases and parameters the forward never
        uses included, so ``model.load_state_dict(state, strict=True)`` takes it."""
        local = self.state_dict()
        if self.comm is None:
            parts: list[dict[str, torch.Tensor]] | None = [local]
        else:
            parts = self.comm.gather_object(local, root=0)
        if parts is None:
            return None
        merged: dict[str, torch.Tensor] = {}
        for part in parts:
            merged.update(part)
        return {k: merged[k] for k in self.program.names if k in merged}

    def load_state_dict(self, state_dict: dict[str, torch.Tensor],
                        strict: bool = True) -> list[str]:
        """Load a single-device ``state_dict`` (e.g. ``model.state_dict()`` or
        ``fxpar.program.checkpoint.export(folder)``) into this rank's modules, every copy, in
        place; keys of other ranks' stages are ignored. Returns the keys loaded. strict: every key
        this rank needs must be there, and no key outside the model (see
        fxpar.program.checkpoint)."""
        return load_stages(self.stages, self.program.names, state_dict, strict, self.rank,
                           self._order)
