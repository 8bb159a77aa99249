"""1-D spatial parallelism vs one process (run by tests/mpi/test_seq1d.py): sequences (N, C, L)
cut into P tiles along L (fxpar issue 40, item 4). Every 1-D op class at P = 2, 3, 4 on odd
lengths (uneven tiles); a 1-D CNN classifier (conv / BatchNorm / ReLU / max pool, stride 2,
a global mean and a linear head) on a long sequence at P = 2, 3, 4 and with halo fusion; a
1-D U-Net for per-position labels (N, L) under SP3, SP4, SP2+PP2, SP2+DP2 and SP2+GEMS+PP2.
Every case checks loss, every gradient, parameters after 2 SGD steps with momentum and every
buffer in float64 (tests/helpers/transparency.py), and that at least 95% of the forward FLOPs
run on tiles (90% for the op cases). A halo one sample short is caught."""

from __future__ import annotations

import torch
from helpers.seq1d import Classifier, Convs, Pads, PerPosition, Pools, UNet1d, Upsampling
from helpers.transparency import Case, assert_covers, check

import fxpar

P = fxpar.Plan
torch.set_num_threads(1)


OPS = {"convs": (Convs, (2, 2, 61)), "pools": (Pools, (2, 2, 151)),
       "upsampling": (Upsampling, (2, 2, 53)), "pads": (Pads, (2, 2, 47)),
       "per_position": (PerPosition, (2, 2, 43))}
PARTS = (2, 3, 4)


def _op_case(name: str, parts: int) -> None:
    build, shape = OPS[name]
    assert_covers(check(Case(build, shape, P(spatial_parts=parts))), f"{name} sp{parts}", 0.9)


for _op in OPS:
    for _p in PARTS:
        globals()[f"case_op_{_op}__sp{_p}"] = (lambda a=_op, b=_p: _op_case(a, b))


# -- whole models --------------------------------------------------------------------------
LENGTH = 4099
"""The classifier's sequence: odd, so every P cuts it unevenly, and long enough that each
tile holds hundreds of samples after the stride-2 layers."""


def _classifier(parts: int) -> None:
    rp = check(Case(Classifier, (2, 2, LENGTH), P(spatial_parts=parts, slice="vertical")))
    assert_covers(rp, f"classifier sp{parts}")


def _unet(plan: fxpar.Plan, batch: int, what: str) -> None:
    rp = check(Case(UNet1d, (batch, 2, 1001), plan, classes=3, segmentation=True))
    assert_covers(rp, f"unet1d {what}")


for _p in PARTS:
    globals()[f"case_classifier__sp{_p}"] = (lambda p=_p: _classifier(p))
for _p in PARTS[1:]:  # SP2: under PP2 and DP2 below
    globals()[f"case_unet1d__sp{_p}"] = (lambda p=_p: _unet(P(spatial_parts=p), 2, f"sp{p}"))


def case_unet1d__sp2_pp2() -> None:
    _unet(P(stages=2, spatial_parts=2, microbatches=2, schedule="1f1b"), 4, "sp2 pp2")


def case_unet1d__sp2_dp2() -> None:
    _unet(P(spatial_parts=2, data_parallel=2), 4, "sp2 dp2")


def case_unet1d__sp2_gems_pp2() -> None:
    _unet(P(stages=2, spatial_parts=2, microbatches=2, gems=True), 4, "sp2 gems pp2")


def case_classifier__sp3_halo_fusion() -> None:
    """Chains of convolutions and pools share one wider exchange along L."""
    rp = check(Case(Classifier, (2, 2, 999), P(spatial_parts=3, halo_fusion="all")))
    assert_covers(rp, "classifier sp3 halo fusion")


# -- the check catches a halo one sample short -------------------------------------------------
def case_halo_one_sample_short_is_caught() -> None:
    """At P = 2 the stride-2 convolution of ``Convs`` reads 2 samples of the left tile. Make
    rank 1's first forward halo from the left one sample short, its farthest sample read as
    the zero padding of a border (what an off-by-one in the window arithmetic would do): the
    check must fail on rank 1, at the first step's loss (proof that the halos are exchanged
    and that the harness sees one sample)."""
    import os
    import sys

    from helpers.equivalence import collect_failures

    from fxpar.comm.world import world
    from fxpar.runtime.spatial import exchange

    original = exchange.rebuild
    fired: list[int] = []

    def rebuild(x, ex, replicated, pieces):  # type: ignore[no-untyped-def]
        if not fired and not replicated and world().rank == 1 and \
                sys._getframe(1).f_code.co_name == "window":
            start = ex.own.dims[0][0]
            left = [i for i, (rect, _) in enumerate(pieces) if rect.dims[0][1] <= start]
            if left:
                pieces = [(r, b.clone().index_fill_(2, torch.tensor([0]), 0) if i in left else b)
                          for i, (r, b) in enumerate(pieces)]
                fired.append(len(left))
        return original(x, ex, replicated, pieces)

    exchange.rebuild = rebuild
    os.environ["FXPAR_HALO_WINDOW"] = "1"  # convolutions assemble their window: rebuild
    try:
        with collect_failures() as failures:
            check(Case(Convs, (2, 2, 61), P(spatial_parts=2)))
    finally:
        exchange.rebuild = original
        del os.environ["FXPAR_HALO_WINDOW"]
    everyone = world().allgather_object((bool(fired), failures[:3]))[:2]
    assert [f for f, _ in everyone] == [False, True], everyone
    caught = everyone[1][1]
    assert caught and caught[0].startswith("step 0 loss: 1 of 1 elements differ"), caught
    if world().rank == 0:
        print(f"a halo one sample short on rank 1 caught: {caught[0][:120]}", flush=True)
