"""Training data for ``fxpar-run``: each rank reads only the part of each image (or volume) it
computes on.

A spatial stage's tile needs its tile of the image plus a halo; a later stage never reads the
image at all. :func:`input_window` gives that box (rows x columns of an image, depth x rows x
columns of a volume), which the compiler worked out for every rank
(fxpar.compiler.windows; saved in program.json), and the sources below fill only that window of
a full-shape ``torch.empty`` batch: the pages outside it are never touched, so the operating
system never backs them with memory (for a batch large enough to be mapped, not pooled).
``RankProgram.train_step`` reads nothing else (a test fills the rest with NaN and still matches
one process).

The same code serves 2-D images, batches (N, C, H, W), and 3-D volumes (CT / MRI, microscopy,
cosmology), batches (N, C, D, H, W): sizes are tuples of spatial sizes, (H, W) or (D, H, W); an
int ``image_size`` means a square image (or, with ``ndim=3``, a cube).

Sources, both indexed by step (so a resumed run sees the same batches):

- :class:`Synthetic`: one fixed batch (``--seed``), a deterministic function of (seed, sample,
  channel, row) for images and of (seed, sample, channel, depth, row) for volumes, so a rank
  generates only its window's rows;
- :class:`FolderBatches` over an :class:`ImageFolder` (``--data DIR``): DIR/<class>/<file>,
  classes sorted are the labels (like torchvision's ImageFolder); the order is shuffled each
  epoch with a seed every rank shares; the last partial batch of an epoch is dropped. The
  files are images or volumes, all of one size (checked from the headers before anything
  else happens).

How much of a file a window read touches depends on the format, honestly:

- ``.npy`` arrays, (C, H, W) or (H, W) for images, (C, D, H, W) or (D, H, W) for volumes:
  memory-mapped (``np.load(mmap_mode="r")``); only the pages holding the window's rows (their
  window columns) are read, straight into the batch;
- NIfTI volumes ``.nii`` / ``.nii.gz`` through nibabel (``pip install fxpar[volumes]``; see
  fxpar.data.volumes for the axis mapping: D = z, H = y, W = x of the voxel array as stored,
  channels from a 4th (or NIfTI's 5th, vector) dim). The window is read with
  ``img.dataobj[window]``: for an uncompressed ``.nii`` nibabel seeks to and reads only the
  byte runs of the window (runs closer than a few hundred bytes are read as one); a
  ``.nii.gz`` cannot seek, so gzip decompresses the file from its start up to the window's
  last byte and drops what is outside the window: memory stays at the window, but the time is
  that of decompressing up to it (for large volumes use ``.nii`` or ``.npy``). Values are the
  stored values with the header's scaling (``scl_slope`` / ``scl_inter``) applied, as floats:
  NIfTI intensities are physical quantities (Hounsfield units, ...), not scaled further;
- PNG / JPEG / TIFF images through PIL: PIL decodes the whole file, then the window is cropped
  and the rest dropped (the batch still holds only the window). Reading a tile of a tiled TIFF,
  a whole-slide image or a multi-page TIFF volume without decoding the rest (tifffile /
  openslide) is future work.

Integer images (uint8, uint16, ...) in ``.npy`` and PIL files are scaled to [0, 1] by their
dtype's maximum, floating point arrays are used as they are.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch

from fxpar.core.geometry import Rect
from fxpar.data import volumes
from fxpar.data.errors import DataError as DataError  # re-exported: users catch it here
from fxpar.program.compiled import input_window_of

if TYPE_CHECKING:
    from fxpar.program.program import RankProgram

Batch = tuple[torch.Tensor | None, torch.Tensor]
NPY = (".npy",)
PIL_FORMATS = (".png", ".jpg", ".jpeg", ".tif", ".tiff")
NIFTI = (".nii", ".nii.gz")
_PIL_MODES = {1: "L", 3: "RGB"}
_NUMPY_VIEWABLE = (torch.float16, torch.float32, torch.float64)
_KIND = {2: "image", 3: "volume"}
_AXES = {2: "HxW", 3: "DxHxW"}



# -- sizes --------------------------------------------------------------------------------------
def spatial_size(size: int | tuple[int, ...] | list[int], ndim: int | None = None
                 ) -> tuple[int, ...]:
    """``size`` as a tuple of spatial sizes: an int is a square image ((n, n)), or a cube
    ((n, n, n)) with ``ndim=3``; a tuple (H, W) or (D, H, W) is returned as it is (``ndim``,
    when given, must match). Raises DataError."""
    if isinstance(size, (int, np.integer)) and not isinstance(size, bool):
        out = (int(size),) * (2 if ndim is None else ndim)
    else:
        try:
            out = tuple(int(s) for s in size)  # type: ignore[union-attr]
        except (TypeError, ValueError):
            raise DataError(f"image size {size!r}: give an int (square image) or the spatial "
                            f"sizes (H, W) or (D, H, W)") from None
        if ndim is not None and len(out) != ndim:
            raise DataError(f"image size {size!r} has {len(out)} dims but {ndim} were asked "
                            f"for: give {_AXES.get(ndim, f'{ndim} sizes')}")
    if not 1 <= len(out) <= 3 or any(s < 1 for s in out):
        raise DataError(f"image size {size!r}: give 1 to 3 spatial sizes >= 1, e.g. 256 "
                        f"(square image), 256x512 (HxW) or 64x128x128 (DxHxW)")
    return out


def parse_size(text: str, flag: str = "--image-size",
               examples: tuple[str, ...] = ("256", "256x512", "32x64x64")) -> tuple[int, ...]:
    """``"N"``, ``"HxW"`` or ``"DxHxW"`` as a tuple of ints (``(N,)`` for ``"N"``). Raises
    DataError naming ``flag``."""
    parts = text.strip().lower().replace("×", "x").split("x")
    try:
        out = tuple(int(p) for p in parts)
    except ValueError:
        out = ()
    if not out or len(out) > 3 or any(v < 1 for v in out):
        shown = ", ".join(f"{flag} {e}" for e in examples)
        raise DataError(f"{flag} {text}: give N, HxW or DxHxW with integers >= 1 "
                        f"(e.g. {shown})")
    return out


def _fmt(size: tuple[int, ...]) -> str:
    return "x".join(map(str, size))


# -- what a rank reads --------------------------------------------------------------------------
def input_window(rp: RankProgram, image: tuple[int, ...] | None = None) -> Rect | None:
    """The bounding box of what ``rp``'s stage modules read from the model input, as the
    compiler recorded it for its rank (``Program.input_windows``): its tiles' windows (halo
    included, clipped to the image), the whole image where a stage uses the input otherwise (a
    non-spatial first stage); None when no stage of the rank reads the input.

    A program that records no windows (an input that is not one image batch, or a folder saved
    before fxpar recorded them): the whole image or volume, of spatial size ``image`` ((H, W)
    or (D, H, W)), where a stage of the rank reads the input (see
    ``RankProgram.input_window``, which this is)."""
    return input_window_of(rp.program, rp.stages, rp.rank, image)


def _slices(window: Rect) -> tuple[slice, ...]:
    return tuple(slice(a, b) for a, b in window.dims)


# -- an image folder ----------------------------------------------------------------------------
def _scale(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    t = torch.from_numpy(np.ascontiguousarray(a))
    if np.issubdtype(a.dtype, np.integer):
        return t.to(dtype) / float(np.iinfo(a.dtype).max)
    return t.to(dtype)


def is_nifti(path: Path) -> bool:
    return path.name.lower().endswith(NIFTI)


def _readable(path: Path) -> bool:
    return path.suffix.lower() in NPY + PIL_FORMATS or is_nifti(path)


@dataclass
class ImageFolder:
    """``root/<class>/<file>`` of images or volumes (see the module doc). Build with
    :meth:`scan`, which checks every file's size and channels from its header before anything
    else happens.

    image_size: the spatial size every file must have: (H, W), (D, H, W), or an int for a
    square image (a cube when ``ndim=3``)."""

    root: Path
    image_size: int | tuple[int, ...]
    channels: int
    classes: list[str]
    samples: list[tuple[Path, int]]
    reads: list[tuple[str, Rect]] | None = None
    """When a list, every :meth:`read` appends (file relative to root, window read)."""
    ndim: int | None = None
    """Spatial dims: 2 (images) or 3 (volumes); None: from ``image_size`` (2 for an int)."""
    size: tuple[int, ...] = field(init=False, repr=False, default=())
    """The spatial size every file has, as a tuple: (H, W) or (D, H, W)."""

    def __post_init__(self) -> None:
        self.size = spatial_size(self.image_size, self.ndim)
        self.ndim = len(self.size)

    @classmethod
    def scan(cls, root: str | Path, image_size: int | tuple[int, ...], channels: int = 3,
             ndim: int | None = None) -> ImageFolder:
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
                if f.is_file() and _readable(f):
                    samples.append((f, label))
        if not samples:
            raise DataError(f"--data {root}: the class folders {classes} hold no images "
                            f"(.npy, .png, .jpg, .jpeg, .tif, .tiff) or volumes (.npy, .nii, "
                            f".nii.gz)")
        data = cls(root, image_size, channels, classes, samples, ndim=ndim)
        for path, _ in samples:
            data._check(path)
        return data

    def __len__(self) -> int:
        return len(self.samples)

    def label(self, i: int) -> int:
        return self.samples[i][1]

    @property
    def kind(self) -> str:
        """"image" or "volume"."""
        return _KIND.get(len(self.size), f"{len(self.size)}-D array")

    def _check(self, path: Path) -> None:
        size, channels = self._header(path)
        want = self.size
        axes = _AXES.get(len(want), "")
        if size != want:
            given = self.image_size if isinstance(self.image_size, int) else _fmt(want)
            raise DataError(f"{path}: {self.kind} is {_fmt(size)} ({axes}) but --image-size "
                            f"is {given}: every {self.kind} must be {_fmt(want)} (resize or "
                            f"crop the data, or change --image-size)")
        if channels != self.channels and not (path.suffix.lower() in PIL_FORMATS
                                              and self.channels in _PIL_MODES):
            raise DataError(f"{path}: {self.kind} has {channels} channel(s) but the model "
                            f"takes {self.channels} (--channels)")

    def _header(self, path: Path) -> tuple[tuple[int, ...], int]:
        """(spatial size, channels) from the file's header, without reading the pixels."""
        n = len(self.size)
        if path.suffix.lower() in NPY:
            try:
                a = np.load(path, mmap_mode="r")
            except (ValueError, OSError, EOFError) as e:
                raise DataError(f"{path}: not a readable .npy array ({e})") from None
            if a.ndim == n:
                return tuple(a.shape), 1
            if a.ndim == n + 1:
                return tuple(a.shape[1:]), a.shape[0]
            want = "(C, H, W) or (H, W)" if n == 2 else "(C, D, H, W) or (D, H, W)"
            hint = " (a volume? give --image-size DxHxW)" if n == 2 and a.ndim == 4 else \
                " (an image? give --image-size HxW)" if n == 3 and a.ndim == 2 else ""
            raise DataError(f"{path}: array of shape {a.shape}; expected {want}{hint}")
        if is_nifti(path):

            return volumes.nifti_header(path, n)
        if n != 2:
            raise DataError(f"{path}: a {path.suffix} file is a 2-D image but --image-size "
                            f"{_fmt(self.size)} asks for volumes: store volumes as .npy "
                            f"(C, D, H, W) or NIfTI (.nii, .nii.gz)")
        from PIL import Image, UnidentifiedImageError

        try:
            with Image.open(path) as im:
                return (im.height, im.width), len(im.getbands())
        except (UnidentifiedImageError, OSError) as e:
            raise DataError(f"{path}: not a readable image ({e})") from None

    def read(self, i: int, window: Rect, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Sample ``i``'s ``window`` (global rows x columns, or depth x rows x columns) as a
        new (C, *window.shape) tensor."""
        out = torch.empty((self.channels, *window.shape), dtype=dtype)
        self.read_into(i, window, out)
        return out

    def read_into(self, i: int, window: Rect, out: torch.Tensor) -> None:
        """Write sample ``i``'s ``window`` into ``out`` ((C, *window.shape); may be a view of a
        batch). A float .npy goes from the mapped file straight into ``out``: no whole-image
        buffer, no second copy of the window."""
        if window.ndim != len(self.size):
            raise ValueError(f"a {window.ndim}-D window ({window}) of {self.kind}s of size "
                             f"{_fmt(self.size)}: give one interval per spatial dim")
        path = self.samples[i][0]
        if path.suffix.lower() in NPY:
            a = np.load(path, mmap_mode="r")
            part = a[_slices(window)][None] if a.ndim == window.ndim else \
                a[(slice(None), *_slices(window))]
            _into(out, part)
            del a
        elif is_nifti(path):

            _into(out, volumes.nifti_window(path, window, self.channels), scale=False)
        else:
            from PIL import Image

            (h0, h1), (w0, w1) = window.h, window.w
            with Image.open(path) as im:  # decodes the whole file (see the module doc)
                if len(im.getbands()) != self.channels or im.mode == "P":
                    im = im.convert(_PIL_MODES[self.channels])
                pixels = np.array(im.crop((w0, h0, w1, h1)))
            out.copy_(_scale(pixels[None] if pixels.ndim == 2 else pixels.transpose(2, 0, 1),
                             out.dtype))
        if self.reads is not None:
            self.reads.append((str(path.relative_to(self.root)), window))


def _into(out: torch.Tensor, part: np.ndarray, scale: bool = True) -> None:
    """Copy the array (view) ``part`` into ``out``: straight from the source (numpy casts as
    it copies), except integers when ``scale``: those are scaled by their dtype's maximum."""
    if out.dtype in _NUMPY_VIEWABLE and (not scale or np.issubdtype(part.dtype, np.floating)):
        out.numpy()[...] = part
    elif scale:
        out.copy_(_scale(np.array(part), out.dtype))
    else:
        out.copy_(torch.from_numpy(np.asarray(part, dtype=np.float64)).to(out.dtype))


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
class Epochs:
    """Step -> sample indices of a set of ``n`` samples: epoch = step // steps_per_epoch, the
    order of each epoch a permutation seeded by (seed, epoch) (:func:`epoch_order`), the last
    partial batch dropped. The one rule of FolderBatches and fxpar.data.samples.SampleBatches."""

    n: int
    batch_size: int
    seed: int = 0
    shuffle: bool = True
    _order: tuple[int, list[int]] | None = field(default=None, repr=False)

    @property
    def steps_per_epoch(self) -> int:
        return self.n // self.batch_size

    def indices(self, step: int) -> list[int]:
        epoch, k = divmod(step, self.steps_per_epoch)
        if self._order is None or self._order[0] != epoch:
            self._order = (epoch, epoch_order(self.n, epoch, self.seed, self.shuffle))
        return self._order[1][k * self.batch_size:(k + 1) * self.batch_size]


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
    _epochs: Epochs = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if len(self.data) < self.batch_size:
            raise DataError(f"--data {self.data.root} has {len(self.data)} {self.data.kind}s, "
                            f"fewer than one batch of {self.batch_size}: lower --batch-size or "
                            f"add {self.data.kind}s")
        self._epochs = Epochs(len(self.data), self.batch_size, self.seed, self.shuffle)

    @property
    def steps_per_epoch(self) -> int:
        return self._epochs.steps_per_epoch

    def indices(self, step: int) -> list[int]:
        return self._epochs.indices(step)

    def batch(self, step: int, window: Rect | None) -> Batch:
        idx = self.indices(step)
        y = torch.tensor([self.data.label(i) for i in idx])
        if window is None:
            return None, y
        shape = (len(idx), self.data.channels, *self.data.size)
        x = torch.empty(shape, dtype=self.dtype) if self.fill is None else \
            torch.full(shape, self.fill, dtype=self.dtype)
        where = _slices(window)
        for k, i in enumerate(idx):
            self.data.read_into(i, window, x[(k, slice(None), *where)])
        return x, y


