"""Labelled samples for training and validation, read one window at a time through
fxpar.data.images (``--data`` / ``--val-data`` of fxpar-run).

A source is a class folder or a CSV:

- a folder ``DIR/<class>/<file>`` as fxpar.data.data.ImageFolder (classes sorted are the labels,
  hidden entries skipped), but every file goes through :func:`fxpar.data.images.open_image`, so
  the files may be tiled / pyramidal TIFF, Zarr folders (``*.zarr``), ``.npy``, PNG / JPEG or
  NIfTI, read at ``level``; each must have exactly the model's spatial size at that level;
- a CSV with a header row and the columns ``image`` (a path relative to the CSV's folder, or
  absolute), then ``label`` (an int class: classification) or ``mask`` (a path: segmentation,
  a per-pixel class map read by the same readers, one channel, the same size as its image at
  that level -- a mask pyramid's matching level, or a single-level mask of that size), and
  optionally ``level``, ``y``, ``x`` (and ``z`` for volumes): the origin of the sample's region
  at that level. A sample is then the region ``[y, y + H) x [x, x + W)`` of a larger slide
  (``--image-size H x W``); the origin defaults to 0, 0 and the level to ``level``. Other
  columns are ignored. Every row is checked against its files' headers before training starts;
  an error names the CSV line and the column.

Batches are step-indexed like fxpar.data.data.FolderBatches (the same epoch order, seeded, the
last partial batch dropped): ``batch(step, window)`` fills only ``window`` (the rank's part of
the region, region coordinates) of each sample's image in a full-shape ``torch.empty`` batch;
y is the class labels (N,) int64, or the masks (N, *size) int64 -- the whole region's mask on
every rank, because the loss is computed on the whole output. Masks are class indices: never
scaled (images are, by :func:`fxpar.data.images.to_tensor`). Readers stay open between steps, at
most ``open_files`` of them (least recently used closed first).
"""

from __future__ import annotations

import csv
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fxpar.core.geometry import Rect
from fxpar.data import data as folder_data
from fxpar.data.data import Batch, DataError, Epochs, spatial_size
from fxpar.data.images import FORMATS, ImageReader, open_image, to_tensor

TASKS = ("classify", "segment")
ORIGIN = ("z", "y", "x")
_NUMPY_FLOATS = (torch.float16, torch.float32, torch.float64)


@dataclass(frozen=True)
class Sample:
    """One sample: the region of ``image`` at ``level`` starting at ``origin``, with a class
    ``label`` or a ``mask`` (read at ``mask_level``). ``line``: the CSV line (0: a folder)."""

    image: Path
    label: int | None = None
    mask: Path | None = None
    level: int = 0
    origin: tuple[int, ...] = ()
    mask_level: int = 0
    line: int = 0

    def region(self, size: tuple[int, ...]) -> Rect:
        """The sample's region in its image at ``level``."""
        return Rect(*((o, o + s) for o, s in zip(self.origin, size, strict=True)))


