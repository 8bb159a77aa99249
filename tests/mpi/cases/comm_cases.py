"""Comm primitives on real ranks (run by tests/mpi/test_comm.py under mpiexec)."""

import os
import time

import torch
from torch import nn

import fxpar
from fxpar.comm.world import world


def case_p2p_ring() -> None:
    c = world()
    nxt, prv = (c.rank + 1) % c.size, (c.rank - 1) % c.size
    send = torch.arange(6, dtype=torch.float64).reshape(2, 3) + c.rank
    recv = torch.empty(2, 3, dtype=torch.float64)
    r1 = c.irecv(recv, prv, tag=3)
    s1 = c.isend(send, nxt, tag=3)
    c.waitall([s1, r1])
    assert torch.equal(recv, torch.arange(6, dtype=torch.float64).reshape(2, 3) + prv)
    # sendrecv, bfloat16 bit patterns and a non-contiguous send buffer
    s = (torch.arange(8, dtype=torch.bfloat16).reshape(2, 4) * (c.rank + 1)).t()
    r = torch.empty(4, 2, dtype=torch.bfloat16)
    c.sendrecv(s, nxt, r, prv)
    assert torch.equal(r, (torch.arange(8, dtype=torch.bfloat16).reshape(2, 4) * (prv + 1)).t())


def case_recv_lands_in_place() -> None:
    c = world()
    if c.size < 2:
        return
    t = torch.zeros(5, dtype=torch.float32)
    view = t[1:4]
    if c.rank == 0:
        c.send(torch.tensor([1.0, 2.0, 3.0]), 1)
    elif c.rank == 1:
        c.recv(view, 0)
        assert t.tolist() == [0.0, 1.0, 2.0, 3.0, 0.0]


def case_collectives() -> None:
    c = world()
    t = torch.full((3,), float(c.rank + 1), dtype=torch.float64)
    c.allreduce(t)
    n = c.size
    assert torch.equal(t, torch.full((3,), n * (n + 1) / 2, dtype=torch.float64))
    m = torch.tensor([float(c.rank)])
    c.allreduce(m, op="max")
    assert m.item() == n - 1
    g = c.allgather(torch.tensor([c.rank, 10 * c.rank]))
    assert [x.tolist() for x in g] == [[r, 10 * r] for r in range(n)]
    got = c.gather(torch.tensor([float(c.rank)]), root=0)
    if c.rank == 0:
        assert got is not None and [x.item() for x in got] == list(range(n))
    else:
        assert got is None
    b = torch.tensor([42.0 if c.rank == 0 else 0.0])
    assert c.bcast(b).item() == 42.0
    req = c.iallreduce(t2 := torch.ones(4))
    req.wait()
    assert torch.equal(t2, torch.full((4,), float(n)))
    assert c.allgather_object({"r": c.rank}) == [{"r": r} for r in range(n)]
    for dt in (torch.float16, torch.bfloat16):  # summed in float32; sent as their bits
        h = torch.full((3,), 1.5, dtype=dt)
        c.iallreduce(h).wait()
        assert torch.equal(h, torch.full((3,), 1.5 * n, dtype=dt)), (dt, h)
        q = c.allreduce(torch.full((2,), 0.25, dtype=dt))
        assert torch.equal(q, torch.full((2,), 0.25 * n, dtype=dt)), (dt, q)
        nxt, prv = (c.rank + 1) % n, (c.rank - 1) % n
        got = c.sendrecv(torch.arange(4, dtype=dt) + c.rank, nxt, torch.empty(4, dtype=dt), prv)
        assert torch.equal(got, torch.arange(4, dtype=dt) + prv), (dt, got)


def case_subcommunicators() -> None:
    c = world()
    half = c.split(c.rank % 2)
    t = torch.tensor([float(c.rank)])
    half.allreduce(t)
    assert t.item() == sum(r for r in range(c.size) if r % 2 == c.rank % 2)
    evens = [r for r in range(c.size) if r % 2 == 0]
    g = c.group(evens)
    if c.rank in evens:
        assert g is not None and g.size == len(evens) and g.rank == evens.index(c.rank)
    else:
        assert g is None


