"""Reference training on one process, and exact comparisons against a compiled program."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn


def reference_step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor,
                   y: torch.Tensor, chunks: int = 1,
                   loss_fn: Callable = F.cross_entropy) -> float:
    """One optimizer step of plain PyTorch over ``chunks`` equal parts of the batch with
    gradient accumulation (the contract's reference); returns the global mean loss."""
    opt.zero_grad(set_to_none=True)
    total = 0.0
    for xc, yc in zip(torch.tensor_split(x, chunks), torch.tensor_split(y, chunks), strict=True):
        loss = loss_fn(model(xc), yc) / chunks
        loss.backward()
        total += loss.item()
    opt.step()
    return total


def assert_same(name: str, got: torch.Tensor | None, want: torch.Tensor | None,
                atol: float = 1e-12, rtol: float = 1e-10) -> None:
    assert (got is None) == (want is None), f"{name}: one side is None"
    if got is None or want is None:
        return
    assert got.shape == want.shape, f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    # relative to the tensor's largest entry: summation-order noise scales with it, while a
    # missing or doubled contribution is of the same order as the entries themselves
    diff = (got - want).abs().max().item() if got.numel() else 0.0
    scale = want.abs().max().item() if want.numel() else 0.0
    if not diff <= atol + rtol * scale:
        raise AssertionError(f"{name}: max abs difference {diff:.3e} with max |value| "
                             f"{scale:.3e} (atol {atol}, rtol {rtol})")


def assert_grads_and_params(named: dict[str, nn.Parameter], ref: nn.Module,
                            atol: float = 1e-12) -> None:
    """Every parameter and its gradient in ``named`` equals the reference's (same names)."""
    ref_params = dict(ref.named_parameters())
    assert named, "no parameters to compare"
    for name, p in named.items():
        assert name in ref_params, f"{name} is not a parameter of the original model"
        assert_same(f"grad of {name}", p.grad, ref_params[name].grad, atol)
        assert_same(name, p.detach(), ref_params[name].detach(), atol)


def assert_buffers(state: dict[str, torch.Tensor], ref: nn.Module | dict[str, torch.Tensor],
                   atol: float = 1e-12, rtol: float = 1e-10) -> None:
    """BatchNorm running statistics (every buffer in ``state``, a rank's state_dict) equal the
    reference's (a module, or its named buffers). With a module, every name in ``state`` must
    be one of its parameters or buffers, so a misnamed buffer fails instead of going
    uncompared."""
    ref_buffers = dict(ref.named_buffers()) if isinstance(ref, nn.Module) else ref
    if isinstance(ref, nn.Module):
        known = set(ref_buffers) | {n for n, _ in ref.named_parameters()}
        unknown = sorted(set(state) - known)
        assert not unknown, f"names not in the reference model: {unknown}"
    for name, b in state.items():
        if name in ref_buffers:
            assert_same(f"buffer {name}", b, ref_buffers[name], atol, rtol)
