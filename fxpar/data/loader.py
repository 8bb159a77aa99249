"""Sampled, augmented batches read by window, and a prefetching loader that fills the next
steps' windows in background threads while the current step computes.

:class:`AugmentedBatches` is a batch source (fxpar.data.data.BatchSource): ``batch(step,
window, target)`` draws every sample of the global batch of ``step`` -- its slide, its
augmentation, then its region (fxpar.data.sampling, fxpar.data.augment) -- from generators
seeded by (seed, epoch, step, replica, sample), and fills only ``window`` of each image and
``target`` of each label map, in a full-shape ``torch.empty`` batch, as
fxpar.data.samples.SampleBatches does. Each rank reads only the source box its window maps to
(plus the interpolation's halo); every rank of a replica gets the same samples, and the filled
cells equal those of the whole augmented batch on one process, bit for bit.

:class:`Prefetcher` runs a ``load(step)`` function ``depth`` steps ahead on ``workers``
threads (a bounded queue of futures, in step order): an exception in a worker is raised in the
training thread at the step that needed it; :meth:`Prefetcher.close` (or leaving its ``with``)
cancels what is queued and joins the threads. numpy's and the readers' I/O release the GIL, so
loading overlaps the step's compute. With ``workers > 1`` the source's readers must be
thread-safe (:class:`ArrayImage` and .npy maps are; a TIFF reader is used by one thread).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

import numpy as np
import torch

from fxpar.core.geometry import Rect
from fxpar.data.augment import Augmentation, Chain, render
from fxpar.data.errors import DataError
from fxpar.data.sampling import Sampler, Schedule, rng

Batch = tuple[torch.Tensor | None, torch.Tensor | None]
T = TypeVar("T")


class Source(Protocol):
    """An image (or label map) read by window: fxpar.data.images.ImageReader, or
    :class:`ArrayImage`."""

    shape: tuple[int, ...]

    @property
    def size(self) -> tuple[int, ...]: ...

    def read(self, window: Rect) -> np.ndarray: ...


class ArrayImage:
    """An array (C, *spatial) -- in memory or memory-mapped -- as a window reader; ``reads``
    records every window read (thread-safe)."""

    def __init__(self, array: np.ndarray) -> None:
        self.array = array
        self.shape = tuple(int(s) for s in array.shape)
        self.reads: list[Rect] = []
        self._lock = threading.Lock()

    @property
    def size(self) -> tuple[int, ...]:
        return self.shape[1:]

    def read(self, window: Rect) -> np.ndarray:
        if window.intersect(Rect.whole(self.size)) != window:
            raise DataError(f"window {window} is outside the {self.size} image")
        with self._lock:
            self.reads.append(window)
        return np.asarray(self.array[(slice(None), *(slice(a, b) for a, b in window.dims))])


@dataclass(frozen=True)
class Slide:
    """One image to draw regions from, with its per-pixel labels (segmentation) or a class
    label (classification)."""

    image: Source
    labels: Source | None = None
    label: int = 0


@dataclass(frozen=True)
class Draw:
    """One sample of a step: its slide, region origin (source cells) and augmentation."""

    slide: int
    origin: tuple[int, ...]
    aug: Augmentation
    key: tuple[int, int, int, int, int]


@dataclass
class AugmentedBatches:
    """Step-indexed batches of regions drawn by ``sampler`` from ``slides`` and augmented by
    ``chain``: samples of spatial size ``out`` (the model input), ``batch_size`` per global
    batch, cut into ``replicas`` data-parallel parts (see fxpar.data.sampling)."""

    slides: Sequence[Slide]
    sampler: Sampler
    chain: Chain
    out: tuple[int, ...]
    batch_size: int
    seed: int = 0
    replicas: int = 1
    steps_per_epoch: int = 0
    """0: one pass over the slides per epoch."""
    dtype: torch.dtype = torch.float32
    fill: float | None = None
    """Fill the batch outside the window with this value (tests: NaN); None: never touched."""
    pad: float = 0.0
    """The image's value past its edge (what an affine corner or an offset reads there)."""
    label_pad: int = 0
    """The label past the image's edge (e.g. a loss's ignore_index)."""
    schedule: Schedule = field(init=False, repr=False)
    channels: int = field(init=False, default=0)
    """The slides' channel count (checked equal)."""

    def __post_init__(self) -> None:
        self.out = tuple(int(n) for n in self.out)
        self.schedule = Schedule(len(self.slides), self.batch_size, self.replicas, self.seed,
                                 self.steps_per_epoch)
        channels = {s.image.shape[0] for s in self.slides}
        if len(channels) != 1:
            raise DataError(f"slides with {sorted(channels)} channels: give slides of one "
                            f"channel count")
        self.channels = channels.pop()

    @property
    def task(self) -> str:
        """"segment" when the slides have label maps, else "classify"."""
        return "segment" if self.slides[0].labels is not None else "classify"

    def draws(self, step: int) -> list[Draw]:
        """Every sample of the global batch of ``step`` (the same on every rank)."""
        out = []
        for key in self.schedule.keys(step):
            slide = self.schedule.slide(key)
            aug = self.chain.draw(rng(*key, purpose="augment"), self.out)
            size = tuple(self.slides[slide].image.size)
            origin = self.sampler.origin(rng(*key, purpose="region"), slide, size, aug.region)
            out.append(Draw(slide, tuple(origin), aug, key))
        return out

    def samples_of(self, replica: int | None) -> range:
        """The batch rows of ``replica`` (all rows for None)."""
        if replica is None:
            return range(self.batch_size)
        per = self.batch_size // self.replicas
        return range(replica * per, (replica + 1) * per)

    def batch(self, step: int, window: Rect | None, target: Rect | None = None,
              targets: bool = True, replica: int | None = None) -> Batch:
        """The batch of ``step``: ``window`` of each image (x None for None), and the labels:
        ``target`` of each label map (None: all of it), or the class labels; y None when not
        ``targets``. ``replica``: fill only that replica's rows (the others' rows are never
        read by its ranks)."""
        draws = self.draws(step)
        rows = self.samples_of(replica)
        y = self._labels(draws, rows, target) if targets else None
        if window is None:
            return None, y
        shape = (self.batch_size, self.channels, *self.out)
        x = torch.empty(shape, dtype=self.dtype) if self.fill is None else \
            torch.full(shape, self.fill, dtype=self.dtype)
        where = tuple(slice(a, b) for a, b in window.dims)
        for k in rows:
            d = draws[k]
            image = self.slides[d.slide].image
            x[(k, slice(None), *where)] = render(image.read, image.size, d.origin, d.aug,
                                                 window, channels=self.channels, fill=self.pad)
        return x, y

    def _labels(self, draws: list[Draw], rows: range, target: Rect | None) -> torch.Tensor:
        if self.task == "classify":
            return torch.tensor([self.slides[d.slide].label for d in draws], dtype=torch.int64)
        box = Rect.whole(self.out) if target is None else target
        y = torch.empty((self.batch_size, *self.out), dtype=torch.int64)
        where = tuple(slice(a, b) for a, b in box.dims)
        for k in rows:
            d = draws[k]
            labels = self.slides[d.slide].labels
            assert labels is not None
            y[(k, *where)] = render(labels.read, labels.size, d.origin, d.aug, box, channels=1,
                                    labels=True, fill=self.label_pad)[0]
        return y


