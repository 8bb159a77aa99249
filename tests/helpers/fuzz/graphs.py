"""Random small CNNs as JSON-able specs, the model a spec builds, and random valid plans.

A spec is plain data, so a hypothesis example travels to the MPI pool as one JSON line and is
printed as it is when it fails::

    {"seed": 0, "batch": 4, "channels": 3, "size": [13, 9], "classes": 3, "head": "gap",
     "nodes": [{"op": "conv", "src": [0], "out": 4, "k": [3, 3], "s": [2, 2], "p": [1, 1],
                "d": [1, 1], "groups": 1, "bias": true},
               {"op": "relu", "src": [1]}]}

Value 0 is the input image; node i of ``nodes`` (0-based) makes value i + 1 from the values
its ``src`` lists. Blocks are drawn one after another from the latest value (the *trunk*):
conv, max/avg pool, BatchNorm, group and instance norm, ReLU, a residual add (1x1 projection
when channels or size change), a channel concat of two branches (one may be an earlier value
of the same size: a skip across stages; or an image-level branch as in DeepLab's ASPP: global
pool, 1x1 conv, interpolated back to the size), nearest/bilinear upsampling, interpolation to
a size or scale (bilinear with either align_corners), constant / reflect / replicate padding,
a ConvNeXt-style channels-last block (permute, LayerNorm, Linear, permute), adaptive average
pooling, and token blocks (tests/helpers/fuzz/tokens.py: the image flattened into tokens, a
per-token MLP, global attention as SDPA or written out, a class token's cross attention, linear
attention, a position embedding, and back). The head is a global mean (``gap`` module or
``mean`` method) or ``flatten``, then a Linear to ``classes``.

Strategies shrink towards the simplest thing: fewer blocks, ReLU before conv, kernel 1,
stride 1, padding 0, the trivial plan.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from hypothesis import strategies as st
from torch import nn

import fxpar
from helpers.fuzz import tokens

Spec = dict[str, Any]
MAX_EXTENT = 48
"""No drawn op makes an image side longer than this (padding is capped accordingly)."""
MAX_RANKS = 4
"""The pool's size: every drawn plan needs at most this many ranks."""
BLOCKS = ("relu", "bn", "conv", "maxpool", "avgpool", "residual", "concat", "upsample",
          "adaptive", "groupnorm", "instancenorm", "pad", "interpolate", "channels_last",
          "perpixel", "tokens")
NODES = {"channels_last": 4}
"""Captured (ATen) compute nodes of a spec node, where more than one: permute, layer_norm,
linear, permute."""
PER_PIXEL = {  # variant: captured compute nodes
    "unsqueeze": 3, "reshape_nc": 3, "transpose_hw": 3, "select": 3, "index_select": 1,
    "max_c": 5, "argmax_c": 2, "batch_mean": 2, "batch_sum": 2, "softmax_c": 1,
}
"""Ops on the batch and channel dims only (issue 36's region ends that are gone): the variants
of a "perpixel" node."""


