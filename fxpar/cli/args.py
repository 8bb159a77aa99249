"""What the CLIs share: argument types (image / volume sizes, process grids, byte sizes) and
the report of a user error under mpiexec."""

from __future__ import annotations

import argparse
import sys

from fxpar.comm import failfast
from fxpar.comm.mpi import Comm
from fxpar.data.data import DataError, parse_size


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


_UNITS = {"": 1, "b": 1, "k": 2**10, "kib": 2**10, "kb": 10**3, "m": 2**20, "mib": 2**20,
          "mb": 10**6, "g": 2**30, "gib": 2**30, "gb": 10**9, "t": 2**40, "tib": 2**40,
          "tb": 10**12}


def bytes_arg(text: str) -> int:
    """``--memory-per-rank``: bytes, with an optional unit: 4GiB, 512MiB, 1.5G (binary), 4GB
    (decimal)."""
    t = text.strip().lower().replace(" ", "")
    number = t.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = t[len(number):]
    try:
        value = int(float(number) * _UNITS[unit])
    except (ValueError, KeyError):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a size: give bytes with an optional unit, e.g. 4GiB, 512MiB, "
            f"1.5G, 4000000000") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: the size must be at least 1 byte")
    return value


def user_error(prog: str, e: Exception, comm: Comm | None, checked: bool) -> int:
    """``prog: error: ...`` once, and 2 returned on every rank alike (fxpar-run,
    fxpar-predict). In a multi-rank job a rank
    that failed before the start-up check (failfast.agree, the first communication) still
    takes part in it with its error, so the other ranks stop there too instead of waiting;
    after the check (``checked``), the rank ends the whole job."""
    world = comm
    if world is None and failfast.launched():
        from fxpar.comm.world import world as mpi_world

        world = mpi_world()
    if world is None or world.size == 1:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    if not isinstance(e, failfast.Disagreement):
        if checked:
            failfast.fail(e)
        try:
            failfast.agree(world, None, str(e))
        except failfast.Disagreement as d:
            e = d
    if world.rank == 0:
        print(f"{prog}: error: {e}", file=sys.stderr, flush=True)
    return 2
