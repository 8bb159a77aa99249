"""A model's own ``with torch.autocast(...)`` blocks at capture (fxpar.frontend.hops): inlined
as plain ATen ops, the same numbers and gradients as the model, and the mixed-precision pass
(fxpar.passes.precision) following what each block set. A ``torch.no_grad()`` block stays
whole."""

from __future__ import annotations

import torch
from torch import fx, nn

from fxpar.core import meta
from fxpar.core.plan import Plan
from fxpar.frontend.capture import capture
from fxpar.frontend.hops import AutocastRegion
from fxpar.frontend.trace import trace
from fxpar.passes.precision import precision

aten = torch.ops.aten


class LinearAttention(nn.Module):
    """conv -> tokens -> EfficientViT's linear attention in float32 with autocast off (as
    timm's LiteMLA) -> back to the image -> conv, times a scale made without gradient."""

    def __init__(self, c: int = 4) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, c, 3, padding=1)
        self.proj = nn.Conv2d(c, c, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x)
        n, c, h, w = y.shape
        t = y.flatten(2).transpose(1, 2)
        with torch.autocast(device_type=t.device.type, enabled=False):
            q, k = t.float().relu(), t.float().relu()
            kv = k.transpose(-1, -2) @ t.float()
            a = (q @ kv / (q.sum(-1, keepdim=True) + 1e-5)).to(t.dtype)
        with torch.no_grad():
            scale = 1 / (y.abs().amax() + 1)
        return self.proj(a.transpose(1, 2).reshape(n, c, h, w)) * scale


class Bf16Block(nn.Module):
    """A linear layer the model itself runs under ``torch.autocast(dtype=torch.bfloat16)``."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
            y = self.lin(x)
        return y.float() * 2


def _blocks(gm: fx.GraphModule) -> list[str]:
    return [n.target.__name__ for n in gm.graph.nodes
            if isinstance(n.target, torch._ops.HigherOrderOperator)]


def test_capture_inlines_autocast_and_no_grad_blocks_with_equal_numbers():
    torch.manual_seed(0)
    model = LinearAttention().double()
    x = torch.randn(2, 3, 6, 5, dtype=torch.float64)
    gm = capture(model, x)
    assert _blocks(gm) == ["wrap_with_set_grad_enabled"], _blocks(gm)
    assert len([m for m in gm.children() if isinstance(m, fx.GraphModule)]) == 1  # no_grad's
    marked = [n for n in gm.graph.nodes if meta.find(n, AutocastRegion) is not None]
    assert any(n.target is aten.matmul.default for n in marked)
    assert all(not meta.get(n, AutocastRegion).enabled for n in marked)

    out = gm(x)
    want = model(x)
    torch.testing.assert_close(out, want, atol=0, rtol=0)
    out.square().sum().backward()
    want.square().sum().backward()
    got = dict(gm.named_parameters())
    for name, p in model.named_parameters():  # the no-grad scale passes no gradient back
        torch.testing.assert_close(got[name].grad, p.grad, atol=0, rtol=0)


def test_precision_bf16_leaves_an_autocast_disabled_block_in_float32():
    model = LinearAttention()
    gm = precision(trace(model, (2, 3, 6, 5)), Plan(precision="bf16"))
    casts = [n for n in gm.graph.nodes if n.target is aten._to_copy.default]
    assert casts, "the convolutions outside the block get autocast's casts"
    for n in gm.graph.nodes:
        if meta.find(n, AutocastRegion) is not None:
            assert all(a.target is not aten._to_copy.default for a in n.all_input_nodes), n
            if n.target is aten.matmul.default:
                assert meta.get(n, meta.TensorInfo).dtype == torch.float32, n
    x = torch.randn(2, 3, 6, 5)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = model(x)
    torch.testing.assert_close(gm(x), want)


def test_precision_applies_a_models_own_bf16_block_under_fp32():
    model = Bf16Block()
    x = torch.randn(3, 6)
    gm = precision(trace(model, x), Plan())
    cast = [n for n in gm.graph.nodes if n.target is aten._to_copy.default]
    assert {c.kwargs["dtype"] for c in cast} == {torch.bfloat16}, cast
    torch.testing.assert_close(gm(x), model(x), atol=0, rtol=0)
