"""How ATen ops (the graph ``torch.export`` captures, see fxpar.frontend.capture) run on tiles.

The ATen ops that real CNNs use form a small closed set; each is one entry of :data:`RULES`
(an :class:`OpRule`: the function that maps a use of the op to its op class of
fxpar.frontend.rules.opkind -- Pointwise, Window, BatchNorm, Norm, Reduce -- and the message
that says why a use it cannot tile is refused). The elementwise ops are one table
(fxpar.frontend.rules.pointwise). An op that is not listed ends the spatial region: it is never
guessed at. Adding an op is one entry::

    @rule(aten.max_pool2d, aten.max_pool3d)
    def _max_pool(n: fx.Node) -> Op | None:
        ...
        return Window("maxpool", k, s, p, d, fill=-math.inf, ...)

Argument positions follow the ATen schemas (``torch.ops.aten.conv2d.default._schema``); a
trailing argument left at its default is absent from ``node.args``, so every read goes through
:func:`_arg` with the schema's default.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx

from fxpar.core import meta
from fxpar.core.geometry import per_dim
from fxpar.core.meta import TensorInfo
from fxpar.frontend.rules.opkind import (
    SPATIAL_RANKS,
    BatchNorm,
    Norm,
    Op,
    Pointwise,
    Reduce,
    Window,
)
from fxpar.frontend.rules.pointwise import POINTWISE as POINTWISE  # re-exported: islands
from fxpar.frontend.rules.wrap import roll_window
from fxpar.runtime.modules import BatchNormOp, DropoutOp
from fxpar.runtime.spatial.interp import PADS, AxisMap

aten = torch.ops.aten

@dataclass(frozen=True)
class OpRule:
    """How one ATen op runs on tiles: ``tile(node)`` gives its op class (fxpar.frontend.rules.
    opkind: Pointwise, Window, BatchNorm, Norm, Reduce), or None where this use of it cannot
    run on tiles; ``refusal(node)`` then says why, and what would (for messages). What the
    passes do with the op class (halo widths from ``Window.needs``, receptive fields, the
    halo exchange) follows from it, and its cost comes from torch's own FLOP table
    (torch.utils.flop_counter): so a new op whose class fxpar knows is one entry here."""

    tile: Callable[[fx.Node], Op | None]
    refusal: Callable[[fx.Node], str] | None = None


RULES: dict[Any, OpRule] = {}
"""One entry per ATen op (overload packet): :func:`rule` adds them."""

REDUCTIONS = {aten.mean: "mean", aten.sum: "sum", aten.amax: "amax",
              aten.linalg_vector_norm: "norm"}
"""Reductions: over H and W of the whole image (replicated result), or over channels only
with ``keepdim`` (CBAM's spatial attention: per pixel)."""


def rule(*packets: Any, refusal: str | Callable[[fx.Node], str] | None = None
         ) -> Callable[[Callable[[fx.Node], Op | None]], Callable[[fx.Node], Op | None]]:
    """Register the decorated ``tile(node)`` as the rule of ``packets``; ``refusal``: why a
    use of them the rule returns None for is refused (a text, or a function of the node)."""
    why = (lambda _n, text=refusal: text) if isinstance(refusal, str) else refusal

    def register(tile: Callable[[fx.Node], Op | None]) -> Callable[[fx.Node], Op | None]:
        for packet in packets:
            if packet in RULES:
                raise ValueError(f"two tile rules for {packet}")
            RULES[packet] = OpRule(tile, why)
        return tile
    return register


def refuse(*packets: Any, refusal: str | Callable[[fx.Node], str]) -> None:
    """Ops that never run on tiles, with the message that says so (no rule to try)."""
    rule(*packets, refusal=refusal)(lambda _n: None)


def arg(n: fx.Node, i: int, default: Any) -> Any:
    """Argument ``i`` of ``n`` by its schema position (or its keyword), else ``default``."""
    if len(n.args) > i:
        return n.args[i]
    target = n.target
    if isinstance(target, torch._ops.OpOverload):
        names = [a.name for a in target._schema.arguments]
        if i < len(names) and names[i] in n.kwargs:
            return n.kwargs[names[i]]
    return default


def _shape(n: Any) -> tuple[int, ...] | None:
    info = meta.find(n, TensorInfo) if isinstance(n, fx.Node) else None
    return info.shape if info is not None and len(info.shapes) == 1 else None


def classify_module(m: torch.nn.Module, path: str) -> Op | None:
    """fxpar's own mode-following modules (fxpar.frontend.capture) in a captured graph."""
    if isinstance(m, BatchNormOp):
        return BatchNorm(path)
    if isinstance(m, DropoutOp):
        return Pointwise()
    return None


def classify_aten(n: fx.Node) -> Op | None:
    """How the ATen op ``n`` runs on tiles (its :data:`RULES` entry), or None."""
    f = n.target
    if not isinstance(f, torch._ops.OpOverload):
        return None
    entry = RULES.get(f.overloadpacket)
    return None if entry is None else entry.tile(n)


def why_not_aten(n: fx.Node) -> str:
    """Why :func:`classify_aten` refuses ``n``, and what would let it run on tiles."""
    f = n.target
    entry = RULES.get(getattr(f, "overloadpacket", None))
    if entry is not None and entry.refusal is not None:
        return entry.refusal(n)
    name = str(getattr(f, "overloadpacket", f)).removeprefix("aten.")
    return f"fxpar has no tiling rule for aten.{name}, so it never guesses"


POOL_DIMS = {aten.max_pool1d: 1, aten.max_pool2d: 2, aten.max_pool3d: 3}
"""Max pools on tiles, and the spatial dims each pools over."""
AVG_POOL_DIMS = {aten.avg_pool1d: 1, aten.avg_pool2d: 2, aten.avg_pool3d: 3}
"""Average pools on tiles, and their spatial dims."""
UPSAMPLES = {aten.upsample_nearest1d: ("nearest", 1), aten.upsample_linear1d: ("bilinear", 1),
             aten.upsample_nearest2d: ("nearest", 2), aten.upsample_bilinear2d: ("bilinear", 2),
             aten.upsample_nearest3d: ("nearest", 3),
             aten.upsample_trilinear3d: ("bilinear", 3)}
"""Interpolations on tiles: mode (linear and trilinear are bilinear along each of their one or
three dims) and dims."""


# -- the rules, one entry per op --------------------------------------------------------------
rule(*POINTWISE)(lambda _n: Pointwise())


@rule(aten.cat, refusal="it concatenates along a spatial dim (D, H, W or L): tiles can only be "
                        "concatenated along the batch or channel dims")
def _cat(n: fx.Node) -> Op | None:
    out = _shape(n)
    rank = len(out) if out is not None else 4
    return Pointwise() if arg(n, 1, 0) % rank in (0, 1) else None


_SLICES = ("only slices with step 1 of a spatial dim (crops) or of the batch / channel dims "
           "run on tiles")


@rule(aten.slice, refusal=_SLICES)
def _slice(n: fx.Node) -> Op | None:
    return _crop(n) if _spatial_slice(n) else _channels(n, 1)


@rule(aten.narrow, refusal=_SLICES)
def _narrow(n: fx.Node) -> Op | None:
    return _channels(n, 1)


@rule(aten.split, aten.split_with_sizes, aten.unsafe_split, aten.chunk, aten.tensor_split,
      refusal="only splits of the batch or channel dims run on tiles")
def _split(n: fx.Node) -> Op | None:
    """Channel splits (CSPNet, Res2Net, MixConv, selective kernels): one output per piece,
    each read per pixel through ``getitem``."""
    return _channels(n, 2)


def _channels(n: fx.Node, dim_at: int) -> Op | None:
    """Per pixel when the op's dim (argument ``dim_at``) is the batch or channel dim."""
    x = _shape(n.args[0])
    dim = arg(n, dim_at, 0)
    return Pointwise() if x is not None and len(x) in SPATIAL_RANKS and dim % len(x) in (0, 1) \
        else None


@rule(aten.expand_as)
def _expand_as(n: fx.Node) -> Op | None:
    return Pointwise()  # a broadcast value (ECA's N x C x 1 x 1) to the image


@rule(aten.sum, aten.mean, aten.amax,
      refusal="only reductions over exactly the spatial dims (H and W; D, H and W; or L), or over "
              "the channel dim with keepdim=True, run on tiles")
def _reduce(n: fx.Node) -> Op | None:
    return _reduction(n, REDUCTIONS[n.target.overloadpacket])


@rule(aten.linalg_vector_norm,
      refusal="only vector norms over exactly the spatial dims (H and W, or D, H and W: a "
              "global response norm) of order 1 or more, or over the batch and channel dims, "
              "run on tiles")
def _vector_norm(n: fx.Node) -> Op | None:
    """``x.norm(p, dim=(2, 3))``: over H and W a :class:`Reduce` "norm" (ConvNeXt-V2's and
    MedNeXt's global response norm); over the channels per pixel (opclass.classify)."""
    x, ord = _shape(n.args[0]), arg(n, 1, 2)
    dims = arg(n, 2, None)
    if x is None or len(x) not in SPATIAL_RANKS or dims is None or \
            arg(n, 4, None) is not None or not isinstance(ord, (int, float)) or not ord >= 1:
        return None
    dims = sorted(d % len(x) for d in ([dims] if isinstance(dims, int) else dims))
    if dims != list(range(2, len(x))):
        return None
    return Reduce("norm", bool(arg(n, 3, False)), (1,) * (len(x) - 2), float(ord))


@rule(aten.conv1d, aten.conv2d, aten.conv3d,
      refusal=lambda n: "padding given as a string ('same'): give the padding as numbers"
      if isinstance(arg(n, 4, 0), str) else "fxpar has no tiling rule for this convolution")
def _conv(n: fx.Node) -> Op | None:
    padding = arg(n, 4, 0)
    if isinstance(padding, str):
        return None
    w = _shape(n.args[1])
    assert w is not None
    nd = len(w) - 2
    return Window("conv", tuple(w[2:]), per_dim(arg(n, 3, 1), nd), per_dim(padding, nd),
                  per_dim(arg(n, 5, 1), nd))


@rule(aten.convolution, refusal="only 1-D, 2-D and 3-D convolutions run on tiles")
def _convolution_rule(n: fx.Node) -> Op | None:
    return _convolution(n)


@rule(aten.conv_transpose1d, aten.conv_transpose2d, aten.conv_transpose3d,
      refusal="a transposed convolution whose stride skips output rows no tap reaches is "
              "not tiled")
def _conv_transpose(n: fx.Node) -> Op | None:
    w = _shape(n.args[1])
    assert w is not None
    nd = len(w) - 2
    return _transposed(tuple(w[2:]), per_dim(arg(n, 3, 1), nd), per_dim(arg(n, 4, 0), nd),
                       per_dim(arg(n, 5, 0), nd), per_dim(arg(n, 7, 1), nd))


@rule(*POOL_DIMS)
def _max_pool(n: fx.Node) -> Op | None:
    nd = POOL_DIMS[n.target.overloadpacket]
    k, s = per_dim(arg(n, 1, None), nd), arg(n, 2, None)
    return Window("maxpool", k, per_dim(s, nd) if s else k, per_dim(arg(n, 3, 0), nd),
                  per_dim(arg(n, 4, 1), nd), fill=-math.inf,
                  attrs=(("ceil_mode", bool(arg(n, 5, False))),))


@rule(*AVG_POOL_DIMS)
def _avg_pool(n: fx.Node) -> Op | None:
    """avg_pool1d has no ``divisor_override`` (argument 6): absent, it reads as None."""
    nd = AVG_POOL_DIMS[n.target.overloadpacket]
    k, s = per_dim(arg(n, 1, None), nd), arg(n, 2, None)
    return Window("avgpool", k, per_dim(s, nd) if s else k, per_dim(arg(n, 3, 0), nd),
                  (1,) * nd, attrs=(("ceil_mode", bool(arg(n, 4, False))),
                                    ("count_include_pad", bool(arg(n, 5, True))),
                                    ("divisor_override", arg(n, 6, None))))


@rule(aten.constant_pad_nd, aten.pad, aten.reflection_pad1d, aten.reflection_pad2d,
      aten.reflection_pad3d, aten.replication_pad1d, aten.replication_pad2d,
      aten.replication_pad3d, aten._pad_circular,
      refusal="only padding of the spatial dims (of an image, volume or sequence) runs on tiles "
              "(constant, reflect, replicate or circular); reflect, replicate and circular "
              "padding of the channel or batch dims does not, nor circular padding by a "
              "negative amount")
def _padding(n: fx.Node) -> Op | None:
    return _pad(n)


@rule(aten.roll, refusal="torch.roll without dims rolls the flattened tensor, which mixes "
                         "the channel and spatial dims; give dims (any of N, C and the "
                         "spatial dims) and it runs on tiles")
def _roll(n: fx.Node) -> Op | None:
    x = _shape(n.args[0])
    if x is None or len(x) not in SPATIAL_RANKS:
        return None
    return roll_window(x, arg(n, 1, []), arg(n, 2, []), tuple(range(2, len(x))))


@rule(*UPSAMPLES,
      refusal="only nearest, linear, bilinear and trilinear interpolation of the spatial dims "
              "run on tiles")
def _interpolate(n: fx.Node) -> Op | None:
    return _upsample(n)


@rule(aten.group_norm)
def _group_norm(n: fx.Node) -> Op | None:
    return Norm(int(arg(n, 1, 1)), float(arg(n, 4, 1e-5)), 2, 3)


@rule(aten.instance_norm, refusal="instance norm with running statistics "
                                  "(track_running_stats=True) is not tiled; without them it is")
def _instance_norm(n: fx.Node) -> Op | None:
    x = _shape(n.args[0])
    if x is None or arg(n, 3, None) is not None or not arg(n, 5, True):
        return None  # running statistics: mode-dependent, not handled on tiles
    return Norm(x[1], float(arg(n, 7, 1e-5)), 1, 2)


@rule(aten.adaptive_avg_pool1d, aten.adaptive_avg_pool2d, aten.adaptive_avg_pool3d)
def _adaptive_avg(n: fx.Node) -> Op | None:
    return _adaptive(n)


@rule(aten.adaptive_max_pool1d, aten.adaptive_max_pool2d, aten.adaptive_max_pool3d,
      refusal="adaptive max pooling runs on tiles when only its values are read; here its "
              "indices (return_indices=True) are used too")
def _adaptive_max(n: fx.Node) -> Op | None:
    """Adaptive max pooling to 1 or to bins that overlap and vary in size: from the tiles into
    a replicated output (TileReduce "maxbins": values and indices, one device's, ties
    included). To a size that divides the map it is a max pool with kernel = stride, on tiles
    (fxpar.frontend.rules.chains rewrites it at capture). The op returns (values, indices):
    the graph must read only the values (``getitem`` 0)."""
    x = _shape(n.args[0])
    if x is None or len(x) not in SPATIAL_RANKS or any(
            u.target is not operator.getitem or (u.args[1] != 0 and u.users) for u in n.users):
        return None
    return Reduce("maxbins", True, per_dim(arg(n, 1, None), len(x) - 2))


@rule(aten.pixel_shuffle, aten.pixel_unshuffle,
      refusal="only pixel (un)shuffles of an image (N, C, H, W) run on tiles (of a volume "
              "they would take D for the channels)")
def _pixel_shuffle(n: fx.Node) -> Op | None:
    """pixel_unshuffle(r): output row o reads input rows [r o, r o + r) (kernel = stride =
    r); pixel_shuffle(r): output row o reads input row o // r. Both on the window their index
    map gives (fxpar.passes.halo), whatever rows the input's tiles hold."""
    x = _shape(n.args[0])
    if x is None or len(x) != 4:
        return None
    r = int(arg(n, 1, 1))
    kind = "unshuffle" if n.target.overloadpacket is aten.pixel_unshuffle else "shuffle"
    return Window(kind, (r, r), (r, r), (0, 0))


LAYOUT_OPS = tuple(getattr(aten, name) for name in (
    "view", "reshape", "flatten", "permute", "transpose", "squeeze", "unsqueeze", "linear",
    "matmul", "bmm", "select", "expand", "unfold"))
"""Ops that leave the (N, C, H, W) layout: a token block (fxpar.frontend.rules.tokens) may
start at one."""
refuse(*LAYOUT_OPS,
       refusal=lambda n: f"aten.{n.target.overloadpacket.__name__} leaves the (N, C, H, W) "
                         f"layout; the ops after it run on tiles only as a block whose every "
                         f"op has a token-layout rule (fxpar.frontend.rules.tokens)")




def _spatial_slice(n: fx.Node) -> bool:
    x = _shape(n.args[0])
    return x is not None and len(x) in SPATIAL_RANKS and arg(n, 1, 0) % len(x) >= 2


def _reduction(n: fx.Node, kind: str) -> Op | None:
    """sum / mean / amax over dims: over exactly H and W a :class:`Reduce` (replicated);
    over the channel dim with ``keepdim`` per pixel; anything else is not tiled."""
    x = _shape(n.args[0])
    dims = arg(n, 1, None)
    if x is None or len(x) not in SPATIAL_RANKS or dims is None or \
            n.target in (aten.sum.default, aten.mean.default):
        return None  # a reduction over everything
    dims = sorted(d % len(x) for d in ([dims] if isinstance(dims, int) else dims))
    keepdim = bool(arg(n, 2, False))
    if arg(n, 3, None) is not None:
        return None  # a dtype argument: not handled
    if dims == list(range(2, len(x))):
        return Reduce(kind, keepdim, (1,) * (len(x) - 2))
    return Pointwise() if dims == [1] and keepdim else None


def _convolution(n: fx.Node) -> Op | None:
    w = _shape(n.args[1])
    assert w is not None
    if len(w) not in SPATIAL_RANKS:
        return None
    nd = len(w) - 2
    stride, padding, dilation = (per_dim(arg(n, i, 1 if i != 4 else 0), nd) for i in (3, 4, 5))
    if not arg(n, 6, False):
        return Window("conv", tuple(w[2:]), stride, padding, dilation)
    return _transposed(tuple(w[2:]), stride, padding, per_dim(arg(n, 7, 0), nd), dilation)


def _transposed(k: tuple[int, ...], s: tuple[int, ...], p: tuple[int, ...],
                output_padding: tuple[int, ...], d: tuple[int, ...]) -> Op | None:
    if any(d[i] * (k[i] - 1) < s[i] - 1 for i in range(len(k))):
        return None  # output rows no tap reaches: not handled
    lead = tuple(d[i] * (k[i] - 1) - p[i] for i in range(len(k)))
    if all(v == 1 for v in s) and min(lead) >= 0:
        # stride 1: the convolution with the kernel flipped and in/out channels swapped,
        # padded by d (k - 1) - p in front (output_padding: the zero fill past the end). A
        # tile computes only its own rows, as a convolution does
        # (fxpar.runtime.spatial.haloconv.conv_weight_of_transposed)
        return Window("conv", k, s, lead, d, attrs=(("transposed", True),))
    # output_padding only lengthens the output; its rows read the zero fill past the border
    return Window("convT", k, s, p, d, attrs=(("output_padding", output_padding),))


PAD_MODES = {aten.reflection_pad1d: "reflect", aten.reflection_pad2d: "reflect",
             aten.reflection_pad3d: "reflect", aten.replication_pad1d: "replicate",
             aten.replication_pad2d: "replicate", aten.replication_pad3d: "replicate",
             aten._pad_circular: "circular"}


def _pad(n: fx.Node) -> Op | None:
    """Padding (``F.pad``'s list: last dim first, (before, after) pairs; negative crops)."""
    packet = n.target.overloadpacket
    mode = PAD_MODES.get(packet) or (arg(n, 2, "constant") if packet is aten.pad
                                     else "constant")
    pad = [int(v) for v in arg(n, 1, [])]
    x, out = _shape(n.args[0]), _shape(n)
    if not any(pad):
        return Pointwise()  # padding by nothing (MONAI's UpCat when the sizes already match)
    if x is None or out is None or len(x) not in SPATIAL_RANKS:
        return None
    nd = len(x) - 2
    pairs = [(pad[2 * i], pad[2 * i + 1]) for i in range(len(pad) // 2)]  # last dim first
    spatial = (pairs + [(0, 0)] * nd)[:nd][::-1]  # (before, after) per spatial dim, in order
    if len(pairs) > nd:  # the channel (or batch) dims too: per pixel if no spatial dim is
        plain = mode == "constant" and not any(v for pr in pairs[:nd] for v in pr)
        return Pointwise() if plain else None
    before = tuple(b for b, _ in spatial)
    if mode in PADS:  # an index map per dim (fxpar.runtime.spatial.interp): border tiles pad
        maps = tuple(AxisMap(mode, False, x[2 + i], out[2 + i], None, before[i])
                     for i in range(nd))
        return Window("interp", (1,) * nd, (1,) * nd, (0,) * nd, attrs=(("maps", maps),))
    if mode == "circular":  # output row o reads input row (o - before) mod extent
        if min(pad) < 0:
            return None  # torch crops, then wraps the rows of the crop: another map
        return Window("wrap", (1,) * nd, (1,) * nd, before, attrs=(("pad", tuple(pad)),))
    if mode != "constant":
        return None
    value = arg(n, 3 if packet is aten.pad else 2, 0.0)
    return Window("pad", (1,) * nd, (1,) * nd, before, fill=float(value or 0.0),
                  attrs=(("pad", tuple(pad)),))


def _crop(n: fx.Node) -> Op | None:
    """``x[..., a:b, ...]`` along one spatial dim with step 1 (a U-Net's centre crop of its
    skip connection): output cell o reads input cell ``o + a``, a window op like padding by
    ``-a`` (nothing is ever read past the border)."""
    x, out = _shape(n.args[0]), _shape(n)
    if x is None or out is None or len(x) not in SPATIAL_RANKS:
        return None
    dim = arg(n, 1, 0) % len(x)
    if dim < 2 or arg(n, 4, 1) != 1:
        return None
    start = arg(n, 2, None) or 0
    start = start + x[dim] if start < 0 else min(start, x[dim])
    nd = len(x) - 2
    before = tuple(-start if 2 + i == dim else 0 for i in range(nd))
    return Window("pad", (1,) * nd, (1,) * nd, before, attrs=(("crop", dim),))


def _adaptive(n: fx.Node) -> Op | None:
    """Adaptive average pooling: to 1x1(x1) a global mean; to a size that divides the input an
    average pool with kernel = stride = input / output (the same bins, tiled); else its bins
    overlap and vary in size: summed from the tiles into a replicated output."""
    x = _shape(n.args[0])
    if x is None or len(x) not in SPATIAL_RANKS:
        return None
    nd = len(x) - 2
    out = per_dim(arg(n, 1, None), nd)
    if out == (1,) * nd:
        return Reduce("mean", True, out)
    if any(e % o for e, o in zip(x[2:], out, strict=True)):
        return Reduce("bins", True, out)  # overlapping bins of varying size: replicated
    k = tuple(e // o for e, o in zip(x[2:], out, strict=True))
    return Window("avgpool", k, k, (0,) * nd, (1,) * nd,
                  attrs=(("ceil_mode", False), ("count_include_pad", True),
                         ("divisor_override", None)))


def _upsample(n: fx.Node) -> Op | None:
    x, out = _shape(n.args[0]), _shape(n)
    mode, nd = UPSAMPLES[n.target.overloadpacket]
    if x is None or out is None or len(x) != nd + 2:
        return None
    linear = mode == "bilinear"
    corners = bool(arg(n, 2, False)) if linear else False
    first = 3 if linear else 2
    if n.target._overloadname == "vec":
        scales = arg(n, first, None)
        scales = list(scales) if scales is not None else [None] * nd
    else:  # .default: separate scales per dim
        scales = [arg(n, first + i, None) for i in range(nd)]
    maps = tuple(AxisMap(mode, corners, x[2 + i], out[2 + i], None if f is None else float(f))
                 for i, f in enumerate(scales))
    return Window("interp", (1,) * nd, (1,) * nd, (0,) * nd, attrs=(("maps", maps),))
