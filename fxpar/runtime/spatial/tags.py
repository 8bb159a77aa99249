"""The MPI tags a tile module's halo exchanges and joins use (in their tile group).

The halo pass (fxpar.passes.halo) numbers them ``10 + 2k`` for the k-th module it adds; a
halo exchange sends forward with its tag and backward with tag + 1, a join only forward (its
backward is an allreduce). Ring attention (fxpar.runtime.spatial.attention.RingAttention) sends
forward with its tag and backward with tag + 1 as a halo exchange does; its default,
``RING_TAG`` = 6 (and 7), lies below the loss join's 8 (fxpar.runtime.spatial.lossops) and the
halo pass's range, so an op made without a tag of its own collides with neither. The compiler
checks the largest against MPI's bound (fxpar.core.messages.check_tags), and a rank program
again against its MPI's ``MPI_TAG_UB``.
"""

from __future__ import annotations

from torch import nn

from fxpar.runtime.spatial.attention import RingAttention
from fxpar.runtime.spatial.ops import Halo, HaloOp, Join


def max_tag(module: nn.Module) -> int:
    """The largest tag the tile ops of ``module`` use (-1: none)."""
    out = -1
    for m in module.modules():
        if isinstance(m, (Halo, HaloOp, RingAttention)):
            out = max(out, m.tag + 1)
        elif isinstance(m, Join):
            out = max(out, m.tag)
    return out
