"""Command-line argument types the CLIs share: image / volume sizes and process grids."""

from __future__ import annotations

import argparse

from fxpar.io.data import DataError, parse_size


def image_size_arg(text: str) -> int | tuple[int, ...]:
    """``--image-size``: N (an int: a square image) or (H, W) / (D, H, W)."""
    try:
        size = parse_size(text)
    except DataError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return size[0] if len(size) == 1 else size


def grid_arg(text: str) -> tuple[int, ...]:
    """``--grid``: tiles per spatial dim, HxW or DxHxW."""
    try:
        grid = parse_size(text, "--grid", ("2x4", "2x2x2"))
    except DataError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if len(grid) == 1:
        raise argparse.ArgumentTypeError(
            f"--grid {text}: give tiles per spatial dim, HxW or DxHxW (e.g. --grid 1x{grid[0]}"
            f"); for {grid[0]} tiles cut by --slice use --spatial-parts {grid[0]}")
    return grid
