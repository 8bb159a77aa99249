"""Sharded checkpoints: save and resume a compiled program's training state; convert it to and
from a single-device ``state_dict``.

A checkpoint folder holds versions, one per save (``ckpt/step-00000004/``: ``checkpoint.json``,
the manifest, and one shard ``rankNNNNN.pt`` per rank), and a ``latest`` pointer whose atomic
replacement commits a save: a crash before it leaves the previous version the one that loads.
fxpar.program.checkpoint_folder describes the layout and why; this module writes and reads the
files.

Each rank writes only what it holds; a save costs three small collectives (the folder name,
a gather of key names and shard checksums, the outcome). A failure on any rank raises the same
CheckpointError on every rank and leaves ``latest`` alone. tests/mpi/test_checkpoint_crash.py kills
a rank mid-save.

Checksums: a rank serialises its shard into memory once, writes exactly those bytes, and sends
their size and sha256 to rank 0 in the gather above; the manifest records them per rank
(fxpar.program.integrity). Whatever reads a shard (:func:`load`, :func:`export`, :func:`verify`)
compares the file with them first -- its size (a file cut short, e.g. by a full disk or a copy
that did not finish, costs no read), then the sha256 of the bytes read once, which ``torch.load``
then reads from memory -- and names the damaged file, what was recorded and what was found, and
the versions still kept that can be loaded instead. A changed byte in tensor data loads without
any error from torch: only the checksum notices it. Checkpoints saved before checksums (no
``size``/``sha256`` in the manifest) load unchecked. ``FXPAR_FAULT=RANK:STEP:corrupt-checkpoint
[:truncate|flip]`` (fxpar.core.faults) damages rank RANK's shard of the save of step STEP right
after it is durably written, as failing storage would: that save still succeeds, the next load
refuses it.

Loading agrees: no rank may resume from a checkpoint that another rank could not read (it would
train alone and wait forever on its peers). Each rank checks and reads only its own shard (reading
every shard on every rank would cost N times the checkpoint in reads on the shared file system),
then the ranks exchange the outcome in one allgather of a short text before anything is copied
into the model: either every rank loads, or every rank raises a CheckpointError that names each
rank's problem (one damaged shard stops every rank alike), with the model left as it was.

:func:`load`, :func:`export`, :func:`verify` and :func:`read_manifest` take the checkpoint
folder (they follow ``latest``), one version's folder (``ckpt/step-00000004``), or a folder of
the first layout (``checkpoint.json`` directly in it, no versions).

Resuming (:func:`load`) needs the same model (its keys and shapes) and plan on the same number
of ranks: it copies into the existing parameters and buffers (the optimizer, the gradient hooks
and the gradient-sync buckets hold references to those objects) and gives bit-identical training
to an uninterrupted run. To change plans, go through the single-device form: :func:`export` (no
MPI, reads the files) then ``RankProgram.load_state_dict`` (the optimizer state and step do not
carry over).

Files must be visible to every rank (a shared file system on a cluster).
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

import torch

from fxpar.core import faults
from fxpar.program import integrity
from fxpar.program.checkpoint_folder import (
    LATEST,
    MANIFEST,
    CheckpointError,
    commit,
    instead,
    read_latest,
    resolve,
    shard_name,
    some_keys,
    start_version,
    version_name,
    write_durably,
)
from fxpar.runtime.scale import LossScale

if TYPE_CHECKING:
    from fxpar.program.program import Program, RankProgram

__all__ = ["LATEST", "MANIFEST", "CheckpointError", "ShardCheck", "check_shards", "export",
           "load", "load_state_dict", "read_manifest", "resolve", "save", "shard_name",
           "verify", "version_name"]

FORMAT = "fxpar-checkpoint"
VERSION = 1

StageKey = tuple[int, int]  # (copy, stage)


class Stateful(Protocol):
    """Training state saved beside the model, per rank (an LR scheduler, a moving average of
    the weights: fxpar.train): torch.distributed.checkpoint's protocol of the same name. Its
    state_dict holds tensors and plain values only (``torch.load(weights_only=True)``)."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class Gathered(NamedTuple):
    """What each rank tells rank 0 at the end of a save."""

    keys: dict[StageKey, list[str]]
    parameters: list[str]
    error: str | None
    shard: dict[str, Any] | None
    """Its shard's size and sha256 (integrity.record); None when it could not write it."""


