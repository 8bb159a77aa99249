"""Tile groups: each tile op talks over the communicator of the rank program that runs it.

A tile op (halo exchange, join, synchronised batch and group norm, reduction over the image)
communicates within its *tile group*: the ranks holding the tiles of one spatial stage of one
model copy, named by ``key`` (fxpar.runtime.spatial.ops.group_key). The op keeps only that name
as data (an emitted program writes it as a constructor argument, see fxpar.program.emit); the
communicator belongs to the rank program (fxpar.program.program.RankProgram), which made it. The
program hands it to its ops (:meth:`TileGroups.bind`) before every step it runs and takes it
back when it closes, so programs built in one process never run over each other's
communicators, even when they share stage modules (two rank programs of one Program).

The ops' autograd functions are given the communicator itself, not the op: backward uses the
one its forward ran with.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from torch import nn

from fxpar.comm.mpi import Comm


class TileOp(nn.Module):
    """A module that communicates within its tile group ``key``."""

    key: str
    comm: Comm | None = None
    """The tile group's communicator, set by the rank program running this op (None: no
    program holds it)."""

    def group(self) -> Comm:
        """The communicator of this op's tile group."""
        if self.comm is None:
            raise RuntimeError(
                f"tile group {self.key!r} has no communicator: a tile op runs inside a rank "
                f"program made for MPI (program.local() under mpiexec, or "
                f"program.for_rank(r, comm)), not after that program was closed")
        return self.comm


class TileGroups:
    """One rank program's tile-group communicators, by key, and the tile ops they serve."""

    def __init__(self, comms: Mapping[str, Comm], modules: Iterable[nn.Module]) -> None:
        self.comms = dict(comms)
        seen: dict[int, TileOp] = {}
        for module in modules:
            for m in module.modules():
                if isinstance(m, TileOp):
                    seen.setdefault(id(m), m)
        self.ops = list(seen.values())

    def __getitem__(self, key: str) -> Comm:
        return self.comms[key]

    def add(self, module: nn.Module) -> None:
        """Serve the tile ops of ``module`` too (a loss module built after the program), bound
        now."""
        for m in module.modules():
            if isinstance(m, TileOp) and all(m is not op for op in self.ops):
                self.ops.append(m)
                m.comm = self.comms.get(m.key)

    def bind(self) -> None:
        """Give every op its group's communicator (ops without one here get None)."""
        for op in self.ops:
            op.comm = self.comms.get(op.key)

    def unbind(self) -> None:
        """Take this program's communicators back from the ops that still hold them."""
        mine = {id(c) for c in self.comms.values()}
        for op in self.ops:
            if op.comm is not None and id(op.comm) in mine:
                op.comm = None
