"""Region samplers and the windowed, augmented batch source (fxpar.data.sampling,
fxpar.data.loader): the same draws on every rank of a replica, others across replicas, a new
slide order each epoch, foreground weighting that prefers the foreground, MONAI's pos:neg ratio,
batches whose windows equal the whole augmented batch, and a prefetching loader that keeps
order, raises its workers' errors in the training thread and shuts down cleanly."""

from __future__ import annotations

import argparse
import threading
import time

import numpy as np
import pytest
import torch

from fxpar.core.geometry import Grid, Rect
from fxpar.data.augment import add_data_arguments, data_options, parse_augment
from fxpar.data.errors import DataError
from fxpar.data.loader import ArrayImage, AugmentedBatches, Prefetcher, Slide, prefetch
from fxpar.data.sampling import (
    Balanced,
    Foreground,
    Schedule,
    Uniform,
    epoch_slides,
    rng,
    sampler_of,
)

IMAGE = (97, 83)
REGION = (9, 9)


def _slides(n: int = 3, channels: int = 3) -> list[Slide]:
    g = np.random.default_rng(0)
    return [Slide(ArrayImage(g.random((channels, *IMAGE))),
                  ArrayImage(g.integers(0, 4, (1, *IMAGE)))) for _ in range(n)]


def _source(slides=None, spec="flip,rot90,affine,noise", replicas=1, batch=4, **kw):
    return AugmentedBatches(slides or _slides(), Uniform(), parse_augment(spec), (15, 12), batch,
                            seed=7, replicas=replicas, dtype=torch.float64, **kw)


def test_seeded_by_the_key_alone_never_by_global_state():
    torch.manual_seed(1)
    np.random.seed(1)
    a = rng(5, 1, 2, 0, 3).random(4)
    torch.manual_seed(2)
    np.random.seed(2)
    assert np.array_equal(a, rng(5, 1, 2, 0, 3).random(4))
    for other in [(5, 1, 2, 1, 3), (5, 2, 2, 0, 3), (5, 1, 3, 0, 3), (6, 1, 2, 0, 3)]:
        assert not np.array_equal(a, rng(*other).random(4)), other
    assert not np.array_equal(a, rng(5, 1, 2, 0, 3, "augment").random(4))


def test_every_rank_of_a_replica_draws_the_same_and_replicas_differ():
    spec = "flip,rot90,affine,elastic,colour,hed,noise"
    ranks = [_source(spec=spec, replicas=2, batch=8) for _ in range(3)]  # three ranks' own
    draws = [r.draws(4) for r in ranks]
    assert draws[0] == draws[1] == draws[2], "the same samples on every rank"
    first, second = draws[0][:4], draws[0][4:]  # replica 0's rows, replica 1's rows
    assert {d.key[3] for d in first} == {0} and {d.key[3] for d in second} == {1}
    assert [d.origin for d in first] != [d.origin for d in second]
    assert [d.aug.geometric[0][1] for d in first] != [d.aug.geometric[0][1] for d in second]
    assert ranks[0].draws(5) != draws[0], "a new step, new regions"


def test_slides_are_shuffled_per_epoch():
    orders = [epoch_slides(10, e, 3) for e in range(4)]
    assert all(sorted(o) == list(range(10)) for o in orders)
    assert len({tuple(o) for o in orders}) == 4
    s = Schedule(slides=6, batch=3, seed=3)
    assert s.per_epoch == 2
    for epoch in range(3):  # every slide once per epoch
        seen = [s.slide(k) for step in (2 * epoch, 2 * epoch + 1) for k in s.keys(step)]
        assert sorted(seen) == list(range(6)), epoch
    with pytest.raises(DataError, match="does not split into 4"):
        Schedule(slides=6, batch=6, replicas=4)


def _centres(sampler, n: int, image=(64, 64), region=(8, 8)) -> np.ndarray:
    return np.array([[o + r // 2 for o, r in zip(sampler.origin(rng(1, 0, i, 0, 0), 0, image,
                                                                region), region, strict=True)]
                     for i in range(n)])


def test_uniform_covers_the_image_and_regions_stay_inside():
    c = _centres(Uniform(), 2000)
    assert c.min() == 4 and c.max() == 60  # region 8: centres 4 .. 60
    assert abs(c.mean() - 32) < 1.5
    with pytest.raises(DataError, match="does not fit"):
        Uniform().origin(rng(0, 0, 0, 0, 0), 0, (6, 64), (8, 8))


def test_foreground_weighting_prefers_the_foreground():
    mask = np.zeros((8, 8))  # a low-resolution mask: one cell per 8x8 image cells
    mask[2:4, 5:7] = 1.0  # 4 of 64 cells: 6% of the image
    c = _centres(Foreground([mask]), 2000)
    inside = (c[:, 0] >= 16) & (c[:, 0] < 32) & (c[:, 1] >= 40) & (c[:, 1] < 56)
    assert inside.mean() == 1.0, "every centre in the foreground (no clamping needed here)"
    uniform = _centres(Uniform(), 2000)
    u_inside = (uniform[:, 0] >= 16) & (uniform[:, 0] < 32) & (uniform[:, 1] >= 40) & \
        (uniform[:, 1] < 56)
    assert u_inside.mean() < 0.15
    weights = np.ones((8, 8))
    weights[0:4] = 3.0  # the top half three times as likely
    top = (_centres(Foreground([weights]), 4000)[:, 0] < 32).mean()
    assert abs(top - 0.75) < 0.03, top
    assert (_centres(Foreground([np.zeros((8, 8))]), 50) >= 4).all(), "empty mask: uniform"


