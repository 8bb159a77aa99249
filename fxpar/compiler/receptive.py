"""How far a model's output reaches into its input: what region-by-region inference needs.

``fxpar-predict`` runs a model over an image larger than memory one *crop* at a time and keeps
each crop's middle (its *region*). The kept output is exactly the whole-image output when

1. every op between the input and the output is local -- pointwise or windowed (convolution,
   pooling, transposed convolution, interpolation, padding; BatchNorm and dropout in eval mode
   are pointwise): a global mean, a GroupNorm / InstanceNorm over the whole image or a
   flatten make each output cell depend on every input cell, and no crop can reproduce that;
   circular padding and torch.roll over H / W (window kinds that wrap) read the opposite
   border: no finite box around an output cell holds what it reads;
2. the crop holds every input cell the region's outputs read, through every layer (the
   *margins*: :func:`reach` walks the graph backwards from an output box with each windowed
   op's own index map, the same arithmetic as the halo pass), except where the crop meets the
   image border, where the crop's padding *is* the image's padding;
3. every crop starts at a multiple of the model's *step*: the least common multiple of the
   cumulative strides (a stride-2 convolution after a stride-2 pooling: 4), so each layer's
   sampling grid inside the crop is the whole image's, shifted by whole cells.

Then the crop's values near its cut edges are wrong (they see zero padding where the image
has pixels), but never the cells the region needs: exactness without seams, which is what the
float64 tests check against one process on the whole image. This is the overlap-tile strategy
of the U-Net paper, with the overlap derived from the graph instead of guessed; MONAI's
``sliding_window_inference`` instead blends overlapping windows and is not exact.

Before (a model)::

    conv(3x3, pad 1) -> maxpool(2) -> conv(3x3, pad 1) -> upsample(2, nearest) -> conv(1x1)

after (:func:`reach` at 64 x 64)::

    Reach(step=(2, 2), scale=(1, 1), before=(3, 3), after=(3, 3))   # output rows [a, b)
    read input rows [a - 3, b + 3) (a even)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction

from torch import fx, nn

from fxpar.core import meta
from fxpar.core.geometry import Interval, Rect
from fxpar.core.meta import TensorInfo
from fxpar.frontend.capture import where
from fxpar.frontend.rules.islands import find_islands
from fxpar.frontend.rules.opclass import BatchNorm, Norm, Pointwise, Reduce, Window, classify
from fxpar.frontend.rules.opkind import SPATIAL_RANKS
from fxpar.frontend.trace import trace
from fxpar.passes.split_stages import model_output


class ReachError(ValueError):
    """The model cannot be run region by region exactly; the message names the op."""


class TooSmall(ReachError):
    """The image analysed is narrower than the model's margins: analyse a larger one."""


@dataclass(frozen=True)
class Reach:
    """What region-by-region inference of one model needs (per spatial dim)."""

    image: tuple[int, ...]
    """The input's spatial size this was analysed at."""
    out: tuple[int, ...]
    """The output's spatial size at that input size."""
    step: tuple[int, ...]
    """Crops start at multiples of this (input cells): the model's cumulative stride."""
    scale: tuple[Fraction, ...]
    """Output cells per input cell (1 for a segmentation map, 1/32 for a class map)."""
    before: tuple[int, ...]
    """Input cells an output box reads before its own span (the margin, leading side)."""
    after: tuple[int, ...]
    """Input cells it reads after its span (trailing side)."""

    @property
    def out_step(self) -> tuple[int, ...]:
        """:attr:`step` in output cells (how output regions align)."""
        return tuple(max(1, int(s * c)) for s, c in zip(self.step, self.scale, strict=True))


def _extent(n: fx.Node) -> tuple[int, ...] | None:
    info = meta.find(n, TensorInfo)
    if info is None or not info.shapes or any(len(s) not in SPATIAL_RANKS for s in info.shapes):
        return None
    extents = {tuple(s[2:]) for s in info.shapes}
    return extents.pop() if len(extents) == 1 else None


def _model_io(gm: fx.GraphModule) -> tuple[fx.Node, fx.Node]:
    x = next((n for n in gm.graph.nodes if n.op == "placeholder"), None)
    out = next((n for n in gm.graph.nodes if n.target is model_output), None)
    if out is None:
        ret = next(n for n in gm.graph.nodes if n.op == "output")
        first = ret.args[0]
        out = first[0] if isinstance(first, (tuple, list)) else first
    elif isinstance(out.args[0], (tuple, list)):
        out = out.args[0][0]
    else:
        out = out.args[0]
    if x is None or _extent(x) is None:
        raise ReachError("the model's input is not an image batch (N, C, H, W), a volume "
                         "batch (N, C, D, H, W) or a sequence batch (N, C, L): nothing to split "
                         "into regions")
    if not isinstance(out, fx.Node) or _extent(out) is None:
        shape = meta.find(out, TensorInfo) if isinstance(out, fx.Node) else None
        got = f" of shape {tuple(shape.shape)}" if shape is not None and shape.shapes else ""
        raise ReachError(f"the model's output{got} has no spatial dims (a classifier?): "
                         f"region-by-region inference writes maps, so the model must end in "
                         f"a map (N, K, H', W'); predict a classifier's patches with fxpar-run "
                         f"--val-data, or cut off its pooling head")
    return x, out


