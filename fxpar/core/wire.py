"""The order on the wire: one sequence of point-to-point messages per pair of ranks, which both
ends issue in the same order.

MPI and gloo match a receive to a send by (source, tag), so a rank may post its receives early
and its sends late, in any order. NCCL ignores tags: between two ranks, the i-th send of one
meets the i-th receive of the other, and each pair's operations run one after another on one
stream, so two ranks that both start with a receive from each other wait forever. The pipeline
runtime posts receives before the compute that precedes them (fxpar.runtime.loop), so its
issue order is not one both ends share.

:func:`agreed_order` derives the sequence from the compile-time simulation of every rank's step
(fxpar.core.lowering.check): the order in which the messages between two ranks matched there.
Each rank then issues its messages to a peer in that order (fxpar.comm.ordered.Sequencer holds
one posted early until those before it are issued). :func:`check_order` runs every rank's
step again the way NCCL would -- a message between two ranks completes when both have issued
it and every message before it in their sequence -- and raises ScheduleError if any rank would
then wait forever, so a schedule this order cannot carry fails at compile time, not on the
cluster.

Halo exchanges inside a spatial stage need no table: every tile posts all its messages of one
exchange at once, and :func:`first_sends` says which end of each pair sends first.
"""

from __future__ import annotations

from dataclasses import dataclass

from fxpar.core.lowering import Channel, Lowered, Meetings, Op, check
from fxpar.core.schedule import Schedule, ScheduleError

Entry = tuple[bool, int]
"""One message of a pair as one end sees it: (this rank sends it, its tag)."""
Order = dict[int, tuple[Entry, ...]]
"""peer -> the messages between this rank and that peer, in the order both issue them."""
Pair = tuple[int, int]


def first_sends(me: int, peer: int) -> bool:
    """In an exchange where both ranks of a pair send and receive at once, the lower rank
    issues its send first and the higher its receive first."""
    return me < peer


def _pair(a: int, b: int) -> Pair:
    return (a, b) if a < b else (b, a)


def sequences(lowered: Lowered, schedule: Schedule | None = None
              ) -> dict[Pair, list[Channel]]:
    """Each pair's messages, (source, destination, tag), in the order they matched in the
    simulation of every rank's step (messages a rank sends itself are not on the wire and
    keep their tags). Raises ScheduleError where fxpar.core.lowering.check does (``schedule``
    adds the grid to the message)."""
    matched: list[Channel] = []
    check(lowered, schedule, matches=matched)
    out: dict[Pair, list[Channel]] = {}
    for ch in matched:
        if ch[0] == ch[1]:
            continue  # a message to oneself: matched by tag, never on the wire
        out.setdefault(_pair(ch[0], ch[1]), []).append(ch)
    return out


def agreed_order(lowered: Lowered, schedule: Schedule | None = None) -> dict[int, Order]:
    """Every rank's :data:`Order`, checked with fxpar.core.lowering.check (matching and
    deadlock with MPI's tags) and :func:`check_order` (in NCCL's issue order)."""
    seqs = sequences(lowered, schedule)
    check_order(lowered, seqs)
    orders: dict[int, Order] = {r: {} for r in lowered}
    for (a, b), seq in seqs.items():
        for me, peer in ((a, b), (b, a)):
            orders.setdefault(me, {})[peer] = tuple((src == me, tag) for src, _, tag in seq)
    return orders


@dataclass
class _Pairs:
    """The issue-order state of every pair: which sequence entries each end has reached, and
    how many have completed."""

    seqs: dict[Pair, list[Channel]]

    def __post_init__(self) -> None:
        self.index = {ch: (p, k) for p, seq in self.seqs.items() for k, ch in enumerate(seq)}
        self.reached: dict[tuple[int, Pair], set[int]] = {}
        self.done = dict.fromkeys(self.seqs, 0)

    def reach(self, rank: int, op: Op) -> tuple[Pair, int]:
        """``rank`` issues ``op`` (a send or receive): its pair and place in the sequence."""
        ch = (rank, op.peer, op.tag) if op.kind == "send" else (op.peer, rank, op.tag)
        if ch not in self.index:
            raise ScheduleError(f"rank {rank}'s {op} is not in the order agreed with rank "
                                f"{op.peer}")
        p, k = self.index[ch]
        self.reached.setdefault((rank, p), set()).add(k)
        a, b = p
        seq = self.seqs[p]
        while self.done[p] < len(seq) and self.done[p] in self.reached.get((a, p), ()) \
                and self.done[p] in self.reached.get((b, p), ()):
            self.done[p] += 1
        return p, k


def check_order(lowered: Lowered, seqs: dict[Pair, list[Channel]]) -> None:
    """Run every rank's step with messages that complete in each pair's sequence order (as
    NCCL runs them); raise ScheduleError when a rank would wait forever. Sends never block a
    rank; a receive blocks where its RECV action stands (the runtime waits later, so what
    passes here also runs); collectives block until every member reaches them."""
    pairs = _Pairs(seqs)
    meetings = Meetings()
    pc = dict.fromkeys(lowered, 0)
    waiting: dict[int, tuple[Pair, int]] = {}
    progress = True
    while progress:
        progress = False
        for r, ops in lowered.items():
            while pc[r] < len(ops):
                op = ops[pc[r]]
                if op.kind in ("send", "recv") and op.peer == r:
                    pc[r] += 1  # to oneself: check() matched it already
                    progress = True
                    continue
                if op.kind in ("send", "recv"):
                    if r not in waiting:
                        waiting[r] = pairs.reach(r, op)
                        progress = True
                    p, k = waiting[r]
                    if op.kind == "recv" and pairs.done[p] <= k:
                        break
                    del waiting[r]
                    pc[r] += 1
                    progress = True
                    continue
                if not meetings.arrive(r, op):  # no Clash: check() ran first
                    break
                for m in op.group:
                    pc[m] += 1
                progress = True
    stuck = [r for r in lowered if pc[r] < len(lowered[r])]
    if stuck:
        lines = [f"rank {r} waits at {lowered[r][pc[r]]}" for r in stuck[:8]]
        raise ScheduleError("the point-to-point messages have no order both ends of every "
                            "pair can issue them in (NCCL matches them in issue order):\n  "
                            + "\n  ".join(lines))
    behind = [p for p, seq in seqs.items() if pairs.done[p] < len(seq)]
    if behind:
        raise ScheduleError(f"messages between ranks {behind[:4]} never complete in their "
                            f"agreed order")
