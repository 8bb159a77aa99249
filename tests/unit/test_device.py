"""The GPU path's logic without a GPU: device binding, CUDA-aware detection, host staging through
the seam fxpar.comm.route.Staging, and the torch.distributed Comm on one in-process rank.
Multi-rank checks (staging forced, gloo backend, both vs one process) are case_device_paths in
tests/mpi/cases/comm_cases.py."""

import warnings

import pytest
import torch

import fxpar.comm.device as device
import fxpar.comm.torch_dist as comm_torch
from fxpar.comm import launch
from fxpar.comm.device import DeviceError, bind, cuda_aware_mpi, node_local
from fxpar.comm.mpi import Comm
from fxpar.comm.route import Staging, direct


@pytest.fixture
def no_launcher(monkeypatch):
    for name in launch.VARIABLES:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def fake_gpus(monkeypatch):
    """torch.cuda reporting two GPUs; returns the list of set_device calls."""
    calls: list[int] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", calls.append)
    monkeypatch.setattr(device, "_warned_sharing", False)
    return calls


def test_node_local_rank_from_launcher_variables(no_launcher, monkeypatch):
    assert node_local() == (0, 1)
    monkeypatch.setenv("PMI_RANK", "5")
    monkeypatch.setenv("PMI_SIZE", "8")
    monkeypatch.setenv("MPI_LOCALRANKID", "1")
    assert device.local_rank() == 1
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "8")
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "7")
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_RANK", "3")
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_SIZE", "4")
    assert node_local() == (3, 4)  # Open MPI's names win (listed first: fxpar.comm.launch)


def test_node_local_rank_from_mpi_on_one_process():
    assert node_local(Comm()) == (0, 1)


def test_bind_cpu_and_auto_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert bind(None, "cpu") == torch.device("cpu")
    assert bind(None, "auto") == torch.device("cpu")
    with pytest.raises(DeviceError, match="torch.cuda.is_available.. is False.*--device cpu"):
        bind(None, "cuda")
    with pytest.raises(ValueError, match="unknown device 'tpu'"):
        bind(None, "tpu")


