"""Bugs of the torch under test that make a one-process reference wrong, each with a probe
that finds it in this torch (so the workaround retires itself once torch is fixed).

``instance_norm``'s backward on CPU (torch 2.14.1 and 2.11.0, float32 and float64; CUDA is
right): with one sample (N = 1) and a
gradient laid out channels-last (what a ``permute(0, 2, 3, 1)`` ... ``permute(0, 3, 1, 2)``
block such as ConvNeXt's hands back), the input's gradient is wrong by O(1) -- InstanceNorm2d
and 3d, affine or not; N >= 2, 1-D, group_norm and batch_norm are right. A pipeline stage
receives its gradient in a fresh contiguous buffer, so fxpar's program is right where the
one-process reference is not (the fuzzer found it: tests/helpers/fuzz/torch_bug.json)."""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode


@functools.cache
def instance_norm_grad_bug() -> bool:
    """Does this torch get instance_norm's input gradient wrong for N = 1 and a
    channels-last gradient?"""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 3, 4, 5, dtype=torch.float64, generator=g, requires_grad=True)
    grad = torch.randn(1, 3, 4, 5, dtype=torch.float64, generator=g)
    right, = torch.autograd.grad(F.instance_norm(x), x, grad)
    got, = torch.autograd.grad(F.instance_norm(x), x,
                               grad.contiguous(memory_format=torch.channels_last))
    return not torch.allclose(right, got, rtol=0, atol=1e-12)


class _ContiguousGrad(torch.autograd.Function):
    """The identity; its backward hands on the gradient in contiguous memory."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        return g.contiguous()


class InstanceNormGradFix(TorchFunctionMode):
    """Inside it, ``F.instance_norm`` gets its gradient contiguous: the mathematically right
    input gradient on a torch with :func:`instance_norm_grad_bug`."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        return _ContiguousGrad.apply(out) if func is F.instance_norm else out
