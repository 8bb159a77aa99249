"""Augmentation chains for windowed training: parse ``--augment``, draw one sample's
augmentation, and compute any window of the augmented sample exactly as the whole would be.

DESIGN.md, "The data edge": every rank of a spatial group draws the same region and
augmentation from a shared seed (fxpar.data.sampling.rng) and reads its window of the
*augmented global image*. The chain is a list of transforms (:data:`TRANSFORMS`, one entry
each); geometric ones (fxpar.data.geometric) compose into one map from the window's cells to
source coordinates, applied last to first; intensity ones (fxpar.data.intensity) then act on the
window's cells, first to last, whatever their place in the list (they are per cell; noise is
keyed by the cell's position in the augmented sample). Augmenting each window on its own would
flip (or add noise to) the halves of one image independently: nothing here knows the window
until :func:`render`, and every draw happens before.

    chain = parse_augment("flip,rot90,affine:degrees=30,intensity,hed")
    aug = chain.draw(rng(seed, epoch, step, replica, k, "augment"), out=(512, 512))
    origin = sampler.origin(rng(..., "region"), slide, image.size, aug.region)
    x = render(image.read, image.size, origin, aug, window, channels=3)  # (3, *window.shape)

A chain of only discrete transforms (flips, quarter turns, transposes, whole-cell offsets)
moves cells and never resamples; with an affine or elastic step images are sampled linearly,
labels by nearest neighbour (``labels=True``: no intensity step).
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from fxpar.core.geometry import Rect
from fxpar.data.errors import DataError
from fxpar.data.geometric import (
    Affine,
    Elastic,
    Flip,
    Offset,
    Rot90,
    Transpose,
    grid_of,
    needed,
    sample,
)
from fxpar.data.intensity import Colour, Hed, Intensity, Noise
from fxpar.data.sampling import SAMPLERS

Extent = tuple[int, ...]


@dataclass(frozen=True)
class Rule:
    """One ``--augment`` name: the transform's class and whether it moves cells."""

    make: type
    geometric: bool
    doc: str


TRANSFORMS: dict[str, Rule] = {
    "flip": Rule(Flip, True, "mirror each axis (p=0.5)"),
    "rot90": Rule(Rot90, True, "k quarter turns in a random axis plane"),
    "transpose": Rule(Transpose, True, "swap a random axis pair (p=0.5)"),
    "offset": Rule(Offset, True, "shift the region by up to pixels=8 cells"),
    "affine": Rule(Affine, True, "rotate (degrees=15), zoom (zoom=0.1), translate (shift=4)"),
    "elastic": Rule(Elastic, True, "smooth random displacement (sigma=4, spacing=32)"),
    "intensity": Rule(Intensity, False, "scale (scale=0.1), shift (shift=0.1), gamma "
                                         "(gamma=0.3)"),
    "noise": Rule(Noise, False, "Gaussian noise keyed by global position (sigma=0.05)"),
    "colour": Rule(Colour, False, "brightness, contrast, saturation, hue (RGB)"),
    "hed": Rule(Hed, False, "HED stain jitter (sigma=0.05, bias=0.05; RGB)"),
}
"""``--augment`` names (adding a transform is adding an entry)."""


@dataclass(frozen=True)
class Augmentation:
    """One sample's drawn augmentation: the geometric steps with their parameters and their
    output / input sizes (last step first), then the intensity steps in order."""

    out: Extent
    geometric: tuple[tuple[Any, Any, Extent, Extent], ...]
    """(transform, params, output size, input size), from the sample back to the region."""
    intensity: tuple[tuple[Any, Any], ...]

    @property
    def region(self) -> Extent:
        """The size of the source region the chain starts from (rot90 / transpose on a
        non-square sample transpose it)."""
        return self.geometric[-1][3] if self.geometric else self.out

    @property
    def discrete(self) -> bool:
        """True when cells only move (no resampling)."""
        return all(t.discrete for t, *_ in self.geometric)

    def coords(self, window: Rect) -> torch.Tensor:
        """Region coordinates (float64, (*window.shape, ndim)) of the cells of ``window`` of
        the augmented sample."""
        if window.ndim != len(self.out):
            raise ValueError(f"a {window.ndim}-D window ({window}) of a "
                             f"{len(self.out)}-D sample of {'x'.join(map(str, self.out))}")
        p = grid_of(window)
        for t, params, out, inn in self.geometric:
            p = t.back(params, p, out, inn)
        return p


@dataclass(frozen=True)
class Chain:
    """A parsed ``--augment`` spec: transforms in the order given."""

    transforms: tuple[Any, ...] = ()
    spec: str = ""

    def draw(self, g: np.random.Generator, out: Extent) -> Augmentation:
        """One sample's parameters: geometric steps drawn from the last back (each needs its
        output's size), then intensity steps in order; all from ``g``."""
        out = tuple(int(n) for n in out)
        geo = [t for t in self.transforms if _is_geometric(t)]
        steps, ext = [], out
        for t in reversed(geo):
            params = t.draw(g, ext)
            inn = tuple(t.extent_in(params, ext))
            steps.append((t, params, ext, inn))
            ext = inn
        inten = tuple((t, t.draw(g, out)) for t in self.transforms if not _is_geometric(t))
        return Augmentation(out, tuple(steps), inten)

    def __str__(self) -> str:
        return self.spec or "none"


def _is_geometric(t: Any) -> bool:
    return any(isinstance(t, r.make) and r.geometric for r in TRANSFORMS.values())


def _value(field: dataclasses.Field, text: str, where: str) -> Any:
    kind = {"float": float, "int": int}.get(str(field.type), float)
    try:
        return kind(text)
    except ValueError:
        raise DataError(f"--augment {where}: {field.name}={text!r} is not a "
                        f"{kind.__name__}") from None


