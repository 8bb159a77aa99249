"""Activation recompute (``Plan(recompute=...)``) vs one process without it, in float64 (run by
tests/mpi/test_recompute.py): loss, every gradient, parameters after 2 SGD steps, every buffer
(BatchNorm's running statistics are updated once, by the first forward), on plain, pipelined,
spatial (halos and statistics replayed), GEMS, data-parallel and volume plans; and what it does:
a recomputed stage saves nothing for backward during its forward, and a step exchanges exactly
the same messages and collectives as without recompute."""

from __future__ import annotations

import copy
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from helpers.transparency import Case, check, sub_comm

import fxpar
from fxpar import models
from fxpar.comm.mpi import Comm
from fxpar.runtime import loop

P = fxpar.Plan


def _unet() -> torch.nn.Module:
    return models.build("unet", num_classes=3, base_channels=4, depth=3)


def _amoeba() -> torch.nn.Module:
    return models.build("amoebanet", num_classes=5, num_layers=3, num_filters=16)


class _AddAtCut(torch.nn.Module):
    """``a += b`` right after a stage cut: stage 1's input is written in place by its first
    node, so a checkpoint segment that recomputed from that input would add ``b`` twice."""

    def __init__(self) -> None:
        super().__init__()
        conv = [torch.nn.Conv2d(3 if i < 2 else 8, 8, 3, padding=1) for i in range(4)]
        self.c1, self.c2, self.c3, self.c4 = conv
        self.fc = torch.nn.Linear(8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.c1(x)
        b = self.c2(x)
        a += b
        a = self.c4(self.c3(F.relu(a)))
        return self.fc(F.relu(a).mean((2, 3)))


CASES: dict[str, tuple[Callable[[], torch.nn.Module], tuple[int, ...], fxpar.Plan, bool]] = {
    "unet_one_mb2_always": (_unet, (4, 3, 32, 32), P(microbatches=2, recompute="always"),
                            True),
    "amoeba_pp2_1f1b_except_last": (_amoeba, (4, 3, 32, 32),
                                    P(stages=2, microbatches=2, schedule="1f1b",
                                      recompute="except_last"), False),
    "unet_sp4_always": (_unet, (2, 3, 32, 40), P(spatial_parts=4, recompute="always"), True),
    "unet_sp3_pp2_always": (_unet, (4, 3, 32, 32),
                            P(stages=2, spatial_parts=3, slice="horizontal", microbatches=2,
                              recompute="always"), True),
    "amoeba_sp2_2spatial_pp_except_last": (_amoeba, (4, 3, 48, 48),
                                           P(stages=3, spatial_parts=2, spatial_stages=2,
                                             microbatches=2, schedule="1f1b",
                                             recompute="except_last"), False),
    "unet_sp2_gems_always": (_unet, (4, 3, 32, 32),
                             P(stages=2, spatial_parts=2, gems=True, microbatches=2,
                               recompute="always"), True),
    "unet_sp2_dp2_always": (_unet, (4, 3, 32, 32),
                            P(spatial_parts=2, data_parallel=2, recompute="always"), True),
    "unet_sp4_segments3": (_unet, (2, 3, 32, 40), P(spatial_parts=4, recompute_segments=3),
                           True),
    "amoeba_sp2_pp2_1f1b_segments4": (_amoeba, (4, 3, 48, 48),
                                      P(stages=2, spatial_parts=2, microbatches=2,
                                        schedule="1f1b", recompute_segments=4), False),
    "unet_pp2_always_and_segments2": (_unet, (4, 3, 32, 32),
                                      P(stages=2, microbatches=2, recompute="always",
                                        recompute_segments=2), True),
    "unet3d_cube_segments3": (lambda: models.build("unet3d", in_channels=3, num_classes=3,
                                                   base=2, depth=3),
                              (2, 3, 16, 16, 16), P(spatial_parts=4, slice="cube",
                                                    recompute_segments=3), True),
    "add_in_place_at_cut_pp2_segments2": (_AddAtCut, (4, 3, 16, 16),
                                          P(stages=2, balance=(2, 7), microbatches=2,
                                            recompute_segments=2), False),
    "add_in_place_at_cut_sp2_pp2_segments3": (_AddAtCut, (4, 3, 16, 16),
                                              P(stages=2, balance=(2, 7), spatial_parts=2,
                                                spatial_stages=2, microbatches=2,
                                                recompute_segments=3), False),
    "unet3d_cube_always": (lambda: models.build("unet3d", in_channels=3, num_classes=3, base=2,
                                                depth=3),
                           (2, 3, 16, 16, 16), P(spatial_parts=4, slice="cube",
                                                 recompute="always"), True),
}


def case_amoeba_sp2_pp2_auto_recomputes_the_stage_over_budget() -> None:
    """recompute="auto" with a budget between the ranks' estimates: the stages of the ranks
    over it are recomputed, the others not, and training is still exact."""
    from fxpar.perf.memory import estimate

    plan = P(stages=2, spatial_parts=2, microbatches=2, schedule="1f1b")
    shape = (4, 3, 48, 48)
    comm = sub_comm(plan.world_size)
    auto, over, totals = plan, set(), {}  # a rank outside the plan only joins check's split
    if comm is not None:
        meta = torch.empty(shape, dtype=torch.float64, device="meta")
        program = fxpar.compile(_amoeba().double(), plan, meta, comm=comm)  # one trace
        totals = {m.rank: m.total for m in estimate(program)}
        budget = (min(totals.values()) + max(totals.values())) // 2
        over = {program.rank_map.roles_of(r)[0].stage for r, t in totals.items() if t > budget}
        assert over and over != {0, 1}, totals
        auto = P(**{**plan.to_json(), "recompute": "auto", "memory_per_rank": budget})
    rp = check(Case(_amoeba, shape, auto))
    assert rp is None or rp.program.recompute == over, (rp.program.recompute, over, totals)


def _case(name: str) -> None:
    build, shape, plan, seg = CASES[name]
    check(Case(build, shape, plan, classes=3 if seg else 5, segmentation=seg))


for _name in CASES:
    globals()[f"case_{_name}"] = (lambda a=_name: _case(a))


# -- what recompute does ---------------------------------------------------------------------
@contextmanager
def _counted() -> Iterator[Counter]:
    """Every message and collective any communicator of this process makes, by kind."""
    calls: Counter = Counter()
    names = ("isend", "irecv", "allreduce", "allgather")
    old = {n: getattr(Comm, n) for n in names}

    def counting(name: str) -> Callable[..., Any]:
        def call(self: Comm, *args: Any, **kw: Any) -> Any:
            calls[name] += 1
            return old[name](self, *args, **kw)
        return call

    for n in names:
        setattr(Comm, n, counting(n))
    try:
        yield calls
    finally:
        for n, f in old.items():
            setattr(Comm, n, f)


@contextmanager
def _saved_in_forward() -> Iterator[list[int]]:
    """Bytes autograd saves for backward inside F actions (not inside a recompute at B)."""
    saved = [0]
    original = loop.Runtime._forward

    def forward(self: loop.Runtime, a: Any, st: Any) -> None:
        def pack(t: torch.Tensor) -> torch.Tensor:
            saved[0] += t.numel() * t.element_size()
            return t
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            original(self, a, st)

    loop.Runtime._forward = forward  # type: ignore[method-assign]
    try:
        yield saved
    finally:
        loop.Runtime._forward = original  # type: ignore[method-assign]


def case_recompute_saves_nothing_at_f_and_exchanges_the_same() -> None:
    """SP3+PP2 U-Net (4 ranks): the same loss and messages per rank with and without
    recompute (stage recompute and checkpoint segments); the F actions of a recomputed stage
    save nothing for backward."""
    plan = P(stages=2, spatial_parts=3, slice="horizontal", microbatches=2)
    comm = sub_comm(plan.world_size)
    if comm is None:
        return
    torch.manual_seed(0)
    model = _unet().double()
    x = torch.randn(4, 3, 32, 32, dtype=torch.float64)
    y = torch.randint(0, 3, (4, 32, 32))
    got = {}
    for mode in ("never", "always", "segments"):
        fields = {"recompute": mode} if mode != "segments" else {"recompute_segments": 3}
        program = fxpar.compile(copy.deepcopy(model), fxpar.Plan(**{**plan.to_json(),
                                                                   **fields}),
                                torch.empty(x.shape, dtype=x.dtype, device="meta"),
                                loss_fn=F.cross_entropy, comm=comm)
        with program.local(comm) as rp, _counted() as calls, _saved_in_forward() as saved:
            loss = rp.train_step(x, y)
            pieces = [len(r.segments) for r in rp.runtime._segmented.values()]
        assert pieces == ([3] if mode == "segments" else []), (mode, pieces)
        got[mode] = (loss, dict(calls), saved[0])
    (loss0, calls0, saved0), (loss1, calls1, saved1) = got["never"], got["always"]
    assert calls1 == calls0, f"rank {comm.rank}: recompute changed the exchanges: {calls0} -> " \
                             f"{calls1}"
    loss2, calls2, _ = got["segments"]  # checkpoint segments replay theirs too
    assert calls2 == calls0, f"rank {comm.rank}: segments changed the exchanges: {calls0} -> " \
                             f"{calls2}"
    assert torch.equal(torch.as_tensor(loss0), torch.as_tensor(loss2)), (loss0, loss2)
    assert calls0.get("isend", 0) > 0 or comm.rank >= 3, calls0
    assert saved0 > 0 and saved1 == 0, (saved0, saved1)
    assert torch.equal(torch.as_tensor(loss0), torch.as_tensor(loss1)), (loss0, loss1)


torch.set_num_threads(1)
