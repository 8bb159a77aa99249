"""A synthetic whole-slide image for docs/cli.md's example: a pyramidal tiled TIFF of pink
"tissue" blobs with texture on a light background, its per-pixel mask (1 = tissue) as a second
tiled TIFF, and CSVs of training / validation regions (image, mask, y, x) for ``fxpar-run
--data`` / ``--val-data``. Written band by band: the image is never whole in memory.

    python tools/make_slide.py out/ --size 8192 --regions 24 --region 512
"""

from __future__ import annotations

import argparse
import csv
from collections.abc import Iterator
from pathlib import Path

import numpy as np

TILE = 256


def blobs(size: int, count: int, seed: int) -> list[tuple[float, float, float]]:
    """(row, col, radius) of the tissue blobs."""
    rng = np.random.default_rng(seed)
    return [(rng.uniform(0, size), rng.uniform(0, size), rng.uniform(size / 16, size / 6))
            for _ in range(count)]


def band(size: int, y0: int, rows: int, spots: list[tuple[float, float, float]],
         seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Rows ``y0 .. y0 + rows`` of the slide (rows, size, 3) uint8 and its mask (rows, size)."""
    yy, xx = np.mgrid[y0:y0 + rows, 0:size].astype(np.float32)
    mask = np.zeros((rows, size), bool)
    for cy, cx, r in spots:
        wobble = 1 + 0.15 * np.sin(xx / 37.0 + cy) * np.cos(yy / 53.0 + cx)
        mask |= (yy - cy) ** 2 + (xx - cx) ** 2 < (r * wobble) ** 2
    rng = np.random.default_rng(seed + y0)
    noise = rng.normal(0, 12, (rows, size, 1)).astype(np.float32)
    tissue = np.array([200, 120, 170], np.float32) + noise
    background = np.array([238, 236, 240], np.float32) + noise / 3
    rgb = np.where(mask[..., None], tissue, background)
    return np.clip(rgb, 0, 255).astype(np.uint8), mask.astype(np.uint8)


def tiles(size: int, spots: list[tuple[float, float, float]], seed: int, which: int,
          step: int = 1) -> Iterator[np.ndarray]:
    """The slide (which=0) or mask (which=1) at 1/step resolution, tile by tile."""
    for y in range(0, size, TILE * step):
        rows = min(TILE * step, size - y)
        part = band(size, y, rows, spots, seed)[which][::step, ::step]
        for x in range(0, size // step, TILE):
            t = part[:, x:x + TILE]
            pad = ((0, TILE - t.shape[0]), (0, TILE - t.shape[1])) + ((0, 0),) * (t.ndim - 2)
            yield np.pad(t, pad)


def write(folder: Path, size: int, count: int, region: int, seed: int) -> None:
    import tifffile

    folder.mkdir(parents=True, exist_ok=True)
    spots = blobs(size, max(3, size // 1024), seed)
    with tifffile.TiffWriter(folder / "slide.tif", bigtiff=True) as tw:
        tw.write(tiles(size, spots, seed, 0), shape=(size, size, 3), dtype=np.uint8,
                 tile=(TILE, TILE), compression="zlib", photometric="rgb", subifds=2)
        for level in (1, 2):
            s = size >> level
            tw.write(tiles(size, spots, seed, 0, 2**level), shape=(s, s, 3), dtype=np.uint8,
                     tile=(TILE, TILE), compression="zlib", photometric="rgb", subfiletype=1)
    tifffile.imwrite(folder / "slide_mask.tif", tiles(size, spots, seed, 1),
                     shape=(size, size), dtype=np.uint8, tile=(TILE, TILE), compression="zlib",
                     bigtiff=True)
    rng = np.random.default_rng(seed + 1)
    for name, n in (("train.csv", count), ("val.csv", max(2, count // 4))):
        with open(folder / name, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["image", "mask", "y", "x"])
            for _ in range(n):
                y, x = (int(v) for v in rng.integers(0, size - region, 2))
                w.writerow(["slide.tif", "slide_mask.tif", y, x])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("folder", type=Path)
    p.add_argument("--size", type=int, default=8192)
    p.add_argument("--regions", type=int, default=24, help="training regions in train.csv")
    p.add_argument("--region", type=int, default=512, help="side of a training region")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    write(a.folder, a.size, a.regions, a.region, a.seed)
    print(f"wrote {a.folder}/slide.tif ({a.size}x{a.size}, 3 levels), slide_mask.tif, "
          f"train.csv, val.csv")


if __name__ == "__main__":
    main()