class Prefetcher(Generic[T]):
    """``load(step)`` for each of ``steps``, ``depth`` steps ahead on ``workers`` threads,
    yielded in order. ``waits``: seconds the training thread waited for each item."""

    def __init__(self, load: Callable[[int], T], steps: Iterable[int], depth: int = 2,
                 workers: int = 1) -> None:
        if depth < 1 or workers < 1:
            raise ValueError(f"Prefetcher(depth={depth}, workers={workers}): give depth >= 1 "
                             f"and workers >= 1 (load in the step without a Prefetcher)")
        self.load, self.depth = load, depth
        self._steps: Iterator[int] = iter(steps)
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="fxpar-data")
        self._queue: deque[Future[T]] = deque()
        self.waits: list[float] = []
        self._closed = False
        for _ in range(depth):
            self._submit()

    def _submit(self) -> None:
        step = next(self._steps, None)
        if step is not None:
            self._queue.append(self._pool.submit(self.load, step))

    def __iter__(self) -> Prefetcher[T]:
        return self

    def __next__(self) -> T:
        if self._closed or not self._queue:
            raise StopIteration
        future = self._queue.popleft()
        t0 = time.perf_counter()
        try:
            item = future.result()  # a worker's exception is raised here, in this thread
        except BaseException:
            self.close()
            raise
        self.waits.append(time.perf_counter() - t0)
        self._submit()
        return item

    def close(self) -> None:
        """Cancel what is queued and join the threads (idempotent)."""
        if self._closed:
            return
        self._closed = True
        for f in self._queue:
            f.cancel()
        self._queue.clear()
        self._pool.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> Prefetcher[T]:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def prefetch(source: Any, steps: Iterable[int], window: Rect | None,
             target: Rect | None = None, *, targets: bool = True, replica: int | None = None,
             depth: int = 2, workers: int = 1) -> Prefetcher[Batch]:
    """A :class:`Prefetcher` of ``source.batch(step, window, target, targets, replica)``."""
    def load(step: int) -> Batch:
        return source.batch(step, window, target, targets=targets, replica=replica)
    return Prefetcher(load, steps, depth, workers)
