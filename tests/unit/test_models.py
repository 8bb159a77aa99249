"""Tests of the model zoo: shapes, capture, eager/captured agreement, gradients, sizes.

The compiler relies on every zoo model capturing (``fxpar.frontend.trace``: torch.export on a fake
input) into an ATen graph that computes exactly what the eager model computes, in training and
in eval mode, BatchNorm updates included; these tests pin that down on tiny configurations so
the whole file runs in a few seconds on CPU.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn

import fxpar
from fxpar import models
from fxpar.models.amoebanet import FactorizedReduce, amoebanetd, stack_sizes
from fxpar.models.resnet_v2 import resnet110_v2, resnet_v2
from fxpar.models.unet import unet

# name -> (factory of a tiny model, input shape, expected output shape)
CASES: dict[str, tuple[Callable[[], nn.Module], tuple[int, ...], tuple[int, ...]]] = {
    "amoebanet": (lambda: amoebanetd(num_classes=10, num_layers=2, num_filters=16),
                  (2, 3, 32, 32), (2, 10)),
    "amoebanet_odd": (lambda: amoebanetd(num_classes=5, num_layers=1, num_filters=8),
                      (2, 3, 65, 65), (2, 5)),
    "resnet_v2": (lambda: resnet_v2(depth=14, num_classes=7), (2, 3, 16, 16), (2, 7)),
    "resnet_v2_wide_odd": (lambda: resnet_v2(depth=8, num_classes=3, width=2),
                           (2, 3, 17, 15), (2, 3)),
    "unet": (lambda: unet(in_channels=3, num_classes=4, base_channels=4, depth=2),
             (2, 3, 16, 24), (2, 4, 16, 24)),
    "unet_1ch": (lambda: unet(in_channels=1, num_classes=2, base_channels=2, depth=3),
                 (2, 1, 32, 8), (2, 2, 32, 8)),
}


def _make(name: str, dtype: torch.dtype = torch.float32):
    factory, in_shape, out_shape = CASES[name]
    torch.manual_seed(0)
    model = factory().to(dtype)
    x = torch.randn(in_shape, dtype=dtype)
    return model, x, out_shape


def _loss(out: torch.Tensor) -> torch.Tensor:
    """Cross-entropy with fixed random targets (per image or per pixel): non-degenerate grads."""
    g = torch.Generator().manual_seed(1)
    target_shape = (out.shape[0], *out.shape[2:])
    target = torch.randint(0, out.shape[1], target_shape, generator=g)
    return F.cross_entropy(out, target)


@pytest.mark.parametrize("name", sorted(CASES))
def test_forward_shape(name):
    model, x, out_shape = _make(name)
    assert model(x).shape == out_shape
    model.eval()
    assert model(x).shape == out_shape


@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_traced_matches_eager(name, train):
    model, x, out_shape = _make(name, torch.float64)
    with torch.no_grad():  # non-trivial BatchNorm running statistics for the eval case
        model.train()
        model(torch.randn_like(x))
    traced = fxpar.trace(copy.deepcopy(model), x)  # training mode, as compile
    assert isinstance(traced, fx.GraphModule)
    model.train(train)
    traced.train(train)

    torch.manual_seed(123)
    expected = model(x)
    torch.manual_seed(123)
    actual = traced(x)

    assert actual.shape == out_shape
    assert torch.allclose(actual, expected, rtol=1e-10, atol=1e-12)
    # Same BatchNorm updates too: the traced graph is the same computation, not just the output.
    expected_state = model.state_dict()
    actual_state = traced.state_dict()
    assert actual_state.keys() == expected_state.keys()
    for key, value in expected_state.items():
        assert torch.allclose(actual_state[key], value, rtol=1e-10, atol=1e-12), key


@pytest.mark.parametrize("name", sorted(CASES))
def test_backward_reaches_every_parameter(name):
    model, x, _ = _make(name)
    _loss(model(x)).backward()
    for pname, p in model.named_parameters():
        assert p.grad is not None, f"no gradient for {pname}"
        assert torch.isfinite(p.grad).all(), pname
        assert p.grad.abs().sum() > 0, f"zero gradient for {pname}"


def _graph_ops(model: nn.Module, shape: tuple[int, ...]) -> set[str]:
    """The ops of ``model``'s captured graph: ATen packets and fxpar's own modules."""
    gm = fxpar.trace(model, shape)
    return {str(n.target.overloadpacket).removeprefix("aten.") for n in gm.graph.nodes
            if n.op == "call_function" and hasattr(n.target, "overloadpacket")} | \
        {type(gm.get_submodule(n.target)).__name__ for n in gm.graph.nodes
         if n.op == "call_module"}


def test_amoebanet_graph_exposes_real_ops():
    model = amoebanetd(num_classes=10, num_layers=1, num_filters=8)
    ops = _graph_ops(model, (2, 3, 32, 32))
    assert {"conv2d", "BatchNormOp", "max_pool2d", "avg_pool2d", "linear",
            "adaptive_avg_pool2d", "cat", "add"} <= ops
    pools = [m for m in model.modules() if isinstance(m, nn.MaxPool2d)]
    assert any(m.kernel_size == 3 and m.padding == 1 for m in pools)  # max_pool_3x3
    assert any(m.kernel_size == 2 for m in pools)  # max_pool_2x2


def test_amoebanet_max_pool_3x3_preserves_size_at_stride_1():
    model = amoebanetd(num_classes=10, num_layers=1, num_filters=8)
    normal = next(c for c in model.cells if not c.reduction)
    pool = normal.ops[normal.op_names.index("max_pool_3x3")]
    assert isinstance(pool, nn.MaxPool2d)
    assert pool(torch.randn(1, 2, 7, 9)).shape == (1, 2, 7, 9)


def test_resnet_and_unet_graphs_expose_real_ops():
    ops = _graph_ops(resnet_v2(depth=8), (2, 3, 16, 16))
    assert {"conv2d", "BatchNormOp", "adaptive_avg_pool2d", "linear", "add"} <= ops
    ops = _graph_ops(unet(depth=2, base_channels=2), (2, 3, 16, 16))
    assert {"conv2d", "BatchNormOp", "max_pool2d", "conv_transpose2d", "cat"} <= ops


def test_amoebanet_parameter_count_matches_gpipe():
    # torchgpipe reports 81.5M parameters for AmoebaNet-D (18, 208) (GPipe Table 1: 82M);
    # this pins the genotype and the channel bookkeeping.  Built on meta: no memory, fast.
    with torch.device("meta"):
        model = amoebanetd(num_classes=1000, num_layers=18, num_filters=208)
    n = sum(p.numel() for p in model.parameters())
    assert 81.45e6 < n < 81.55e6


@pytest.mark.parametrize("size", [(32, 32), (64, 64), (65, 65), (33, 20), (1, 1)])
def test_amoebanet_image_sizes(size):
    model = amoebanetd(num_classes=3, num_layers=1, num_filters=8)
    assert model(torch.randn(2, 3, *size)).shape == (2, 3)


def test_amoebanet_cell_counts():
    assert stack_sizes(18) == (6, 6, 6)
    assert stack_sizes(4) == (2, 1, 1)
    assert stack_sizes(1) == (1, 0, 0)
    for layers in (1, 2, 3, 4, 6):
        model = amoebanetd(num_layers=layers, num_filters=8)
        assert sum(not c.reduction for c in model.cells) == layers
        assert sum(c.reduction for c in model.cells) == 4  # 2 in the stem, 2 between stacks


def test_amoebanet_rejects_bad_settings():
    with pytest.raises(ValueError, match="num_layers"):
        amoebanetd(num_layers=0)
    with pytest.raises(ValueError, match="num_filters"):
        amoebanetd(num_filters=4)


@pytest.mark.parametrize("size", [(6, 6), (7, 9)])
def test_factorized_reduce_shift_is_slice_then_pad(size):
    # The single ZeroPad2d((-1, 1, -1, 1)) must equal the reference's x[:, :, 1:, 1:] + pad.
    x = torch.randn(2, 3, *size)
    fr = FactorizedReduce(3, 4)
    expected = F.pad(x[:, :, 1:, 1:], (0, 1, 0, 1))
    assert torch.equal(fr.shift(x), expected)


def test_resnet110_v2_parameter_count():
    model = resnet110_v2(num_classes=10)
    n = sum(p.numel() for p in model.parameters())
    assert 1.6e6 < n < 1.8e6  # the paper's 1.7M
    assert sum(isinstance(m, nn.Conv2d) for m in model.modules()) == 109 + 2  # + 2 projections


@pytest.mark.parametrize("depth", [21, 2, 0, 111])
def test_resnet_v2_rejects_invalid_depth(depth):
    with pytest.raises(ValueError, match=r"depth must be 6n\+2, e\.g\. 20, 56, 110"):
        resnet_v2(depth=depth)


@pytest.mark.parametrize("size", [(8, 8), (16, 40), (64, 24)])
def test_unet_output_spatial_size_equals_input(size):
    model = unet(in_channels=2, num_classes=5, base_channels=2, depth=3)
    out = model(torch.randn(2, 2, *size))
    assert out.shape == (2, 5, *size)


def test_registry_names_and_build():
    assert set(models.MODELS) == {"amoebanet", "resnet_v2", "resnet110", "unet", "unet3d",
                                  "cosmoflow"}
    # each name builds its own architecture with the keyword arguments passed through
    amoeba = models.build("amoebanet", num_layers=1, num_filters=8)
    assert sum(not c.reduction for c in amoeba.cells) == 1
    assert amoeba(torch.randn(2, 3, 32, 32)).shape == (2, 10)
    resnet = models.build("resnet_v2", depth=8)
    assert sum(isinstance(m, nn.Conv2d) for m in resnet.modules()) == 7 + 2  # + 2 projections
    deep = models.build("resnet110", num_classes=100)
    assert sum(isinstance(m, nn.Conv2d) for m in deep.modules()) == 109 + 2
    assert deep(torch.randn(1, 3, 32, 32)).shape == (1, 100)
    out = models.build("unet", base_channels=2, depth=1)(torch.randn(1, 3, 4, 4))
    assert out.shape == (1, 2, 4, 4)


def test_build_unknown_name_lists_known_names():
    with pytest.raises(ValueError, match="unknown model 'vgg'") as info:
        models.build("vgg")
    for known in models.MODELS:
        assert known in str(info.value)
