"""How this process was started: which launcher, and the rank, size and node-local rank it set.

Each launcher exports its own variables to every process it starts (one entry per launcher in
:data:`LAUNCHERS`). The first entry whose marker variables are all set names the launcher, so the
order matters where launchers nest:

* ``torchrun`` first: under ``srun`` (one torchrun per node) its workers also carry Slurm's
  variables, which describe the torchrun process, not the worker;
* then the MPI launchers: ``mpiexec`` inside a Slurm allocation starts its proxies with ``srun``,
  so its ranks carry a Slurm step's variables as well;
* then ``srun`` itself (ranks started by Slurm directly, with the site MPI's PMI);
* last, a bare torch.distributed environment (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` set by
  some other launcher, for example a Kubernetes PyTorchJob).

``comm`` is the communication backend a launcher implies when ``FXPAR_COMM`` is not set: MPI
where an MPI launcher (or Slurm's PMI) wired the ranks, torch.distributed alone (no MPI in the
process) where torchrun did.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class Launcher:
    """The variables one launcher sets in each process it starts."""

    name: str
    markers: tuple[str, ...]
    """All set: this launcher started the process."""
    rank: str
    size: str
    local_rank: str
    local_size: str
    """"" where the launcher exports no such variable (srun: see :func:`_slurm_local_size`)."""
    comm: str
    """The backend its ranks communicate over unless FXPAR_COMM says otherwise."""


LAUNCHERS: tuple[Launcher, ...] = (
    Launcher("torchrun", ("TORCHELASTIC_RUN_ID", "RANK", "WORLD_SIZE"), "RANK", "WORLD_SIZE",
             "LOCAL_RANK", "LOCAL_WORLD_SIZE", "torch"),
    Launcher("mpiexec (Open MPI)", ("OMPI_COMM_WORLD_SIZE",), "OMPI_COMM_WORLD_RANK",
             "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE",
             "mpi"),
    Launcher("mpiexec (MPICH)", ("PMI_RANK", "PMI_SIZE"), "PMI_RANK", "PMI_SIZE",
             "MPI_LOCALRANKID", "MPI_LOCALNRANKS", "mpi"),
    Launcher("srun", ("SLURM_STEP_ID", "SLURM_PROCID", "SLURM_NTASKS"), "SLURM_PROCID",
             "SLURM_NTASKS", "SLURM_LOCALID", "", "mpi"),
    Launcher("mpiexec (PMIx)", ("PMIX_RANK",), "PMIX_RANK", "", "", "", "mpi"),
    Launcher("torch.distributed environment", ("RANK", "WORLD_SIZE", "MASTER_ADDR"), "RANK",
             "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "torch"),
)


@dataclass(frozen=True)
class Launch:
    """What the launcher told this process. ``size``/``local_size`` are 0 when it did not say
    (ask the communicator)."""

    launcher: Launcher
    rank: int
    size: int
    local_rank: int
    local_size: int

    @property
    def name(self) -> str:
        return self.launcher.name


def _int(env: Mapping[str, str], name: str) -> int | None:
    value = env.get(name, "") if name else ""
    return int(value) if value.isdigit() else None


def _slurm_local_size(env: Mapping[str, str]) -> int:
    """Tasks of this step on this node, from ``SLURM_STEP_TASKS_PER_NODE`` (``2(x3),1``: two
    tasks on each of three nodes, then one) and ``SLURM_NODEID``; 0 when unreadable."""
    spec = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE", "")
    node = _int(env, "SLURM_NODEID")
    counts: list[int] = []
    for part in filter(None, spec.split(",")):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if m is None:
            return 0
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    return counts[node] if node is not None and node < len(counts) else 0


def detect(environ: Mapping[str, str] | None = None) -> Launch | None:
    """The launcher that started this process and what it said; None for a plain process."""
    env = os.environ if environ is None else environ
    for launcher in LAUNCHERS:
        if not all(m in env for m in launcher.markers):
            continue
        rank = _int(env, launcher.rank)
        if rank is None:
            continue
        size = _int(env, launcher.size) or 0
        local_size = _int(env, launcher.local_size)
        if local_size is None:
            local_size = _slurm_local_size(env) if launcher.name == "srun" else 0
        local_rank = _int(env, launcher.local_rank)
        return Launch(launcher, rank, size, local_rank if local_rank is not None else 0,
                      local_size)
    return None


def launched(environ: Mapping[str, str] | None = None) -> bool:
    """Whether a launcher (mpiexec, srun, torchrun, ...) started this process."""
    return detect(environ) is not None


def launched_size(environ: Mapping[str, str] | None = None) -> int:
    """Ranks in the job as the launcher says (1 for a plain process, 0 when it does not say)."""
    launch = detect(environ)
    return 1 if launch is None else launch.size


def backend(environ: Mapping[str, str] | None = None) -> str:
    """The communication backend the launcher implies ("mpi" for a plain process)."""
    launch = detect(environ)
    return "mpi" if launch is None else launch.launcher.comm


VARIABLES: tuple[str, ...] = tuple(sorted({
    v for entry in LAUNCHERS
    for v in (*entry.markers, entry.rank, entry.size, entry.local_rank, entry.local_size) if v
} | {"SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE", "SLURM_NODEID"}))
"""Every variable :func:`detect` reads (tests clear them to look like a plain process)."""
