"""Checkpoints and meta-device materialisation without MPI: one-rank programs, hand-written
shards, error messages, the command line. (The multi-rank claims -- bitwise resume, export and
import across plans, per-rank materialisation under mpiexec -- are in tests/mpi/cases/
checkpoint_cases.py and meta_cases.py, run by tests/mpi/test_programs.py.)"""

import copy
import errno
import hashlib
import json
import re
import shutil
import subprocess
import sys
import zlib
from types import SimpleNamespace

import pytest
import torch
from torch import nn

import fxpar
from fxpar.cli.checkpoint import main as checkpoint_cli
from fxpar.program import checkpoint, integrity
from fxpar.program.checkpoint import CheckpointError
from fxpar.runtime.materialize import MaterializeError, materialize, materialize_model, module_seed

SHAPE = (4, 3, 8, 8)


def tiny() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
                         nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 3))


def sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def one_rank(seed: int = 0, plan: fxpar.Plan | None = None, model: nn.Module | None = None):
    torch.manual_seed(seed)
    model = model if model is not None else tiny().double()
    program = fxpar.compile(model, plan or fxpar.Plan(),
                            torch.empty(SHAPE, dtype=torch.float64, device="meta"),
                            optimizer=sgd)
    return program.for_rank(0), model


def batch(seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(SHAPE, dtype=torch.float64, generator=g),
            torch.randint(0, 3, (SHAPE[0],), generator=g))


def state(rp) -> list[tuple[str, torch.Tensor]]:
    out = [(k, v.clone()) for k, v in rp.state_dict().items()]
    out += [(f"momentum {n}", rp.optimizer.state[p]["momentum_buffer"].clone())
            for n, p in rp.named_parameters()]
    return out


@pytest.fixture
def saved(tmp_path):
    """A one-rank program trained one step and saved at step 1 (with its state then)."""
    rp, _ = one_rank()
    rp.train_step(*batch())
    checkpoint.save(rp, tmp_path, step=1, extra={"epoch": 3})
    return tmp_path, rp, state(rp)


def listing(folder) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def latest(folder) -> dict:
    return json.loads((folder / "latest").read_text())


def assert_state(rp, want) -> None:
    got = state(rp)
    assert [k for k, _ in got] == [k for k, _ in want]
    for (k, a), (_, b) in zip(got, want, strict=True):
        assert torch.equal(a, b), k


# -- save / load ---------------------------------------------------------------------------------
def test_save_writes_a_version_folder_then_points_latest_at_it(saved):
    folder, rp, _ = saved
    assert listing(folder) == ["latest", "step-00000001"]
    assert listing(folder / "step-00000001") == ["checkpoint.json", "rank00000.pt"]
    assert latest(folder) == {"format": "fxpar-checkpoint-latest", "folder": "step-00000001",
                              "step": 1, "versions": ["step-00000001"]}
    manifest = checkpoint.read_manifest(folder)
    assert manifest == checkpoint.read_manifest(folder / "step-00000001")
    assert manifest["step"] == 1 and manifest["world_size"] == 1
    assert manifest["extra"] == {"epoch": 3}
    assert manifest["names"] == list(rp.program.names)
    assert manifest["parameters"] == [n for n, _ in rp.named_parameters()]
    shard = (folder / "step-00000001" / "rank00000.pt").read_bytes()
    assert manifest["ranks"] == [{"rank": 0, "file": "rank00000.pt",
                                  "roles": [{"dp": 0, "copy": 0, "stage": 0, "tile": 0}],
                                  "size": len(shard),
                                  "sha256": hashlib.sha256(shard).hexdigest()}]


def test_load_restores_in_place_and_returns_the_step(saved):
    folder, _, want = saved
    rp, _ = one_rank(seed=5)
    rp.train_step(*batch(2))  # momentum buffers exist and differ
    objects = [id(p) for p in rp.parameters()]
    assert checkpoint.load(rp, folder) == 1
    assert [id(p) for p in rp.parameters()] == objects
    assert_state(rp, want)
    assert any(k.endswith("num_batches_tracked") for k, _ in want)


