"""Tracing and analysis: model -> GraphModule with shapes and costs on every node.

Analysis runs torch.fx's ShapeProp on *fake* tensors (torch._subclasses.FakeTensorMode): the
example input may be a real, a ``meta`` or a fake tensor, and no image-sized memory is ever
allocated, so a 16384x16384 ResNet-152 is analysed in about the memory of its parameters.
FLOPs come from torch's own FlopCounterMode, run per node on the same fake tensors.
"""

from __future__ import annotations

import contextlib
import io
import operator
from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import fx, nn
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    FakeTensor,
    FakeTensorMode,
)
from torch.fx.passes.shape_prop import ShapeProp
from torch.nn.modules.lazy import LazyModuleMixin
from torch.utils.flop_counter import FlopCounterMode, flop_registry

from fxpar.core import meta
from fxpar.core.meta import NodeCost, TensorInfo
from fxpar.frontend.capture import TraceError
from fxpar.frontend.capture import capture as capture_model


def check_model(model: nn.Module) -> None:
    """Raise unless ``model`` is an nn.Module whose parameters all have shapes (lazy modules,
    nn.LazyLinear and the like, get theirs only in their first forward)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"fxpar needs the model as a torch.nn.Module, got "
                        f"{type(model).__name__}: wrap the function in an nn.Module's forward")
    for name, m in model.named_modules():
        if isinstance(m, LazyModuleMixin) and m.has_uninitialized_params():
            raise TraceError(
                f"module {name or 'the model'!r} ({type(m).__name__}) has uninitialized lazy "
                f"parameters: run the model once on a small batch (model(x)) before "
                f"fxpar.compile, or give it explicit sizes (e.g. nn.Linear(in_features, ...))")


def fake_like(example: torch.Tensor | Sequence[int], mode: FakeTensorMode,
              dtype: torch.dtype = torch.float32,
              device: torch.device | str = "cpu") -> torch.Tensor:
    """A fake tensor shaped like ``example`` (a real/meta/fake tensor, or a shape), on
    ``device`` (the parameters' device: meta for a model built without memory)."""
    if isinstance(example, FakeTensor):
        return example
    if isinstance(example, torch.Tensor):
        if example.device.type == "meta" or torch.device(device).type == "meta":
            with mode:
                return torch.empty(example.shape, dtype=example.dtype, device=device)
        return mode.from_tensor(example)
    with mode:
        return torch.empty(tuple(example), dtype=dtype, device=device)


class _Analyzer(ShapeProp):
    """ShapeProp that also counts each node's forward FLOPs and bytes."""

    def run_node(self, n: fx.Node) -> Any:
        try:
            with FlopCounterMode(display=False) as counter:
                result = super().run_node(n)
        except RuntimeError as e:
            cause = e.__cause__ or e
            if not isinstance(cause, DataDependentOutputException):
                module = f" (module {n.target!r})" if n.op == "call_module" else ""
                raise TraceError(
                    f"shape propagation failed at node {n.name!r}{module}: "
                    f"{type(cause).__name__}: {str(cause).splitlines()[0]}\n"
                    f"Check the example input's shape (is the image large enough for every "
                    f"stride and pooling window?) and the model's layer sizes.") from e
            raise TraceError(
                f"node {n.name!r} ({n.op} {n.target!r}) has Python control flow that depends on "
                f"tensor values, which fxpar cannot analyse without running the model on real "
                f"data. Express the choice with tensor ops (torch.where, masks) instead.") from e
        for annotation in _annotations(self.real_module, n, result,
                                       int(counter.get_total_flops())):
            meta.put(n, annotation)
        return result


def _annotations(root: nn.Module, n: fx.Node, result: Any, flops: int
                 ) -> tuple[TensorInfo, NodeCost]:
    """Node ``n``'s shapes and costs from the value it computes (``result``) and its FLOPs."""
    tensors = [t for t in _flatten(result) if isinstance(t, torch.Tensor)]
    info = TensorInfo(tuple(tuple(int(s) for s in t.shape) for t in tensors),
                      tuple(t.dtype for t in tensors))
    return info, NodeCost(flops=flops,
                          # the output node only repeats its inputs' tensors
                          out_bytes=0 if n.op == "output" else
                          sum(t.numel() * t.element_size() for t in tensors),
                          param_bytes=_owned_bytes(root, n))


def _flatten(x: Any) -> Iterable[Any]:
    if isinstance(x, (tuple, list)):
        for y in x:
            yield from _flatten(y)
    elif isinstance(x, dict):
        for y in x.values():
            yield from _flatten(y)
    else:
        yield x


def _owned_bytes(root: nn.Module, n: fx.Node) -> int:
    """Bytes of the parameters and buffers a call_module / get_attr node uses."""
    if n.op == "call_module":
        mod = root.get_submodule(str(n.target))
        tensors = [*mod.parameters(), *mod.buffers()]
    elif n.op == "get_attr":
        obj = root
        for part in str(n.target).split("."):
            obj = getattr(obj, part)
        tensors = [obj] if isinstance(obj, torch.Tensor) else []
    else:
        return 0
    return sum(t.numel() * t.element_size() for t in tensors)


def analyze(gm: fx.GraphModule, *example_inputs: torch.Tensor | Sequence[int],
            reuse_capture: bool = True) -> fx.GraphModule:
    """Annotate every node of ``gm`` with :class:`TensorInfo` and :class:`NodeCost`, running on
    fake tensors (no real activation memory). Returns ``gm`` (annotated in place).

    A graph torch.export captured on inputs of these shapes already carries every node's
    fake value (``node.meta["val"]``): then only the ops that decompose into counted ones run,
    on meta tensors (:func:`_from_capture`, the same annotations in a fraction of the time);
    ``reuse_capture=False`` runs every node on fake tensors regardless."""
    if reuse_capture and _from_capture(gm, example_inputs):
        return gm
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    first = next(iter(gm.parameters()), None)
    dtype = first.dtype if first is not None else torch.float32
    device = first.device if first is not None else torch.device("cpu")
    fakes = [fake_like(x, mode, dtype, device) for x in example_inputs]
    # ShapeProp prints a traceback before raising; the TraceError above says it better.
    analyzer = _Analyzer(gm, fake_mode=mode)
    analyzer.extra_traceback = False  # fx would append "While executing ..." to our message
    with contextlib.redirect_stderr(io.StringIO()):
        analyzer.propagate(*fakes)
    return gm


def _example_like(val: object, example: torch.Tensor | Sequence[int], dtype: torch.dtype) -> bool:
    if not isinstance(val, torch.Tensor):
        return False
    shape = tuple(example.shape) if isinstance(example, torch.Tensor) else tuple(example)
    want = example.dtype if isinstance(example, torch.Tensor) else dtype
    return tuple(val.shape) == shape and val.dtype == want


_BY_DEVICE = frozenset({torch.ops.aten.scaled_dot_product_attention})
"""Ops whose decomposition depends on the device (sdpa picks its kernel by it): counted on
fake tensors of the captured device; the others on meta tensors, which run much faster."""


def _twin(x: Any, device: torch.device | None) -> Any:
    """A tensor's twin (same shape, strides and dtype) on ``device`` (None: on ``meta``), in
    the current fake mode; anything else as it is."""
    if isinstance(x, torch.Tensor):
        return torch.empty_strided(tuple(x.shape), tuple(x.stride()), dtype=x.dtype,
                                   device=x.device if device is None else device)
    return x


def _counted_directly(n: fx.Node) -> bool:
    """True when ``n``'s FLOPs need no run: its op is in torch's FLOP table (counted from the
    shapes) or cannot decompose into one that is (counted as 0, as FlopCounterMode does)."""
    if n.op in ("placeholder", "get_attr", "output"):
        return True
    if n.op != "call_function":
        return False
    if n.target is operator.getitem:
        return True
    if not isinstance(n.target, torch._ops.OpOverload):
        return False
    return n.target.overloadpacket in flop_registry or not _decomposes(n.target)


def _decomposes(op: torch._ops.OpOverload) -> bool:
    """Whether ``op.decompose()`` (what FlopCounterMode tries for an op it has no count for)
    returns something: a CompositeImplicitAutograd kernel, in C++ or in Python (sdpa's)."""
    key = torch._C.DispatchKey.CompositeImplicitAutograd
    return key in op.py_kernels or \
        torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), key)


