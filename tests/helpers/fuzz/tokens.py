"""Random token blocks for the fuzzer (issue 40): the image flattened into tokens, a
transformer-style block on them, and back to (N, C, H, W).

One spec node of op ``"tokens"`` is one block::

    {"op": "tokens", "src": [3], "kind": "sdpa", "heads": 2, "pos": 30, "scale": null,
     "causal": false}

``pos``: the token count of a learned position embedding added first (0: none). The kinds
(:data:`KINDS`; fxpar.frontend.rules.tokens and attention.py are the rules they exercise):

- ``mlp``: pre-norm LayerNorm, Linear-GELU-Linear, residual: per-token ops only;
- ``sdpa``: pre-norm global multi-head attention through ``F.scaled_dot_product_attention``
  (ring attention on tiles), output projection, residual; ``scale`` None or a number;
  ``causal`` adds ``is_causal=True``, which fxpar does not tile: the region ends cleanly there
  (a join), and the rest runs whole on every rank of the tile group;
- ``written``: the same attention written out, ``softmax((q @ k^T) * scale) @ v`` with
  matmuls, or ``einsum`` (MONAI's form);
- ``cls``: a learned class token (replicated queries) attends to every token (gathered
  attention on tiles), projected and added to every pixel of the input;
- ``linear``: ReLU linear attention, ``k^T v`` and ``sum k`` over every token, then per token
  ``q (k^T v) / (q . sum k)``, residual;
- ``window``: Swin's attention within ``window`` x ``window`` windows, ``shift``ed by half a
  window (torch.roll) or not: on tiles where every tile holds whole windows, else the region
  ends at the block. Drawn only when asked for (:data:`WINDOW`), so that the fixed draws of
  the other kinds stay what they were.

A map of more than :data:`MAX_TOKENS` pixels first goes through a patch embedding (a conv with
kernel = stride, as ViT's), so that one attention example stays well under a second.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from hypothesis import reject
from hypothesis import strategies as st
from torch import nn

if TYPE_CHECKING:
    from helpers.fuzz.graphs import _Graph

Spec = dict[str, Any]
KINDS = ("mlp", "sdpa", "written", "cls", "linear")
"""The kinds a token block is drawn from by default."""
WINDOW = ("window",)
"""Swin's windowed and shifted-window attention (tests/mpi/test_fuzz.py draws them apart)."""
MAX_TOKENS = 144
"""Tokens (pixels) of the largest map an attention block is drawn on."""
MAX_HEADS = 4

_NODES = {"mlp": 9, "sdpa": 17, "written": 21, "cls": 20, "linear": 20, "window": 21}
"""Captured (ATen) compute nodes of each kind without a position embedding (the embedding
adds one ``add``); ``written`` with einsums has 1 fewer, ``window`` with a shift 2 more."""


def nodes(node: Spec) -> int:
    """Compute nodes of the traced block (what ``Plan.balance`` counts)."""
    kind = node["kind"]
    extra = {"written": -int(node.get("einsum", False)),
             "window": 2 * int(node.get("shift", False))}.get(kind, 0)
    return _NODES[kind] + extra + bool(node.get("pos"))


