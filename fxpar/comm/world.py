"""The world communicator of a job, on the backend asked for (MPI or torch.distributed)."""

from __future__ import annotations

from fxpar.comm import failfast, watchdog
from fxpar.comm.mpi import Comm
from fxpar.comm.torch_dist import torch_world
from fxpar.core.options import setting


def world(backend: str | None = None) -> Comm:
    """The communicator of every rank in the job.

    backend: "mpi" (mpi4py, the default) or "torch" (torch.distributed, see fxpar.comm.torch_dist:
    NCCL collectives on GPUs); None reads ``FXPAR_COMM`` (default "mpi")."""
    watchdog.configure()
    backend = backend or setting("comm") or "mpi"
    if backend == "mpi":
        comm: Comm = Comm()
    elif backend == "torch":
        comm = torch_world()
    else:
        raise ValueError(f"unknown communication backend {backend!r} (FXPAR_COMM or "
                         f"world(backend=...)): use 'mpi' or 'torch'")
    if comm.size > 1 and failfast.launched():
        watchdog.attach()  # collective, once per process: every rank's first world()
    return comm
