"""Jobs started by torchrun and by srun (its environment), not only mpiexec: fxpar-run,
fxpar-predict and the transparency cases train and predict what one process does, with ranks
that communicate over torch.distributed alone (fxpar.comm.distributed: no MPI in the
process)."""

import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers.launch import CASES, PATHS

from fxpar.comm.launch import detect
from fxpar.models.zoo import build_model
from fxpar.program.checkpoint import export
from fxpar.testing import run_cases, torchrun

pytestmark = pytest.mark.mpi

BIN = Path(sys.executable).parent
TRAIN = ["models:unet", "--image-size", "48", "--batch-size", "2", "--num-classes", "3",
         "--steps", "2", "--loss", "dicece", "--class-weights", "0.2,1,2", "--dtype", "float64",
         "--device", "cpu", "--lr", "0.05"]
"""A U-Net under MONAI's DiceCE loss with class weights, two SGD steps, float64."""
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
for _name in ("FXPAR_COMM", "PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_RANK"):
    ENV.pop(_name, None)


def _run(cmd, env=None, timeout=300):
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env or ENV)
    assert r.returncode == 0, f"{cmd}\n{r.stdout[-3000:]}\n{r.stderr[-5000:]}"
    return r


def _same_state(a: dict, b: dict) -> None:
    """Every parameter and buffer, element-wise, within float64 rounding."""
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    for k in a:
        x, y = a[k].double(), b[k].double()
        scale = max(x.abs().max().item(), 1.0)
        assert (x - y).abs().max().item() <= 1e-12 * scale, k


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """The reference: fxpar-run on one process, no launcher."""
    folder = tmp_path_factory.mktemp("one") / "ckpt"
    _run([str(BIN / "fxpar-run"), *TRAIN, "--checkpoint", str(folder)])
    return export(folder)