class TokenBlock(nn.Module):
    """One token block (module doc) on a map of ``c`` channels."""

    def __init__(self, node: Spec, c: int) -> None:
        super().__init__()
        self.kind, self.heads = node["kind"], node["heads"]
        self.scale, self.causal = node.get("scale"), node.get("causal", False)
        self.einsum = node.get("einsum", False)
        self.window, self.shift = node.get("window", 1), node.get("shift", False)
        self.pos = nn.Parameter(torch.randn(1, node["pos"], c) * 0.1) if node.get("pos") \
            else None
        self.norm = nn.LayerNorm(c)
        if self.kind == "mlp":
            self.fc1, self.fc2 = nn.Linear(c, 2 * c), nn.Linear(2 * c, c)
        elif self.kind == "cls":
            self.cls = nn.Parameter(torch.randn(1, 1, c))
            self.kv, self.proj = nn.Linear(c, 2 * c), nn.Linear(c, c)
        elif self.kind == "linear":
            self.qkv = nn.Linear(c, 3 * c)
        else:
            self.qkv, self.proj = nn.Linear(c, 3 * c), nn.Linear(c, c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, c, h, w = x.shape
        if self.kind == "window":
            return self._windows(x)
        t = x.flatten(2).transpose(1, 2)
        if self.pos is not None:
            t = t + self.pos
        if self.kind == "cls":
            return x + self._cls(t).reshape(n, c, 1, 1)
        if self.kind == "mlp":
            t = t + self.fc2(F.gelu(self.fc1(self.norm(t))))
        elif self.kind == "linear":
            t = t + self._linear(self.norm(t))
        else:
            t = t + self._attention(self.norm(t))
        return t.transpose(1, 2).reshape(n, c, h, w)

    def _split(self, t: torch.Tensor) -> torch.Tensor:
        """(N, L, C) -> (N, heads, L, C / heads)."""
        n, length, c = t.shape
        return t.reshape(n, length, self.heads, c // self.heads).transpose(1, 2)

    def _attention(self, y: torch.Tensor) -> torch.Tensor:
        n, length, c = y.shape
        q, k, v = self.qkv(y).reshape(n, length, 3, self.heads, c // self.heads) \
            .permute(2, 0, 3, 1, 4).unbind(0)
        if self.kind == "written":
            s = self.scale if self.scale is not None else (c // self.heads) ** -0.5
            if self.einsum:
                a = (torch.einsum("bhxd,bhyd->bhxy", q, k) * s).softmax(dim=-1)
                o = torch.einsum("bhxy,bhyd->bhxd", a, v)
            else:
                o = ((q @ k.transpose(-2, -1)) * s).softmax(dim=-1) @ v
        else:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal,
                                               scale=self.scale)
        return self.proj(o.transpose(1, 2).reshape(n, length, c))

    def _cls(self, t: torch.Tensor) -> torch.Tensor:
        """The class token's attention over every token: (N, C), replicated."""
        n, _, c = t.shape
        k, v = self.kv(self.norm(t)).chunk(2, dim=-1)
        q = self.cls.expand(n, 1, c).reshape(n, 1, self.heads, c // self.heads).transpose(1, 2)
        a = F.scaled_dot_product_attention(q, self._split(k), self._split(v), scale=self.scale)
        return self.proj(a.transpose(1, 2).reshape(n, c))

    def _linear(self, y: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(y).relu().chunk(3, dim=-1)
        kv = k.transpose(-2, -1) @ v
        ksum = k.sum(dim=1, keepdim=True)
        return (q @ kv) / ((q * ksum).sum(-1, keepdim=True) + 1e-3)

    def _windows(self, x: torch.Tensor) -> torch.Tensor:
        """Swin: attention within each window (after a cyclic shift by half a window)."""
        n, c, h, w = x.shape
        ws, sh = self.window, self.window // 2 if self.shift else 0
        t = x.permute(0, 2, 3, 1)
        if sh:
            t = torch.roll(t, (-sh, -sh), (1, 2))
        t = t.reshape(n, h // ws, ws, w // ws, ws, c).permute(0, 1, 3, 2, 4, 5) \
            .reshape(-1, ws * ws, c)
        t = t + self._attention(self.norm(t))
        t = t.reshape(n, h // ws, w // ws, ws, ws, c).permute(0, 1, 3, 2, 4, 5) \
            .reshape(n, h, w, c)
        if sh:
            t = torch.roll(t, (sh, sh), (1, 2))
        return t.permute(0, 3, 1, 2)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def draw_block(draw: st.DrawFn, g: _Graph, kinds: tuple[str, ...] = KINDS) -> None:
    """Append a token block of one of ``kinds`` (after a patch embedding where the map is
    large) to the trunk; a draw asking only for windows on a map no window tiles is
    rejected."""
    x = g.last
    h, w = g.sizes[x]
    if h * w > MAX_TOKENS:  # ViT's patch embedding: kernel = stride = s
        s = next(s for s in range(2, max(h, w) + 1) if (h // s) * (w // s) <= MAX_TOKENS)
        x = g.add({"op": "conv", "src": [x], "out": draw(st.integers(1, 8)), "k": [s, s],
                   "s": [s, s], "p": [0, 0], "d": [1, 1], "groups": 1, "bias": True})
        h, w = g.sizes[x]
    c = g.chans[x]
    fit = [k for k in kinds if k != "window" or _windows(h, w)]
    if not fit:
        reject()
    kind = draw(st.sampled_from(fit))
    node: Spec = {"op": "tokens", "src": [x], "kind": kind,
                  "heads": draw(st.sampled_from([d for d in _divisors(c) if d <= MAX_HEADS])),
                  "pos": h * w if kind != "window" and draw(st.booleans()) else 0}
    if kind in ("sdpa", "written", "cls", "window"):
        node["scale"] = draw(st.sampled_from([None, 0.5, 1.25]))
    if kind == "sdpa":
        node["causal"] = draw(st.integers(0, 5)) == 0  # no tile rule: ends the region
    if kind == "written":
        node["einsum"] = draw(st.booleans())
    if kind == "window":
        node["window"] = draw(st.sampled_from(_windows(h, w)))
        node["shift"] = node["window"] > 1 and draw(st.booleans())
    g.add(node)


def _windows(h: int, w: int) -> list[int]:
    """Window sizes that tile an h x w map (at least 2 windows)."""
    return [s for s in range(2, min(h, w) + 1) if h % s == 0 and w % s == 0 and
            math.prod((h // s, w // s)) > 1]