@dataclass
class SampleSet:
    """Checked samples of one folder or CSV (build with :meth:`scan`)."""

    source: Path
    samples: list[Sample]
    size: tuple[int, ...]
    channels: int
    classes: list[str]
    task: str

    @classmethod
    def scan(cls, path: str | Path, size: tuple[int, ...], channels: int, level: int = 0,
             readers: Any = None) -> SampleSet:
        """The samples of a folder or CSV, every one checked against its files' headers
        (``readers(path, level, mask)``: how to open them; a cache by default)."""
        path = Path(path)
        opener = readers or _Readers(len(size), channels)
        if path.is_dir() and not path.name.lower().endswith(".zarr"):
            found = _folder(path, level)
        elif path.is_file() and path.suffix.lower() == ".csv":
            found = _csv(path, level, len(size))
        else:
            raise DataError(f"--data {path}: give a folder of class folders (DIR/<class>/"
                            f"<image>) or a .csv of image,label or image,mask rows"
                            f"{'' if path.exists() else ' (no such file or folder)'}")
        samples, classes = found
        data = cls(path, samples, tuple(size), channels, classes,
                   "segment" if samples[0].mask is not None else "classify")
        data.samples = [data._check(s, opener) for s in samples]
        return data

    def __len__(self) -> int:
        return len(self.samples)

    def _where(self, s: Sample) -> str:
        return f"{self.source}:{s.line}" if s.line else str(s.image)

    def _check(self, s: Sample, readers: Any) -> Sample:
        """``s`` with its origin filled in and its mask level chosen; DataError when the image
        or mask does not fit."""
        where, fmt = self._where(s), folder_data._fmt
        try:
            image = readers(s.image, s.level, False)
        except DataError as e:
            raise DataError(f"{where}: column 'image': {e}") from None
        if len(image.size) != len(self.size):
            raise DataError(f"{where}: {s.image} is {fmt(image.size)} but --image-size is "
                            f"{fmt(self.size)}: give {len(image.size)} sizes")
        if image.shape[0] != self.channels:
            raise DataError(f"{where}: {s.image} has {image.shape[0]} channel(s) but the model "
                            f"takes {self.channels} (--channels)")
        origin = s.origin or (0,) * len(self.size)
        region = Rect(*((o, o + n) for o, n in zip(origin, self.size, strict=True)))
        if not s.line and image.size != self.size:
            raise DataError(f"{where}: image is {fmt(image.size)} at level {s.level} but "
                            f"--image-size is {fmt(self.size)}: every image must be that size "
                            f"(resize or crop the data, change --image-size or --level, or list "
                            f"regions of larger images in a CSV with y, x columns)")
        if region.intersect(Rect.whole(image.size)) != region:
            cols = ", ".join(ORIGIN[-len(self.size):])
            raise DataError(f"{where}: columns {cols}: the region {region} of size "
                            f"{fmt(self.size)} passes the edge of {s.image}, "
                            f"{fmt(image.size)} at level {s.level}: move the origin or lower "
                            f"--image-size")
        mask_level = 0
        if s.mask is not None:
            try:
                mask = readers(s.mask, 0, True)
            except DataError as e:
                raise DataError(f"{where}: column 'mask': {e}") from None
            if mask.shape[0] != 1:
                raise DataError(f"{where}: column 'mask': {s.mask} has {mask.shape[0]} "
                                f"channels; a mask holds one class index per pixel")
            fits = [k for k, n in enumerate(mask.levels) if n == image.size]
            if not fits:
                raise DataError(f"{where}: column 'mask': {s.mask} is "
                                f"{', '.join(fmt(n) for n in mask.levels)} but its image is "
                                f"{fmt(image.size)} at level {s.level}: a mask must have the "
                                f"size of its image at that level")
            mask_level = s.level if s.level in fits else fits[0]
        return Sample(s.image, s.label, s.mask, s.level, origin, mask_level, s.line)


def _folder(root: Path, level: int) -> tuple[list[Sample], list[str]]:
    classes = sorted(d.name for d in root.iterdir() if d.is_dir()
                     and not d.name.startswith(".") and not d.name.lower().endswith(".zarr"))
    if not classes:
        raise DataError(f"--data {root} has no class folders: put the images of each class in "
                        f"{root}/<class name>/, or list them in a CSV")
    samples = [Sample(f, label, level=level) for label, name in enumerate(classes)
               for f in sorted((root / name).iterdir())
               if not f.name.startswith(".") and f.name.lower().endswith(FORMATS)]
    if not samples:
        raise DataError(f"--data {root}: the class folders {classes} hold no images "
                        f"({', '.join(FORMATS)})")
    return samples, classes


def _int(text: str, where: str, column: str, lowest: int = 0) -> int:
    try:
        value = int(text)
    except ValueError:
        value = lowest - 1
    if value < lowest:
        raise DataError(f"{where}: column '{column}': {text!r} is not an integer >= {lowest}")
    return value


