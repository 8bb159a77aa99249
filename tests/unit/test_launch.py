"""Which launcher started a process, and what it said (fxpar.comm.launch): one environment per
launcher as it really sets it, and the nested cases where the order of the table decides."""

import subprocess
import sys

import pytest

from fxpar.comm import launch
from fxpar.comm.launch import detect

MPICH = {"PMI_RANK": "3", "PMI_SIZE": "8", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"}
OPEN_MPI = {"OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_SIZE": "8",
            "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "4",
            "PMIX_RANK": "5"}
SRUN = {"SLURM_JOB_ID": "77", "SLURM_STEP_ID": "0", "SLURM_PROCID": "6", "SLURM_NTASKS": "7",
        "SLURM_LOCALID": "0", "SLURM_NODEID": "3", "SLURM_STEP_TASKS_PER_NODE": "2(x3),1"}
TORCHRUN = {"TORCHELASTIC_RUN_ID": "abc", "RANK": "9", "WORLD_SIZE": "16", "LOCAL_RANK": "1",
            "LOCAL_WORLD_SIZE": "8", "MASTER_ADDR": "node0", "MASTER_PORT": "29500"}


@pytest.mark.parametrize(("env", "want"), [
    ({}, None),
    (MPICH, ("mpiexec (MPICH)", 3, 8, 1, 2, "mpi")),
    (OPEN_MPI, ("mpiexec (Open MPI)", 5, 8, 1, 4, "mpi")),
    (SRUN, ("srun", 6, 7, 0, 1, "mpi")),
    (TORCHRUN, ("torchrun", 9, 16, 1, 8, "torch")),
    # one torchrun per node under srun: the worker is torchrun's, not Slurm's task
    ({**SRUN, **TORCHRUN}, ("torchrun", 9, 16, 1, 8, "torch")),
    # mpiexec in an allocation starts its proxies with srun: the rank is MPICH's
    ({**SRUN, **MPICH}, ("mpiexec (MPICH)", 3, 8, 1, 2, "mpi")),
    ({"PMIX_RANK": "2"}, ("mpiexec (PMIx)", 2, 0, 0, 0, "mpi")),
    ({"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "h"},
     ("torch.distributed environment", 1, 2, 0, 0, "torch")),
    ({"RANK": "1", "WORLD_SIZE": "2"}, None),  # no rendezvous address: not a launch
], ids=["plain", "mpich", "openmpi", "srun", "torchrun", "torchrun-in-srun", "mpiexec-in-slurm",
        "pmix", "torch-env", "rank-only"])
def test_each_launcher_is_read_from_its_own_variables(env, want):
    found = detect(env)
    got = None if found is None else (found.name, found.rank, found.size, found.local_rank,
                                      found.local_size, found.launcher.comm)
    assert got == want
    assert launch.launched(env) is (want is not None)
    assert launch.backend(env) == ("mpi" if want is None else want[-1])


@pytest.mark.parametrize(("spec", "node", "size"), [
    ("4", "0", 4), ("2(x3),1", "2", 2), ("2(x3),1", "3", 1), ("2(x3),1", "4", 0),
    ("weird", "0", 0)])
def test_srun_tasks_on_this_node(spec, node, size):
    env = {**SRUN, "SLURM_STEP_TASKS_PER_NODE": spec, "SLURM_NODEID": node}
    assert detect(env).local_size == size


def _world(env: dict[str, str]) -> subprocess.CompletedProcess:
    code = "from fxpar.comm.world import world\nc = world()\nprint('world', c.rank, c.size)\n"
    import os

    clean = {k: v for k, v in os.environ.items() if k not in launch.VARIABLES
             and k != "FXPAR_COMM"}
    return subprocess.run([sys.executable, "-c", code], env={**clean, **env},
                          capture_output=True, text=True, timeout=120)


def test_an_srun_whose_mpi_cannot_see_the_other_tasks_is_a_clear_error():
    """pip's mpich has no Slurm PMI: under srun every task would be a world of one and train
    the whole job alone. Said before any communication, with what to do."""
    r = _world({**SRUN, "SLURM_PROCID": "0", "SLURM_NTASKS": "2"})
    assert r.returncode != 0
    assert "srun started 2 ranks but MPI sees 1" in r.stderr, r.stderr[-2000:]
    assert "FXPAR_COMM=torch" in r.stderr


def test_asking_for_mpi_under_torchrun_is_a_clear_error():
    r = _world({**TORCHRUN, "FXPAR_COMM": "mpi"})
    assert r.returncode != 0
    assert "FXPAR_COMM=mpi, but torchrun started this job" in r.stderr, r.stderr[-2000:]
