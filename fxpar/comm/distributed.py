"""Comm over torch.distributed alone, for jobs started by ``torchrun`` (no MPI in the process).

Selected by the launcher (fxpar.comm.launch: torchrun, or a bare ``RANK``/``WORLD_SIZE``/
``MASTER_ADDR`` environment) or by ``FXPAR_COMM=torch`` under ``srun`` without MPI. The ranks
meet at torch.distributed's own rendezvous (``init_process_group`` with ``env://``: torchrun's
agent store, or rank 0's store at ``MASTER_ADDR:MASTER_PORT``); every process group fxpar makes
then lives under its own prefix of that store.

What goes where:

* CPU tensors, pickled objects and barriers: a gloo process group (always there).
* CUDA tensors under NCCL (``FXPAR_TORCH_BACKEND=nccl``, default when the rank has a GPU):
  collectives and point-to-point on an NCCL process group over the same ranks, device to
  device. NCCL ignores tags and runs a pair's sends and receives in issue order, so fxpar
  issues them in an order both ends agree on (fxpar.comm.ordered, fxpar.core.wire).
  ``FXPAR_P2P=staged``: CUDA point-to-point through pinned host buffers over gloo instead;
  ``FXPAR_P2P=issue``: gloo ignores tags too (one tag for all), which tests that order on
  CPU.

Sub-communicators are collective over their members only, like MPI's ``MPI_Comm_create_group``:
each is named from its members, its tag and how many such groups this communicator made before
(the same count on every member), so no rank outside it takes part. ``split`` is collective
over every rank (it needs everyone's colour), then makes its groups the same way.

Ending the job: ``abort`` exits this process; torchrun's agent then stops every other worker.
Under ``srun`` that needs ``--kill-on-bad-exit=1`` (docs/clusters.md).
"""

from __future__ import annotations

import atexit
import os
import pickle
import socket
import sys
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _get_default_store

from fxpar.comm import launch
from fxpar.comm.ordered import Issued
from fxpar.comm.torch_dist import (
    Work,
    _process_group,
    _timeout,
    blocking_recv,
    blocking_send,
    blocking_sendrecv,
    p2p_mode,
    p2p_tag,
    pg_allgather,
    pg_allreduce,
    pg_broadcast,
)
from fxpar.comm.watchdog import watching
from fxpar.core.options import setting

TAG_UB = 2**31 - 1
_NARROW = (torch.bfloat16, torch.float16)
"""Reduced in float32 and rounded once (as fxpar.comm.mpi does)."""


class _Done:
    """A finished operation (a message to oneself)."""

    def wait(self) -> None:
        pass

    def test(self) -> bool:
        return True


class _Received:
    """A receive from oneself: filled by the matching send, which may come later."""

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t
        self.filled = False

    def wait(self) -> None:
        if not self.filled:
            raise RuntimeError(f"a receive of {tuple(self.t.shape)} from this rank itself was "
                               f"waited for before this rank sent it: it would never complete")

    def test(self) -> bool:
        return self.filled


class _Mailbox:
    """Messages a rank sends itself (gloo has no send to self), matched by tag in order."""

    def __init__(self) -> None:
        self._sent: dict[int, deque[torch.Tensor]] = {}
        self._waiting: dict[int, deque[_Received]] = {}

    def send(self, t: torch.Tensor, tag: int) -> _Done:
        waiting = self._waiting.get(tag)
        if waiting:
            r = waiting.popleft()
            r.t.copy_(t.detach())
            r.filled = True
        else:
            self._sent.setdefault(tag, deque()).append(t.detach().clone())
        return _Done()

    def recv(self, t: torch.Tensor, tag: int) -> _Received:
        r = _Received(t)
        sent = self._sent.get(tag)
        if sent:
            t.copy_(sent.popleft())
            r.filled = True
        else:
            self._waiting.setdefault(tag, deque()).append(r)
        return r