def _from_capture(gm: fx.GraphModule, example_inputs: Sequence[torch.Tensor | Sequence[int]]
                  ) -> bool:
    """Annotate ``gm`` from the fake values torch.export left on its nodes, when every node has
    one and the placeholders match ``example_inputs``; False (nothing written) otherwise.

    FLOPs: an op in torch's FLOP table is counted from its arguments' shapes
    (``flop_registry``, as FlopCounterMode counts it); one that decomposes (conv2d, linear,
    matmul, sdpa) and modules run once under FlopCounterMode, on meta tensors (fake ones for
    :data:`_BY_DEVICE`); the rest count 0."""
    nodes = list(gm.graph.nodes)
    if any("val" not in n.meta for n in nodes if n.op != "output"):
        return False
    first = next(iter(gm.parameters()), None)
    dtype = first.dtype if first is not None else torch.float32
    holders = [n for n in nodes if n.op == "placeholder"]
    if len(holders) != len(example_inputs) or not all(
            _example_like(n.meta["val"], x, dtype)
            for n, x in zip(holders, example_inputs, strict=True)):
        return False
    found: dict[fx.Node, tuple[TensorInfo, NodeCost]] = {}
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    try:
        for n in nodes:
            found[n] = _annotation(gm, n, mode)
    except Exception:  # noqa: BLE001 - an op meta tensors cannot run: the fake-tensor pass
        return False
    for n, (info, cost) in found.items():
        meta.put(n, info)
        meta.put(n, cost)
    return True


