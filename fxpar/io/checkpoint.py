"""Sharded checkpoints: save and resume a compiled program's training state; convert it to and
from a single-device ``state_dict``.

A checkpoint folder holds versions, one per save, and a pointer to the newest complete one::

    ckpt/
      latest              rank 0: JSON naming the version saved last (its folder and step) and
                          the versions kept, oldest first
      step-00000004/      a version: one complete checkpoint
        checkpoint.json     rank 0, written last: format, step, world size, the plan, the
                            model's state_dict keys in order, which rank holds which (copy,
                            stage, tile), which shard holds each key for export
        rank00000.pt        one shard per rank: each (copy, stage) module's state_dict
        rank00001.pt        (parameters, BatchNorm buffers incl. num_batches_tracked), the
        ...                 optimizer's state_dict, the step, the torch RNG state
      step-00000006/

Why a pointer: a save is many files written by many processes, and no file system renames a
set of files at once. Every rank writes its shard into a fresh version folder (temporary
name, fsync, ``os.replace``); after a gather shows that every shard is in place, rank 0 writes
the manifest the same way, then replaces ``latest`` (temporary name, fsync, ``os.replace``,
fsync of the folder). That last rename is the commit. A crash at any moment before it (a
rank killed mid-write, a full disk) leaves ``latest`` naming the previous complete version,
which still loads; the unfinished folder is ignored, and removed by the next save. After
``latest`` moves, rank 0 removes every version but the newest ``keep``.

A save never writes into a folder ``latest`` names, so it can never damage the checkpoint a
resume would use: saving a step that already has a complete version (the same step again, or
the steps after resuming from an older version) writes ``step-NNNNNNNN.1`` (``.2``, ...) and
moves ``latest`` there. ``latest`` is the version saved last, not the highest step.

Each rank writes only what it holds; a save costs three small collectives (the folder name,
a gather of key names, the outcome). A failure on any rank raises the same CheckpointError on
every rank and leaves ``latest`` alone. tests/test_checkpoint_crash.py kills a rank mid-save.

:func:`load`, :func:`export` and :func:`read_manifest` take the checkpoint folder (they follow
``latest``), one version's folder (``ckpt/step-00000004``), or a folder of the first layout
(``checkpoint.json`` directly in it, no versions).

Resuming (:func:`load`) needs the same plan on the same number of ranks: it copies into the
existing parameters and buffers (the optimizer, the gradient hooks and the gradient-sync buckets
hold references to those objects) and gives bit-identical training to an uninterrupted run.
To change plans, go through the single-device form: :func:`export` (no MPI, reads the files)
then ``RankProgram.load_state_dict`` (the optimizer state and step do not carry over).

Files must be visible to every rank (a shared file system on a cluster).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from fxpar.runtime.scale import LossScale

if TYPE_CHECKING:
    from fxpar.io.program import Program, RankProgram

FORMAT = "fxpar-checkpoint"
VERSION = 1
MANIFEST = "checkpoint.json"
LATEST = "latest"
LATEST_FORMAT = "fxpar-checkpoint-latest"
_VERSION_FOLDER = re.compile(r"step-(\d{8,})(?:\.(\d+))?")
_TEMPORARY = re.compile(r"\..+\.tmp\d+")

StageKey = tuple[int, int]  # (copy, stage)
Gathered = tuple[dict[StageKey, list[str]], list[str], str | None]  # keys, parameters, error


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used here; the message says what to do instead."""


def shard_name(rank: int) -> str:
    return f"rank{rank:05d}.pt"


def version_name(step: int, n: int = 0) -> str:
    """The folder of a version: ``step-00000042``, or ``step-00000042.n`` for the n-th other
    save of that step."""
    return f"step-{step:08d}" + (f".{n}" if n else "")


