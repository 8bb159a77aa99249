"""Pass: mixed precision (``Plan(precision="bf16" | "fp16")``) — autocast's casts as graph nodes.

``torch.autocast`` decides per op, in the dispatcher, which inputs to cast: convolutions and
matrix products run in the compute dtype, some ops (reflect / replicate padding, 3-D pooling,
losses) in float32, everything else in the dtype its inputs already have. fxpar replaces many
of those ops by its own tile ops (halo convolutions, synchronised norms), where the
dispatcher's decision would come too late (inside an autograd Function, after the halo was
sent in float32) or not at all. So this pass asks the dispatcher once, at compile time, and
writes its answer into the graph: every op whose result under ``torch.autocast`` differs
from its result without it gets explicit ``aten._to_copy`` casts of its floating inputs, as
autocast would make them. Before (bf16)::

    conv2d = torch.ops.aten.conv2d.default(x, conv1_weight, None, [2, 2], [3, 3])

after::

    _to_copy = torch.ops.aten._to_copy.default(x, dtype=torch.bfloat16)
    _to_copy_1 = torch.ops.aten._to_copy.default(conv1_weight, dtype=torch.bfloat16)
    conv2d = torch.ops.aten.conv2d.default(_to_copy, _to_copy_1, None, [2, 2], [3, 3])

The program then needs no autocast at run time (only the loss runs under it, as in a user's
``with torch.autocast(...)`` block): parameters stay float32 (the casts' backward returns
float32 gradients: float32 master weights and optimizer state), activations, halos and
pipeline messages are in the compute dtype, and it behaves the same on every device. The
policy is that of CPU autocast (the device fxpar compiles on); the graph is re-analysed so
that shapes, dtypes, message sizes and memory estimates follow the casts.

A model's own ``with torch.autocast(...)`` blocks (captured as an ``AutocastRegion`` on each of
their ops, fxpar.frontend.hops) decide for their ops: ``enabled=False`` (EfficientViT's linear
attention) gets no casts, whatever the plan, as autocast makes none there on one process;
``enabled=True`` gets the casts of the block's dtype, under any plan (``"fp32"`` too), on
every device: the block's device type is not consulted.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from fxpar.core import meta
from fxpar.core.meta import TensorInfo
from fxpar.core.plan import PRECISION_DTYPES, Plan
from fxpar.frontend.hops import AutocastRegion
from fxpar.frontend.trace import analyze

aten = torch.ops.aten


class _CastLog(TorchDispatchMode):
    """Records the casts (``aten._to_copy`` to another dtype) made of the watched tensors."""

    def __init__(self, watched: dict[int, torch.Tensor]) -> None:
        super().__init__()
        self.watched = watched
        self.casts: set[tuple[int, torch.dtype]] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is aten._to_copy.default and args and id(args[0]) in self.watched:
            dtype = kwargs.get("dtype")
            if dtype is not None and dtype != args[0].dtype:
                self.casts.add((id(args[0]), dtype))
        return func(*args, **kwargs)


AUTOCAST_DTYPES = (torch.bfloat16, torch.float16)
"""The dtypes CPU autocast computes in (the policy the pass asks)."""


def cast_dtype(n: fx.Node, dtype: torch.dtype | None) -> torch.dtype | None:
    """The dtype autocast computes ``n`` in: the plan's ``dtype`` (None: no autocast), unless
    the model's own autocast block around ``n`` says otherwise."""
    region = meta.find(n, AutocastRegion)
    if region is None:
        return dtype
    if not region.enabled:
        return None
    if region.dtype not in AUTOCAST_DTYPES:
        raise NotImplementedError(
            f"{n.name}: the model computes under torch.autocast(dtype={region.dtype}), which "
            f"fxpar does not support inside a model (only {AUTOCAST_DTYPES}); remove the "
            "block, or give the whole model one precision with Plan(precision=...)")
    return region.dtype


