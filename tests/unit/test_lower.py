"""Lowered per-rank schedules (fxpar.core.lowering) and MPI tag bounds, without MPI: correct
plans pass; hand-broken schedules fail naming the ranks and actions; tags above the bound are
plan errors at compile time and when a rank program meets its communicator."""

from __future__ import annotations

import re

import pytest
import torch
from helpers.errors_triggers import MixedDtypes as Mixed  # the catalogue's model of this error
from torch import nn

import fxpar
from fxpar.compiler.driver import links_of, rank_schedules
from fxpar.core.geometry import Grid
from fxpar.core.lowering import Op, check, lower
from fxpar.core.messages import MPI_TAG_UB_MIN, check_tags, max_p2p_tag, p2p_tag, tag_uses
from fxpar.core.plan import Plan, PlanError, RankMap
from fxpar.core.schedule import Action, Schedule
from fxpar.core.stages import StageGraph, Transfer
from fxpar.perf.simulate import ScheduleError
from fxpar.runtime.sync import Member, StageSync


def chain_graph(stages: int, shape: tuple[int, ...] = (2, 4, 8, 8)) -> StageGraph:
    """Stages in a chain, one float tensor across each cut (no modules: lowering reads only
    the transfers)."""
    return StageGraph((None,) * stages, ((),) * stages, (1,) * stages,  # type: ignore[arg-type]
                      tuple(Transfer(i, i, 0, i + 1, 0, shape, torch.float32, tiled=True)
                            for i in range(stages - 1)))


def setup(**plan: object) -> tuple[Schedule, StageGraph, RankMap]:
    p = Plan(**plan)  # type: ignore[arg-type]
    graph = chain_graph(p.stages)
    rm = RankMap(p)
    return rank_schedules(rm, links_of(graph)), graph, rm


def grid_of(rm: RankMap) -> Grid | None:
    """The tile grid of an image plan (the chain graph's tensors are N x C x H x W)."""
    return Grid(*rm.plan.tile_grid()) if rm.plan.spatial else None


def edit(schedule: Schedule, rank: int, fn: object) -> Schedule:
    out = {r: list(acts) for r, acts in schedule.items()}
    out[rank] = fn(out[rank])  # type: ignore[operator]
    return out


PLANS = [dict(stages=3, microbatches=4, schedule="1f1b"), dict(stages=4, microbatches=2),
         dict(stages=2, spatial_parts=4, microbatches=2),
         dict(stages=3, spatial_parts=2, spatial_stages=2, microbatches=2, schedule="1f1b"),
         dict(stages=3, gems=True, gems_times=2, microbatches=2),
         dict(stages=2, spatial_parts=2, gems=True, data_parallel=2, microbatches=2),
         dict(spatial_parts=4, data_parallel=2)]


@pytest.mark.parametrize("plan", PLANS, ids=lambda p: ",".join(f"{k}={v}" for k, v in p.items()))
def test_generated_schedules_lower_and_match(plan):
    sched, graph, rm = setup(**plan)
    lowered = lower(sched, graph, rm, grid_of(rm))
    matched = check(lowered, sched)
    sends = sum(op.kind == "send" for ops in lowered.values() for op in ops)
    assert matched == sends == sum(op.kind == "recv" for ops in lowered.values() for op in ops)


def test_lowered_ops_carry_the_runtime_tags_and_peers():
    sched, graph, rm = setup(stages=2, microbatches=2)
    ops = lower(sched, graph, rm, grid_of(rm))
    first = next(op for op in ops[0] if op.kind == "send")
    assert str(first) == "0SEND_F0 (to rank 1, tag 0)" and first.shape == (2, 4, 8, 8)
    grads = [op for op in ops[1] if op.action.kind == "SEND_B"]
    t = graph.transfers[0]
    assert [op.tag for op in grads] == [p2p_tag(t, 0, mb, True, 2, 1) for mb in (0, 1)] == [2, 3]
    assert max(op.tag for rs in ops.values() for op in rs) == max_p2p_tag(1, 2, 1)


def test_a_spatial_stage_gathers_every_tile():
    sched, graph, rm = setup(stages=2, spatial_parts=4)
    ops = lower(sched, graph, rm, grid_of(rm))
    recvs = [op for op in ops[4] if op.kind == "recv"]
    assert [op.peer for op in recvs] == [0, 1, 2, 3] and {op.shape for op in recvs} == \
        {(2, 4, 4, 4)}
    colls = [str(op) for op in ops[2] if op.kind == "coll"]
    assert colls == ["0F0 (collective on tiles c0s0 dp0, ranks [0, 1, 2, 3])",
                     "0B0 (collective on tiles c0s0 dp0, ranks [0, 1, 2, 3])",
                     "ALLREDUCE (collective on stage 0, ranks [0, 1, 2, 3])"]


