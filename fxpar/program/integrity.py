"""Shard checksums: what a checkpoint's manifest records of each shard file, the check before
a shard is read back, and the damage that the ``corrupt-checkpoint`` fault does.

``save`` serialises a shard into memory, records ``{"size": bytes, "sha256": hex}`` of exactly
those bytes and writes them; a reader compares the file with the record before ``torch.load``:
the size first (a stat: a file cut short costs no read), then the sha256 of the bytes read once,
which ``torch.load`` then reads from memory. Without the check, a file with one byte changed in
its tensor data loads without any error and trains from a wrong weight.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

DAMAGES = ("truncate", "flip")
"""What :func:`damage` can do to a file (``FXPAR_FAULT=RANK:STEP:corrupt-checkpoint[:ARG]``)."""


def record(data: bytes | memoryview) -> dict[str, Any]:
    """What the manifest keeps of one shard's bytes."""
    return {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def recorded(entry: dict[str, Any]) -> bool:
    """Whether a manifest entry has a checksum (checkpoints saved before them have none)."""
    return "size" in entry and "sha256" in entry


def size_problem(path: Path, entry: dict[str, Any], manifest: str) -> str | None:
    """Why ``path`` (which exists) cannot be the recorded shard by its size alone, or None."""
    found, want = path.stat().st_size, entry["size"]
    if found == want:
        return None
    how = ("cut short (a full disk, a copy that did not finish, a file system fault)"
           if found < want else "longer than written (another file copied over it?)")
    return f"it has {found} bytes where {manifest} recorded {want}: {how}"


def read_checked(path: Path, entry: dict[str, Any], manifest: str
                 ) -> tuple[bytes | None, str | None]:
    """``(the file's bytes, None)``, or ``(None, why they are not the bytes recorded in
    entry)``; an entry without a checksum accepts any bytes. Reads the file once."""
    if recorded(entry):
        problem = size_problem(path, entry, manifest)
        if problem is not None:
            return None, problem
    data = path.read_bytes()
    if not recorded(entry):
        return data, None
    found = record(data)
    if found["size"] != entry["size"]:  # changed between the stat and the read
        return None, f"it has {found['size']} bytes where {manifest} recorded {entry['size']}"
    if found["sha256"] != entry["sha256"]:
        return None, (f"its sha256 is {found['sha256']} where {manifest} recorded "
                      f"{entry['sha256']} (both {entry['size']} bytes: its contents changed "
                      f"after the save, by a disk or file system fault or a file copied over "
                      f"it)")
    return data, None


def damage(path: Path, how: str = "truncate") -> None:
    """Damage a written file as failing storage does: ``truncate`` cuts it to half its size,
    ``flip`` inverts the bits of its middle byte. Durable (fsync) like the write it undoes."""
    if how not in DAMAGES:
        raise ValueError(f"damage {how!r}: one of {', '.join(DAMAGES)}")
    size = path.stat().st_size
    with open(path, "r+b") as f:
        if how == "truncate":
            f.truncate(size // 2)
        else:
            f.seek(size // 2)
            byte = f.read(1)
            f.seek(size // 2)
            f.write(bytes([byte[0] ^ 0xFF]))
        f.flush()
        os.fsync(f.fileno())
