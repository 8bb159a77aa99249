"""Capture: an ordinary model -> an ATen-level ``fx.GraphModule`` through ``torch.export``.

``torch.export.export(model, (x,), strict=False)`` runs the model's Python once on a *fake*
input (no image memory: a 16384x16384 ResNet-152 is captured in under a second) and records the
ATen ops it calls. Python control flow, functional norms, padding computed from the input size
(timm's ``Conv2dSame``), ``torch.jit.isinstance``: all resolved by running the real code, so the
graph is what the model does, not what a symbolic tracer guessed. Parameters and buffers are
``get_attr`` nodes under the original names (``layer1.0.conv1.weight``), shared with ``model``
(training the program trains the model).

The captured graph is then normalised for fxpar (:func:`normalize`):

- the export wrappers go: the guard call, the pytree (un)flattening of inputs and output:
  the graph returns the output's leaves, its structure kept as data (fxpar.core.outputs);
- the bodies of ``with torch.autocast(...)`` blocks, which export captures as higher-order
  ops, are inlined as plain ATen ops, what the block set kept as data (fxpar.frontend.hops);
- ops whose behaviour depends on train/eval mode, which export bakes in as a constant, become
  small modules that read the stage module's mode (:class:`BatchNormOp` also owns the
  ``num_batches_tracked += 1`` that export records as a separate ``aten.add_``,
  :class:`DropoutOp`), so ``program.train()`` / ``program.eval()`` work as on the model;
- a run of views and a permute that is one known op (TResNet's SpaceToDepth:
  ``pixel_unshuffle`` and a channel reorder) becomes that op (fxpar.frontend.rules.chains);
- every node keeps ``nn_module_stack`` and ``stack_trace`` for messages (:func:`where`).

Before (export, train mode)::

    add_ = torch.ops.aten.add_.Tensor(bn1_num_batches_tracked, 1)
    batch_norm = torch.ops.aten.batch_norm.default(conv2d, bn1_weight, bn1_bias,
        bn1_running_mean, bn1_running_var, True, 0.1, 1e-05, False)

after::

    batch_norm = self.fxpar_bn_0(conv2d, bn1_weight, bn1_bias, bn1_running_mean,
        bn1_running_var, bn1_num_batches_tracked)       # BatchNormOp(momentum=0.1, eps=1e-05)
"""

from __future__ import annotations

import contextlib
import io
import linecache
import logging
import os
import re
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import fx, nn
from torch._subclasses.fake_tensor import FakeTensorMode

from fxpar.core.fxgraph import graph_module, lazy_code, replace_node
from fxpar.core.meta import pretty_path
from fxpar.core.modelkeys import MODEL_KEYS, ModelKeys
from fxpar.core.outputs import LEAF, OUT_SPEC, register_types
from fxpar.frontend.hops import inline_blocks
from fxpar.frontend.rules.chains import fuse_chains
from fxpar.runtime.modules import BatchNormOp, DropoutOp

aten = torch.ops.aten


class TraceError(RuntimeError):
    """The model cannot be captured (torch.export) or traced (torch.fx); the message names the
    model's source line and what to change."""


_DROPOUTS = {aten.dropout.default: "dropout", aten.feature_dropout.default: "feature_dropout",
             aten.alpha_dropout.default: "alpha_dropout"}
_DROPOUTS_INPLACE = {aten.dropout_.default: "dropout",
                     aten.feature_dropout_.default: "feature_dropout",
                     aten.alpha_dropout_.default: "alpha_dropout"}
"""``nn.Dropout2d(inplace=True)`` (smp's FPN): the same module, out of place, where nothing
else reads the tensor it would have overwritten."""


def where(n: fx.Node) -> str:
    """Where ``n`` comes from in the user's code: 'module path (Class), file:line' as far as
    known (export records both), or ''."""
    parts = []
    stack = n.meta.get("nn_module_stack")
    if stack:
        path, cls = list(stack.values())[-1]
        cls = cls if isinstance(cls, str) else getattr(cls, "__name__", str(cls))
        if path:
            parts.append(f"module {pretty_path(path)!r} ({cls.rsplit('.', 1)[-1]})")
    line = _last_frame(n.meta.get("stack_trace") or "")
    if line:
        parts.append(line)
    return ", ".join(parts)


