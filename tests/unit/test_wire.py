"""The order on the wire (fxpar.core.wire, fxpar.comm.ordered), without ranks: every schedule
family gets a per-pair order both ends issue in and that completes when messages match in issue
order (as NCCL matches them); a broken order is caught at compile time; the runtime's sequencer
holds a message posted early until those before it are issued; halo exchanges put the lower
rank's send first; the issue-log check finds the order NCCL would hang on."""

from __future__ import annotations

import pytest
import torch
from test_lower import grid_of, setup

from fxpar.comm.ordered import Issued, Sequencer, exchange, issue_problems
from fxpar.core.lowering import lower
from fxpar.core.schedule import ScheduleError
from fxpar.core.wire import agreed_order, check_order, sequences

FAMILIES = [
    *(dict(stages=s, microbatches=m, schedule=k) for s in (2, 4) for m in (1, 4)
      for k in ("gpipe", "1f1b", "zero_bubble")),
    *(dict(stages=s, microbatches=m, schedule=k, stages_per_rank=2) for s in (4, 8) for m in (4, 8)
      for k in ("interleaved_1f1b", "zero_bubble_v")),
    dict(stages=4, microbatches=4, schedule="1f1b", gems=True),
    dict(stages=3, gems=True, gems_times=2, microbatches=2),
    dict(stages=2, spatial_parts=2, microbatches=4, schedule="zero_bubble", data_parallel=2),
    dict(stages=3, spatial_parts=2, spatial_stages=2, microbatches=2, schedule="1f1b"),
    dict(stages=2, spatial_parts=2, gems=True, data_parallel=2, microbatches=2),
]


def lowered(**plan):
    sched, graph, rm = setup(**plan)
    return lower(sched, graph, rm, grid_of(rm))


@pytest.mark.parametrize("plan", FAMILIES,
                         ids=lambda p: ",".join(f"{k}={v}" for k, v in p.items()))
def test_every_schedule_family_has_an_order_both_ends_issue(plan):
    low = lowered(**plan)
    orders = agreed_order(low)
    wire = sum(op.kind == "send" and op.peer != r for r, ops in low.items() for op in ops)
    assert sum(len(seq) for o in orders.values() for seq in o.values()) == 2 * wire > 0
    for me, order in orders.items():
        for peer, seq in order.items():  # the peer sees the same messages, sends as receives
            assert orders[peer][me] == tuple((not send, tag) for send, tag in seq)
            mine = [(op.kind == "send", op.tag) for op in low[me] if op.peer == peer
                    and op.kind in ("send", "recv")]
            assert sorted(mine) == sorted(seq)


def test_an_order_that_cannot_complete_fails_at_compile_time():
    low = lowered(stages=2, microbatches=4, schedule="1f1b")
    seqs = sequences(low)
    check_order(low, seqs)  # the agreed one completes
    backwards = {p: seq[::-1] for p, seq in seqs.items()}
    with pytest.raises(ScheduleError, match="no order both ends of every pair"):
        check_order(low, backwards)


class FakeComm:
    """Records what is issued, in order."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.log: list[tuple[str, int, int]] = []

    def isend(self, t, peer, tag=0):
        self.log.append(("send", peer, tag))
        return Done()

    def irecv(self, t, peer, tag=0):
        self.log.append(("recv", peer, tag))
        return Done()


class Done:
    waited = False

    def wait(self):
        self.waited = True

    def test(self):
        return True


def test_the_sequencer_holds_a_message_posted_before_those_ahead_of_it():
    comm = FakeComm(0)
    seq = Sequencer(comm, {1: ((True, 7), (False, 3), (False, 4))})
    r3 = seq.irecv(torch.zeros(1), 1, 3)  # posted early: the send of tag 7 comes first
    assert comm.log == [] and seq.unissued() == ["send to rank 1 (tag 7)",
                                                 "receive from rank 1 (tag 3)",
                                                 "receive from rank 1 (tag 4)"]
    with pytest.raises(RuntimeError, match="before issuing the messages that come first"):
        r3.wait()
    seq.isend(torch.zeros(1), 1, 7)
    assert comm.log == [("send", 1, 7), ("recv", 1, 3)]
    r3.wait()
    seq.irecv(torch.zeros(1), 1, 4)
    assert seq.unissued() == [] and len(comm.log) == 3
    assert seq.isend(torch.zeros(1), 0, 9) is not None and comm.log[-1] == ("send", 0, 9)
    with pytest.raises(RuntimeError, match="not in the order agreed"):
        seq.isend(torch.zeros(1), 1, 99)


def test_a_halo_exchange_puts_the_lower_ranks_send_first():
    t = torch.zeros(2)
    low, high = FakeComm(1), FakeComm(2)
    exchange(low, [(2, t), (0, t)], [(0, t), (2, t)], tag=5)
    exchange(high, [(1, t)], [(1, t)], tag=5)
    assert low.log == [("recv", 0, 5), ("send", 0, 5), ("send", 2, 5), ("recv", 2, 5)]
    assert high.log == [("recv", 1, 5), ("send", 1, 5)]


def test_the_issue_log_check_finds_what_nccl_would_hang_on():
    def msg(me, peer, send, n=4):
        return Issued("w", me, peer, send, n, "torch.float64")

    dual = [[msg(0, 1, True), msg(0, 1, False)], [msg(1, 0, False), msg(1, 0, True)]]
    assert issue_problems(dual) == []
    both_receive_first = [[msg(0, 1, False), msg(0, 1, True)],
                          [msg(1, 0, False), msg(1, 0, True)]]
    assert "rank 0 receives 4 torch.float64, rank 1 receives" in \
        issue_problems(both_receive_first)[0]
    sizes = [[msg(0, 1, True, 4)], [msg(1, 0, False, 5)]]
    assert issue_problems(sizes)
    missing = [[msg(0, 1, True), msg(0, 1, True)], [msg(1, 0, False)]]
    assert "issued 2 messages with rank 1, which issued 1" in issue_problems(missing)[0]
