"""Where the regions of a training step come from: random region samplers over images and
volumes, seeded per (seed, epoch, step, replica, sample), never by global RNG state.

Every rank of a spatial group must cut the *same* region of the same slide (and apply the same
augmentation, fxpar.data.augment): each draws it from its own generator seeded by the same key,
so no message is needed. Data-parallel replicas draw different regions: replica ``d`` of ``D``
uses ``replica=d`` in the key. The global batch of N samples is cut into D contiguous parts
(``Plan.chunks``): sample ``k`` belongs to replica ``k // (N // D)``, as index ``j = k % (N // D)``
within it, and draws from :func:`rng` ``(seed, epoch, step, d, j, purpose)`` (numpy's
SeedSequence mixes the tuple; a ``purpose`` keeps the region and the augmentation streams
apart), so a sample's region and augmentation depend on nothing else (not on D, nor on which
rank asks).

Samplers (``origin(rng, slide, image, region)``: the region's first cell, inside the image):

- :class:`Uniform`: every position equally likely;
- :class:`Foreground`: the region's centre falls in a cell of a (low-resolution) tissue mask,
  chosen with probability proportional to the mask's value, then uniformly inside that cell
  (a mask of the slide's size is a per-pixel weight);
- :class:`Balanced`: MONAI's ``RandCropByPosNegLabel``: with probability ``pos / (pos + neg)``
  the centre is a positive cell of a label map (label > 0), else a negative one; the centre
  is then moved as little as needed to keep the region inside the image (as MONAI does).

Slides are visited in a new order every epoch (a permutation seeded by (seed, epoch)).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from fxpar.data.errors import DataError

STREAMS = {"slide": 0, "region": 1, "augment": 2}
"""The purposes a sample draws for, each its own generator (adding one changes no other)."""


def rng(seed: int, epoch: int, step: int, replica: int, sample: int,
        purpose: str = "region") -> np.random.Generator:
    """The generator of one sample's ``purpose`` (see :data:`STREAMS`): the same on every rank
    that asks with the same key."""
    key = [int(seed), int(epoch), int(step), int(replica), int(sample), STREAMS[purpose]]
    if any(v < 0 for v in key):
        raise ValueError(f"seed key {key}: every part must be >= 0")
    return np.random.default_rng(np.random.SeedSequence(key))


def epoch_slides(n: int, epoch: int, seed: int) -> list[int]:
    """The order slides are visited in during ``epoch`` (the same on every rank)."""
    return np.random.default_rng(np.random.SeedSequence([seed, epoch, n])).permutation(n).tolist()


class Sampler(Protocol):
    """Chooses a region of ``region`` cells inside an image of ``image`` cells (per dim)."""

    def origin(self, g: np.random.Generator, slide: int, image: tuple[int, ...],
               region: tuple[int, ...]) -> tuple[int, ...]: ...


def _fits(image: tuple[int, ...], region: tuple[int, ...]) -> None:
    if len(image) != len(region) or any(r > e for r, e in zip(region, image, strict=True)):
        raise DataError(f"a region of {'x'.join(map(str, region))} does not fit in an image "
                        f"of {'x'.join(map(str, image))}: lower --image-size or use larger "
                        f"images")


def _clamp(centre: Sequence[int], image: tuple[int, ...], region: tuple[int, ...]
           ) -> tuple[int, ...]:
    """The origin of the region centred on ``centre`` (cell ``r // 2`` of the region), moved
    inside the image."""
    return tuple(min(max(int(c) - r // 2, 0), e - r)
                 for c, e, r in zip(centre, image, region, strict=True))


@dataclass(frozen=True)
class Uniform:
    """Every region position inside the image equally likely."""

    def origin(self, g: np.random.Generator, slide: int, image: tuple[int, ...],
               region: tuple[int, ...]) -> tuple[int, ...]:
        _fits(image, region)
        return tuple(int(g.integers(0, e - r + 1)) for e, r in zip(image, region, strict=True))


def _cells(mask: np.ndarray, image: tuple[int, ...]) -> tuple[float, ...]:
    """Image cells per mask cell along each dim (a low-resolution mask covers the image)."""
    if mask.ndim != len(image):
        raise DataError(f"a {mask.ndim}-D mask of shape {mask.shape} for a "
                        f"{len(image)}-D image of {'x'.join(map(str, image))}: give one mask "
                        f"dim per image dim")
    return tuple(e / m for e, m in zip(image, mask.shape, strict=True))


def _centre_in(g: np.random.Generator, flat: int, mask_shape: tuple[int, ...],
               image: tuple[int, ...], scale: tuple[float, ...]) -> tuple[int, ...]:
    """A uniform image cell inside mask cell ``flat`` (a flat index)."""
    idx = np.unravel_index(flat, mask_shape)
    out = []
    for i, s, e in zip(idx, scale, image, strict=True):
        lo, hi = math.floor(i * s), max(math.floor(i * s) + 1, math.floor((i + 1) * s))
        out.append(min(int(g.integers(lo, hi)), e - 1))
    return tuple(out)


@dataclass(frozen=True)
class Foreground:
    """Centres weighted by a tissue / foreground mask per slide (any resolution: mask cell i
    covers image cells ``[i * E / M, (i + 1) * E / M)``); values are weights >= 0 (a 0/1 mask:
    uniform over the foreground). A slide whose mask is all zero is sampled uniformly."""

    masks: Sequence[np.ndarray]

    def origin(self, g: np.random.Generator, slide: int, image: tuple[int, ...],
               region: tuple[int, ...]) -> tuple[int, ...]:
        _fits(image, region)
        mask = np.asarray(self.masks[slide], dtype=np.float64)
        scale = _cells(mask, image)
        w = mask.ravel()
        if (w < 0).any() or not np.isfinite(w).all():
            raise DataError(f"slide {slide}: the foreground mask holds negative or non-finite "
                            f"values; give weights >= 0")
        total = w.sum()
        if total == 0:
            return Uniform().origin(g, slide, image, region)
        flat = int(np.searchsorted(np.cumsum(w), g.random() * total, side="right"))
        flat = min(flat, w.size - 1)
        return _clamp(_centre_in(g, flat, mask.shape, image, scale), image, region)


@dataclass(frozen=True)
class Balanced:
    """Positive / negative centres with the ratio ``pos : neg`` (MONAI's
    RandCropByPosNegLabel): positive cells are label > 0 of each slide's label map (any
    resolution, as :class:`Foreground`'s masks), negative cells the rest. A slide without
    positive (negative) cells gives a negative (positive) centre."""

    labels: Sequence[np.ndarray]
    pos: float = 1.0
    neg: float = 1.0

    def __post_init__(self) -> None:
        if self.pos < 0 or self.neg < 0 or self.pos + self.neg == 0:
            raise DataError(f"--pos-neg {self.pos}:{self.neg}: give two ratios >= 0, not "
                            f"both 0 (e.g. 1:1, or 2:1 for two positive centres per negative)")

    @property
    def ratio(self) -> float:
        """The probability of a positive centre."""
        return self.pos / (self.pos + self.neg)

    def kind(self, g: np.random.Generator) -> bool:
        """Whether the next centre is positive (one draw)."""
        return bool(g.random() < self.ratio)

    def origin(self, g: np.random.Generator, slide: int, image: tuple[int, ...],
               region: tuple[int, ...]) -> tuple[int, ...]:
        _fits(image, region)
        labels = np.asarray(self.labels[slide])
        scale = _cells(labels, image)
        positive = labels.ravel() > 0
        want = self.kind(g)
        cells = np.flatnonzero(positive if want else ~positive)
        if cells.size == 0:
            cells = np.flatnonzero(~positive if want else positive)
        flat = int(cells[g.integers(0, cells.size)])
        return _clamp(_centre_in(g, flat, labels.shape, image, scale), image, region)


@dataclass(frozen=True)
class SamplerRule:
    """One sampler of ``--sampler``: how to build it from the slides' masks / labels."""

    make: Callable[..., Sampler]
    needs: str
    """What it reads beyond the image: "" (nothing), "mask" or "labels"."""
    doc: str


SAMPLERS: dict[str, SamplerRule] = {
    "uniform": SamplerRule(lambda **kw: Uniform(), "", "every position equally likely"),
    "foreground": SamplerRule(lambda masks, **kw: Foreground(masks), "mask",
                              "centres weighted by a (low-resolution) tissue mask"),
    "balanced": SamplerRule(lambda labels, pos=1.0, neg=1.0, **kw: Balanced(labels, pos, neg),
                            "labels", "positive / negative centres, ratio pos:neg (MONAI "
                            "RandCropByPosNegLabel)"),
}
"""``--sampler`` names: one entry per sampler (adding one is adding an entry)."""


def sampler_of(name: str, *, masks: Sequence[np.ndarray] | None = None,
               labels: Sequence[np.ndarray] | None = None, pos: float = 1.0,
               neg: float = 1.0) -> Sampler:
    """The sampler called ``name`` (:data:`SAMPLERS`). Raises DataError listing the names, or
    naming what the sampler needs and was not given."""
    rule = SAMPLERS.get(name.strip().lower())
    if rule is None:
        raise DataError(f"--sampler {name}: unknown; give one of "
                        + ", ".join(f"{n} ({r.doc})" for n, r in SAMPLERS.items()))
    given = {"mask": masks, "labels": labels}
    if rule.needs and given[rule.needs] is None:
        raise DataError(f"--sampler {name} needs a {rule.needs} per slide: give "
                        f"{'masks' if rule.needs == 'mask' else 'labels'}=")
    return rule.make(masks=masks, labels=labels, pos=pos, neg=neg)


def parse_ratio(text: str) -> tuple[float, float]:
    """``"pos:neg"`` (e.g. ``"1:1"``) as two floats. Raises DataError."""
    parts = text.split(":")
    try:
        pos, neg = (float(p) for p in parts)
    except ValueError:
        raise DataError(f"--pos-neg {text}: give pos:neg, e.g. 1:1 or 2:1") from None
    return pos, neg


@dataclass(frozen=True)
class Pick:
    """One sample's slide and region origin (plus its key, for the augmentation's stream)."""

    slide: int
    origin: tuple[int, ...]
    key: tuple[int, int, int, int, int]
    """(seed, epoch, step, replica, index in the replica)."""


@dataclass(frozen=True)
class Schedule:
    """Which sample of which replica reads which slide, step by step: ``steps_per_epoch``
    steps of ``batch`` samples per epoch (the global batch, ``replicas`` parts of it)."""

    slides: int
    batch: int
    replicas: int = 1
    seed: int = 0
    steps_per_epoch: int = 0
    """0: one pass over the slides per epoch (at least one step)."""

    def __post_init__(self) -> None:
        if self.slides < 1:
            raise DataError("no slides to sample regions from: give at least one image")
        if self.batch % self.replicas:
            raise DataError(f"a batch of {self.batch} does not split into {self.replicas} "
                            f"data-parallel replicas: give a multiple of {self.replicas}")

    @property
    def per_epoch(self) -> int:
        return self.steps_per_epoch or max(1, self.slides // self.batch)

    def keys(self, step: int) -> list[tuple[int, int, int, int, int]]:
        """Every sample's key of the global batch of ``step``, in batch order."""
        epoch = step // self.per_epoch
        per = self.batch // self.replicas
        return [(self.seed, epoch, step, k // per, k % per) for k in range(self.batch)]

    def slide(self, key: tuple[int, int, int, int, int]) -> int:
        """The slide a sample reads: the epoch's order, walked one sample at a time."""
        seed, epoch, step, d, j = key
        order = epoch_slides(self.slides, epoch, seed)
        k = (step % self.per_epoch) * self.batch + d * (self.batch // self.replicas) + j
        return order[k % self.slides]