def test_fxpar_run_under_torchrun_trains_what_one_process_trains(one_process, tmp_path):
    """torchrun, two ranks, two tiles: every weight and BatchNorm buffer after two steps."""
    r = _run([torchrun(), "--standalone", "--nproc-per-node=2", "--no-python",
              str(BIN / "fxpar-run"), *TRAIN, "--spatial-parts", "2",
              "--checkpoint", str(tmp_path / "ckpt")])
    assert "on 2 rank(s)" in r.stdout and r.stdout.count("step    2/2") == 1, r.stdout
    _same_state(one_process, export(tmp_path / "ckpt"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _srun_env(rank: int, size: int, port: int) -> dict[str, str]:
    """What srun exports to task ``rank`` of a one-node step (Slurm's own variables), with
    the rendezvous a job script sets for FXPAR_COMM=torch (docs/clusters.md)."""
    return {**ENV, "SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_PROCID": str(rank),
            "SLURM_NTASKS": str(size), "SLURM_LOCALID": str(rank), "SLURM_NODEID": "0",
            "SLURM_STEP_TASKS_PER_NODE": str(size), "FXPAR_COMM": "torch",
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}


def test_fxpar_run_in_an_srun_environment_trains_what_one_process_trains(one_process,
                                                                          tmp_path):
    """Two processes with the variables srun sets (no Slurm here: started by this test) and
    FXPAR_COMM=torch: they find each other by Slurm's rank and size alone."""
    port = _free_port()
    procs = [subprocess.Popen([str(BIN / "fxpar-run"), *TRAIN, "--spatial-parts", "2",
                               "--checkpoint", str(tmp_path / "ckpt")],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env=_srun_env(r, 2, port)) for r in range(2)]
    try:
        outs = [p.communicate(timeout=300)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0], "\n".join(outs)
    assert "on 2 rank(s)" in outs[0]
    _same_state(one_process, export(tmp_path / "ckpt"))


def test_fxpar_predict_under_torchrun_equals_one_process(tmp_path):
    """Four tiles of a 2x2 grid under torchrun vs the one-process forward, float64 logits."""
    image = np.random.default_rng(0).random((3, 96, 80), dtype=np.float32)
    np.save(tmp_path / "image.npy", image)
    torch.manual_seed(0)
    torch.save(build_model("models:unet", num_classes=3).state_dict(), tmp_path / "w.pt")
    args = ["models:unet", str(tmp_path / "image.npy"), "--num-classes", "3", "--region", "48",
            "--weights", str(tmp_path / "w.pt"), "--output", "logits", "--dtype", "float64",
            "--no-progress"]
    _run([str(BIN / "fxpar-predict"), *args, str(tmp_path / "one.zarr")])
    _run([torchrun(), "--standalone", "--nproc-per-node=4", "--no-python",
          str(BIN / "fxpar-predict"), *args, "--spatial-parts", "4", "--slice", "square",
          str(tmp_path / "four.zarr")])
    import zarr

    one, four = (np.asarray(zarr.open(str(tmp_path / f"{n}.zarr"), mode="r"))
                 for n in ("one", "four"))
    assert one.shape == four.shape and one.shape[-2:] == (96, 80)
    assert np.abs(one - four).max() <= 1e-12 * max(np.abs(one).max(), 1.0)


TORCHRUN_CASES = [f"{CASES / f}::{n}" for f, n in (
    ("spatial_cases.py", "case_sp_lp_resnet18"),
    ("schedule_cases.py", "case_zb_sp2_pp2_resnet18"),
    ("gems_dp_cases.py", "case_sp_dp_resnet18"),
    ("gems_dp_cases.py", "case_sp_gems_lp_resnet18"),
    ("comm_cases.py", "case_collectives"),
    ("comm_cases.py", "case_subcommunicators"),
    ("comm_cases.py", "case_one_host_read_per_step"),
    ("comm_cases.py", "case_issue_order_agrees"),
)]
ISSUE_ORDER = {"FXPAR_P2P": "issue"}
"""The torchrun launch matches every tensor message in issue order, tags ignored, as NCCL
does: a message issued out of the order both ends agree on lands in the wrong buffer or
fails case_issue_order_agrees' check."""


@pytest.fixture(scope="module")
def torchrun_results():
    return run_cases(TORCHRUN_CASES, n=4, timeout=400, pythonpath=PATHS, launcher="torchrun",
                     env=ISSUE_ORDER)


@pytest.mark.parametrize("case", TORCHRUN_CASES, ids=lambda c: c.split("::")[1])
def test_transparency_under_torchrun(torchrun_results, case):
    """Spatial + layer pipeline, zero-bubble SP2 x PP2, SP2 x DP2, SP + GEMS (float64, vs one
    process), the communicator's own collectives and sub-communicators, one host read per
    training step, and the order both ends of each pair issue their messages in, on four
    ranks that torchrun started, every message matched in issue order (as NCCL does)."""
    torchrun_results[case].check()
    assert "torchrun" not in torchrun_results[case].report


def test_a_failing_rank_ends_a_torchrun_job_with_its_traceback():
    """Rank 1 raises while rank 0 waits for it: torchrun's agent ends the job (no MPI_Abort
    here), the report carries rank 1's traceback, and the next case runs in a fresh launch."""
    failing = f"{CASES / 'comm_cases.py'}::case_fails_on_rank_1"
    later = f"{CASES / 'comm_cases.py'}::case_p2p_ring"
    res = run_cases([failing, later], n=2, timeout=120, pythonpath=PATHS, launcher="torchrun")
    assert not res[failing].passed
    assert "injected failure on rank 1" in res[failing].report
    assert res[later].passed, res[later].report


def test_the_srun_environment_is_read_as_srun():
    env = _srun_env(1, 2, 1234)
    found = detect(env)
    assert found is not None and (found.name, found.rank, found.size) == ("srun", 1, 2)
    assert torch.distributed.is_available()


OPEN_MPI = Path("/usr/bin/mpiexec.openmpi")
OPEN_MPI_LIB = Path("/usr/lib/x86_64-linux-gnu/libmpi.so.40")


@pytest.mark.skipif(not (OPEN_MPI.exists() and OPEN_MPI_LIB.exists()),
                    reason="no system Open MPI (Debian: apt-get install openmpi-bin; .ci/run "
                           "installs it)")
def test_transparency_under_a_system_open_mpi(monkeypatch):
    """The same cases under the system's Open MPI instead of pip's mpich: mpi4py's wheel
    carries both ABIs and loads the one named (MPI4PY_MPIABI / MPI4PY_LIBMPI), as a cluster
    user's site MPI would be loaded."""
    env = {"FXPAR_MPIEXEC": str(OPEN_MPI), "MPI4PY_MPIABI": "openmpi",
           "MPI4PY_LIBMPI": str(OPEN_MPI_LIB), "OMPI_ALLOW_RUN_AS_ROOT": "1",
           "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1", "OMPI_MCA_rmaps_base_oversubscribe": "1"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    cases = [c for c in TORCHRUN_CASES if not c.endswith("case_issue_order_agrees")] + \
        [f"{CASES / 'comm_cases.py'}::case_p2p_ring"]  # sendrecv polled: no MPI-4 Isendrecv
    res = run_cases(cases, n=4, timeout=400, pythonpath=PATHS, env=env)
    for case in cases:
        res[case].check()
    assert "Open MPI" in subprocess.run(
        [sys.executable, "-c", "from mpi4py import MPI; print(MPI.Get_library_version())"],
        env={**ENV, **env}, capture_output=True, text=True, timeout=60).stdout