def _csv(path: Path, level: int, ndim: int) -> tuple[list[Sample], list[str]]:
    with open(path, newline="", encoding="utf-8-sig") as f:
        rows = list(csv.reader(f))
    header = [c.strip().lower() for c in rows[0]] if rows else []
    kinds = [c for c in ("label", "mask") if c in header]
    if "image" not in header or len(kinds) != 1:
        raise DataError(f"{path}: the header row has columns {header}; give 'image' and "
                        f"either 'label' (classes) or 'mask' (segmentation), optionally "
                        f"'level', {', '.join(repr(c) for c in ORIGIN[-ndim:])}")
    col = {name: header.index(name) for name in header}
    samples = []
    for line, row in enumerate(rows[1:], start=2):
        if not any(cell.strip() for cell in row):
            continue
        if len(row) < len(header):
            raise DataError(f"{path}:{line}: {len(row)} cells but the header has "
                            f"{len(header)} columns")
        where = f"{path}:{line}"

        def cell(name: str, row: list[str] = row) -> str:
            return row[col[name]].strip() if name in col else ""

        if not cell("image"):
            raise DataError(f"{where}: column 'image' is empty: give the image's path")
        image = path.parent / cell("image")
        label = _int(cell("label"), where, "label") if kinds == ["label"] else None
        mask = None
        if kinds == ["mask"]:
            if not cell("mask"):
                raise DataError(f"{where}: column 'mask' is empty: give the mask's path")
            mask = path.parent / cell("mask")
        lv = _int(cell("level"), where, "level") if cell("level") else level
        origin = tuple(_int(cell(c), where, c) if cell(c) else 0 for c in ORIGIN[-ndim:])
        samples.append(Sample(image, label, mask, lv, origin, line=line))
    if not samples:
        raise DataError(f"{path}: no rows after the header: list one sample per row")
    top = max((s.label or 0) for s in samples)
    return samples, [str(k) for k in range(top + 1)] if kinds == ["label"] else []


class _Readers:
    """Open readers by (path, level, mask), the least recently used closed beyond ``limit``:
    a slide is parsed once, not once per step."""

    def __init__(self, ndim: int, channels: int | None = None, counting: bool = False,
                 limit: int = 16) -> None:
        self.ndim, self.channels, self.counting, self.limit = ndim, channels, counting, limit
        self.open: OrderedDict[tuple[Path, int, bool], ImageReader] = OrderedDict()

    def __call__(self, path: Path, level: int, mask: bool) -> ImageReader:
        key = (path, level, mask)
        if key in self.open:
            self.open.move_to_end(key)
            return self.open[key]
        reader = open_image(path, level, counting=self.counting, ndim=self.ndim,
                            channels=None if mask else self.channels, mask=mask)
        self.open[key] = reader
        while len(self.open) > self.limit:
            self.open.popitem(last=False)[1].close()
        return reader

    def close(self) -> None:
        while self.open:
            self.open.popitem()[1].close()