# -- durable files -------------------------------------------------------------------------
def _write_durably(path: Path, write: Callable[[Path], None]) -> None:
    """``write(tmp)``, fsync the file, rename it onto ``path`` (atomic on POSIX), fsync the
    folder: once this returns, ``path`` holds the whole file, even after a power cut."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        write(tmp)
        _fsync(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    _fsync(path.parent)


def _fsync(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # a folder on Windows cannot be opened: its renames are durable anyway
        return
    try:
        os.fsync(fd)
    except OSError:  # some file systems refuse fsync on a folder
        pass
    finally:
        os.close(fd)


# -- the layout: versions and the latest pointer -------------------------------------------------
def _read_latest(root: Path) -> dict[str, Any] | None:
    path = root / LATEST
    if not path.is_file():
        return None
    try:
        pointer = json.loads(path.read_text())
        ok = (pointer.get("format") == LATEST_FORMAT
              and _VERSION_FOLDER.fullmatch(pointer["folder"]) is not None
              and all(_VERSION_FOLDER.fullmatch(v) for v in pointer["versions"]))
    except (ValueError, KeyError, TypeError, AttributeError):
        ok = False
    if not ok:
        raise CheckpointError(f"{path} is not an fxpar checkpoint pointer (checkpoint.save "
                              f"writes it): delete it, then load a version by its folder "
                              f"({root}/step-NNNNNNNN)")
    return pointer


def _version_folders(root: Path) -> list[Path]:
    """The ``step-*`` folders in ``root``, complete or not, by step."""
    found = [(m, p) for p in (root.iterdir() if root.is_dir() else [])
             if p.is_dir() and (m := _VERSION_FOLDER.fullmatch(p.name))]
    return [p for m, p in sorted(found, key=lambda mp: (int(mp[0][1]), int(mp[0][2] or 0)))]


def _complete(version: Path) -> bool:
    return (version / MANIFEST).is_file()


def resolve(folder: str | os.PathLike[str]) -> Path:
    """The folder holding the checkpoint that ``folder`` stands for: the version its
    ``latest`` names, else ``folder`` itself when it holds a manifest (a version folder, or the
    first layout). Raises CheckpointError, saying what to load instead, when there is none."""
    root = Path(folder)
    pointer = _read_latest(root)
    complete = [p for p in _version_folders(root) if _complete(p)]
    instead = (f"; complete versions here: {', '.join(p.name for p in complete)} (load one by "
               f"its folder, e.g. {complete[-1]})" if complete else "")
    if pointer is not None:
        version = root / pointer["folder"]
        if _complete(version):
            return version
        what = "is missing" if not version.exists() else f"has no {MANIFEST} (incomplete)"
        raise CheckpointError(
            f"{root / LATEST} names {pointer['folder']} (step {pointer.get('step')}), which "
            f"{what}: it was removed, or this process does not see the files rank 0 wrote "
            f"(every rank needs the folder on a shared file system){instead}")
    if _complete(root):
        return root
    raise CheckpointError(f"{root / MANIFEST} does not exist: not a (complete) fxpar "
                          f"checkpoint; fxpar.io.checkpoint.save writes a folder with a "
                          f"'{LATEST}' file and step-NNNNNNNN versions{instead}")


def _start_version(root: Path, step: int) -> str:
    """Rank 0: make the empty folder this save writes into. Never one that ``latest`` names or
    any complete version; an unfinished save's folder of the same name is cleared."""
    root.mkdir(parents=True, exist_ok=True)
    pointer = _read_latest(root)
    taken = set(pointer["versions"]) if pointer is not None else set()
    n = 0
    while version_name(step, n) in taken or _complete(root / version_name(step, n)):
        n += 1
    version = root / version_name(step, n)
    shutil.rmtree(version, ignore_errors=True)
    version.mkdir()
    return version.name


def _commit(root: Path, name: str, step: int, keep: int | None) -> None:
    """Rank 0, once ``name`` is complete: point ``latest`` at it, then remove every other
    version but the newest ``keep`` (an unfinished save's folder included)."""
    pointer = _read_latest(root)
    if pointer is not None:
        before = pointer["versions"]
    else:  # no pointer yet (or it was deleted): the complete versions on disk, by step
        before = [p.name for p in _version_folders(root) if _complete(p)]
    versions = [v for v in before if v != name and _complete(root / v)] + [name]
    kept = versions[-keep:] if keep is not None else versions
    text = json.dumps({"format": LATEST_FORMAT, "folder": name, "step": step,
                       "versions": kept}, indent=1)
    _write_durably(root / LATEST, lambda p: p.write_text(text))
    try:  # saved: what cannot be removed now, the next save removes
        for version in _version_folders(root):
            if version.name not in kept:
                shutil.rmtree(version, ignore_errors=True)
        for stale in root.iterdir():  # a temporary file of a save that crashed while renaming
            if _TEMPORARY.fullmatch(stale.name) and stale.is_file():
                stale.unlink(missing_ok=True)
    except OSError:
        pass


