"""Numbers for people: decimal prefixes for FLOPs, binary ones for bytes."""

from __future__ import annotations


def si(n: float, unit: str = "") -> str:
    """``1.5e9 -> '1.50 G'`` (decimal prefixes, for FLOPs)."""
    for prefix, scale in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {prefix}{unit}"
    return f"{n:.0f} {unit}".rstrip()


def nbytes(n: float) -> str:
    """``1536 -> '1.50 KiB'`` (binary prefixes, for memory)."""
    for prefix, scale in (("Ti", 2**40), ("Gi", 2**30), ("Mi", 2**20), ("Ki", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {prefix}B"
    return f"{n:.0f} B"
