"""fxpar.runtime.sync's gradient buckets hold each gradient once: from the moment a bucket's
sum starts, its parameters' ``.grad`` are views of it (the copy the sum runs on), not a second
tensor beside it. The sums themselves stay exact: tests/mpi (spatial, GEMS and DP cases against
one process, float64)."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn

from fxpar.runtime import sync as sync_mod
from fxpar.runtime.sync import Member, StageSync


class Recording:
    """A stand-in 2-rank stage group whose sums finish when waited for: each bucket is
    doubled in place then (the other rank's equal share)."""

    rank, size = 0, 2

    def __init__(self) -> None:
        self.buckets: list[torch.Tensor] = []

    def iallreduce(self, t: torch.Tensor) -> SimpleNamespace:
        self.buckets.append(t)
        return SimpleNamespace(wait=lambda: t.mul_(2))


def test_a_started_bucket_is_the_gradients_only_copy(monkeypatch):
    monkeypatch.setattr(sync_mod, "BUCKET_BYTES", 64)  # several buckets
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    x = torch.randn(5, 3)
    module(x).sum().backward()
    expected = [p.grad.clone() for p in module.parameters()]
    module.zero_grad(set_to_none=True)

    comm = Recording()
    sync = StageSync([Member(module, 0, 1, True)], comm, 1)  # type: ignore[arg-type]
    assert len(sync.buckets) > 1
    sync.reset()
    module(x).sum().backward()  # every bucket starts during backward
    assert len(comm.buckets) == len(sync.buckets)
    bases = {b.untyped_storage().data_ptr() for b in comm.buckets}
    for p in module.parameters():  # already views of the buckets: no gradient held twice
        assert p.grad.untyped_storage().data_ptr() in bases
    sync.grads()
    for p, e in zip(module.parameters(), expected, strict=True):
        assert p.grad.untyped_storage().data_ptr() in bases
        torch.testing.assert_close(p.grad, 2 * e, rtol=0, atol=0)
    sync.close()


def test_buckets_follow_the_stage_graphs_forward_order(monkeypatch):
    """A captured stage module registers its parameters in no forward order (ResNet-18's lists
    fc first, conv1 last): cut in that order, bucket 0 waited for conv1's gradient, the last
    of backward, and every sum started in one burst near its end. Cut in the graph's first-use
    order (reversed), the first sum starts while backward still has gradients to produce."""
    import fxpar
    from fxpar.models.zoo import build_model
    from fxpar.runtime.sync import forward_order

    monkeypatch.setattr(sync_mod, "BUCKET_BYTES", 2**20)
    model = build_model("torchvision:resnet18", num_classes=10)
    stage = fxpar.compile(model, fxpar.Plan(), (2, 3, 32, 32)).graph.modules[0]
    names = [n for n, _ in stage.named_parameters()]
    order = forward_order(stage)
    assert order.index("conv1.weight") < order.index("fc.weight")
    assert names.index("conv1.weight") > names.index("fc.weight")  # why the order is needed
    x = torch.randn(2, 3, 32, 32)
    started = {}
    for given in (None, order):
        comm = Recording()
        sync = StageSync([Member(stage, 0, 1, True)], comm, 1, given)  # type: ignore[arg-type]
        sync.reset()
        stage(x)[0].sum().backward()  # a stage module returns its outputs as a tuple
        started[given is not None] = (list(sync.started_at), len(sync.slots))
        sync.grads()
        sync.close()
        stage.zero_grad(set_to_none=True)
    (burst, n), (overlapped, _) = started[False], started[True]
    assert burst[0] > 0.9 * n, burst  # the module's order: the first sum waited for (nearly)
    assert overlapped[0] < n // 4, overlapped  # every gradient; forward order: early on