def test_bind_by_local_rank_round_robin_warns_once_when_shared(no_launcher, monkeypatch,
                                                                fake_gpus):
    monkeypatch.setenv("PMI_RANK", "3")
    monkeypatch.setenv("PMI_SIZE", "4")
    monkeypatch.setenv("MPI_LOCALRANKID", "3")
    monkeypatch.setenv("MPI_LOCALNRANKS", "4")
    with pytest.warns(UserWarning, match="4 ranks on this node share 2 GPU"):
        assert bind(None, "cuda") == torch.device("cuda", 1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert bind(None, "auto") == torch.device("cuda", 1)  # no second warning
    assert bind(None, "cuda:0") == torch.device("cuda", 0)
    assert fake_gpus == [1, 1, 0]
    with pytest.raises(DeviceError, match="cuda:2 does not exist: this node has 2 GPU"):
        bind(None, "cuda:2")


def test_cuda_aware_override_and_query(monkeypatch):
    monkeypatch.setenv("FXPAR_CUDA_AWARE", "1")
    assert cuda_aware_mpi() is True
    monkeypatch.setenv("FXPAR_CUDA_AWARE", "0")
    assert cuda_aware_mpi() is False
    monkeypatch.setenv("FXPAR_CUDA_AWARE", "yes")
    with pytest.raises(ValueError, match="use 1 .* or 0"):
        cuda_aware_mpi()
    monkeypatch.delenv("FXPAR_CUDA_AWARE")
    from mpi4py import MPI

    if MPI.Get_library_version().startswith("MPICH"):  # the query is found in the library
        assert hasattr(device._libmpi(), "MPIX_Query_cuda_support")
        if not torch.cuda.is_available():  # no GPU, so MPI says it cannot read one
            assert cuda_aware_mpi() is False


class CountingCopy:
    """The 'device copy' of the staging seam: counts copies in each direction."""

    def __init__(self):
        self.n = 0

    def __call__(self, dst, src):
        self.n += 1
        dst.copy_(src)


def staged_comm() -> tuple[Comm, CountingCopy]:
    c = Comm(stage=True)
    copy = CountingCopy()
    c._route.staging = Staging(copy=copy, keep=2)
    return c, copy


def test_staged_receive_lands_only_when_the_request_completes():
    c, copy = staged_comm()
    recv = torch.zeros(2, 3, dtype=torch.float64)
    r = c.irecv(recv, 0, tag=5)
    s = c.isend(torch.arange(6, dtype=torch.float64).reshape(2, 3), 0, tag=5)
    s.wait()
    assert copy.n == 1  # the send's copy into its host buffer
    assert not recv.any()  # MPI wrote the host buffer; the tensor waits for wait()
    r.wait()
    assert torch.equal(recv, torch.arange(6, dtype=torch.float64).reshape(2, 3))
    assert copy.n == 2


def test_staged_collectives_and_p2p_on_one_rank():
    c, copy = staged_comm()
    t = torch.full((3,), 2.0, dtype=torch.float64)
    assert torch.equal(c.allreduce(t), torch.full((3,), 2.0, dtype=torch.float64))
    m = torch.tensor([4.0, -1.0])
    c.allreduce(m, op="min")
    assert m.tolist() == [4.0, -1.0]
    req = c.iallreduce(u := torch.ones(4))
    req.wait()
    assert torch.equal(u, torch.ones(4))
    assert c.bcast(torch.tensor([7.0])).item() == 7.0
    assert [x.tolist() for x in c.allgather(torch.tensor([1, 2]))] == [[1, 2]]
    got = c.gather(torch.tensor([3.0]))
    assert got is not None and got[0].item() == 3.0
    s = (torch.arange(8, dtype=torch.bfloat16).reshape(2, 4) * 3).t()  # non-contiguous send
    r = torch.empty(4, 2, dtype=torch.bfloat16)
    c.sendrecv(s, 0, r, 0, tag=1)
    assert torch.equal(r, s)
    assert copy.n >= 14
    with pytest.raises(ValueError, match="contiguous"):
        c.irecv(torch.empty(3, 4).t(), 0)


def test_staging_reuses_host_buffers_within_its_bound():
    c, _ = staged_comm()
    staging = c._route.staging
    for _ in range(10):
        c.allreduce(torch.ones(5))
    assert staging.allocated == 1
    reqs = [c.iallreduce(torch.ones(5)) for _ in range(4)]  # four in flight at once
    Comm.waitall(reqs)
    assert staging.allocated == 4  # three more, since one buffer was free
    assert len(staging._free[(5, torch.float32)]) == 2  # keep=2: the rest are dropped


def test_cpu_tensors_skip_staging_unless_forced(monkeypatch):
    monkeypatch.delenv("FXPAR_FORCE_STAGING", raising=False)
    c = Comm()
    c.allreduce(torch.ones(3))
    assert c._route.staging.allocated == 0
    monkeypatch.setenv("FXPAR_FORCE_STAGING", "1")
    forced = Comm()
    forced.split(0).allreduce(torch.ones(3))  # sub-communicators share the route
    assert forced._route.staging.allocated == 1


def test_direct_buffers_are_torch_tensors_mpi_reads_after_a_stream_sync(monkeypatch):
    """The CUDA-aware route hands MPI the tensor itself (DLPack/CUDA array interface); on CPU
    mpi4py reads the same object through DLPack, which checks the route's buffer handling."""
    synced: list[bool] = []

    class Stream:
        def synchronize(self):
            synced.append(True)

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream())
    send = direct(torch.arange(8, dtype=torch.bfloat16).reshape(2, 4).t(), writable=False)
    assert send.dtype == torch.int16 and send.is_contiguous()
    recv = torch.empty(4, 2, dtype=torch.bfloat16)
    c = Comm()
    c._c.Sendrecv(send, dest=0, recvbuf=direct(recv, writable=True), source=0)
    assert torch.equal(recv, torch.arange(8, dtype=torch.bfloat16).reshape(2, 4).t())
    assert synced == [True, True]


@pytest.fixture
def gloo_world():
    world = comm_torch.torch_world("gloo")
    yield world
    torch.distributed.destroy_process_group()
    comm_torch._world = None


def test_torch_backend_on_one_rank(gloo_world):
    c = gloo_world
    assert isinstance(c, comm_torch.TorchComm) and (c.rank, c.size) == (0, 1)
    assert c.backend == "gloo" and comm_torch.torch_world() is c
    t = torch.full((2,), 3.0)
    assert torch.equal(c.allreduce(t), torch.full((2,), 3.0))
    req = c.iallreduce(u := torch.ones(3))
    req.wait()
    assert torch.equal(u, torch.ones(3))
    assert [x.tolist() for x in c.allgather(torch.tensor([4, 5]))] == [[4, 5]]
    got = c.gather(torch.tensor([6.0]))
    assert got is not None and got[0].item() == 6.0
    assert c.bcast(torch.tensor([8.0])).item() == 8.0
    r = torch.empty(2)  # to itself: through MPI (gloo has no self pairs)
    Comm.waitall([c.irecv(r, 0, 3), c.isend(torch.tensor([1.0, 2.0]), 0, 3)])
    assert r.tolist() == [1.0, 2.0]
    sub = c.split(0)
    assert isinstance(sub, comm_torch.TorchComm) and sub.size == 1
    assert sub.allreduce(torch.tensor([9.0])).item() == 9.0
    g = c.group([0])
    assert g is not None and g.bcast_object("x") == "x"
