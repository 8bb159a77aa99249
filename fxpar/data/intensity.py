"""Intensity augmentation that a window computes exactly as the whole sample would.

Each transform is a function of one cell's values (its channels) and of the cell's *global*
position in the augmented sample, with parameters drawn once per sample from the sample's
generator (fxpar.data.sampling.rng): ``apply(params, x, window, out)`` maps a window ``x`` (C,
*window.shape, float64) of a sample of size ``out``. Nothing reads a statistic of the whole
image (a per-image mean, min or max would need every rank's pixels), so contrast is taken about
a fixed grey and gamma on the values as they are.

Transcendental functions (log, exp, pow, cos) go through numpy, element-wise, single-threaded:
torch's CPU kernels compute the tail of a vectorised loop (and each thread's chunk) with scalar
code that can round differently from the vector code, so the same pixel could differ in its
last bit between a window and the whole image. Linear maps are written out as sums of products
per channel (no matmul).

- :class:`Intensity`: ``a * sign(x) |x|^gamma + b`` (scale, shift, gamma);
- :class:`Noise`: Gaussian noise from a counter-based hash of (the sample's key, channel,
  global cell index): splitmix64 to two uniforms, Box-Muller to a normal, so any window's noise
  is the whole sample's noise at its cells;
- :class:`Colour`: brightness, contrast about mid-grey, saturation (blend with luma), hue
  (a rotation in YIQ), composed into one 3x3 map plus offset per sample (RGB);
- :class:`Hed`: stain jitter (Tellez et al. 2018) in HED optical density space, the
  Ruifrok-Johnston colour deconvolution as skimage.color's rgb2hed / hed2rgb (the same 3x3
  matrix and log scaling, written out here): each stain scaled by ``1 + U(-sigma, sigma)`` and
  shifted by ``U(-bias, bias)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from fxpar.core.geometry import Rect

Extent = tuple[int, ...]

RGB_FROM_HED = np.array([[0.65, 0.70, 0.29],   # haematoxylin
                         [0.07, 0.99, 0.11],   # eosin
                         [0.27, 0.57, 0.78]])  # DAB
"""Ruifrok & Johnston (2001) stain vectors in optical density, one row per stain (the values
skimage.color uses for ``rgb_from_hed``)."""
HED_FROM_RGB = np.linalg.inv(RGB_FROM_HED)
OD_EPS = 1e-6
"""skimage's floor of RGB before the log: optical density 1 at RGB = 1e-6."""
LUMA = np.array([0.299, 0.587, 0.114])
YIQ = np.array([[0.299, 0.587, 0.114], [0.596, -0.274, -0.322], [0.211, -0.523, 0.312]])


def _linear(x: torch.Tensor, m: Any, v: Any = None) -> torch.Tensor:
    """``out[c] = sum_j m[c, j] * x[j] (+ v[c])`` per cell, as element-wise sums."""
    m = np.asarray(m, dtype=np.float64)
    rows = []
    for c in range(m.shape[0]):
        acc = float(m[c, 0]) * x[0]
        for j in range(1, m.shape[1]):
            acc = acc + float(m[c, j]) * x[j]
        rows.append(acc if v is None else acc + float(v[c]))
    return torch.stack(rows)


def _need_rgb(x: torch.Tensor, what: str) -> None:
    if x.shape[0] != 3:
        raise ValueError(f"{what} augments RGB images; this one has {x.shape[0]} channel(s): "
                         f"drop it from --augment")


@dataclass(frozen=True)
class Intensity:
    """Scale by ``1 + U(-scale, scale)``, shift by ``U(-shift, shift)``, gamma ``exp(U(-g, g))``
    with ``g = log(1 + gamma)``; one draw per sample, every channel alike."""

    scale: float = 0.1
    shift: float = 0.1
    gamma: float = 0.3

    def draw(self, g: np.random.Generator, out: Extent) -> tuple[float, float, float]:
        lg = math.log1p(self.gamma)
        return (1 + g.uniform(-self.scale, self.scale), g.uniform(-self.shift, self.shift),
                math.exp(g.uniform(-lg, lg)))

    def apply(self, params: tuple[float, float, float], x: torch.Tensor, window: Rect,
              out: Extent) -> torch.Tensor:
        a, b, gamma = params
        v = x.numpy()
        powered = torch.from_numpy(np.sign(v) * np.power(np.abs(v), gamma))
        return powered * a + b


_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def splitmix64(z: np.ndarray) -> np.ndarray:
    """splitmix64's output function on a uint64 array (wrapping arithmetic)."""
    z = z + _GOLDEN
    z = (z ^ (z >> np.uint64(30))) * _M1
    z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


def cell_index(window: Rect, out: Extent, channels: int) -> np.ndarray:
    """The global linear index of every (channel, cell) of ``window`` in a sample of size
    ``out``: shape (C, *window.shape), uint64."""
    idx = np.zeros((channels, *window.shape), dtype=np.uint64)
    idx += np.arange(channels, dtype=np.uint64).reshape(-1, *([1] * window.ndim))
    for d, ((a, b), n) in enumerate(zip(window.dims, out, strict=True)):
        shape = [1] * (window.ndim + 1)
        shape[d + 1] = b - a
        idx = idx * np.uint64(n) + np.arange(a, b, dtype=np.uint64).reshape(shape)
    return idx