class _Probe(fx.Interpreter):
    """Runs the graph on fake CPU tensors under autocast and records, per node, the casts
    autocast makes of its inputs that the op would not make without autocast."""

    def __init__(self, gm: fx.GraphModule, dtype: torch.dtype | None) -> None:
        super().__init__(gm)
        self.dtype = dtype
        self.casts: dict[fx.Node, dict[fx.Node, torch.dtype]] = {}
        self._attrs: dict[str, torch.Tensor] = {}

    def placeholder(self, target: Any, args: Any, kwargs: Any) -> Any:
        n = next(n for n in self.module.graph.nodes
                 if n.op == "placeholder" and n.target == target)
        info = meta.get(n, TensorInfo)
        return torch.empty(info.shape, dtype=info.dtypes[0])

    def get_attr(self, target: Any, args: Any, kwargs: Any) -> Any:
        value = super().get_attr(target, args, kwargs)
        if not isinstance(value, torch.Tensor):
            return value
        if target not in self._attrs:  # a CPU fake of the parameter (which may be on meta)
            self._attrs[target] = torch.empty(value.shape, dtype=value.dtype)
        return self._attrs[target]

    def run_node(self, n: fx.Node) -> Any:
        dtype = cast_dtype(n, self.dtype)
        if n.op not in ("call_function", "call_module") or dtype is None:
            return super().run_node(n)
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        watched = {id(t): t for t in _tensors((args, kwargs))}
        with _CastLog(watched) as log, torch.autocast("cpu", dtype=dtype):
            out = getattr(self, n.op)(n.target, args, kwargs)
        if log.casts:
            try:
                with _CastLog(watched) as plain:
                    getattr(self, n.op)(n.target, args, kwargs)
                made = log.casts - plain.casts
            except Exception:  # noqa: BLE001 - mixed dtypes that only autocast's casts fix
                made = log.casts
            by_id = dict(made)
            inputs = {a: by_id[id(self.env[a])] for a in n.all_input_nodes
                      if id(self.env[a]) in by_id}
            if inputs:
                self.casts[n] = inputs
        return out


def _tensors(x: Any) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(x) if isinstance(t, torch.Tensor)]


def autocast_casts(gm: fx.GraphModule, dtype: torch.dtype
                   ) -> dict[fx.Node, dict[fx.Node, torch.dtype]]:
    """node -> {input node: the dtype autocast casts it to} for ``gm``'s nodes, asked of the
    dispatcher on fake CPU tensors (no memory)."""
    probe = _Probe(gm, dtype)
    with FakeTensorMode(allow_non_fake_inputs=True):
        probe.run()
    return probe.casts


def insert_casts(gm: fx.GraphModule, casts: dict[fx.Node, dict[fx.Node, torch.dtype]]
                 ) -> None:
    """Put an ``aten._to_copy`` before each node of ``casts`` for each input it names (the
    node's own copy, so a cast never crosses a stage boundary)."""
    g = gm.graph
    for n, inputs in casts.items():
        made: dict[fx.Node, fx.Node] = {}
        for a, dtype in inputs.items():
            with g.inserting_before(n):
                c = g.call_function(aten._to_copy.default, (a,), {"dtype": dtype})
            for key in ("nn_module_stack", "stack_trace"):
                if key in n.meta:
                    c.meta[key] = n.meta[key]
            made[a] = c
        n.args = fx.node.map_arg(n.args, lambda a, m=made: m.get(a, a))  # type: ignore
        n.kwargs = fx.node.map_arg(n.kwargs, lambda a, m=made: m.get(a, a))  # type: ignore


def precision(gm: fx.GraphModule, plan: Plan) -> fx.GraphModule:
    """The pass: nothing for ``precision="fp32"`` (unless the model has an enabled autocast
    block); else autocast's casts made explicit and the graph re-analysed (shapes, dtypes,
    costs)."""
    dtype = PRECISION_DTYPES[plan.precision]
    if dtype is None and not any(r.enabled for n in gm.graph.nodes
                                 if (r := meta.find(n, AutocastRegion)) is not None):
        return gm
    insert_casts(gm, autocast_casts(gm, dtype))
    gm.graph.lint()
    gm.recompile()
    inputs = [meta.get(n, TensorInfo) for n in gm.graph.nodes if n.op == "placeholder"]
    analyze(gm, *(torch.empty(i.shape, dtype=i.dtypes[0], device="meta") for i in inputs))
    return gm
