"""The inference section of ``make gpu-check`` (a worker of tools/gpu_measure.py): fxpar.predict's
region loop on a tiled TIFF against MONAI's sliding window, on one device.

tools/bench_predict.py makes the same comparison on the CPU with the CLI; this reuses its image,
model and loader. Each finished item is one ``BENCH`` line (benchlib.emit): ``image`` (the TIFF
written), ``exact`` (the whole-image forward: the reference), ``fxpar``, ``monai/MODE``; an item
whose library is missing says so (``missing``).
"""

from __future__ import annotations

import copy
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_predict  # noqa: E402
import benchlib  # noqa: E402
from gpu_measure import error, release, timed  # noqa: E402

_COARSE: Any = None


def _keep_coarse(coarse: Any) -> None:
    global _COARSE
    _COARSE = coarse


def _tile(corner: tuple[int, int]) -> Any:
    t = min(bench_predict.TILE, len(_COARSE) * bench_predict.COARSE)
    return bench_predict.image_tile(corner[0], corner[1], t, t, _COARSE)


def write_image(path: Path, size: int, workers: int) -> int:
    """bench_predict.write_image's image (the same pixels), its tiles made by ``workers``
    processes: one process needs about a minute for 16384²."""
    import multiprocessing

    import numpy as np
    import tifffile

    coarse = np.random.default_rng(bench_predict.SEED).uniform(
        0, 255, (size // bench_predict.COARSE + 2,) * 2 + (3,)).astype(np.float32)
    t = min(bench_predict.TILE, size)
    corners = [(y, x) for y in range(0, size, t) for x in range(0, size, t)]
    with multiprocessing.get_context("fork").Pool(workers, _keep_coarse, (coarse,)) as pool:
        tifffile.imwrite(path, pool.imap(_tile, corners, chunksize=4), shape=(size, size, 3),
                         dtype=np.uint8, tile=(t, t), photometric="rgb", compression="zlib",
                         compressionargs={"level": 1}, predictor=True, bigtiff=True,
                         maxworkers=workers)
    return path.stat().st_size


class OnDevice:
    """A compiled program whose rank programs run on ``dev`` and return their output on the
    CPU: fxpar.predict's region loop keeps rank programs where the model is (the CPU), and
    fxpar-predict has no device option."""

    def __init__(self, program: Any, dev: torch.device) -> None:
        self._program, self._dev = program, dev

    def __getattr__(self, name: str) -> Any:
        return getattr(self._program, name)

    def for_rank(self, rank: int, comm: Any = None) -> Any:
        return _RankOnDevice(self._program.for_rank(rank, comm).to(self._dev))

    def local(self, comm: Any = None) -> Any:
        return _RankOnDevice(self._program.local(comm).to(self._dev))


class _RankOnDevice:
    def __init__(self, rp: Any) -> None:
        self._rp = rp

    def __getattr__(self, name: str) -> Any:
        return getattr(self._rp, name)

    def forward(self, x: torch.Tensor | None) -> Any:
        y = self._rp.forward(x)
        return None if y is None else y.cpu()


def run(dev: torch.device, size: int, region: int, modes: tuple[str, ...],
        overlap: float) -> None:
    """Every item in turn, on ``dev``: a ``size``² image, ``region``² regions (MONAI's
    ``roi_size``), MONAI in each of ``modes`` with ``overlap``."""
    import fxpar
    from fxpar.compiler.predict import predict_regions
    from fxpar.data.images import open_image

    mpx = size ** 2 / 1e6
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        path = Path(tmp) / "image.tif"
        t0 = time.perf_counter()  # before CUDA is touched: the tile makers are forked
        size_bytes = write_image(path, size, max(1, min(16, os.cpu_count() or 1)))
        benchlib.emit({"item": "image", "size": size, "bytes": size_bytes,
                       "seconds": time.perf_counter() - t0})
        model = bench_predict.trained_model(3)
        on_dev = copy.deepcopy(model).to(dev)
        x = bench_predict._load(path).to(dev)
        with torch.no_grad():
            on_dev(x[..., :region, :region])  # the device's and cuDNN's first-call costs
            seconds, logits = timed(lambda: on_dev(x), dev)
            ref = logits[0].argmax(0).to(torch.uint8)
            del logits
        benchlib.emit({"item": "exact", "seconds": seconds, "mpx_s": mpx / seconds})

        def differ(got: Any) -> int:
            return int((torch.as_tensor(got).to(dev) != ref).sum())

        def compile_crop(example: torch.Tensor) -> OnDevice:
            return OnDevice(fxpar.compile(copy.deepcopy(model), fxpar.Plan(), example), dev)

        t0 = time.perf_counter()
        try:
            import zarr  # fxpar reads TIFF windows and writes its output through it
        except ImportError as e:
            benchlib.emit({"item": "fxpar", "missing": str(e)})
        else:
            try:  # a failure is reported; MONAI still runs
                got = predict_regions(model, fxpar.Plan(), open_image(path),
                                      Path(tmp) / "fx.zarr", compile_crop=compile_crop,
                                      region=region, output="argmax", progress=False)
                argmax = zarr.open_array(str(got.output), mode="r")[0]
                benchlib.emit({"item": "fxpar", "seconds": got.seconds,
                               "mpx_s": mpx / got.seconds, "wall_s": time.perf_counter() - t0,
                               "overlap": got.overlap, "regions": got.regions,
                               "differ": differ(argmax)})
            except Exception as e:  # noqa: BLE001
                benchlib.emit({"item": "fxpar", "error": error(e)})
        try:
            from monai.inferers import sliding_window_inference
        except ImportError as e:
            benchlib.emit({"item": "monai", "missing": str(e)})
            return
        for mode in modes:
            try:
                with torch.no_grad():
                    seconds, out = timed(lambda m=mode: sliding_window_inference(
                        x, region, 1, on_dev, overlap=overlap, mode=m), dev)
                    got_m = torch.as_tensor(out)[0].argmax(0).to(torch.uint8)
                    del out
                benchlib.emit({"item": f"monai/{mode}", "seconds": seconds,
                               "mpx_s": mpx / seconds, "differ": differ(got_m)})
            except Exception as e:  # noqa: BLE001
                benchlib.emit({"item": f"monai/{mode}", "error": error(e)})
            release()