@pytest.mark.parametrize("pos,neg", [(1, 1), (3, 1), (1, 4)])
def test_balanced_respects_the_pos_neg_ratio(pos, neg):
    labels = np.zeros((64, 64), dtype=np.int64)
    labels[20:30, 30:50] = 2  # positives: 5% of the pixels
    c = _centres(Balanced([labels], pos, neg), 3000)
    positive = labels[c[:, 0], c[:, 1]] > 0
    want = pos / (pos + neg)
    assert abs(positive.mean() - want) < 0.03, (positive.mean(), want)
    low = np.zeros((16, 16), dtype=np.int64)  # a low-resolution label map works the same
    low[5:7, 8:12] = 1
    c = _centres(Balanced([low], 1, 0), 200)
    assert (labels[c[:, 0], c[:, 1]] > 0).all()


def test_sampler_of_lists_the_names_and_says_what_is_missing():
    assert isinstance(sampler_of("uniform"), Uniform)
    assert isinstance(sampler_of("balanced", labels=[np.ones((2, 2))], pos=2), Balanced)
    with pytest.raises(DataError, match=r"unknown; give one of uniform .*foreground .*balanced"):
        sampler_of("random")
    with pytest.raises(DataError, match="needs a mask per slide"):
        sampler_of("foreground")
    with pytest.raises(DataError, match="not both 0"):
        Balanced([np.ones((2, 2))], 0, 0)


@pytest.mark.parametrize("spec", ["flip,rot90,transpose,offset", "flip,affine,elastic,noise"])
def test_batches_read_by_window_equal_the_whole_augmented_batch(spec):
    slides = _slides()
    whole = _source(slides, spec, fill=float("nan"))
    for step in (0, 3):
        x, y = whole.batch(step, Rect.whole((15, 12)))
        assert torch.isfinite(x).all()
        for grid in (Grid(2, 1), Grid(3, 1), Grid(2, 2)):
            for t in range(grid.size):
                for s in slides:
                    s.image.reads.clear()
                w = grid.tile_rect((15, 12), t)
                halo = Rect(*((a - 1, b + 1) for a, b in w.dims)).intersect(Rect.whole((15, 12)))
                xw, yw = _source(slides, spec, fill=float("nan")).batch(step, halo, target=w)
                cut = (slice(None), slice(None), *(slice(a, b) for a, b in halo.dims))
                assert torch.equal(xw[cut], x[cut]), (spec, step, grid, t)
                outside = torch.ones(x.shape, dtype=torch.bool)
                outside[cut] = False
                assert torch.isnan(xw[outside]).all(), "nothing written outside the window"
                ycut = (slice(None), *(slice(a, b) for a, b in w.dims))
                assert torch.equal(yw[ycut], y[ycut])
                reads = [r for s in slides for r in s.image.reads]
                assert len(reads) == 4 and all(r.size <= 3 * halo.size for r in reads), \
                    "each sample reads about its window, not the region"


def test_a_replica_fills_only_its_rows():
    src = _source(replicas=2, batch=4, fill=float("nan"))
    x, y = src.batch(0, Rect.whole((15, 12)), replica=1)
    assert torch.isnan(x[:2]).all() and torch.isfinite(x[2:]).all()
    full, _ = src.batch(0, Rect.whole((15, 12)))
    assert torch.equal(x[2:], full[2:])


def test_prefetcher_keeps_order_bounds_its_queue_and_shuts_down():
    started: list[int] = []

    def load(step: int) -> int:
        started.append(step)
        time.sleep(0.002)
        return step * 10

    with Prefetcher(load, range(6), depth=2) as p:
        first = next(p)
        time.sleep(0.05)
        assert first == 0 and len(started) <= 3, started  # at most depth ahead of the consumer
        assert [first, *p] == [0, 10, 20, 30, 40, 50]
    assert len(p.waits) == 6
    assert not any(t.name.startswith("fxpar-data") and t.is_alive()
                   for t in threading.enumerate())


def test_prefetcher_raises_the_workers_error_in_the_training_thread():
    def load(step: int) -> int:
        if step == 2:
            raise DataError("slide 2 is unreadable")
        return step

    p = Prefetcher(load, range(10), depth=3, workers=2)
    assert next(p) == 0 and next(p) == 1
    with pytest.raises(DataError, match="slide 2 is unreadable"):
        next(p)
    with pytest.raises(StopIteration):
        next(p)  # closed after the error
    assert not any(t.name.startswith("fxpar-data") and t.is_alive()
                   for t in threading.enumerate())


def test_prefetched_batches_equal_direct_ones():
    src = _source()
    window = Rect((0, 8), (0, 12))
    with prefetch(src, range(3), window, depth=2) as p:
        for step, (x, y) in enumerate(p):
            want = src.batch(step, window)
            assert torch.equal(x[:, :, :8], want[0][:, :, :8]) and torch.equal(y, want[1])


def test_data_arguments_parse_to_options():
    parser = argparse.ArgumentParser()
    add_data_arguments(parser)
    opts = data_options(parser.parse_args(["--sampler", "balanced", "--augment",
                                           "flip,rot90,hed", "--pos-neg", "3:1"]))
    assert opts.sampler == "balanced" and (opts.pos, opts.neg) == (3.0, 1.0)
    assert [type(t).__name__ for t in opts.chain.transforms] == ["Flip", "Rot90", "Hed"]
    with pytest.raises(DataError, match="pos:neg"):
        data_options(parser.parse_args(["--pos-neg", "3"]))
