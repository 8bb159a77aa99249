"""Schedules as data: what each rank does in one training step, as a list of Actions.

An :class:`Action` is a small value with a compact text form that parses back::

    0F1      stage 0, forward, micro-batch 1            (copy 0)
    2B0      stage 2, backward, micro-batch 0
    1SEND_F3 stage 1 sends its forward output of micro-batch 3
    c1.0F0   copy 1 (the GEMS mirror) of stage 0, forward, micro-batch 0
    STEP     optimizer step

A schedule is ``dict[rank, list[Action]]``; generators are pure functions of the plan and the
runtime is one loop over a rank's list.
"""

from __future__ import annotations

import re
from typing import NamedTuple

KINDS = ("F", "B", "SEND_F", "RECV_F", "SEND_B", "RECV_B", "ALLREDUCE", "STEP")
_PATTERN = re.compile(r"^(?:c(\d+)\.)?(\d+)(SEND_F|RECV_F|SEND_B|RECV_B|F|B)(\d+)$")


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


def single_rank(microbatches: int = 1) -> Schedule:
    """The trivial plan: one rank, one stage, forward then backward per micro-batch, one step."""
    actions: list[Action] = []
    for i in range(microbatches):
        actions += [Action("F", 0, i), Action("B", 0, i)]
    return {0: [*actions, Action("STEP")]}


def format_grid(schedule: Schedule, mark: tuple[int, int] | None = None) -> str:
    """The schedule as a step x rank table; ``mark=(rank, step)`` flags one cell."""
    ranks = sorted(schedule)
    steps = max((len(a) for a in schedule.values()), default=0)
    width = max([len(str(a)) for acts in schedule.values() for a in acts] + [6]) + 2
    lines = ["step  " + "".join(f"rank {r}".ljust(width) for r in ranks)]
    for s in range(steps):
        cells = []
        for r in ranks:
            acts = schedule[r]
            cell = str(acts[s]) if s < len(acts) else ""
            if mark == (r, s):
                cell += " <-- ERROR HERE"
            cells.append(cell.ljust(width))
        lines.append(f"{s:<6}" + "".join(cells).rstrip())
    return "\n".join(lines)