def _last_frame(trace: str) -> str:
    frames = re.findall(r'File "([^"]+)", line (\d+)', trace)
    outside = [f for f in frames if "/torch/" not in f[0]]  # the model's line, not torch's
    if not frames:
        return ""
    file, line = (outside or frames)[-1]
    return f"{_short_file(file)}:{line}"


def _short_file(file: str) -> str:
    """A source file as a user reads it: relative to site-packages or the working folder."""
    m = re.search(r"site-packages/(.*)$", file)
    if m:
        return m.group(1)
    here = os.getcwd() + os.sep
    return file[len(here):] if file.startswith(here) else file


def capture(model: nn.Module, example: torch.Tensor) -> fx.GraphModule:
    """``model`` captured by ``torch.export`` on a fake copy of ``example`` (a real, meta or
    fake tensor: only its shape and dtype are read), normalised by :func:`normalize`."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    first = next(iter(model.parameters()), None)
    device = first.device if first is not None else torch.device("cpu")
    running: list[str] = []  # the modules whose forward is running, outermost first

    def enter(name: str) -> Callable[..., None]:
        return lambda *_: running.append(name)  # a pre-hook returning None changes nothing

    def leave(*_: Any) -> None:
        running.pop()

    hooks = [h for name, m in model.named_modules() if name
             for h in (m.register_forward_pre_hook(enter(name)),
                       m.register_forward_hook(leave))]
    # a dataclass output becomes a pytree node before export flattens it
    hooks.append(model.register_forward_hook(lambda _m, _a, out: register_types(out)))
    try:
        with mode, _quiet_torch_logs(), contextlib.redirect_stderr(io.StringIO()), lazy_code():
            fake = torch.empty(tuple(example.shape), dtype=example.dtype, device=device)
            ep = torch.export.export(model, (fake,), strict=False)
    except Exception as e:  # noqa: BLE001 - re-raised with what to change
        inner = running[-1] if running else ""
        what = f" in module {inner!r} ({type(model.get_submodule(inner)).__name__})" \
            if inner else ""
        raise TraceError(_explain(model, e, what)) from e
    finally:
        for h in hooks:
            h.remove()
    with lazy_code():
        gm = normalize(ep.module(), type(model).__name__)
    gm.train(model.training)
    _not_state(gm, ep.constants)
    gm.meta[MODEL_KEYS] = ModelKeys.of(model)  # the names export keeps only one of
    for m in gm.modules():  # the mode each op was captured in (a frozen BatchNorm stays so)
        if isinstance(m, (BatchNormOp, DropoutOp)):
            m.train(m.captured_training)
    return gm


def _not_state(gm: fx.GraphModule, constants: Iterable[str]) -> None:
    """Tensors export lifted out of the forward (the constants MONAI's SwinUNETR builds its
    shifted-window mask from) and the model's non-persistent buffers are read by the graph but
    are not the model's state: they stay out of ``state_dict`` as on one process."""
    for path in constants:
        *parents, leaf = str(path).split(".")
        try:
            owner = gm.get_submodule(".".join(parents))
        except AttributeError:
            continue
        if leaf in owner._buffers:
            owner._non_persistent_buffers_set.add(leaf)


_NOISY = ("torch._subclasses.fake_tensor", "torch.fx.experimental.symbolic_shapes",
          "torch._export", "torch.export", "torch._dynamo")


@contextlib.contextmanager
def _quiet_torch_logs() -> Iterator[None]:
    """torch logs a failed capture's traceback and graph itself; the TraceError says it
    better, so those loggers are silenced while capturing (and restored after)."""
    loggers = [logging.getLogger(name) for name in _NOISY]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL + 1)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)


def _explain(model: nn.Module, e: Exception, module: str = "") -> str:
    text = str(e)
    frames = re.findall(r'File "([^"]+)", line (\d+), in (\w+)', text)
    user = [f for f in frames if "/torch/" not in f[0] and os.path.exists(f[0])]
    at = ""
    if user:
        file, line, fn = user[-1]
        code = linecache.getline(file, int(line)).strip()
        at = f" at {_short_file(file)}:{line} in {fn}" + (f" (`{code}`)" if code else "")
    first = text.strip().splitlines()[0] if text.strip() else type(e).__name__
    data_dependent = any(k in text for k in ("data-dependent", "data dependent",
                                             "GuardOnDataDependent", "DataDependent"))
    too_small = any(k in text for k in ("too small", "can't be greater", "must be greater"))
    if data_dependent:
        hint = ("the model's Python branches on a tensor's *value* (not its shape), which has "
                "no single graph: express the choice with tensor ops (torch.where, masks)")
    elif too_small:
        hint = ("is the image large enough for every stride and pooling window? Use a larger "
                "example input (image size)")
    else:
        hint = ("torch.export runs the model once on a fake input of the example's shape; "
                "check that the model runs on a batch of that shape")
    return (f"torch.export could not capture {type(model).__name__}{module}{at}: "
            f"{type(e).__name__}: {first}\n{hint}.")


