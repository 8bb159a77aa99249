"""Tile groups: each tile op talks over the communicator its rank program binds for the step.

A tile op (halo exchange, join, synchronised batch and group norm, reduction over the image)
communicates within its *tile group*: the ranks holding the tiles of one spatial stage of one
model copy, named by ``key`` (fxpar.runtime.spatial.ops.group_key). The op keeps only that name
as data: it calls fxpar's custom ops (fxpar.runtime.spatial.library) with the key as a string
argument, so a stage is an ordinary graph of ATen and ``fxpar::`` ops. The communicators belong
to the rank program (fxpar.program.rank.RankProgram), which made them: it binds key ->
communicator in a context variable for the duration of each step it runs (:func:`bound`), and
the ops' kernels look their group up there (:func:`group`). Programs built in one process never
run over each other's communicators, even when they share stage modules (two rank programs of
one Program, on two threads: each thread has its own context).

Backward uses the communicators its forward ran with: each op's autograd context keeps the
binding it saw (:func:`current`) and binds it again around its backward's ops, on whatever
thread the autograd engine runs it.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from contextvars import ContextVar
from types import MappingProxyType

from torch import nn

from fxpar.comm.mpi import Comm

_BOUND: ContextVar[Mapping[str, Comm]] = ContextVar("fxpar_tile_groups",
                                                    default=MappingProxyType({}))
"""The tile groups' communicators of the rank program running now, by key."""


@contextmanager
def bound(comms: Mapping[str, Comm]) -> Iterator[None]:
    """Bind ``comms`` (key -> communicator) for the tile ops run inside."""
    token = _BOUND.set(MappingProxyType(dict(comms)))
    try:
        yield
    finally:
        _BOUND.reset(token)


def current() -> Mapping[str, Comm]:
    """The binding the tile ops see now."""
    return _BOUND.get()


def group(key: str) -> Comm:
    """The communicator of tile group ``key`` in the current binding."""
    comm = _BOUND.get().get(key)
    if comm is None:
        raise RuntimeError(
            f"tile group {key!r} has no communicator: a tile op runs inside a step of a rank "
            f"program made for MPI (program.local() under mpiexec, or program.for_rank(r, "
            f"comm)); tests and tools that call tile ops directly bind one with "
            f"fxpar.runtime.spatial.group.bound({{{key!r}: comm}})")
    return comm


class TileOp(nn.Module):
    """A module that communicates within its tile group ``key``."""

    key: str


class TileGroups:
    """One rank program's tile-group communicators, by key."""

    def __init__(self, comms: Mapping[str, Comm]) -> None:
        self.comms = dict(comms)

    def __getitem__(self, key: str) -> Comm:
        return self.comms[key]

    def bound(self) -> AbstractContextManager[None]:
        """Bind these communicators for the tile ops run inside (a step)."""
        return bound(self.comms)
