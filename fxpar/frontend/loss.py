"""Capture the user's loss: ``loss_fn(output, *targets)`` -> a core-ATen ``fx.GraphModule``.

A loss on a tiled output (segmentation) must equal the loss of the whole output, so fxpar
captures it like the model and runs its sums, means and counts over the tiles
(fxpar.frontend.rules.dims, fxpar.passes.tile_loss). Capture is ``torch.export`` (non-strict)
on fake tensors shaped like one micro-batch's output and targets, then torch's core-ATen
decompositions: ``F.cross_entropy`` with ``weight``, ``ignore_index`` and ``label_smoothing``,
``binary_cross_entropy_with_logits``, ``one_hot`` and the like become a few dozen plain ops
(``_log_softmax``, ``gather``, ``where``, ``sum``, ``div``, ``scatter``...), each one rule.

Loss code often turns a small constant tensor into Python numbers (MONAI's Dice family:
``torch.arange(2, len(input.shape)).tolist()``), which a fake tensor cannot answer. While
capturing, :class:`_ConstantFactories` makes ``torch.arange`` / ``torch.tensor`` calls with
only Python arguments real, so their values are known; the graph never sees them unless an op
uses them, and then as constants.
"""

from __future__ import annotations

import contextlib
import io
import traceback
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import fx, nn
from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily
from torch.overrides import TorchFunctionMode

from fxpar.frontend.capture import TraceError, _quiet_torch_logs, _short_file, normalize
from fxpar.frontend.trace import analyze

TensorSpec = tuple[tuple[int, ...], torch.dtype]
"""A tensor's (shape, dtype): what capture reads of an example."""

aten = torch.ops.aten


class LossCaptureError(TraceError):
    """``loss_fn`` could not be captured as a graph (the message says why)."""


class _Loss(nn.Module):
    """``loss_fn`` as a module (export captures modules); a loss that is a module (MONAI's,
    smp's, ``nn.CrossEntropyLoss(weight=...)``) is a submodule, so its buffers come along."""

    def __init__(self, loss_fn: Callable[..., torch.Tensor]) -> None:
        super().__init__()
        self.fn = loss_fn

    def forward(self, output: Any, *targets: torch.Tensor) -> torch.Tensor:
        return self.fn(output, *targets)


_CONSTANT_FACTORIES = (torch.arange, torch.tensor, torch.as_tensor, torch.linspace)


CALLS_KEY = "fxpar.loss_calls"
"""``gm.meta`` key: the torch functions the loss called, in order, each with the line of the
loss's own code that called it (export keeps source lines only inside modules' forwards)."""


class _ConstantFactories(TorchFunctionMode):
    """Factories called with Python values only give real tensors (see the module doc); every
    call is recorded with its caller's line in the loss (:data:`CALLS_KEY`)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, str]] = []

    def __torch_function__(self, func: Any, types: Any, args: Sequence[Any] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        self.calls.append((getattr(func, "__name__", ""), _caller()))
        if func in _CONSTANT_FACTORIES and not any(
                isinstance(a, torch.Tensor) for a in pytree.tree_leaves((args, kwargs))):
            with unset_fake_temporarily():
                return func(*args, **kwargs)
        return func(*args, **kwargs)


def _caller() -> str:
    """The innermost frame outside torch and fxpar, as 'file:line' (as :func:`where` writes
    it: relative to site-packages or the working folder)."""
    for frame in reversed(traceback.extract_stack()):
        f = frame.filename
        if "/torch/" not in f and "/fxpar/" not in f and not f.startswith("<"):
            return f"{_short_file(f)}:{frame.lineno}"
    return ""


def capture_loss(loss_fn: Callable[..., torch.Tensor], output: TensorSpec | Sequence[TensorSpec],
                 targets: Sequence[TensorSpec], device: torch.device | str = "cpu",
                 spec: pytree.TreeSpec | None = None) -> fx.GraphModule:
    """``loss_fn(output, *targets)`` as an analysed core-ATen graph (a :class:`TensorInfo` on
    every node: global shapes of one micro-batch). With ``spec`` (the model output's
    structure, fxpar.core.outputs), ``output`` lists the spec of each leaf and the loss is
    called on that structure: the graph's inputs are the leaves, then the targets. Raises
    :class:`LossCaptureError`."""
    module = loss_fn if isinstance(loss_fn, nn.Module) else None
    wrapper = _Loss(loss_fn)
    if module is not None:
        wrapper.train(module.training)
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    leaves = list(output) if spec is not None else [output]
    specs = [*leaves, *targets]
    name = getattr(loss_fn, "__name__", type(loss_fn).__name__)
    try:
        with mode, _quiet_torch_logs(), contextlib.redirect_stderr(io.StringIO()), \
                warnings.catch_warnings():
            warnings.simplefilter("ignore")
            fakes = [torch.empty(s, dtype=d, device=device) for s, d in specs]
            n = len(leaves)
            first = pytree.tree_unflatten(fakes[:n], spec) if spec is not None else fakes[0]
            with _ConstantFactories() as recorder:
                ep = torch.export.export(wrapper, (first, *fakes[n:]), strict=False)
            ep = ep.run_decompositions()
    except Exception as e:  # noqa: BLE001 - re-raised with what it means
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise LossCaptureError(f"torch.export could not capture the loss {name}: "
                               f"{type(e).__name__}: {first}") from e
    gm = normalize(ep.module(), "Loss")
    gm.meta[CALLS_KEY] = tuple(recorder.calls)
    _drop_checks(gm)
    out = next(n for n in gm.graph.nodes if n.op == "output")
    if not isinstance(out.args[0], fx.Node):
        raise LossCaptureError(f"the loss {name} returns {type(out.args[0]).__name__}, not one "
                               f"tensor: return a scalar tensor")
    return analyze(gm, *(torch.empty(s, dtype=d, device="meta") for s, d in specs))


def _drop_checks(gm: fx.GraphModule) -> None:
    """Export's records of the dtypes and shapes it saw go (global shapes: wrong on a tile),
    and so do ops nothing uses. Asserts on values (``_assert_async``: smp's one-hot range
    check) stay: they read a reduction, whole on every rank."""
    g = gm.graph
    for n in list(g.nodes):
        if n.op == "call_function" and n.target is aten._assert_tensor_metadata.default \
                and not n.users:
            g.erase_node(n)
    g.eliminate_dead_code()
    gm.recompile()
