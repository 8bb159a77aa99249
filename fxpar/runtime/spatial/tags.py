"""The MPI tags a tile module's halo exchanges and joins use (in their tile group).

The halo pass (fxpar.passes.halo) numbers them ``10 + 2k`` for the k-th module it adds; a
halo exchange sends forward with its tag and backward with tag + 1, a join only forward (its
backward is an allreduce). Ring attention (fxpar.runtime.spatial.attention.RingAttention) sends
forward with its tag and backward with tag + 1 as a halo exchange does; its default,
``RING_TAG`` = 6 (and 7), lies below the loss join's 8 (fxpar.runtime.spatial.lossops) and the
halo pass's range, so an op made without a tag of its own collides with neither. The compiler
checks the largest against MPI's bound (fxpar.core.messages.check_tags), and a rank program
again against its MPI's ``MPI_TAG_UB``, and that no two tile ops of a stage share a tag
(:func:`tag_owners`).
"""

from __future__ import annotations

from torch import nn

from fxpar.runtime.spatial.attention import RingAttention
from fxpar.runtime.spatial.ops import Halo, HaloOp, Join


def _tags(m: nn.Module) -> tuple[int, ...]:
    """The tags tile op ``m`` sends with (forward, then backward); () for any other module."""
    if isinstance(m, (Halo, HaloOp, RingAttention)):
        return (m.tag, m.tag + 1)
    return (m.tag,) if isinstance(m, Join) else ()


def max_tag(module: nn.Module) -> int:
    """The largest tag the tile ops of ``module`` use (-1: none)."""
    return max((t for m in module.modules() for t in _tags(m)), default=-1)


def tag_owners(module: nn.Module) -> dict[int, str]:
    """Every tag the tile ops of ``module`` use -> the op's name. Raises AssertionError when two
    ops share one: in one tile group a message of the one could match a receive of the other
    (two ring attentions in flight, a halo exchange beside a ring's step), so the halo pass
    numbers them apart; two that share one are a compiler bug."""
    owners: dict[int, str] = {}
    for name, m in module.named_modules():
        for t in _tags(m):
            if t in owners:
                raise AssertionError(f"tile ops {owners[t]!r} and {name!r} of "
                                     f"{type(module).__name__} both send with MPI tag {t}")
            owners[t] = name
    return owners