class ChannelsLast(nn.Module):
    """ConvNeXt's per-pixel block: to N, H, W, C; LayerNorm and Linear over C; back."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.norm, self.fc = nn.LayerNorm(c), nn.Linear(c, c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.norm(x.permute(0, 2, 3, 1))).permute(0, 3, 1, 2)


class PerPixel(nn.Module):
    """One op (or round trip) on the batch and channel dims, back to the input's shape."""

    def __init__(self, variant: str, c: int) -> None:
        super().__init__()
        self.variant = variant
        self.register_buffer("order", torch.arange(c - 1, -1, -1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # noqa: PLR0911 - one line each
        v = self.variant
        if v == "unsqueeze":
            return (x.unsqueeze(1) * 0.5).squeeze(1)
        if v == "reshape_nc":
            return torch.relu(x.reshape(-1, 1, *x.shape[2:])).reshape(x.shape)
        if v == "transpose_hw":
            return (x.transpose(2, 3) * 2.0).transpose(2, 3)
        if v == "select":
            return x * x[:, 0].unsqueeze(1)
        if v == "index_select":
            return x.index_select(1, self.order)
        if v == "max_c":
            return x - x.max(dim=1)[0].unsqueeze(1)
        if v == "argmax_c":
            return x * x.argmax(1, keepdim=True)
        if v == "batch_mean":
            return x - x.mean(0, keepdim=True)
        if v == "batch_sum":
            return x - x.sum(0)
        return x.softmax(1)


class Interpolate(nn.Module):
    """F.interpolate to a size (or by a scale), nearest or bilinear with either corners."""

    def __init__(self, node: Spec) -> None:
        super().__init__()
        self.node = node

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = self.node
        corners = n["corners"] if n["mode"] == "bilinear" else None
        if "size" in n:
            return nn.functional.interpolate(x, size=tuple(n["size"]), mode=n["mode"],
                                             align_corners=corners)
        return nn.functional.interpolate(x, scale_factor=tuple(n["scale"]), mode=n["mode"],
                                         align_corners=corners)


# -- the model a spec builds -------------------------------------------------------------------

def _module(node: Spec, c_in: int) -> nn.Module:
    """The module of a one-input node."""
    op = node["op"]
    if op == "conv":
        return nn.Conv2d(c_in, node["out"], tuple(node["k"]), tuple(node["s"]), tuple(node["p"]),
                         tuple(node["d"]), groups=node["groups"], bias=node["bias"])
    if op == "maxpool":
        return nn.MaxPool2d(tuple(node["k"]), tuple(node["s"]), tuple(node["p"]),
                            tuple(node["d"]), ceil_mode=node["ceil"])
    if op == "avgpool":
        return nn.AvgPool2d(tuple(node["k"]), tuple(node["s"]), tuple(node["p"]),
                            ceil_mode=node["ceil"], count_include_pad=node["include_pad"])
    if op == "bn":
        return nn.BatchNorm2d(c_in)
    if op == "relu":
        return nn.ReLU()
    if op == "upsample":
        return nn.Upsample(scale_factor=tuple(float(f) for f in node["scale"]),
                           mode=node["mode"])
    if op == "adaptive":
        return nn.AdaptiveAvgPool2d(tuple(node["out"]))
    if op == "groupnorm":
        return nn.GroupNorm(node["groups"], c_in)
    if op == "instancenorm":
        return nn.InstanceNorm2d(c_in, affine=node["affine"])
    if op == "pad":
        pad = tuple(node["pad"])
        if node["mode"] == "constant":
            return nn.ConstantPad2d(pad, node["value"])
        return nn.ReflectionPad2d(pad) if node["mode"] == "reflect" else nn.ReplicationPad2d(pad)
    if op == "interpolate":
        return Interpolate(node)
    if op == "channels_last":
        return ChannelsLast(c_in)
    if op == "perpixel":
        return PerPixel(node["variant"], c_in)
    if op == "tokens":
        return tokens.TokenBlock(node, c_in)
    raise ValueError(f"unknown fuzz op {op!r}")


def channels(spec: Spec) -> list[int]:
    """The channel count of every value (the input's first)."""
    return _replay(spec).chans


class FuzzNet(nn.Module):
    """The model of a spec: the node list unrolled by torch.fx into a plain DAG."""

    def __init__(self, spec: Spec) -> None:
        super().__init__()
        chans = channels(spec)
        self.nodes = tuple((n["op"], tuple(n["src"])) for n in spec["nodes"])
        self.layers = nn.ModuleDict({f"n{i}": _module(n, chans[n["src"][0]])
                                     for i, n in enumerate(spec["nodes"])
                                     if n["op"] not in ("add", "cat")})
        self.head = spec["head"]
        self.pool = nn.AdaptiveAvgPool2d(1)
        c, (h, w) = chans[-1], shapes(spec)[-1]
        self.fc = nn.Conv2d(c, spec["classes"], 1) if self.head == "seg" else \
            nn.Linear(c * h * w if self.head == "flatten" else c, spec["classes"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        values = [x]
        for i, (op, src) in enumerate(self.nodes):
            if op == "add":
                values.append(values[src[0]] + values[src[1]])
            elif op == "cat":
                values.append(torch.cat([values[j] for j in src], 1))
            else:
                values.append(self.layers[f"n{i}"](values[src[0]]))
        y = values[-1]
        if self.head == "seg":  # one score per class and pixel: a loss on the (tiled) map
            return self.fc(y)
        if self.head == "gap":
            y = torch.flatten(self.pool(y), 1)
        elif self.head == "mean":
            y = y.mean((2, 3))
        else:
            y = torch.flatten(y, 1)
        return self.fc(y)


def build(spec: Spec) -> FuzzNet:
    """The model of ``spec``, the same on every rank: weights from ``spec["seed"]``, BatchNorm
    affine parameters drawn too (so they are not the trivial 1 and 0)."""
    torch.manual_seed(spec["seed"])
    model = FuzzNet(spec)
    for m in model.modules():
        if isinstance(m, (nn.BatchNorm2d, nn.GroupNorm, nn.InstanceNorm2d, nn.LayerNorm)) and \
                m.weight is not None:
            nn.init.uniform_(m.weight, 0.5, 1.5)
            nn.init.uniform_(m.bias, -0.5, 0.5)
    return model


def compute_nodes(spec: Spec) -> int:
    """Compute nodes of the traced model (what ``Plan.balance`` counts): one per node, then
    the head's (pool + flatten, mean, or flatten) and the Linear."""
    return sum(PER_PIXEL[n["variant"]] if n["op"] == "perpixel" else
               tokens.nodes(n) if n["op"] == "tokens" else NODES.get(n["op"], 1)
               for n in spec["nodes"]) + \
        {"gap": 2, "mean": 1, "flatten": 1, "seg": 0}[spec["head"]] + 1


# -- shapes ------------------------------------------------------------------------------------

def _size_after(node: Spec, c_in: int, hw: tuple[int, int]) -> tuple[int, int]:
    with torch.device("meta"):
        y = _module(node, c_in)(torch.empty(1, c_in, *hw))
    return (int(y.shape[2]), int(y.shape[3]))


def shapes(spec: Spec) -> list[tuple[int, int]]:
    """(H, W) of every value, the input's first."""
    return _replay(spec).sizes


def _replay(spec: Spec) -> _Graph:
    """The channels and sizes of ``spec``'s values, as drawing it tracked them."""
    g = _Graph(spec["channels"], tuple(spec["size"]))
    for node in spec["nodes"]:
        g.add(node)
    return g


# -- drawing a spec ----------------------------------------------------------------------------

def _pair(draw: st.DrawFn, lo: int, hi: tuple[int, int]) -> tuple[int, int]:
    """A value per dim in [lo, hi[dim]]: usually the same for both dims."""
    if draw(st.booleans()):  # asymmetric
        return (draw(st.integers(lo, hi[0])), draw(st.integers(lo, hi[1])))
    v = draw(st.integers(lo, min(hi)))
    return (v, v)


class _Graph:
    """The spec being drawn, with the channels and size of every value so far."""

    def __init__(self, c: int, hw: tuple[int, int]) -> None:
        self.nodes: list[Spec] = []
        self.chans = [c]
        self.sizes = [hw]

    @property
    def last(self) -> int:
        return len(self.sizes) - 1

    def add(self, node: Spec) -> int:
        src = node["src"]
        if node["op"] in ("add", "cat"):
            hw = self.sizes[src[0]]
            assert all(self.sizes[j] == hw for j in src), f"{node} joins different sizes"
            if node["op"] == "add":
                assert len({self.chans[j] for j in src}) == 1, f"{node} adds channel counts"
            c = sum(self.chans[j] for j in src) if node["op"] == "cat" else self.chans[src[0]]
        else:
            c = node["out"] if node["op"] == "conv" else self.chans[src[0]]
            hw = _size_after(node, self.chans[src[0]], self.sizes[src[0]])
            assert min(hw) >= 1 and max(hw) <= MAX_EXTENT, f"{node} gives {hw}"
        self.nodes.append(node)
        self.chans.append(c)
        self.sizes.append(hw)
        return self.last


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _conv(draw: st.DrawFn, g: _Graph, src: int) -> Spec:
    """Any conv: kernel 1..5, stride 1..3, padding 0..k, dilation 1..2, groups, bias."""
    c, hw = g.chans[src], g.sizes[src]
    out = draw(st.integers(1, 8))
    d = _pair(draw, 1, (2, 2))
    k = _pair(draw, 1, (5, 5))
    s = _pair(draw, 1, (3, 3))
    span = [d[i] * (k[i] - 1) + 1 for i in range(2)]
    lo = [max(0, math.ceil((span[i] - hw[i]) / 2)) for i in range(2)]  # output >= 1 px
    # padding up to k, but no side longer than MAX_EXTENT
    hi = [max(lo[i], min(k[i], ((MAX_EXTENT - 1) * s[i] + span[i] - hw[i]) // 2))
          for i in range(2)]
    if draw(st.booleans()) or max(lo) > min(hi):
        p = (draw(st.integers(lo[0], hi[0])), draw(st.integers(lo[1], hi[1])))
    else:
        v = draw(st.integers(max(lo), max(max(lo), min(hi))))
        p = (v, v)
    groups = draw(st.sampled_from(_divisors(math.gcd(c, out))))
    return {"op": "conv", "src": [src], "out": out, "k": list(k), "s": list(s), "p": list(p),
            "d": list(d), "groups": groups, "bias": draw(st.booleans())}


def _same_conv(draw: st.DrawFn, g: _Graph, src: int, out: int, stride: int = 1) -> Spec:
    """A conv whose output size is ceil(size / stride), like a 1x1 conv with that stride."""
    k = draw(st.sampled_from([1, 3, 5]))
    d = draw(st.integers(1, 2)) if k > 1 else 1
    p = d * (k - 1) // 2
    return {"op": "conv", "src": [src], "out": out, "k": [k, k], "s": [stride, stride],
            "p": [p, p], "d": [d, d], "groups": 1, "bias": draw(st.booleans())}


def _pool(draw: st.DrawFn, g: _Graph, src: int, kind: str) -> Spec:
    """Max pool (with dilation) or avg pool (count_include_pad or not); kernel 1..4, stride
    1..3, ceil_mode or not."""
    hw = g.sizes[src]
    d = _pair(draw, 1, tuple(2 if e >= 3 else 1 for e in hw)) if kind == "maxpool" else (1, 1)
    k = _pair(draw, 1, tuple(min(4, (hw[i] - 1) // d[i] + 1) for i in range(2)))
    s = _pair(draw, 1, (3, 3))
    # padding up to half the kernel (PyTorch's limit); none where it could grow the side
    p = _pair(draw, 0, tuple(0 if hw[i] >= MAX_EXTENT - 1 else k[i] // 2 for i in range(2)))
    node = {"op": kind, "src": [src], "k": list(k), "s": list(s), "p": list(p),
            "ceil": draw(st.booleans())}
    if kind == "maxpool":
        node["d"] = list(d)
    else:
        node["include_pad"] = draw(st.booleans())
    return node


def _block(draw: st.DrawFn, g: _Graph) -> None:
    """Append one block to the trunk."""
    x = g.last
    c, (h, w) = g.chans[x], g.sizes[x]
    kinds = [b for b in BLOCKS if not (b in ("bn", "groupnorm", "instancenorm", "adaptive")
                                       and h * w < 2)  # norms need 2 values per channel
             and not (b == "upsample" and max(h, w) > MAX_EXTENT // 2)
             and not (b == "pad" and max(h, w) > MAX_EXTENT - 4)]
    kind = draw(st.sampled_from(kinds))
    if kind in ("relu", "bn"):
        g.add({"op": kind, "src": [x]})
    elif kind == "conv":
        g.add(_conv(draw, g, x))
    elif kind in ("maxpool", "avgpool"):
        g.add(_pool(draw, g, x, kind))
    elif kind == "residual":
        out = draw(st.integers(1, 8))
        stride = draw(st.integers(1, 2))
        y = g.add(_same_conv(draw, g, x, out, stride))
        if draw(st.booleans()):  # conv - BN - ReLU - conv
            y = g.add({"op": "bn", "src": [y]}) if math.prod(g.sizes[y]) >= 2 else y
            y = g.add({"op": "relu", "src": [y]})
            y = g.add(_same_conv(draw, g, y, out))
        skip = x
        if out != c or stride != 1:
            skip = g.add({"op": "conv", "src": [x], "out": out, "k": [1, 1],
                          "s": [stride, stride], "p": [0, 0], "d": [1, 1], "groups": 1,
                          "bias": draw(st.booleans())})
        g.add({"op": "add", "src": [y, skip]})
    elif kind == "concat":
        a = g.add(_same_conv(draw, g, x, draw(st.integers(1, 8))))
        how = draw(st.sampled_from(["trunk", "maxpool", "avgpool", "earlier", "pooled"]))
        earlier = [v for v in range(x) if g.sizes[v] == (h, w)]
        if how == "pooled":  # DeepLab's ASPP image branch: global pool, 1x1 conv, back up
            b = g.add({"op": "adaptive", "src": [x], "out": [1, 1]})
            b = g.add({"op": "conv", "src": [b], "out": draw(st.integers(1, 8)), "k": [1, 1],
                       "s": [1, 1], "p": [0, 0], "d": [1, 1], "groups": 1,
                       "bias": draw(st.booleans())})
            mode = draw(st.sampled_from(["nearest", "bilinear"]))
            b = g.add({"op": "interpolate", "src": [b], "mode": mode, "size": [h, w],
                       "corners": draw(st.booleans())})
        elif how in ("maxpool", "avgpool"):
            b = g.add({"op": how, "src": [x], "k": [3, 3], "s": [1, 1], "p": [1, 1],
                       "ceil": False, **({"d": [1, 1]} if how == "maxpool"
                                         else {"include_pad": draw(st.booleans())})})
        elif how == "earlier" and earlier:
            b = draw(st.sampled_from(earlier))
        else:
            b = x
        g.add({"op": "cat", "src": [b, a] if draw(st.booleans()) else [a, b]})
    elif kind == "upsample":
        scale = draw(st.sampled_from([[2, 2], [2, 1], [1, 2]]))
        g.add({"op": "upsample", "src": [x], "scale": scale,
               "mode": draw(st.sampled_from(["nearest", "bilinear"]))})
    elif kind == "groupnorm":
        g.add({"op": kind, "src": [x], "groups": draw(st.sampled_from(_divisors(c)))})
    elif kind == "instancenorm":
        g.add({"op": kind, "src": [x], "affine": draw(st.booleans())})
    elif kind == "pad":  # constant, reflect and replicate pads run on tiles
        mode = draw(st.sampled_from(["constant", "constant", "reflect", "replicate"]))
        most = [2 if mode == "constant" else min(2, e - 1) for e in (w, w, h, h)]
        node = {"op": "pad", "src": [x], "mode": mode,
                "pad": [draw(st.integers(0, m)) for m in most]}
        if mode == "constant":
            node["value"] = draw(st.sampled_from([0.0, 0.5, -1.0]))
        g.add(node)
    elif kind == "interpolate":
        mode = draw(st.sampled_from(["nearest", "bilinear"]))
        node = {"op": "interpolate", "src": [x], "mode": mode, "corners": draw(st.booleans())}
        if draw(st.booleans()):
            node["size"] = [draw(st.integers(max(1, e // 2), min(MAX_EXTENT, 2 * e)))
                            for e in (h, w)]
        else:
            node["scale"] = draw(st.sampled_from([[2.0, 2.0], [1.5, 1.5], [0.5, 2.0]]))
            if any(int(e * f) < 1 or int(e * f) > MAX_EXTENT
                   for e, f in zip((h, w), node["scale"], strict=True)):
                node["scale"] = [1.0, 1.0]
        g.add(node)
    elif kind == "channels_last":
        g.add({"op": kind, "src": [x]})
    elif kind == "perpixel":
        g.add({"op": kind, "src": [x], "variant": draw(st.sampled_from(sorted(PER_PIXEL)))})
    elif kind == "tokens":
        tokens.draw_block(draw, g)
    else:  # adaptive average pooling to a smaller size: ends a spatial region
        g.add({"op": "adaptive", "src": [x],
               "out": [draw(st.integers(1, h)), draw(st.integers(1, w))]})


@st.composite
def specs(draw: st.DrawFn, max_blocks: int = 5, token_block: bool = False,
          kinds: tuple[str, ...] = tokens.KINDS) -> Spec:
    """A random small CNN: input 8..40 px a side (non-square allowed), batch 2..8, 1..4 input
    channels, 1..``max_blocks`` blocks, a head and 2..6 classes. ``token_block``: one of the
    blocks is a token block of one of ``kinds`` (tests/helpers/fuzz/tokens.py)."""
    c = draw(st.integers(1, 4))
    if token_block and set(kinds) <= set(tokens.WINDOW):  # sides that 2, 3, 4 tiles and
        hw = (12 * draw(st.integers(1, 3)), 12 * draw(st.integers(1, 3)))  # windows divide
    else:
        hw = (draw(st.integers(8, 40)), draw(st.integers(8, 40)))
    g = _Graph(c, hw)
    blocks = draw(st.integers(1, max_blocks))
    at = draw(st.integers(0, blocks - 1)) if token_block else -1
    for i in range(blocks):
        if i == at:
            tokens.draw_block(draw, g, kinds)
        else:
            _block(draw, g)
    h, w = g.sizes[-1]
    heads = ["gap", "mean", "seg"] + (["flatten"] if g.chans[-1] * h * w <= 512 else [])
    head = draw(st.sampled_from(heads))
    return {"seed": draw(st.integers(0, 2**16)), "batch": draw(st.integers(2, 8)),
            "channels": c, "size": list(hw), "classes": draw(st.integers(2, 6)),
            "head": head, "nodes": g.nodes,
            **({"loss": draw(st.sampled_from(sorted(LOSSES)))} if head == "seg" else {})}


# -- the losses of a segmentation head ---------------------------------------------------------

def _dice(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """A soft Dice: per-class sums over the batch and the pixels, then their ratio."""
    p = out.softmax(1)
    onehot = torch.nn.functional.one_hot(y, out.shape[1]).permute(0, 3, 1, 2).to(p.dtype)
    inter, total = (p * onehot).sum((0, 2, 3)), (p + onehot).sum((0, 2, 3))
    return (1 - (2 * inter + 1e-3) / (total + 1e-3)).mean()


def _masked(out: torch.Tensor, y: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-pixel cross-entropy times a mask, summed, over the mask's sum."""
    ce = torch.nn.functional.cross_entropy(out, y, reduction="none")
    return (ce * mask).sum() / mask.sum().clamp_min(1)


LOSSES = {
    "ce": lambda out, y: torch.nn.functional.cross_entropy(out, y),
    "ce_ignore": lambda out, y: torch.nn.functional.cross_entropy(out, y, ignore_index=1),
    "dice": _dice,
    "masked": _masked,
}
"""The losses a ``seg`` head trains with: a per-pixel mean, ``ignore_index``, a ratio of sums,
a masked mean (each drawn; the target a label per pixel, and a mask for ``masked``)."""


def targets(spec: Spec) -> Any:
    """The targets of a ``seg`` spec's batch, from a generator: labels per output pixel (and a
    0/1 mask for the masked loss)."""
    (h, w), n = shapes(spec)[-1], spec["batch"]

    def make(g: torch.Generator) -> Any:
        y = torch.randint(0, spec["classes"], (n, h, w), generator=g)
        if spec["loss"] != "masked":
            return y
        return y, (torch.rand((n, h, w), generator=g) > 0.4).double()
    return make


# -- drawing a plan ----------------------------------------------------------------------------

def _layout(stages: int, parts: int, spatial_stages: int) -> int:
    """Ranks of one layout (one data-parallel copy)."""
    return stages + (parts - 1) * spatial_stages if parts > 1 else stages


@st.composite
def plans(draw: st.DrawFn, spec: Spec) -> dict[str, Any]:
    """A plan for ``spec`` on at most MAX_RANKS ranks whose chunks divide the batch, as
    ``Plan(**d)`` keyword arguments. Whether the model's sizes suit it (tiles not smaller than
    the image, spatial stages with work) is for ``fxpar.compile`` to say."""
    n, batch = compute_nodes(spec), spec["batch"]
    stages = draw(st.integers(1, min(MAX_RANKS, n)))
    parts = draw(st.integers(1, MAX_RANKS + 1 - stages))
    plan: dict[str, Any] = {"stages": stages}
    spatial_stages = 1
    if parts > 1:
        fit = [s for s in range(1, stages + 1) if _layout(stages, parts, s) <= MAX_RANKS]
        spatial_stages = draw(st.sampled_from(fit))
        plan.update(spatial_parts=parts, spatial_stages=spatial_stages,
                    slice=draw(st.sampled_from(["square", "vertical", "horizontal"])))
    layout = _layout(stages, parts, spatial_stages)
    dp = draw(st.sampled_from([d for d in range(1, MAX_RANKS // layout + 1) if batch % d == 0]))
    gems = batch % (2 * dp) == 0 and draw(st.booleans())
    times = draw(st.sampled_from([t for t in (1, 2) if batch % (2 * dp * t) == 0])) if gems else 1
    per = batch // (dp * (2 * times if gems else 1))
    micro = draw(st.sampled_from(_divisors(per)[:4]))
    schedules = ["gpipe", "1f1b", "zero_bubble"]
    if stages % 2 == 0 and micro % (stages // 2) == 0 and (parts == 1 or
                                                          spatial_stages == stages):
        schedules.append("interleaved_1f1b")  # 2 stages per rank
    if stages % 2 == 0 and (parts == 1 or spatial_stages == stages):
        schedules.append("zero_bubble_v")  # 2 stages per rank, in a V
    schedule = draw(st.sampled_from(schedules))
    plan.update(data_parallel=dp, gems=gems, gems_times=times, microbatches=micro,
                schedule=schedule)
    if schedule in ("interleaved_1f1b", "zero_bubble_v"):
        plan["stages_per_rank"] = 2
    if stages > 1 and draw(st.booleans()):
        cuts = sorted(draw(st.lists(st.integers(1, n - 1), min_size=stages - 1,
                                    max_size=stages - 1, unique=True)))
        plan["balance"] = [b - a for a, b in zip([0, *cuts], [*cuts, n], strict=True)]
    fxpar.Plan(**plan)  # a drawn plan is always valid on its own
    return plan
