"""Single-rank plans under a real mpiexec (run by tests/mpi/test_compile_single.py)."""

import pytest
import torch

import fxpar
from fxpar.comm.world import world


def case_one_rank_plan_on_two_ranks() -> None:
    """On a job of any size above one (tests/mpi/test_gpu.py launches it on 5 ranks)."""
    size = world().size
    program = fxpar.compile(torch.nn.Conv2d(3, 2, 1), fxpar.Plan(), (2, 3, 4, 4))
    with pytest.raises(fxpar.PlanError, match=f"needs 1 ranks but the job has {size}: run "
                       "with `mpiexec -n 1`"):
        program.local()
