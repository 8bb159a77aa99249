"""Schedules as data: what each rank does in one training step, as a list of Actions.

An :class:`Action` is a small value with a compact text form that parses back::

    0F1      stage 0, forward, micro-batch 1            (copy 0)
    2B0      stage 2, backward, micro-batch 0 (with a 2W0 in the list: input gradients only)
    2W0      stage 2, weight gradients of micro-batch 0 (zero-bubble schedules: deferrable)
    1SEND_F3 stage 1 sends its forward output of micro-batch 3
    c1.0F0   copy 1 (the GEMS mirror) of stage 0, forward, micro-batch 0
    STEP     optimizer step

A schedule is ``dict[rank, list[Action]]``; generators are pure functions of the plan and the
runtime is one loop over a rank's list.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

KINDS = ("F", "B", "W", "SEND_F", "RECV_F", "SEND_B", "RECV_B", "ALLREDUCE", "STEP")
_PATTERN = re.compile(r"^(?:c(\d+)\.)?(\d+)(SEND_F|RECV_F|SEND_B|RECV_B|F|B|W)(\d+)$")


class ScheduleError(RuntimeError):
    """A schedule that breaks a rule or deadlocks; the message names the actions."""


class Action(NamedTuple):
    """One thing a rank does: ``kind`` for micro-batch ``mb`` of ``stage`` of model ``copy``."""

    kind: str
    stage: int = -1
    mb: int = -1
    copy: int = 0

    def __str__(self) -> str:
        if self.kind in ("STEP", "ALLREDUCE"):
            return self.kind if self.stage < 0 else f"{self.kind}{self.stage}"
        prefix = f"c{self.copy}." if self.copy else ""
        return f"{prefix}{self.stage}{self.kind}{self.mb}"

    __repr__ = __str__

    @staticmethod
    def from_str(text: str) -> Action:
        """Parse the compact form back (``Action.from_str(str(a)) == a``)."""
        text = text.strip()
        for kind in ("STEP", "ALLREDUCE"):
            if text.startswith(kind):
                rest = text[len(kind):]
                return Action(kind, int(rest) if rest else -1)
        m = _PATTERN.match(text)
        if not m:
            raise ValueError(f"not an action: {text!r} (expected e.g. '0F1', 'c1.2B0', 'STEP')")
        copy, stage, kind, mb = m.groups()
        return Action(kind, int(stage), int(mb), int(copy or 0))


Schedule = dict[int, list[Action]]


def split_keys(lists: Iterable[Sequence[Action]]) -> frozenset[tuple[int, int, int]]:
    """(copy, stage, micro-batch) of every backward that ``lists`` (a schedule's action lists)
    split into B (input gradients) and W (weight gradients): those with a W."""
    return frozenset((a.copy, a.stage, a.mb) for acts in lists for a in acts if a.kind == "W")


# Generators give, per stage, the compute order (F and B only); `lower` adds communication and
# the optimizer step, and places the lists on ranks.
#
# m: micro-batches, S: stages, s: a stage. GPipe with S=3, m=2 (stage x time; B costs 2 ticks):
#
#   s0: F0 F1 .  .  .  .  .  .  B0 B0 B1 B1
#   s1: .  F0 F1 .  .  .  B0 B0 B1 B1
#   s2: .  .  F0 F1 B0 B0 B1 B1
#
# 1F1B: stage s runs min(S-1-s, m) warm-up forwards, then alternates F and B, then drains Bs.
# Zero bubble (ZB-H1): 1F1B with B split into B (input gradients) and W (weight gradients);
# W fills the slots where 1F1B idles. S=3, m=3, F = B = W = 1 tick:
#
#   s0: F0 F1 F2 .  .  B0 W0 B1 W1 B2 W2
#   s1: .  F0 F1 .  B0 F2 B1 W0 B2 W1 W2
#   s2: .  .  F0 B0 F1 B1 F2 B2 W0 W1 W2

StageOrder = dict[int, list[Action]]


def gpipe(stages: int, microbatches: int, copy: int = 0) -> StageOrder:
    """All forwards, then all backwards (in micro-batch order: gradients accumulate in the same
    order as the single-device reference)."""
    return {s: [Action("F", s, i, copy) for i in range(microbatches)]
            + [Action("B", s, i, copy) for i in range(microbatches)] for s in range(stages)}


def one_f_one_b(stages: int, microbatches: int, copy: int = 0) -> StageOrder:
    """1F1B (PipeDream-flush): at most S-s micro-batches in flight on stage s."""
    out: StageOrder = {}
    for s in range(stages):
        warm = min(stages - 1 - s, microbatches)
        acts = [Action("F", s, i, copy) for i in range(warm)]
        for i in range(microbatches - warm):
            acts += [Action("F", s, warm + i, copy), Action("B", s, i, copy)]
        acts += [Action("B", s, i, copy) for i in range(microbatches - warm, microbatches)]
        out[s] = acts
    return out


def zero_bubble(stages: int, microbatches: int, copy: int = 0) -> StageOrder:
    """ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism", 2023): 1F1B with each backward split
    into B (input gradients, sent upstream at once) and W (weight gradients). Stage s runs
    min(S-s, m) warm-up forwards, then for each micro-batch k: B_k, then W_(k-s) once k >= s
    (stage s defers its first s weight passes into the slots where 1F1B idles), then the next
    forward; the deferred Ws drain at the end. W runs in micro-batch order, so gradients
    accumulate in the reference's order. At most S micro-batches are in flight (F done, W not)
    on any stage: 1F1B's peak (stage 0's). With F = B = W the step takes 3m + S - 1 units
    against 1F1B's 3(m + S - 1) (m >= S): a third of the bubble."""
    out: StageOrder = {}
    for s in range(stages):
        warm = min(stages - s, microbatches)
        acts = [Action("F", s, i, copy) for i in range(warm)]
        done_w = 0
        for k in range(microbatches):
            acts.append(Action("B", s, k, copy))
            if k >= s:
                acts.append(Action("W", s, done_w, copy))
                done_w += 1
            if k + warm < microbatches:
                acts.append(Action("F", s, k + warm, copy))
        acts += [Action("W", s, i, copy) for i in range(done_w, microbatches)]
        out[s] = acts
    return out


