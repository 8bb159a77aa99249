"""The layout of a checkpoint folder: versions, the ``latest`` pointer, durable writes.

A checkpoint folder holds versions, one per save, and a pointer to the newest complete one::

    ckpt/
      latest              rank 0: JSON naming the version saved last (its folder and step) and
                          the versions kept, oldest first
      step-00000004/      a version: one complete checkpoint
        checkpoint.json     rank 0, written last: format, step, world size, the plan, the
                            model's state_dict keys in order, which rank holds which (copy,
                            stage, tile) and each shard's size and sha256, which shard holds
                            each key for export
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

What writes and reads the files is fxpar.program.checkpoint; this module knows only the folders.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from fxpar.program import integrity

MANIFEST = "checkpoint.json"
LATEST = "latest"
LATEST_FORMAT = "fxpar-checkpoint-latest"
VERSION_FOLDER = re.compile(r"step-(\d{8,})(?:\.(\d+))?")
_TEMPORARY = re.compile(r"\..+\.tmp\d+")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used here; the message says what to do instead."""


CheckpointError.__module__ = "fxpar.program.checkpoint"  # where users import it from (and pickle)


def shard_name(rank: int) -> str:
    return f"rank{rank:05d}.pt"


def version_name(step: int, n: int = 0) -> str:
    """The folder of a version: ``step-00000042``, or ``step-00000042.n`` for the n-th other
    save of that step."""
    return f"step-{step:08d}" + (f".{n}" if n else "")


# -- durable files -------------------------------------------------------------------------
def write_durably(path: Path, write: Callable[[Path], None]) -> None:
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


# -- versions and the latest pointer -------------------------------------------------------------
def read_latest(root: Path) -> dict[str, Any] | None:
    """The ``latest`` pointer of ``root``, None when it has none."""
    path = root / LATEST
    if not path.is_file():
        return None
    try:
        pointer = json.loads(path.read_text())
        ok = (pointer.get("format") == LATEST_FORMAT
              and VERSION_FOLDER.fullmatch(pointer["folder"]) is not None
              and all(VERSION_FOLDER.fullmatch(v) for v in pointer["versions"]))
    except (ValueError, KeyError, TypeError, AttributeError):
        ok = False
    if not ok:
        raise CheckpointError(f"{path} is not an fxpar checkpoint pointer (checkpoint.save "
                              f"writes it): delete it, then load a version by its folder "
                              f"({root}/step-NNNNNNNN)")
    return pointer


def version_folders(root: Path) -> list[Path]:
    """The ``step-*`` folders in ``root``, complete or not, by step."""
    found = [(m, p) for p in (root.iterdir() if root.is_dir() else [])
             if p.is_dir() and (m := VERSION_FOLDER.fullmatch(p.name))]
    return [p for m, p in sorted(found, key=lambda mp: (int(mp[0][1]), int(mp[0][2] or 0)))]


def complete(version: Path) -> bool:
    return (version / MANIFEST).is_file()


def resolve(folder: str | os.PathLike[str]) -> Path:
    """The folder holding the checkpoint that ``folder`` stands for: the version its
    ``latest`` names, else ``folder`` itself when it holds a manifest (a version folder, or the
    first layout). Raises CheckpointError, saying what to load instead, when there is none."""
    root = Path(folder)
    pointer = read_latest(root)
    done = [p for p in version_folders(root) if complete(p)]
    instead = (f"; complete versions here: {', '.join(p.name for p in done)} (load one by "
               f"its folder, e.g. {done[-1]})" if done else "")
    if pointer is not None:
        version = root / pointer["folder"]
        if complete(version):
            return version
        what = "is missing" if not version.exists() else f"has no {MANIFEST} (incomplete)"
        raise CheckpointError(
            f"{root / LATEST} names {pointer['folder']} (step {pointer.get('step')}), which "
            f"{what}: it was removed, or this process does not see the files rank 0 wrote "
            f"(every rank needs the folder on a shared file system){instead}")
    if complete(root):
        return root
    raise CheckpointError(f"{root / MANIFEST} does not exist: not a (complete) fxpar "
                          f"checkpoint; fxpar.program.checkpoint.save writes a folder with a "
                          f"'{LATEST}' file and step-NNNNNNNN versions{instead}")


def instead(version: Path) -> str:
    """What to do when ``version`` cannot be loaded: the other complete versions kept beside it
    whose shards still have their recorded sizes (a stat each, no read)."""
    root = version.parent if VERSION_FOLDER.fullmatch(version.name) else version
    others = [v for v in version_folders(root) if v != version and _sizes_ok(v)]
    if not others:
        return (f"No other complete version is kept in {root}: train from the start, or from "
                f"a single-device state_dict you have (rank_program.load_state_dict)")
    newest = others[-1]
    return (f"Versions still kept in {root}: {', '.join(v.name for v in others)}; load one "
            f"instead, e.g. fxpar.program.checkpoint.load(rp, {str(newest)!r}) "
            f"(fxpar-run --resume {newest}); `python -m fxpar.cli.checkpoint verify {newest}` "
            f"checks it first")


def _sizes_ok(version: Path) -> bool:
    try:
        entries = json.loads((version / MANIFEST).read_text())["ranks"]
        return all((version / e["file"]).is_file() and (
            not integrity.recorded(e)
            or integrity.size_problem(version / e["file"], e, MANIFEST) is None)
            for e in entries)
    except (OSError, ValueError, KeyError, TypeError):
        return False


# -- what a save does to the folder (rank 0) ---------------------------------------------------
def start_version(root: Path, step: int) -> str:
    """Rank 0: make the empty folder this save writes into. Never one that ``latest`` names or
    any complete version; an unfinished save's folder of the same name is cleared."""
    root.mkdir(parents=True, exist_ok=True)
    pointer = read_latest(root)
    taken = set(pointer["versions"]) if pointer is not None else set()
    n = 0
    while version_name(step, n) in taken or complete(root / version_name(step, n)):
        n += 1
    version = root / version_name(step, n)
    shutil.rmtree(version, ignore_errors=True)
    version.mkdir()
    return version.name


def commit(root: Path, name: str, step: int, keep: int | None) -> None:
    """Rank 0, once ``name`` is complete: point ``latest`` at it, then remove every other
    version but the newest ``keep`` (an unfinished save's folder included)."""
    pointer = read_latest(root)
    if pointer is not None:
        before = pointer["versions"]
    else:  # no pointer yet (or it was deleted): the complete versions on disk, by step
        before = [p.name for p in version_folders(root) if complete(p)]
    versions = [v for v in before if v != name and complete(root / v)] + [name]
    kept = versions[-keep:] if keep is not None else versions
    text = json.dumps({"format": LATEST_FORMAT, "folder": name, "step": step,
                       "versions": kept}, indent=1)
    write_durably(root / LATEST, lambda p: p.write_text(text))
    try:  # saved: what cannot be removed now, the next save removes
        for version in version_folders(root):
            if version.name not in kept:
                shutil.rmtree(version, ignore_errors=True)
        for stale in root.iterdir():  # a temporary file of a save that crashed while renaming
            if _TEMPORARY.fullmatch(stale.name) and stale.is_file():
                stale.unlink(missing_ok=True)
    except OSError:
        pass


def some_keys(keys: Sequence[str], n: int = 8) -> str:
    """The first ``n`` of ``keys``, and how many more (for messages)."""
    return ", ".join(keys[:n]) + (f", ... ({len(keys) - n} more)" if len(keys) > n else "")

