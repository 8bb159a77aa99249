"""Captures on disk: a folder that keeps each traced graph for the next process.

``torch.export`` is most of a compile, and the first capture in a process costs about 2 s more
for torch's own warm-up: a job that is restarted (a resume after a failure, the same model
under another plan, a test suite's launches) captures the same model again. With
``FXPAR_CAPTURE_CACHE=DIR`` (or ``fxpar.CaptureCache(folder=DIR)``) a capture is written to
``DIR`` and read back by any later process that compiles a model of the same structure for an
input of the same shape and dtype, as ranks of one job already receive rank 0's
(fxpar.frontend.share).

A file is used only when all of these are equal to the process reading it (its name is a
SHA-256 over them; its second line, one over the rest of its contents, catches a damaged
file):

- the model's structure (fxpar.frontend.share.structure: classes, settings, tensors), the
  input's shape and dtype;
- torch's version;
- the source of the files that define the model classes' methods, and of every loaded module
  of the packages those classes come from and of fxpar: editing a ``forward`` (or anything
  else in those packages) misses the cache.

What it cannot see is a global setting that changes the graph without changing the model or
those files (an environment variable a ``forward`` reads): clear the folder after changing one.
A file is a pickle, as torch.compile's caches are: the folder must be yours. One owned by
another user, or writable by others, is not used (a warning says so); a damaged file is
traced again and replaced.
"""

from __future__ import annotations

import hashlib
import os
import sys
import tempfile
import types
import warnings
from pathlib import Path

import torch
from torch import nn

MAGIC = b"fxpar-capture 1\n"
"""The first bytes of a capture file: the format, then the SHA-256 of the rest."""


class CaptureStoreWarning(UserWarning):
    """A capture folder that cannot be used (not yours, or writable by others)."""


def code_digest(model: nn.Module) -> str:
    """SHA-256 over torch's version, the files that define the methods of ``model``'s classes,
    and the files of every loaded module of the top-level packages they come from and of
    fxpar (torch itself: its version)."""
    classes = {type(m) for m in model.modules()}
    tops = {c.__module__.partition(".")[0] for c in classes} | {"fxpar"}
    tops.discard("torch")
    files = {f for name, mod in list(sys.modules.items()) if name.partition(".")[0] in tops
             and (f := getattr(mod, "__file__", None)) is not None}
    for c in classes:  # also a class of a file loaded without a sys.modules entry
        files |= {v.__code__.co_filename for v in vars(c).values()
                  if isinstance(v, types.FunctionType)}
    h = hashlib.sha256(torch.__version__.encode())
    for f in sorted(files):
        h.update(f.encode())
        try:
            h.update(Path(f).read_bytes())
        except OSError:
            h.update(b"unreadable")
    return h.hexdigest()


class CaptureStore:
    """Packed captures (fxpar.frontend.share.pack) in ``folder``, one file per key."""

    def __init__(self, folder: str | os.PathLike[str]) -> None:
        self.folder = Path(folder)
        self.usable = _usable(self.folder)

    def path(self, key: str) -> Path:
        return self.folder / f"{hashlib.sha256(key.encode()).hexdigest()}.capture"

    def get(self, key: str) -> bytes | None:
        """The packed capture kept for ``key``, or None (none kept, or a damaged file)."""
        if not self.usable:
            return None
        try:
            raw = self.path(key).read_bytes()
        except OSError:
            return None
        head, sep, rest = raw.partition(b"\n")
        digest, sep2, packed = rest.partition(b"\n")
        if head + sep != MAGIC or not sep2 or \
                hashlib.sha256(packed).hexdigest().encode() != digest:
            return None
        return packed

    def put(self, key: str, packed: bytes) -> None:
        """Keep ``packed`` for ``key`` (written whole or not at all: a temporary file renamed
        over the old one, so concurrent ranks never read half a file)."""
        if not self.usable:
            return
        raw = MAGIC + hashlib.sha256(packed).hexdigest().encode() + b"\n" + packed
        fd, tmp = tempfile.mkstemp(dir=self.folder, suffix=".part")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(raw)
            os.replace(tmp, self.path(key))
        except OSError:
            Path(tmp).unlink(missing_ok=True)


def _usable(folder: Path) -> bool:
    """Make ``folder`` (private to this user) if missing; False, with a warning, when it is
    another user's or others may write to it."""
    try:
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = folder.stat()
    except OSError as e:
        warnings.warn(f"capture cache {folder} cannot be used ({e}): compiling without it",
                      CaptureStoreWarning, stacklevel=4)
        return False
    if hasattr(os, "getuid") and st.st_uid != os.getuid():
        why = "it belongs to another user"
    elif st.st_mode & 0o022:
        why = "others may write to it"
    else:
        return True
    warnings.warn(f"capture cache {folder} is not used: {why} (its files are pickles, read as "
                  f"code): give FXPAR_CAPTURE_CACHE a folder of your own (chmod go-w)",
                  CaptureStoreWarning, stacklevel=4)
    return False