def interleaved_1f1b(stages: int, microbatches: int, copy: int = 0,
                     per_rank: int = 2) -> StageOrder:
    """Interleaved 1F1B (Narayanan et al., 2021; Megatron-LM's order), keyed by pipeline rank:
    P = stages / per_rank ranks, rank p holds stages p, p + P, ... (its *chunks*). Forwards run
    in rounds of P micro-batches, each round through chunk 0, then chunk 1, ...; backwards in
    the same rounds, last chunk first. Rank p runs 2(P-1-p) + (per_rank-1)P warm-up forwards,
    then alternates F and B, then drains its Bs. Each stage sees its micro-batches in order
    (gradients accumulate in the reference's order). The bubble is 1F1B's divided by
    per_rank: (P-1)/(per_rank m + P - 1) with free communication. Needs m % P == 0."""
    ranks = stages // per_rank
    total = microbatches * per_rank

    def at(k: int, kind: str, p: int) -> Action:
        rnd, within = divmod(k, ranks * per_rank)
        chunk = within // ranks if kind == "F" else per_rank - 1 - within // ranks
        return Action(kind, chunk * ranks + p, rnd * ranks + within % ranks, copy)

    out: StageOrder = {}
    for p in range(ranks):
        warm = min(2 * (ranks - 1 - p) + (per_rank - 1) * ranks, total)
        acts = [at(k, "F", p) for k in range(warm)]
        for i in range(total - warm):
            acts += [at(warm + i, "F", p), at(i, "B", p)]
        acts += [at(i, "B", p) for i in range(total - warm, total)]
        out[p] = acts
    return out


