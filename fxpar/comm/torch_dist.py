"""Comm over torch.distributed: NCCL collectives for GPU clusters (gloo on CPU, for testing).

Selected with ``world(backend="torch")`` or ``FXPAR_COMM=torch``. It is bootstrapped
from the MPI ranks (``mpiexec`` starts the job as always): rank 0 opens a ``TCPStore`` on
``MASTER_ADDR:MASTER_PORT`` (default: its host name and a free port) and broadcasts the address
with mpi4py; ``init_process_group`` then joins every rank with MPI's rank and size.

What goes where:

* tensors on the backend's device (CUDA for NCCL, CPU for gloo): collectives and
  point-to-point through the process group. NCCL ignores tags and runs a pair's sends and
  receives in issue order, so fxpar issues them in an order both ends agree on
  (fxpar.comm.ordered, fxpar.core.wire); ``FXPAR_P2P=staged`` keeps CUDA point-to-point on MPI
  instead (CUDA-aware or staged, see fxpar.comm.mpi), and ``FXPAR_P2P=issue`` makes gloo match
  in issue order too, which tests that order on CPU.
* everything else (the CPU loss under NCCL, pickled objects, barriers, abort): the matching MPI
  communicator this class extends.

Sub-communicators: ``torch.distributed.new_group`` is collective on *every* rank of the job and
names groups by a counter all ranks must share, while :meth:`Comm.group` is collective over its
members only. So each sub-communicator builds its own process group over a prefix of the shared
store, the prefix chosen by the group's first rank and broadcast over the MPI sub-communicator:
collective over the members only, like MPI.
"""

from __future__ import annotations

import datetime
import os
import socket
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from fxpar.comm.mpi import Comm
from fxpar.comm.watchdog import watching
from fxpar.core.options import setting


def _timeout() -> datetime.timedelta:
    """How long torch.distributed waits for a collective (FXPAR_TORCH_timeout())."""
    return datetime.timedelta(seconds=float(setting("torch_timeout")))
_world: TorchComm | None = None


class Work:
    """A pending torch.distributed operation (same interface as fxpar.comm.mpi.Request)."""

    def __init__(self, work: Any, keep: object, what: Callable[[], str],
                 done: Callable[[], object] | None = None) -> None:
        self._work = work
        self._keep = keep
        self._what = what
        self._done = done
        """Run once when the operation completed (a staged receive's copy into its tensor)."""

    def wait(self) -> None:
        with watching(self._what):  # FXPAR_WATCHDOG covers this backend too
            self._work.wait()
        self._keep = None
        if self._done is not None:
            done, self._done = self._done, None
            done()

    def test(self) -> bool:
        done = bool(self._work.is_completed())
        if done:
            self.wait()
        return done


def blocking_send(self: Any, t: torch.Tensor, dst: int, tag: int = 0) -> None:
    """``send`` of a communicator whose point-to-point is its ``isend`` / ``irecv``."""
    self.isend(t, dst, tag).wait()


def blocking_recv(self: Any, t: torch.Tensor, src: int, tag: int = 0) -> torch.Tensor:
    self.irecv(t, src, tag).wait()
    return t


def blocking_sendrecv(self: Any, send: torch.Tensor, dst: int, recv: torch.Tensor, src: int,
                      tag: int = 0) -> torch.Tensor:
    r = self.irecv(recv, src, tag)
    s = self.isend(send, dst, tag)
    r.wait()
    s.wait()
    return recv


_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def pg_allreduce(pg: Any, t: torch.Tensor, op: str, what: Callable[[], str],
                 wide: torch.dtype | None = None) -> Work:
    """Start an in-place allreduce of ``t`` (contiguous) on process group ``pg``; ``wide``:
    reduce a copy in that dtype, rounded into ``t`` once when the work completes."""
    if not t.is_contiguous():
        raise ValueError("allreduce buffer must be contiguous (the result would land in a copy)")
    opts = dist.AllreduceOptions()
    opts.reduceOp = _OPS[op]
    if wide is not None and wide != t.dtype:
        buf = t.to(wide)
        return Work(pg.allreduce([buf], opts), buf, what, done=lambda: t.copy_(buf))
    return Work(pg.allreduce([t], opts), t, what)


