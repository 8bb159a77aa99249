"""Reference training on one process, and exact comparisons against a compiled program."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn


def reference_step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor,
                   y: torch.Tensor | tuple[torch.Tensor, ...], chunks: int = 1,
                   loss_fn: Callable = F.cross_entropy, *, accumulate: int = 1, call: int = 0,
                   before_step: Callable[[nn.Module], None] | None = None) -> float:
    """One optimizer step of plain PyTorch over ``chunks`` equal parts of the batch with
    gradient accumulation (the contract's reference); returns the global mean loss. ``y``:
    the targets, or a tuple of them (``loss_fn(output, *y)``: a target and a mask).

    ``accumulate`` = k: this is call ``call`` (0-based) of k that make one step, as
    ``RankProgram.train_step(accumulate=k)``: gradients zeroed in call 0, each chunk's loss
    divided by ``chunks * k`` (accumulation over the k batches' chunks), ``before_step(model)``
    and the optimizer step in call k - 1 only; returns this batch's mean loss."""
    if call == 0:
        opt.zero_grad(set_to_none=True)
    total = 0.0
    ys = [torch.tensor_split(t, chunks) for t in y] if isinstance(y, (tuple, list)) else \
        [torch.tensor_split(y, chunks)]
    for i, xc in enumerate(torch.tensor_split(x, chunks)):
        loss = loss_fn(model(xc), *(part[i] for part in ys)) / (chunks * accumulate)
        loss.backward()
        total += loss.item()
    if call == accumulate - 1:
        if before_step is not None:
            before_step(model)
        opt.step()
    return total * accumulate


RTOL64 = 1e-7
ATOL64 = 1e-10
"""Element-wise float64 tolerances of the transparency checks: ``|got - want| <= atol + rtol *
|want|`` at every element. ``ATOL64`` is for the first step: compiled and reference start from
the same weights and only the order of summation differs (per tile, micro-batch, stage, copy).
Measured (FXPAR_TOLERANCE_LOG, every float64 MPI suite on CPU): the first step needs at most
6.5e-12 at rtol 1e-7 (timm skresnet18 under SP2; tv inception_v3 SP2 6.0e-12, ResNet-50 SP2
3.8e-12; pipeline, GEMS/DP, programs, fuzz (300 random cases) 1e-12 or less)."""
ATOL64_LATER = 1e-8
"""After a step the two runs start from weights that differ in their last bits, and networks
with BatchNorm over a few values (2 images of 2x2 pixels deep in ResNet-50 at 64x64) amplify
that. Measured for compiled vs one process: later gradients need at most 2.1e-9 at rtol 1e-7
(timm tf_efficientnetv2_s under SP4; ResNet-50 SP2 1.2e-9, AmoebaNet GEMS 4.8e-10); one
process against itself with every initial weight moved by 1e-15 relative needs 4.9e-9
(tf_efficientnetv2_s) and 2.0e-9 (ResNet-50): the compiled programs are inside the models' own
conditioning. Used for every comparison after the first optimizer step (later gradients,
losses and parameters, BatchNorm buffers after them, the eval forward and state dicts after
training)."""
RTOL64_EVAL = 1e-6
"""The eval forward after training divides by BatchNorm running variances estimated from a few
values: timm mixnet_s under SP2 gives logits of 7.8e4 that differ by 2.7e-7 relative, and one
process against itself (initial weights moved by 1e-15) by 7.6e-7."""


def atol64(step: int) -> float:
    """The float64 ``atol`` of a comparison made after ``step`` optimizer steps (0: the first
    step's gradients, loss, parameters and buffers)."""
    return ATOL64 if step == 0 else ATOL64_LATER


def assert_same(name: str, got: torch.Tensor | float | None, want: torch.Tensor | float | None,
                atol: float = 1e-12, rtol: float = 1e-10) -> None:
    """``got`` equals ``want`` element by element: ``|got - want| <= atol + rtol * |want|`` at
    every index (as torch.testing.assert_close), NaN only where ``want`` has NaN at the same
    place. A small entry next to a big one gets no slack from the big one. The message names
    the worst element: its index, both values, and how many elements are out."""
    assert (got is None) == (want is None), f"{name}: one side is None"
    if got is None or want is None:
        return
    if not isinstance(got, torch.Tensor):
        got = torch.tensor(float(got), dtype=torch.float64)
    if not isinstance(want, torch.Tensor):
        want = torch.tensor(float(want), dtype=torch.float64)
    assert got.shape == want.shape, f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    if not got.numel():
        return
    g = got.detach().to("cpu", torch.float64)
    w = want.detach().to("cpu", torch.float64)
    if _log_folder() is None and _all_close(g, w, atol, rtol):
        return
    diff = (g - w).abs()
    allowed = w.abs().mul_(rtol).add_(atol)
    # NaN on one side only is never <=; an infinite ``want`` allows anything but itself
    ok = (diff <= allowed).logical_and_(w.isfinite())
    if not bool(ok.all()):  # NaN on both sides at one place, or the same infinity, is equal
        ok |= (g.isnan() & w.isnan()) | (g.isinf() & (g == w))
    _log(name, diff, w, ok)
    if bool(ok.all()):
        return
    # the worst element: furthest beyond its own allowance (a NaN or inf counts as worst)
    excess = torch.where(ok, torch.zeros_like(diff), (diff / allowed).nan_to_num(float("inf")))
    flat = int(excess.flatten().argmax())
    index = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), g.shape))
    gv, wv, dv = g.flatten()[flat].item(), w.flatten()[flat].item(), diff.flatten()[flat].item()
    rel = dv / abs(wv) if wv else float("inf")
    message = (f"{name}: {int((~ok).sum())} of {g.numel()} elements differ; worst at index "
               f"{list(index)}: got {gv!r}, want {wv!r} (|diff| {dv:.3e}, relative {rel:.3e}; "
               f"allowed {atol:g} + {rtol:g} * |want|)")
    if _collected is not None:
        _collected.append(message)
        return
    raise AssertionError(message)