def normal_at(key: int, index: np.ndarray) -> np.ndarray:
    """A standard normal per index, a pure function of (key, index): Box-Muller on two
    uniforms hashed from it (u1 in (0, 1], u2 in [0, 1), 53 bits each)."""
    k = np.uint64(key)
    with np.errstate(over="ignore"):
        h1 = splitmix64(k ^ splitmix64(index * np.uint64(2)))
        h2 = splitmix64(k ^ splitmix64(index * np.uint64(2) + np.uint64(1)))
    u1 = ((h1 >> np.uint64(11)).astype(np.float64) + 1.0) * 2.0 ** -53
    u2 = (h2 >> np.uint64(11)).astype(np.float64) * 2.0 ** -53
    return np.sqrt(-2.0 * np.log(u1)) * np.cos(2.0 * math.pi * u2)


@dataclass(frozen=True)
class Noise:
    """Additive Gaussian noise of standard deviation ``U(0, sigma)`` (per sample), seeded by
    each cell's global position (see the module doc)."""

    sigma: float = 0.05

    def draw(self, g: np.random.Generator, out: Extent) -> tuple[int, float]:
        return int(g.integers(0, 2**63)), float(g.uniform(0, self.sigma))

    def apply(self, params: tuple[int, float], x: torch.Tensor, window: Rect,
              out: Extent) -> torch.Tensor:
        key, sigma = params
        z = normal_at(key, cell_index(window, out, x.shape[0]))
        return x + torch.from_numpy(z) * sigma


def _compose(first: tuple[np.ndarray, np.ndarray], then: tuple[np.ndarray, np.ndarray]
             ) -> tuple[np.ndarray, np.ndarray]:
    (m1, v1), (m2, v2) = first, then
    return m2 @ m1, m2 @ v1 + v2


@dataclass(frozen=True)
class Colour:
    """Brightness ``1 + U(-b, b)``, contrast ``1 + U(-c, c)`` about 0.5, saturation ``1 +
    U(-s, s)``, hue ``U(-h, h)`` turns (a rotation of the IQ plane), for RGB in [0, 1]."""

    brightness: float = 0.2
    contrast: float = 0.2
    saturation: float = 0.2
    hue: float = 0.05

    def draw(self, g: np.random.Generator, out: Extent) -> tuple[Any, tuple[float, ...]]:
        eye, zero = np.eye(3), np.zeros(3)
        b = 1 + g.uniform(-self.brightness, self.brightness)
        c = 1 + g.uniform(-self.contrast, self.contrast)
        s = 1 + g.uniform(-self.saturation, self.saturation)
        t = 2 * math.pi * g.uniform(-self.hue, self.hue)
        rot = np.array([[1, 0, 0], [0, math.cos(t), -math.sin(t)], [0, math.sin(t), math.cos(t)]])
        m: tuple[np.ndarray, np.ndarray] = (b * eye, zero)
        m = _compose(m, (c * eye, np.full(3, 0.5 * (1 - c))))
        m = _compose(m, (s * eye + (1 - s) * np.outer(np.ones(3), LUMA), zero))
        m = _compose(m, (np.linalg.inv(YIQ) @ rot @ YIQ, zero))
        return _frozen(m[0]), tuple(m[1].tolist())

    def apply(self, params: tuple[Any, tuple[float, ...]], x: torch.Tensor, window: Rect,
              out: Extent) -> torch.Tensor:
        _need_rgb(x, "colour")
        return _linear(x, *params)


def _frozen(m: np.ndarray) -> tuple[tuple[float, ...], ...]:
    """A matrix as nested tuples: drawn parameters compare (and hash) as values."""
    return tuple(tuple(float(v) for v in row) for row in m)


def rgb2hed(x: torch.Tensor) -> torch.Tensor:
    """skimage.color.rgb2hed without its final clip at 0 (so hed2rgb inverts it): optical
    density ``log(max(rgb, 1e-6)) / log(1e-6)`` per channel, then ``od @ HED_FROM_RGB``."""
    od = torch.from_numpy(np.log(np.maximum(x.numpy(), OD_EPS)) / math.log(OD_EPS))
    return _linear(od, HED_FROM_RGB.T)


def hed2rgb(stains: torch.Tensor) -> torch.Tensor:
    """skimage.color.hed2rgb: ``exp(-(stains * -log(1e-6)) @ RGB_FROM_HED)``, clipped to
    [0, 1]."""
    log_rgb = _linear(stains * math.log(OD_EPS), RGB_FROM_HED.T)
    return torch.from_numpy(np.clip(np.exp(log_rgb.numpy()), 0.0, 1.0))


@dataclass(frozen=True)
class Hed:
    """HED stain jitter: stain k scaled by ``1 + U(-sigma, sigma)`` and shifted by ``U(-bias,
    bias)`` in optical density (Tellez et al.: sigma 0.05, bias 0.05), RGB in [0, 1]."""

    sigma: float = 0.05
    bias: float = 0.05

    def draw(self, g: np.random.Generator, out: Extent) -> tuple[tuple[float, ...],
                                                                tuple[float, ...]]:
        return (tuple((1 + g.uniform(-self.sigma, self.sigma, 3)).tolist()),
                tuple(g.uniform(-self.bias, self.bias, 3).tolist()))

    def apply(self, params: Any, x: torch.Tensor, window: Rect, out: Extent) -> torch.Tensor:
        _need_rgb(x, "hed")
        alpha, beta = params
        return hed2rgb(_linear(rgb2hed(x), np.diag(alpha), beta))