def _write_bytes(path: Path, data: bytes | memoryview) -> None:
    with open(path, "wb") as f:
        f.write(data)


def _write_shard(path: Path, shard: dict[str, Any]) -> dict[str, Any]:
    """Serialise ``shard`` once and write exactly those bytes durably; their size and sha256
    (what the manifest records, so a reader checks the very bytes that were written)."""
    buffer = io.BytesIO()
    torch.save(shard, buffer)
    with buffer.getbuffer() as data:
        written = integrity.record(data)
        write_durably(path, lambda p: _write_bytes(p, data))
    return written


# -- save / load (collective; same plan) --------------------------------------------------------
def save(rp: RankProgram, folder: str | os.PathLike[str], step: int,
         extra: dict[str, Any] | None = None, keep: int | None = 2,
         state: Mapping[str, Stateful] | None = None) -> Path:
    """Collective: every rank writes its shard of the training state to a new version folder
    in ``folder``, rank 0 the manifest; then ``folder/latest`` names it. Returns the version's
    folder. ``extra``: JSON values kept in the manifest (rank 0's), e.g. the epoch; read them
    back with :func:`read_manifest`. ``keep``: how many versions to keep (the newest), None for
    all. ``state``: more of this rank's training state, by name (its ``state_dict()`` goes in
    the shard; :func:`load` with the same names restores it), e.g. the Trainer's LR scheduler
    and weight average. A failure on any rank raises CheckpointError on every rank and leaves
    the previous checkpoint the one ``latest`` names. ``FXPAR_FAULT`` is read at each call: a
    ``corrupt-checkpoint`` fault of this rank at ``step`` damages its shard once written."""
    root = Path(folder)
    comm = rp.comm
    if comm is None and rp.program.world_size > 1:
        raise CheckpointError(f"save is collective over the plan's {rp.program.world_size} "
                              f"ranks: call it on every rank of program.local() under mpiexec")
    if extra is not None:
        try:
            json.dumps(extra)
        except TypeError as e:
            raise TypeError(f"checkpoint extra must hold JSON values only ({e}): save tensors "
                            f"and other objects yourself, next to the checkpoint") from e
    if keep is not None and keep < 1:
        raise ValueError(f"keep={keep}: keep at least the version being saved (keep=1), or "
                         f"keep=None to keep every version")
    if int(step) < 0:
        raise ValueError(f"step={step}: a checkpoint's step is a count of steps, >= 0")
    fault = faults.find(faults.from_env(), rp.rank, int(step), "corrupt-checkpoint")
    name, error = None, None
    if rp.rank == 0:
        try:
            name = start_version(root, int(step))
        except (OSError, CheckpointError) as e:
            error = f"cannot start a version of step {step} in {root}: {e}"
    if comm is not None:
        name, error = comm.bcast_object((name, error), root=0)
    if error is not None:
        raise CheckpointError(error)
    version = root / name
    shard = {
        "format": VERSION, "rank": rp.rank, "step": int(step),
        "stages": {key: m.state_dict() for key, m in rp.stages.items()},
        "optimizer": rp.optimizer.state_dict() if rp.optimizer is not None else None,
        "rng": torch.get_rng_state(),
        "loss_scale": dataclasses.asdict(rp.loss_scale) if rp.loss_scale is not None else None,
        "train": {k: v.state_dict() for k, v in (state or {}).items()},
    }
    path, written = version / shard_name(rp.rank), None
    try:
        written = _write_shard(path, shard)
    except (OSError, RuntimeError) as e:
        error = f"rank {rp.rank} could not write {path}: {e}"
    if fault is not None and written is not None:  # silent disk corruption: the save succeeds
        integrity.damage(path, fault.arg or "truncate")
    mine = Gathered({key: list(m.state_dict()) for key, m in rp.stages.items()},
                    [n for n, _ in rp.named_parameters()], error, written)
    everyone = comm.gather_object(mine, root=0) if comm is not None else [mine]
    if everyone is not None:  # rank 0: every shard is durably in place, or an error says why
        error = _finish(rp.program, root, name, int(step), extra, keep, everyone)
    if comm is not None:  # also keeps every rank here until latest has moved
        error = comm.bcast_object(error, root=0)
    if error is not None:
        raise CheckpointError(error)
    return version