_collected: list[str] | None = None

CHUNK = 1 << 18
"""Elements compared at a time by :func:`_all_close` (2 MiB of float64)."""


def _all_close(g: torch.Tensor, w: torch.Tensor, atol: float, rtol: float) -> bool:
    """Whether every element of ``g`` is within ``atol + rtol * |w|`` of the finite ``w``: the
    test of :func:`assert_same` that nearly every comparison passes, a chunk at a time. Its
    temporaries stay small, so the allocator reuses them: on whole tensors, each of the four
    is fresh memory the kernel faults in page by page (over 11M elements, 1.5x and 3.5x slower
    in two runs on a busy machine). False sends the comparison to the element-wise account."""
    gf, wf = g.reshape(-1), w.reshape(-1)
    for start in range(0, gf.numel(), CHUNK):
        gc, wc = gf[start:start + CHUNK], wf[start:start + CHUNK]
        allowed = wc.abs().mul_(rtol).add_(atol)
        if not bool(torch.sub(gc, wc).abs_().le_(allowed).logical_and_(wc.isfinite()).all()):
            return False
    return True


@contextmanager
def collect_failures() -> Iterator[list[str]]:
    """Inside, a failing :func:`assert_same` appends its message to the list this yields
    instead of raising, so a whole transparency check runs to its end on every rank (a rank
    that raised would leave its peers waiting in the next collective). For tests of the
    harness itself (tests/mpi/cases/harness_cases.py)."""
    global _collected
    outer, _collected = _collected, []
    try:
        yield _collected
    finally:
        _collected = outer


def _log_folder() -> str | None:
    """``FXPAR_TOLERANCE_LOG``: where :func:`_log` writes (None: nowhere)."""
    return os.environ.get("FXPAR_TOLERANCE_LOG") or None


def _log(name: str, diff: torch.Tensor, want: torch.Tensor, ok: torch.Tensor) -> None:
    """With ``FXPAR_TOLERANCE_LOG=<folder>``, append one JSON line per comparison to a file of
    this process there: the worst element-wise relative error and the ``atol`` that each
    candidate ``rtol`` would need. That is how the tolerances above were measured."""
    folder = _log_folder()
    if folder is None:
        return
    finite = diff.isfinite()
    d, a = diff[finite], want.abs()[finite]
    nonzero = a > 0
    rel = (d[nonzero] / a[nonzero]).max().item() if bool(nonzero.any()) else 0.0
    needed = {f"{r:g}": max(0.0, (d - r * a).max().item()) if d.numel() else 0.0
              for r in (0.0, 1e-12, 1e-10, 1e-9, 1e-8, 1e-7, 1e-6)}
    case = "?"
    for f in _frames():  # the mpiexec case (fxpar.testing's worker), else the test function
        if f.f_code.co_name == "_worker" and "case" in f.f_locals:
            case = str(f.f_locals["case"]).rpartition("::")[2]
            break
        if f.f_code.co_name.startswith(("case_", "test_")) and case == "?":
            case = f.f_code.co_name
    line = {"group": os.environ.get("FXPAR_TOLERANCE_GROUP", "?"), "case": case, "name": name,
            "numel": diff.numel(), "max_abs_diff": d.max().item() if d.numel() else 0.0,
            "max_abs_want": a.max().item() if a.numel() else 0.0, "worst_rel": rel,
            "needed_atol": needed, "passed": bool(ok.all())}
    with open(Path(folder) / f"{os.getpid()}.jsonl", "a") as f:
        f.write(json.dumps(line) + "\n")


def _frames():
    frame = sys._getframe(1)
    while frame is not None:
        yield frame
        frame = frame.f_back


def assert_grads_and_params(named: dict[str, nn.Parameter], ref: nn.Module,
                            atol: float = 1e-12, rtol: float = 1e-10) -> None:
    """Every parameter and its gradient in ``named`` equals the reference's (same names)."""
    ref_params = dict(ref.named_parameters())
    assert named, "no parameters to compare"
    for name, p in named.items():
        assert name in ref_params, f"{name} is not a parameter of the original model"
        assert_same(f"grad of {name}", p.grad, ref_params[name].grad, atol, rtol)
        assert_same(name, p.detach(), ref_params[name].detach(), atol, rtol)


def assert_buffers(state: dict[str, torch.Tensor], ref: nn.Module | dict[str, torch.Tensor],
                   atol: float = 1e-12, rtol: float = 1e-10) -> None:
    """BatchNorm running statistics (every buffer in ``state``, a rank's state_dict) equal the
    reference's (a module, or its named buffers). With a module, every name in ``state`` must
    be one of its parameters or buffers, so a misnamed buffer fails instead of going
    uncompared."""
    # every name of a buffer, aliases included (a module held under two names)
    ref_buffers = dict(ref.named_buffers(remove_duplicate=False)) \
        if isinstance(ref, nn.Module) else ref
    if isinstance(ref, nn.Module):
        known = set(ref_buffers) | {n for n, _ in ref.named_parameters(remove_duplicate=False)}
        unknown = sorted(set(state) - known)
        assert not unknown, f"names not in the reference model: {unknown}"
    for name, b in state.items():
        if name in ref_buffers:
            assert_same(f"buffer {name}", b, ref_buffers[name], atol, rtol)
