"""Training data for ``fxpar-run``: each rank reads only the part of each image it computes on.

A spatial stage's tile needs its tile of the image plus a halo; a later stage never reads the
image at all. :func:`input_window` gives that rectangle, which the compiler worked out for
every rank (fxpar.compiler.windows; saved in program.json), and the sources below fill only
that window of a full-shape ``torch.empty`` batch: the pages outside it are never touched, so
the operating system never backs them with memory (for a batch large enough to be mapped, not
pooled).
``RankProgram.train_step`` reads nothing else (a test fills the rest with NaN and still matches
one process).

Sources, both indexed by step (so a resumed run sees the same batches):

- :class:`Synthetic`: one fixed batch (``--seed``), a deterministic function of (seed, sample,
  channel, row), so a rank generates only its window's rows;
- :class:`FolderBatches` over an :class:`ImageFolder` (``--data DIR``): DIR/<class>/<image>,
  classes sorted are the labels (like torchvision's ImageFolder); the order is shuffled each
  epoch with a seed every rank shares; the last partial batch of an epoch is dropped.

How much of a file a window read touches depends on the format, honestly:

- ``.npy`` arrays, (C, H, W) or (H, W): memory-mapped (``np.load(mmap_mode="r")``); only the
  pages holding the window's rows (their window columns) are read, straight into the batch;
- PNG / JPEG / TIFF through PIL: PIL decodes the whole file, then the window is cropped and the
  rest dropped (the batch still holds only the window). Reading a tile of a tiled TIFF or a
  whole-slide image without decoding the rest (tifffile / openslide) is future work.

Integer images (uint8, uint16, ...) are scaled to [0, 1] by their dtype's maximum, floating
point arrays are used as they are.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch

from fxpar.core.geometry import Rect

if TYPE_CHECKING:
    from fxpar.io.program import RankProgram

Batch = tuple[torch.Tensor | None, torch.Tensor]
NPY = (".npy",)
PIL_FORMATS = (".png", ".jpg", ".jpeg", ".tif", ".tiff")
_PIL_MODES = {1: "L", 3: "RGB"}
_NUMPY_VIEWABLE = (torch.float16, torch.float32, torch.float64)


class DataError(ValueError):
    """A dataset that cannot be used as given; the message names the file and what to do."""


# -- what a rank reads --------------------------------------------------------------------------
def input_window(rp: RankProgram, image: tuple[int, int] | None = None) -> Rect | None:
    """The bounding box of what ``rp``'s stage modules read from the model input, as the
    compiler recorded it for its rank (``Program.input_windows``): its tiles' windows (halo
    included, clipped to the image), the whole image where a stage uses the input otherwise (a
    non-spatial first stage); None when no stage of the rank reads the input.

    A program that records no windows (an input that is not one image batch, or a folder saved
    before fxpar recorded them): the whole image, of size ``image`` (H, W), where a stage of the
    rank reads the input (see ``RankProgram.input_window``)."""
    windows = rp.program.input_windows
    if windows is not None:
        return windows[rp.rank]
    if not any(src.source == "batch" for _copy, stage in rp.stages
               for src in rp.program.graph.inputs[stage]):
        return None
    if image is None:
        raise ValueError(f"rank {rp.rank} reads the whole model input but its program does "
                         f"not record the image size: pass input_window(image=(H, W))")
    return Rect((0, image[0]), (0, image[1]))


# -- an image folder ----------------------------------------------------------------------------
def _scale(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    t = torch.from_numpy(np.ascontiguousarray(a))
    if np.issubdtype(a.dtype, np.integer):
        return t.to(dtype) / float(np.iinfo(a.dtype).max)
    return t.to(dtype)


@dataclass
class ImageFolder:
    """``root/<class>/<image>`` (see the module doc). Build with :meth:`scan`, which checks
    every file's size and channels from its header before anything else happens."""

    root: Path
    image_size: int
    channels: int
    classes: list[str]
    samples: list[tuple[Path, int]]
    reads: list[tuple[str, Rect]] | None = None
    """When a list, every :meth:`read` appends (file relative to root, window read)."""

    @classmethod
    def scan(cls, root: str | Path, image_size: int, channels: int = 3) -> ImageFolder:
        root = Path(root)
        if not root.is_dir():
            raise DataError(f"--data {root}: no such folder (expected {root}/<class>/<image>)")
        classes = sorted(d.name for d in root.iterdir() if d.is_dir()
                         and not d.name.startswith("."))
        if not classes:
            raise DataError(f"--data {root} has no class folders: put the images of each class "
                            f"in {root}/<class name>/")
        samples: list[tuple[Path, int]] = []
        for label, name in enumerate(classes):
            for f in sorted((root / name).iterdir()):
                if f.is_file() and f.suffix.lower() in NPY + PIL_FORMATS:
                    samples.append((f, label))
        if not samples:
            raise DataError(f"--data {root}: the class folders {classes} hold no images "
                            f"(.npy, .png, .jpg, .jpeg, .tif, .tiff)")
        data = cls(root, image_size, channels, classes, samples)
        for path, _ in samples:
            data._check(path)
        return data

    def __len__(self) -> int:
        return len(self.samples)

    def label(self, i: int) -> int:
        return self.samples[i][1]

    def _check(self, path: Path) -> None:
        size, channels = self._header(path)
        want = (self.image_size, self.image_size)
        if size != want:
            raise DataError(f"{path}: image is {size[0]}x{size[1]} (HxW) but --image-size is "
                            f"{self.image_size}: every image must be {want[0]}x{want[1]} "
                            f"(resize or crop the data, or change --image-size)")
        if channels != self.channels and not (path.suffix.lower() in PIL_FORMATS
                                              and self.channels in _PIL_MODES):
            raise DataError(f"{path}: image has {channels} channel(s) but the model takes "
                            f"{self.channels} (--channels)")

    @staticmethod
    def _header(path: Path) -> tuple[tuple[int, int], int]:
        """((H, W), channels) from the file's header, without reading the pixels."""
        if path.suffix.lower() in NPY:
            try:
                a = np.load(path, mmap_mode="r")
            except (ValueError, OSError) as e:
                raise DataError(f"{path}: not a readable .npy array ({e})") from None
            if a.ndim == 2:
                return (a.shape[0], a.shape[1]), 1
            if a.ndim == 3:
                return (a.shape[1], a.shape[2]), a.shape[0]
            raise DataError(f"{path}: array of shape {a.shape}; expected (C, H, W) or (H, W)")
        from PIL import Image, UnidentifiedImageError

        try:
            with Image.open(path) as im:
                return (im.height, im.width), len(im.getbands())
        except (UnidentifiedImageError, OSError) as e:
            raise DataError(f"{path}: not a readable image ({e})") from None

    def read(self, i: int, window: Rect, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Sample ``i``'s ``window`` (global rows x columns) as a new (C, h, w) tensor."""
        out = torch.empty((self.channels, *window.shape), dtype=dtype)
        self.read_into(i, window, out)
        return out

    def read_into(self, i: int, window: Rect, out: torch.Tensor) -> None:
        """Write sample ``i``'s ``window`` into ``out`` (C, h, w; may be a view of a batch).
        A float .npy goes from the mapped file straight into ``out``: no whole-image buffer,
        no second copy of the window."""
        path = self.samples[i][0]
        (h0, h1), (w0, w1) = window.h, window.w
        if path.suffix.lower() in NPY:
            a = np.load(path, mmap_mode="r")
            part = a[h0:h1, w0:w1][None] if a.ndim == 2 else a[:, h0:h1, w0:w1]
            if np.issubdtype(part.dtype, np.floating) and out.dtype in _NUMPY_VIEWABLE:
                out.numpy()[...] = part  # numpy casts float64 <-> float32 as it copies
            else:
                out.copy_(_scale(np.array(part), out.dtype))
            del a
        else:
            from PIL import Image

            with Image.open(path) as im:  # decodes the whole file (see the module doc)
                if len(im.getbands()) != self.channels or im.mode == "P":
                    im = im.convert(_PIL_MODES[self.channels])
                pixels = np.array(im.crop((w0, h0, w1, h1)))
            out.copy_(_scale(pixels[None] if pixels.ndim == 2 else pixels.transpose(2, 0, 1),
                             out.dtype))
        if self.reads is not None:
            self.reads.append((str(path.relative_to(self.root)), window))


# -- batch sources ------------------------------------------------------------------------------
class BatchSource(Protocol):
    """What the training loop draws from: the global batch of step ``step``, only ``window``
    of it filled (x None when the window is None)."""

    def batch(self, step: int, window: Rect | None) -> Batch: ...


def epoch_order(n: int, epoch: int, seed: int, shuffle: bool = True) -> list[int]:
    """The sample order of one epoch: a permutation seeded by (seed, epoch), the same on every
    rank."""
    if not shuffle:
        return list(range(n))
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(n, generator=g).tolist()


@dataclass
class FolderBatches:
    """Step-indexed batches of an :class:`ImageFolder`: epoch = step // steps_per_epoch."""

    data: ImageFolder
    batch_size: int
    dtype: torch.dtype = torch.float32
    seed: int = 0
    shuffle: bool = True
    fill: float | None = None
    """Fill the batch outside the window with this value (tests: NaN proves nothing reads
    there); None leaves it as ``torch.empty`` gives it: never touched, never allocated."""
    _order: tuple[int, list[int]] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if len(self.data) < self.batch_size:
            raise DataError(f"--data {self.data.root} has {len(self.data)} images, fewer than "
                            f"one batch of {self.batch_size}: lower --batch-size or add images")

    @property
    def steps_per_epoch(self) -> int:
        return len(self.data) // self.batch_size

    def indices(self, step: int) -> list[int]:
        epoch, k = divmod(step, self.steps_per_epoch)
        if self._order is None or self._order[0] != epoch:
            self._order = (epoch, epoch_order(len(self.data), epoch, self.seed, self.shuffle))
        return self._order[1][k * self.batch_size:(k + 1) * self.batch_size]

    def batch(self, step: int, window: Rect | None) -> Batch:
        idx = self.indices(step)
        y = torch.tensor([self.data.label(i) for i in idx])
        if window is None:
            return None, y
        size = self.data.image_size
        shape = (len(idx), self.data.channels, size, size)
        x = torch.empty(shape, dtype=self.dtype) if self.fill is None else \
            torch.full(shape, self.fill, dtype=self.dtype)
        for k, i in enumerate(idx):
            self.data.read_into(i, window,
                                x[k, :, window.h[0]:window.h[1], window.w[0]:window.w[1]])
        return x, y


@dataclass
class Synthetic:
    """One fixed batch of standard-normal images and uniform labels (``seed``). Row r of
    channel c of sample n comes from its own generator seeded by (seed, n, c, r), so a rank
    builds only its window's rows and every rank agrees on every pixel."""

    shape: tuple[int, int, int, int]
    classes: int
    dtype: torch.dtype = torch.float32
    seed: int = 0
    _cache: dict[Rect | None, Batch] = field(default_factory=dict, repr=False)

    def batch(self, step: int, window: Rect | None) -> Batch:
        if window not in self._cache:
            self._cache.clear()
            self._cache[window] = self._make(window)
        return self._cache[window]

    def _make(self, window: Rect | None) -> Batch:
        n, c, h, w = self.shape
        y = torch.randint(0, self.classes, (n,),
                          generator=torch.Generator().manual_seed(self.seed + 1))
        if window is None:
            return None, y
        x = torch.empty(self.shape, dtype=self.dtype)
        g = torch.Generator()
        for k, ch, r in _rows(n, c, window.h):
            g.manual_seed(((self.seed * 1_000_003 + k) * 1009 + ch) * 100_003 + r)
            x[k, ch, r, window.w[0]:window.w[1]] = \
                torch.randn(w, generator=g, dtype=self.dtype)[window.w[0]:window.w[1]]
        return x, y


def _rows(n: int, c: int, rows: tuple[int, int]) -> Iterator[tuple[int, int, int]]:
    for k in range(n):
        for ch in range(c):
            for r in range(*rows):
                yield k, ch, r


def whole_batch(source: BatchSource, step: int, shape: tuple[int, ...]) -> Batch:
    """The whole batch of ``step`` (every pixel): what one process trains on."""
    return source.batch(step, Rect((0, shape[-2]), (0, shape[-1])))


def describe(source: Any) -> str:
    """One line for the driver's start-up message."""
    if isinstance(source, FolderBatches):
        d = source.data
        return (f"data: {d.root} ({len(d)} images, {len(d.classes)} classes, "
                f"{source.steps_per_epoch} steps per epoch)")
    return "data: synthetic (one fixed batch)"