def _finish(program: Program, root: Path, name: str, step: int, extra: dict[str, Any] | None,
            keep: int | None, everyone: Sequence[Gathered]) -> str | None:
    """Rank 0: the manifest, then the commit; the error every rank raises, or None."""
    failed = [g.error for g in everyone if g.error is not None]
    if not failed:
        text = json.dumps(_manifest(program, step, extra, everyone), indent=1)
        try:
            write_durably(root / name / MANIFEST, lambda p: p.write_text(text))
            commit(root, name, step, keep)
            return None
        except (OSError, CheckpointError) as e:
            failed = [f"rank 0 could not write {root / name / MANIFEST} or {root / LATEST}: {e}"]
    try:
        pointer = read_latest(root)
    except CheckpointError:
        pointer = None
    now = (f"{root / LATEST} still names {pointer['folder']}" if pointer is not None
           else f"{root} has no '{LATEST}' yet")
    return (f"checkpoint of step {step} not saved: {'; '.join(failed)}. {now}; free space or "
            f"fix the file system and save again")


def _manifest(program: Program, step: int, extra: dict[str, Any] | None,
              everyone: Sequence[Gathered]) -> dict[str, Any]:
    rm = program.rank_map
    holders: dict[str, list[int]] = {}  # key -> [rank, copy, stage]: copy 0, tile 0, replica 0
    for stage in range(program.plan.stages):
        rank = rm.rank_of(0, 0, stage, 0)
        for key in everyone[rank].keys.get((0, stage), []):
            holders.setdefault(key, [rank, 0, stage])
    params = {n for g in everyone for n in g.parameters}
    return {
        "format": FORMAT, "version": VERSION, "step": step, "world_size": program.world_size,
        "plan": program.plan.to_json(),
        "names": list(program.names),
        "parameters": [n for n in program.names if n in params],
        "unsaved": [n for n in program.names if n not in holders],
        "ranks": [{"rank": r, "file": shard_name(r),
                   "roles": [{"dp": rm.dp_index(r), "copy": role.copy, "stage": role.stage,
                              "tile": role.tile} for role in rm.roles_of(r)],
                   **(everyone[r].shard or {})}  # size, sha256
                  for r in range(program.world_size)],
        "holders": {n: holders[n] for n in program.names if n in holders},
        "extra": extra,
    }


def read_manifest(folder: str | os.PathLike[str]) -> dict[str, Any]:
    """The manifest (``checkpoint.json``: step, plan, layout, names, extra) of the checkpoint
    that ``folder`` stands for (see :func:`resolve`)."""
    return _open(folder)[1]


def _open(folder: str | os.PathLike[str]) -> tuple[Path, dict[str, Any]]:
    version = resolve(folder)
    path = version / MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except ValueError as e:  # not JSON, or not text at all
        raise CheckpointError(f"{path} is not valid JSON ({e}): the manifest was damaged after "
                              f"the save. {instead(version)}") from e
    if not isinstance(manifest, dict):
        manifest = {}
    if manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
        raise CheckpointError(f"{path} is not an fxpar checkpoint of version {VERSION} "
                              f"(format {manifest.get('format')!r}, version "
                              f"{manifest.get('version')!r})")
    return version, manifest


