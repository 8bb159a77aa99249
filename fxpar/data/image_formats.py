"""Readers of the formats beyond tiled TIFF, Zarr and ``.npy`` (fxpar.data.images): PNG / JPEG
through PIL (decoded whole, then cropped), OpenSlide formats through openslide-python, NIfTI
through fxpar.data.volumes. :func:`fxpar.data.images.open_image` chooses them by extension.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from fxpar.core.geometry import Rect
from fxpar.data.errors import DataError
from fxpar.data.image_base import _PIL_MODE, CountingFile, ImageReader


class PilReader(ImageReader):
    """PNG / JPEG through PIL: the whole file is decoded, then cropped. ``channels`` converts
    (to L, RGB or RGBA, as fxpar.data.data does); ``mask`` keeps a palette image's indices."""

    def __init__(self, path: Path, level: int, counting: bool, channels: int | None,
                 mask: bool) -> None:
        from PIL import Image, UnidentifiedImageError

        f = CountingFile(path) if counting else path
        try:
            with Image.open(f) as im:
                self._mode = im.mode if mask else _pil_mode(im.mode, len(im.getbands()),
                                                            channels)
                probe = np.asarray(Image.new(self._mode, (1, 1)))
                size = im.size
        except (UnidentifiedImageError, OSError, Image.DecompressionBombError) as e:
            raise DataError(f"{path}: not a readable image ({e}); store large images as "
                            f"tiled TIFF or Zarr") from None
        finally:
            if isinstance(f, CountingFile):
                f.close()
        super().__init__(path, level, ((size[1], size[0]),),
                         probe.shape[2] if probe.ndim == 3 else 1, probe.dtype)
        self._counting = counting
        if isinstance(f, CountingFile):
            self.stats.bytes = self.stats.header = f.count

    def _read(self, window: Rect) -> np.ndarray:
        from PIL import Image

        (h0, h1), (w0, w1) = window.h, window.w
        f = CountingFile(self.path) if self._counting else self.path
        try:
            with Image.open(f) as im:  # decodes the whole file (see the module doc)
                if im.mode != self._mode:
                    im = im.convert(self._mode)
                a = np.asarray(im.crop((w0, h0, w1, h1)))
        finally:
            if isinstance(f, CountingFile):
                self.stats.bytes += f.count
                f.close()
        self.stats.tiles += 1
        return a[None] if a.ndim == 2 else a.transpose(2, 0, 1)


def _pil_mode(mode: str, bands: int, channels: int | None) -> str:
    if channels is not None and (channels != bands or mode in ("P", "1")) \
            and channels in _PIL_MODE:
        return _PIL_MODE[channels]
    return {"P": "RGBA" if bands == 4 else "RGB", "1": "L", "LA": "RGBA"}.get(mode, mode)


class OpenSlideReader(ImageReader):
    """An OpenSlide format through openslide-python (see the module doc)."""

    def __init__(self, path: Path, level: int) -> None:
        try:
            import openslide
        except ImportError:
            raise DataError(f"{path}: {path.suffix} slides are read through OpenSlide: pip "
                            f"install openslide-python openslide-bin (or convert the slide "
                            f"to a pyramidal OME-TIFF)") from None
        try:
            self._slide = openslide.OpenSlide(str(path))
        except Exception as e:  # noqa: BLE001 (OpenSlideError and friends)
            raise DataError(f"{path}: OpenSlide cannot read it ({e})") from None
        levels = tuple((int(h), int(w)) for w, h in self._slide.level_dimensions)
        super().__init__(path, level, levels, 3, np.dtype(np.uint8))
        self._down = float(self._slide.level_downsamples[level])

    def _read(self, window: Rect) -> np.ndarray:
        (h0, h1), (w0, w1) = window.h, window.w
        origin = (round(w0 * self._down), round(h0 * self._down))  # level-0 coordinates
        rgba = np.asarray(self._slide.read_region(origin, self.level, (w1 - w0, h1 - h0)))
        rgb = np.where(rgba[..., 3:] == 0, np.uint8(255), rgba[..., :3])
        return rgb.transpose(2, 0, 1)

    def close(self) -> None:
        self._slide.close()


class NiftiReader(ImageReader):
    """A NIfTI volume (or 2-D image) through fxpar.data.volumes; values as float64."""

    def __init__(self, path: Path, level: int, ndim: int | None) -> None:
        from fxpar.data import volumes

        self._volumes = volumes
        size, channels = volumes.nifti_header(path, ndim or 3)
        super().__init__(path, level, (size,), channels, np.dtype(np.float64))

    def _read(self, window: Rect) -> np.ndarray:
        self.stats.tiles += 1
        return self._volumes.nifti_window(self.path, window, self.shape[0])