def normalize(exported: fx.GraphModule, class_name: str) -> fx.GraphModule:
    """A plain ``fx.GraphModule`` (no pytree code generation, no export guard) over the same
    tensors, with mode-dependent ops as :class:`BatchNormOp` / :class:`DropoutOp` modules."""
    inline_blocks(exported)
    graph = exported.graph
    for n in list(graph.nodes):
        if n.op == "call_module" and str(n.target).startswith("_guards"):
            graph.erase_node(n)
        elif n.target is torch.ops.aten._assert_tensor_metadata.default and not n.users:
            graph.erase_node(n)  # export's check of a dtype it saw (MONAI's .to(x.dtype))
    out = next(n for n in graph.nodes if n.op == "output")
    codegen = graph._codegen
    spec = getattr(getattr(codegen, "pytree_info", None), "out_spec", None)
    flat = list(out.args[0]) if isinstance(out.args[0], (tuple, list)) else [out.args[0]]
    if spec is not None and spec != LEAF:  # the leaves, flat; the structure as data
        out.args = (tuple(flat),)
    elif spec is not None:
        out.args = (flat[0],)
    graph._codegen = fx.graph.CodeGen()
    gm = graph_module(exported, graph, class_name)
    if spec is not None and spec != LEAF:
        gm.meta[OUT_SPEC] = spec
    _mode_ops(gm)
    fuse_chains(gm)
    gm.graph.lint()
    gm.recompile()
    return gm


def _mode_ops(gm: fx.GraphModule) -> None:
    """Batch norm and dropout as modules that follow ``gm.train()`` / ``gm.eval()``."""
    g = gm.graph
    counters: dict[str, fx.Node] = {}  # owner path -> its num_batches_tracked get_attr
    for n in list(g.nodes):
        if n.op == "get_attr" and f".{n.target}".endswith(".num_batches_tracked"):
            counters[str(n.target).rpartition(".")[0]] = n
    count = 0
    for n in list(g.nodes):
        if n.op != "call_function":
            continue
        if n.target is aten.add_.Tensor and isinstance(n.args[0], fx.Node) and \
                n.args[0] in counters.values() and not n.users:
            g.erase_node(n)  # BatchNormOp counts the batches itself
            continue
        if n.target in (aten.batch_norm.default, aten.instance_norm.default):
            if n.target is aten.instance_norm.default:
                continue  # handled by the norm rules (no mode-dependent counter)
            x, w, b, rm, rv, training, momentum, eps = (list(n.args) + [None] * 9)[:8]
            owner = str(rm.target).rpartition(".")[0] if isinstance(rm, fx.Node) else None
            nbt = counters.get(owner) if owner is not None else None
            name = f"fxpar_bn_{count}"
            count += 1
            op = BatchNormOp(float(momentum), float(eps), owner or "")
            op.captured_training = bool(training)
            gm.add_submodule(name, op)
            with g.inserting_before(n):
                new = g.call_module(name, (x, w, b, rm, rv, nbt))
            replace_node(g, n, new)
        elif n.target in _DROPOUTS or (n.target in _DROPOUTS_INPLACE and isinstance(
                n.args[0], fx.Node) and set(n.args[0].users) == {n}):
            p = float(n.args[1])
            name = f"fxpar_dropout_{count}"
            count += 1
            drop = DropoutOp(p, {**_DROPOUTS, **_DROPOUTS_INPLACE}[n.target])
            drop.captured_training = bool(n.args[2]) if len(n.args) > 2 else True
            gm.add_submodule(name, drop)
            with g.inserting_before(n):
                new = g.call_module(name, (n.args[0],))
            replace_node(g, n, new)
    # a counter's get_attr now read by the BatchNormOp must come before it (export puts the
    # get_attrs first, so it does); unused ones go
    for n in counters.values():
        if not n.users:
            g.erase_node(n)