def pg_allgather(pg: Any, t: torch.Tensor, size: int,
                 what: Callable[[], str]) -> list[torch.Tensor]:
    """Every member's ``t`` in rank order, gathered on process group ``pg`` of ``size``."""
    out = [torch.empty_like(t, memory_format=torch.contiguous_format) for _ in range(size)]
    with watching(what):
        pg.allgather([out], [t.contiguous()]).wait()
    return out


def pg_broadcast(pg: Any, t: torch.Tensor, root: int, what: Callable[[], str]) -> torch.Tensor:
    """In-place broadcast of ``t`` (contiguous) from ``root`` on process group ``pg``."""
    if not t.is_contiguous():
        raise ValueError("broadcast buffer must be contiguous (data would land in a copy)")
    opts = dist.BroadcastOptions()
    opts.rootRank = root
    with watching(what):
        pg.broadcast([t], opts).wait()
    return t


ISSUE_TAG = 0
"""The one tag of every tensor message under ``FXPAR_P2P=issue`` (gloo matching as NCCL does)."""
P2P_MODES = ("", "nccl", "staged", "issue")


def p2p_mode() -> str:
    """``FXPAR_P2P``, checked: how point-to-point tensors travel over torch.distributed."""
    mode = setting("p2p")
    if mode not in P2P_MODES:
        raise ValueError(f"FXPAR_P2P={mode!r}: use nccl (the default), staged or issue")
    return mode


def p2p_tag(mode: str, tag: int) -> int:
    """The tag a tensor message carries on a process group: ``tag``, or under
    ``FXPAR_P2P=issue`` one tag for all, so gloo matches them in issue order like NCCL."""
    return ISSUE_TAG if mode == "issue" else tag


def _process_group(store: Any, prefix: str, rank: int, size: int, backend: str) -> Any:
    """A process group of ``size`` ranks rendezvousing under ``prefix`` of ``store``."""
    from torch._C._distributed_c10d import PrefixStore

    sub = PrefixStore(prefix, store)
    if backend == "nccl":
        return dist.ProcessGroupNCCL(sub, rank, size, dist.ProcessGroupNCCL.Options())
    return dist.ProcessGroupGloo(sub, rank, size, _timeout())


class TorchComm(Comm):
    """A communicator whose device-tensor collectives run on a torch.distributed process group.

    mpi: the MPI communicator over the same ranks in the same order (objects, barriers, and
    tensors the process group does not carry)."""

    def __init__(self, mpi: Comm, pg: Any, backend: str, store: Any) -> None:
        super().__init__(mpi._c, route=mpi._route)
        self._pg = pg
        self.backend = backend
        self._store = store
        self._native = "cuda" if backend == "nccl" else "cpu"
        self._p2p_mode = p2p_mode()
        self._pg_p2p = self._p2p_mode != "staged" or backend != "nccl"
        """Point-to-point of native tensors goes through the process group (NCCL: issued in
        the order both ends agree on, fxpar.comm.ordered), else MPI. (Not ``_p2p``: that is
        Comm's description of a message, which the watchdog calls.)"""

    def _mine(self, t: torch.Tensor) -> bool:
        return t.device.type == self._native

    def _sub(self, mpi_comm: Any) -> TorchComm:
        """A TorchComm over ``mpi_comm`` (collective over its members only)."""
        mpi = Comm(mpi_comm, route=self._route)
        prefix = mpi.bcast_object(f"fxpar-{uuid.uuid4().hex}/" if mpi.rank == 0 else None)
        pg = _process_group(self._store, prefix, mpi.rank, mpi.size, self.backend)
        return TorchComm(mpi, pg, self.backend, self._store)

    # -- point to point ---------------------------------------------------------------------
    def isend(self, t: torch.Tensor, dst: int, tag: int = 0) -> Any:
        if not (self._pg_p2p and dst != self.rank and self._mine(t)):
            return super().isend(t, dst, tag)
        t = t.detach().contiguous()
        return Work(self._pg.send([t], dst, p2p_tag(self._p2p_mode, tag)), t,
                    lambda: self._p2p("send", t, "to", dst, tag))

    def irecv(self, t: torch.Tensor, src: int, tag: int = 0) -> Any:
        if not (self._pg_p2p and src != self.rank and self._mine(t)):
            return super().irecv(t, src, tag)
        if not t.is_contiguous():
            raise ValueError("receive buffer must be contiguous (data would land in a copy)")
        return Work(self._pg.recv([t], src, p2p_tag(self._p2p_mode, tag)), t,
                    lambda: self._p2p("receive", t, "from", src, tag))

    send = blocking_send
    recv = blocking_recv
    sendrecv = blocking_sendrecv

    # -- collectives ------------------------------------------------------------------------
    def _start_allreduce(self, t: torch.Tensor, op: str) -> Any:
        return pg_allreduce(self._pg, t, op, lambda: self._coll(f"allreduce ({op})", t))

    def allreduce(self, t: torch.Tensor, op: str = "sum") -> torch.Tensor:
        if not self._mine(t):
            return super().allreduce(t, op)
        self._start_allreduce(t, op).wait()
        return t

    def iallreduce(self, t: torch.Tensor) -> Any:
        if not self._mine(t):
            return super().iallreduce(t)
        return self._start_allreduce(t, "sum")

    def allgather(self, t: torch.Tensor) -> list[torch.Tensor]:
        if not self._mine(t):
            return super().allgather(t)
        return pg_allgather(self._pg, t, self.size, lambda: self._coll("allgather", t))

    def gather(self, t: torch.Tensor, root: int = 0) -> list[torch.Tensor] | None:
        if not self._mine(t):
            return super().gather(t, root)
        out = [torch.empty_like(t, memory_format=torch.contiguous_format)
               for _ in range(self.size)] if self.rank == root else None
        opts = dist.GatherOptions()
        opts.rootRank = root
        with watching(lambda: self._coll("gather", t)):
            self._pg.gather([out] if out is not None else [], [t.contiguous()], opts).wait()
        return out

    def bcast(self, t: torch.Tensor, root: int = 0) -> torch.Tensor:
        if not self._mine(t):
            return super().bcast(t, root)
        return pg_broadcast(self._pg, t, root, lambda: self._coll("broadcast", t))

    # -- sub-communicators: Comm.split / group / node build TorchComms through _sub -----------
    def free(self) -> None:
        """Release a sub-communicator: its process group, then its MPI communicator."""
        if self is not _world:
            self._pg = None
        super().free()

    def group(self, ranks: Sequence[int], tag: int = 0) -> TorchComm | None:
        sub = super().group(ranks, tag)
        assert sub is None or isinstance(sub, TorchComm)
        return sub