def _annotation(gm: fx.GraphModule, n: fx.Node, mode: FakeTensorMode
                ) -> tuple[TensorInfo, NodeCost]:
    value = n.args[0] if n.op == "output" else n.meta["val"]
    vals = fx.node.map_arg(value, lambda a: a.meta["val"]) if n.op == "output" else value
    flops = 0
    if not _counted_directly(n):
        fn = gm.get_submodule(str(n.target)) if n.op == "call_module" else n.target
        by_device = getattr(fn, "overloadpacket", None) in _BY_DEVICE
        with mode if by_device else contextlib.nullcontext():
            args = fx.node.map_arg((n.args, n.kwargs), lambda a: pytree.tree_map(
                lambda t: _twin(t, None if by_device else torch.device("meta")),
                a.meta["val"]))
            with FlopCounterMode(display=False) as counter:
                fn(*args[0], **args[1])
        flops = int(counter.get_total_flops())
    elif n.op == "call_function" and n.target is not operator.getitem:
        count = flop_registry.get(n.target.overloadpacket)
        if count is not None:
            args = fx.node.map_arg((n.args, n.kwargs), lambda a: a.meta["val"])
            flops = int(count(*args[0], **args[1], out_val=value))
    return _annotations(gm, n, vals, flops)


def trace(model: nn.Module, *example_inputs: torch.Tensor | Sequence[int]) -> fx.GraphModule:
    """Capture ``model`` (torch.export on a fake input, see capture.py) and analyse it on fake
    copies of ``example_inputs``: an ATen-level graph with shapes and costs on every node.

    ``example_inputs`` may be real tensors, ``meta`` tensors, or plain shapes such as
    ``(8, 3, 16384, 16384)``: only their shapes and dtypes are used.
    """
    check_model(model)
    first = next(iter(model.parameters()), None)
    dtype = first.dtype if first is not None else torch.float32
    examples = [x if isinstance(x, torch.Tensor) else torch.empty(tuple(x), dtype=dtype,
                                                                  device="meta")
                for x in example_inputs]
    if len(examples) != 1:
        raise TraceError(f"fxpar captures models of one input tensor, got "
                         f"{len(examples)} example inputs")
    return analyze(capture_model(model, examples[0]), *example_inputs)


def totals(gm: fx.GraphModule) -> NodeCost:
    """Sum of every node's cost (parameter bytes counted once per module use)."""
    costs = [c for n in gm.graph.nodes if (c := meta.find(n, NodeCost)) is not None]
    return NodeCost(flops=sum(c.flops for c in costs),
                    out_bytes=sum(c.out_bytes for c in costs),
                    param_bytes=sum(c.param_bytes for c in costs))
