"""Lowering: every rank's communication for one step, as data, simulated at compile time.

Each action of a rank's list becomes the operations it performs on the wire:

    SEND_F / SEND_B   a send per message (fxpar.core.messages: peer rank, MPI tag, shape)
    RECV_F / RECV_B   a receive per message
    F / B             of a spatial stage: one collective over its tile group (the halo
                      exchanges, BatchNorm and mean allreduces inside it are between the tiles,
                      so every tile must run the same F/B in the same order)
    ALLREDUCE         one collective per stage group of more than one rank the rank holds, in
                      stage order (the gradient sum and BatchNorm-statistics merge)

:func:`check` runs all ranks' lists together: sends never block (the runtime's are
``isend``), a receive waits for its send (same source, destination and tag; MPI matches
them in order, and the shapes must agree), a collective waits until every member of its
communicator has reached it, and two ranks at different collectives of one communicator are
an error. A program that would hang or cross its messages fails here, at compile time, with
the ranks and actions named, instead of under ``mpiexec``.

A receive is taken to block where its RECV action stands, although the runtime posts it early
and waits only in the compute action that needs it: a schedule that passes here also runs.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from fxpar.core.geometry import Grid
from fxpar.core.messages import Message, messages
from fxpar.core.plan import RankMap
from fxpar.core.roles import chunks_per_copy, stage_groups
from fxpar.core.schedule import Action, Schedule, ScheduleError, format_grid
from fxpar.core.stages import StageGraph


@dataclass(frozen=True)
class Op:
    """One operation of a rank on the wire, from the action at ``step`` of its list."""

    kind: str
    """"send", "recv" or "coll"."""
    step: int
    action: Action
    peer: int = -1
    """send / recv: the other rank (world rank)."""
    tag: int = -1
    shape: tuple[int, ...] = ()
    comm: str = ""
    """coll: the communicator it runs on ("tiles c0s0 dp0", "stage 1")."""
    group: tuple[int, ...] = ()
    """coll: its ranks."""

    def __str__(self) -> str:
        if self.kind == "send":
            return f"{self.action} (to rank {self.peer}, tag {self.tag})"
        if self.kind == "recv":
            return f"{self.action} (from rank {self.peer}, tag {self.tag})"
        return f"{self.action} (collective on {self.comm}, ranks {list(self.group)})"


Lowered = dict[int, list[Op]]


def lower(schedule: Schedule, graph: StageGraph, rank_map: RankMap,
          grid: Grid | None = None) -> Lowered:
    """Every rank's operations for one step, in order; ``grid``: the spatial stages' tile grid
    (None: no spatial stages). Raises ScheduleError when a rank runs an F (B) before the
    RECV_F (RECV_B) that brings its inputs (gradients)."""
    plan = rank_map.plan
    if not plan.spatial:
        grid = None
    spatial_stages = plan.spatial_stages if plan.spatial else 0
    mbs = chunks_per_copy(plan)
    held = stage_groups(rank_map)
    groups: dict[tuple[int, int, int], tuple[int, ...]] = {}  # each made once, then shared
    said: dict[tuple[Action, int], list[Message]] = {}  # the same for every data-parallel copy

    def messages_of(a: Action, tile: int) -> list[Message]:
        if (a, tile) not in said:
            said[(a, tile)] = messages(a, graph, mbs, grid, spatial_stages, tile)
        return said[(a, tile)]

    out: Lowered = {}
    for r, acts in schedule.items():
        dp = rank_map.dp_index(r)
        roles = rank_map.roles_of(r)
        tiles = {role.copy: role.tile for role in roles}
        ops: list[Op] = []
        posted: set[Action] = set()
        for i, a in enumerate(acts):
            if a.kind in ("F", "B"):  # its inputs (gradients) must have been received
                recv = a._replace(kind="RECV_" + a.kind)
                if recv not in posted and messages_of(recv, tiles.get(a.copy, 0)):
                    _fail(f"rank {r} runs {a} before receiving its inputs ({recv})",
                          schedule, [(r, i)])
            if a.kind in ("SEND_F", "RECV_F", "SEND_B", "RECV_B"):
                posted.add(a)
                kind = "send" if a.kind.startswith("SEND") else "recv"
                for m in messages_of(a, tiles.get(a.copy, 0)):
                    peer = rank_map.rank_of(dp, a.copy, m.stage, m.tile)
                    ops.append(Op(kind, i, a, peer, m.tag, m.shape))
            elif a.kind in ("F", "B") and plan.group_size(a.stage) > 1:
                key = (dp, a.copy, a.stage)
                if key not in groups:
                    groups[key] = rank_map.group(*key)
                ops.append(Op("coll", i, a, comm=f"tiles c{a.copy}s{a.stage} dp{dp}",
                              group=groups[key]))
            elif a.kind == "ALLREDUCE":
                for s in sorted({role.stage for role in roles}):
                    if len(held[s]) > 1:
                        ops.append(Op("coll", i, a, comm=f"stage {s}", group=held[s]))
        out[r] = ops
    return out


Channel = tuple[int, int, int]  # (source, destination, tag)


class Clash(Exception):
    """A rank reached another collective of a communicator than the one its other members
    are entering."""

    def __init__(self, rank: int, op: Op) -> None:
        super().__init__(rank, op)
        self.rank = rank
        self.op = op


class Meetings:
    """The collective each communicator's members are entering (one at a time: they leave it
    together) and who has reached it, so a rank arriving costs O(1), not a look at every
    member (plans of thousands of ranks)."""

    def __init__(self) -> None:
        self._at: dict[str, tuple[Op, int, set[int]]] = {}

    def arrive(self, r: int, op: Op) -> bool:
        """Rank ``r`` reaches collective ``op`` (again, while it waits: counted once). True
        when every member has: the meeting is over and they all go on. Raises
        :class:`Clash` with a member waiting at another collective of ``op.comm``."""
        first_op, first, present = self._at.setdefault(op.comm, (op, r, set()))
        if first_op.action != op.action:
            raise Clash(first, first_op)
        present.add(r)
        if len(present) < len(op.group):
            return False
        del self._at[op.comm]
        return True


def check(lowered: Lowered, schedule: Schedule | None = None,
          matches: list[Channel] | None = None) -> int:
    """Run every rank's operations together; raise ScheduleError on a deadlock, a message
    that is never received, a shape mismatch or ranks at different collectives of one
    communicator. ``schedule`` (the action lists) adds the step x rank grid of the ranks
    involved to the message. Returns the number of messages matched; ``matches``, when
    given, gets each message's (source, destination, tag) in the order they matched."""
    pc = {r: 0 for r in lowered}
    flight: dict[Channel, deque[Op]] = {}
    matched = 0
    meetings = Meetings()

    def head(r: int) -> Op | None:
        ops = lowered.get(r, [])
        return ops[pc[r]] if pc.get(r, 0) < len(ops) else None

    progress = True
    while progress:
        progress = False
        for r, ops in lowered.items():
            while pc[r] < len(ops):
                op = ops[pc[r]]
                if op.kind == "send":
                    flight.setdefault((r, op.peer, op.tag), deque()).append(op)
                elif op.kind == "recv":
                    q = flight.get((op.peer, r, op.tag))
                    if not q:
                        break
                    sent = q.popleft()
                    if sent.shape != op.shape:
                        _fail(f"rank {op.peer} sends {sent} of shape {sent.shape} but rank "
                              f"{r} receives it at {op} as shape {op.shape}",
                              schedule, [(op.peer, sent.step), (r, op.step)])
                    matched += 1
                    if matches is not None:
                        matches.append((op.peer, r, op.tag))
                else:
                    if r not in op.group:
                        _fail(f"rank {r} enters {op} without being one of its ranks",
                              schedule, [(r, op.step)])
                    try:
                        if not meetings.arrive(r, op):
                            break
                    except Clash as c:
                        (a, x), (b, y) = sorted([(r, op), (c.rank, c.op)], key=lambda e: e[0])
                        _fail(f"ranks of one communicator are at different collectives: "
                              f"rank {a} at {x}, rank {b} at {y}",
                              schedule, [(a, x.step), (b, y.step)])
                    for m in op.group:
                        pc[m] += 1
                    progress = True
                    continue
                pc[r] += 1
                progress = True
    stuck = [r for r in lowered if head(r) is not None]
    lost = [op for q in flight.values() for op in q]
    if stuck:
        lines = [_waits(r, head(r), head, lowered) for r in stuck]  # type: ignore[arg-type]
        if lost:
            lines.append("sent and never received: " + "; ".join(
                f"rank {_sender(lowered, op)}'s {op}" for op in lost[:8]))
        cells = [(r, head(r).step) for r in stuck]  # type: ignore[union-attr]
        _fail("deadlock, no rank can go on:\n  " + "\n  ".join(lines[:16]), schedule, cells)
    if lost:
        _fail("messages sent and never received: " + "; ".join(
            f"rank {_sender(lowered, op)}'s {op}" for op in lost[:8]), schedule,
            [(_sender(lowered, op), op.step) for op in lost])
    return matched


