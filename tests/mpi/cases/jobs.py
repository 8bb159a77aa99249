"""Plain user scripts for fault injection and determinism: ``mpiexec -n N python jobs.py NAME
OUT``. Unlike the case harness (fxpar.testing), nothing here catches exceptions: each job is a
user's training script, and tests/mpi/test_faults.py asserts what the whole job does when one rank
fails (ends, in bounded time, printing that rank's error once) and that two runs of the same
seed and plan are bit-identical."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import fxpar
from fxpar.comm.world import world

SHAPE = (8, 3, 16, 16)
PLANS = {
    "pp": fxpar.Plan(stages=2, microbatches=2),  # 2 ranks
    "sp": fxpar.Plan(spatial_parts=2, slice="vertical"),  # 2 ranks
    "hybrid": fxpar.Plan(stages=2, spatial_parts=2, microbatches=2, schedule="1f1b"),  # 3 ranks
}


def build(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.MaxPool2d(2), nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8),
                         nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(8, 4)).double()


def classifier(num_classes: int = 4) -> nn.Module:
    """The same model for ``fxpar-run tests/mpi/cases/jobs.py:classifier`` (float32 there)."""
    assert num_classes == 4
    return build(0).float()


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return (torch.randn(SHAPE, dtype=torch.float64, generator=g),
            torch.randint(0, 4, (SHAPE[0],), generator=g))


def compiled(plan: str, seed: int = 0, loss_fn=F.cross_entropy) -> fxpar.RankProgram:
    program = fxpar.compile(build(seed), PLANS[plan], SHAPE, loss_fn=loss_fn,
                            optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9))
    return program.local()


def train(rp: fxpar.RankProgram, steps: int = 3, before=None) -> list[float]:
    losses = []
    for step in range(steps):
        x, y = batch(step)
        if before is not None:
            before(rp, step)
        losses.append(float(rp.train_step(x, y)))
    return losses


def on(rank: int, step: int, act):
    """A hook for ``train(before=)``: run ``act()`` on ``rank`` before step ``step``."""
    def before(rp: fxpar.RankProgram, s: int) -> None:
        if rp.rank == rank and s == step:
            act()
    return before


def inside_stage(rp: fxpar.RankProgram, rank: int, act) -> None:
    """From now on, run ``act()`` at the start of every stage forward on ``rank`` (inside a
    compute action, while its peers are in theirs)."""
    if world().rank != rank:
        return
    for module in rp.stages.values():
        module.register_forward_pre_hook(lambda *_: act())


# -- faults ------------------------------------------------------------------------------------
def job_loss_raises(out: Path) -> None:
    """User loss code raises on the last stage (rank 1) in the second step."""
    calls = []

    def loss(o: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        if len(calls) == 3:  # step 2, micro-batch 1
            raise ValueError("injected failure in the user's loss")
        return F.cross_entropy(o, y)
    train(compiled("pp", loss_fn=loss))


def job_data_loader_raises(out: Path) -> None:
    """The data loader of rank 0 raises before step 2 while rank 1 is already exchanging."""
    def fail() -> None:
        raise OSError("injected failure in the data loader: cannot read image 17")
    train(compiled("sp"), before=on(0, 1, fail))


def job_out_of_memory_in_forward(out: Path) -> None:
    """A stage's forward on rank 2 runs out of memory (a real allocator failure)."""
    rp = compiled("hybrid")
    train(rp, steps=1)
    inside_stage(rp, 2, lambda: torch.empty(1 << 60, dtype=torch.uint8))
    train(rp, steps=1)


def job_rank_killed(out: Path) -> None:
    """Rank 1 is killed (SIGKILL, as the OOM killer does) in the middle of a step."""
    rp = compiled("pp")
    train(rp, steps=1)
    inside_stage(rp, 1, lambda: os.kill(os.getpid(), signal.SIGKILL))
    train(rp, steps=1)


def job_rank_stuck(out: Path) -> None:
    """Rank 1 hangs in user code; the others' watchdog (FXPAR_WATCHDOG) ends the job."""
    train(compiled("sp"), before=on(1, 1, lambda: time.sleep(3600)))


def job_rank_stuck_before_sending(out: Path) -> None:
    """Rank 0 hangs in user code while rank 1 waits to receive its activations: a
    point-to-point wait (under FXPAR_COMM=torch, on the gloo process group)."""
    train(compiled("pp"), before=on(0, 1, lambda: time.sleep(3600)))


def job_ranks_seeded_differently(out: Path) -> None:
    """Rank 1 builds the model under another seed: the start-up check stops every rank."""
    train(compiled("pp", seed=world().rank))


