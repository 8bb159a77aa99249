"""A saved program is data: the loader builds every stage from graph.json and weights.pt, equal
node for node, tensor for tensor, to the compiled stage (library models, every plan family),
and runs no code from the folder (the MPI half, training a loaded program like the compiled
one, is in cases/emit_cases.py)."""

import json

import pytest
import segmentation_models_pytorch as smp
import timm
import torch
import torchvision.models as tvm

import fxpar
from fxpar.core.plan import PlanError
from fxpar.core.values import decode, encode
from fxpar.program.graphdata import build, graph_data
from fxpar.program.loader import load


class Tied(torch.nn.Module):
    """A weight reached under two names (tied) and a layer the forward never uses, whose own
    tensors and alias the last stage keeps (fxpar.core.modelkeys)."""

    def __init__(self):
        super().__init__()
        self.stem = torch.nn.Sequential(torch.nn.Conv2d(3, 6, 3, padding=1),
                                        torch.nn.BatchNorm2d(6), torch.nn.ReLU())
        self.body = torch.nn.Conv2d(6, 6, 3, padding=1)
        self.again = self.body  # the same module under a second name
        self.fc = torch.nn.Linear(6, 5)
        self.spare = torch.nn.Linear(6, 5)
        self.spare_alias = self.spare

    def forward(self, x):
        return self.fc(self.again(self.stem(x)).mean((2, 3)))


PROGRAMS = {
    "tied weights and an unused layer, SP2 + PP2": (
        Tied, (4, 3, 11, 13), fxpar.Plan(spatial_parts=2, stages=2, microbatches=2)),
    "resnet18 SP2x2 on 2 spatial stages + PP, halo fusion": (
        lambda: tvm.resnet18(num_classes=5), (4, 3, 32, 32),
        fxpar.Plan(stages=3, spatial_parts=4, spatial_stages=2, microbatches=2,
                   halo_fusion="all")),
    "timm efficientnet_b0 SP2 horizontal": (
        lambda: timm.create_model("efficientnet_b0", num_classes=5), (2, 3, 32, 48),
        fxpar.Plan(spatial_parts=2, slice="horizontal")),
    "timm convnext_atto SP2 + GEMS + PP2": (
        lambda: timm.create_model("convnext_atto", num_classes=5), (2, 3, 32, 32),
        fxpar.Plan(spatial_parts=2, gems=True, stages=2)),
    "smp Unet SP4 channels_last (odd size)": (
        lambda: smp.Unet("resnet18", encoder_weights=None, classes=3), (1, 3, 64, 96),
        fxpar.Plan(spatial_parts=4, channels_last=True)),
    "MONAI UNet SP2 (transposed convolutions on tiles)": (
        lambda: __import__("monai.networks.nets", fromlist=["UNet"]).UNet(
            spatial_dims=2, in_channels=3, out_channels=3, channels=(8, 16, 32),
            strides=(2, 2), num_res_units=1), (2, 3, 32, 32),
        fxpar.Plan(spatial_parts=2, slice="horizontal")),
    "torchvision densenet PP3 + DP2": (
        lambda: tvm.DenseNet(32, (2, 2, 2, 2), 64, num_classes=5), (8, 3, 32, 32),
        fxpar.Plan(stages=3, microbatches=2, data_parallel=2)),
}


@pytest.fixture(scope="module", params=list(PROGRAMS), ids=list(PROGRAMS))
def saved(request, tmp_path_factory):
    build_model, shape, plan = PROGRAMS[request.param]
    torch.manual_seed(0)
    model = build_model().double()
    program = fxpar.compile(model, plan, torch.empty(shape, dtype=torch.float64,
                                                     device="meta"))
    root = tmp_path_factory.mktemp("job")
    program.save(root)
    return program, root


def _code(m):
    return m.graph.python_code("self").src


