"""NIfTI volumes (``.nii``, ``.nii.gz``) through nibabel, read one window at a time.

nibabel is optional: ``pip install fxpar[volumes]`` (``fxpar[test]`` has it too). Only
:mod:`fxpar.data.data` uses this module, for the NIfTI files of an ``ImageFolder``.

Axes. A NIfTI file stores its voxel array in (x, y, z) order, x varying fastest on disk, with
optional further dims: (x, y, z, c) -- several modalities or channels stacked in the 4th dim --
or NIfTI's vector form (x, y, z, 1, c). fxpar's tensors are (C, D, H, W), so:

    D = z,  H = y,  W = x,  C = the 4th dim (or the 5th when the 4th is 1; 1 when absent);

the array is transposed, ``(x, y, z, c) -> (c, z, y, x)``. These are the array's voxel axes as
stored: the affine (the orientation in scanner space) is not applied; reorient the files first
(e.g. ``nibabel.as_closest_canonical``) if the model expects one orientation. A 2-D image in a
NIfTI file is (x, y) or (x, y, 1): H = y, W = x.

Reading. A window (global depth x rows x columns) is read as ``img.dataobj[x0:x1, y0:y1,
z0:z1]`` -- the window's slices in the file's axis order -- and only then transposed: nibabel's
array proxy reads only the bytes of the window from an uncompressed ``.nii`` (it merges byte
runs separated by less than a few hundred bytes into one read), while for ``.nii.gz`` gzip
cannot seek: the file is decompressed from its start up to the window's last byte and what is
outside the window is dropped as it streams by (memory: the window; time: decompressing up to
it). Values come with the header's scaling (``scl_slope``, ``scl_inter``) applied and are not
scaled further (intensities such as Hounsfield units are physical quantities).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from fxpar.core.geometry import Rect
from fxpar.data.errors import DataError


def _nibabel() -> Any:
    try:
        import nibabel
    except ImportError:
        raise DataError("reading NIfTI files (.nii, .nii.gz) needs nibabel: pip install "
                        "'fxpar[volumes]' (or pip install nibabel)") from None
    return nibabel


def _load(path: Path) -> Any:
    """The image with its header read and its voxels left on disk (an array proxy)."""
    nib = _nibabel()
    try:
        img = nib.load(path)
        shape = tuple(int(s) for s in img.shape)
        kind = np.dtype(img.get_data_dtype()).kind
    except Exception as e:  # nibabel raises many kinds (ImageFileError, HeaderDataError, ...)
        raise DataError(f"{path}: not a readable NIfTI file ({type(e).__name__}: {e})") from None
    if kind not in "biuf":
        raise DataError(f"{path}: NIfTI voxels of type {img.get_data_dtype()}; expected "
                        f"numbers (convert RGB or complex volumes to channels of floats)")
    if not 2 <= len(shape) <= 5 or (len(shape) == 5 and shape[3] != 1):
        raise DataError(f"{path}: NIfTI array of shape {shape}; expected (x, y, z), "
                        f"(x, y, z, c) or (x, y, z, 1, c)")
    return img


def _axes(shape: tuple[int, ...]) -> tuple[tuple[int, int, int], int]:
    """((x, y, z), channels) of a NIfTI array shape."""
    x, y, z = (*shape[:3], 1, 1)[:3]
    return (x, y, z), int(shape[-1]) if len(shape) > 3 else 1


def nifti_header(path: Path, ndim: int) -> tuple[tuple[int, ...], int]:
    """(spatial size, channels) from the header: ((D, H, W), C) = ((z, y, x), c) for
    ``ndim=3``, ((H, W), C) = ((y, x), c) for ``ndim=2`` (which needs z == 1)."""
    img = _load(path)
    (x, y, z), c = _axes(tuple(img.shape))
    if ndim == 3:
        return (z, y, x), c
    if ndim == 2:
        if z != 1:
            raise DataError(f"{path}: a NIfTI volume of {z}x{y}x{x} (DxHxW = z, y, x) but "
                            f"--image-size asks for 2-D images: give --image-size "
                            f"{z}x{y}x{x} (DxHxW) for volumes")
        return (y, x), c
    raise DataError(f"{path}: NIfTI holds 2-D images or 3-D volumes, not {ndim}-D data")


def nifti_window(path: Path, window: Rect, channels: int) -> np.ndarray:
    """``window`` ((depth, rows, cols) or (rows, cols), global) of the file as a (C,
    *window.shape) array, reading only the window (see the module doc); ``channels``: what
    the header check found."""
    img = _load(path)
    shape = tuple(img.shape)
    index: list[Any] = [slice(a, b) for a, b in reversed(window.dims)]  # x, y[, z]
    if len(shape) >= 3 and window.ndim == 2:
        index.append(slice(0, 1))  # the one z of a 2-D image
    del index[len(shape):]  # a 2-D (x, y) file read as a volume of depth 1
    index += [slice(None)] * (len(shape) - len(index))
    try:
        part = np.asarray(img.dataobj[tuple(index)])
    except (ValueError, OSError, EOFError) as e:  # e.g. a file cut short after its header
        raise DataError(f"{path}: cannot read the window {window} ({type(e).__name__}: "
                        f"{e}): replace the file") from None
    return part.reshape(*reversed(window.shape), channels).T
