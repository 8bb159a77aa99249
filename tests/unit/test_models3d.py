"""Tests of the zoo's 3-D models, ``unet3d`` (Çiçek et al. 2016) and ``cosmoflow`` (Mathuriya et
al. 2018): output shapes, capture by torch.export on fake inputs, the registry, configuration
errors, and a one-rank fxpar program that equals eager PyTorch.  Tiny sizes (16^3 volumes, base
4), so the file runs in seconds on CPU.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

import fxpar
from fxpar import models
from fxpar.models.cosmoflow import cosmoflow
from fxpar.models.unet3d import unet3d

# name -> (factory of a tiny model, input shape, expected output shape)
CASES: dict[str, tuple[Callable[[], nn.Module], tuple[int, ...], tuple[int, ...]]] = {
    "unet3d": (lambda: unet3d(base=4, depth=3), (2, 1, 16, 16, 16), (2, 3, 16, 16, 16)),
    "unet3d_box": (lambda: unet3d(in_channels=2, num_classes=5, base=2, depth=2),
                   (2, 2, 8, 6, 10), (2, 5, 8, 6, 10)),
    "unet3d_one_level": (lambda: unet3d(base=2, depth=1), (2, 1, 5, 3, 7), (2, 3, 5, 3, 7)),
    "cosmoflow": (lambda: cosmoflow(in_channels=1, base=4, blocks=3, input_size=16),
                  (2, 1, 16, 16, 16), (2, 4)),
    "cosmoflow_dropout": (lambda: cosmoflow(base=4, blocks=4, input_size=32, hidden=(16, 8),
                                            outputs=3, dropout=0.5),
                          (2, 4, 32, 32, 32), (2, 3)),
}


def _make(name: str, dtype: torch.dtype = torch.float32):
    factory, in_shape, out_shape = CASES[name]
    torch.manual_seed(0)
    model = factory().to(dtype)
    x = torch.randn(in_shape, dtype=dtype)
    return model, x, out_shape


@pytest.mark.parametrize("name", sorted(CASES))
def test_forward_shape(name):
    model, x, out_shape = _make(name)
    assert model(x).shape == out_shape
    model.eval()
    with torch.no_grad():
        assert model(x).shape == out_shape


@pytest.mark.parametrize("name", sorted(CASES))
def test_export_captures_on_fake_input(name):
    model, _, out_shape = _make(name)
    _, in_shape, _ = CASES[name]
    with FakeTensorMode(allow_non_fake_inputs=True):
        x = torch.empty(in_shape)
        ep = torch.export.export(model, (x,), strict=False)
    targets = {str(n.target) for n in ep.graph.nodes if n.op == "call_function"}
    assert any("conv3d" in t or "convolution" in t for t in targets), targets
    (out,) = [n for n in ep.graph.nodes if n.op == "output"][0].args[0]
    assert tuple(out.meta["val"].shape) == out_shape


def test_registry_builds_both():
    assert models.MODELS["unet3d"] is unet3d and models.MODELS["cosmoflow"] is cosmoflow
    assert {"unet3d", "cosmoflow"} <= set(models.__all__)
    net = models.build("unet3d", base=4, depth=3)
    assert net(torch.randn(1, 1, 8, 8, 8)).shape == (1, 3, 8, 8, 8)
    reg = models.build("cosmoflow", in_channels=1, base=2, blocks=2, input_size=8)
    assert reg(torch.randn(2, 1, 8, 8, 8)).shape == (2, 4)


def test_default_sizes():
    with torch.device("meta"):
        u = unet3d()
        c = cosmoflow()
    # The paper's 3D U-Net (32..512 channels, 4 levels) has about 19M parameters.
    assert sum(p.numel() for p in u.parameters()) == 19_071_459
    assert sum(p.numel() for p in c.parameters()) == 3_283_060
    # MLPerf HPC reference widths: 16..256 channels, 256 * 4**3 features into the first Linear.
    widths = [m.out_channels for m in c.modules() if isinstance(m, nn.Conv3d)]
    assert widths == [16, 32, 64, 128, 256]
    first = next(m for m in c.modules() if isinstance(m, nn.Linear))
    assert (first.in_features, first.out_features) == (256 * 4**3, 128)
    # Paper's channel scheme: the second conv of an analysis level doubles the channels.
    down = [m.out_channels for m in u.modules() if isinstance(m, nn.Conv3d)][:8]
    assert down == [32, 64, 64, 128, 128, 256, 256, 512]


def test_cosmoflow_channel_cap():
    c = cosmoflow(in_channels=1, base=4, blocks=4, input_size=16, max_channels=8)
    assert [m.out_channels for m in c.modules() if isinstance(m, nn.Conv3d)] == [4, 8, 8, 8]
    assert c(torch.randn(2, 1, 16, 16, 16)).shape == (2, 4)


def test_cosmoflow_bad_input_size_says_what_to_change():
    with pytest.raises(ValueError) as info:
        cosmoflow(input_size=100, blocks=5)
    msg = str(info.value)
    assert "input_size 100 is not divisible by 2**blocks = 32" in msg
    assert "multiple of 32 (e.g. 96 or 128)" in msg
    assert "blocks <= 2" in msg
    with pytest.raises(ValueError, match="multiple of 4 \\(e.g. 4\\)$"):
        models.build("cosmoflow", input_size=3, blocks=2)


@pytest.mark.parametrize("kwargs, match", [
    (dict(blocks=0), "blocks must be >= 1"),
    (dict(hidden=(128,)), "hidden must be two positive widths"),
    (dict(dropout=1.0), "dropout must be in"),
])
def test_cosmoflow_other_bad_configs(kwargs, match):
    with pytest.raises(ValueError, match=match):
        cosmoflow(**kwargs)


def test_unet3d_bad_config():
    with pytest.raises(ValueError, match="depth must be >= 1"):
        unet3d(depth=0)


def _mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out, target)


@pytest.mark.parametrize("name, loss_fn", [("unet3d", F.cross_entropy), ("cosmoflow", _mse)])
def test_one_rank_program_equals_eager(name, loss_fn):
    model, _, out_shape = _make(name, torch.float64)
    ref = copy.deepcopy(model)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(CASES[name][1], dtype=torch.float64, generator=g)
    if loss_fn is F.cross_entropy:
        y = torch.randint(0, out_shape[1], (out_shape[0], *out_shape[2:]), generator=g)
    else:
        y = torch.randn(out_shape, dtype=torch.float64, generator=g)

    program = fxpar.compile(model, fxpar.Plan(), torch.randn(2, 1, 16, 16, 16,
                                                             dtype=torch.float64),
                            loss_fn=loss_fn)
    assert program.world_size == 1
    rp = program.local()
    loss = rp.train_step(x, y)
    ref_loss = loss_fn(ref(x), y)
    ref_loss.backward()
    assert math.isfinite(loss) and abs(loss - ref_loss.item()) <= 1e-12, (loss, ref_loss)
    grads = {n: p.grad for n, p in rp.named_parameters()}
    assert sorted(grads) == sorted(n for n, _ in ref.named_parameters())
    for n, p in ref.named_parameters():
        assert grads[n] is not None, n
        torch.testing.assert_close(grads[n], p.grad, rtol=0, atol=1e-12, msg=n)