def test_every_stage_loads_equal_to_the_compiled_one(saved):
    program, root = saved
    for rank in range(program.world_size):
        compiled = program.stage_modules(rank)
        loaded = load(root, rank=rank).stages
        assert set(loaded) == set(compiled)
        for key, m in compiled.items():
            again = loaded[key]
            assert _code(again) == _code(m), f"rank {rank} stage {key}: another graph"
            for n in {str(n.target) for n in m.graph.nodes if n.op == "call_module"}:
                a, b = m.get_submodule(n), again.get_submodule(n)
                assert type(a) is type(b) and a.emit_args() == b.emit_args(), n
            want, got = m.state_dict(), again.state_dict()
            assert list(got) == list(want) or set(got) == set(want)
            for k, v in want.items():
                assert got[k].dtype == v.dtype and torch.equal(got[k], v.detach()), k
                assert got[k].requires_grad == v.requires_grad, k


def test_loading_runs_no_code_from_the_folder(saved, tmp_path):
    program, root = saved
    marker = tmp_path / "ran"
    for module_py in root.rglob("module.py"):
        module_py.write_text(f"open({str(marker)!r}, 'w').write('ran')\nraise SystemExit(3)\n")
    for rank in range(program.world_size):
        load(root, rank=rank)
    assert not marker.exists()


def _tampered(root, edit):
    path = next(root.rglob("graph.json"))
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))
    return path


def test_a_graph_naming_a_function_outside_torch_and_fxpar_is_refused(tmp_path):
    model = tvm.resnet18(num_classes=5).double()
    program = fxpar.compile(model, fxpar.Plan(stages=2), torch.empty((2, 3, 32, 32),
                                                                      dtype=torch.float64))
    program.save(tmp_path)

    def call_os(data):
        node = next(n for n in data["nodes"] if n["op"] == "call_function")
        node["target"] = {"function": "os:system"}

    _tampered(tmp_path, call_os)
    with pytest.raises(PlanError, match=r"names 'os:system'.*only functions and classes"):
        load(tmp_path, rank=0)

    def new_module(data):
        data["modules"].append({"path": "evil", "class": "subprocess:Popen", "args": {
            "dict": [["args", "true"]]}})

    program.save(tmp_path)
    _tampered(tmp_path, new_module)
    with pytest.raises(PlanError, match="subprocess"):
        load(tmp_path, rank=0)

    def method(data):
        node = next(n for n in data["nodes"] if n["op"] == "call_function")
        node["op"], node["target"] = "call_method", "__reduce_ex__"

    program.save(tmp_path)
    _tampered(tmp_path, method)
    with pytest.raises(PlanError, match="not a torch.Tensor method"):
        load(tmp_path, rank=0)


def test_values_keep_their_types():
    values = [None, True, 3, -2.5, float("inf"), float("nan"), "s", (1, (2,)), [1, [2]],
              slice(1, None, 2), Ellipsis, torch.float64, torch.device("cpu"),
              torch.channels_last, torch.strided, {"a": (1, 2), 3: [4]}]
    again = decode(json.loads(json.dumps(encode(values))))
    assert repr(again) == repr(values)
    assert [type(v) for v in again] == [type(v) for v in values]


def test_a_changed_weight_file_is_caught(tmp_path):
    model = tvm.resnet18(num_classes=5)
    program = fxpar.compile(model, fxpar.Plan(), torch.empty((2, 3, 32, 32)))
    gm = program.stage_modules(0)[(0, 0)]
    state = dict(gm.state_dict())
    data = graph_data(gm)
    again = build(data, state)
    x = torch.randn(2, 3, 32, 32)
    gm.eval(), again.eval()
    assert torch.equal(again(x)[0] if isinstance(again(x), tuple) else again(x),
                       gm(x)[0] if isinstance(gm(x), tuple) else gm(x))
    state.pop(next(iter(state)))
    with pytest.raises((PlanError, RuntimeError), match="weights.pt has no tensor|Missing"):
        build(data, state)