class DistComm:
    """A group of ranks over torch.distributed process groups (see the module doc).

    ranks: the world rank of each member, in this communicator's order; name: the store prefix
    its process groups rendezvous under."""

    def __init__(self, store: Any, rank: int, ranks: Sequence[int], name: str,
                 backend: str) -> None:
        self._store = store
        self._rank = rank
        self._ranks = tuple(ranks)
        self._name = name
        self.backend = backend
        self._cpu = _process_group(store, f"{name}/gloo/", rank, len(self._ranks), "gloo")
        self._dev = _process_group(store, f"{name}/nccl/", rank, len(self._ranks), "nccl") \
            if backend == "nccl" else None
        self._family: list[DistComm] = []
        """This communicator's sub-communicators (the world's: all), released at exit."""
        self._self = _Mailbox()
        self._mode = p2p_mode()
        """FXPAR_P2P: how point-to-point tensors travel (module doc)."""
        self._wire: list[Issued] = []
        """Under ``FXPAR_P2P=issue``: every tensor message the family issued, in order
        (:meth:`issued`)."""
        self._made: dict[object, int] = {}
        """Sub-communicators made so far, per (kind, members, tag): part of their names."""

    # -- who ------------------------------------------------------------------------------------
    @property
    def rank(self) -> int:
        return self._rank

    @property
    def size(self) -> int:
        return len(self._ranks)

    @property
    def tag_ub(self) -> int:
        return TAG_UB

    def world_ranks(self) -> tuple[int, ...]:
        return self._ranks

    def node_size(self) -> int:
        node = self.node()
        try:
            return node.size
        finally:
            node.free()

    def _pg(self, t: torch.Tensor) -> Any:
        if t.device.type == "meta":
            raise ValueError("a meta tensor has no data to communicate: materialise it first")
        return self._dev if self._dev is not None and t.device.type == "cuda" else self._cpu

    # -- point to point ---------------------------------------------------------------------
    def _nccl(self, t: torch.Tensor) -> bool:
        """A CUDA tensor's message goes device to device over NCCL (not staged)."""
        return t.device.type == "cuda" and self._dev is not None and self._mode != "staged"

    def issued(self) -> list[Issued]:
        """Under ``FXPAR_P2P=issue``, every tensor message this communicator's family issued,
        in issue order: (communicator name, this rank and the peer as world ranks, whether it
        is a send, the element count and dtype). NCCL carries a step only if, for each pair on
        each communicator, one end's i-th message is a send exactly where the other's is a
        receive of the same size (fxpar.comm.ordered.issue_problems)."""
        return list(self._wire)

    def _log(self, peer: int, send: bool, t: torch.Tensor) -> None:
        if self._mode == "issue":
            self._wire.append(Issued(self._name, self._ranks[self._rank], self._ranks[peer],
                                     send, t.numel(), str(t.dtype)))

    def isend(self, t: torch.Tensor, dst: int, tag: int = 0) -> Any:
        if dst == self._rank:
            return self._self.send(t, tag)
        self._log(dst, True, t)
        what = lambda: self._p2p("send", t, "to", dst, tag)  # noqa: E731
        src = t.detach().contiguous()
        if self._nccl(src):
            return Work(self._dev.send([src], dst, 0), src, what)  # NCCL ignores tags
        if src.device.type != "cpu":
            src = src.to("cpu")  # the host staging of a device tensor (module doc)
        return Work(self._cpu.send([src], dst, p2p_tag(self._mode, tag)), src, what)

    def irecv(self, t: torch.Tensor, src: int, tag: int = 0) -> Any:
        if not t.is_contiguous():
            raise ValueError("receive buffer must be contiguous (data would land in a copy)")
        if src == self._rank:
            return self._self.recv(t, tag)
        self._log(src, False, t)
        what = lambda: self._p2p("receive", t, "from", src, tag)  # noqa: E731
        if self._nccl(t):
            return Work(self._dev.recv([t], src, 0), t, what)
        if t.device.type == "cpu":
            return Work(self._cpu.recv([t], src, p2p_tag(self._mode, tag)), t, what)
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=t.device.type == "cuda")
        return Work(self._cpu.recv([host], src, p2p_tag(self._mode, tag)), host, what,
                    done=lambda: t.copy_(host))

    send = blocking_send
    recv = blocking_recv
    sendrecv = blocking_sendrecv

    @staticmethod
    def waitall(requests: Sequence[Any]) -> None:
        for r in requests:
            r.wait()

    # -- collectives ------------------------------------------------------------------------
    def _start_allreduce(self, t: torch.Tensor, op: str) -> Any:
        return pg_allreduce(self._pg(t), t, op, lambda: self._coll(f"allreduce ({op})", t),
                            wide=torch.float32 if t.dtype in _NARROW else None)

    def allreduce(self, t: torch.Tensor, op: str = "sum") -> torch.Tensor:
        self._start_allreduce(t, op).wait()
        return t

    def iallreduce(self, t: torch.Tensor) -> Any:
        return self._start_allreduce(t, "sum")

    def allgather(self, t: torch.Tensor) -> list[torch.Tensor]:
        return pg_allgather(self._pg(t), t, self.size, lambda: self._coll("allgather", t))

    def gather(self, t: torch.Tensor, root: int = 0) -> list[torch.Tensor] | None:
        everyone = self.allgather(t)  # gloo and NCCL alike; gathers are start-up only
        return everyone if self._rank == root else None

    def bcast(self, t: torch.Tensor, root: int = 0) -> torch.Tensor:
        return pg_broadcast(self._pg(t), t, root, lambda: self._coll("broadcast", t))

    def allgather_object(self, obj: object) -> list[Any]:
        """Every rank's picklable ``obj``: the sizes, then the padded bytes, over gloo."""
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        sizes = self.allgather(torch.tensor([data.numel()], dtype=torch.int64))
        longest = max(int(s) for s in sizes)
        padded = torch.zeros(longest, dtype=torch.uint8)
        padded[:data.numel()] = data
        everyone = self.allgather(padded)
        return [pickle.loads(bytes(b[:int(n)].numpy()))  # noqa: S301 - our own ranks' objects
                for b, n in zip(everyone, sizes, strict=True)]

    def gather_object(self, obj: object, root: int = 0) -> list[Any] | None:
        everyone = self.allgather_object(obj)
        return everyone if self._rank == root else None

    def bcast_object(self, obj: object, root: int = 0) -> Any:
        return self.allgather_object(obj if self._rank == root else None)[root]

    def barrier(self, poll: float | None = None) -> None:
        """Every rank here (an allreduce over gloo); ``poll``: test it every ``poll`` seconds
        and sleep in between."""
        flag = torch.zeros(1)
        work = self._cpu.allreduce([flag])
        with watching(lambda: self._coll("barrier")):
            if poll is not None:
                while not work.is_completed():
                    time.sleep(poll)
            work.wait()

    # -- sub-communicators ------------------------------------------------------------------
    def _make(self, kind: str, members: Sequence[int], tag: int) -> DistComm:
        key = (kind, tuple(members), tag)
        count = self._made.get(key, 0)
        self._made[key] = count + 1
        name = f"{self._name}/{kind}-{'.'.join(map(str, members))}-t{tag}-{count}"
        with watching(lambda: f"creating a communicator of ranks {list(members)}"):
            sub = DistComm(self._store, list(members).index(self._rank),
                           [self._ranks[m] for m in members], name, self.backend)
        sub._family = self._family  # one list for the whole family
        sub._wire = self._wire
        self._family.append(sub)
        return sub

    def split(self, color: int, key: int | None = None) -> DistComm:
        everyone = self.allgather_object((color, self._rank if key is None else key))
        members = sorted((k, r) for r, (c, k) in enumerate(everyone) if c == color)
        return self._make(f"split{color}", [r for _, r in members], 0)

    def group(self, ranks: Sequence[int], tag: int = 0) -> DistComm | None:
        if self._rank not in ranks:
            return None
        return self._make("group", list(ranks), tag)

    def node(self) -> DistComm:
        hosts = self.allgather_object(socket.gethostname())
        return self.split(sorted(set(hosts)).index(hosts[self._rank]))

    def free(self) -> None:
        self._cpu = self._dev = None

    def close(self) -> None:
        """At the end of the process: wait for every rank, then release every process group of
        the family (gloo's connections closing under a peer that still uses them abort the
        process: "terminate called without an active exception")."""
        if self._cpu is not None:
            self.barrier(poll=0.01)
        for sub in reversed(self._family):
            sub.free()
        self._family.clear()
        self.free()
        if dist.is_initialized():
            dist.destroy_process_group()

    def abort(self, code: int = 1) -> None:
        """End this process now; the launcher (torchrun's agent, ``srun
        --kill-on-bad-exit=1``) ends the others."""
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)

    # -- descriptions for the watchdog --------------------------------------------------------
    def _p2p(self, verb: str, t: torch.Tensor, way: str, peer: int, tag: int) -> str:
        return (f"{verb} of {tuple(t.shape)} {str(t.dtype).removeprefix('torch.')} {way} "
                f"rank {self._ranks[peer]} (tag {tag})")

    def _coll(self, what: str, t: torch.Tensor | None = None) -> str:
        shown = ", ".join(map(str, self._ranks[:8])) + (", ..." if self.size > 8 else "")
        of = f" of {tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}" if t is not None \
            else ""
        return f"{what}{of} over ranks [{shown}]"


