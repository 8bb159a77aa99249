"""Comm: the one small communication interface fxpar's runtime uses, over mpi4py.

CPU tensors go to MPI through their own memory (a NumPy view of the tensor's storage), with no
staging copy: a receive writes straight into the destination tensor. Buffers must therefore be
contiguous; send buffers that are not are made contiguous once (and said so in the docstring of
each call), receive buffers that are not are an error, because the data would land in a copy.

Device (CUDA) tensors take one of two routes, chosen once per communicator family:

* CUDA-aware MPI (:func:`fxpar.comm.device.cuda_aware_mpi`): the device buffer itself goes to MPI
  (through ``__cuda_array_interface__``/DLPack), after the current stream is synchronised so
  MPI reads finished data and writes into memory no queued kernel still uses.
* otherwise :class:`Staging`: sends copy into a pinned host buffer first; receives land in one and
  are copied into the device tensor when the request completes (``Request.wait``). Host buffers
  are pooled per (numel, dtype) so a training step reuses the same few.

CPU tensors skip all of that (one device-type test per call). ``Comm(stage=True)`` or
``FXPAR_FORCE_STAGING=1`` sends CPU tensors through :class:`Staging` too, so the staging logic is
tested on machines without a GPU.

Every call takes and returns torch tensors; MPI details (datatypes, IN_PLACE, requests) stay here.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from fxpar.comm.failfast import mpi
from fxpar.comm.route import BITCAST, Route, nothing
from fxpar.comm.watchdog import watching
from fxpar.core.messages import MPI_TAG_UB_MIN


def _mpi() -> Any:
    return mpi()  # imported lazily: analysis and inspect never need MPI


def _complete(req: Any, poll: float | None) -> None:
    """Wait for an MPI request: MPI's own wait (a busy loop), or with ``poll`` seconds, test it
    and sleep in between, leaving the core to a busy rank when ranks outnumber cores. (The sleep
    does not grow during a long wait: tried, sleeps growing to 10x ``poll`` made a file of
    GEMS/DP cases on 6 ranks 25 % slower, from messages found late.)"""
    if poll is None:
        req.Wait()
        return
    while not req.Test():
        time.sleep(poll)


class Request:
    """A pending nonblocking operation; keeps its buffer alive until :meth:`wait`, then runs
    ``done`` once (a staged receive's copy into the device tensor, returning host buffers)."""

    def __init__(self, req: Any, keep: object, done: Callable[[], None] | None = None,
                 what: Callable[[], str] = lambda: "a request", poll: float | None = None
                 ) -> None:
        self._req = req
        self._keep = keep
        self._done = done
        self._what = what
        self._poll = poll

    def wait(self) -> None:
        with watching(self._what):
            _complete(self._req, self._poll)
        self._finish()

    def test(self) -> bool:
        done = bool(self._req.Test())
        if done:
            self._finish()
        return done

    def _finish(self) -> None:
        self._keep = None
        if self._done is not None:
            done, self._done = self._done, None
            done()


class Comm:
    """A communicator: the world, or a sub-group made with :meth:`split` / :meth:`group`.

    stage: send every tensor, CPU ones included, through host staging buffers (default: the
    ``FXPAR_FORCE_STAGING`` environment variable); for testing the GPU path without a GPU."""

    def __init__(self, mpi_comm: Any = None, stage: bool | None = None,
                 route: Route | None = None, poll: float | None = None) -> None:
        self._c = mpi_comm if mpi_comm is not None else _mpi().COMM_WORLD
        self._route = route if route is not None else Route(stage, poll)

    def _sub(self, mpi_comm: Any) -> Comm:
        """A communicator over ``mpi_comm`` sharing this one's device route."""
        return Comm(mpi_comm, route=self._route)

    @property
    def rank(self) -> int:
        return int(self._c.Get_rank())

    def node_size(self) -> int:
        """How many ranks of this communicator share this rank's node (MPI's shared-memory
        split; a collective)."""
        local = self._c.Split_type(_mpi().COMM_TYPE_SHARED)
        try:
            return int(local.Get_size())
        finally:
            local.Free()

    @property
    def size(self) -> int:
        return int(self._c.Get_size())

    def world_ranks(self) -> tuple[int, ...]:
        """The world rank of each member, in this communicator's order."""
        mpi = _mpi()
        ranks = mpi.Group.Translate_ranks(self._c.Get_group(), list(range(self.size)),
                                          mpi.COMM_WORLD.Get_group())
        return tuple(int(r) for r in ranks)

    @property
    def tag_ub(self) -> int:
        """The largest message tag this MPI accepts (its ``MPI_TAG_UB`` attribute)."""
        ub = self._c.Get_attr(_mpi().TAG_UB)
        return int(ub) if ub is not None else MPI_TAG_UB_MIN

    # -- point to point ---------------------------------------------------------------------
    def _request(self, req: Any, buf: object, done: Callable[[], None],
                 what: Callable[[], str]) -> Request:
        return Request(req, buf, done, what, self._route.poll)

    def _wait(self, blocking: Callable[[], object], start: Callable[[], Any]) -> None:
        """Run MPI's blocking call, or with ``FXPAR_POLL`` start its nonblocking twin and
        poll it (fxpar.comm.route.Route.poll)."""
        if self._route.poll is None:
            blocking()
        else:
            _complete(start(), self._route.poll)

    def isend(self, t: torch.Tensor, dst: int, tag: int = 0) -> Request:
        """Start sending ``t`` to ``dst`` (a non-contiguous ``t`` is sent from a copy)."""
        buf, done = self._route.out(t)
        return self._request(self._c.Isend(buf, dest=dst, tag=tag), buf, done,
                             lambda: self._p2p("send", t, "to", dst, tag))

    def irecv(self, t: torch.Tensor, src: int, tag: int = 0) -> Request:
        """Start receiving into ``t`` (contiguous) from ``src``; ``t`` holds the data once the
        request's ``wait`` returned."""
        buf, done = self._route.into(t)
        return self._request(self._c.Irecv(buf, source=src, tag=tag), buf, done,
                             lambda: self._p2p("receive", t, "from", src, tag))

    def send(self, t: torch.Tensor, dst: int, tag: int = 0) -> None:
        with watching(lambda: self._p2p("send", t, "to", dst, tag)):
            self._send(t, dst, tag)

    def _send(self, t: torch.Tensor, dst: int, tag: int) -> None:
        buf, done = self._route.out(t)
        self._wait(lambda: self._c.Send(buf, dest=dst, tag=tag),
                   lambda: self._c.Isend(buf, dest=dst, tag=tag))
        done()

    def recv(self, t: torch.Tensor, src: int, tag: int = 0) -> torch.Tensor:
        with watching(lambda: self._p2p("receive", t, "from", src, tag)):
            return self._recv(t, src, tag)

    def _recv(self, t: torch.Tensor, src: int, tag: int) -> torch.Tensor:
        buf, done = self._route.into(t)
        self._wait(lambda: self._c.Recv(buf, source=src, tag=tag),
                   lambda: self._c.Irecv(buf, source=src, tag=tag))
        done()
        return t

    def sendrecv(self, send: torch.Tensor, dst: int, recv: torch.Tensor, src: int,
                 tag: int = 0) -> torch.Tensor:
        """Send ``send`` to ``dst`` while receiving into ``recv`` from ``src``."""
        with watching(lambda: self._p2p("receive", recv, "from", src, tag)):
            return self._sendrecv(send, dst, recv, src, tag)

    def _sendrecv(self, send: torch.Tensor, dst: int, recv: torch.Tensor, src: int,
                  tag: int) -> torch.Tensor:
        sbuf, sdone = self._route.out(send)
        rbuf, rdone = self._route.into(recv)
        if self._route.poll is None:
            self._c.Sendrecv(sbuf, dest=dst, sendtag=tag, recvbuf=rbuf, source=src, recvtag=tag)
        else:  # no Isendrecv (MPI 4; Open MPI 4 lacks it): a receive and a send, polled
            reqs = [self._c.Irecv(rbuf, source=src, tag=tag), self._c.Isend(sbuf, dest=dst,
                                                                            tag=tag)]
            for req in reqs:
                _complete(req, self._route.poll)
        sdone()
        rdone()
        return recv

    @staticmethod
    def waitall(requests: Sequence[Request]) -> None:
        for r in requests:
            r.wait()

    # -- collectives ------------------------------------------------------------------------
    def allreduce(self, t: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """In-place allreduce of ``t`` (sum, max or min); returns ``t``."""
        with watching(lambda: self._coll(f"allreduce ({op})", t)):
            return self._allreduce(t, op)

    def _allreduce(self, t: torch.Tensor, op: str) -> torch.Tensor:
        if t.dtype in BITCAST:
            # no MPI sum of bfloat16 / float16 (Open MPI: no float16 type): reduce in
            # float32, round once
            wide = t.float()
            self._allreduce(wide, op)
            return t.copy_(wide)
        mpi = _mpi()
        reduce = {"sum": mpi.SUM, "max": mpi.MAX, "min": mpi.MIN}[op]
        buf, done = self._route.inout(t)
        self._wait(lambda: self._c.Allreduce(mpi.IN_PLACE, buf, op=reduce),
                   lambda: self._c.Iallreduce(mpi.IN_PLACE, buf, op=reduce))
        done()
        return t

    def iallreduce(self, t: torch.Tensor) -> Request:
        """Start an in-place sum allreduce of ``t`` (bfloat16 / float16: of a float32 copy,
        rounded into ``t`` once it completes, as :meth:`allreduce` does)."""
        mpi = _mpi()
        wide = t.float() if t.dtype in BITCAST else t
        buf, land = self._route.inout(wide)

        def done() -> None:
            land()
            if wide is not t:
                t.copy_(wide)

        return self._request(self._c.Iallreduce(mpi.IN_PLACE, buf, op=mpi.SUM), buf, done,
                             lambda: self._coll("allreduce (sum)", t))

    def allgather(self, t: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's ``t`` (same shape on all ranks), in rank order, on ``t``'s device."""
        with watching(lambda: self._coll("allgather", t)):
            return self._allgather(t)

    def _allgather(self, t: torch.Tensor) -> list[torch.Tensor]:
        out = torch.empty((self.size, *t.shape), dtype=t.dtype, device=t.device)
        sbuf, sdone = self._route.out(t)
        rbuf, rdone = self._route.into(out)
        self._wait(lambda: self._c.Allgather(sbuf, rbuf), lambda: self._c.Iallgather(sbuf, rbuf))
        sdone()
        rdone()
        return list(out.unbind(0))

    def gather(self, t: torch.Tensor, root: int = 0) -> list[torch.Tensor] | None:
        """Every rank's ``t`` on ``root`` (in rank order); None elsewhere."""
        with watching(lambda: self._coll("gather", t)):
            return self._gather(t, root)

    def _gather(self, t: torch.Tensor, root: int) -> list[torch.Tensor] | None:
        out = torch.empty((self.size, *t.shape), dtype=t.dtype, device=t.device) \
            if self.rank == root else None
        sbuf, sdone = self._route.out(t)
        rbuf, rdone = self._route.into(out) if out is not None else (None, nothing)
        self._wait(lambda: self._c.Gather(sbuf, rbuf, root=root),
                   lambda: self._c.Igather(sbuf, rbuf, root=root))
        sdone()
        rdone()
        return list(out.unbind(0)) if out is not None else None

    def bcast(self, t: torch.Tensor, root: int = 0) -> torch.Tensor:
        """In-place broadcast of ``t`` from ``root``."""
        with watching(lambda: self._coll("broadcast", t)):
            return self._bcast(t, root)

    def _bcast(self, t: torch.Tensor, root: int) -> torch.Tensor:
        buf, done = self._route.inout(t) if self.rank == root else self._route.into(t)
        self._wait(lambda: self._c.Bcast(buf, root=root),
                   lambda: self._c.Ibcast(buf, root=root))
        done()
        return t

    def allgather_object(self, obj: object) -> list[Any]:
        """Every rank's picklable ``obj`` (for start-up checks, not for the hot path)."""
        with watching(lambda: self._coll("allgather of Python objects")):
            self._meet()
            return list(self._c.allgather(obj))

    def gather_object(self, obj: object, root: int = 0) -> list[Any] | None:
        with watching(lambda: self._coll("gather of Python objects")):
            self._meet()
            return self._c.gather(obj, root=root)

    def bcast_object(self, obj: object, root: int = 0) -> Any:
        with watching(lambda: self._coll("broadcast of Python objects")):
            self._meet()
            return self._c.bcast(obj, root=root)

    def _meet(self) -> None:
        """With ``FXPAR_POLL``, a polled barrier before an object collective (mpi4py has no
        nonblocking twin of those): ranks that arrive early, such as those waiting while
        rank 0 traces the model for them, sleep instead of spinning."""
        if self._route.poll is not None:
            _complete(self._c.Ibarrier(), self._route.poll)

    def barrier(self, poll: float | None = None) -> None:
        """Wait until every rank is here. ``poll``: test every ``poll`` seconds and sleep in
        between instead of MPI's busy wait, which gives the cores to the ranks still working
        when ranks outnumber cores (the test harness between cases)."""
        with watching(lambda: self._coll("barrier")):
            if poll is None:
                self._c.Barrier()
            else:
                _complete(self._c.Ibarrier(), poll)

    # -- descriptions for the watchdog (built only when it fires) -----------------------------
    def _world_rank(self, r: int) -> int:
        mpi = _mpi()
        try:
            return int(mpi.Group.Translate_ranks(self._c.Get_group(), [r],
                                                 mpi.COMM_WORLD.Get_group())[0])
        except Exception:  # noqa: BLE001 - a description must never fail
            return r

    def _p2p(self, verb: str, t: torch.Tensor, way: str, peer: int, tag: int) -> str:
        return (f"{verb} of {tuple(t.shape)} {str(t.dtype).removeprefix('torch.')} {way} "
                f"rank {self._world_rank(peer)} (tag {tag})")

    def _coll(self, what: str, t: torch.Tensor | None = None) -> str:
        ranks = [self._world_rank(r) for r in range(self.size)]
        shown = ", ".join(map(str, ranks[:8])) + (", ..." if len(ranks) > 8 else "")
        of = f" of {tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}" if t is not None \
            else ""
        return f"{what}{of} over ranks [{shown}]"

    # -- sub-communicators ------------------------------------------------------------------
    def split(self, color: int, key: int | None = None) -> Comm:
        """Ranks with the same ``color`` form a new communicator (collective on all ranks)."""
        with watching(lambda: self._coll("communicator split")):
            self._meet()
            return self._sub(self._c.Split(color, self.rank if key is None else key))

    def group(self, ranks: Sequence[int], tag: int = 0) -> Comm | None:
        """A communicator of ``ranks`` (in that order); collective over the ranks listed only.
        None on ranks not listed."""
        if self.rank not in ranks:
            return None
        grp = self._c.Get_group().Incl(list(ranks))
        with watching(lambda: f"creating a communicator of ranks {list(ranks)}"):
            return self._sub(self._c.Create_group(grp, tag=tag))

    def node(self) -> Comm:
        """The ranks of this communicator that share this node's memory, in rank order
        (collective on all ranks): its rank is the node-local rank GPUs are bound by."""
        mpi = _mpi()
        return self._sub(self._c.Split_type(mpi.COMM_TYPE_SHARED, key=self.rank))

    def free(self) -> None:
        """Release a sub-communicator this process made (never the world's). MPI counts it as
        collective over its ranks, but it waits for none of them: operations still pending on
        it complete first."""
        mpi = _mpi()
        if self._c not in (mpi.COMM_WORLD, mpi.COMM_SELF, mpi.COMM_NULL):
            self._c.Free()

    def abort(self, code: int = 1) -> None:
        """End the whole job now (every rank), flushing this rank's output first."""
        sys.stdout.flush()
        sys.stderr.flush()
        self._c.Abort(code)
        os._exit(code)  # MPI_Abort can return when every peer has already exited
