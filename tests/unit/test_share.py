"""One capture per job (fxpar.frontend.share): the graph rank 0 traces, sent as bytes and rebuilt
over another rank's own copy of the model, is the same graph -- node for node with the metadata
the compiler reads, every parameter and buffer under the same name and registration, modes, and
the same program compiled from it; a failure to trace reaches every rank."""

from __future__ import annotations

import pytest
import torch
import torchvision.models as tvm
from torch import nn

import fxpar
from fxpar.frontend.capture import TraceError
from fxpar.frontend.share import KEPT_META, WAIT_POLL, pack, shared_trace, unpack
from fxpar.frontend.trace import trace


class FakeComm:
    """Two ranks in one process: rank 0's broadcast is what rank 1 receives."""

    def __init__(self, rank: int, sent: list | None = None) -> None:
        self.rank, self.size = rank, 2
        self.sent = sent if sent is not None else []
        self.polls: list[float | None] = []

    def bcast_object(self, obj: object, root: int = 0) -> object:
        if self.rank == root:
            self.sent.append(obj)
            return obj
        return self.sent.pop(0)

    def barrier(self, poll: float | None = None) -> None:
        self.polls.append(poll)


def _timm(name: str):
    def build() -> nn.Module:
        import timm

        return timm.create_model(name, num_classes=5)
    return build


def _smp() -> nn.Module:
    import segmentation_models_pytorch as smp

    return smp.Unet(encoder_name="resnet18", encoder_weights=None, classes=3)


def _monai() -> nn.Module:
    import monai.networks.nets as mn

    return mn.UNet(spatial_dims=2, in_channels=3, out_channels=3, channels=(8, 16, 32),
                   strides=(2, 2), num_res_units=1)


