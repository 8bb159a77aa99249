"""The world communicator of a job, on the backend asked for (MPI or torch.distributed)."""

from __future__ import annotations

import os

from fxpar.comm import failfast, launch, watchdog
from fxpar.comm.distributed import dist_world
from fxpar.comm.mpi import Comm
from fxpar.comm.protocol import Comm as AnyComm
from fxpar.comm.torch_dist import torch_world
from fxpar.core.options import setting


def world(backend: str | None = None) -> AnyComm:
    """The communicator of every rank in the job.

    backend: "mpi" (mpi4py) or "torch" (torch.distributed: NCCL collectives on GPUs); None
    reads ``FXPAR_COMM``, else the launcher decides (fxpar.comm.launch: torch.distributed alone
    under torchrun, MPI under mpiexec and srun). "torch" in a job an MPI launcher started joins
    torch.distributed through MPI (fxpar.comm.torch_dist); in one torchrun started, or under
    srun with ``MASTER_ADDR`` set, through torch.distributed's own rendezvous, with no MPI at
    all (fxpar.comm.distributed)."""
    watchdog.configure()
    found = launch.detect()  # None: a plain process
    implied = found.launcher.comm if found is not None else "mpi"
    backend = backend or setting("comm") or implied
    if backend == "mpi":
        if found is not None and implied != "mpi":
            raise ValueError(f"FXPAR_COMM=mpi, but {found.name} started this job, not an MPI "
                             f"launcher: unset FXPAR_COMM (torch.distributed is used), or "
                             f"start it with mpiexec / srun")
        comm: AnyComm = Comm()
        if comm.size > 1 and found is not None:
            watchdog.attach()  # collective, once per process: every rank's first world()
        _check_size(comm, found)
        return comm
    if backend != "torch":
        raise ValueError(f"unknown communication backend {backend!r} (FXPAR_COMM or "
                         f"world(backend=...)): use 'mpi' or 'torch'")
    if found is None or (implied == "mpi" and "MASTER_ADDR" not in os.environ):
        comm = torch_world()  # through MPI (a plain process: a world of one)
        if comm.size > 1:
            watchdog.attach()
        return comm
    return dist_world()  # no MPI: the watchdog's limit holds, without its cross-rank report


def _check_size(comm: AnyComm, found: launch.Launch | None) -> None:
    """A launcher whose ranks the MPI library cannot see (an srun with pip's mpich, which has
    no Slurm PMI; another MPI's mpiexec) gives every rank a world of one: say so instead of
    running N copies of a one-rank job."""
    if found is None or found.size <= 1 or comm.size == found.size:
        return
    library = failfast.mpi().Get_library_version().splitlines()[0].strip()
    raise RuntimeError(
        f"{found.name} started {found.size} ranks but MPI sees {comm.size}: the MPI this "
        f"Python loaded ({library}) cannot read {found.name}'s process manager. Start the job "
        f"with that MPI's own mpiexec; under srun, use the site's MPI (`module load`; pip's "
        f"mpich has no Slurm support) with `srun --mpi=pmix` (or pmi2); or run without MPI: "
        f"torchrun, or FXPAR_COMM=torch with MASTER_ADDR set (docs/clusters.md)")


def node_comm() -> AnyComm | None:
    """What :func:`fxpar.comm.device.bind` asks for this rank's place on its node before the
    job's communicator exists: MPI's world under an MPI launcher (its shared-memory split is
    exact), None elsewhere (torchrun's ``LOCAL_RANK`` is exact; a plain process is alone)."""
    return Comm() if failfast.launched() and launch.backend() == "mpi" else None