def v_position(stage: int, ranks: int) -> int:
    """The pipeline rank of ``stage`` in a V of ``2 * ranks`` stages: down, then back up
    (rank r holds stages r and 2 * ranks - 1 - r; the last rank holds the middle two)."""
    return stage if stage < ranks else 2 * ranks - 1 - stage


def zero_bubble_v(stages: int, microbatches: int, copy: int = 0) -> StageOrder:
    """ZB-V (Qi et al., 2023, section 4): 2P stages in a V over P ranks, backwards split into B
    and W, keyed by pipeline rank. The order is built by list scheduling on unit costs
    (F = B = W = 1, a chain of stages): each rank, whenever it is free, runs what can start
    earliest, preferring B, then F, then W, the later stage first; a rank holds at most 2P
    micro-batch chunks in flight (F done, W not), 1F1B's peak (P micro-batches of a whole
    rank's layers). Each stage sees its micro-batches in order. With m >= 2P the bubble is a
    fraction of ZB-H1's (fxpar-inspect prints both)."""
    ranks = stages // 2
    limit = 2 * ranks
    count = {k: [0] * stages for k in "FBW"}
    done: dict[tuple[str, int, int], float] = {}
    clock, held = [0.0] * ranks, [0] * ranks
    out: StageOrder = {r: [] for r in range(ranks)}
    for _ in range(3 * stages * microbatches):
        best: tuple[float, int, int, int, str, int] | None = None
        for r in range(ranks):
            for s in (r, stages - 1 - r):
                for prio, kind in enumerate("BFW"):
                    i = count[kind][s]
                    if kind == "B" and i < count["F"][s]:
                        dep: tuple[str, int, int] | None = \
                            ("F", s, i) if s == stages - 1 else ("B", s + 1, i)
                    elif kind == "F" and i < microbatches and held[r] < limit:
                        dep = ("F", s - 1, i) if s else None
                    elif kind == "W" and i < count["B"][s]:
                        dep = None
                    else:
                        continue
                    if dep is not None and dep not in done:
                        continue
                    start = max(clock[r], done[dep] if dep is not None else 0.0)
                    option = (start, r, prio, -s, kind, i)
                    if best is None or option < best:
                        best = option
        if best is None:
            raise RuntimeError(f"zero_bubble_v: no order for {stages} stages and "
                               f"{microbatches} micro-batches (a bug: please report it)")
        start, r, _, neg, kind, i = best
        clock[r] = done[(kind, -neg, i)] = start + 1.0
        count[kind][-neg] += 1
        held[r] += 1 if kind == "F" else -1 if kind == "W" else 0
        out[r].append(Action(kind, -neg, i, copy))
    return out


def _round_robin(stage: int, ranks: int) -> int:
    return stage % ranks


def _one_per_rank(name: str) -> Callable[[int, int, int], list[str]]:
    def problems(stages: int, per_rank: int, microbatches: int) -> list[str]:
        if per_rank == 1:
            return []
        return [f"Plan.stages_per_rank={per_rank} needs schedule='interleaved_1f1b' or "
                f"'zero_bubble_v' (the schedules that run several stages per rank); "
                f"{name!r} runs one stage per rank: set stages_per_rank=1"]
    return problems


def _interleaved_problems(stages: int, per_rank: int, microbatches: int) -> list[str]:
    if per_rank < 2:
        return ["Plan.schedule='interleaved_1f1b' places several stages on each rank: set "
                "stages_per_rank >= 2 (with stages a multiple of it), or use schedule='1f1b'"]
    ranks = stages // per_rank
    if stages % per_rank == 0 and microbatches % ranks:
        return [f"Plan.schedule='interleaved_1f1b' runs micro-batches in rounds of one per "
                f"pipeline rank ({ranks}): make microbatches a multiple of {ranks} (got "
                f"{microbatches})"]
    return []


