"""What every image reader of fxpar.data.images shares: the reader interface (:class:`ImageReader`,
one window of one level at a time, with accounting), a file object that counts the bytes read,
and :func:`to_tensor`."""

from __future__ import annotations

import io
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fxpar.core.geometry import Rect
from fxpar.data.errors import DataError

_PIL_MODE = {1: "L", 3: "RGB", 4: "RGBA"}


@dataclass
class ReadStats:
    """What a reader has read so far: its windows, the bytes (``counting=True``; headers
    included, ``header`` of them while opening) and the storage tiles / chunks touched."""

    windows: list[Rect] = field(default_factory=list)
    bytes: int = 0
    tiles: int = 0
    header: int = 0


class CountingFile(io.RawIOBase):
    """A read-only file that counts the bytes read through it, handed to tifffile / PIL so the
    bytes a window costs are measured at the file handle rather than estimated. It has no
    ``fileno``, so tifffile cannot memory-map around it."""

    def __init__(self, path: Path) -> None:
        super().__init__()
        self._f = open(path, "rb", buffering=0)  # noqa: SIM115 (closed by close())
        self.name = str(path)
        self.count = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        return self._f.seek(offset, whence)

    def tell(self) -> int:
        return self._f.tell()

    def readinto(self, buffer: Any) -> int:
        n = self._f.readinto(buffer) or 0
        self.count += n
        return n

    def close(self) -> None:
        if not self.closed:
            self._f.close()
        super().close()


class ImageReader:
    """One image at one pyramid level. ``shape`` is (C, *spatial) at ``level``; ``levels`` the
    spatial size of every level (level 0 first); ``geo`` the GeoTIFF tags (tag name -> value,
    see :func:`geo_extratags`) of level 0, None for other files. Subclasses implement
    ``_read``; :meth:`read` checks the window and keeps the accounting."""

    def __init__(self, path: Path, level: int, levels: tuple[tuple[int, ...], ...],
                 channels: int, dtype: np.dtype, geo: dict[str, Any] | None = None) -> None:
        self.path, self.levels, self.geo = path, levels, geo
        if not 0 <= level < len(levels):
            sizes = ", ".join(f"{k}: {_fmt(s)}" for k, s in enumerate(levels))
            raise DataError(f"{path}: no pyramid level {level}; the file has {len(levels)} "
                            f"level(s) ({sizes}): give a level from 0 to {len(levels) - 1}")
        self.level = level
        self.shape: tuple[int, ...] = (channels, *levels[level])
        self.dtype = np.dtype(dtype)
        self.stats = ReadStats()
        self._counter: Any = None  # something with .count: the bytes read so far

    @property
    def size(self) -> tuple[int, ...]:
        """The spatial size at this level: (H, W) or (D, H, W)."""
        return self.shape[1:]

    def read(self, window: Rect) -> np.ndarray:
        """``window`` (this level's coordinates) as a (C, *window.shape) array of the stored
        dtype."""
        image = Rect.whole(self.size)
        if window.ndim != len(self.size) or window.intersect(image) != window:
            raise DataError(f"{self.path}: window {window} is outside the "
                            f"{_fmt(self.size)} image at level {self.level}: read inside "
                            f"{image} (a sample's region must lie inside its image)")
        a = self._read(window)
        self.stats.windows.append(window)
        if self._counter is not None:
            self.stats.bytes = self._counter.count
        return a

    def _read(self, window: Rect) -> np.ndarray:
        raise NotImplementedError

    def _opened(self) -> None:
        """Call at the end of opening: what was read so far is the header."""
        if self._counter is not None:
            self.stats.bytes = self.stats.header = self._counter.count

    def close(self) -> None:
        """Close the file (readers keep it open between reads)."""

    def __enter__(self) -> ImageReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"{type(self).__name__}({str(self.path)!r}, level={self.level}, "
                f"shape={self.shape}, dtype={self.dtype})")


def _fmt(size: tuple[int, ...]) -> str:
    return "x".join(map(str, size))


def to_tensor(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """An image window as a tensor of ``dtype``: integers scaled to [0, 1] by their dtype's
    maximum (as fxpar.data.data), booleans to 0 / 1, floats as they are. Not for masks."""
    t = torch.from_numpy(np.ascontiguousarray(a))
    if a.dtype.kind in "iu":
        return t.to(dtype) / float(np.iinfo(a.dtype).max)
    return t.to(dtype)
