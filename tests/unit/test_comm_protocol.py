"""The communicator protocol (fxpar.comm.protocol.Comm): both backends implement every member
with the protocol's parameters, so code typed against the protocol runs on either."""

import inspect

import pytest

from fxpar.comm import protocol
from fxpar.comm.distributed import DistComm
from fxpar.comm.mpi import Comm as MpiComm
from fxpar.comm.torch_dist import TorchComm

MEMBERS = [n for n, v in vars(protocol.Comm).items()
           if not n.startswith("_") and (callable(v) or isinstance(v, property))]


def test_the_protocol_lists_what_the_runtime_uses():
    assert {"rank", "size", "isend", "irecv", "sendrecv", "allreduce", "iallreduce", "split",
            "group", "barrier", "abort"} <= set(MEMBERS)


@pytest.mark.parametrize("backend", [MpiComm, TorchComm, DistComm],
                         ids=["mpi", "torch", "torchrun"])
@pytest.mark.parametrize("name", MEMBERS)
def test_each_backend_implements_each_member(backend, name):
    want = vars(protocol.Comm)[name]
    got = inspect.getattr_static(backend, name, None)
    assert got is not None, f"{backend.__name__} has no {name}"
    if isinstance(want, property):
        assert isinstance(got, property), f"{backend.__name__}.{name} is not a property"
        return
    fn = got.__func__ if isinstance(got, (staticmethod, classmethod)) else got
    params = list(inspect.signature(want).parameters)[1:]  # after self
    have = list(inspect.signature(fn).parameters)
    have = have[1:] if have and have[0] == "self" else have
    assert have[:len(params)] == params, f"{backend.__name__}.{name}{have} vs {params}"