def job_hybrid(out: Path) -> None:
    """Three steps of SP2+PP, nothing else: the faults come from FXPAR_FAULT."""
    train(compiled("hybrid"), steps=3)


def job_caught_and_exits(out: Path) -> None:
    """The user's loop catches the failure (FXPAR_FAULT=2:2:raise: rank 2, step 2), prints
    it and leaves with sys.exit(2): the job must still end (it once hung in MPI_Finalize)."""
    rp = compiled("hybrid")
    try:
        train(rp, steps=3)
    except Exception as e:
        print(f"[rank {rp.rank}] caught {type(e).__name__}; exiting with code 2", flush=True)
        sys.exit(2)


def job_caught_and_closes(out: Path) -> None:
    """The same, but the script closes the program (a with block) and returns normally."""
    with compiled("hybrid") as rp:
        try:
            train(rp, steps=3)
        except Exception as e:
            print(f"[rank {rp.rank}] caught {type(e).__name__}; going on", flush=True)


def job_one_rank_stops_early(out: Path) -> None:
    """A script bug: rank 1 runs one step, rank 0 three; rank 1's process exits."""
    rp = compiled("pp")
    train(rp, steps=1 if rp.rank == 1 else 3)


def _state(rp: fxpar.RankProgram) -> list[torch.Tensor]:
    out = [t.clone() for _, t in sorted(rp.state_dict().items())]
    for _, p in rp.named_parameters():
        out.append(rp.optimizer.state[p]["momentum_buffer"].clone())
    return out


def job_nan_undone(out: Path) -> None:
    """FXPAR_FAULT=1:2:nan-loss (rank 1, a tile, step 2) under both policies, then the same
    job trained without that batch: the state after each must be bit-identical (the step was
    undone on every rank: no optimizer step, BatchNorm statistics and counts as before)."""
    fault = os.environ.pop("FXPAR_FAULT")
    runs = {}
    for policy in ("stop", "skip", "reference"):
        os.environ["FXPAR_FAULT"] = fault if policy != "reference" else ""
        os.environ["FXPAR_NONFINITE"] = "skip" if policy == "skip" else "stop"
        rp = compiled("hybrid")
        losses = []
        for step in range(3):
            if policy == "reference" and step == 1:
                continue
            x, y = batch(step)
            try:
                losses.append(rp.train_step(x, y))
            except fxpar.NonFiniteError as e:
                assert policy == "stop" and step == 1, (policy, step)
                assert "step 2: NaN or inf values (rank" in str(e), e
                losses.append(None)
        if policy == "skip":
            assert rp.guard.skipped == 1 and losses[1] != losses[1], losses  # NaN
        runs[policy] = (_state(rp), [v for i, v in enumerate(losses) if i != 1 or
                                    policy == "reference"])
        rp.close()
    ref_state, ref_losses = runs["reference"]
    for policy in ("stop", "skip"):
        state, losses = runs[policy]
        assert losses == ref_losses, (policy, losses, ref_losses)
        assert len(state) == len(ref_state) > 10
        for a, b in zip(state, ref_state, strict=True):
            assert torch.equal(a, b), policy
    (out / f"rank{rp.rank}.ok").write_text(json.dumps(ref_losses))


# -- determinism -------------------------------------------------------------------------------
def _digest(rp: fxpar.RankProgram, losses: list[float]) -> tuple[str, int]:
    h = hashlib.sha256(json.dumps(losses).encode())
    tensors = [t for _, t in sorted(rp.state_dict().items())]
    tensors += [p.grad for _, p in rp.named_parameters() if p.grad is not None]
    for t in tensors:
        h.update(t.detach().contiguous().numpy().tobytes())
    return h.hexdigest(), len(tensors)


def job_determinism(out: Path) -> None:
    """Train the hybrid plan twice in this process (fresh compile each time); write each
    rank's digest of losses, parameters, buffers and gradients for the test to compare with
    another launch."""
    runs = []
    for _ in range(2):
        rp = compiled("hybrid", seed=0)
        losses = train(rp, steps=3)
        runs.append(_digest(rp, losses))
    assert runs[0] == runs[1], f"rank {rp.rank}: two runs in one process differ: {runs}"
    (out / f"rank{rp.rank}.json").write_text(json.dumps(
        {"digest": runs[0][0], "tensors": runs[0][1], "losses": losses}))


if __name__ == "__main__":
    globals()[f"job_{sys.argv[1]}"](Path(sys.argv[2]))
