"""Schedules as data: literal tables, parsing, lowering, the simulator and the validator."""

import pytest

from fxpar.core.schedule import (
    Action,
    add_comm,
    chain,
    format_grid,
    gpipe,
    one_f_one_b,
    pipeline,
    zero_bubble,
)
from fxpar.perf.simulate import ScheduleError, simulate, validate


def table(order):
    return {s: " ".join(map(str, acts)) for s, acts in order.items()}


def test_gpipe_table():
    assert table(gpipe(3, 4)) == {
        0: "0F0 0F1 0F2 0F3 0B0 0B1 0B2 0B3",
        1: "1F0 1F1 1F2 1F3 1B0 1B1 1B2 1B3",
        2: "2F0 2F1 2F2 2F3 2B0 2B1 2B2 2B3",
    }


def test_1f1b_table():
    assert table(one_f_one_b(3, 4)) == {
        0: "0F0 0F1 0F2 0B0 0F3 0B1 0B2 0B3",
        1: "1F0 1F1 1B0 1F2 1B1 1F3 1B2 1B3",
        2: "2F0 2B0 2F1 2B1 2F2 2B2 2F3 2B3",
    }


def test_1f1b_with_fewer_microbatches_than_stages():
    assert table(one_f_one_b(4, 2)) == {
        0: "0F0 0F1 0B0 0B1", 1: "1F0 1F1 1B0 1B1", 2: "2F0 2F1 2B0 2B1", 3: "3F0 3B0 3F1 3B1",
    }


def test_zero_bubble_table():
    """Stage s: min(S-s, m) warm-up forwards; then per micro-batch k its B, then the weight
    pass W_(k-s) once k >= s, then the next forward; the deferred Ws last."""
    assert table(zero_bubble(3, 3)) == {
        0: "0F0 0F1 0F2 0B0 0W0 0B1 0W1 0B2 0W2",
        1: "1F0 1F1 1B0 1F2 1B1 1W0 1B2 1W1 1W2",
        2: "2F0 2B0 2F1 2B1 2F2 2B2 2W0 2W1 2W2",
    }
    assert table(zero_bubble(2, 4)) == {
        0: "0F0 0F1 0B0 0W0 0F2 0B1 0W1 0F3 0B2 0W2 0B3 0W3",
        1: "1F0 1B0 1F1 1B1 1W0 1F2 1B2 1W1 1F3 1B3 1W2 1W3",
    }


def test_zero_bubble_timeline_by_hand():
    """S=3, m=3 with F = B = W = 1 tick (b_cost 2 split in two): the picture in
    fxpar.core.schedule, 11 = 3m + S - 1 ticks, every rank idle S - 1 = 2 of them."""
    res = simulate(pipeline(3, 3, "zero_bubble"), chain(3))
    compute = {r: [(str(sp.action), sp.start) for sp in spans if sp.action.kind in "FBW"]
               for r, spans in res.spans.items()}
    assert compute == {
        0: [("0F0", 0), ("0F1", 1), ("0F2", 2), ("0B0", 5), ("0W0", 6), ("0B1", 7), ("0W1", 8),
            ("0B2", 9), ("0W2", 10)],
        1: [("1F0", 1), ("1F1", 2), ("1B0", 4), ("1F2", 5), ("1B1", 6), ("1W0", 7),
            ("1B2", 8), ("1W1", 9), ("1W2", 10)],
        2: [("2F0", 2), ("2B0", 3), ("2F1", 4), ("2B1", 5), ("2F2", 6), ("2B2", 7),
            ("2W0", 8), ("2W1", 9), ("2W2", 10)],
    }
    assert res.makespan == 11
    assert res.busy == {0: 9, 1: 9, 2: 9}


def test_lowering_adds_communication_and_step():
    sched = pipeline(2, 2, "1f1b")
    assert table(sched) == {
        0: "0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1 STEP",
        1: "1RECV_F0 1F0 1B0 1SEND_B0 1RECV_F1 1F1 1B1 1SEND_B1 STEP",
    }


def test_skip_links_receive_from_every_sender():
    links = {0: {1, 2}, 1: {2}, 2: set()}
    acts = add_comm([Action("F", 2, 0), Action("B", 2, 0)], links)
    assert " ".join(map(str, acts)) == "2RECV_F0 2F0 2B0 2SEND_B0"
    sched = pipeline(3, 2, "gpipe", links)
    validate(sched, links)
    simulate(sched, links)


@pytest.mark.parametrize("text", ["0F1", "12B3", "1SEND_F3", "c1.2RECV_B0", "STEP",
                                  "ALLREDUCE", "ALLREDUCE2"])
def test_action_text_round_trips(text):
    assert str(Action.from_str(text)) == text
    a = Action.from_str(text)
    assert Action.from_str(str(a)) == a


def test_bad_action_text():
    with pytest.raises(ValueError, match="not an action: 'F0'"):
        Action.from_str("F0")


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("stages, m", [(2, 1), (2, 4), (3, 2), (4, 8), (5, 3)])
def test_generated_schedules_are_valid_and_bubble_matches_formula(name, stages, m):
    sched = pipeline(stages, m, name)
    validate(sched, chain(stages))
    res = simulate(sched, chain(stages))
    # with F = 1 and B = 2 ticks both schedules take (m + S - 1) * 3 ticks
    assert res.makespan == (m + stages - 1) * 3
    assert res.bubble == pytest.approx((stages - 1) / (m + stages - 1))


