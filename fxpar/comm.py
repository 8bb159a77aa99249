"""Comm: the one small communication interface fxpar's runtime uses, over mpi4py.

CPU tensors go to MPI through their own memory (a NumPy view of the tensor's storage), with no
staging copy: a receive writes straight into the destination tensor. Buffers must therefore be
contiguous; send buffers that are not are made contiguous once (and said so in the docstring of
each call), receive buffers that are not are an error, because the data would land in a copy.

Every call takes and returns torch tensors; MPI details (datatypes, IN_PLACE, requests) stay here.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

# dtypes NumPy has no type for travel as same-width integers (bit patterns are preserved); they
# can be sent and received but not reduced.
_BITCAST = {torch.bfloat16: torch.int16, torch.float8_e4m3fn: torch.int8,
            torch.float8_e5m2: torch.int8}


def _mpi() -> Any:
    from mpi4py import MPI  # imported lazily: analysis and inspect never need MPI

    return MPI


def _buffer(t: torch.Tensor, *, writable: bool) -> np.ndarray:
    """A NumPy view of ``t``'s memory (no copy)."""
    if t.device.type != "cpu":
        raise NotImplementedError(f"Comm over mpi4py handles CPU tensors; got one on {t.device}")
    if not t.is_contiguous():
        if writable:
            raise ValueError("receive buffer must be contiguous (data would land in a copy)")
        t = t.contiguous()
    t = t.detach()
    if t.dtype in _BITCAST:
        t = t.view(_BITCAST[t.dtype])
    return t.numpy()


class Request:
    """A pending nonblocking operation; keeps its buffer alive until :meth:`wait`."""

    def __init__(self, req: Any, keep: object) -> None:
        self._req = req
        self._keep = keep

    def wait(self) -> None:
        self._req.Wait()
        self._keep = None

    def test(self) -> bool:
        done = bool(self._req.Test())
        if done:
            self._keep = None
        return done


class Comm:
    """A communicator: the world, or a sub-group made with :meth:`split` / :meth:`group`."""

    def __init__(self, mpi_comm: Any = None) -> None:
        self._c = mpi_comm if mpi_comm is not None else _mpi().COMM_WORLD

    @property
    def rank(self) -> int:
        return int(self._c.Get_rank())

    @property
    def size(self) -> int:
        return int(self._c.Get_size())

    # -- point to point ---------------------------------------------------------------------
    def isend(self, t: torch.Tensor, dst: int, tag: int = 0) -> Request:
        """Start sending ``t`` to ``dst`` (a non-contiguous ``t`` is sent from a copy)."""
        buf = _buffer(t, writable=False)
        return Request(self._c.Isend(buf, dest=dst, tag=tag), buf)

    def irecv(self, t: torch.Tensor, src: int, tag: int = 0) -> Request:
        """Start receiving into ``t`` (contiguous) from ``src``."""
        buf = _buffer(t, writable=True)
        return Request(self._c.Irecv(buf, source=src, tag=tag), buf)

    def send(self, t: torch.Tensor, dst: int, tag: int = 0) -> None:
        self._c.Send(_buffer(t, writable=False), dest=dst, tag=tag)

    def recv(self, t: torch.Tensor, src: int, tag: int = 0) -> torch.Tensor:
        self._c.Recv(_buffer(t, writable=True), source=src, tag=tag)
        return t

    def sendrecv(self, send: torch.Tensor, dst: int, recv: torch.Tensor, src: int,
                 tag: int = 0) -> torch.Tensor:
        """Send ``send`` to ``dst`` while receiving into ``recv`` from ``src``."""
        self._c.Sendrecv(_buffer(send, writable=False), dest=dst, sendtag=tag,
                         recvbuf=_buffer(recv, writable=True), source=src, recvtag=tag)
        return recv

    @staticmethod
    def waitall(requests: Sequence[Request]) -> None:
        for r in requests:
            r.wait()

    # -- collectives ------------------------------------------------------------------------
    def allreduce(self, t: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """In-place allreduce of ``t`` (sum, max or min); returns ``t``."""
        if t.dtype in _BITCAST:
            raise TypeError(f"allreduce of {t.dtype} is not supported: reduce in float32")
        mpi = _mpi()
        ops = {"sum": mpi.SUM, "max": mpi.MAX, "min": mpi.MIN}
        self._c.Allreduce(mpi.IN_PLACE, _buffer(t, writable=True), op=ops[op])
        return t

    def iallreduce(self, t: torch.Tensor) -> Request:
        """Start an in-place sum allreduce of ``t``."""
        buf = _buffer(t, writable=True)
        mpi = _mpi()
        return Request(self._c.Iallreduce(mpi.IN_PLACE, buf, op=mpi.SUM), buf)

    def allgather(self, t: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's ``t`` (same shape on all ranks), in rank order."""
        out = torch.empty((self.size, *t.shape), dtype=t.dtype)
        self._c.Allgather(_buffer(t, writable=False), _buffer(out, writable=True))
        return list(out.unbind(0))

    def gather(self, t: torch.Tensor, root: int = 0) -> list[torch.Tensor] | None:
        """Every rank's ``t`` on ``root`` (in rank order); None elsewhere."""
        out = torch.empty((self.size, *t.shape), dtype=t.dtype) if self.rank == root else None
        self._c.Gather(_buffer(t, writable=False),
                       _buffer(out, writable=True) if out is not None else None, root=root)
        return list(out.unbind(0)) if out is not None else None

    def bcast(self, t: torch.Tensor, root: int = 0) -> torch.Tensor:
        """In-place broadcast of ``t`` from ``root``."""
        self._c.Bcast(_buffer(t, writable=True), root=root)
        return t

    def allgather_object(self, obj: object) -> list[Any]:
        """Every rank's picklable ``obj`` (for start-up checks, not for the hot path)."""
        return list(self._c.allgather(obj))

    def gather_object(self, obj: object, root: int = 0) -> list[Any] | None:
        return self._c.gather(obj, root=root)

    def bcast_object(self, obj: object, root: int = 0) -> Any:
        return self._c.bcast(obj, root=root)

    def barrier(self) -> None:
        self._c.Barrier()

    # -- sub-communicators ------------------------------------------------------------------
    def split(self, color: int, key: int | None = None) -> Comm:
        """Ranks with the same ``color`` form a new communicator (collective on all ranks)."""
        return Comm(self._c.Split(color, self.rank if key is None else key))

    def group(self, ranks: Sequence[int], tag: int = 0) -> Comm | None:
        """A communicator of ``ranks`` (in that order); collective over the ranks listed only.
        None on ranks not listed."""
        if self.rank not in ranks:
            return None
        grp = self._c.Get_group().Incl(list(ranks))
        return Comm(self._c.Create_group(grp, tag=tag))

    def abort(self, code: int = 1) -> None:
        """End the whole job now (every rank), flushing this rank's output first."""
        sys.stdout.flush()
        sys.stderr.flush()
        self._c.Abort(code)
        os._exit(code)  # MPI_Abort can return when every peer has already exited


def world() -> Comm:
    """The communicator of every rank in the job."""
    return Comm()
