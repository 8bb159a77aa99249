"""The models, tiles and message counters of tools/bench_attention.py (section ``attention``).

- :class:`ViT`: a ViT-style segmentation encoder: a 16x16 patch embedding (strided conv), a
  learned position embedding over every token, pre-norm transformer blocks with global
  multi-head attention through ``F.scaled_dot_product_attention`` (fxpar runs it as ring
  attention over the tile group), back to an image, a small conv head, bilinear upsampling to
  the input's pixels. ``kv_repeat = P`` makes the limit's model: each of P independent processes
  runs its own tile, its queries against its keys and values repeated P times, i.e. 1/P of the
  one-process work (1/P of the queries against as many keys as the whole image has) with no
  messages; a ViT on 1/P of the image alone would do 1/P^2 of the attention.
- :func:`swin`: MONAI's SwinUNETR from ``key=value;...`` (:func:`parse_kwargs`), so it can be
  re-run with other sizes (or ``use_v2=1``) once its windowed attention runs on tiles.
- :func:`box` / :func:`split`: a rank's tile of the input, as fxpar cuts it (DESIGN.md).
- :func:`instrument`: ``Comm.isend`` counted by tag: ring attention, halo exchanges, the rest.
- :func:`ring_shapes`: per RingAttention module, what it was called with (forward pre-hooks),
  from which :func:`expected_ring` sums ``ring_bytes`` and the formula minimum.
- :func:`saved_step`: what one step saves for backward, the input batch counted by the window
  of it a rank reads.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

CLASSES = {"vit": 4, "swin": 3}


# -- the ViT-style encoder ----------------------------------------------------------------------
class Block(nn.Module):
    """Pre-norm transformer block: x + proj(attention(norm x)), x + mlp(norm x)."""

    def __init__(self, c: int, heads: int, mlp: int = 2, kv_repeat: int = 1) -> None:
        super().__init__()
        self.heads, self.kv_repeat = heads, kv_repeat
        self.norm1, self.norm2 = nn.LayerNorm(c), nn.LayerNorm(c)
        self.qkv, self.proj = nn.Linear(c, 3 * c), nn.Linear(c, c)
        self.mlp = nn.Sequential(nn.Linear(c, mlp * c), nn.GELU(), nn.Linear(mlp * c, c))

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        n, length, c = t.shape
        q, k, v = self.qkv(self.norm1(t)).reshape(n, length, 3, self.heads, c // self.heads) \
            .permute(2, 0, 3, 1, 4).unbind(0)
        if self.kv_repeat > 1:  # the limit's model: as many keys as the whole image has
            k, v = k.repeat(1, 1, self.kv_repeat, 1), v.repeat(1, 1, self.kv_repeat, 1)
        a = F.scaled_dot_product_attention(q, k, v)
        t = t + self.proj(a.transpose(1, 2).reshape(n, length, c))
        return t + self.mlp(self.norm2(t))


class ViT(nn.Module):
    """Patch embedding -> ``depth`` blocks over (H/patch)(W/patch) tokens -> image -> head."""

    def __init__(self, tokens: tuple[int, int], width: int = 64, heads: int = 4, depth: int = 4,
                 patch: int = 16, classes: int = CLASSES["vit"], kv_repeat: int = 1) -> None:
        super().__init__()
        self.patch = patch
        self.embed = nn.Conv2d(3, width, patch, stride=patch)
        self.pos = nn.Parameter(torch.randn(1, tokens[0] * tokens[1], width) * 0.02)
        self.blocks = nn.Sequential(*[Block(width, heads, kv_repeat=kv_repeat)
                                      for _ in range(depth)])
        self.norm = nn.LayerNorm(width)
        self.head = nn.Sequential(nn.Conv2d(width, width // 2, 3, padding=1), nn.ReLU(),
                                  nn.Conv2d(width // 2, classes, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        n, c, h, w = x.shape
        t = self.norm(self.blocks(x.flatten(2).transpose(1, 2) + self.pos))
        x = self.head(t.transpose(1, 2).reshape(n, c, h, w))
        return F.interpolate(x, scale_factor=float(self.patch), mode="bilinear")


def parse_vit(spec: str) -> dict[str, int]:
    """``"64,4,4,16"`` -> width, heads, depth, patch."""
    try:
        width, heads, depth, patch = (int(v) for v in spec.split(","))
    except ValueError:
        raise ValueError(f"the ViT is given as width,heads,depth,patch (e.g. 64,4,4,16), got "
                         f"{spec!r}") from None
    if min(width, heads, depth, patch) < 1 or width % heads or width % 2:
        raise ValueError(f"ViT {spec!r}: sizes must be >= 1, the width even and a multiple of "
                         f"the heads")
    return {"width": width, "heads": heads, "depth": depth, "patch": patch}


# -- MONAI's SwinUNETR --------------------------------------------------------------------------
def parse_kwargs(spec: str) -> dict[str, Any]:
    """``"feature_size=12;depths=2,2,2,2;use_v2=0"`` -> keyword arguments: ints, tuples of
    ints (a comma), else the string."""
    out: dict[str, Any] = {}
    for item in filter(None, (s.strip() for s in spec.split(";"))):
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise ValueError(f"model arguments are key=value;key=value..., got {item!r} in "
                             f"{spec!r}")
        parts = [v.strip() for v in value.split(",")]
        try:
            ints = [int(v) for v in parts]
            out[key.strip()] = tuple(ints) if "," in value else ints[0]
        except ValueError:
            out[key.strip()] = value.strip()
    return out


def swin(spec: str) -> nn.Module:
    """MONAI's SwinUNETR (3-D, 1 input channel, ``CLASSES["swin"]`` classes) with ``spec``'s
    arguments (:func:`parse_kwargs`); on the CPU (its constructor calls ``.item()``, which the
    meta device refuses)."""
    from monai.networks.nets import SwinUNETR

    kwargs: dict[str, Any] = {"spatial_dims": 3, "in_channels": 1,
                              "out_channels": CLASSES["swin"], **parse_kwargs(spec)}
    for flag in ("use_v2", "normalize", "qkv_bias", "patch_norm", "use_checkpoint"):
        if flag in kwargs:
            kwargs[flag] = bool(kwargs[flag])
    return SwinUNETR(**kwargs)


# -- tiles ----------------------------------------------------------------------------------------
def split(extent: int, parts: int, k: int) -> tuple[int, int]:
    """Part ``k`` of ``extent`` in ``parts``: ``[floor(k*E/P), floor((k+1)*E/P))``, fxpar's even
    split of every tensor (DESIGN.md), restated so the limit's tiles are independent of it."""
    return (k * extent // parts, (k + 1) * extent // parts)


def box(extents: Sequence[int], grid: Sequence[int], rank: int) -> tuple[slice, ...]:
    """The slices of tile ``rank`` (row-major over ``grid``, as fxpar numbers tiles)."""
    pos = list(itertools.product(*(range(g) for g in grid)))[rank]
    return tuple(slice(*split(e, g, k)) for e, g, k in zip(extents, grid, pos, strict=True))


# -- counting what is sent ------------------------------------------------------------------------
KINDS = ("ring_fwd", "ring_bwd", "halo_fwd", "halo_bwd", "other")


def tag_kinds(modules: Sequence[nn.Module]) -> dict[int, str]:
    """Tag -> kind of message: a RingAttention or halo module sends forward with its ``tag``
    and backward with ``tag + 1`` (fxpar.runtime.spatial.tags); other tags are joins, the
    loss and the like."""
    from fxpar.runtime.spatial.attention import RingAttention
    from fxpar.runtime.spatial.ops import Halo, HaloOp

    kinds: dict[int, str] = {}
    for mod in modules:
        for m in mod.modules():
            kind = "ring" if isinstance(m, RingAttention) else \
                "halo" if isinstance(m, (Halo, HaloOp)) else ""
            if kind:
                kinds[m.tag], kinds[m.tag + 1] = f"{kind}_fwd", f"{kind}_bwd"
    return kinds


def instrument(modules: Sequence[nn.Module]) -> dict[str, float]:
    """Patch ``Comm.isend`` in this process to count the bytes of every message by
    :func:`tag_kinds` (``<kind>_bytes``) and the number of ring messages. Returns the live
    counters (:func:`reset` zeroes them)."""
    from fxpar.comm.mpi import Comm

    kinds = tag_kinds(modules)
    counts = dict.fromkeys([f"{k}_bytes" for k in KINDS] + ["ring_msgs"], 0.0)
    isend = Comm.isend

    def counted(self: Any, t: torch.Tensor, dst: int, tag: int = 0) -> Any:
        kind = kinds.get(tag, "other")
        counts[f"{kind}_bytes"] += t.numel() * t.element_size()
        counts["ring_msgs"] += kind.startswith("ring")
        return isend(self, t, dst, tag)

    Comm.isend = counted  # type: ignore[method-assign]
    return counts


def reset(counts: dict[str, float]) -> None:
    for key in counts:
        counts[key] = 0.0


def ring_shapes(modules: Sequence[nn.Module]) -> list[dict[str, Any]]:
    """Forward pre-hooks on every RingAttention of ``modules``: the returned list fills, per
    call, with its lengths, batch (product of the leading dims), key and value widths and
    dtype."""
    from fxpar.runtime.spatial.attention import RingAttention

    calls: list[dict[str, Any]] = []

    def hook(mod: nn.Module, args: tuple[Any, ...]) -> None:
        _q, k, v = args[:3]
        calls.append({"lengths": list(mod.lengths), "batch": math.prod(k.shape[:-2]),
                      "e": int(k.shape[-1]), "ev": int(v.shape[-1]), "dtype": k.dtype})

    for mod in modules:
        for m in mod.modules():
            if isinstance(m, RingAttention):
                m.register_forward_pre_hook(hook)
    return calls


def expected_ring(calls: Sequence[dict[str, Any]], rank: int) -> dict[str, float]:
    """For rank ``rank``'s ring calls of one step: the bytes ``ring_bytes`` says it sends
    (``formula_fwd`` / ``formula_bwd``), K and V of the whole sequence (``kv``, per layer
    summed) and the minimum this rank must receive in forward (``min_fwd``: every other
    tile's K and V) and in backward (``min_bwd``: those again, unless kept from forward, and
    the partial dK, dV of its own tokens from every other rank, a reduce-scatter)."""
    from fxpar.runtime.spatial.attention import acc_dtype, ring_bytes

    out = dict.fromkeys(("formula_fwd", "formula_bwd", "kv", "min_fwd", "min_bwd"), 0.0)
    for c in calls:
        fwd, bwd = ring_bytes(c["lengths"], rank, c["batch"], c["e"], c["ev"], c["dtype"])
        row = c["batch"] * (c["e"] + c["ev"])
        b, a = c["dtype"].itemsize, acc_dtype(c["dtype"]).itemsize
        total, mine = sum(c["lengths"]), c["lengths"][rank]
        out["formula_fwd"] += fwd
        out["formula_bwd"] += bwd
        out["kv"] += row * b * total
        out["min_fwd"] += row * b * (total - mine)
        out["min_bwd"] += row * (b + a) * (total - mine)
    return out


# -- saved activations ----------------------------------------------------------------------------
def saved_step(step: Callable[[], float], params: Sequence[torch.Tensor],
               held: Sequence[tuple[torch.Tensor, int]]) -> dict[str, Any]:
    """Run ``step`` once and count what its forward saves for backward, as tools/memtrack.py's
    ``saved_step`` does (unique storages packed by ``saved_tensors_hooks`` outside backward,
    parameters excluded), except for the storages of ``held``: (tensor, bytes this rank holds
    of it). A saved tensor on one of those counts that many bytes, once. An fxpar rank is
    handed the whole batch's shape but reads only its window (``RankProgram.input_window``; a
    loader fills just that part of a ``torch.empty``, the rest is never resident), yet the
    op that runs the first conv on the input (``fxpar::halo_op``) saves the whole batch tensor
    for backward: counted by storage, each rank would seem to keep the whole image.
    ``saved_storage_bytes``: the count with whole storages, as memtrack gives it."""
    skip = {p.untyped_storage().data_ptr() for p in params}
    mine = {t.untyped_storage().data_ptr(): (t.untyped_storage().nbytes(), n) for t, n in held}
    saved: dict[int, int] = {}
    inputs: set[int] = set()
    seen = [0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        if torch._C._current_graph_task_id() == -1:  # not inside a backward pass
            seen[0] += 1
            ptr = t.untyped_storage().data_ptr()
            if ptr in mine:
                inputs.add(ptr)
            elif ptr not in skip:
                saved[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = step()
    return {"saved_bytes": sum(saved.values()) + sum(mine[p][1] for p in inputs),
            "saved_storage_bytes": sum(saved.values()) + sum(mine[p][0] for p in inputs),
            "saved_input_bytes": sum(mine[p][1] for p in inputs), "saved_tensors": seen[0],
            "param_bytes": sum(p.numel() * p.element_size() for p in params), "loss": loss}
