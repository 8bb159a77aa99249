"""The transparency matrix on CUDA (skipped without a GPU): compiled programs vs one process,
both on the GPU in float64 (tests/helpers/transparency.py reads FXPAR_TEST_DEVICE=cuda; ranks
share the node's GPUs round-robin by local rank). Receives go through pinned host staging unless
the MPI is CUDA-aware; one launch forces staging, one uses the torch.distributed backend."""


import pytest
import torch
from helpers.launch import CASES as CASE_FILES
from helpers.launch import PATHS

from fxpar.testing import run_cases

CASES = [f"{CASE_FILES / f}::{n}" for f, n in (
    ("single_cases.py", "case_one_rank_plan_on_two_ranks"),
    ("pipeline_cases.py", "case_resnet18_lp2"),
    ("pipeline_cases.py", "case_resnet18_pp2_1f1b_s3"),
    ("spatial_cases.py", "case_conv_k3_p2_vertical"),
    ("spatial_cases.py", "case_resnet18_p4_square"),
    ("spatial_cases.py", "case_sp_lp_resnet18"),
    ("comm_cases.py", "case_device_paths"),
    ("schedule_cases.py", "case_zb_sp2_pp2_resnet18"),
    ("schedule_cases.py", "case_i1f1b_resnet18_4stages_on_2_ranks"),
    ("schedule_cases.py", "case_zbv_all_spatial_sp2_gems"),
    ("comm_cases.py", "case_device_syncs_per_step"),
)]

pytestmark = [pytest.mark.gpu, pytest.mark.mpi,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.fixture(scope="module")
def results():
    return run_cases(CASES, n=5, timeout=1500, env={"FXPAR_TEST_DEVICE": "cuda"},
                     pythonpath=PATHS)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.split("::")[1])
def test_transparency_on_cuda(results, case):
    results[case].check()


def test_forced_pinned_staging_on_cuda():
    """Pinned host staging (the route of an MPI that is not CUDA-aware) forced on an SP+LP
    plan, whatever this machine's MPI can do."""
    case = f"{CASE_FILES / 'spatial_cases.py'}::case_sp_lp_resnet18"
    res = run_cases([case], n=5, timeout=900, pythonpath=PATHS,
                    env={"FXPAR_TEST_DEVICE": "cuda", "FXPAR_FORCE_STAGING": "1"})[case]
    res.check()


@pytest.mark.skipif(torch.cuda.device_count() < 2,
                    reason="NCCL needs one GPU per rank (ranks cannot share a GPU)")
@pytest.mark.parametrize("launcher", ["mpiexec", "torchrun"])
def test_nccl_backend(launcher):
    """Collectives, halos and pipeline messages over NCCL, device to device, each pair's
    messages in the order both ends agree on (fxpar.core.wire): a 1F1B pipeline and a layer
    pipeline on 2 GPUs; with 4, zero-bubble SP2 x PP2 and SP4 too. Under mpiexec the ranks
    join torch.distributed through MPI (FXPAR_COMM=torch); under torchrun there is no MPI."""
    n = 4 if torch.cuda.device_count() >= 4 else 2
    names = [("pipeline_cases.py", "case_resnet50_pp2_s2"),
             ("pipeline_cases.py", "case_resnet18_lp2"),
             ("comm_cases.py", "case_device_syncs_per_step")]
    if n == 4:
        names += [("schedule_cases.py", "case_zb_sp2_pp2_resnet18"),
                  ("spatial_cases.py", "case_resnet18_p4_square")]
    cases = [f"{CASE_FILES / f}::{c}" for f, c in names]
    env = {"FXPAR_TEST_DEVICE": "cuda", "FXPAR_TORCH_BACKEND": "nccl"}
    if launcher == "mpiexec":
        env["FXPAR_COMM"] = "torch"
    res = run_cases(cases, n=n, timeout=900, pythonpath=PATHS, env=env, launcher=launcher)
    for case in cases:
        res[case].check()