ZB_GRID = [(1, 1), (1, 3), (2, 1), (2, 2), (2, 4), (3, 2), (3, 3), (3, 7), (4, 2), (4, 4),
           (4, 8), (5, 3), (5, 5), (6, 13), (8, 8), (8, 32)]


@pytest.mark.parametrize("stages, m", ZB_GRID)
def test_zero_bubble_is_valid_and_matches_the_zb_h1_figures(stages, m):
    """F = B = W = 1 tick (b_cost = 2, split 1 + 1). ZB-H1 (Qi et al. 2023) with m >= S:
    3m + S - 1 ticks, bubble (S-1)/(3m+S-1), every rank idle S - 1 ticks, against 1F1B's
    3(m + S - 1) ticks, 3(S - 1) of them idle on every rank. With m < S the pipeline
    never fills: micro-batches leave the last stage every 2 ticks (F, B) and stage 0 ends with
    the last one's W, 2m + 2S - 1 ticks (= 3m + S - 1 at m = S)."""
    sched = pipeline(stages, m, "zero_bubble")
    validate(sched, chain(stages))
    res = simulate(sched, chain(stages))
    span = 3 * m + stages - 1 if m >= stages else 2 * m + 2 * stages - 1
    assert res.makespan == span
    assert res.busy == {r: 3 * m for r in range(stages)}  # F + B + W per micro-batch
    assert {r: res.makespan - b for r, b in res.busy.items()} == \
        {r: span - 3 * m for r in range(stages)}
    if m >= stages:
        assert span - 3 * m == stages - 1
        assert res.bubble == pytest.approx((stages - 1) / (3 * m + stages - 1))
    f1b = simulate(pipeline(stages, m, "1f1b"), chain(stages))
    assert f1b.makespan == 3 * (m + stages - 1) and f1b.busy == res.busy
    if stages > 1:
        assert res.makespan < f1b.makespan  # 1F1B idles 3(S-1) ticks per rank, ZB-H1 S-1
        assert res.bubble < f1b.bubble


def test_simulator_finds_a_deadlock():
    # both stages wait for the other's gradient before sending anything
    sched = {0: [Action("F", 0, 0), Action("RECV_B", 0, 0), Action("SEND_F", 0, 0),
                 Action("B", 0, 0)],
             1: [Action("RECV_F", 1, 0), Action("F", 1, 0), Action("B", 1, 0),
                 Action("SEND_B", 1, 0)]}
    with pytest.raises(ScheduleError, match=r"deadlock: ranks wait forever at \{0: '0RECV_B0', "
                       r"1: '1RECV_F0'\}"):
        simulate(sched, chain(2))


def test_validator_rules():
    with pytest.raises(ScheduleError, match="0B0 comes before its forward"):
        validate({0: [Action("B", 0, 0), Action("F", 0, 0)]}, chain(1))
    with pytest.raises(ScheduleError, match="forwards without backwards"):
        validate({0: [Action("F", 0, 0)]}, chain(1))
    with pytest.raises(ScheduleError, match="0SEND_F0 has no matching 1RECV_F0"):
        validate({0: [Action("F", 0, 0), Action("SEND_F", 0, 0), Action("B", 0, 0)],
                  1: [Action("F", 1, 0), Action("B", 1, 0)]}, chain(2))
    with pytest.raises(ScheduleError, match="stage 0 \\(copy 0\\) runs on ranks 0 and 1"):
        validate({0: [Action("F", 0, 0)], 1: [Action("B", 0, 0)]}, chain(1))


def test_validator_rejects_misplaced_weight_passes():
    F, B, W = (Action(k, 0, 0) for k in "FBW")
    validate({0: [F, B, W]}, chain(1))
    with pytest.raises(ScheduleError, match=r"rank 0: 0W0 comes before its input-gradient "
                       r"pass 0B0"):
        validate({0: [F, W, B]}, chain(1))
    with pytest.raises(ScheduleError, match="0W0 appears 2 times"):
        validate({0: [F, B, W, W]}, chain(1))
    with pytest.raises(ScheduleError, match=r"0W0 comes before its input-gradient pass 0B0 "
                       r"\(or that runs on another rank\)"):
        validate({0: [F, B], 1: [W]}, chain(1))


def test_grid_marks_the_failing_cell():
    grid = format_grid(pipeline(2, 1), mark=(1, 1))
    assert grid.splitlines()[0].split() == ["step", "rank", "0", "rank", "1"]
    assert "1F0 <-- ERROR HERE" in grid.splitlines()[2]


def test_each_schedule_is_one_entry_of_the_registry():
    """fxpar.core.schedule.SCHEDULES holds every schedule: the Plan field's type, the CLI
    choices and the plan checks come from it, and each entry's generator runs every forward
    and backward of every micro-batch on every stage once."""
    import typing

    from fxpar.core import plan as plan_module
    from fxpar.core.schedule import SCHEDULES, Action, pipeline

    hints = typing.get_type_hints(plan_module.Plan)
    assert typing.get_args(hints["schedule"]) == tuple(SCHEDULES) == plan_module.SCHEDULES
    for name, rule in SCHEDULES.items():
        v = 2 if rule.virtual else 1
        stages, m = 2 * v, 4
        assert not plan_module.Plan(stages=stages, microbatches=m, schedule=name,
                                    stages_per_rank=v).problems()
        done = [a for acts in pipeline(stages, m, name, per_rank=v).values() for a in acts
                if a.kind in ("F", "B")]
        want = sorted(Action(k, s, mb) for k in ("F", "B") for s in range(stages)
                      for mb in range(m))
        assert sorted(done) == want, name
        text, value = rule.bubble(stages // v, m, v)
        assert 0 <= value < 1 and text