def _sender(lowered: Lowered, op: Op) -> int:
    return next(r for r, ops in lowered.items() if any(o is op for o in ops))


def _waits(r: int, op: Op, at: Callable[[int], Op | None], lowered: Lowered) -> str:
    """'rank r waits at X' and what the ranks it waits for are doing (``at(rank)``: the op a
    rank is at, None once it finished its step)."""
    if op.kind == "recv":
        other = at(op.peer)
        doing = f"rank {op.peer} waits at {other}" if other is not None else \
            f"rank {op.peer} finished its step without sending it"
        return f"rank {r} waits at {op}, while {doing}"
    behind = [m for m in op.group if m != r and not _same(at(m), op)]
    done = [m for m in behind if at(m) is None]
    elsewhere = [f"rank {m} at {at(m)}" for m in behind if at(m) is not None]
    parts = elsewhere[:3] + ([f"ranks {done} finished their step without entering it"]
                             if done else [])
    return f"rank {r} waits at {op}, while " + "; ".join(parts)


def _same(h: Op | None, op: Op) -> bool:
    return h is not None and h.kind == "coll" and h.comm == op.comm and h.action == op.action


def _fail(text: str, schedule: Schedule | None, cells: list[tuple[int, int]]) -> None:
    """Raise ScheduleError with ``text`` and the grid of the ranks involved (at most 8), the
    first cell marked."""
    if schedule is not None and cells:
        ranks = sorted({r for r, _ in cells})[:8]
        grid = format_grid({r: schedule[r] for r in ranks}, mark=cells[0])
        text += "\n" + grid
    raise ScheduleError(text)