def _backend() -> str:
    backend = setting("torch_backend") or \
        ("nccl" if torch.cuda.is_available() and torch.cuda.is_initialized() else "gloo")
    if backend not in ("nccl", "gloo"):
        raise ValueError(f"FXPAR_TORCH_BACKEND={backend!r}: use 'nccl' (GPUs) or 'gloo'")
    return backend


_world: DistComm | None = None


def dist_world() -> DistComm:
    """Every rank of a job started by torchrun (or another torch.distributed launcher).

    Joins torch.distributed's default process group first (``env://``), so the user's own
    ``torch.distributed`` calls work beside fxpar's, then builds fxpar's groups on its store.
    Made once per process, then the same object."""
    global _world
    if _world is not None:
        return _world
    found = launch.detect()
    if found is None or not found.size:
        raise RuntimeError(
            "FXPAR_COMM=torch without mpiexec needs a torch.distributed launcher: start the job "
            "with `torchrun --nproc-per-node N ...`, or set RANK, WORLD_SIZE, MASTER_ADDR and "
            "MASTER_PORT (srun: see docs/clusters.md)")
    backend = _backend()
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_PORT", "29500")
        dist.init_process_group("cpu:gloo,cuda:nccl" if backend == "nccl" else "gloo",
                                init_method="env://", rank=found.rank,
                                world_size=found.size, timeout=_timeout())
    if (dist.get_rank(), dist.get_world_size()) != (found.rank, found.size):
        raise RuntimeError(f"torch.distributed is initialised as rank {dist.get_rank()} of "
                           f"{dist.get_world_size()}, but {found.name} says {found.rank} of "
                           f"{found.size}: let fxpar initialise it")
    _world = DistComm(_get_default_store(), found.rank, range(found.size), "fxpar", backend)
    atexit.register(_world.close)
    return _world
