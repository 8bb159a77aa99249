"""The user's parallel plan and the rank map it implies.

A :class:`Plan` is pure configuration: it is validated on construction (so a bad plan fails
before anything is traced or any rank talks to another) and it knows nothing about the model.
:class:`RankMap` turns a plan into "which rank runs which stage, tile, copy and data-parallel
replica" — the same answer on every rank, computed without MPI.

Roles of one layout are listed flat: the tiles of stage 0, then those of stage 1, ...::

    stages=3, spatial_stages=1, spatial_parts=2          N = 2 + 1 + 1 = 4 roles

    role j        0       1       2       3
    (stage,tile)  (0,0)   (0,1)   (1,0)   (2,0)
    copy 0 rank   0       1       2       3          rank = d*N + j
    copy 1 rank   3       2       1       0          rank = d*N + (N-1-j)   (GEMS mirror)

``d`` is the data-parallel index: D copies of the whole layout sit side by side.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any, Literal

import torch

from fxpar.core.schedule import SCHEDULES as SCHEDULE_RULES

SCHEDULES = tuple(SCHEDULE_RULES)
"""The names ``Plan.schedule`` takes (fxpar.core.schedule.SCHEDULES: one entry each)."""
VIRTUAL = tuple(n for n, rule in SCHEDULE_RULES.items() if rule.virtual)
"""Schedules that place several stages on each rank (``Plan.stages_per_rank``)."""
SLICES = ("vertical", "horizontal", "square", "slab", "pencil", "cube")
RECOMPUTE = ("never", "always", "except_last", "auto")
HALO_FUSION = ("off", "auto", "all")
PRECISION_DTYPES: dict[str, torch.dtype | None] = {
    "fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
"""``Plan.precision`` -> the compute dtype (None: the model's own dtypes, no autocast)."""


class PlanError(ValueError):
    """A plan (or a plan/model/batch combination) that cannot work; the message says what to
    change."""


@dataclass(frozen=True, kw_only=True)
class Plan:
    """How to spread one model over MPI ranks. The defaults are the trivial plan: one rank.

    The MPI4DL flag each field replaces is given in brackets.
    """

    stages: int = 1
    """Consecutive pieces the graph is cut into, one rank (group) each; 1 means no layer
    parallelism. [--split-size]"""
    balance: tuple[int, ...] | None = None
    """Optional explicit cut: how many compute nodes of the topological order each stage gets
    (``len == stages``); None lets the cost model choose. [--balance]"""
    microbatches: int = 1
    """Micro-batches each step's batch is split into for pipelining; 1 means no pipelining.
    [--parts]"""
    schedule: Literal["gpipe", "1f1b", "zero_bubble", "interleaved_1f1b",
                      "zero_bubble_v"] = "gpipe"
    """Pipeline schedule: "gpipe" (all forwards, then all backwards), "1f1b",
    "zero_bubble" (ZB-H1: 1F1B whose backwards are split into input gradients, sent upstream
    at once, and weight gradients, run in the slots where 1F1B idles; about a third of 1F1B's
    bubble at the same peak memory; fxpar.core.schedule.zero_bubble), or "interleaved_1f1b"
    (virtual stages: each rank holds ``stages_per_rank`` stages, Megatron's order; the bubble
    shrinks by that factor; fxpar.core.schedule.interleaved_1f1b), or "zero_bubble_v" (ZB-V:
    ``stages_per_rank=2`` in a V, rank r holding stages r and 2P-1-r, backwards split as in
    zero_bubble; fxpar.core.schedule.zero_bubble_v)."""
    stages_per_rank: int = 1
    """Stages each rank (group) holds, for ``schedule="interleaved_1f1b"`` or
    ``"zero_bubble_v"``: the graph is cut into ``stages`` stages over
    ``stages // stages_per_rank`` pipeline ranks (``Plan.position``). 1: one stage per rank."""
    spatial_parts: int = 1
    """Tiles each spatial stage's image is cut into, one rank each; 1 means no spatial
    parallelism. [--num-spatial-parts]"""
    slice: Literal["vertical", "horizontal", "square", "slab", "pencil", "cube"] = "square"
    """How tiles cut the image (or volume): "vertical" strips (split W), "horizontal" strips
    (split H), a "square" grid of rows x cols = spatial_parts as close to square as possible;
    for volumes also "slab" (split the depth D), "pencil" (D x H, as square as possible) and
    "cube" (D x H x W, as even as possible). On an image "slab" is "horizontal", and "pencil"
    and "cube" are "square". A sequence (N, C, L) has one spatial dim: every slice cuts L into
    spatial_parts tiles, the one grid there is. [--slice-method]"""
    grid: tuple[int, ...] | None = None
    """An explicit process grid instead of ``slice``: tiles per spatial dim, e.g. (2, 2, 2)
    for a volume (D, H, W), (2, 4) for an image (H, W) or (4,) for a sequence (L);
    spatial_parts is their product (give it or leave it at 1)."""
    spatial_stages: int = 1
    """How many leading stages run spatially (used only when spatial_parts > 1).
    [--spatial-size]"""
    gems: bool = False
    """Bidirectional GEMS: a mirrored second model copy on the same ranks, in reverse order."""
    gems_times: int = 1
    """Rounds of each GEMS copy per optimizer step. [--times]"""
    data_parallel: int = 1
    """Copies of the whole layout, each on its own ranks and its own part of the batch; 1 means
    no data parallelism. [--local-DP]"""
    recompute: Literal["never", "always", "except_last", "auto"] = "never"
    """Activation recompute per stage (torchgpipe's checkpoint modes): "always" runs every
    stage's forward without keeping activations for backward and runs it again, with autograd,
    right before the stage's backward; "except_last" all stages but the last; "never" keeps
    them (the default); "auto" recomputes the stages the memory estimate says must be, for
    ``memory_per_rank``. A recomputed spatial stage replays the halos and statistics its
    first forward received: no extra messages (fxpar.runtime.recompute)."""
    recompute_segments: int = 1
    """Checkpoint segments per stage: each stage's forward is cut into this many pieces of
    about equal activation bytes and only their inputs are kept for backward; each piece runs again
    (replaying its exchanges) right before its own backward. With one large image per step
    this is what lowers the peak (stage recompute cannot); ~sqrt(layers) is the usual
    choice. 1: off. [--recompute-segments]"""
    memory_per_rank: int | None = None
    """Bytes each rank may hold (parameters, gradients, optimizer state, activations, received
    tensors, as ``fxpar-inspect --memory`` estimates them); used by ``recompute="auto"``."""
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    """Mixed precision: "bf16" / "fp16" compute as under ``torch.autocast`` (convolutions and
    matrix products in that dtype, norm statistics in float32) with float32 parameters,
    gradients and optimizer state; halos and pipeline messages travel in the compute dtype.
    "fp16" adds a dynamic loss scale whose overflow check all ranks agree on (a step with an
    inf or NaN gradient on any rank is skipped on every rank and the scale halves).
    "fp32": the model's own dtypes. [--precision]"""
    channels_last: bool = False
    """Lay convolution weights out channels-last (NHWC / NDHWC), so convolutions and the
    activations between them run in that memory format (often faster with oneDNN and cuDNN);
    the same values, so the same training."""
    halo_fusion: Literal["off", "auto", "all"] = "off"
    """Spatial plans: let consecutive convolutions and pools (with pointwise ops and BatchNorm
    between them) share one wider halo exchange, computing the border their neighbours own
    again (fxpar.passes.halo_fusion; exact, gradients included). "auto": where the cost model
    says the messages saved outweigh the redundant border compute; "all": every chain that
    can be fused; "off": one exchange per windowed op. ``fxpar-inspect --halos`` lists the
    groups and their widths. [--halo-D2 / --fused-layers]"""
    compile: bool = False
    """Run each rank's stage modules through ``torch.compile`` (Inductor), forward and
    backward: the pointwise code between convolutions fuses, communicating ops stay calls in
    graph order (fxpar.runtime.inductor). The same values to the dtype's rounding; each graph
    compiles at its first step (Inductor's on-disk cache makes later runs and other ranks of
    the node fast). [--compile]"""
    strict: bool = False
    """Spatial plans: raise (instead of warning) when the spatial region covers less than
    ``fxpar.COVERAGE_WARN`` of the forward FLOPs on image tensors, e.g. because an op without
    a tiling rule ends it early."""

    def __post_init__(self) -> None:
        if self.balance is not None:
            # Accept any sequence from users (lists from JSON/CLI); store an immutable tuple.
            if isinstance(self.balance, (str, bytes)) or not hasattr(self.balance, "__iter__"):
                raise PlanError(f"Plan.balance must be a sequence of node counts, one per "
                                f"stage (e.g. balance=(40, 29) for stages=2), got "
                                f"{self.balance!r}")
            object.__setattr__(self, "balance", tuple(self.balance))
        if self.grid is not None:
            if isinstance(self.grid, (str, bytes)) or not hasattr(self.grid, "__iter__"):
                raise PlanError(f"Plan.grid must be a sequence of tile counts, one per "
                                f"spatial dim (e.g. grid=(2, 2, 2) for D x H x W), got "
                                f"{self.grid!r}")
            object.__setattr__(self, "grid", tuple(self.grid))
            if self.spatial_parts == 1 and all(isinstance(g, int) and g >= 1
                                               for g in self.grid):
                object.__setattr__(self, "spatial_parts", math.prod(self.grid))
        for problem in self.problems():
            raise PlanError(problem)

    def to_json(self) -> dict[str, Any]:
        """The fields as JSON values (``balance`` a list), as program.json, checkpoints and
        metrics files record them; ``Plan(**d)`` reads them back."""
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        for name in ("balance", "grid"):
            if d[name] is not None:
                d[name] = list(d[name])
        return d

    def problems(self) -> list[str]:
        """Every reason this plan cannot work, each saying what to change (empty if valid)."""
        out: list[str] = []

        def positive_int(name: str) -> bool:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                out.append(f"Plan.{name} must be an integer >= 1, got {value!r}")
                return False
            return True

        ok = all([positive_int(n) for n in
                  ("stages", "microbatches", "spatial_parts", "spatial_stages", "gems_times",
                   "data_parallel", "recompute_segments", "stages_per_rank")])
        if self.schedule not in SCHEDULES:
            out.append(f"Plan.schedule must be one of {SCHEDULES}, got {self.schedule!r}")
        if self.recompute not in RECOMPUTE:
            out.append(f"Plan.recompute must be one of {RECOMPUTE}, got {self.recompute!r}")
        budget = self.memory_per_rank
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int)
                                   or budget < 1):
            out.append(f"Plan.memory_per_rank must be a number of bytes >= 1 (e.g. 4 * 2**30 "
                       f"for 4 GiB), got {budget!r}")
        if self.recompute == "auto" and budget is None:
            out.append('Plan.recompute="auto" chooses the stages to recompute for a memory '
                       'budget: give memory_per_rank (bytes per rank), or choose "always" / '
                       '"except_last"')
        if self.slice not in SLICES:
            out.append(f"Plan.slice must be one of {SLICES}, got {self.slice!r}")
        if not isinstance(self.gems, bool):
            out.append(f"Plan.gems must be True or False, got {self.gems!r}")
        if self.precision not in PRECISION_DTYPES:
            out.append(f"Plan.precision must be one of {tuple(PRECISION_DTYPES)}, got "
                       f"{self.precision!r}")
        if not isinstance(self.channels_last, bool):
            out.append(f"Plan.channels_last must be True or False, got {self.channels_last!r}")
        if not isinstance(self.compile, bool):
            out.append(f"Plan.compile must be True or False, got {self.compile!r}")
        if self.halo_fusion not in HALO_FUSION:
            out.append(f"Plan.halo_fusion must be one of {HALO_FUSION}, got "
                       f"{self.halo_fusion!r}")
        if not isinstance(self.strict, bool):
            out.append(f"Plan.strict must be True or False, got {self.strict!r}")
        if ok and self.spatial_parts > 1 and self.spatial_stages > self.stages:
            out.append(
                f"Plan.spatial_stages={self.spatial_stages} exceeds stages={self.stages}: "
                f"set spatial_stages <= stages (the spatial stages are the leading ones)")
        rule = SCHEDULE_RULES.get(self.schedule)  # None: refused above
        if ok and rule is not None:
            out += self._virtual_problems()
        if ok and rule is not None and rule.splits_backward and \
                self.recompute_segments > 1:
            out.append(f"Plan.schedule={self.schedule!r} splits each backward into input and "
                       f"weight gradients, which checkpoint segments would recompute twice: use "
                       f"recompute_segments=1 (stage recompute works), or schedule='1f1b'")
        if ok and self.gems_times > 1 and not self.gems:
            out.append("Plan.gems_times > 1 needs gems=True (it counts rounds of each GEMS copy)")
        if self.grid is not None:
            if not self.grid or len(self.grid) > 3 or any(
                    isinstance(g, bool) or not isinstance(g, int) or g < 1 for g in self.grid):
                out.append(f"Plan.grid must hold 1 to 3 integers >= 1, one per spatial dim "
                           f"(e.g. (2, 2, 2) for D x H x W, (4,) for L), got {self.grid!r}")
            elif ok and math.prod(self.grid) != self.spatial_parts:
                out.append(f"Plan.grid={self.grid} makes {math.prod(self.grid)} tiles but "
                           f"spatial_parts={self.spatial_parts}: give one of them, or make "
                           f"spatial_parts the product of the grid")
        if self.balance is not None:
            if any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in self.balance):
                out.append(f"Plan.balance entries must be integers >= 1, got {self.balance!r}")
            elif ok and len(self.balance) != self.stages:
                out.append(
                    f"Plan.balance has {len(self.balance)} entries but stages={self.stages}: "
                    f"give one node count per stage")
        return out

    def _virtual_problems(self) -> list[str]:
        """What stops ``stages_per_rank`` / the interleaved schedule (fields already valid)."""
        v = self.stages_per_rank
        out = SCHEDULE_RULES[self.schedule].problems(self.stages, v, self.microbatches)
        if v > 1 and self.stages % v:
            out.append(f"Plan.stages={self.stages} is not a multiple of stages_per_rank={v}: "
                       f"each rank holds stages_per_rank stages, so use stages = "
                       f"{max(v, self.stages // v * v)} or {(self.stages // v + 1) * v}")
        elif v > 1 and self.spatial_parts > 1 and self.spatial_stages != self.stages:
            out.append(f"Plan.stages_per_rank={v} puts stages s and s+{self.stages // v} on one "
                       f"rank group, so they must have the same tiles: make every stage spatial "
                       f"(spatial_stages={self.stages}) or set spatial_parts=1")
        return out

    @property
    def pipeline_ranks(self) -> int:
        """Ranks (groups) along the pipeline: ``stages // stages_per_rank``."""
        return self.stages // self.stages_per_rank

    def position(self, stage: int) -> int:
        """The pipeline rank (0 .. pipeline_ranks - 1) that holds ``stage``: round robin, or
        a V for zero_bubble_v (the schedule's rule, fxpar.core.schedule.SCHEDULES)."""
        return SCHEDULE_RULES[self.schedule].position(stage, self.pipeline_ranks)

    @property
    def spatial(self) -> bool:
        """True when the leading stages run on image tiles."""
        return self.spatial_parts > 1

    @property
    def copies(self) -> int:
        """Model copies per layout: 2 with GEMS, else 1."""
        return 2 if self.gems else 1

    def tile_grid(self, ndim: int = 2) -> tuple[int, ...]:
        """Tiles along each of ``ndim`` spatial dims ((rows, cols) for an image, (depth, rows,
        cols) for a volume, (parts,) along L for a sequence, whatever ``slice`` says): how many
        parts each dim is cut into. Raises PlanError when an explicit ``grid`` has another
        number of dims."""
        p = self.spatial_parts
        if self.grid is not None:
            if len(self.grid) != ndim:
                kind = {1: "a sequence (L)", 2: "an image (H, W)",
                        3: "a volume (D, H, W)"}.get(ndim, f"{ndim} dims")
                raise PlanError(f"Plan.grid={self.grid} has {len(self.grid)} dims but the "
                                f"input is {kind}: give one tile count per spatial dim")
            return self.grid
        if ndim == 1:  # a sequence: one dim to cut, whichever slice
            return (p,)
        split = {"horizontal": (ndim - 2,), "vertical": (ndim - 1,), "square": (ndim - 2,
                                                                               ndim - 1),
                 "slab": (0,), "pencil": (0, 1),
                 "cube": tuple(range(ndim))}[self.slice]
        out = [1] * ndim
        for d, n in zip(split, balanced(p, len(split)), strict=True):
            out[d] = n
        return tuple(out)

    def group_size(self, stage: int) -> int:
        """Ranks that run one copy of ``stage``: the tiles of a spatial stage, else 1."""
        return self.spatial_parts if self.spatial and stage < self.spatial_stages else 1

    @property
    def world_size(self) -> int:
        """Ranks the plan needs (``mpiexec -n``)."""
        return self.data_parallel * RankMap(self).layout_size

    def chunks(self) -> int:
        """Equal, contiguous parts each global batch is cut into (DP x GEMS x rounds x mbs)."""
        return self.data_parallel * self.copies * self.gems_times * self.microbatches

    def check_batch(self, batch_size: int) -> None:
        """Raise PlanError unless ``batch_size`` splits into this plan's equal chunks."""
        n = self.chunks()
        if batch_size < 1:
            raise PlanError(f"batch size {batch_size}: a batch needs at least one sample "
                            f"(at least {n} for this plan)")
        if batch_size % n:
            parts = [f"data_parallel={self.data_parallel}"]
            if self.gems:
                parts.append(f"2 GEMS copies x gems_times={self.gems_times}")
            parts.append(f"microbatches={self.microbatches}")
            raise PlanError(
                f"batch size {batch_size} does not split into {n} equal chunks "
                f"({' x '.join(parts)}): use a batch size that is a multiple of {n}, "
                f"or change those fields")


