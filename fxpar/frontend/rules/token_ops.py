"""Token-layout rules for ops beyond views, reductions and attention (fxpar.frontend.rules.
tokens' :data:`RULES` holds them): padding of nothing, torch.roll over split dims (Swin's
shifted windows), Tensor.unfold (HaloNet's overlapping windows), expand_as, group norm over
split dims, 1x1 convolutions per position, and fresh values made from a tiled one."""

from __future__ import annotations

import torch
from torch import fx

from fxpar.frontend.rules.aten_ops import arg
from fxpar.frontend.rules.dims import NoRule
from fxpar.frontend.rules.layouts import (
    State,
    TokenLayout,
    dim_of,
    first_tiled,
    image_factor,
    shape,
    tiled,
)

aten = torch.ops.aten


def pad(n: fx.Node, st: State) -> TokenLayout:
    """Constant padding of dims that hold no image factor, or of nothing (Swin pads its map
    to whole windows, by nothing when it holds whole windows already)."""
    lay = first_tiled(n, st)
    packet = n.target.overloadpacket
    if packet is aten.pad and arg(n, 2, "constant") != "constant":
        raise NoRule("reflect, replicate or circular padding in a token layout")
    pads = [int(v) for v in arg(n, 1, [])]
    out = list(lay)
    for i in range(len(pads) // 2):
        d = len(lay) - 1 - i
        if not (pads[2 * i] or pads[2 * i + 1]):
            continue
        if st.split(lay[d]):
            raise NoRule("it pads a dim of the image that is split over the tiles (positions "
                         "inside windows wider than a tile?): choose an image size or a number "
                         "of parts whose tiles hold whole windows")
        if any(image_factor(f) for f in lay[d]):
            raise NoRule("it pads a dim of the image in a token layout")
        out[d] = ()  # positions inside windows (HaloNet's relative logits): held whole
    return TokenLayout(tuple(out))


def unfold(n: fx.Node, st: State) -> TokenLayout:
    """Tensor.unfold(dim, size, step): windows of ``size`` cells every ``step`` cells along
    ``dim``, the position inside a window a new last dim every tile holds whole (HaloNet's
    overlapping key windows: ``F.pad``, then ``unfold(2, win, block).unfold(3, win, block)``).
    Along a dim that holds one image axis the window index takes the axis, at the windows'
    count; when that axis is split each tile makes its own windows (``"unfold"``): a halo
    brings the cells they reach past its edge, as for a convolution (fxpar.passes.
    tile_tokens). Every tile must hold a window."""
    lay = first_tiled(n, st)
    d = dim_of(n, 1, 0, len(lay))
    size, step = int(arg(n, 2, 1)), int(arg(n, 3, 1))
    count = shape(n)[d]
    if len(lay[d]) != 1 or not image_factor(lay[d][0]):
        if st.split(lay[d]):
            raise NoRule("it unfolds a dim that holds more than one image axis")
        return TokenLayout((*lay[:d], (), *lay[d + 1:], ()))
    (axis, extent), = lay[d]
    out = (*lay[:d], ((axis, count),), *lay[d + 1:], ())
    if not st.split(lay[d]):
        return TokenLayout(out)
    if count < st.parts[axis]:
        raise NoRule(f"{count} window(s) of {size} cells every {step} along a dim of {extent} "
                     f"leave some of its {st.parts[axis]} tiles without one: choose an image "
                     f"size or a number of parts whose tiles hold whole windows")
    held = sorted(a[0][0] for a in lay if any(image_factor(f) for f in a))
    if held != list(range(len(st.parts))) or \
            any(len(a) != 1 for a in lay if any(image_factor(f) for f in a)):
        raise NoRule("an unfold of a split dim of a tensor that is not the image in some dim "
                     "order (each image axis alone in a dim)")
    return TokenLayout(out, "unfold")


def roll_args(n: fx.Node) -> tuple[list[int], list[int]]:
    """(shifts, dims) of ``aten.roll`` node ``n``, each a list."""
    shifts, dims = arg(n, 1, []), arg(n, 2, [])
    return ([shifts] if isinstance(shifts, int) else list(shifts),
            [dims] if isinstance(dims, int) else list(dims))


def roll(n: fx.Node, st: State) -> TokenLayout:
    """torch.roll: along dims that are not split, on the tile; along split dims (Swin's
    shifted windows on (N, H, W, C)) a wrapped exchange, for a tensor that is an image in
    another dim order (each grid axis alone in a dim, two other dims)."""
    lay = first_tiled(n, st)
    shifts, dims = roll_args(n)
    if not dims:
        raise NoRule("a roll of the flattened tensor")
    split = tuple((int(d) % len(lay), int(sh)) for sh, d in zip(shifts, dims, strict=True)
                  if st.split(lay[int(d) % len(lay)]))
    if not split:
        return TokenLayout(lay)
    held = sorted(a[0][0] for a in lay if a and len(a) == 1 and a[0][0] >= 0)
    if len(lay) != len(st.parts) + 2 or held != list(range(len(st.parts))) or \
            sum(1 for a in lay if a) != len(st.parts):
        raise NoRule("a roll over split dims of a tensor that is not the image in some dim "
                     "order")
    return TokenLayout(lay, "roll", roll=split)


def expand_as(n: fx.Node, st: State) -> TokenLayout:
    """x.expand_as(other): a whole value of size 1 along the split dims spread to a tile's
    sizes (F.normalize's norms), or a tiled value to the shape of one tiled alike."""
    x, other = n.args[0], n.args[1]
    lx, lo = st.layout(x), st.layout(other)
    if not tiled(lo):
        raise NoRule("expand_as to the shape of a whole value")
    sx, out = shape(x), shape(n)
    off = len(out) - len(sx)
    for i, size in enumerate(sx):
        if st.split(lo[off + i]) and size != 1 and (not tiled(lx) or lx[i] != lo[off + i]):
            raise NoRule("expand_as of a value that is not tiled like its target")
    return TokenLayout(lo)


def group_norm(n: fx.Node, st: State) -> TokenLayout:
    """group_norm over (C, *rest) of a value whose batch and channel dims are not split: with a
    split dim among the rest, statistics over all tiles (``groupnorm``, MobileViT-v2's
    GroupNorm(1) over its patches)."""
    lay = first_tiled(n, st)
    if st.split(lay[0]) or st.split(lay[1]):
        raise NoRule("group norm of a value split along its batch or channel dim")
    return TokenLayout(lay, "groupnorm" if any(st.split(a) for a in lay[2:]) else "")


def conv_1x1(n: fx.Node, st: State) -> TokenLayout:
    """A 1x1 convolution (stride 1, no padding) acts on the channels of each position alone:
    per token in any layout of the dims after the channels (MobileViT's projections of its
    unfolded patches)."""
    lay = first_tiled(n, st)
    w = shape(n.args[1])
    stride, padding, dilation = (arg(n, i, d) for i, d in ((3, 1), (4, 0), (5, 1)))
    ones = all(v == 1 for v in w[2:])
    plain = all(v in (1, [1], (1,)) or isinstance(v, (list, tuple)) and set(v) == {1}
                for v in (stride, dilation)) and \
        all(v in (0, [0], (0,)) or isinstance(v, (list, tuple)) and set(v) == {0}
            for v in (padding,))
    if not (ones and plain) or st.split(lay[0]) or st.split(lay[1]):
        raise NoRule("a convolution wider than 1x1 in a token layout")
    if any(tiled(st.layout(a)) for a in n.all_input_nodes[1:]):
        raise NoRule("its weights are tiled")
    return TokenLayout(lay)


def replicated_factory(n: fx.Node, st: State) -> TokenLayout:
    """new_empty / new_zeros / new_ones / new_full of a tiled tensor: a fresh value of the
    given sizes, the same on every rank when no size is the image's (drop path's mask)."""
    return TokenLayout(None)