def _zbv_problems(stages: int, per_rank: int, microbatches: int) -> list[str]:
    if per_rank == 2:
        return []
    return [f"Plan.schedule='zero_bubble_v' places 2 stages on each rank in a V: set "
            f"stages_per_rank=2 (got {per_rank}) and stages to twice the pipeline ranks"]


def _fill_drain(p: int, m: int, v: int) -> tuple[str, float]:
    return "(p-1)/(m+p-1)", (p - 1) / (m + p - 1)


def _zb_h1(p: int, m: int, v: int) -> tuple[str, float]:
    if m >= p:
        return "(p-1)/(3m+p-1)", (p - 1) / (3 * m + p - 1)
    return "(2p-m-1)/(2m+2p-1) (m < p)", (2 * p - m - 1) / (2 * m + 2 * p - 1)


def _interleaved_bubble(p: int, m: int, v: int) -> tuple[str, float]:
    return "(p-1)/(vm+p-1)", (p - 1) / (v * m + p - 1)


def _zbv_bubble(p: int, m: int, v: int) -> tuple[str, float]:  # list-scheduled: none
    return "(none; ZB-H1's on p ranks, (p-1)/(3m+p-1))", (p - 1) / (3 * m + p - 1)


@dataclass(frozen=True)
class ScheduleRule:
    """Everything fxpar knows of one pipeline schedule, in one entry of :data:`SCHEDULES`:
    adding a schedule is one entry (and its generator) plus its tests."""

    order: Callable[[int, int, int, int], StageOrder]
    """``order(stages, microbatches, copy, per_rank)``: each pipeline rank's compute order."""
    problems: Callable[[int, int, int], list[str]]
    """``problems(stages, stages_per_rank, microbatches)``: what a plan must change for it."""
    bubble: Callable[[int, int, int], tuple[str, float]]
    """``bubble(p, m, v)``: the published idle fraction over p pipeline ranks with m
    micro-batches and v stages per rank (unit costs F=1, B=2, or B=W=1 where the backward is
    split; free communication), as formula text and value."""
    position: Callable[[int, int], int] = _round_robin
    """``position(stage, ranks)``: the pipeline rank that holds ``stage``."""
    virtual: bool = False
    """Several stages on each rank (``Plan.stages_per_rank``)."""
    splits_backward: bool = False
    """The backward runs as B (input gradients) and W (weight gradients)."""
    closed_form: bool = True
    """False: no published formula (``bubble`` gives a comparison; the simulator is exact)."""


SCHEDULES: dict[str, ScheduleRule] = {
    "gpipe": ScheduleRule(lambda s, m, c, v: gpipe(s, m, c), _one_per_rank("gpipe"),
                          _fill_drain),
    "1f1b": ScheduleRule(lambda s, m, c, v: one_f_one_b(s, m, c), _one_per_rank("1f1b"),
                         _fill_drain),
    "zero_bubble": ScheduleRule(lambda s, m, c, v: zero_bubble(s, m, c),
                                _one_per_rank("zero_bubble"), _zb_h1, splits_backward=True),
    "interleaved_1f1b": ScheduleRule(interleaved_1f1b, _interleaved_problems,
                                     _interleaved_bubble, virtual=True),
    "zero_bubble_v": ScheduleRule(lambda s, m, c, v: zero_bubble_v(s, m, c), _zbv_problems,
                                  _zbv_bubble, position=v_position, virtual=True,
                                  splits_backward=True, closed_form=False),
}
"""The pipeline schedules, by ``Plan.schedule`` name (docs/schedules.md)."""

Links = dict[int, set[int]]
"""Forward data links between stages: ``links[a]`` = stages that receive from stage a."""


def chain(stages: int) -> Links:
    """Links of a plain chain of stages (each sends to the next)."""
    return {s: ({s + 1} if s + 1 < stages else set()) for s in range(stages)}


