"""The planner: ``fxpar.plan_auto`` searches the plan space for the fastest plan that fits.

For ``world_size`` ranks it enumerates every layout that uses them all: data-parallel copies D
(dividing the batch), stages k (up to ``max_stages``), the leading s of them spatial on P tiles
(a square grid) with ``s * P + (k - s) = world_size / D``, GEMS or not, micro-batches from
``MICROBATCHES`` that split the batch, GPipe, 1F1B or zero bubble (ZB-H1); a plan whose
memory estimate is over ``memory_per_rank`` is tried again with every stage recomputed. Each
candidate is costed by ``fxpar.planner.planspace`` (stage cuts by networkx, seconds and bytes
from the profile): first in closed form, then the fastest ``EXACT`` in the timed simulator.
The result ranks the plans that fit and counts the rejected ones by reason; the chosen plan
carries its stage cuts as ``balance`` and is compiled once (on meta tensors) to make sure it
is valid.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from fxpar.compiler.driver import compile as fx_compile
from fxpar.core.geometry import Grid
from fxpar.core.plan import Plan, PlanError
from fxpar.core.units import nbytes
from fxpar.perf.profile import Profile
from fxpar.planner.planspace import Estimate, ModelTable, analyse, evaluate

MICROBATCHES = (1, 2, 4, 8, 16, 32)
PIPELINE_SCHEDULES = ("gpipe", "1f1b", "zero_bubble")
"""The schedules tried with more than one micro-batch (one micro-batch: GPipe, they agree)."""
EXACT = 48
"""Candidates (fastest in closed form) that the timed simulator ranks."""
DEFAULT_PROFILE = "h100-nvlink-ib"


@dataclass(frozen=True)
class Rejected:
    """A plan the search set aside, and why (``kind``: batch, memory, tiles, cuts)."""

    plan: Plan
    kind: str
    reason: str
    need: int = 0
    """Bytes per rank the plan needs (``kind`` memory)."""


@dataclass(frozen=True)
class AutoPlan:
    """What :func:`plan_auto` found."""

    plan: Plan
    """The chosen plan (the fastest that fits), with its stage cuts as ``balance``."""
    ranked: tuple[Estimate, ...]
    """Plans that fit, fastest first (the timed simulator's step)."""
    rejected: tuple[Rejected, ...]
    searched: int
    seconds: tuple[float, float, float]
    """Wall seconds: tracing and analysing the model once, the search, compiling the chosen
    plan to check it (0 without ``check``)."""
    world_size: int
    memory_per_rank: int | None
    profile: str
    """The profile's name."""
    profile_note: str = ""
    """Where the profile came from, for the report (fxpar-run --plan auto: measured on this
    machine now, cached, or given by --profile); "" says nothing."""
    spatial_dims: int = 2
    """The input's spatial dims (1: a sequence, 2: an image, 3: a volume): how the report
    writes the tile grids."""

    def report(self, top: int = 8) -> str:
        """The top plans with predicted step and memory, then the rejected ones by reason."""
        budget = nbytes(self.memory_per_rank) if self.memory_per_rank else "no limit"
        note = f" ({self.profile_note})" if self.profile_note else ""
        lines = [f"plan search: {self.world_size} rank(s), memory per rank {budget}, profile "
                 f"{self.profile!r}{note}: {self.searched} plans searched in "
                 f"{self.seconds[1]:.2f} s "
                 f"(model analysed in {self.seconds[0]:.2f} s, choice compiled in "
                 f"{self.seconds[2]:.2f} s)",
                 f"  {'#':>3}  {'plan':<44} {'step s':>10} {'bubble':>7} {'memory/rank':>12}"]
        for i, e in enumerate(self.ranked[:top], 1):
            lines.append(f"  {i:>3}  {describe(e.plan, self.spatial_dims):<44} {e.step_s:>10.4g} "
                         f"{e.bubble:>7.1%} {nbytes(e.memory):>12}")
        if len(self.ranked) > top:
            lines.append(f"  ... {len(self.ranked) - top} more that fit")
        kinds: dict[str, list[Rejected]] = {}
        for r in self.rejected:
            kinds.setdefault(r.kind, []).append(r)
        if kinds:
            lines.append("rejected:")
        for kind, rs in sorted(kinds.items(), key=lambda kv: -len(kv[1])):
            lines.append(f"  {len(rs):>5} {kind}: e.g. {describe(rs[0].plan, self.spatial_dims)}: "
                         f"{rs[0].reason}")
        lines.append(f"chosen: {describe(self.plan, self.spatial_dims)}")
        lines.append(f"  fxpar-run flags: {flags(self.plan)}")
        return "\n".join(lines)


def describe(plan: Plan, spatial_dims: int | None = None) -> str:
    """A short name: ``SP4(2x2)x1+PP3 m4 1f1b GEMS DP2 recompute=always`` (``x1``: spatial
    stages), ``DP4``, ``1 rank``. ``spatial_dims``: the input's (None: guessed from the plan,
    a volume's slices or else an image)."""
    parts = []
    if plan.spatial:
        ndim = len(plan.grid) if plan.grid else spatial_dims if spatial_dims else \
            3 if plan.slice in ("slab", "pencil", "cube") else 2
        grid = "x".join(map(str, plan.tile_grid(ndim)))
        parts.append(f"SP{plan.spatial_parts}({grid})x{plan.spatial_stages}")
    if plan.stages > 1:
        parts.append(("PP" if plan.microbatches > 1 else "LP") + str(plan.stages))
    words = ["+".join(parts)] if parts else []
    if plan.microbatches > 1:
        words.append(f"m{plan.microbatches} {plan.schedule}")
    if plan.gems:
        words.append("GEMS" if plan.gems_times == 1 else f"GEMS x{plan.gems_times}")
    if plan.data_parallel > 1:
        words.append(f"DP{plan.data_parallel}")
    if plan.recompute != "never":
        words.append(f"recompute={plan.recompute}")
    return " ".join(words) or "1 rank"


def flags(plan: Plan) -> str:
    """The ``fxpar-run`` / ``fxpar-inspect`` flags of ``plan``."""
    out = []
    if plan.stages > 1:
        out.append(f"--stages {plan.stages}")
        if plan.balance:
            out.append("--balance " + ",".join(map(str, plan.balance)))
    if plan.microbatches > 1:
        out.append(f"--microbatches {plan.microbatches} --schedule {plan.schedule}")
    if plan.spatial:
        out.append(f"--spatial-parts {plan.spatial_parts}")
        out.append(f"--grid {'x'.join(map(str, plan.grid))}" if plan.grid
                   else f"--slice {plan.slice}")
        if plan.spatial_stages > 1:
            out.append(f"--spatial-stages {plan.spatial_stages}")
    if plan.gems:
        out.append("--gems")
    if plan.data_parallel > 1:
        out.append(f"--data-parallel {plan.data_parallel}")
    if plan.recompute != "never":
        out.append(f"--recompute {plan.recompute}")
    return " ".join(out) or "(none: one rank)"


def slice_of(ndim: int) -> str:
    """The tiling the planner uses: a square grid of an image, a cube grid of a volume."""
    return "square" if ndim <= 2 else "cube"


def even_grid(parts: int, ndim: int) -> bool:
    """True for 2 or 3 tiles (strips), and for grids whose sides differ at most 2x: long
    strips (1x5, 1x31) cost far more halo than the planner wants to try."""
    grid = Plan(spatial_parts=parts, slice=slice_of(ndim)).tile_grid(ndim)  # type: ignore
    return parts <= 3 or max(grid) <= 2 * min(grid)


def layouts(world_size: int, batch: int, spatial: int, max_stages: int
            ) -> list[dict[str, Any]]:
    """Every (data_parallel, stages, spatial_stages, spatial_parts) that uses ``world_size``
    ranks exactly, as Plan fields; ``spatial``: the image's spatial dims (0: none)."""
    out = []
    for d in range(1, world_size + 1):
        if world_size % d or batch % d:
            continue
        n = world_size // d
        for k in range(1, min(max_stages, n) + 1):
            if k == n:
                out.append({"data_parallel": d, "stages": k})
            if not spatial:
                continue
            for s in range(1, k + 1):
                rest = n - (k - s)
                if rest % s == 0 and rest // s >= 2 and even_grid(rest // s, spatial):
                    out.append({"data_parallel": d, "stages": k, "spatial_stages": s,
                                "spatial_parts": rest // s, "slice": slice_of(spatial)})
    return out


def candidates(world_size: int, batch: int, spatial: int, max_stages: int
               ) -> tuple[list[Plan], list[Rejected]]:
    """The plans to cost, and those rejected before costing (the batch does not split)."""
    plans: list[Plan] = []
    rejected: list[Rejected] = []
    for lay in layouts(world_size, batch, spatial, max_stages):
        k = lay["stages"]
        for gems in ((False, True) if k >= 2 else (False,)):
            for m in (MICROBATCHES if k >= 2 else (1,)):
                for schedule in (PIPELINE_SCHEDULES if m > 1 else ("gpipe",)):
                    plan = Plan(**lay, gems=gems, microbatches=m, schedule=schedule)
                    try:
                        plan.check_batch(batch)
                    except PlanError as e:
                        rejected.append(Rejected(plan, "batch", str(e).split(":")[0]))
                        continue
                    plans.append(plan)
    return plans, rejected


def plan_auto(model: nn.Module, example: torch.Tensor | tuple[int, ...], world_size: int,
              memory_per_rank: int | None = None, profile: Profile | str = DEFAULT_PROFILE,
              *, max_stages: int = 8, check: bool = True) -> AutoPlan:
    """The fastest plan of ``model`` on ``world_size`` ranks whose estimated memory per rank
    fits ``memory_per_rank`` bytes (None: no limit), ranked on ``profile`` (a Profile, a
    profile file, or a shipped profile's name). ``example``: one global batch or its shape.
    ``check``: compile the chosen plan (on meta tensors) to make sure it is valid.
    Raises PlanError when no plan fits, saying what the closest one needs.

    The default profile stays the shipped ``h100-nvlink-ib``, not this machine: this function
    plans for any number of ranks from one process (2,048 H100s in docs/scaling.md), where a
    calibration of the process it runs in would measure neither the target's devices nor its
    links. ``fxpar-run --plan auto`` plans for the job it runs in, and without ``--profile``
    ranks on that job's own machine (fxpar.planner.localprofile.local_profile)."""
    t0 = time.perf_counter()
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise PlanError(f"plan_auto needs world_size >= 1 ranks, got {world_size!r}")
    prof = profile if isinstance(profile, Profile) else Profile.load(profile)
    shape = tuple(example.shape) if isinstance(example, torch.Tensor) else tuple(example)
    table = analyse(model, shape, prof)
    t1 = time.perf_counter()
    spatial = len(shape) - 2 if any(table.tiled) else 0
    plans, rejected = candidates(world_size, shape[0], spatial, max_stages)
    fits, more = _cost(table, plans, memory_per_rank)
    rejected += more
    if not fits:
        closest = min((r for r in more if r.kind == "memory"), default=None,
                      key=lambda r: r.need)
        hint = f" (closest: {describe(closest.plan)}: {closest.reason})" if closest else ""
        raise PlanError(f"no plan of {world_size} rank(s) fits{hint}: give more ranks or "
                        f"memory per rank, or a smaller batch or image")
    fits.sort(key=lambda e: e.step_s)
    exact = [x for e in fits[:EXACT] if (x := evaluate(table, e.plan)) is not None]
    exact.sort(key=lambda e: (e.step_s, e.memory))
    ranked = tuple(exact) + tuple(fits[EXACT:])
    chosen = _with_balance(ranked[0])
    t2 = time.perf_counter()
    if check:
        chosen = _checked(model, shape, chosen)
    seconds = (t1 - t0, t2 - t1, time.perf_counter() - t2)
    return AutoPlan(chosen, ranked, tuple(rejected), len(plans) + len(rejected), seconds,
                    world_size, memory_per_rank, prof.name, spatial_dims=len(shape) - 2)


def _cost(table: ModelTable, plans: list[Plan], budget: int | None
          ) -> tuple[list[Estimate], list[Rejected]]:
    fits: list[Estimate] = []
    rejected: list[Rejected] = []
    for plan in plans:
        e = evaluate(table, plan, exact=False)
        if e is None:
            grid = Grid(*plan.tile_grid(table.ndim)) if plan.spatial else None
            small = grid is not None and table.prefix(grid) is None
            kind = "tiles" if small else "cuts"
            why = (f"tiles of a {grid} grid are too small for a window" if small else
                   f"fewer than {plan.stages} places to cut where few bytes cross")
            rejected.append(Rejected(plan, kind, why))
            continue
        if budget is not None and e.memory > budget:
            again = evaluate(table, replace(plan, recompute="always"), exact=False)
            if again is None or again.memory > budget:
                need = again.memory if again is not None else e.memory
                rejected.append(Rejected(plan, "memory", f"needs {nbytes(need)} per rank "
                                                         f"(even recomputing)", need))
                continue
            e = again
        fits.append(e)
    return fits, rejected


def _with_balance(e: Estimate) -> Plan:
    b = e.stages.bounds
    if e.plan.stages == 1:
        return e.plan
    return replace(e.plan, balance=tuple(y - x for x, y in zip(b, b[1:], strict=False)))


def _checked(model: nn.Module, shape: tuple[int, ...], plan: Plan) -> Plan:
    """``plan`` if it compiles; else the same plan with the compiler's own cuts."""
    dtype = next((p.dtype for p in model.parameters()), torch.float32)
    example = torch.empty(shape, device="meta", dtype=dtype)

    def untouched(name: str, module: nn.Module) -> None:
        """The check computes nothing: a meta model's modules need no values (and no
        reset_parameters) here."""

    try:
        fx_compile(model, plan, example, init=untouched)
        return plan
    except PlanError:
        if plan.balance is None:
            raise
        plan = replace(plan, balance=None)
        fx_compile(model, plan, example, init=untouched)
        return plan
