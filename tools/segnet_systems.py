"""The segnet section's four systems (tools/bench_segnet.py): one train step per model as
each system runs it, and the PhysicsNeMo ShardTensor setup.

``one`` and ``ideal`` are plain eager PyTorch (on the whole image; on this rank's rows, no
messages), ``sp2`` is fxpar ``Plan(spatial_parts=2)``, ``shard`` the same eager loop on
PhysicsNeMo ShardTensors. PhysicsNeMo is not a dependency of fxpar: ``INSTALL`` installs it
into the venv for the section; on a CPU-only torch it needs the workarounds in
:func:`shard_mesh` and :func:`shard_inputs`.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import torch
from bench_spatial import eager_step, sgd  # (the user's loop)
from torch import nn

INSTALL = ("PIP_CONSTRAINT=<(printf 'torch==%s\\ntorchvision==%s\\n' 2.14.1 0.29.1) "
           ".venv/bin/pip install nvidia-physicsnemo==2.2.2  # the installed torch and "
           "torchvision versions (pip show), so pip keeps them")


# -- the systems' train steps -----------------------------------------------------------------
def rows_of(side: int, rank: int, size: int) -> slice:
    """Rank ``rank``'s rows of ``size`` even strips (fxpar's split, DESIGN.md)."""
    return slice(rank * side // size, (rank + 1) * side // size)


class Runner:
    """One launch's system: its communicator, and a train step for each model in turn.

    ``one``: plain eager PyTorch on the whole image; ``ideal``: eager on this rank's rows, no
    messages; ``sp2``: fxpar ``Plan(spatial_parts=2)``; ``shard``: the same eager loop on
    PhysicsNeMo ShardTensors sharded along H (its conv / GroupNorm / interpolate wrappers
    exchange halos and reduce statistics and weight gradients)."""

    def __init__(self, system: str) -> None:
        self.system, self.rank, self.size, self.comm, self.mesh = system, 0, 1, None, None
        if system in ("ideal", "sp2"):
            from fxpar.comm.world import world

            self.comm = world()
            self.rank, self.size = self.comm.rank, self.comm.size
        elif system == "shard":
            self.mesh = shard_mesh()
            self.rank, self.size = self.mesh.get_rank(), self.mesh.size()

    def step(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor
             ) -> tuple[Callable[[], float], float]:
        """``(step, compile seconds)`` for one model on the global batch ``(x, y)``."""
        if self.system == "one":
            return eager_step(model, x, y), 0.0
        rows = rows_of(x.shape[2], self.rank, self.size)
        if self.system == "ideal":
            return eager_step(model, x[:, :, rows].contiguous(), y[:, rows].contiguous()), 0.0
        if self.system == "shard":
            return eager_step(model, *shard_inputs(self.mesh, x, y, rows)), 0.0
        import fxpar

        t0 = time.perf_counter()
        program = fxpar.compile(model, fxpar.Plan(spatial_parts=self.size),
                                torch.empty(x.shape, dtype=x.dtype, device="meta"),
                                target=torch.empty(y.shape, dtype=y.dtype, device="meta"),
                                optimizer=sgd, comm=self.comm)
        rp = program.local()
        return (lambda: rp.train_step(x, y)), time.perf_counter() - t0

    def barrier(self) -> None:
        if self.comm is not None:
            self.comm.barrier()
        elif self.mesh is not None:
            torch.distributed.barrier()

    def gather(self, rec: dict[str, Any]) -> list[dict[str, Any]] | None:
        """Every rank's ``rec`` on rank 0 (None elsewhere)."""
        if self.comm is not None:
            return self.comm.gather_object(rec)
        if self.mesh is not None:
            out: list[Any] | None = [None] * self.size if self.rank == 0 else None
            torch.distributed.gather_object(rec, out, dst=0)
            return out
        return [rec]


def shard_mesh() -> Any:
    """A 1-D CPU device mesh over the job's ranks (gloo), from MPICH's PMI variables.

    PhysicsNeMo's ``DistributedManager.initialize()`` is not used: on a CPU-only torch 2.14 its
    ``setup`` passes ``device_id=cpu`` to ``init_process_group``, which raises ValueError. Its
    custom ops and op wrappers register only when CUDA is available, so they are registered
    here."""
    import torch.distributed as dist
    from physicsnemo.domain_parallel import register_custom_ops

    rank = int(os.environ.get("PMI_RANK", os.environ.get("RANK", "0")))
    size = int(os.environ.get("PMI_SIZE", os.environ.get("WORLD_SIZE", "1")))
    dist.init_process_group("gloo", rank=rank, world_size=size)
    register_custom_ops()
    return dist.init_device_mesh("cpu", (size,), mesh_dim_names=("domain",))


def shard_inputs(mesh: Any, x: torch.Tensor, y: torch.Tensor, rows: slice
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's rows of ``x`` and ``y`` as ShardTensors sharded along H. ``"chunk"``
    shapes (torch.chunk's, the same as fxpar's for an even split) need no collective; the
    ``"infer"`` default allocates pinned memory, which a CPU-only torch refuses."""
    from physicsnemo.domain_parallel import ShardTensor
    from torch.distributed.tensor.placement_types import Shard

    def part(t: torch.Tensor, dim: int) -> torch.Tensor:
        local = t.narrow(dim, rows.start, rows.stop - rows.start).contiguous()
        return ShardTensor.from_local(local, mesh, (Shard(dim),), sharding_shapes="chunk",
                                      global_shape=tuple(t.shape))

    return part(x, 2), part(y, 1)


def have_physicsnemo() -> bool:
    import importlib.util

    return importlib.util.find_spec("physicsnemo") is not None
