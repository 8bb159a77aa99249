"""Schedules as data: literal tables, parsing, lowering, the simulator and the validator."""

import pytest

from fxpar.compiler.simulate import ScheduleError, simulate, validate
from fxpar.core.schedule import Action, add_comm, chain, format_grid, gpipe, one_f_one_b, pipeline


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


def test_grid_marks_the_failing_cell():
    grid = format_grid(pipeline(2, 1), mark=(1, 1))
    assert grid.splitlines()[0].split() == ["step", "rank", "0", "rank", "1"]
    assert "1F0 <-- ERROR HERE" in grid.splitlines()[2]
