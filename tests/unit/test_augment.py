"""Augmentation read by window is exact (fxpar.data.augment, geometric, intensity): for every
transform and chains of them, on images and volumes of odd sizes, every window of fxpar's
tiles (floor(k*O/P) intervals, P = 2, 3, 4, square grids; also widened by a halo and clipped to
the sample) equals the same cells of the whole augmented sample in float64, bit for bit
(torch.equal), labels (nearest) too; and the same assertion catches windows augmented on their
own (the classic silent error)."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fxpar.core.geometry import Grid, Rect
from fxpar.data.augment import TRANSFORMS, Augmentation, parse_augment, render
from fxpar.data.errors import DataError
from fxpar.data.intensity import HED_FROM_RGB, RGB_FROM_HED, Noise, hed2rgb, rgb2hed
from fxpar.data.sampling import rng

IMAGE = {2: (3, 41, 37), 3: (2, 17, 15, 19)}
"""Source arrays (C, *spatial): odd sizes, larger than the samples so halos are real cells."""
OUT = {2: (19, 14), 3: (9, 11, 8)}
"""Augmented sample sizes: odd, non-square (rot90 and transpose swap the region's sides)."""
GRIDS = {2: [Grid(2, 1), Grid(1, 2), Grid(3, 1), Grid(1, 3), Grid(4, 1), Grid(1, 4),
             Grid(2, 2), Grid(3, 3)],
         3: [Grid(2, 1, 1), Grid(1, 3, 1), Grid(1, 1, 4), Grid(2, 2, 2), Grid(1, 2, 2)]}
HALOS = (0, 2)
CHAINS = [*TRANSFORMS, "flip,rot90,transpose", "offset,affine,elastic",
          "flip,rot90,affine,intensity,noise", "elastic,rot90,flip,noise,intensity",
          "flip,rot90,transpose,offset,affine,elastic,intensity,noise,colour,hed"]
RGB_ONLY = {"colour", "hed"}


def _chain_for(spec: str, dims: int) -> str | None:
    """The spec for ``dims`` (RGB transforms need a 3-channel image: images only)."""
    names = {s.split(":")[0] for s in spec.split(",")}
    return None if dims == 3 and names & RGB_ONLY else spec


def _source(dims: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).random(IMAGE[dims])


def _labels(dims: int) -> np.ndarray:
    return np.random.default_rng(9).integers(0, 5, (1, *IMAGE[dims][1:]))


def _reader(a: np.ndarray):
    return lambda box: a[(slice(None), *(slice(lo, hi) for lo, hi in box.dims))]


def windows(out: tuple[int, ...], grids: list[Grid]) -> list[Rect]:
    """Every tile of every grid, as fxpar tiles (floor(k*O/P)), and each widened by a halo
    and clipped to the sample."""
    whole = Rect.whole(out)
    got = []
    for grid, halo in itertools.product(grids, HALOS):
        for t in range(grid.size):
            tile = grid.tile_rect(out, t)
            wide = Rect(*((a - halo, b + halo) for a, b in tile.dims)).intersect(whole)
            assert wide is not None
            got.append(wide)
    return got


def _cut(x: torch.Tensor, w: Rect) -> torch.Tensor:
    return x[(slice(None), *(slice(a, b) for a, b in w.dims))]


def assert_windows_match(render_window, whole: torch.Tensor, out: tuple[int, ...],
                         grids: list[Grid]) -> float:
    """Every window of ``grids`` equals the same cells of ``whole``; returns the largest
    difference seen (0.0: all equal)."""
    worst = 0.0
    for w in windows(out, grids):
        got, want = render_window(w), _cut(whole, w)
        diff = (got.double() - want.double()).abs().max().item()
        worst = max(worst, diff)
        assert torch.equal(got, want), f"window {w}: max difference {diff:.3g}"
    return worst


@pytest.mark.parametrize("spec,dims", [(s, d) for s in CHAINS for d in (2, 3)
                                       if _chain_for(s, d) is not None])
def test_every_window_equals_the_whole_augmented_sample(spec, dims):
    chain = parse_augment(spec)
    src, labels = _source(dims), _labels(dims)
    image, out = IMAGE[dims][1:], OUT[dims]
    for k in range(2 if "," not in spec else 1):  # two draws of each transform alone
        aug = chain.draw(rng(3, 0, k, 0, 0, "augment"), out)
        origin = tuple(int(v) for v in np.minimum(3 + k, np.subtract(image, aug.region)))

        def image_window(w: Rect, aug: Augmentation = aug, origin: tuple = origin):
            return render(_reader(src), image, origin, aug, w, channels=src.shape[0])

        def label_window(w: Rect, aug: Augmentation = aug, origin: tuple = origin):
            return render(_reader(labels), image, origin, aug, w, channels=1, labels=True,
                          fill=-1)

        whole = image_window(Rect.whole(out))
        assert whole.shape == (src.shape[0], *out) and whole.dtype == torch.float64
        assert torch.isfinite(whole).all()
        assert assert_windows_match(image_window, whole, out, GRIDS[dims]) == 0.0
        whole_labels = label_window(Rect.whole(out))
        assert set(whole_labels.unique().tolist()) <= {-1, 0, 1, 2, 3, 4}
        assert assert_windows_match(label_window, whole_labels, out, GRIDS[dims]) == 0.0


def _draw(spec: str, out: tuple[int, ...], seed: int = 0) -> Augmentation:
    return parse_augment(spec).draw(rng(seed, 0, 0, 0, 0, "augment"), out)


def _whole(src: np.ndarray, aug: Augmentation, origin: tuple[int, ...]) -> torch.Tensor:
    return render(_reader(src), src.shape[1:], origin, aug, Rect.whole(aug.out),
                  channels=src.shape[0])


def test_discrete_transforms_are_torch_flip_rot90_and_transpose_of_the_region():
    for dims in (2, 3):
        src = _source(dims)
        origin = (2,) * dims
        seen = set()
        for seed in range(40):
            aug = _draw("flip,rot90,transpose", OUT[dims], seed)
            region = torch.from_numpy(src)[(slice(None), *(slice(o, o + n) for o, n in
                                                           zip(origin, aug.region, strict=True)))]
            want = region
            for t, params, _, _ in reversed(aug.geometric):  # forward: first transform first
                name = type(t).__name__
                if name == "Flip":
                    axes = [1 + i for i, f in enumerate(params) if f]
                    want = want.flip(axes) if axes else want
                elif name == "Rot90":
                    k, (a, b) = params
                    want = torch.rot90(want, k, dims=(1 + a, 1 + b))
                    seen.add((dims, k, (a, b)))
                elif params is not None:
                    want = want.transpose(1 + params[0], 1 + params[1])
            assert torch.equal(_whole(src, aug, origin), want), (dims, seed, aug.geometric)
        assert {k for _, k, _ in seen} == {0, 1, 2, 3}
    assert {p for d, _, p in seen if d == 3} == {(0, 1), (0, 2), (1, 2)}, "every volume plane"


def test_linear_sampling_is_grid_sample_with_align_corners_true():
    """The affine / elastic resampling is grid_sample's bilinear / trilinear with
    align_corners=True and zeros padding, on the whole source image (the sum's order differs:
    up to a few ulps)."""
    for dims, spec in itertools.product((2, 3), ("affine:degrees=40:zoom=0.3:shift=9",
                                                 "elastic:sigma=6:spacing=5")):
        src = _source(dims)
        aug = _draw(spec, OUT[dims], seed=dims)
        origin = (-3,) * dims  # the sample hangs over the image's corner: zeros padding
        got = _whole(src, aug, origin)
        s = aug.coords(Rect.whole(aug.out)) + torch.tensor(origin, dtype=torch.float64)
        size = torch.tensor(src.shape[1:], dtype=torch.float64)
        grid = (2 * s / (size - 1) - 1).flip(-1)[None]  # grid_sample's (x, y[, z]) order
        want = F.grid_sample(torch.from_numpy(src)[None], grid, mode="bilinear",
                             padding_mode="zeros", align_corners=True)[0]
        assert (got - want).abs().max().item() < 1e-12, (dims, spec)
        assert (got == 0).any() and (got != 0).any()


def test_elastic_field_is_smooth_and_global():
    aug = _draw("elastic:sigma=3:spacing=8", (40, 40))
    p = aug.coords(Rect.whole((40, 40)))
    disp = p - torch.stack(torch.meshgrid(torch.arange(40.0), torch.arange(40.0),
                                          indexing="ij"), -1).double()
    assert disp.abs().max() > 0.5, "it moves cells"
    step = (disp[1:] - disp[:-1]).abs().max()
    assert step < 0.5 * disp.abs().max(), "neighbouring cells move alike"


def test_noise_is_a_function_of_the_global_cell():
    noise = Noise(sigma=1.0)
    whole = Rect.whole((23, 31))
    x = torch.zeros((2, 23, 31), dtype=torch.float64)
    params = (12345, 1.0)
    full = noise.apply(params, x, whole, (23, 31))
    for w in windows((23, 31), GRIDS[2]):
        part = noise.apply(params, torch.zeros((2, *w.shape), dtype=torch.float64), w, (23, 31))
        assert torch.equal(part, _cut(full, w))
    big = noise.apply(params, torch.zeros((1, 300, 300), dtype=torch.float64),
                      Rect.whole((300, 300)), (300, 300))
    assert abs(big.mean().item()) < 0.01 and abs(big.std().item() - 1) < 0.01
    assert abs(((big > 1.96).double().mean() - 0.025).item()) < 0.003  # a normal's tail
    other = noise.apply((12346, 1.0), x, whole, (23, 31))
    assert not torch.equal(other, full), "another sample's key, other noise"


def test_hed_is_the_ruifrok_johnston_deconvolution():
    assert np.allclose(RGB_FROM_HED @ HED_FROM_RGB, np.eye(3), atol=1e-14)
    # pure haematoxylin of optical density 1: RGB = 10^(-OD * 6) per channel (skimage's scale)
    od = RGB_FROM_HED[0]
    rgb = torch.from_numpy(np.exp(od * math.log(1e-6)))[:, None, None]
    assert torch.allclose(rgb2hed(rgb)[:, 0, 0], torch.tensor([1.0, 0.0, 0.0],
                                                              dtype=torch.float64), atol=1e-12)
    x = torch.from_numpy(np.random.default_rng(1).uniform(0.05, 1.0, (3, 7, 9)))
    assert (hed2rgb(rgb2hed(x)) - x).abs().max() < 1e-12, "hed2rgb inverts rgb2hed"
    aug = _draw("hed:sigma=0.2:bias=0.1", (7, 9))
    moved = aug.intensity[0][0].apply(aug.intensity[0][1], x, Rect.whole((7, 9)), (7, 9))
    assert (moved - x).abs().max() > 1e-3 and (0 <= moved).all() and (moved <= 1).all()


def test_parse_lists_the_valid_transforms_and_options():
    chain = parse_augment("flip, rot90,affine:degrees=30:zoom=0.2,intensity,hed")
    assert [type(t).__name__ for t in chain.transforms] == ["Flip", "Rot90", "Affine",
                                                          "Intensity", "Hed"]
    assert chain.transforms[2].degrees == 30.0 and chain.transforms[2].zoom == 0.2
    assert parse_augment("none").transforms == () == parse_augment("").transforms
    with pytest.raises(DataError, match=r"unknown transform 'rotate'.*flip.*rot90.*hed"):
        parse_augment("flip,rotate")
    with pytest.raises(DataError, match=r"option 'angle=3'; affine takes degrees=<number>"):
        parse_augment("affine:angle=3")
    with pytest.raises(DataError, match="is not a float"):
        parse_augment("affine:degrees=lots")
    with pytest.raises(ValueError, match="colour augments RGB images"):
        aug = _draw("colour", (4, 4))
        aug.intensity[0][0].apply(aug.intensity[0][1], torch.zeros(2, 4, 4), Rect.whole((4, 4)),
                                  (4, 4))


# -- the mutation check: each window augmented on its own ---------------------------------------
def _per_window(spec: str, src: np.ndarray, out: tuple[int, ...], origin: tuple[int, ...]):
    """The classic error: every window draws its own augmentation (its own seed: here the
    window's position), as a loader that augments the crop it read would."""
    chain = parse_augment(spec)

    def window(w: Rect) -> torch.Tensor:
        seed = sum(a * 7919 ** i for i, (a, _) in enumerate(w.dims))
        aug = chain.draw(rng(0, 0, 0, 0, seed, "augment"), out)
        return render(_reader(src), src.shape[1:], origin, aug, w, channels=src.shape[0])
    return window


@pytest.mark.parametrize("spec", ["flip:p=0.5", "noise", "rot90", "affine"])
def test_windows_augmented_on_their_own_are_caught(spec):
    src, out = _source(2), OUT[2]
    origin = (4, 4)
    whole = _per_window(spec, src, out, origin)(Rect.whole(out))
    with pytest.raises(AssertionError, match="max difference"):
        assert_windows_match(_per_window(spec, src, out, origin), whole, out, GRIDS[2])
