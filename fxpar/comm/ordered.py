"""Point-to-point messages issued in the order both ends agree on (fxpar.core.wire), so a
backend that matches them in issue order and ignores tags (NCCL) carries them as MPI would.

* :class:`Sequencer`: the pipeline runtime's messages of one step. A message posted before
  those that come first in its pair's agreed order is held, and issued as soon as they are.
* :func:`exchange`: a halo exchange, every message of which is posted at once: to each peer,
  the lower rank sends first and the higher receives first.

Both are used with every backend (MPI and gloo match by tag and do not need them), so the
order is exercised wherever the tests run; ``FXPAR_P2P=issue`` makes gloo ignore tags as NCCL
does, and a message issued out of order then lands in the wrong buffer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

from fxpar.comm.protocol import Comm, Pending
from fxpar.core.wire import Entry, Order, first_sends


class _Slot:
    """One message of the step: issued now or held until those before it are."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.req: Pending | None = None

    def wait(self) -> None:
        if self.req is None:
            raise RuntimeError(f"the runtime waits for {self.what} before issuing the "
                               f"messages that come first in the order agreed with that peer "
                               f"(fxpar.core.wire): a bug in fxpar's schedule")
        self.req.wait()

    def test(self) -> bool:
        return self.req is not None and self.req.test()


class Sequencer:
    """One rank's point-to-point messages of one step, issued to each peer in ``order``
    (fxpar.core.wire.Order, computed for this rank's action list)."""

    def __init__(self, comm: Comm, order: Order) -> None:
        self.comm = comm
        self.order = order
        self._next = dict.fromkeys(order, 0)
        """peer -> how many of its messages are issued."""
        self._known = {peer: frozenset(seq) for peer, seq in order.items()}
        """peer -> its messages, to check a posted one without a scan per message."""
        self._held: dict[int, dict[Entry, tuple[_Slot, Callable[[], Pending]]]] = {}

    def isend(self, t: torch.Tensor, peer: int, tag: int) -> Pending:
        return self._post(peer, (True, tag), f"the send of tag {tag} to rank {peer}",
                          lambda: self.comm.isend(t, peer, tag))

    def irecv(self, t: torch.Tensor, peer: int, tag: int) -> Pending:
        return self._post(peer, (False, tag), f"the receive of tag {tag} from rank {peer}",
                          lambda: self.comm.irecv(t, peer, tag))

    def _post(self, peer: int, entry: Entry, what: str, issue: Callable[[], Pending]
              ) -> Pending:
        if peer == self.comm.rank:  # to oneself: matched by tag, never on the wire
            return issue()
        seq = self.order.get(peer, ())
        if entry not in self._known.get(peer, ()):
            raise RuntimeError(f"{what} is not in the order agreed with that peer "
                               f"(fxpar.core.wire): a bug in fxpar's schedule")
        slot = _Slot(what)
        self._held.setdefault(peer, {})[entry] = (slot, issue)
        held = self._held[peer]
        while self._next[peer] < len(seq) and seq[self._next[peer]] in held:
            ready, go = held.pop(seq[self._next[peer]])
            ready.req = go()
            self._next[peer] += 1
        return slot

    def unissued(self) -> list[str]:
        """The messages of the step this rank has not issued yet (none at its end)."""
        return [f"{'send to' if s else 'receive from'} rank {peer} (tag {tag})"
                for peer, seq in self.order.items() for s, tag in seq[self._next[peer]:]]


def exchange(comm: Comm, recvs: Sequence[tuple[int, torch.Tensor]],
             sends: Sequence[tuple[int, torch.Tensor]], tag: int) -> list[Pending]:
    """Post a receive into each ``(source, buffer)`` and a send of each ``(destination,
    tensor)``, per peer in the order both ends agree on (fxpar.core.wire.first_sends);
    several messages to one peer keep the order they are listed in, on both ends."""
    reqs: list[Pending] = []
    for peer in sorted({p for p, _ in recvs} | {p for p, _ in sends}):
        out = [t for p, t in sends if p == peer]
        into = [buf for p, buf in recvs if p == peer]
        if first_sends(comm.rank, peer):
            reqs += [comm.isend(t, peer, tag) for t in out]
            reqs += [comm.irecv(buf, peer, tag) for buf in into]
        else:
            reqs += [comm.irecv(buf, peer, tag) for buf in into]
            reqs += [comm.isend(t, peer, tag) for t in out]
    return reqs


class Issued(NamedTuple):
    """One tensor message as a rank issued it (fxpar.comm.distributed.DistComm.issued)."""

    comm: str
    """The communicator's name (each is its own NCCL communicator)."""
    me: int
    peer: int
    """World ranks."""
    send: bool
    numel: int
    dtype: str


def issue_problems(everyone: Sequence[Sequence[Issued]]) -> list[str]:
    """Where the ranks' issue logs (one per rank) break what NCCL needs: on each communicator,
    between each pair, one end's i-th message a send exactly where the other's is a receive
    of the same count and dtype, and as many on both ends. Empty: every pair agrees."""
    lanes: dict[tuple[str, int, int], list[Issued]] = {}
    for log in everyone:
        for m in log:
            lanes.setdefault((m.comm, m.me, m.peer), []).append(m)
    problems = []
    for (comm, a, b), mine in sorted(lanes.items()):
        if a > b:
            continue
        theirs = lanes.get((comm, b, a), [])
        if len(mine) != len(theirs):
            problems.append(f"{comm}: rank {a} issued {len(mine)} messages with rank {b}, "
                            f"which issued {len(theirs)}")
        for i, (x, y) in enumerate(zip(mine, theirs, strict=False)):
            if x.send == y.send or (x.numel, x.dtype) != (y.numel, y.dtype):
                problems.append(
                    f"{comm}: message {i} between ranks {a} and {b}: rank {a} "
                    f"{'sends' if x.send else 'receives'} {x.numel} {x.dtype}, rank {b} "
                    f"{'sends' if y.send else 'receives'} {y.numel} {y.dtype}")
                break
    return problems