def _where(n: fx.Node) -> str:
    w = where(n)
    return f" ({w})" if w else ""


def _not_local(gm: fx.GraphModule, n: fx.Node, op: object) -> ReachError:
    what = n.target.__name__ if hasattr(n.target, "__name__") else str(n.target)
    if isinstance(op, Norm):
        why = ("normalises each sample over the whole image (per-sample statistics), so no "
               "crop can compute it; use BatchNorm (eval mode uses running statistics) or run "
               "the whole image as one region (--region at least the image size)")
    elif isinstance(op, Reduce):
        why = ("reduces over the whole image (a global mean or adaptive pooling: "
               "squeeze-excite, attention gates), so every output cell depends on every input "
               "cell; run the whole image as one region (--region at least the image size)")
    else:
        why = ("is not a pointwise or windowed op fxpar knows, so fxpar cannot tell which "
               "input cells it reads (it never guesses)")
    return ReachError(f"{what}{_where(n)} {why}")


def _merge(needs: dict[fx.Node, Rect], n: fx.Node, r: Rect) -> None:
    old = needs.get(n)
    needs[n] = r if old is None else Rect(*((min(a0, b0), max(a1, b1)) for (a0, a1), (b0, b1)
                                            in zip(old.dims, r.dims, strict=True)))


def x_of(n: fx.Node, islands: dict[fx.Node, str]) -> fx.Node:
    """The NCHW tensor an island member's block started from (an entry's first input)."""
    seen = n
    while islands.get(seen) != "entry":
        seen = next(a for a in seen.all_input_nodes if a in islands)
    first = seen.args[0]
    if isinstance(first, (list, tuple)):  # torch.stack of same-shape maps
        first = first[0]
    assert isinstance(first, fx.Node)
    return first


def needs(gm: fx.GraphModule, box: Rect) -> Rect:
    """The input box (global, unclipped: cells outside the image are padding) that output box
    ``box`` reads, through every op of the analysed graph ``gm``. Raises ReachError for an op
    that is not local."""
    x, out = _model_io(gm)
    need: dict[fx.Node, Rect] = {out: box}
    islands = find_islands(gm, box.ndim)
    for n in reversed(list(gm.graph.nodes)):
        r = need.get(n)
        if r is None or n.op in ("placeholder", "get_attr"):
            continue
        op = classify(gm, n)
        if n in islands:  # a per-pixel block in another layout: the same box all through
            for a in n.all_input_nodes:
                if a in islands or _extent(a) == _extent(x_of(n, islands)):
                    _merge(need, a, r)
                elif a.op != "get_attr":
                    raise _not_local(gm, n, None)
        elif isinstance(op, Window) and op.rule.wraps:
            raise ReachError(f"{n.target}{_where(n)} reads rows wrapped around from the "
                             f"opposite border (circular padding, torch.roll): cells at one "
                             f"border depend on cells at the other, so a crop has no finite "
                             f"box of input cells that reproduces it; run the whole image as "
                             f"one region (--region at least the image size)")
        elif isinstance(op, Window):
            src = n.args[0]
            assert isinstance(src, fx.Node)
            want = Rect(*(op.needs(iv, i) for i, iv in enumerate(r.dims)))
            if op.rule.clamped:  # border rows repeat (clamp, reflect): no fill past it
                ext = _extent(src)
                assert ext is not None
                want = want.intersect(Rect.whole(ext)) or want
            _merge(need, src, want)
        elif isinstance(op, (Pointwise, BatchNorm)):  # BatchNorm: eval mode, per pixel
            ext = _extent(n)
            for a in n.all_input_nodes:
                if a.op == "get_attr" or (e := _extent(a)) is None:
                    continue
                if e == ext:
                    _merge(need, a, r)
                elif len(e) == len(ext) and all(d == 1 or d == o
                                                for d, o in zip(e, ext, strict=True)):
                    _merge(need, a, Rect(*((0, 1) if d == 1 else iv
                                           for d, iv in zip(e, r.dims, strict=True))))
                else:
                    raise _not_local(gm, n, None)
        elif any(_extent(a) is not None for a in n.all_input_nodes):
            raise _not_local(gm, n, op)
    if x not in need:
        raise ReachError("the model's output does not depend on its input image through "
                         "pointwise and windowed ops fxpar can follow")
    return need[x]


def strides(gm: fx.GraphModule) -> dict[fx.Node, tuple[Fraction, ...]]:
    """Each spatial node's cumulative stride per dim: input cells per cell of the node."""
    x, _ = _model_io(gm)
    ext = _extent(x)
    assert ext is not None
    out: dict[fx.Node, tuple[Fraction, ...]] = {x: (Fraction(1),) * len(ext)}
    for n in gm.graph.nodes:
        if n in out or _extent(n) is None:
            continue
        op = classify(gm, n)
        ins = [a for a in n.all_input_nodes if a in out]
        if not ins:
            continue
        base = out[ins[0]]
        out[n] = tuple(b * op.scale(i) for i, b in enumerate(base)) \
            if isinstance(op, Window) else base
    return out