def _address(mpi: Comm) -> tuple[str, int, Any]:
    """Rank 0's store address (and its store), broadcast to every rank over MPI."""
    store = None
    if mpi.rank == 0:
        host = os.environ.get("MASTER_ADDR") or socket.gethostbyname(socket.gethostname())
        port = int(os.environ.get("MASTER_PORT", "0"))  # 0: the store picks a free port
        store = dist.TCPStore(host, port, mpi.size, True, _timeout(),
                              wait_for_workers=False)
        addr = (host, int(store.port))
    else:
        addr = None
    host, port = mpi.bcast_object(addr)
    if store is None:
        store = dist.TCPStore(host, port, mpi.size, False, _timeout())
    return host, port, store


def torch_world(backend: str | None = None, mpi: Comm | None = None) -> TorchComm:
    """Every rank of the job over torch.distributed (made once, then the same object).

    backend: "nccl" or "gloo"; None: nccl when this rank's current device is a GPU
    (fxpar.comm.device.bind ran first), else gloo."""
    global _world
    if _world is not None:
        return _world
    mpi = mpi if mpi is not None else Comm()
    if backend is None:
        backend = setting("torch_backend") or \
            ("nccl" if torch.cuda.is_available() and torch.cuda.is_initialized() else "gloo")
    if backend not in ("nccl", "gloo"):
        raise ValueError(f"torch.distributed backend {backend!r}: use 'nccl' (GPUs) or 'gloo'")
    _host, _port, store = _address(mpi)
    if not dist.is_initialized():
        dist.init_process_group(backend, store=store, rank=mpi.rank, world_size=mpi.size,
                                timeout=_timeout())
    elif (dist.get_rank(), dist.get_world_size()) != (mpi.rank, mpi.size):
        raise RuntimeError(f"torch.distributed is already initialised as rank "
                           f"{dist.get_rank()} of {dist.get_world_size()}, but MPI says "
                           f"{mpi.rank} of {mpi.size}: let fxpar initialise it")
    pg = dist.group.WORLD
    _world = TorchComm(mpi, pg, backend, store)
    return _world
