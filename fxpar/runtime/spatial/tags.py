"""The MPI tags a tile module's halo exchanges and joins use (in their tile group).

The halo pass (fxpar.passes.halo) numbers them ``10 + 2k`` for the k-th module it adds; a
halo exchange sends forward with its tag and backward with tag + 1, a join only forward (its
backward is an allreduce). The compiler checks the largest against MPI's bound
(fxpar.core.messages.check_tags), and a rank program again against its MPI's ``MPI_TAG_UB``.
"""

from __future__ import annotations

from torch import nn

from fxpar.runtime.spatial.ops import Halo, HaloOp, Join


def max_tag(module: nn.Module) -> int:
    """The largest tag the tile ops of ``module`` use (-1: none)."""
    out = -1
    for m in module.modules():
        if isinstance(m, (Halo, HaloOp)):
            out = max(out, m.tag + 1)
        elif isinstance(m, Join):
            out = max(out, m.tag)
    return out