def test_a_dropped_send_is_a_deadlock_naming_both_ranks():
    sched, graph, rm = setup(stages=3, microbatches=2)
    broken = edit(sched, 1, lambda acts: [a for a in acts if str(a) != "1SEND_F0"])
    with pytest.raises(ScheduleError) as e:
        check(lower(broken, graph, rm, grid_of(rm)), broken)
    text = str(e.value)
    assert "deadlock" in text
    assert "rank 2 waits at 2RECV_F0 (from rank 1, tag 1), while rank 1 waits at 1RECV_B0 " \
           "(from rank 2, tag 5)" in text
    assert "<-- ERROR HERE" in text  # the grid of the ranks involved


def test_a_swapped_receive_order_is_a_deadlock():
    sched, graph, rm = setup(stages=3, microbatches=4, schedule="1f1b")

    def swap(acts):  # the last stage runs micro-batch 2 (from its receive on) before 0
        i, j = acts.index(Action("RECV_F", 2, 0)), acts.index(Action("RECV_F", 2, 2))
        acts[i:i + 4], acts[j:j + 4] = acts[j:j + 4], acts[i:i + 4]
        return acts

    broken = edit(sched, 2, swap)
    with pytest.raises(ScheduleError, match=re.escape(
            "rank 2 waits at 2RECV_F2 (from rank 1, tag 5), while rank 1 waits at 1RECV_B0 "
            "(from rank 2, tag 9)")):
        check(lower(broken, graph, rm, grid_of(rm)), broken)


def test_running_before_receiving_is_reported():
    sched, graph, rm = setup(stages=2, microbatches=2)

    def swap(acts):
        i, j = acts.index(Action("RECV_F", 1, 0)), acts.index(Action("RECV_F", 1, 1))
        acts[i], acts[j] = acts[j], acts[i]
        return acts

    broken = edit(sched, 1, swap)
    with pytest.raises(ScheduleError, match=r"rank 1 runs 1F0 before receiving its inputs "
                                            r"\(1RECV_F0\)"):
        lower(broken, graph, rm, grid_of(rm))


def test_a_wrong_tag_is_never_received():
    sched, graph, rm = setup(stages=2, microbatches=1)
    lowered = lower(sched, graph, rm, grid_of(rm))
    lowered[0] = [Op(op.kind, op.step, op.action, op.peer, 99, op.shape)
                  if op.kind == "send" else op for op in lowered[0]]
    with pytest.raises(ScheduleError) as e:
        check(lowered, sched)
    text = str(e.value)
    assert "rank 1 waits at 1RECV_F0 (from rank 0, tag 0)" in text
    assert "sent and never received: rank 0's 0SEND_F0 (to rank 1, tag 99)" in text


def test_a_shape_mismatch_is_reported():
    sched, graph, rm = setup(stages=2)
    lowered = lower(sched, graph, rm, grid_of(rm))
    lowered[1] = [Op(op.kind, op.step, op.action, op.peer, op.tag, (1, 2))
                  if op.kind == "recv" else op for op in lowered[1]]
    with pytest.raises(ScheduleError, match=re.escape(
            "rank 0 sends 0SEND_F0 (to rank 1, tag 0) of shape (2, 4, 8, 8) but rank 1 "
            "receives it at 1RECV_F0 (from rank 0, tag 0) as shape (1, 2)")):
        check(lowered, sched)


def test_a_collective_entered_by_part_of_its_group():
    sched, graph, rm = setup(stages=2, spatial_parts=2)  # ranks 0, 1: tiles of stage 0
    broken = edit(sched, 1, lambda acts: [a for a in acts if a.kind != "ALLREDUCE"])
    with pytest.raises(ScheduleError, match=re.escape(
            "rank 0 waits at ALLREDUCE (collective on stage 0, ranks [0, 1]), while ranks [1] "
            "finished their step without entering it")):
        check(lower(broken, graph, rm, grid_of(rm)), broken)


def test_tiles_at_different_collectives_are_reported():
    sched, graph, rm = setup(stages=2, spatial_parts=2, microbatches=2)

    def swap(acts):  # tile 1 runs micro-batch 1 first
        i, j = acts.index(Action("F", 0, 0)), acts.index(Action("F", 0, 1))
        acts[i], acts[j] = acts[j], acts[i]
        acts[acts.index(Action("SEND_F", 0, 0))], acts[acts.index(Action("SEND_F", 0, 1))] = \
            Action("SEND_F", 0, 1), Action("SEND_F", 0, 0)
        return acts

    broken = edit(sched, 1, swap)
    with pytest.raises(ScheduleError, match=re.escape(
            "ranks of one communicator are at different collectives: rank 0 at 0F0 "
            "(collective on tiles c0s0 dp0, ranks [0, 1]), rank 1 at 0F1")):
        check(lower(broken, graph, rm, grid_of(rm)), broken)