def parse_augment(spec: str) -> Chain:
    """``"flip,rot90,affine:degrees=30:zoom=0.2,intensity,hed"`` as a :class:`Chain` (empty
    or ``"none"``: no augmentation). Raises DataError naming the valid transforms / options."""
    items = [s.strip() for s in spec.split(",") if s.strip()]
    if items in ([], ["none"]):
        return Chain((), "")
    made = []
    for item in items:
        name, *opts = item.split(":")
        rule = TRANSFORMS.get(name.strip().lower())
        if rule is None:
            raise DataError(f"--augment {spec}: unknown transform {name!r}; give a "
                            f"comma-separated list of " + ", ".join(
                                f"{n} ({r.doc})" for n, r in TRANSFORMS.items()))
        fields = {f.name: f for f in dataclasses.fields(rule.make)}
        kw = {}
        for opt in opts:
            key, _, text = opt.partition("=")
            if key not in fields or not text:
                raise DataError(f"--augment {item}: option {opt!r}; {name} takes "
                                + (", ".join(f"{k}=<number>" for k in fields) or "no options"))
            kw[key] = _value(fields[key], text, item)
        made.append(rule.make(**kw))
    return Chain(tuple(made), ",".join(items))


Reader = Callable[[Rect], Any]
"""``read(box)``: the source's cells in ``box`` (inside the image) as (C, *box.shape)."""


def _tensor(a: Any, labels: bool) -> torch.Tensor:
    if isinstance(a, torch.Tensor):
        return a.to(torch.int64 if labels else torch.float64)
    a = np.asarray(a)
    if labels:
        return torch.from_numpy(a.astype(np.int64))
    t = torch.from_numpy(np.ascontiguousarray(a))
    if a.dtype.kind in "iu":  # as fxpar.data.images.to_tensor: integers scaled to [0, 1]
        return t.to(torch.float64) / float(np.iinfo(a.dtype).max)
    return t.to(torch.float64)


def render(read: Reader, image: Extent, origin: tuple[int, ...], aug: Augmentation,
           window: Rect, *, channels: int, labels: bool = False, fill: float = 0.0
           ) -> torch.Tensor:
    """``window`` of the augmented sample whose region starts at ``origin`` of an image of
    size ``image``: (C, *window.shape), float64 (images) or int64 (``labels``: nearest, no
    intensity steps). Reads one box of the source: what the window's cells map to, plus the
    interpolation's halo, inside the image; ``fill`` past the image."""
    p = aug.coords(window)
    s = p + torch.tensor(origin, dtype=torch.float64)
    order = "nearest" if labels or aug.discrete else "linear"
    box = needed(s, tuple(image), order)
    dtype = torch.int64 if labels else torch.float64
    if box is None:
        x = torch.full((channels, *window.shape), fill, dtype=dtype)
    else:
        x = sample(_tensor(read(box), labels), box, s, tuple(image), order, fill)
    if not labels:
        for t, params in aug.intensity:
            x = t.apply(params, x, window, aug.out)
    return x


# -- command line -------------------------------------------------------------------------------
def add_data_arguments(parser: argparse.ArgumentParser) -> None:
    """The sampling and augmentation flags, for fxpar.cli to add (``--sampler``,
    ``--augment``, ``--pos-neg``, ``--prefetch``, ``--data-workers``); read them back with
    :func:`data_options`."""
    g = parser.add_argument_group("region sampling and augmentation (fxpar.data.augment)")
    g.add_argument("--sampler", default="uniform", choices=sorted(SAMPLERS),
                   help="where regions are drawn: " + "; ".join(
                       f"{n}: {r.doc}" for n, r in SAMPLERS.items()))
    g.add_argument("--augment", default="none", metavar="SPEC",
                   help="comma-separated transforms, each name[:option=value...], applied to "
                        "the whole augmented region and read by window: "
                        + "; ".join(f"{n}: {r.doc}" for n, r in TRANSFORMS.items()))
    g.add_argument("--pos-neg", default="1:1", metavar="POS:NEG",
                   help="--sampler balanced: positive to negative centres (default 1:1)")
    g.add_argument("--prefetch", type=int, default=2, metavar="N",
                   help="steps loaded ahead in background threads (0: load in the step)")
    g.add_argument("--data-workers", type=int, default=1, metavar="N",
                   help="loader threads (readers must be thread-safe for more than 1)")


@dataclass(frozen=True)
class DataOptions:
    """What :func:`add_data_arguments`'s flags asked for, checked."""

    sampler: str = "uniform"
    """A name of fxpar.data.sampling.SAMPLERS."""
    chain: Chain = Chain()
    """The parsed ``--augment``."""
    pos: float = 1.0
    """--sampler balanced: the weight of positive centres."""
    neg: float = 1.0
    """--sampler balanced: the weight of negative centres."""
    prefetch: int = 2
    """Steps loaded ahead (0: none)."""
    workers: int = 1
    """Loader threads."""


def data_options(args: argparse.Namespace) -> DataOptions:
    """The flags of :func:`add_data_arguments` as :class:`DataOptions`. Raises DataError."""
    from fxpar.data.sampling import parse_ratio

    pos, neg = parse_ratio(args.pos_neg)
    if args.prefetch < 0 or args.data_workers < 1:
        raise DataError(f"--prefetch {args.prefetch} --data-workers {args.data_workers}: give "
                        f"--prefetch >= 0 and --data-workers >= 1")
    return DataOptions(args.sampler, parse_augment(args.augment), pos, neg, args.prefetch,
                       args.data_workers)