# -- save / load (collective; same plan) --------------------------------------------------------
def save(rp: RankProgram, folder: str | os.PathLike[str], step: int,
         extra: dict[str, Any] | None = None, keep: int | None = 2) -> Path:
    """Collective: every rank writes its shard of the training state to a new version folder
    in ``folder``, rank 0 the manifest; then ``folder/latest`` names it. Returns the version's
    folder. ``extra``: JSON values kept in the manifest (rank 0's), e.g. the epoch; read them
    back with :func:`read_manifest`. ``keep``: how many versions to keep (the newest), None for
    all. A failure on any rank raises CheckpointError on every rank and leaves the previous
    checkpoint the one ``latest`` names."""
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
    name, error = None, None
    if rp.rank == 0:
        try:
            name = _start_version(root, int(step))
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
    }
    try:
        _write_durably(version / shard_name(rp.rank), lambda p: torch.save(shard, p))
    except (OSError, RuntimeError) as e:
        error = f"rank {rp.rank} could not write {version / shard_name(rp.rank)}: {e}"
    mine = ({key: list(m.state_dict()) for key, m in rp.stages.items()},
            [n for n, _ in rp.named_parameters()], error)
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
    failed = [e for _, _, e in everyone if e is not None]
    if not failed:
        text = json.dumps(_manifest(program, step, extra, everyone), indent=1)
        try:
            _write_durably(root / name / MANIFEST, lambda p: p.write_text(text))
            _commit(root, name, step, keep)
            return None
        except (OSError, CheckpointError) as e:
            failed = [f"rank 0 could not write {root / name / MANIFEST} or {root / LATEST}: {e}"]
    try:
        pointer = _read_latest(root)
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
        for key in everyone[rank][0].get((0, stage), []):
            holders.setdefault(key, [rank, 0, stage])
    params = {n for _, names, _ in everyone for n in names}
    return {
        "format": FORMAT, "version": VERSION, "step": step, "world_size": program.world_size,
        "plan": program.plan.to_json(),
        "names": list(program.names),
        "parameters": [n for n in program.names if n in params],
        "unsaved": [n for n in program.names if n not in holders],
        "ranks": [{"rank": r, "file": shard_name(r),
                   "roles": [{"dp": rm.dp_index(r), "copy": role.copy, "stage": role.stage,
                              "tile": role.tile} for role in rm.roles_of(r)]}
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
    manifest = json.loads(path.read_text())
    if manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
        raise CheckpointError(f"{path} is not an fxpar checkpoint of version {VERSION} "
                              f"(format {manifest.get('format')!r}, version "
                              f"{manifest.get('version')!r})")
    return version, manifest


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
        raise CheckpointError(
            f"checkpoint {folder} was saved by another job: {'; '.join(problems)}. Resume with "
            f"the same model and plan on the same number of ranks, or change plans through "
            f"the single-device form: state = fxpar.io.checkpoint.export({str(folder)!r}) (or "
            f"`python -m fxpar.cli.checkpoint export {folder} model.pt`), then "
            f"rank_program.load_state_dict(state) (the optimizer state and step start afresh)")


def load(rp: RankProgram, folder: str | os.PathLike[str]) -> int:
    """Restore this rank's shard in place (parameters, buffers, optimizer, RNG); returns the
    step it was saved at. Collective in the sense that every rank must call it; it communicates
    nothing, and a checkpoint of another plan or world size raises on every rank alike."""
    folder, manifest = _open(folder)
    _check_same_job(manifest, rp.program, folder)
    path = folder / manifest["ranks"][rp.rank]["file"]
    if not path.exists():
        raise CheckpointError(f"{path} is missing: every rank must see the whole checkpoint "
                              f"folder (a shared file system)")
    shard = torch.load(path, map_location="cpu", weights_only=True)
    if shard["step"] != manifest["step"]:
        raise CheckpointError(
            f"{path} is from step {shard['step']} but {folder / MANIFEST} from step "
            f"{manifest['step']}: files of two saves are mixed in this folder (a save of "
            f"the first layout that did not finish, or files copied by hand); load another "
            f"version")
    if set(shard["stages"]) != set(rp.stages):
        raise CheckpointError(f"{path} holds (copy, stage) {sorted(shard['stages'])}, this "
                              f"rank runs {sorted(rp.stages)}: not this job's checkpoint")
    with torch.no_grad():
        for key, module in rp.stages.items():
            try:  # copies into the existing tensors (assign=False)
                module.load_state_dict(shard["stages"][key], strict=True)
            except RuntimeError as e:
                raise CheckpointError(f"{path}, (copy, stage) {key}: {e}") from e
    if (shard["optimizer"] is None) != (rp.optimizer is None):
        saved = "without" if shard["optimizer"] is None else "with"
        now = "none" if rp.optimizer is None else "one"
        raise CheckpointError(f"{path} was saved {saved} an optimizer, this program has {now}: "
                              f"compile with the same optimizer= as the job that saved it")
    if rp.optimizer is not None:
        rp.optimizer.load_state_dict(shard["optimizer"])
    torch.set_rng_state(shard["rng"])
    if rp.loss_scale is not None and shard.get("loss_scale") is not None:
        rp.loss_scale = LossScale(**shard["loss_scale"])  # fp16: the scale goes on as it was
    return int(manifest["step"])


# -- the single-device form ------------------------------------------------------------------
def export(folder: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """The single-device ``state_dict`` of a checkpoint, in the original model's key order
    (each key from copy 0, tile 0, replica 0 of its stage). Reads files only: no MPI."""
    folder, manifest = _open(folder)
    shards: dict[int, dict[str, Any]] = {}
    out: dict[str, torch.Tensor] = {}
    for name in manifest["names"]:
        if name not in manifest["holders"]:
            continue  # used by no stage: never saved (listed in manifest["unsaved"])
        rank, copy_, stage = manifest["holders"][name]
        if rank not in shards:
            path = folder / manifest["ranks"][rank]["file"]
            if not path.exists():
                raise CheckpointError(f"{path} is missing: export needs the shards listed in "
                                      f"{folder / MANIFEST}")
            shards[rank] = torch.load(path, map_location="cpu", weights_only=True)
        out[name] = shards[rank]["stages"][(copy_, stage)][name]
    return out


def load_state_dict(rp: RankProgram, state_dict: dict[str, torch.Tensor],
                    strict: bool = True) -> list[str]:
    """``RankProgram.load_state_dict``: the keys of this rank's modules (every copy) copied in
    place from a single-device ``state_dict``; returns the keys loaded."""
    program = rp.program
    known = set(program.names)
    wanted: dict[StageKey, list[str]] = {
        key: [k for k in m.state_dict() if k in known] for key, m in rp.stages.items()}
    needed = sorted({k for keys in wanted.values() for k in keys}, key=rp._order)
    if strict:
        missing = [k for k in needed if k not in state_dict]
        unknown = [k for k in state_dict if k not in known]
        if missing or unknown:
            what = []
            if missing:
                what.append(f"missing {len(missing)} key(s) rank {rp.rank} needs: "
                            f"{_some(missing)}")
            if unknown:
                what.append(f"{len(unknown)} key(s) the compiled model does not have: "
                            f"{_some(unknown)}")
            raise CheckpointError(f"load_state_dict: {'; '.join(what)}. Pass the whole "
                                  f"single-device state_dict of the same model "
                                  f"(model.state_dict()), or strict=False to load what matches")
    with torch.no_grad():
        for key, module in rp.stages.items():
            part = {k: state_dict[k] for k in wanted[key] if k in state_dict}
            try:
                module.load_state_dict(part, strict=False)  # copy_ into the existing tensors
            except RuntimeError as e:
                raise CheckpointError(f"load_state_dict into (copy, stage) {key}: {e}") from e
    return [k for k in needed if k in state_dict]


def _some(keys: Sequence[str], n: int = 8) -> str:
    return ", ".join(keys[:n]) + (f", ... ({len(keys) - n} more)" if len(keys) > n else "")