def case_fails_on_rank_1() -> None:
    """A deliberate failure: rank 1 raises while rank 0 waits for it in a receive."""
    c = world()
    if c.rank == 1:
        raise RuntimeError("injected failure on rank 1")
    c.recv(torch.empty(1), 1)


def case_fails_after_peers_left() -> None:
    """The job's last case fails on rank 0 after every other rank has finished and exited."""
    if world().rank == 0:
        time.sleep(1.5)
        raise RuntimeError("injected late failure on rank 0")


class _Tiny(nn.Module):
    """conv-BN-ReLU, conv, global mean, linear, BN: halos, BN allreduces, a pipeline cut with
    BatchNorm statistics on both sides."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
                                  nn.Conv2d(4, 4, 3, padding=1))
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(4, 5)
        self.bn = nn.BatchNorm1d(5)

    def forward(self, x):
        return self.bn(self.fc(torch.flatten(self.pool(self.body(x)), 1)))


def case_device_paths() -> None:
    """The GPU path's logic on CPU: host staging forced for every tensor (FXPAR_FORCE_STAGING)
    and the torch.distributed backend (gloo) each train a 2-tile spatial plan and a 2-stage
    pipeline exactly like one process (tests/helpers/transparency.py, float64, one step)."""
    from helpers.transparency import Case, check

    from fxpar.comm.torch_dist import TorchComm

    for env in ({"FXPAR_FORCE_STAGING": "1"}, {"FXPAR_COMM": "torch"}):
        os.environ.update(env)
        try:
            for plan in (fxpar.Plan(spatial_parts=2), fxpar.Plan(stages=2, microbatches=2)):
                rp = check(Case(_Tiny, (4, 3, 9, 8), plan, steps=1))
                if rp is None:
                    continue
                assert rp.comm is not None
                if "FXPAR_COMM" in env:
                    assert isinstance(rp.comm, TorchComm), type(rp.comm)
                else:  # every message really went through host buffers, and they are reused
                    staged = rp.comm._route.staging
                    assert 0 < staged.allocated < 40, staged.allocated
        finally:
            for k in env:
                del os.environ[k]


def _tiny(plan: fxpar.Plan, dtype: torch.dtype = torch.float64) -> tuple:
    """:class:`_Tiny` compiled for ``plan`` (seeded alike on every rank), a batch for it, and
    the communicator of the plan's ranks (None on the others, which sit it out)."""
    from helpers.transparency import sub_comm

    torch.manual_seed(0)
    model = _Tiny().to(dtype)
    x = torch.randn(8, 3, 9, 8, dtype=dtype)
    y = torch.randint(0, 5, (8,))
    program = fxpar.compile(model, plan, x, optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
    return program, x, y, sub_comm(program.world_size)


def case_one_host_read_per_step() -> None:
    """Inside a training step, nothing reads a tensor's values back to the host but the loss
    the step returns (fxpar.perf.syncs.HostReads: on a GPU each read stops the host until
    the queue drains). Spatial with synchronised BatchNorm, a 1F1B pipeline, data parallel,
    GEMS and a float16 pipeline with its loss scale, each on the ranks it needs; the count
    is per rank, and the returned loss is the same on every rank of the plan."""
    from fxpar.perf.syncs import HostReads

    plans = (fxpar.Plan(spatial_parts=2), fxpar.Plan(stages=2, microbatches=2, schedule="1f1b"),
             fxpar.Plan(data_parallel=2), fxpar.Plan(stages=2, gems=True, microbatches=2),
             fxpar.Plan(stages=2, microbatches=2, precision="fp16"))  # the loss scale's flag
    for plan in plans:
        dtype = torch.float32 if plan.precision == "fp16" else torch.float64
        program, x, y, comm = _tiny(plan, dtype)
        if comm is None:
            world().barrier()  # wait for the plan's ranks
            continue
        rp = program.local(comm)
        rp.train_step(x, y)  # warm-up: buffers, shapes, staging pools
        with HostReads() as reads:
            loss = rp.train_step(x, y)
        assert reads.count == 1, f"{plan}: {reads.count} host reads in a step: {reads.report()}"
        losses = comm.allgather_object(loss)
        assert len(set(losses)) == 1, losses
        rp.close()
        world().barrier()


def _issued_since(start: int) -> tuple[int, list[str]]:
    """How many tensor messages all ranks issued since ``start`` (this rank's log length
    then), and where their order breaks what NCCL needs."""
    from fxpar.comm.ordered import issue_problems

    w = world()
    everyone = w.allgather_object(w.issued()[start:])
    return sum(map(len, everyone)), issue_problems(everyone)


def case_issue_order_agrees() -> None:
    """Under ``FXPAR_P2P=issue`` (torchrun, gloo): tags are really ignored, as NCCL ignores
    them -- two messages received in the other order land swapped -- and every pair of ranks
    issues its messages in one order on both ends (a send where the other end has the
    receive, fxpar.comm.ordered.issue_problems), as NCCL needs, for a 1F1B pipeline,
    interleaved virtual stages, zero-bubble SP2 x PP2, GEMS and SP2 x DP2. The 1F1B
    pipeline's runtime without the sequencer posts its receives early and fails that check:
    the check sees the order NCCL would hang on."""
    from fxpar.comm.torch_dist import p2p_mode

    w = world()
    assert p2p_mode() == "issue" and hasattr(w, "issued"), "run under torchrun, FXPAR_P2P=issue"
    a, b = torch.zeros(2), torch.zeros(2)
    if w.rank == 0:
        w.waitall([w.isend(torch.full((2,), 1.0), 1, tag=5), w.isend(torch.full((2,), 2.0), 1,
                                                                        tag=6)])
    elif w.rank == 1:
        w.waitall([w.irecv(b, 0, tag=6), w.irecv(a, 0, tag=5)])
        assert b.tolist() == [1.0, 1.0] and a.tolist() == [2.0, 2.0], (a, b)  # in issue order
    plans = (fxpar.Plan(stages=2, microbatches=4, schedule="1f1b"),
             fxpar.Plan(stages=4, microbatches=2, schedule="interleaved_1f1b",
                        stages_per_rank=2),
             fxpar.Plan(stages=2, spatial_parts=2, microbatches=2, schedule="zero_bubble"),
             fxpar.Plan(stages=2, gems=True, microbatches=2),
             fxpar.Plan(spatial_parts=2, data_parallel=2))
    for plan, unordered in [(p, False) for p in plans] + [(plans[0], True)]:
        program, x, y, comm = _tiny(plan)
        start = len(w.issued())
        if comm is not None:
            rp = program.local(comm)
            if unordered:
                rp.runtime.wire = None  # as the runtime posted before the sequencer
            rp.train_step(x, y)
            rp.train_step(x, y)
            rp.forward(x)
            rp.close()
        count, problems = _issued_since(start)
        assert count > 0 and bool(problems) == unordered, f"{plan}: {count}, {problems}"
        if unordered and w.rank == 0:
            print("without the sequencer:", problems[0])


def case_device_syncs_per_step() -> None:
    """On a GPU (FXPAR_TEST_DEVICE=cuda), what ``torch.cuda.set_sync_debug_mode`` sees in one
    training step: the loss read alone. A one-rank program always; SP2 and a 1F1B pipeline
    on two ranks when messages travel over NCCL (a staged or MPI route copies through the
    host, which is a wait by design)."""
    import warnings

    from fxpar.comm.device import bind

    w = world()
    plans = [fxpar.Plan()]
    if getattr(w, "backend", "") == "nccl":
        plans += [fxpar.Plan(spatial_parts=2),
                  fxpar.Plan(stages=2, microbatches=2, schedule="1f1b")]
    for plan in plans:
        program, x, y, comm = _tiny(plan)
        if comm is None:
            w.barrier()
            continue
        dev = bind(None, "cuda")
        rp = program.local(comm)
        rp.to(dev)
        x, y = x.to(dev), y.to(dev)
        rp.train_step(x, y)  # warm-up
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                rp.train_step(x, y)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        syncs = [str(s.message) for s in seen if "synchroniz" in str(s.message)]
        assert len(syncs) == 1, f"{plan}: {len(syncs)} device syncs in a step: {syncs[:4]}"
        rp.close()
        w.barrier()
