"""A rank killed (SIGKILL) while writing its shard must leave the previous checkpoint loadable.

One 2-rank mpiexec launch runs :func:`train_save_then_die_while_saving` (a case for
``fxpar.testing.run_cases``, not a pytest test): it trains a step, saves step 1 and records the
state it saved, trains another step, then rank 1 dies part way through writing its shard of
step 2, after rank 0's shard is complete. The test then checks what is on disk, without MPI:
``latest`` still names step 1, export and info give step 1, and each rank's ``load`` restores
exactly the recorded step-1 state (load communicates nothing, so each rank's view can be loaded
in this one process)."""

import json
import os
import re
import signal
import time
from pathlib import Path

import pytest
import torch
from helpers.launch import PATHS
from torch import nn

import fxpar
from fxpar.cli.checkpoint import main as checkpoint_cli
from fxpar.program import checkpoint
from fxpar.testing import run_cases

PLAN = fxpar.Plan(stages=2, microbatches=2)  # 2 ranks
SHAPE = (4, 3, 8, 8)
KILLED = "Killed (signal 9)"  # what mpiexec (MPICH) prints when a rank dies of SIGKILL


def _program(classes: int = 3) -> fxpar.Program:
    """Also used by tests/mpi/test_checkpoint_faults.py (with ``classes``, another last layer)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
                          nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, classes)).double()
    return fxpar.compile(model, PLAN, torch.empty(SHAPE, dtype=torch.float64, device="meta"),
                         optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9))


def _batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(SHAPE, dtype=torch.float64, generator=g),
            torch.randint(0, 3, (SHAPE[0],), generator=g))


def _training_state(rp) -> list[tuple[str, torch.Tensor]]:
    """Parameters, buffers and momentum buffers of this rank, in a fixed order."""
    out = [(f"stage {key} {k}", v.clone()) for key, m in sorted(rp.stages.items())
           for k, v in m.state_dict().items()]
    out += [(f"momentum of {n}", rp.optimizer.state[p]["momentum_buffer"].clone())
            for n, p in rp.named_parameters()]
    return out


def _die_part_way(path: str | os.PathLike[str], data: bytes | memoryview) -> None:
    """Stands in for the write of the shard's bytes on rank 1: once rank 0's shard is in place,
    write the first bytes of this shard, then die as a killed process does (no cleanup, no
    exception)."""
    theirs = Path(path).parent / "rank00000.pt"
    deadline = time.monotonic() + 30
    while not theirs.exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    with open(path, "wb") as f:
        f.write(data[:len(data) // 3])
        f.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def train_save_then_die_while_saving() -> None:
    from fxpar.comm.world import world

    comm = world()
    out = Path(os.environ["FXPAR_CRASH_DIR"])
    rp = _program().local(comm)
    rp.train_step(*_batch(1))
    checkpoint.save(rp, out / "ckpt", step=1)
    full = rp.full_state_dict()  # collective; rank 0's is the model's
    torch.save({"full": full, "state": _training_state(rp)}, out / f"saved{comm.rank}.pt")
    rp.train_step(*_batch(2))
    if comm.rank == 1:
        checkpoint._write_bytes = _die_part_way  # this process only; it does not outlive the save
    checkpoint.save(rp, out / "ckpt", step=2)
    raise AssertionError(f"rank {comm.rank}: the save of step 2 returned, but rank 1 was to "
                         f"be killed in it")


@pytest.mark.mpi
def test_a_rank_killed_while_saving_leaves_the_previous_checkpoint(tmp_path, capsys):
    case = f"{__file__}::train_save_then_die_while_saving"
    result = run_cases([case], n=2, timeout=60, env={"FXPAR_CRASH_DIR": str(tmp_path)},
                        pythonpath=PATHS)[case]
    assert not result.passed and "timeout" not in result.report, result.report
    assert KILLED in result.output, result.report
    folder = tmp_path / "ckpt"
    assert json.loads((folder / "latest").read_text())["folder"] == "step-00000001"
    unfinished = sorted(p.name for p in (folder / "step-00000002").iterdir())
    assert len(unfinished) == 2 and unfinished[1] == "rank00000.pt", unfinished
    assert re.fullmatch(r"\.rank00001\.pt\.tmp\d+", unfinished[0]), unfinished  # cut short

    saved = [torch.load(tmp_path / f"saved{r}.pt", weights_only=True) for r in range(2)]
    exported = checkpoint.export(folder)
    assert list(exported) == list(saved[0]["full"])
    for k, v in saved[0]["full"].items():
        assert torch.equal(exported[k], v), k

    assert checkpoint_cli(["info", str(folder)]) == 0
    info = capsys.readouterr().out
    assert info.startswith("step 1, 2 ranks,"), info
    assert "unfinished saves (ignored; the next save removes them): step-00000002" in info

    program = _program()
    for r in range(2):
        rp = program.for_rank(r)
        assert checkpoint.load(rp, folder) == 1
        got, want = _training_state(rp), saved[r]["state"]
        assert [k for k, _ in got] == [k for k, _ in want]
        assert any(k.startswith("momentum") for k, _ in got)
        for (k, a), (_, b) in zip(got, want, strict=True):
            assert torch.equal(a, b), f"rank {r}: {k}"