def test_keep_prunes_older_versions_and_unfinished_saves(saved):
    folder, rp, _ = saved
    for step in (2, 3):
        assert checkpoint.save(rp, folder, step=step) == folder / f"step-0000000{step}"
    assert listing(folder) == ["latest", "step-00000002", "step-00000003"]
    unfinished = folder / "step-00000009"  # what a crashed save leaves
    unfinished.mkdir()
    (unfinished / ".rank00000.pt.tmp77").write_bytes(b"PK\x03")
    (folder / ".latest.tmp77").write_text("{")
    checkpoint.save(rp, folder, step=4, keep=1)
    assert listing(folder) == ["latest", "step-00000004"]
    assert latest(folder)["versions"] == ["step-00000004"]
    for step in (5, 6):
        checkpoint.save(rp, folder, step=step, keep=None)
    assert latest(folder)["versions"] == [f"step-0000000{s}" for s in (4, 5, 6)]
    with pytest.raises(ValueError, match="keep=1.*keep=None"):
        checkpoint.save(rp, folder, step=7, keep=0)


def test_saving_a_step_again_never_writes_into_the_version_latest_names(saved):
    folder, rp, first = saved
    rp.train_step(*batch(2))
    assert checkpoint.save(rp, folder, step=1) == folder / "step-00000001.1"
    assert latest(folder)["versions"] == ["step-00000001", "step-00000001.1"]
    second = state(rp)
    checkpoint.save(rp, folder, step=0)  # lower than latest (after resuming an older one)
    assert latest(folder)["folder"] == "step-00000000"  # latest: the version saved last
    assert listing(folder) == ["latest", "step-00000000", "step-00000001.1"]
    fresh, _ = one_rank(seed=5)
    assert checkpoint.load(fresh, folder / "step-00000001.1") == 1
    assert_state(fresh, second)
    assert checkpoint.load(fresh, folder) == 0
    assert not torch.equal(first[0][1], second[0][1])  # the second save held other values