def interp_ratios(gm: fx.GraphModule) -> list[tuple[str, tuple[Fraction, ...], bool]]:
    """(name, source cells per output cell per dim, align_corners) of every interpolation, in
    graph order: a crop reproduces the whole image's interpolation only with the same ratios and
    without align_corners (whose ratio (in - 1) / (out - 1) depends on the size)."""
    found = []
    for n in gm.graph.nodes:
        op = classify(gm, n) if n.op == "call_function" else None
        if isinstance(op, Window) and op.kind == "interp":
            maps = [m for m in op.attr("maps") if m.mode not in ("reflect", "replicate")]
            if maps:
                found.append((n.name, tuple(Fraction(m.size_in, m.size_out) for m in maps),
                              any(m.align_corners for m in maps)))
    return found


def check_same_interpolation(whole: fx.GraphModule, crop: fx.GraphModule) -> None:
    """Raise ReachError when the crop's interpolations sample differently from the whole
    image's (``size=`` computed from a size that does not scale, or align_corners=True)."""
    for (name, a, corners), (_, b, _) in zip(interp_ratios(whole), interp_ratios(crop),
                                             strict=False):
        n = next(m for m in whole.graph.nodes if m.name == name)
        if corners:
            raise ReachError(f"interpolation with align_corners=True{_where(n)} samples at "
                             f"(in - 1) / (out - 1), which depends on the image size: a crop "
                             f"cannot reproduce it; use align_corners=False or one region")
        if a != b:
            raise ReachError(f"interpolation{_where(n)} samples {float(a[-1]):g} input cells "
                             f"per output cell on the whole image but {float(b[-1]):g} on a "
                             f"crop: its output size does not scale with the input; interpolate "
                             f"with scale_factor, or use one region")


def reach(gm: fx.GraphModule) -> Reach:
    """The step, scale and margins of the analysed graph ``gm`` (see the module doc). The
    margins are measured on output boxes in the middle of the image, at two aligned positions,
    and the larger taken; the image should be a few margins wide (ReachError otherwise)."""
    x, out = _model_io(gm)
    image, o_ext = _extent(x), _extent(out)
    assert image is not None and o_ext is not None
    st = strides(gm)
    step = tuple(math.lcm(*(s[i].numerator for s in st.values())) for i in range(len(image)))
    scale = tuple(1 / st[out][i] for i in range(len(image))) if out in st else \
        tuple(Fraction(o, i) for o, i in zip(o_ext, image, strict=True))
    o_step = tuple(max(1, int(s * c)) for s, c in zip(step, scale, strict=True))
    before, after = [0] * len(image), [0] * len(image)
    for frac in (Fraction(1, 3), Fraction(1, 2)):
        dims: list[Interval] = []
        for e, k in zip(o_ext, o_step, strict=True):
            a = int(e * frac) // k * k
            dims.append((a, min(e, a + k)))
        box = Rect(*dims)
        got = needs(gm, box)
        for i, ((o0, o1), (i0, i1)) in enumerate(zip(box.dims, got.dims, strict=True)):
            before[i] = max(before[i], math.ceil(o0 / scale[i]) - i0)
            after[i] = max(after[i], i1 - math.ceil(o1 / scale[i]))
    for i, e in enumerate(image):
        if before[i] + after[i] + step[i] > e:
            raise TooSmall(f"the model reads {before[i]} + {after[i]} cells around each "
                             f"output cell along dim {i} but was analysed on {e}: analyse it on "
                             f"a larger image")
    return Reach(tuple(image), tuple(o_ext), step, scale, tuple(before), tuple(after))


def output_extent(gm: fx.GraphModule) -> tuple[int, ...]:
    """The spatial size of the model's output in the analysed graph ``gm``."""
    _, out = _model_io(gm)
    ext = _extent(out)
    assert ext is not None
    return ext


def output_channels(gm: fx.GraphModule) -> int:
    """The channels (classes) of the model's output map in the analysed graph ``gm``."""
    _, out = _model_io(gm)
    return int(meta.get(out, TensorInfo).shape[1])


def reach_model(model: nn.Module, channels: int, size: tuple[int, ...],
                whole: fx.GraphModule | None = None) -> Reach:
    """:func:`reach` of ``model`` for images of ``size``: analysed on ``whole`` (the graph at
    that size) when the image is wide enough, else on a larger probe (1024 cells per dim,
    doubled up to 16384), since the margins do not depend on the image."""
    if whole is not None:
        try:
            return reach(whole)
        except TooSmall:
            pass
    probe = 1024
    while True:
        dims = tuple(max(e, probe) for e in size)
        try:
            return reach(trace(model, (1, channels, *dims)))
        except TooSmall:
            if probe >= 16384:
                raise
            probe *= 2