@dataclass
class Synthetic:
    """One fixed batch of standard-normal images (or volumes) and uniform labels (``seed``).
    ``shape`` is (N, C, H, W) or (N, C, D, H, W). Row r of channel c of sample n comes from its
    own generator seeded by (seed, n, c, r) -- (seed, n, c, depth, r) in a volume -- so a rank
    builds only its window's rows and every rank agrees on every voxel."""

    shape: tuple[int, ...]
    classes: int
    dtype: torch.dtype = torch.float32
    seed: int = 0
    masks: tuple[int, ...] | None = None
    """For a segmentation model, the output's spatial size: the labels are then one class per
    pixel, (N, *masks), whole on every rank (synthetic data is for small runs)."""
    _cache: dict[Rect | None, Batch] = field(default_factory=dict, repr=False)

    def batch(self, step: int, window: Rect | None) -> Batch:
        if window not in self._cache:
            self._cache.clear()
            self._cache[window] = self._make(window)
        return self._cache[window]

    def _make(self, window: Rect | None) -> Batch:
        n, c, *size = self.shape
        y = torch.randint(0, self.classes, (n, *(self.masks or ())),
                          generator=torch.Generator().manual_seed(self.seed + 1))
        if window is None:
            return None, y
        if window.ndim != len(size):
            raise ValueError(f"a {window.ndim}-D window ({window}) of a synthetic batch of "
                             f"shape {tuple(self.shape)}: give one interval per spatial dim")
        x = torch.empty(self.shape, dtype=self.dtype)
        w, (w0, w1) = size[-1], window.w
        g = torch.Generator()
        for k, ch, lead in _rows(n, c, window.dims[:-1]):
            g.manual_seed(_row_seed(self.seed, k, ch, lead))
            x[(k, ch, *lead, slice(w0, w1))] = \
                torch.randn(w, generator=g, dtype=self.dtype)[w0:w1]
        return x, y


