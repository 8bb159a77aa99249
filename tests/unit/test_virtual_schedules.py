"""Schedules with several stages per rank (interleaved 1F1B, ZB-V) as data: literal tables,
placement, validity and simulated bubbles against the published figures."""

import pytest

import fxpar
from fxpar.core.plan import PlanError, RankMap
from fxpar.core.schedule import chain, interleaved_1f1b, pipeline, v_position, zero_bubble_v
from fxpar.perf.simulate import simulate, validate


def table(order):
    return {r: " ".join(map(str, acts)) for r, acts in order.items()}


def test_interleaved_table_4_stages_on_2_ranks():
    # Megatron's order: rounds of P=2 micro-batches through chunk 0, then chunk 1; rank 0
    # warms up with 2(P-1-0) + (v-1)P = 4 forwards, rank 1 with 2
    assert table(interleaved_1f1b(4, 4, per_rank=2)) == {
        0: "0F0 0F1 2F0 2F1 0F2 2B0 0F3 2B1 2F2 0B0 2F3 0B1 2B2 2B3 0B2 0B3",
        1: "1F0 1F1 3F0 3B0 3F1 3B1 1F2 1B0 1F3 1B1 3F2 3B2 3F3 3B3 1B2 1B3",
    }


@pytest.mark.parametrize("stages, per_rank, m", [(4, 2, 2), (4, 2, 4), (8, 2, 4), (8, 2, 8),
                                                 (6, 3, 4), (8, 4, 2), (4, 1, 4)])
def test_interleaved_bubble_is_1f1b_over_v(stages, per_rank, m):
    sched = pipeline(stages, m, "interleaved_1f1b", per_rank=per_rank)
    validate(sched, chain(stages))
    res = simulate(sched, chain(stages))
    ranks = stages // per_rank
    assert res.bubble == pytest.approx((ranks - 1) / (per_rank * m + ranks - 1))
    for s in range(stages):  # each stage's micro-batches in order: F, and B
        for kind in "FB":
            mbs = [a.mb for a in sched[s % ranks] if a.kind == kind and a.stage == s]
            assert mbs == list(range(m))


def test_v_placement():
    assert [v_position(s, 3) for s in range(6)] == [0, 1, 2, 2, 1, 0]
    rm = RankMap(fxpar.Plan(stages=6, stages_per_rank=2, microbatches=2,
                            schedule="zero_bubble_v"))
    assert [sorted(r.stage for r in rm.roles_of(k)) for k in range(3)] == [[0, 5], [1, 4], [2, 3]]
    assert rm.rank_of(0, 0, 4) == 1


@pytest.mark.parametrize("stages, m", [(4, 1), (4, 2), (4, 4), (6, 3), (8, 2), (8, 8), (8, 16)])
def test_zero_bubble_v_is_valid_and_beats_zb_h1(stages, m):
    order = zero_bubble_v(stages, m)
    ranks = stages // 2
    for r, acts in order.items():
        assert {a.stage for a in acts} == {r, stages - 1 - r}
        held = peak = 0
        for a in acts:  # at most 2P micro-batch chunks in flight (F done, W not)
            held += {"F": 1, "W": -1}.get(a.kind, 0)
            peak = max(peak, held)
        assert peak <= 2 * ranks
        for s in {r, stages - 1 - r}:
            for kind in "FBW":
                assert [a.mb for a in acts if a.kind == kind and a.stage == s] == list(range(m))
    sched = pipeline(stages, m, "zero_bubble_v")
    validate(sched, chain(stages))
    v = simulate(sched, chain(stages)).makespan
    # the same model as ZB-H1 / 1F1B on P whole stages (twice the ticks per stage)
    h1 = 2 * simulate(pipeline(ranks, m, "zero_bubble"), chain(ranks)).makespan
    f1 = 2 * simulate(pipeline(ranks, m, "1f1b"), chain(ranks)).makespan
    assert v <= h1 < f1 or m < ranks
    if m >= 2 * ranks:
        assert v < h1


@pytest.mark.parametrize("kw, match", [
    ({"stages": 4, "microbatches": 4, "schedule": "interleaved_1f1b"}, "stages_per_rank >= 2"),
    ({"stages": 5, "stages_per_rank": 2, "microbatches": 4, "schedule": "interleaved_1f1b"},
     "not a multiple of stages_per_rank"),
    ({"stages": 4, "stages_per_rank": 2, "microbatches": 3, "schedule": "interleaved_1f1b"},
     "multiple of 2"),
    ({"stages": 6, "stages_per_rank": 3, "microbatches": 3, "schedule": "zero_bubble_v"},
     "set stages_per_rank=2"),
    ({"stages": 4, "stages_per_rank": 2, "microbatches": 2, "spatial_parts": 2,
      "schedule": "zero_bubble_v"}, "same tiles"),
    ({"stages": 4, "stages_per_rank": 2, "microbatches": 2}, "set stages_per_rank=1"),
])
def test_unsupported_combinations_say_what_to_change(kw, match):
    with pytest.raises(PlanError, match=match):
        fxpar.Plan(**kw)