def balanced(p: int, n: int) -> tuple[int, ...]:
    """``p`` as a product of ``n`` factors, as even as possible (the smallest sum: least halo
    surface on an even extent), ascending: (1, 2) for 2 in 2 dims, (2, 2, 2) for 8 in 3,
    (1, 2, 2) for 4 in 3."""
    def splits(p: int, n: int) -> list[tuple[int, ...]]:
        if n == 1:
            return [(p,)]
        return [(d, *rest) for d in range(1, p + 1) if p % d == 0 for rest in splits(p // d,
                                                                                    n - 1)]
    return min((tuple(sorted(f)) for f in splits(p, n)), key=lambda f: (sum(f), f))


@dataclass(frozen=True)
class Role:
    """One piece of work in a layout: a stage's tile of one model copy."""

    copy: int
    stage: int
    tile: int


@dataclass(frozen=True)
class RankMap:
    """Which rank runs which (data-parallel index, copy, stage, tile). Pure; no MPI."""

    plan: Plan
    roles: tuple[tuple[int, int], ...] = field(init=False)
    """(pipeline rank, tile) of each rank of one layout, in rank order of copy 0 (the
    pipeline rank is the stage, unless ranks hold several: ``Plan.position``)."""

    _index: dict[tuple[int, int], int] = field(init=False, repr=False, compare=False)
    """(pipeline rank, tile) -> its place in :attr:`roles` (rank_of runs for every message
    of every rank when a program is lowered: a search of the tuple made that quadratic)."""

    def __post_init__(self) -> None:
        p = self.plan
        flat = tuple((s, t) for s in range(p.pipeline_ranks) for t in range(p.group_size(s)))
        object.__setattr__(self, "roles", flat)
        object.__setattr__(self, "_index", {role: j for j, role in enumerate(flat)})

    @property
    def layout_size(self) -> int:
        """Ranks in one layout (one data-parallel replica)."""
        return len(self.roles)

    def rank_of(self, dp: int, copy: int, stage: int, tile: int = 0) -> int:
        """The rank that runs ``tile`` of ``stage`` of model ``copy`` in replica ``dp``."""
        j = self._index[(self.plan.position(stage), tile)]
        n = self.layout_size
        return dp * n + (j if copy == 0 else n - 1 - j)

    def group(self, dp: int, copy: int, stage: int) -> tuple[int, ...]:
        """Ranks of one stage's group, in tile order."""
        return tuple(self.rank_of(dp, copy, stage, t) for t in range(self.plan.group_size(stage)))

    def tile_groups(self) -> dict[tuple[int, int, int], tuple[int, ...]]:
        """(rank, copy, stage) -> the ranks that run that spatial stage of that copy together
        (its tiles; their forward and backward are collective), for every rank's spatial
        roles. Schedules use it: ranks in two groups (GEMS) must meet each in one order."""
        made: dict[tuple[int, int, int], tuple[int, ...]] = {}  # each group once, not per tile
        out = {}
        for r in range(self.plan.world_size):
            for role in self.roles_of(r):
                if self.plan.group_size(role.stage) > 1:
                    key = (self.dp_index(r), role.copy, role.stage)
                    if key not in made:
                        made[key] = self.group(*key)
                    out[(r, role.copy, role.stage)] = made[key]
        return out

    def dp_index(self, rank: int) -> int:
        """The data-parallel replica ``rank`` belongs to."""
        return rank // self.layout_size

    def roles_of(self, rank: int) -> tuple[Role, ...]:
        """Every role ``rank`` plays: one per model copy (GEMS gives two) and per stage it
        holds (``stages_per_rank``)."""
        n, p = self.layout_size, self.plan
        j = rank % n
        out = [Role(c, s, t) for c, (pos, t) in
               ([(0, self.roles[j])] + ([(1, self.roles[n - 1 - j])] if p.gems else []))
               for s in range(p.stages) if p.position(s) == pos]
        return tuple(out)

    def describe(self) -> list[dict[str, object]]:
        """One row per rank (for fxpar-inspect and the saved plan JSON)."""
        rows: list[dict[str, object]] = []
        for r in range(self.plan.world_size):
            for role in self.roles_of(r):
                rows.append({"rank": r, "dp": self.dp_index(r), "copy": role.copy,
                             "stage": role.stage, "tile": role.tile})
        return rows