def test_a_failed_shard_write_raises_and_leaves_the_previous_version(saved, monkeypatch, capsys):
    folder, rp, want = saved
    rp.train_step(*batch(2))

    def full_disk(path, data):
        with open(path, "wb") as f:
            f.write(data[:4])
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(checkpoint, "_write_bytes", full_disk)
    with pytest.raises(CheckpointError, match=r"(?s)step 2 not saved: rank 0 could not write "
                       r".*step-00000002/rank00000.pt.*No space.*latest still names "
                       r"step-00000001"):
        checkpoint.save(rp, folder, step=2)
    monkeypatch.undo()
    assert listing(folder / "step-00000002") == []  # the partial file was removed
    fresh, _ = one_rank(seed=5)
    assert checkpoint.load(fresh, folder) == 1
    assert_state(fresh, want)
    assert checkpoint_cli(["info", str(folder)]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("step 1, 1 ranks") and "unfinished saves" in printed, printed


def test_latest_naming_a_missing_or_unfinished_version_says_what_to_load(saved):
    folder, rp, _ = saved
    checkpoint.save(rp, folder, step=2)
    (folder / "step-00000002" / "checkpoint.json").unlink()
    with pytest.raises(CheckpointError, match=r"names step-00000002 \(step 2\), which has no "
                       r"checkpoint.json \(incomplete\).*complete versions here: step-00000001 "
                       r"\(load one by its folder, e.g. .*step-00000001\)"):
        checkpoint.read_manifest(folder)
    shutil.rmtree(folder / "step-00000002")
    with pytest.raises(CheckpointError, match="which is missing"):
        checkpoint.load(rp, folder)
    (folder / "latest").unlink()
    with pytest.raises(CheckpointError, match="not a \\(complete\\).*versions here: "
                       "step-00000001"):
        checkpoint.export(folder)
    (folder / "latest").write_text("step-00000001")
    with pytest.raises(CheckpointError, match="not an fxpar checkpoint pointer.*delete it"):
        checkpoint.load(rp, folder)


def test_a_folder_of_the_first_layout_still_loads(saved, tmp_path_factory):
    folder, _, want = saved
    old = tmp_path_factory.mktemp("first-layout")  # checkpoint.json next to the shards
    for f in (folder / "step-00000001").iterdir():
        shutil.copy(f, old / f.name)
    fresh, _ = one_rank(seed=5)
    assert checkpoint.load(fresh, old) == 1
    assert_state(fresh, want)


def test_load_restores_the_rng_state(tmp_path):
    rp, _ = one_rank()
    torch.manual_seed(42)
    checkpoint.save(rp, tmp_path, step=0)
    expected = torch.rand(3)
    torch.manual_seed(7)
    checkpoint.load(rp, tmp_path)
    assert torch.equal(torch.rand(3), expected)


def test_resume_continues_like_one_uninterrupted_run(saved):
    folder, first, _ = saved
    straight, _ = one_rank()
    for seed in (1, 2, 3):
        straight.train_step(*batch(seed))
    resumed, _ = one_rank(seed=11)
    checkpoint.load(resumed, folder)
    for seed in (2, 3):
        resumed.train_step(*batch(seed))
    for (k, a), (_, b) in zip(state(resumed), state(straight), strict=True):
        assert torch.equal(a, b), k


def test_load_of_another_plan_says_to_use_the_same_plan_or_export(saved):
    folder, _, _ = saved
    other = fxpar.compile(tiny().double(), fxpar.Plan(stages=2),
                          torch.empty(SHAPE, dtype=torch.float64, device="meta"), optimizer=sgd)
    with pytest.raises(CheckpointError) as e:
        checkpoint.load(other.for_rank(0), folder)
    msg = str(e.value)
    assert "it has 1 ranks, this program 2" in msg and "stages=1 (now 2)" in msg
    assert "same model and plan" in msg and "export" in msg and "load_state_dict" in msg


def test_load_of_another_model_is_refused(saved):
    folder, _, _ = saved
    model = nn.Sequential(nn.Conv2d(3, 3, 1), nn.AdaptiveAvgPool2d(1), nn.Flatten()).double()
    rp, _ = one_rank(model=model)
    with pytest.raises(CheckpointError, match="another model"):
        checkpoint.load(rp, folder)


def test_a_shard_of_another_step_is_refused(saved):
    folder, _, _ = saved
    path = folder / "step-00000001" / "checkpoint.json"
    manifest = json.loads(path.read_text())
    manifest["step"] = 2
    path.write_text(json.dumps(manifest))
    rp, _ = one_rank()
    with pytest.raises(CheckpointError, match="from step 1 but .* from step 2.*mixed"):
        checkpoint.load(rp, folder)


def test_missing_manifest_and_bad_extra_are_explained(tmp_path):
    with pytest.raises(CheckpointError, match="not a \\(complete\\) fxpar checkpoint"):
        checkpoint.read_manifest(tmp_path)
    rp, _ = one_rank()
    with pytest.raises(TypeError, match="JSON values"):
        checkpoint.save(rp, tmp_path, step=0, extra={"x": torch.zeros(1)})
    assert listing(tmp_path) == []


def test_save_without_a_communicator_on_a_multi_rank_plan_is_refused(tmp_path):
    program = fxpar.compile(tiny().double(), fxpar.Plan(stages=2), SHAPE)
    with pytest.raises(CheckpointError, match="collective"):
        checkpoint.save(program.for_rank(0), tmp_path, step=0)


# -- checksums, damaged shards, the corrupt-checkpoint fault --------------------------------------
def save_damaged(folder, rp, monkeypatch, how="", step=2, **kw):
    """Save ``step`` with this rank's shard damaged by FXPAR_FAULT (``how``: truncate / flip /
    "" for the default); returns (the shard's path, its size as written)."""
    monkeypatch.setenv("FXPAR_FAULT", f"0:{step}:corrupt-checkpoint" + (f":{how}" if how else ""))
    version = checkpoint.save(rp, folder, step=step, **kw)  # succeeds: the damage is silent
    monkeypatch.delenv("FXPAR_FAULT")
    entry = json.loads((version / "checkpoint.json").read_text())["ranks"][0]
    return version / "rank00000.pt", entry["size"]


def test_a_truncated_shard_is_refused_with_the_sizes_and_the_version_to_load(saved, monkeypatch):
    folder, rp, want = saved
    rp.train_step(*batch(2))
    shard, size = save_damaged(folder, rp, monkeypatch)
    assert shard.stat().st_size == size // 2
    fresh, _ = one_rank(seed=5)
    fresh.train_step(*batch(3))  # momentum buffers exist and differ
    before = state(fresh)
    good = folder / "step-00000001"
    pattern = (rf"^{re.escape(str(shard))} is damaged: it has {size // 2} bytes where "
               rf"checkpoint.json recorded {size}: cut short .*Versions still kept in "
               rf"{re.escape(str(folder))}: step-00000001; load one instead, e\.g\. "
               rf"fxpar\.program\.checkpoint\.load\(rp, '{re.escape(str(good))}'\)")
    with pytest.raises(CheckpointError, match=pattern):
        checkpoint.load(fresh, folder)
    assert_state(fresh, before)  # nothing was copied in
    with pytest.raises(CheckpointError, match=pattern):
        checkpoint.export(folder)
    assert checkpoint.load(fresh, good) == 1
    assert_state(fresh, want)


def test_one_flipped_byte_is_caught_by_the_checksum_alone(saved, monkeypatch):
    folder, rp, _ = saved
    rp.train_step(*batch(2))
    written = state(rp)
    shard, size = save_damaged(folder, rp, monkeypatch, "flip")
    fresh, _ = one_rank(seed=5)
    with pytest.raises(CheckpointError, match=rf"^\S+rank00000.pt is damaged: its sha256 is "
                       rf"[0-9a-f]{{64}} where checkpoint.json recorded [0-9a-f]{{64}} \(both "
                       rf"{size} bytes: its contents changed after the save"):
        checkpoint.load(fresh, folder)
    # without the checksum (a checkpoint saved before them) torch loads the changed byte silently
    path = shard.parent / "checkpoint.json"
    manifest = json.loads(path.read_text())
    for entry in manifest["ranks"]:
        del entry["size"], entry["sha256"]
    path.write_text(json.dumps(manifest))
    assert checkpoint.load(fresh, folder) == 2
    differ = [k for (k, a), (_, b) in zip(state(fresh), written, strict=True)
              if not torch.equal(a, b)]
    assert len(differ) == 1, differ


def test_a_fault_for_another_rank_or_step_leaves_the_save_alone(saved, monkeypatch):
    folder, rp, _ = saved
    monkeypatch.setenv("FXPAR_FAULT", "1:2:corrupt-checkpoint,0:3:corrupt-checkpoint:flip")
    checkpoint.save(rp, folder, step=2)
    assert checkpoint.verify(folder) == folder / "step-00000002"
    monkeypatch.setenv("FXPAR_FAULT", "0:2:corrupt-checkpoint:shred")
    with pytest.raises(fxpar.PlanError, match="ARG of corrupt-checkpoint is truncate or flip"):
        checkpoint.save(rp, folder, step=2)


def test_damage_truncates_to_half_or_inverts_the_middle_byte(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(bytes(range(10)))
    integrity.damage(path, "flip")
    assert path.read_bytes() == bytes([0, 1, 2, 3, 4, 5 ^ 0xFF, 6, 7, 8, 9])
    integrity.damage(path)
    assert path.read_bytes() == bytes([0, 1, 2, 3, 4])
    with pytest.raises(ValueError, match="truncate, flip"):
        integrity.damage(path, "zero")


def test_a_manifest_that_is_not_json_is_named_with_the_versions_kept(saved):
    folder, rp, _ = saved
    checkpoint.save(rp, folder, step=2)
    manifest = folder / "step-00000002" / "checkpoint.json"
    manifest.write_text('{"format": "fxpar-checkpoint", "step"')
    match = (rf"^{re.escape(str(manifest))} is not valid JSON \(.*\): the manifest was "
             rf"damaged after the save\. Versions still kept in \S+: step-00000001;")
    with pytest.raises(CheckpointError, match=match):
        checkpoint.load(rp, folder)
    with pytest.raises(CheckpointError, match=match):
        checkpoint.read_manifest(folder)


def test_a_checkpoint_saved_before_checksums_loads_unchecked(saved, capsys):
    folder, _, want = saved
    path = folder / "step-00000001" / "checkpoint.json"
    manifest = json.loads(path.read_text())
    for entry in manifest["ranks"]:
        del entry["size"], entry["sha256"]
    path.write_text(json.dumps(manifest))
    fresh, _ = one_rank(seed=5)
    assert checkpoint.load(fresh, folder) == 1
    assert_state(fresh, want)
    assert checkpoint_cli(["verify", str(folder)]) == 0
    assert "rank00000.pt: readable, " in capsys.readouterr().out
    shard = folder / "step-00000001" / "rank00000.pt"
    shard.write_bytes(shard.read_bytes()[:100])  # unchecked, but torch.load still fails
    with pytest.raises(CheckpointError, match=r"rank00000.pt cannot be read by torch.load \("
                       r".*No other complete version is kept in"):
        checkpoint.load(fresh, folder)
    assert checkpoint_cli(["verify", str(folder)]) == 1
    assert "rank00000.pt: DAMAGED: torch.load fails (" in capsys.readouterr().out


def test_verify_command_prints_each_shard_and_exits_1_naming_the_damaged(saved, monkeypatch,
                                                                          capsys):
    folder, rp, _ = saved
    shard, size = save_damaged(folder, rp, monkeypatch)
    assert checkpoint_cli(["verify", str(folder)]) == 1
    out, err = capsys.readouterr()
    version = folder / "step-00000002"
    assert out.splitlines() == [
        f"{version}: step 2, 1 shard",
        f"  rank00000.pt: DAMAGED: it has {size // 2} bytes where checkpoint.json recorded "
        f"{size}: cut short (a full disk, a copy that did not finish, a file system fault)"]
    assert err.startswith(f"fxpar-checkpoint: 1 of 1 shards of {version} failed the check: "
                          f"rank00000.pt. Versions still kept in {folder}: step-00000001; "), err
    good = folder / "step-00000001" / "rank00000.pt"
    assert checkpoint_cli(["verify", str(good.parent)]) == 0
    digest = hashlib.sha256(good.read_bytes()).hexdigest()
    assert capsys.readouterr().out.splitlines() == [
        f"{good.parent}: step 1, 1 shard",
        f"  rank00000.pt: ok, {good.stat().st_size} bytes, sha256 {digest}",
        "all 1 shard intact"]
    shard.unlink()
    assert checkpoint_cli(["verify", str(folder)]) == 1
    assert "  rank00000.pt: MISSING" in capsys.readouterr().out
    with pytest.raises(CheckpointError, match=r"1 of 1 shards of \S+ failed the check: "
                                              r"rank00000.pt \(missing\)"):
        checkpoint.verify(folder)


def test_load_of_a_model_with_other_shapes_names_them(saved):
    folder, _, _ = saved
    wider = nn.Sequential(*list(tiny())[:-1], nn.Linear(4, 5)).double()  # the same keys
    rp, _ = one_rank(model=wider)
    rp.train_step(*batch(3))
    before = state(rp)
    with pytest.raises(CheckpointError, match=re.escape(
            "was saved by another job: it is of another model (tensors of other shapes: "
            "8.weight (3, 4) saved, (5, 4) now, 8.bias (3,) saved, (5,) now). Resume with the "
            "same model and plan")):
        checkpoint.load(rp, folder)
    assert_state(rp, before)


class Peers:
    """A communicator whose allgather returns this rank's outcome among the peers' ``said``."""

    def __init__(self, said, rank=0):
        self.said, self.rank, self.size = said, rank, len(said) + 1

    def allgather_object(self, obj):
        return [*self.said[:self.rank], obj, *self.said[self.rank:]]


def test_load_agrees_every_rank_raises_when_any_cannot(saved, monkeypatch):
    folder, _, want = saved
    fresh, _ = one_rank(seed=5)
    fresh.train_step(*batch(3))  # momentum buffers exist and differ
    before = state(fresh)
    fresh.comm = Peers(["ckpt/step-00000001/rank00001.pt is missing: ..."])  # rank 1 failed
    with pytest.raises(CheckpointError, match=re.escape(
            f"checkpoint {folder} not loaded on any rank: rank 1 cannot load it, and no rank may "
            f"go on from a checkpoint that another could not read. rank 1: ckpt/step-00000001/"
            f"rank00001.pt is missing: ...")):
        checkpoint.load(fresh, folder)
    assert_state(fresh, before)  # this rank's shard was fine, and still nothing was copied in
    fresh.comm = Peers([None])
    assert checkpoint.load(fresh, folder) == 1
    assert_state(fresh, want)

    rp = SimpleNamespace(rank=0, comm=None)
    for said, message in [(["A", "A", "A"], "A"),  # alike on every rank: as it is
                          (["A", "B", "A"], "not loaded on any rank: ranks 0, 1, 2 cannot "
                           "load it, and no rank may go on from a checkpoint that another could "
                           "not read. ranks 0, 2: A; rank 1: B")]:
        rp.comm = Peers(said[1:])
        with pytest.raises(CheckpointError) as e:
            checkpoint._agree(rp, "ckpt", said[0])
        assert str(e.value).endswith(message)
    rp.comm = Peers([None, None])
    checkpoint._agree(rp, "ckpt", None)


# -- export ---------------------------------------------------------------------------------
def test_export_of_a_one_rank_checkpoint_is_the_state_dict(saved):
    folder, rp, _ = saved
    exported = checkpoint.export(folder)
    assert list(exported) == list(rp.state_dict())
    for k, v in rp.state_dict().items():
        assert torch.equal(exported[k], v), k


def _write_shards(folder):
    """A hand-written 2-rank GEMS checkpoint: rank 0 holds (copy 0, stage 0) and (copy 1,
    stage 1), rank 1 the other two; copy 1 holds different values, which export must skip."""
    a = {"w0": torch.tensor([1.0]), "b0": torch.tensor([2.0])}
    b = {"w1": torch.tensor([3.0]), "n1": torch.tensor(4)}
    junk = lambda sd: {k: v * 0 - 1 for k, v in sd.items()}  # noqa: E731
    shards = {0: {(0, 0): a, (1, 1): junk(b)}, 1: {(0, 1): b, (1, 0): junk(a)}}
    for r, stages in shards.items():
        torch.save({"format": 1, "rank": r, "step": 7, "stages": stages, "optimizer": None,
                    "rng": torch.get_rng_state()}, folder / f"rank{r:05d}.pt")
    manifest = {"format": "fxpar-checkpoint", "version": 1, "step": 7, "world_size": 2,
                "plan": {"stages": 2, "gems": True}, "names": ["w0", "b0", "unused", "w1", "n1"],
                "parameters": ["w0", "b0", "w1"], "unsaved": ["unused"],
                "ranks": [{"rank": r, "file": f"rank{r:05d}.pt", "roles": []} for r in (0, 1)],
                "holders": {"w0": [0, 0, 0], "b0": [0, 0, 0], "w1": [1, 0, 1], "n1": [1, 0, 1]},
                "extra": None}
    (folder / "checkpoint.json").write_text(json.dumps(manifest))
    return a | b


def test_export_reads_copy_0_in_the_model_order(tmp_path):
    want = _write_shards(tmp_path)
    got = checkpoint.export(tmp_path)
    assert list(got) == ["w0", "b0", "w1", "n1"]
    for k in got:
        assert torch.equal(got[k], want[k]), k
    (tmp_path / "rank00001.pt").unlink()
    with pytest.raises(CheckpointError, match="rank00001.pt is missing"):
        checkpoint.export(tmp_path)


def test_export_command_writes_the_state_dict(tmp_path, capsys):
    want = _write_shards(tmp_path)
    out = tmp_path / "model.pt"
    assert checkpoint_cli(["export", str(tmp_path), str(out)]) == 0
    printed = capsys.readouterr().out
    assert f"wrote {out}: 4 tensors (3 parameters, 1 buffers" in printed
    assert "of step 7, from a 2-rank checkpoint" in printed
    assert "(used by no stage): unused" in printed
    got = torch.load(out, weights_only=True)
    assert list(got) == ["w0", "b0", "w1", "n1"] and torch.equal(got["w1"], want["w1"])
    assert checkpoint_cli(["info", str(tmp_path)]) == 0
    assert "step 7, 2 ranks" in capsys.readouterr().out
    assert checkpoint_cli(["export", str(tmp_path / "nothing"), str(out)]) == 1
    assert "does not exist" in capsys.readouterr().err


def test_python_m_fxpar_checkpoint_export(saved, tmp_path):
    folder, rp, _ = saved
    out = tmp_path / "single.pt"
    run = subprocess.run([sys.executable, "-m", "fxpar.cli.checkpoint", "export", str(folder),
                          str(out)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith(f"wrote {out}: ")
    plain = tiny().double()
    plain.load_state_dict(torch.load(out, weights_only=True))
    for k, v in rp.state_dict().items():
        assert torch.equal(plain.state_dict()[k], v), k


# -- import (RankProgram.load_state_dict) ----------------------------------------------------
def test_load_state_dict_loads_this_ranks_keys_in_place():
    torch.manual_seed(3)
    source = tiny().double()
    program = fxpar.compile(tiny().double(), fxpar.Plan(stages=2),
                            torch.empty(SHAPE, dtype=torch.float64, device="meta"))
    rp = program.for_rank(1)
    objects = [id(p) for p in rp.parameters()]
    loaded = rp.load_state_dict(source.state_dict())
    assert loaded == list(rp.state_dict()) and "0.weight" not in loaded  # stage 0: rank 0
    assert [id(p) for p in rp.parameters()] == objects
    for k, v in rp.state_dict().items():
        assert torch.equal(v, source.state_dict()[k]), k


def test_load_state_dict_strict_lists_missing_and_unknown_keys():
    rp, _ = one_rank()
    partial = dict(tiny().double().state_dict())
    del partial["1.running_mean"], partial["8.bias"]
    with pytest.raises(CheckpointError, match="missing 2 key.*1.running_mean, 8.bias"):
        rp.load_state_dict(partial)
    with pytest.raises(CheckpointError, match="1 key.*does not have: extra"):
        rp.load_state_dict({**tiny().double().state_dict(), "extra": torch.zeros(1)})
    before = rp.state_dict()["8.bias"].clone()
    assert "8.bias" not in rp.load_state_dict(partial, strict=False)
    assert torch.equal(rp.state_dict()["8.bias"], before)


def test_load_state_dict_of_the_wrong_shape_names_the_stage():
    rp, _ = one_rank()
    bad = tiny().double().state_dict()
    bad["8.weight"] = torch.zeros(5, 4, dtype=torch.float64)
    with pytest.raises(CheckpointError,
                       match=r"(?s)\(copy, stage\) \(0, 0\).*size mismatch for 8.weight"):
        rp.load_state_dict(bad)


# -- materialisation ------------------------------------------------------------------------
def meta_tiny() -> nn.Module:
    with torch.device("meta"):
        return tiny().double()


def test_module_seed_is_a_stable_hash_of_seed_and_name():
    assert module_seed(0, "layer1.0.conv1") == zlib.crc32(b"0:layer1.0.conv1")
    seeds = {module_seed(s, n) for s in (0, 1, 2**40) for n in ("a", "b")}
    assert len(seeds) == 6 and max(seeds) < 2**32  # mt19937 reads 32 bits of a seed


def test_materialize_model_is_deterministic_and_independent_of_order():
    a = materialize_model(meta_tiny(), seed=4)
    b = meta_tiny()
    torch.manual_seed(123)  # the global RNG does not matter ...
    for name in ("8", "4", "0", "1", "3"):  # ... nor the order modules are materialised in
        materialize(b, [name], seed=4)
    assert not any(t.is_meta for t in b.state_dict().values())
    for k, v in a.state_dict().items():
        assert torch.equal(v, b.state_dict()[k]), k
    assert torch.equal(a.state_dict()["1.running_var"], torch.ones(4, dtype=torch.float64))
    c = materialize_model(meta_tiny(), seed=5)
    assert not torch.equal(a.state_dict()["0.weight"], c.state_dict()["0.weight"])


def test_materialize_leaves_the_global_rng_alone():
    torch.manual_seed(0)
    expected = torch.rand(2)
    torch.manual_seed(0)
    materialize_model(meta_tiny())
    assert torch.equal(torch.rand(2), expected)


class Gate(nn.Module):
    """Owns a parameter but has no reset_parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 3, 1)
        self.g = nn.Parameter(torch.empty(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x) * self.g


def test_a_module_without_reset_parameters_needs_init():
    with torch.device("meta"):
        model = nn.Sequential(Gate(), nn.AdaptiveAvgPool2d(1), nn.Flatten())
    with pytest.raises(MaterializeError, match=r"module '0' \(Gate\).*\(g\).*pass init=fn"):
        fxpar.compile(model, fxpar.Plan(), (2, 3, 4, 4))
    with pytest.raises(MaterializeError, match="module '0' "):
        materialize_model(copy.deepcopy(model))
    calls = []

    def init(name, module):
        calls.append(name)
        if isinstance(module, Gate):
            nn.init.constant_(module.g, 2.0)
        else:
            module.reset_parameters()

    materialize_model(model, init=init)
    assert calls == ["0", "0.conv"] and model[0].g.item() == 2.0


def test_for_rank_materialises_only_its_stages_with_the_single_process_values():
    reference = materialize_model(meta_tiny(), seed=9)
    model = meta_tiny()
    program = fxpar.compile(model, fxpar.Plan(stages=2), SHAPE, seed=9, optimizer=sgd)
    rp = program.for_rank(1)
    real = [t for t in program.graph.modules[1].state_dict().values()]
    assert real and not any(t.is_meta for t in real)
    assert all(t.is_meta for t in program.graph.modules[0].state_dict().values())
    for k, v in rp.state_dict().items():
        assert torch.equal(v, reference.state_dict()[k]), k
    held = sum(p.numel() for p in model.parameters() if not p.is_meta)
    assert held == sum(p.numel() for p in rp.parameters()) == 4 * 4 * 9 + 4 + 4 + 4 + 4 * 3 + 3
    program.for_rank(0)  # now the rest
    for k, v in model.state_dict().items():
        assert torch.equal(v, reference.state_dict()[k]), k
