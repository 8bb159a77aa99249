"""Attention models shared by the unit tests and the MPI cases (fxpar.frontend.rules.tokens
and fxpar.runtime.spatial.attention on tiles): a small class-token model, and timm's
EfficientViT-B0 with its attention in float32 as timm writes it or in the model's dtype."""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from torch import nn


class ClassToken(nn.Module):
    """Cross attention: a learned class token (replicated) attends to the tiled pixels."""

    def __init__(self, c: int = 8) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, c, 3, padding=1)
        self.cls = nn.Parameter(torch.randn(1, 1, c))
        self.kv = nn.Linear(c, 2 * c)
        self.head = nn.Linear(c, 5)

    def forward(self, x):
        x = self.stem(x).relu()
        n, c, h, w = x.shape
        k, v = self.kv(x.flatten(2).transpose(1, 2)).chunk(2, dim=-1)
        q = self.cls.expand(n, 1, c)
        a = F.scaled_dot_product_attention(q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1))
        return self.head(a.squeeze(1).squeeze(1))


def _attn_in_input_dtype(self: nn.Module, q: torch.Tensor, k: torch.Tensor,
                         v: torch.Tensor) -> torch.Tensor:
    """timm's ``LiteMLA._attn`` without its ``.float()`` casts."""
    kv = k.transpose(-1, -2) @ v
    out = q @ kv
    return out[..., :-1] / (out[..., -1:] + self.eps)


def efficientvit_b0(float64_attention: bool) -> nn.Module:
    """timm's efficientvit_b0 (5 classes); ``float64_attention``: each LiteMLA's ``_attn``
    without its float32 casts, so a float64 model computes in float64 throughout (set on each
    instance: a cached capture of the class's ``_attn`` would differ)."""
    import timm
    from timm.models.efficientvit_mit import LiteMLA

    model = timm.create_model("efficientvit_b0", num_classes=5, pretrained=False)
    if float64_attention:
        for m in model.modules():
            if isinstance(m, LiteMLA):
                m._attn = types.MethodType(_attn_in_input_dtype, m)
    return model