# -- reading shards back: checked against the manifest -----------------------------------------
def _read_shard(version: Path, entry: dict[str, Any], missing: str) -> dict[str, Any]:
    """The shard ``entry`` of the manifest names, once its size and sha256 match the record;
    CheckpointError naming the file otherwise (``missing``: what to say when it is absent)."""
    path = version / entry["file"]
    if not path.is_file():
        raise CheckpointError(f"{path} is missing: {missing}")
    data, problem = integrity.read_checked(path, entry, MANIFEST)
    if problem is not None or data is None:
        raise CheckpointError(f"{path} is damaged: {problem}. {instead(version)}")
    try:
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - a damaged file fails in many ways
        raise CheckpointError(f"{path} cannot be read by torch.load ({type(e).__name__}: "
                              f"{e}). {instead(version)}") from e


@dataclasses.dataclass(frozen=True)
class ShardCheck:
    """One shard file against what the manifest recorded of it."""

    file: str
    size: int | None
    """Its size on disk (None: missing)."""
    sha256: str | None
    """The recorded sha256 when the file matches it, else None."""
    problem: str | None
    """Why it is not the shard that was saved; None when it is (or, without a checksum, when
    torch.load reads it)."""


def check_shards(folder: str | os.PathLike[str]) -> tuple[Path, list[ShardCheck]]:
    """Every shard of the checkpoint ``folder`` stands for, checked against its recorded size
    and sha256 (each read once); a shard saved without a checksum is checked by torch.load."""
    version, manifest = _open(folder)
    checks = []
    for entry in manifest["ranks"]:
        path = version / entry["file"]
        if not path.is_file():
            checks.append(ShardCheck(entry["file"], None, None, "missing"))
            continue
        data, problem = integrity.read_checked(path, entry, MANIFEST)
        if data is not None and not integrity.recorded(entry):
            try:
                torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
            except Exception as e:  # noqa: BLE001 - a damaged file fails in many ways
                problem = f"torch.load fails ({type(e).__name__}: {e})"
        checks.append(ShardCheck(entry["file"], path.stat().st_size,
                                 entry.get("sha256") if problem is None else None, problem))
    return version, checks


def verify(folder: str | os.PathLike[str]) -> Path:
    """Check every shard of the checkpoint ``folder`` stands for (:func:`check_shards`); its
    version folder, or CheckpointError naming every damaged shard and what to load instead."""
    version, checks = check_shards(folder)
    if any(c.problem is not None for c in checks):
        raise CheckpointError(damaged(version, checks))
    return version


def damaged(version: Path, checks: Sequence[ShardCheck], why: bool = True) -> str:
    """The message naming the shards of ``checks`` that failed (``why``: and each problem)."""
    bad = [c for c in checks if c.problem is not None]
    named = "; ".join(f"{c.file} ({c.problem})" if why else c.file for c in bad)
    return (f"{len(bad)} of {len(checks)} shards of {version} failed the check: {named}. "
            f"{instead(version)}")


# -- load (collective; same job) --------------------------------------------------------------
def _another_job(folder: Path, problems: Sequence[str]) -> CheckpointError:
    return CheckpointError(
        f"checkpoint {folder} was saved by another job: {'; '.join(problems)}. Resume with "
        f"the same model and plan on the same number of ranks, or change plans through "
        f"the single-device form: state = fxpar.program.checkpoint.export({str(folder)!r}) (or "
        f"`python -m fxpar.cli.checkpoint export {folder} model.pt`), then "
        f"rank_program.load_state_dict(state) (the optimizer state and step start afresh)")


def _check_same_job(manifest: dict[str, Any], program: Program, folder: Path) -> None:
    """Raise (on every rank alike: each reads the same manifest) unless ``program`` is the job
    that wrote the checkpoint."""
    problems = []
    if manifest["world_size"] != program.world_size:
        problems.append(f"it has {manifest['world_size']} ranks, this program "
                        f"{program.world_size}")
    plan = program.plan.to_json()
    diff = [f"{k}={manifest['plan'].get(k)!r} (now {v!r})" for k, v in plan.items()
            if manifest["plan"].get(k) != v]
    if diff:
        problems.append("its plan has " + ", ".join(diff))
    if manifest["names"] != list(program.names):
        problems.append("it is of another model (its state_dict keys differ)")
    if problems:
        raise _another_job(folder, problems)