def _row_seed(seed: int, k: int, ch: int, lead: tuple[int, ...]) -> int:
    """The seed of one row: (seed, sample, channel, row) for an image (as fxpar always did),
    (seed, sample, channel, depth, row) for a volume (reduced to 64 bits)."""
    s = (seed * 1_000_003 + k) * 1009 + ch
    for i in lead:
        s = s * 100_003 + i
    return s if len(lead) <= 1 else s % 2**64


def _rows(n: int, c: int, lead: tuple[tuple[int, int], ...]
          ) -> Iterator[tuple[int, int, tuple[int, ...]]]:
    """(sample, channel, indices along every spatial dim but the last) of each row."""
    for k in range(n):
        for ch in range(c):
            for idx in itertools.product(*(range(a, b) for a, b in lead)):
                yield k, ch, idx


def whole_batch(source: BatchSource, step: int, shape: tuple[int, ...]) -> Batch:
    """The whole batch of ``step`` (every pixel or voxel): what one process trains on. shape:
    (N, C, H, W) or (N, C, D, H, W)."""
    return source.batch(step, Rect.whole(tuple(shape[2:])))


def describe(source: Any) -> str:
    """One line for the driver's start-up message (a source's own ``describe()`` when it has
    one: fxpar.data.samples)."""
    if callable(getattr(source, "describe", None)):
        return source.describe()
    if isinstance(source, FolderBatches):
        d = source.data
        return (f"data: {d.root} ({len(d)} {d.kind}s, {len(d.classes)} classes, "
                f"{source.steps_per_epoch} steps per epoch)")
    return "data: synthetic (one fixed batch)"
