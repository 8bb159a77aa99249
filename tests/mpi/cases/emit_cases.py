"""Saved programs under mpiexec (run by tests/mpi/test_programs.py): a program written with
program.save and loaded back by each rank trains bit for bit like the in-memory program (which
the transparency suites compare with one process), in spatial + pipeline, fused-halo and GEMS
layouts."""

import copy
import tempfile
from pathlib import Path

import torch
import torchvision.models as tvm
from helpers.models import resnet18_narrow
from helpers.transparency import sgd, sub_comm

import fxpar
from fxpar.cli.run import main as fxpar_run
from fxpar.comm.world import world
from fxpar.program.loader import load


def _shared_dir(comm) -> Path:
    """One scratch folder for all ranks of ``comm`` (rank 0 makes it)."""
    name = tempfile.mkdtemp(prefix="fxpar-emit-") if comm.rank == 0 else None
    return Path(comm.bcast_object(name))


def _check_saved_equals_memory(plan: fxpar.Plan, shape, steps: int = 2) -> None:
    comm = sub_comm(plan.world_size)
    if comm is None:
        return
    torch.manual_seed(0)
    model = resnet18_narrow().double()  # a saved program is the same at any width
    twin = copy.deepcopy(model)
    example = torch.empty(shape, dtype=torch.float64, device="meta")
    saved = fxpar.compile(model, plan, example, optimizer=sgd, comm=comm)
    folder = _shared_dir(comm)
    if comm.rank == 0:
        saved.save(folder)
    comm.barrier()
    loaded = load(folder, comm, optimizer=sgd)
    memory = fxpar.compile(twin, plan, example, optimizer=sgd, comm=comm).local(comm)
    assert loaded.actions == memory.actions
    g = torch.Generator().manual_seed(1)
    x = torch.randn(shape, dtype=torch.float64, generator=g)
    y = torch.randint(0, 5, (shape[0],), generator=g)
    for step in range(steps):
        a, b = loaded.train_step(x, y), memory.train_step(x, y)
        assert a == b, f"step {step}: loss {a} (loaded) != {b} (in memory)"
        got, want = dict(loaded.named_parameters()), dict(memory.named_parameters())
        assert set(got) == set(want)
        for name, p in want.items():
            assert torch.equal(got[name], p), f"step {step}: {name} differs"
            assert torch.equal(got[name].grad, p.grad), f"step {step}: grad of {name} differs"
        sa, sb = loaded.state_dict(), memory.state_dict()
        assert set(sa) == set(sb)
        assert all(torch.equal(sa[k], sb[k]) for k in sb), "buffers differ"
    loaded.eval()
    memory.eval()
    out_a, out_b = loaded.forward(x), memory.forward(x)
    assert (out_a is None) == (out_b is None)
    if out_b is not None:
        assert torch.equal(out_a, out_b)


def case_saved_spatial_pipeline_program_trains_like_memory():
    plan = fxpar.Plan(stages=2, spatial_parts=2, spatial_stages=1, microbatches=2,
                      schedule="1f1b")
    _check_saved_equals_memory(plan, (4, 3, 32, 32))


def case_saved_fused_halo_program_trains_like_memory():
    """Halo fusion's local windows and BatchNorm boxes survive the generated code."""
    _check_saved_equals_memory(fxpar.Plan(spatial_parts=4, halo_fusion="all"), (2, 3, 32, 32))


def case_saved_gems_program_trains_like_memory():
    _check_saved_equals_memory(fxpar.Plan(stages=2, gems=True, microbatches=2), (8, 3, 32, 32))


def case_fxpar_run_runs_a_saved_program_and_refuses_another_world_size():
    comm = world()
    folder = _shared_dir(comm)
    if comm.rank == 0:
        torch.manual_seed(0)
        model = tvm.resnet18(num_classes=4)
        plan = fxpar.Plan(stages=2, spatial_parts=2, spatial_stages=1)
        fxpar.compile(model, plan, torch.empty((2, 3, 32, 32), device="meta")).save(folder)
    comm.barrier()
    # 4 ranks for a 3-rank program: every rank says so and exits 2 (no communication)
    assert fxpar_run([str(folder), "--steps", "1"]) == 2