def _check_state(shard: dict[str, Any], state: Mapping[str, Stateful], path: Path) -> None:
    """Raise unless ``shard`` holds every part of ``state`` (a run that resumes its LR schedule
    or weight average from a checkpoint saved without them would restart them silently)."""
    saved = shard.get("train") or {}
    missing = [k for k in state if k not in saved]
    if missing:
        had = ", ".join(sorted(saved)) or "none"
        raise CheckpointError(
            f"{path} was saved without the {' and '.join(missing)} state this run resumes "
            f"(it holds: {had}): resume with the recipe that saved it (lr_schedule, ema; "
            f"fxpar-run --lr-schedule, --ema), or start afresh from its weights (export)")


def _check_shard(shard: dict[str, Any], manifest: dict[str, Any], rp: RankProgram,
                 path: Path, folder: Path) -> None:
    """Raise unless ``shard`` fits this rank's modules and optimizer exactly, so that copying it
    in (after every rank agreed) cannot fail part way."""
    if shard["step"] != manifest["step"]:
        raise CheckpointError(
            f"{path} is from step {shard['step']} but {folder / MANIFEST} from step "
            f"{manifest['step']}: files of two saves are mixed in this folder (a save of "
            f"the first layout that did not finish, or files copied by hand); load another "
            f"version")
    if set(shard["stages"]) != set(rp.stages):
        raise CheckpointError(f"{path} holds (copy, stage) {sorted(shard['stages'])}, this "
                              f"rank runs {sorted(rp.stages)}: not this job's checkpoint")
    problems: list[str] = []
    shapes: dict[str, str] = {}
    for key, module in sorted(rp.stages.items()):
        saved, now = shard["stages"][key], module.state_dict()
        if set(saved) != set(now):
            problems.append(f"(copy, stage) {key} holds other tensors (saved only: "
                            f"{some_keys(sorted(set(saved) - set(now)))}; now only: "
                            f"{some_keys(sorted(set(now) - set(saved)))})")
        for k, v in now.items():  # (a GEMS rank holds two copies of the same tensors)
            if k in saved and saved[k].shape != v.shape:
                shapes[k] = f"{k} {tuple(saved[k].shape)} saved, {tuple(v.shape)} now"
    if shapes:
        problems.append(f"it is of another model (tensors of other shapes: "
                        f"{some_keys([shapes[k] for k in sorted(shapes, key=rp._order)])})")
    if problems:
        raise _another_job(folder, problems)
    if (shard["optimizer"] is None) != (rp.optimizer is None):
        was = "without" if shard["optimizer"] is None else "with"
        has = "none" if rp.optimizer is None else "one"
        raise CheckpointError(f"{path} was saved {was} an optimizer, this program has {has}: "
                              f"compile with the same optimizer= as the job that saved it")


def _agree(rp: RankProgram, folder: str | os.PathLike[str], error: str | None) -> None:
    """Every rank raises, or none: one allgather of each rank's outcome (a rank alone in a
    process, without a communicator, raises its own)."""
    comm = rp.comm
    said = list(enumerate(comm.allgather_object(error))) if comm is not None and comm.size > 1 \
        else [(rp.rank, error)]
    bad = [(r, e) for r, e in said if e is not None]
    if not bad:
        return
    if len(bad) == len(said) and len({e for _, e in bad}) == 1:
        raise CheckpointError(bad[0][1])  # every rank alike (another job, a damaged manifest)
    by_error: dict[str, list[int]] = {}
    for r, e in bad:
        by_error.setdefault(e, []).append(r)
    ranks = [r for r, _ in bad]
    raise CheckpointError(
        f"checkpoint {folder} not loaded on any rank: rank{'s' * (len(ranks) > 1)} "
        f"{', '.join(map(str, ranks))} cannot load it, and no rank may go on from a checkpoint "
        f"that another could not read. " + "; ".join(
            f"rank{'s' * (len(rs) > 1)} {', '.join(map(str, rs))}: {e}"
            for e, rs in by_error.items()))


