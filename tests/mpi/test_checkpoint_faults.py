"""A damaged shard is refused on every rank, and the version before it resumes bit-identically.

One 2-rank mpiexec launch (float64, Plan(stages=2, microbatches=2), SGD with momentum) runs the
cases below (for ``fxpar.testing.run_cases``; not pytest tests). :func:`damaged_then_resumed`
trains a step and saves step 1 intact, trains a step and saves step 2 twice with
``FXPAR_FAULT=1:2:corrupt-checkpoint`` -- rank 1's shard cut to half (``truncate``), then one
byte changed (``flip``) -- and trains a third step: that run, never interrupted, is the
reference. Loading either step-2 version must raise the same CheckpointError on both ranks,
naming rank 1's file and what was recorded against what was found, and leave both ranks' models
as they were (rank 0's own shard is intact: it must refuse too, or it would train alone). Then
loading step 1 by its folder and training steps 2 and 3 again must give exactly (``torch.equal``)
the reference's parameters, BatchNorm buffers, momentum buffers and losses. The comparison is
shown to catch a change of 1e-12 in one parameter. :func:`other_shapes_refused` loads a
checkpoint into a model with the same keys and another last layer: both ranks refuse, and the
message names the tensors and their shapes. The test then runs ``fxpar-checkpoint verify`` on
what the launch left.
"""

import os
from pathlib import Path

import pytest
import torch
from helpers.launch import PATHS

# the model, the batches and the state they compare: the crash test's (tests/ is on the path
# of the pytest process and, through run_cases(pythonpath=...), of the ranks)
from test_checkpoint_crash import _batch, _program, _training_state

from fxpar.cli.checkpoint import main as checkpoint_cli
from fxpar.program import checkpoint
from fxpar.program.checkpoint import CheckpointError
from fxpar.testing import run_cases

DIR = "FXPAR_CHECKPOINT_FAULTS_DIR"


def _differences(got, want) -> list[str]:
    """The names whose tensors are not bitwise equal (and any name that is not in both)."""
    assert [k for k, _ in got] == [k for k, _ in want], "not the same tensors"
    return [k for (k, a), (_, b) in zip(got, want, strict=True) if not torch.equal(a, b)]


def _save_damaged(rp, folder: Path, step: int, how: str) -> Path:
    os.environ["FXPAR_FAULT"] = f"1:{step}:corrupt-checkpoint:{how}"
    try:
        return checkpoint.save(rp, folder, step=step, keep=None)
    finally:
        del os.environ["FXPAR_FAULT"]


def _refusal(comm, rp, folder: Path) -> str:
    """The CheckpointError's text that ``load`` raised on this rank (the same on every rank)."""
    with pytest.raises(CheckpointError) as e:
        checkpoint.load(rp, folder)
    message = str(e.value)
    assert comm.allgather_object(message) == [message] * comm.size, "ranks differ"
    return message


def damaged_then_resumed() -> None:
    from fxpar.comm.world import world

    comm = world()
    folder = Path(os.environ[DIR]) / "ckpt"
    rp = _program().local(comm)
    rp.train_step(*_batch(1))
    checkpoint.save(rp, folder, step=1, keep=None)
    losses = [rp.train_step(*_batch(2))]
    cut = _save_damaged(rp, folder, 2, "truncate")
    flipped = _save_damaged(rp, folder, 2, "flip")  # the same step again: step-00000002.1
    assert (cut.name, flipped.name) == ("step-00000002", "step-00000002.1")
    losses.append(rp.train_step(*_batch(3)))
    reference = _training_state(rp)

    message = _refusal(comm, rp, folder)  # latest: the flipped version
    bad = flipped / "rank00001.pt"
    assert message.startswith(f"checkpoint {folder} not loaded on any rank: rank 1 cannot "
                              f"load it"), message
    assert f"rank 1: {bad} is damaged: its sha256 is " in message, message
    assert f"Versions still kept in {folder}: step-00000001; load one instead, e.g. " \
           f"fxpar.program.checkpoint.load(rp, '{folder / 'step-00000001'}')" in message, message
    message = _refusal(comm, rp, cut)
    size = checkpoint.read_manifest(cut)["ranks"][1]["size"]
    assert f"rank 1: {cut / 'rank00001.pt'} is damaged: it has {size // 2} bytes where " \
           f"checkpoint.json recorded {size}: cut short" in message, message
    assert not _differences(_training_state(rp), reference), "a refused load changed the model"

    assert checkpoint.load(rp, folder / "step-00000001") == 1
    again = [rp.train_step(*_batch(2)), rp.train_step(*_batch(3))]
    assert again == losses, (again, losses)
    resumed = _training_state(rp)
    assert any(k.startswith("momentum") for k, _ in resumed)
    assert any(k.endswith("num_batches_tracked") for k, _ in resumed)
    assert not _differences(resumed, reference)
    # the comparison sees a change of 1e-12 in one parameter
    name, tensor = next((k, v) for k, v in resumed if v.is_floating_point())
    nudged = [(k, v + 1e-12 if k == name else v) for k, v in resumed]
    assert _differences(nudged, reference) == [name]


def other_shapes_refused() -> None:
    from fxpar.comm.world import world

    comm = world()
    folder = Path(os.environ[DIR]) / "shapes"
    rp = _program().local(comm)
    checkpoint.save(rp, folder, step=0)
    wider = _program(classes=5).local(comm)  # the same keys; the last layer has 5 outputs
    wider.train_step(*_batch(1))
    before = _training_state(wider)
    message = _refusal(comm, wider, folder)
    assert "was saved by another job: it is of another model (tensors of other shapes: " \
           "8.weight (3, 4) saved, (5, 4) now, 8.bias (3,) saved, (5,) now)" in message, message
    assert "same model and plan" in message and "export" in message, message
    assert not _differences(_training_state(wider), before)


@pytest.mark.mpi
def test_a_damaged_shard_stops_every_rank_and_the_version_before_resumes(tmp_path, capsys):
    cases = [f"{__file__}::{name}" for name in ("damaged_then_resumed", "other_shapes_refused")]
    results = run_cases(cases, n=2, timeout=120, env={DIR: str(tmp_path)},
                        pythonpath=PATHS)
    for result in results.values():
        result.check()
    version = tmp_path / "ckpt" / "step-00000002"
    assert checkpoint_cli(["verify", str(version)]) == 1
    out, err = capsys.readouterr()
    lines = out.splitlines()
    assert lines[0] == f"{version}: step 2, 2 shards", out
    assert lines[1].startswith("  rank00000.pt: ok, "), out
    assert lines[2].startswith("  rank00001.pt: DAMAGED: it has "), out
    assert err.startswith(f"fxpar-checkpoint: 1 of 2 shards of {version} failed the check: "
                          f"rank00001.pt. "), err
    assert checkpoint_cli(["verify", str(tmp_path / "ckpt" / "step-00000001")]) == 0
    assert capsys.readouterr().out.endswith("all 2 shards intact\n")
