"""Where ``fxpar-predict`` writes: a Zarr array filled region by region, resumable, and a tiled
TIFF made from it at the end.

The output never exists whole in memory. Its chunks are the regions' output boxes
(fxpar.data.regions), so each region writes whole chunks and nothing is read back. After each
region the store's attributes record it as done (key ``fxpar_predict``: the run's settings and
the done regions); a run that is interrupted and started again with the same settings skips
them (a region written but not yet recorded is computed again: the same values). A store from
other settings is refused, so a resumed run never mixes two models' outputs.

A ``.tif`` / ``.tiff`` output is filled the same way in ``OUT.partial.zarr`` next to it, then
written as a tiled, deflate-compressed TIFF chunk by chunk (tifffile takes an iterator of
tiles), with the input's GeoTIFF tags when it had any (the pixel scale adjusted to the output's
resolution), and the partial store removed.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np

from fxpar.core.geometry import Rect
from fxpar.data.errors import DataError
from fxpar.data.images import geo_extratags

KEY = "fxpar_predict"
TIFF = (".tif", ".tiff")
TIFF_TILE = 256


def _zarr() -> Any:
    try:
        import zarr
    except ImportError:
        raise DataError("writing predictions needs zarr: pip install 'fxpar[images]'") from None
    return zarr


class PredictionStore:
    """The output of one prediction run: (C, *spatial) of ``dtype``, chunked by region.

    path: ``OUT.zarr`` (a Zarr v3 array) or ``OUT.tif`` (a Zarr array beside it first, see the
    module doc). settings: what must match for a resumed run to continue (JSON values)."""

    def __init__(self, path: str | Path, shape: tuple[int, ...], dtype: np.dtype | str,
                 chunks: tuple[int, ...], settings: dict[str, Any], overwrite: bool = False
                 ) -> None:
        zarr = _zarr()
        self.path = Path(path)
        self.tiff = self.path.suffix.lower() in TIFF
        self.store = self.path.with_name(self.path.name + ".partial.zarr") if self.tiff \
            else self.path
        self.settings = json.loads(json.dumps(settings))
        self.done: set[tuple[int, ...]] = set()
        if self.tiff and self.path.exists() and not overwrite:
            raise DataError(f"{self.path} exists: remove it or pass --overwrite")
        if self.store.exists() and not overwrite:
            self.array = zarr.open_array(str(self.store), mode="r+")
            found = dict(self.array.attrs).get(KEY)
            if found is None:
                raise DataError(f"{self.store} exists but was not written by fxpar-predict: "
                                f"choose another output or pass --overwrite")
            if found["settings"] != self.settings or tuple(self.array.shape) != tuple(shape):
                diff = sorted(k for k in set(found["settings"]) | set(self.settings)
                              if found["settings"].get(k) != self.settings.get(k))
                raise DataError(f"{self.store} holds a prediction with other settings "
                                f"({', '.join(diff) or 'shape'} differ): resume with the same "
                                f"settings, choose another output, or pass --overwrite")
            self.done = {tuple(i) for i in found["done"]}
        else:
            if overwrite and self.store.exists():
                shutil.rmtree(self.store)
            self.array = zarr.create_array(str(self.store), shape=shape, chunks=chunks,
                                           dtype=dtype, fill_value=0, overwrite=True)
            self._record()

    def _record(self) -> None:
        self.array.attrs[KEY] = {"settings": self.settings,
                                 "done": sorted(list(i) for i in self.done)}

    def write(self, index: tuple[int, ...], out: Rect, values: np.ndarray) -> None:
        """Region ``index``'s values (C, *out.shape) into the output box ``out``; then it is
        recorded as done."""
        self.array[(slice(None), *(slice(a, b) for a, b in out.dims))] = values
        self.done.add(tuple(index))
        self._record()

    def finish(self, geo: dict[str, Any] | None = None,
               scale: tuple[Fraction, ...] | None = None) -> Path:
        """The finished output: the Zarr array, or the TIFF written from it (see the module
        doc); ``geo``: GeoTIFF tags of the input (``ImageReader.geo`` at its level), ``scale``:
        output cells per input cell, for the pixel scale."""
        if not self.tiff:
            return self.path
        write_tiff(self.path, self.array, geo, scale)
        shutil.rmtree(self.store)
        return self.path


def _tiles(array: Any, tile: int) -> Iterator[np.ndarray]:
    """The array's tiles in TIFF order: plane by plane, rows of tiles, each padded to
    ``tile`` x ``tile``."""
    c, h, w = array.shape
    for p in range(c):
        for y in range(0, h, tile):
            band = np.asarray(array[p, y:y + tile, :])
            for x in range(0, w, tile):
                t = band[:, x:x + tile]
                if t.shape != (tile, tile):
                    t = np.pad(t, ((0, tile - t.shape[0]), (0, tile - t.shape[1])))
                yield t


def write_tiff(path: Path, array: Any, geo: dict[str, Any] | None = None,
               scale: tuple[Fraction, ...] | None = None) -> None:
    """A tiled, compressed TIFF of ``array`` (C, H, W), read and written one band of tiles at
    a time: one page (C = 1) or C planes (planar)."""
    import tifffile

    c, h, w = array.shape
    shape = (h, w) if c == 1 else (c, h, w)
    tifffile.imwrite(path, _tiles(array, TIFF_TILE), shape=shape, dtype=array.dtype,
                     tile=(TIFF_TILE, TIFF_TILE), compression="zlib",
                     photometric="minisblack", planarconfig="separate" if c > 1 else None,
                     extratags=geo_extratags(geo, scale), bigtiff=h * w * c *
                     np.dtype(array.dtype).itemsize > 2**31)