def load(rp: RankProgram, folder: str | os.PathLike[str],
         state: Mapping[str, Stateful] | None = None) -> int:
    """Restore this rank's shard in place (parameters, buffers, optimizer, RNG, and each part
    of ``state`` saved under its name by :func:`save`); returns the step it was saved at.
    Collective: every rank calls it. Each rank checks and reads only its own shard (size and
    sha256 against the manifest), then one allgather of the outcomes: if any rank cannot load
    (a damaged or missing shard, another plan or model, a part of ``state`` it lacks), every
    rank raises CheckpointError and no rank's model changes."""
    version, shard, error = Path(folder), None, None
    try:
        version, manifest = _open(folder)
        _check_same_job(manifest, rp.program, version)
        entry = manifest["ranks"][rp.rank]
        shard = _read_shard(version, entry, "every rank must see the whole checkpoint folder "
                                            "(a shared file system)")
        _check_shard(shard, manifest, rp, version / entry["file"], version)
        _check_state(shard, state or {}, version / entry["file"])
    except CheckpointError as e:
        error = str(e)
    _agree(rp, folder, error)
    assert shard is not None
    with torch.no_grad():
        for key, module in rp.stages.items():
            try:  # copies into the existing tensors (assign=False)
                module.load_state_dict(shard["stages"][key], strict=True)
            except RuntimeError as e:
                raise CheckpointError(f"{version / entry['file']}, (copy, stage) {key}: "
                                      f"{e}") from e
    if rp.optimizer is not None:
        rp.optimizer.load_state_dict(shard["optimizer"])
    torch.set_rng_state(shard["rng"])
    if rp.loss_scale is not None and shard.get("loss_scale") is not None:
        rp.loss_scale = LossScale(**shard["loss_scale"])  # fp16: the scale goes on as it was
    rp.guard.steps = int(shard["step"])  # step numbers go on (FXPAR_FAULT, messages)
    for k, part in (state or {}).items():  # after the optimizer: a scheduler reads its LR
        part.load_state_dict(shard["train"][k])
    return int(shard["step"])


# -- the single-device form ------------------------------------------------------------------
def export(folder: str | os.PathLike[str], ema: bool = False) -> dict[str, torch.Tensor]:
    """The single-device ``state_dict`` of a checkpoint, in the original model's key order
    (each key from copy 0, tile 0, replica 0 of its stage). Reads files only: no MPI. Each
    shard it reads is checked against its recorded size and sha256 first. ema: the moving
    average of the weights instead (saved by a Trainer with ``TrainConfig(ema=...)``)."""
    folder, manifest = _open(folder)
    shards: dict[int, dict[str, Any]] = {}
    out: dict[str, torch.Tensor] = {}
    for name in manifest["names"]:
        if name not in manifest["holders"]:
            continue  # used by no stage: never saved (listed in manifest["unsaved"])
        rank, copy_, stage = manifest["holders"][name]
        if rank not in shards:
            shards[rank] = _read_shard(folder, manifest["ranks"][rank],
                                       f"export needs the shards listed in {folder / MANIFEST}")
        shard = shards[rank]
        if not ema:
            out[name] = shard["stages"][(copy_, stage)][name]
        elif "ema" not in (shard.get("train") or {}):
            raise CheckpointError(f"{folder / shard_name(rank)} holds no moving average of the "
                                  f"weights: it was saved without TrainConfig(ema=...) "
                                  f"(fxpar-run --ema); export(folder) gives the weights")
        else:
            out[name] = shard["train"]["ema"]["shadow"][name]
    return out


def load_state_dict(rp: RankProgram, state_dict: dict[str, torch.Tensor],
                    strict: bool = True) -> list[str]:
    """``rp.load_state_dict(state_dict, strict)`` (:meth:`RankProgram.load_state_dict`)."""
    return rp.load_state_dict(state_dict, strict)