# -- tags ------------------------------------------------------------------------------------
def test_tag_uses_of_a_plan():
    uses = tag_uses(Plan(stages=3, microbatches=4, gems=True), 2, {})
    assert uses["point-to-point transfers between stages"][0] == 2 * 2 * 4 * 2 - 1
    assert uses["communicator creation"][0] == 2
    check_tags(uses)  # far below 32767


def test_tags_over_a_small_bound_name_the_plan_sizes():
    uses = tag_uses(Plan(stages=2, microbatches=8), 3, {0: 40})
    with pytest.raises(PlanError) as e:
        check_tags(uses, 32, "a test bound (32)")
    text = str(e.value)
    assert "this program's MPI tags exceed a test bound (32)" in text
    assert "point-to-point transfers between stages need tags up to 47: 2 directions x 1 " \
           "model copies x 8 micro-batches per copy (microbatches x gems_times) x 3 tensors " \
           "crossing the stage cuts: use fewer micro-batches" in text
    assert "halo exchanges of stage 0 need tags up to 40" in text
    assert "communicator creation" not in text


def test_compile_refuses_tags_above_mpi_minimum():
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Flatten(),
                          nn.Linear(4 * 4 * 4, 3))
    mbs = MPI_TAG_UB_MIN // 2 + 2  # one transfer, two directions: tags up to 2 * mbs - 1
    with pytest.raises(PlanError, match=r"(?s)exceed 32767, the largest tag every MPI accepts "
                                        r".*need tags up to 32769: .* x 16385 micro-batches"):
        fxpar.compile(model, Plan(stages=2, microbatches=mbs), (mbs, 3, 4, 4))


class SmallTagComm:
    """A communicator whose MPI allows tags up to 5 (and that must not be used)."""

    size, rank, tag_ub = 2, 0, 5


def test_rank_program_checks_the_real_tag_bound_before_communicating():
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Flatten(),
                          nn.Linear(4 * 4 * 4, 3))
    program = fxpar.compile(model, Plan(stages=2, microbatches=4), (4, 3, 4, 4))  # tags 0..7
    with pytest.raises(PlanError, match=re.escape("exceed this MPI's MPI_TAG_UB (5)")):
        program.for_rank(0, SmallTagComm())  # type: ignore[arg-type]


# -- gradient sums checked before communicating -------------------------------------------
def test_mixed_parameter_dtypes_fail_at_compile_time_not_at_the_first_allreduce():
    x = torch.empty(2, 3, 4, 4, device="meta")
    fxpar.compile(Mixed(), Plan(), x)  # one rank: nothing is summed
    with pytest.raises(PlanError, match=r"stage 0's parameters have several dtypes "
                                        r"\(float32, float64\)"):
        fxpar.compile(Mixed(), Plan(data_parallel=2), x)


class NoComm:
    """Any use of this communicator beyond its size is a failure of the test."""

    size = 2

    def __getattr__(self, name: str) -> object:
        raise AssertionError(f"communicated: {name}")


def test_stage_sync_refuses_mixed_dtypes_before_touching_its_communicator():
    with pytest.raises(PlanError, match="this stage's parameters have several dtypes"):
        StageSync([Member(Mixed(), 0, 1, True)], NoComm(), 2)  # type: ignore[arg-type]


# -- the halo pass runs through the pass driver ---------------------------------------------
def small_cnn() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 3))


def test_compile_runs_the_halo_pass_for_tile_0_of_each_spatial_stage():
    seen: list[tuple[str, str]] = []
    program = fxpar.compile(small_cnn(), Plan(stages=2, spatial_parts=2), (2, 3, 8, 8),
                            after_pass=lambda name, gm: seen.append((name, type(gm).__name__)))
    assert [n for n, _ in seen] == ["trace", "precision", "spatial_region", "split_stages",
                                    "limit_region", "halo"]
    assert seen[-1][1].endswith("Tile0")
    assert program.spatial is not None and (0, 0) in program.spatial._cache


def test_a_failing_halo_pass_names_the_pass_and_the_tile(monkeypatch):
    from fxpar.compiler import driver
    from fxpar.compiler.passdriver import PassError

    def broken(stage, plan, **_):
        raise KeyError("boom")

    monkeypatch.setattr(driver, "TILE_PASSES", [("halo", broken)])
    with pytest.raises(PassError, match=r"pass 'halo' failed on stage 0, tile 0, copy 0 "
                                        r"\(after no passes\): KeyError"):
        fxpar.compile(small_cnn(), Plan(spatial_parts=2), (2, 3, 8, 8))
