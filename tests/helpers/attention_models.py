"""Small attention models shared by the unit tests and the MPI cases (fxpar.frontend.rules.tokens
and fxpar.runtime.spatial.attention on tiles)."""

from __future__ import annotations

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