def add_comm(order: list[Action], links: Links, grads: bool = True) -> list[Action]:
    """Insert RECV_F before / SEND_F after each F, and RECV_B before / SEND_B after each B,
    where the stage has peers in that direction."""
    receivers_of = {s: {a for a, dsts in links.items() if s in dsts} for s in links}
    out: list[Action] = []
    for a in order:
        pre, post = [], []
        if a.kind == "F":
            if receivers_of.get(a.stage):
                pre.append(a._replace(kind="RECV_F"))
            if links.get(a.stage):
                post.append(a._replace(kind="SEND_F"))
        elif a.kind == "B" and grads:
            if links.get(a.stage):
                pre.append(a._replace(kind="RECV_B"))
            if receivers_of.get(a.stage):
                post.append(a._replace(kind="SEND_B"))
        out += [*pre, a, *post]
    return out


def pipeline(stages: int, microbatches: int, name: str = "gpipe",
             links: Links | None = None, copy: int = 0, per_rank: int = 1) -> Schedule:
    """Per pipeline rank (keyed by its index; with one stage per rank, the stage): compute
    order, communication, and a final STEP. ``per_rank`` > 1: stages each rank holds
    (``interleaved_1f1b``)."""
    order = SCHEDULES[name].order(stages, microbatches, copy, per_rank)
    links = links if links is not None else chain(stages)
    return {p: [*add_comm(acts, links), Action("STEP")] for p, acts in order.items()}


def place(per_copy: dict[int, Schedule], roles: list[list[tuple[int, int]]], sync: bool,
          merge: Callable[[dict[int, list[list[Action]]]], Schedule]) -> Schedule:
    """Per rank: the lists of the (copy, pipeline rank) roles it plays, merged by ``merge``
    (one role: as is); then ALLREDUCE (gradient sum over each stage's tiles, copies and
    replicas) when ``sync``; then STEP."""
    queues = {r: [per_copy[c][s][:-1] for c, s in rs] for r, rs in enumerate(roles)}
    merged = merge(queues) if any(len(q) > 1 for q in queues.values()) else \
        {r: q[0] for r, q in queues.items()}
    tail = [Action("ALLREDUCE")] if sync else []
    return {r: [*acts, *tail, Action("STEP")] for r, acts in merged.items()}


def single_rank(microbatches: int = 1) -> Schedule:
    """The trivial plan: one rank, one stage, forward then backward per micro-batch, one step."""
    return pipeline(1, microbatches)


def format_grid(schedule: Schedule, mark: tuple[int, int] | None = None,
                here: dict[int, int] | None = None, context: int = 4) -> str:
    """The schedule as a step x rank table; ``mark=(rank, step)`` flags one cell as the error,
    ``here={rank: step}`` flags where each rank is. With ``here``, a long table shows only the
    rows within ``context`` of a flagged one."""
    ranks = sorted(schedule)
    steps = max((len(a) for a in schedule.values()), default=0)
    width = max([len(str(a)) for acts in schedule.values() for a in acts] + [6]) + 2
    flagged = {*(here or {}).values(), *([mark[1]] if mark else [])}
    keep = range(steps) if not here or steps <= 4 * context + 8 else \
        sorted({s for f in flagged for s in range(f - context, f + context + 1)
                if 0 <= s < steps})
    width += 8 if here else 0
    lines = [("step  " + "".join(f"rank {r}".ljust(width) for r in ranks)).rstrip()]
    last = -1
    for s in keep:
        if s != last + 1:
            lines.append("...")
        last = s
        cells = []
        for r in ranks:
            acts = schedule[r]
            cell = str(acts[s]) if s < len(acts) else ""
            if mark == (r, s):
                cell += " <-- ERROR HERE"
            if here and here.get(r) == s:
                cell += " <-- HERE"
            cells.append(cell.ljust(width))
        lines.append(f"{s:<6}" + "".join(cells).rstrip())
    if keep and last != steps - 1:
        lines.append("...")
    return "\n".join(lines)
