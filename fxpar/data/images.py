"""Image readers that read one window of one pyramid level, and only the storage it touches.

A whole-slide image (SVS / NDPI / OME-TIFF, up to 100000² pixels), a satellite scene (GeoTIFF)
or a microscopy volume (OME-Zarr) does not fit in memory, and a rank of a spatial stage needs
only its tile plus a halo (fxpar.data.data.input_window). :func:`open_image` opens one file at
one level as an :class:`ImageReader` whose ``read(window)`` returns that window as
``(C, *window.shape)`` in the stored dtype. What each format reads:

- TIFF family (tiled / striped / pyramidal TIFF, SVS, NDPI, OME-TIFF with sub-IFD pyramids,
  GeoTIFF, BigTIFF) through tifffile: level k is ``series.levels[k]`` of the first series (the
  main image: SVS baseline, OME image 0), read through ``zarr.open(series.aszarr(level=k))``,
  which reads and decodes only the tiles (strips) the window touches. JPEG / JPEG 2000 tiles
  of real slides need imagecodecs.
- Zarr (a ``*.zarr`` folder, v2 or v3): a plain array, or a multiscale group -- OME-Zarr
  ``multiscales`` attributes (v0.4, or v0.5 under ``ome``), else arrays ``0``, ``1``, ... --
  whose level k is its k-th dataset: only the chunks touching the window are read.
- ``.npy``: memory-mapped; only the pages holding the window's rows are touched.
- PNG / JPEG through PIL: the whole file is decoded, then cropped (keep these small).
- OpenSlide formats (``.mrxs``, ``.vms``, ``.vmu``, ``.svslide``; ``.scn`` / ``.bif`` when
  tifffile cannot) through openslide-python when installed; RGBA becomes RGB, fully
  transparent (unscanned) pixels white.
- NIfTI (``.nii``, ``.nii.gz``) through fxpar.data.volumes (see there).

Axes: the result is (C, H, W), or (C, D, H, W) for volumes. TIFF axes come from tifffile
(chunky ``YXS`` is transposed, planar ``SYX`` / ``CYX`` kept); OME-Zarr's from its ``axes``
metadata (c, z, y, x; t must be 1). Without metadata (plain Zarr, ``.npy``) the shape decides:
(H, W); a 3-D array is (C, H, W) when its first dim is <= 4, else (H, W, C) when its last is
<= 4, else (D, H, W); 4-D is (C, D, H, W). ``ndim=3`` (volumes expected) makes any 3-D array
(D, H, W); write OME axes when the shape is ambiguous. Other axes must have size 1.

Accounting: ``reader.stats`` (:class:`ReadStats`) records the windows read and the storage
tiles / chunks (strips, for striped TIFF) they touched; with ``counting=True`` also the bytes,
measured: TIFF and PIL files are read through :class:`CountingFile`, Zarr through a counting
store (headers included; ``stats.header`` is what opening read). A ``.npy`` window counts its
rows' byte runs (a memory map cannot count); OpenSlide hides its I/O (0 bytes, 0 tiles).
:func:`to_tensor` scales integers to [0, 1] by their dtype's maximum (as fxpar.data.data); masks
are class indices and never scaled (fxpar.data.samples).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from fxpar.core.geometry import Rect
from fxpar.data import image_formats
from fxpar.data.errors import DataError
from fxpar.data.image_base import (  # noqa: F401 - re-exported: fxpar.data.images is the API
    _PIL_MODE,
    CountingFile,
    ImageReader,
    ReadStats,
    _fmt,
    to_tensor,
)

TIFF = (".tif", ".tiff", ".svs", ".ndpi", ".btf", ".tf8", ".tf2", ".qptiff", ".gtiff", ".scn",
        ".bif")
OPENSLIDE = (".mrxs", ".vms", ".vmu", ".svslide")
OPENSLIDE_TIFF = (".scn", ".bif")  # TIFF-based: tifffile first, OpenSlide when it cannot
PIL_FORMATS = (".png", ".jpg", ".jpeg")
NPY = (".npy",)
NIFTI = (".nii", ".nii.gz")
ZARR = (".zarr",)
FORMATS = TIFF + OPENSLIDE + PIL_FORMATS + NPY + NIFTI + ZARR
GEO_TAGS = {33550: ("ModelPixelScaleTag", 12), 33922: ("ModelTiepointTag", 12),
            34264: ("ModelTransformationTag", 12), 34735: ("GeoKeyDirectoryTag", 3),
            34736: ("GeoDoubleParamsTag", 12), 34737: ("GeoAsciiParamsTag", 2)}
"""GeoTIFF tags: code -> (tifffile's name, TIFF data type), as :func:`geo_extratags` writes."""
_IMAGES_PIP = "pip install 'fxpar[images]' (tifffile, zarr, imagecodecs)"


# -- axes ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Axes:
    """Role of each stored axis: "c" (channels), "z", "y", "x" (spatial), "1" (size 1, dropped).
    Turns a window into an index of the stored array and the result into (C, *spatial)."""

    roles: tuple[str, ...]

    @property
    def spatial(self) -> tuple[str, ...]:
        return tuple(r for r in self.roles if r in "zyx")

    def shape(self, stored: tuple[int, ...]) -> tuple[int, ...]:
        c = [s for r, s in zip(self.roles, stored, strict=True) if r == "c"]
        return (c[0] if c else 1, *(s for r, s in zip(self.roles, stored, strict=True)
                                    if r in "zyx"))

    def index(self, window: Rect) -> tuple[Any, ...]:
        dims = dict(zip(self.spatial, window.dims, strict=True))
        return tuple(slice(*dims[r]) if r in dims else 0 if r == "1" else slice(None)
                     for r in self.roles)

    def arrange(self, a: np.ndarray) -> np.ndarray:
        kept = [r for r in self.roles if r != "1"]
        if "c" not in kept:
            return a[None]
        return a.transpose([kept.index("c"), *(i for i, r in enumerate(kept) if r != "c")])


def _axes(letters: str, shape: tuple[int, ...], path: Path) -> _Axes:
    """Roles from axis letters (tifffile's ``YXS``, ``CYX``, ``ZYXS``..., or OME names)."""
    letters = letters.upper()
    if "Y" not in letters or "X" not in letters:
        raise DataError(f"{path}: axes {letters} of shape {shape} have no Y and X: not an image")
    roles = []
    for a, n in zip(letters, shape, strict=True):
        roles.append({"Y": "y", "X": "x"}.get(a, "1" if n == 1 else
                                              "c" if a in "SC" else "z" if a in "ZI" else "?"))
    bad = [f"{a} ({n})" for a, n, r in zip(letters, shape, roles, strict=True) if r == "?"]
    if bad or roles.count("c") > 1 or roles.count("z") > 1:
        raise DataError(f"{path}: axes {letters} of shape {shape}: fxpar reads one image "
                        f"(channels, [depth,] rows, cols) and cannot tell which of "
                        f"{', '.join(bad) or letters} to take: save that one image alone")
    return _Axes(tuple(roles))


def _guess(shape: tuple[int, ...], ndim: int | None, path: Path) -> _Axes:
    """Axes of an array without metadata (see the module doc)."""
    n = len(shape)
    letters = {2: "YX", 4: "CZYX", 5: "TCZYX"}.get(n, "")
    if n == 3:
        letters = "ZYX" if ndim == 3 else "CYX" if shape[0] <= 4 else \
            "YXC" if shape[-1] <= 4 else "ZYX"
    if not letters:
        raise DataError(f"{path}: array of shape {shape}; expected (H, W), (C, H, W), "
                        f"(H, W, C) with C <= 4, (D, H, W) or (C, D, H, W)")
    return _axes(letters, shape, path)


# -- readers ------------------------------------------------------------------------------------
def _touched(shape: tuple[int, ...], chunks: tuple[int, ...], index: tuple[Any, ...]) -> int:
    """How many chunks of an array the index (ints and slices) touches."""
    n = 1
    for size, chunk, i in zip(shape, chunks, index, strict=True):
        lo, hi = (i, i + 1) if isinstance(i, int) else (i.start or 0, size if i.stop is None
                                                        else i.stop)
        n *= (hi - 1) // chunk - lo // chunk + 1 if hi > lo else 0
    return n


class _ZarrArrayReader(ImageReader):
    """Reads through a zarr array (a Zarr file, or a TIFF level through tifffile's store)."""

    _array: Any
    _axes: _Axes

    def _read(self, window: Rect) -> np.ndarray:
        index = self._axes.index(window)
        try:
            a = np.asarray(self._array[index])
        except (ValueError, RuntimeError, OSError, KeyError) as e:
            hint = f": {_IMAGES_PIP}" if "imagecodecs" in str(e) else ": replace the file"
            raise DataError(f"{self.path}: cannot read window {window} at level "
                            f"{self.level} ({type(e).__name__}: {e}){hint}") from None
        self.stats.tiles += _touched(self._array.shape, self._array.chunks, index)
        return self._axes.arrange(a)


class TiffReader(_ZarrArrayReader):
    """A TIFF-family file through tifffile (see the module doc)."""

    def __init__(self, path: Path, level: int, counting: bool, ndim: int | None) -> None:
        tifffile, zarr = _module("tifffile"), _module("zarr")
        self._fh = CountingFile(path) if counting else None
        self._tif: Any = None
        try:
            self._open(path, level, tifffile, zarr)
        except BaseException:
            self.close()  # a level out of range, odd axes ...: no file left open
            raise

    def _open(self, path: Path, level: int, tifffile: Any, zarr: Any) -> None:
        try:
            self._tif = tifffile.TiffFile(self._fh if self._fh is not None else path)
            series = self._tif.series[0]
            levels = series.levels
        except (tifffile.TiffFileError, OSError, ValueError, IndexError, KeyError) as e:
            raise DataError(f"{path}: not a readable TIFF ({type(e).__name__}: {e})") from None
        axes = [_axes(s.axes, tuple(s.shape), path) for s in levels]
        page = self._tif.pages.first
        geo = {name: page.tags[code].value for code, (name, _) in GEO_TAGS.items()
               if code in page.tags} or None
        super().__init__(path, level, tuple(a.shape(tuple(s.shape))[1:]
                                            for a, s in zip(axes, levels, strict=True)),
                         axes[0].shape(tuple(series.shape))[0], series.dtype, geo)
        self._axes, self._counter = axes[level], self._fh
        self._array = zarr.open(series.aszarr(level=level), mode="r")
        self._opened()

    def close(self) -> None:
        if self._tif is not None:
            self._tif.close()
        if self._fh is not None:
            self._fh.close()


class ZarrReader(_ZarrArrayReader):
    """A Zarr array or multiscale group (see the module doc)."""

    def __init__(self, path: Path, level: int, counting: bool, ndim: int | None) -> None:
        zarr = _module("zarr")
        store: Any = zarr.storage.LocalStore(path, read_only=True)
        if counting:
            store = _counting_store(zarr)(store)
        try:
            node = zarr.open(store, mode="r")
        except (FileNotFoundError, ValueError, KeyError, TypeError) as e:
            raise DataError(f"{path}: not a readable Zarr array or group ({e})") from None
        arrays, letters = _datasets(node, path)
        axes = [_axes(letters, a.shape, path) if letters else _guess(a.shape, ndim, path)
                for a in arrays]
        super().__init__(path, level, tuple(ax.shape(a.shape)[1:]
                                            for ax, a in zip(axes, arrays, strict=True)),
                         axes[0].shape(arrays[0].shape)[0], arrays[0].dtype)
        self._array, self._axes = arrays[level], axes[level]
        self._counter = store if counting else None
        self._opened()


def _datasets(node: Any, path: Path) -> tuple[list[Any], str]:
    """(the levels' arrays, axis letters from OME metadata or "") of an opened Zarr node."""
    if hasattr(node, "shape"):
        return [node], ""
    attrs = dict(node.attrs)
    multiscales = attrs.get("multiscales") or attrs.get("ome", {}).get("multiscales")
    if multiscales:
        ms = multiscales[0]
        names = [a["name"] if isinstance(a, dict) else a for a in ms.get("axes", [])]
        paths = [d["path"] for d in ms["datasets"]]
    else:
        names, paths = [], []
        while str(len(paths)) in node:
            paths.append(str(len(paths)))
    if not paths:
        raise DataError(f"{path}: a Zarr group with no OME-Zarr 'multiscales' attributes and "
                        f"no arrays named 0, 1, ...: open the array itself ({path}/<name>)")
    return [node[p] for p in paths], "".join(n[:1] for n in names)


def _counting_store(zarr: Any) -> type:
    """A zarr store wrapper counting the bytes it returns (defined lazily: zarr is optional)."""

    class CountingStore(zarr.storage.WrapperStore):
        count = 0

        async def get(self, key: str, prototype: Any, byte_range: Any = None) -> Any:
            buf = await self._store.get(key, prototype, byte_range)
            self.count += 0 if buf is None else len(buf)
            return buf

        async def get_partial_values(self, prototype: Any, key_ranges: Any) -> Any:
            out = await self._store.get_partial_values(prototype, key_ranges)
            self.count += sum(len(b) for b in out if b is not None)
            return out

    return CountingStore


class NpyReader(ImageReader):
    """A memory-mapped ``.npy`` array (one level)."""

    def __init__(self, path: Path, level: int, counting: bool, ndim: int | None) -> None:
        try:
            self._a = np.load(path, mmap_mode="r")
        except (ValueError, OSError, EOFError) as e:
            raise DataError(f"{path}: not a readable .npy array ({e})") from None
        self._axes = _guess(self._a.shape, ndim, path)
        shape = self._axes.shape(self._a.shape)
        super().__init__(path, level, (shape[1:],), shape[0], self._a.dtype)
        self._counting = counting

    def _read(self, window: Rect) -> np.ndarray:
        index = self._axes.index(window)
        a = np.array(self._a[index])
        runs = a.size // a.shape[-1] if a.size else 0  # C order: one run per last-axis row
        self.stats.tiles += runs
        if self._counting:
            self.stats.bytes += a.nbytes
        return self._axes.arrange(a)

    def close(self) -> None:
        self._a = None  # type: ignore[assignment]  # drops the mapping


# -- opening ------------------------------------------------------------------------------------
def open_image(path: str | Path, level: int = 0, *, counting: bool = False,
               ndim: int | None = None, channels: int | None = None,
               mask: bool = False) -> ImageReader:
    """Open ``path`` at pyramid ``level`` (0: full resolution). ``counting``: count the bytes
    read (:class:`ReadStats`). ``ndim``: 2 (images) or 3 (volumes) when the caller knows,
    to settle ambiguous array shapes (module doc). ``channels``: PNG / JPEG are converted to
    that many channels (other formats are returned as stored). ``mask``: the file holds class
    indices (a palette PNG's indices are kept). Raises DataError saying what to change."""
    path = Path(path)
    name = path.name.lower()
    if not path.exists():
        raise DataError(f"{path}: no such file (check the path; paths in a CSV are relative "
                        f"to the CSV's folder)")
    if name.endswith(ZARR) or (path.is_dir() and any(
            (path / m).exists() for m in ("zarr.json", ".zarray", ".zgroup"))):
        return ZarrReader(path, level, counting, ndim)
    suffix = ".nii.gz" if name.endswith(".nii.gz") else path.suffix.lower()
    if suffix in OPENSLIDE_TIFF:
        try:
            return TiffReader(path, level, counting, ndim)
        except DataError as e:
            if "no pyramid level" in str(e):
                raise
            return image_formats.OpenSlideReader(path, level)
    if suffix in TIFF:
        return TiffReader(path, level, counting, ndim)
    if suffix in OPENSLIDE:
        return image_formats.OpenSlideReader(path, level)
    if suffix in NPY:
        return NpyReader(path, level, counting, ndim)
    if suffix in PIL_FORMATS:
        return image_formats.PilReader(path, level, counting, channels, mask)
    if suffix in NIFTI:
        return image_formats.NiftiReader(path, level, ndim)
    raise DataError(f"{path}: unknown image format {suffix or '(no extension)'!r}: give one of "
                    f"{', '.join(FORMATS)} (or a Zarr folder)")


def _module(name: str) -> Any:
    """tifffile / zarr, imported when first needed: they are optional (fxpar[images])."""
    try:
        return __import__(name)
    except ImportError:
        raise DataError(f"reading tiled / pyramidal images needs {name}: "
                        f"{_IMAGES_PIP}") from None


def geo_scaled(geo: dict[str, Any], scale: tuple[Any, ...]) -> dict[str, Any]:
    """``geo`` for an image with ``scale`` cells per cell of the grid it describes, per
    spatial dim (H, W): ModelPixelScale (and ModelTransformation) 1 / scale times as large (a
    class map at 1/32, pyramid level k at 1 / its downsampling); the other tags as they are."""
    sy, sx = (1 / float(s) for s in scale[-2:])
    out = dict(geo)
    if "ModelPixelScaleTag" in out:
        v = out["ModelPixelScaleTag"]
        out["ModelPixelScaleTag"] = (v[0] * sx, v[1] * sy, *v[2:])
    if "ModelTransformationTag" in out:
        out["ModelTransformationTag"] = tuple(
            v * (sx if i % 4 == 0 else sy if i % 4 == 1 else 1)
            for i, v in enumerate(out["ModelTransformationTag"]))
    return out


def geo_extratags(geo: dict[str, Any] | None, scale: tuple[Any, ...] | None = None
                  ) -> list[tuple[int, int, int, Any, bool]]:
    """``geo`` (:attr:`ImageReader.geo`, tag name -> value) as tifffile ``extratags`` for a
    writer that keeps the georeference, rescaled by :func:`geo_scaled` when ``scale`` is given.
    The tags describe level 0: at level k, scale by 1 / the level's downsampling."""
    if geo and scale is not None:
        geo = geo_scaled(geo, scale)
    out = []
    for code, (name, dtype) in GEO_TAGS.items():
        if geo and name in geo:
            value = geo[name]
            count = len(value.encode()) + 1 if isinstance(value, str) else \
                len(value) if hasattr(value, "__len__") else 1
            out.append((code, dtype, count, value, True))
    return out