@dataclass
class SampleBatches:
    """Step-indexed batches of a :class:`SampleSet` (a fxpar.data.data.BatchSource):
    epoch = step // steps_per_epoch, as FolderBatches."""

    data: SampleSet
    batch_size: int
    dtype: torch.dtype = torch.float32
    seed: int = 0
    shuffle: bool = True
    fill: float | None = None
    """Fill the batch outside the window with this value (tests: NaN); None: never touched."""
    readers: _Readers = field(default=None, repr=False)  # type: ignore[assignment]
    reads: list[tuple[Path, Rect]] | None = None
    """When a list, every image read appends (file, window in its level's coordinates)."""
    _epochs: Epochs = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.readers is None:
            self.readers = _Readers(len(self.data.size), self.data.channels)
        if len(self.data) < self.batch_size:
            raise DataError(f"--data {self.data.source} has {len(self.data)} samples, fewer "
                            f"than one batch of {self.batch_size}: lower --batch-size or add "
                            f"samples")
        self._epochs = Epochs(len(self.data), self.batch_size, self.seed, self.shuffle)

    @property
    def task(self) -> str:
        """"classify" (y: labels) or "segment" (y: masks)."""
        return self.data.task

    @property
    def steps_per_epoch(self) -> int:
        return self._epochs.steps_per_epoch

    def __len__(self) -> int:
        """The number of samples (an epoch uses ``steps_per_epoch * batch_size`` of them)."""
        return len(self.data)

    def indices(self, step: int) -> list[int]:
        return self._epochs.indices(step)

    def batch(self, step: int, window: Rect | None, target: Rect | None = None,
              targets: bool = True) -> Batch:
        """The batch of ``step``: only ``window`` of each image filled (x None when the window
        is None); y the labels, or the masks: only ``target`` of each (the box the rank's loss
        reads, ``RankProgram.target_window``; None: all of it), or None when not ``targets``
        (a rank that computes no loss, ``RankProgram.needs_targets``)."""
        samples = [self.data.samples[i] for i in self.indices(step)]
        y = self._labels(samples, target) if targets else None
        if window is None:
            return None, y
        size = self.data.size
        if window.ndim != len(size) or window.intersect(Rect.whole(size)) != window:
            raise ValueError(f"window {window} is not inside the {folder_data._fmt(size)} "
                             f"samples")
        shape = (len(samples), self.data.channels, *size)
        x = torch.empty(shape, dtype=self.dtype) if self.fill is None else \
            torch.full(shape, self.fill, dtype=self.dtype)
        where = tuple(slice(a, b) for a, b in window.dims)
        for k, s in enumerate(samples):
            inside = window.moved(tuple(-o for o in s.origin))  # the image's coordinates
            a = self.readers(s.image, s.level, False).read(inside)
            if self.reads is not None:
                self.reads.append((s.image, inside))
            out = x[(k, slice(None), *where)]
            if a.dtype.kind == "f" and self.dtype in _NUMPY_FLOATS:
                out.numpy()[...] = a  # straight from the reader's array, no second copy
            else:
                out.copy_(to_tensor(a, self.dtype))
        return x, y

    def _labels(self, samples: list[Sample], target: Rect | None = None) -> torch.Tensor:
        if self.data.task == "classify":
            return torch.tensor([s.label for s in samples], dtype=torch.int64)
        y = torch.empty((len(samples), *self.data.size), dtype=torch.int64)
        box = Rect.whole(self.data.size) if target is None else target
        where = tuple(slice(a, b) for a, b in box.dims)
        for k, s in enumerate(samples):
            assert s.mask is not None
            inside = box.moved(tuple(-o for o in s.origin))  # the mask's coordinates
            a = self.readers(s.mask, s.mask_level, True).read(inside)[0]
            if self.reads is not None:
                self.reads.append((s.mask, inside))
            if a.dtype.kind == "f" and not np.array_equal(a, np.round(a)):
                raise DataError(f"{self.data._where(s)}: column 'mask': {s.mask} holds "
                                f"fractions; a mask holds integer class indices")
            y[(k, *where)] = torch.from_numpy(a.astype(np.int64))
        return y

    def describe(self) -> str:
        """One line for the driver's start-up message."""
        d = self.data
        what = f"{len(d.classes)} classes" if d.task == "classify" else "masks"
        levels = sorted({s.level for s in d.samples})
        return (f"data: {d.source} ({len(d)} samples, {what}, level "
                f"{', '.join(map(str, levels))}, {folder_data._fmt(d.size)} regions, "
                f"{self.steps_per_epoch} steps per epoch)")

    def close(self) -> None:
        self.readers.close()


def open_source(path: str | Path, shape: tuple[int, ...], dtype: torch.dtype = torch.float32,
                seed: int = 0, shuffle: bool = True, level: int = 0, *,
                fill: float | None = None, counting: bool = False) -> SampleBatches:
    """The batch source of a class folder or a CSV (see the module doc). ``shape``: the
    global batch, (N, C, H, W) or (N, C, D, H, W). ``level``: the pyramid level of rows and
    files that give none. ``counting``: readers count their bytes (fxpar.data.images)."""
    if len(shape) not in (4, 5):
        raise DataError(f"batch shape {tuple(shape)}: give (N, C, H, W) or (N, C, D, H, W)")
    n, channels, *size = (int(s) for s in shape)
    size_t = spatial_size(tuple(size))
    readers = _Readers(len(size_t), channels, counting)
    data = SampleSet.scan(path, size_t, channels, level, readers)
    return SampleBatches(data, n, dtype, seed, shuffle, fill, readers)


def task(source: Any) -> str:
    """"segment" for a source of masks, else "classify" (folders, CSV labels, synthetic)."""
    return getattr(source, "task", "classify")


def describe(source: Any) -> str:
    """One line about any source: its own ``describe()``, or fxpar.data.data.describe."""
    own = getattr(source, "describe", None)
    return own() if callable(own) else folder_data.describe(source)