class WithConstant(nn.Module):
    """A tensor made in forward (export lifts it to a constant the model does not hold), a
    non-persistent buffer, a tied weight, an unused layer, dropout and a frozen BatchNorm."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.drop = nn.Dropout(0.0)
        self.head = nn.Conv2d(4, 4, 1)
        self.tied = self.head
        self.spare = nn.Linear(2, 2)  # never called: its tensors are in no node
        self.spare_bn = nn.BatchNorm2d(2)  # nor this one (num_batches_tracked went missing)
        self.register_buffer("scale", torch.tensor([0.5, 1.0, 1.5, 2.0]), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.drop(self.bn(self.conv(x))) * self.scale.view(1, 4, 1, 1)
        return self.tied(y) + torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=x.dtype).view(1, 4, 1, 1)


def _frozen() -> nn.Module:
    m = WithConstant()
    m.bn.eval()
    return m


MODELS = {
    "resnet18": (lambda: tvm.resnet18(num_classes=5), (2, 3, 32, 32)),
    "timm_efficientnet_b0": (_timm("efficientnet_b0"), (2, 3, 64, 64)),
    "timm_convnext_atto": (_timm("convnext_atto"), (2, 3, 64, 64)),
    "smp_Unet": (_smp, (2, 3, 64, 64)),
    "monai_UNet": (_monai, (2, 3, 64, 64)),
    "constants": (_frozen, (2, 3, 8, 8)),
}


def _pair(build):
    torch.manual_seed(0)
    a = build().double()
    torch.manual_seed(0)
    return a, build().double()


def _tensors(gm: nn.Module) -> list[tuple[str, str, bool]]:
    """(path, what it is registered as, persistent) of every tensor under ``gm``."""
    out = []
    for path, mod in gm.named_modules(remove_duplicate=False):
        pre = f"{path}." if path else ""
        out += [(pre + k, "parameter", True) for k, v in mod._parameters.items() if v is not None]
        out += [(pre + k, "buffer", k not in mod._non_persistent_buffers_set)
                for k, v in mod._buffers.items() if v is not None]
        out += [(pre + k, "attribute", True) for k, v in vars(mod).items()
                if isinstance(v, torch.Tensor)]
    return out


@pytest.mark.parametrize("name", list(MODELS))
def test_the_received_graph_is_the_traced_one_over_the_receivers_model(name):
    build, shape = MODELS[name]
    model, other = _pair(build)
    gm = trace(model, torch.empty(shape, dtype=torch.float64, device="meta"))
    got = unpack(pack(gm, model), other)
    assert got.code == gm.code and type(got).__name__ == type(gm).__name__
    for a, b in zip(gm.graph.nodes, got.graph.nodes, strict=True):
        assert (a.name, a.op, a.target, fx_names(a.args), fx_names(a.kwargs)) == \
            (b.name, b.op, b.target, fx_names(b.args), fx_names(b.kwargs))
        kept = {k: v for k, v in a.meta.items() if k in KEPT_META or k.startswith("fxpar.")}
        assert b.meta == kept, a.name
    assert _tensors(got) == _tensors(gm)
    assert got.meta == gm.meta
    assert [(p, m.training) for p, m in got.named_modules()] == \
        [(p, m.training) for p, m in gm.named_modules()]
    # the receiver's own tensors (training the program trains its model), the rest by value
    mine = {id(t) for t in [*other.parameters(), *other.buffers()]}
    for key, t in got.state_dict(keep_vars=True).items():
        assert torch.equal(t, gm.state_dict()[key]), key
        if key in dict(model.state_dict()):
            assert id(t) in mine, key
    x = torch.randn(shape, dtype=torch.float64)
    model_out, got_out = gm(x), got(x)
    assert torch.equal(model_out, got_out)


def fx_names(x):
    """Arguments with nodes replaced by their names (nodes of two graphs never compare equal)."""
    return torch.fx.node.map_arg(x, lambda n: n.name)


def test_a_program_compiled_from_the_received_graph_is_the_same():
    model, other = _pair(lambda: tvm.resnet18(num_classes=5))
    plan = fxpar.Plan(stages=2, spatial_parts=2, microbatches=2)
    shape = (4, 3, 32, 32)
    sent: list = []
    first = fxpar.compile(model, plan, shape, comm=FakeComm(0, sent))
    second = fxpar.compile(other, plan, shape, comm=FakeComm(1, sent))
    alone = fxpar.compile(model, plan, shape)
    for s in range(plan.stages):
        assert first.graph.modules[s].code == second.graph.modules[s].code == \
            alone.graph.modules[s].code
    assert first.schedule == second.schedule == alone.schedule
    assert first.spatial.tile(0, 1).code == second.spatial.tile(0, 1).code


class Broken(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:  # a branch on a value: no graph
            return x
        return -x


def test_a_failure_to_trace_reaches_every_rank():
    sent: list = []
    with pytest.raises(TraceError) as first:
        shared_trace(Broken(), (1, 3, 4, 4), FakeComm(0, sent))
    with pytest.raises(TraceError, match="raised on rank 0, which traced the model") as second:
        shared_trace(Broken(), (1, 3, 4, 4), FakeComm(1, sent))
    assert str(first.value) in str(second.value)


def test_the_ranks_wait_for_rank_0s_capture_asleep():
    """A polled barrier before the broadcast, on every rank: MPI's busy wait in the broadcast
    took the cores from rank 0, tracing, where ranks outnumber cores."""
    sent: list = []
    comms = [FakeComm(0, sent), FakeComm(1, sent)]
    for c in comms:
        shared_trace(nn.Sequential(nn.Conv2d(3, 4, 3)), (1, 3, 8, 8), c)
    assert [c.polls for c in comms] == [[WAIT_POLL], [WAIT_POLL]]


def test_a_rank_whose_model_differs_is_told():
    sent: list = []
    shared_trace(nn.Sequential(nn.Conv2d(3, 4, 3)), (1, 3, 8, 8), FakeComm(0, sent))
    with pytest.raises(TraceError, match="every rank must build the same model"):
        shared_trace(nn.Sequential(nn.Identity(), nn.Conv2d(3, 4, 3)), (1, 3, 8, 8),
                     FakeComm(1, sent))


def test_a_rank_compiling_for_another_input_is_told():
    sent: list = []
    shared_trace(nn.Sequential(nn.Conv2d(3, 4, 3)), (2, 3, 8, 8), FakeComm(0, sent))
    with pytest.raises(TraceError, match=r"rank 1 compiles for input .*\(1, 3, 8, 8\).* but "
                                         r"rank 0.*\(2, 3, 8, 8\)"):
        shared_trace(nn.Sequential(nn.Conv2d(3, 4, 3)), (1, 3, 8, 8), FakeComm(1, sent))


def test_a_rank_given_another_plan_is_told_which_fields_differ():
    """fxpar-run: rank 0 captures for every rank, so this is where plans first meet; the plan
    is named before the input shape its micro-batches give."""
    sent: list = []
    net = nn.Sequential(nn.Conv2d(3, 4, 3))
    shared_trace(net, (2, 3, 8, 8), FakeComm(0, sent), plan={"stages": 2, "microbatches": 2})
    with pytest.raises(TraceError, match=r"rank 1 compiles another plan than rank 0 "
                                         r"\(microbatches: 2 vs 4, rank 0's first\)"):
        shared_trace(net, (1, 3, 8, 8), FakeComm(1, sent), plan={"stages": 2, "microbatches": 4})


class Gate(nn.Module):
    """A setting the module tree shows only as a plain attribute: it changes the graph."""

    def __init__(self, skip: bool) -> None:
        super().__init__()
        self.skip = skip
        self.conv = nn.Conv2d(3, 3, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x)
        return y + x if self.skip else y


def test_a_capture_cache_traces_each_structure_and_input_once():
    cache = fxpar.CaptureCache()
    shape = (2, 3, 32, 32)
    first, second = _pair(lambda: tvm.resnet18(num_classes=5))
    a = fxpar.compile(first, fxpar.Plan(stages=2), shape, captures=cache)
    plan = fxpar.Plan(stages=2, spatial_parts=2)
    b = fxpar.compile(second, plan, shape, captures=cache)
    assert cache.hits == 1
    alone = fxpar.compile(second, plan, shape)
    assert [m.code for m in b.graph.modules] == [m.code for m in alone.graph.modules]
    assert b.spatial.tile(0, 1).code == alone.spatial.tile(0, 1).code
    # the hit is built over the second model's own tensors: training it trains that model
    mine = {id(t) for t in second.parameters()}
    assert all(id(p) in mine for m in b.graph.modules for p in m.parameters())
    assert not any(id(p) in mine for m in a.graph.modules for p in m.parameters())
    # another input shape, another tensor shape, another plain setting: each traced anew
    fxpar.compile(tvm.resnet18(num_classes=5).double(), None, (2, 3, 48, 48), captures=cache)
    fxpar.compile(tvm.resnet18(num_classes=7).double(), None, shape, captures=cache)
    plain, skip = Gate(False).double(), Gate(True).double()
    got = [fxpar.compile(m, None, (1, 3, 8, 8), captures=cache) for m in (plain, skip)]
    assert cache.hits == 1
    x = torch.randn(1, 3, 8, 8, dtype=torch.float64)
    out = got[1].graph.modules[0](x)  # a stage returns a tuple
    assert torch.equal(out[0], skip(x)) and not torch.equal(got[0].graph.modules[0](x)[0], skip(x))
