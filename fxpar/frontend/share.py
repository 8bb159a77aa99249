"""One capture for the ranks of a job: the first rank traces the model, the others receive it.

Every rank of a job compiles the same program from the same model, and capturing it
(``torch.export`` plus the analysis on fake tensors, :func:`fxpar.frontend.trace.trace`) is
most of a compile: 85 % of ResNet-50's. When ranks outnumber cores (several ranks per GPU node
sharing its CPUs, or the test suite's oversubscribed ranks) that work is done once per rank for
nothing. ``fxpar.compile(..., comm=comm)`` traces on ``comm``'s rank 0 only and sends the traced
graph to the others as data (:func:`pack`): its nodes, the metadata the compiler reads
(shapes, costs, module paths and source lines for messages), fxpar's mode-op modules, and the
names under which each rank's own model holds the tensors; a tensor the model does not hold
(a constant export lifted out of the forward) travels by value. Every rank then runs the same
passes on the same graph, over its own model's parameters.

A failure to trace on rank 0 is raised on every rank (the same error type and message), so no
rank waits for a graph that never comes.
"""

from __future__ import annotations

import io
import os
import pickle
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn

from fxpar.comm.protocol import Comm
from fxpar.core.fxgraph import graph_module
from fxpar.core.outputs import OUT_SPEC
from fxpar.frontend.capture import TraceError
from fxpar.frontend.capture_store import CaptureStore, code_digest
from fxpar.frontend.trace import trace

KEPT_META = ("nn_module_stack", "stack_trace")
"""The torch.export metadata the compiler reads after tracing (messages name the module and
source line); fxpar's own keys (``fxpar.*``) are kept too. Fake values (``val``) stay behind:
nothing after the analysis reads them."""

WAIT_POLL = 0.002
"""Seconds between tests of the ranks waiting for rank 0's capture (a polled barrier before
the broadcast): they sleep through the seconds it takes instead of spinning in MPI's busy
wait, which, with more ranks than cores (several ranks per GPU node, or the demo's 5 ranks on
2 cores), took the cores from rank 0 while it traced for them."""


@dataclass(frozen=True)
class _Ref:
    """A node in a packed node's arguments, by name."""

    name: str


@dataclass(frozen=True)
class _Op:
    """An ATen (or other ``torch.ops``) overload, by its qualified name: ``aten::conv2d``
    with overload ``default``."""

    qualified: str
    overload: str

    def resolve(self) -> torch._ops.OpOverload:
        ns, _, name = self.qualified.partition("::")
        return getattr(getattr(getattr(torch.ops, ns), name), self.overload)


@dataclass(frozen=True)
class _Tensor:
    """A tensor of the traced module: where it hangs, what it is registered as, and either
    the model's name for it (each rank binds its own model's tensor) or its value."""

    path: str
    kind: str  # "parameter", "buffer" or "attribute"
    persistent: bool
    model_name: str | None
    value: torch.Tensor | None


class _Pickler(pickle.Pickler):
    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, torch._ops.OpOverload):
            return _Op, (obj._schema.name, obj._overloadname)
        return NotImplemented


def _pickle(obj: object) -> bytes:
    buf = io.BytesIO()
    _Pickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    return buf.getvalue()


def pack(gm: fx.GraphModule, model: nn.Module) -> bytes:
    """The traced ``gm`` of ``model`` as bytes :func:`unpack` rebuilds over an equal model."""
    names: dict[int, str] = {}
    for name, t in [*model.named_parameters(remove_duplicate=False),
                    *model.named_buffers(remove_duplicate=False)]:
        names.setdefault(id(t), name)
    tensors: list[_Tensor] = []
    modules: dict[str, Any] = {}
    training: dict[str, bool] = {}
    called = {str(n.target) for n in gm.graph.nodes if n.op == "call_module"}
    for path, mod in gm.named_modules(remove_duplicate=False):
        training[path] = mod.training
        if path in called:
            if any(True for _ in mod.parameters()) or any(True for _ in mod.buffers()):
                raise TraceError(f"cannot send the traced module {path!r} "
                                 f"({type(mod).__name__}): it holds tensors")
            modules[path] = mod
            continue
        prefix = f"{path}." if path else ""
        entries = [*(("parameter", k, v) for k, v in mod._parameters.items()),
                   *(("buffer", k, v) for k, v in mod._buffers.items()),
                   *(("attribute", k, v) for k, v in vars(mod).items()
                     if isinstance(v, torch.Tensor))]
        for kind, key, t in entries:
            if t is None:
                continue
            own = names.get(id(t))
            tensors.append(_Tensor(prefix + key, kind,
                                   key not in mod._non_persistent_buffers_set, own,
                                   None if own is not None else t.detach()))
    spec = gm.meta.get(OUT_SPEC)
    if spec is not None:
        try:
            _pickle(spec)
        except (pickle.PicklingError, AttributeError, TypeError) as e:
            raise TraceError(f"the model's output type cannot be sent to the other ranks "
                             f"({e}): define its classes at the top level of a module they "
                             f"import (or of the script every rank runs)") from e
    nodes = []
    for n in gm.graph.nodes:
        refs = fx.node.map_arg((n.args, n.kwargs), lambda a: _Ref(a.name))
        kept = {k: v for k, v in n.meta.items() if k in KEPT_META or k.startswith("fxpar.")}
        nodes.append((n.name, n.op, n.target, *refs, kept))
    return _pickle({"class": type(gm).__name__, "nodes": nodes, "tensors": tensors,
                    "modules": modules, "training": training, "meta": gm.meta})


def unpack(data: bytes, model: nn.Module) -> fx.GraphModule:
    """The traced graph :func:`pack` sent, over ``model``'s own parameters and buffers."""
    got = pickle.loads(data)
    root = nn.Module()
    for path, mod in got["modules"].items():
        _place(root, path, mod)
    _register(root, got["tensors"], model)
    graph = fx.Graph()
    made: dict[str, fx.Node] = {}
    for name, op, target, args, kwargs, meta in got["nodes"]:
        args, kwargs = fx.node.map_aggregate(
            (args, kwargs), lambda a: made[a.name] if isinstance(a, _Ref)
            else a.resolve() if isinstance(a, _Op) else a)
        target = target.resolve() if isinstance(target, _Op) else target
        node = graph.create_node(op, target, args, kwargs, name)
        if node.name != name:
            raise TraceError(f"the received graph names a node {name!r} twice")
        node.meta.update(meta)
        made[name] = node
    gm = graph_module(root, graph, got["class"])
    # GraphModule copies only what a node reads: the tensors of modules whose forward never
    # runs (unused layers), which the traced module keeps for the state_dict, go on again
    _register(gm, [t for t in got["tensors"] if not _holds(gm, t.path)], model)
    gm.meta.update(got["meta"])
    for path, mod in gm.named_modules(remove_duplicate=False):
        mod.training = got["training"].get(path, mod.training)
    return gm


def _register(root: nn.Module, tensors: list[_Tensor], model: nn.Module) -> None:
    """Hang each of ``tensors`` under ``root`` as it was registered: ``model``'s own tensor
    where it has one, else the value that travelled."""
    for t in tensors:
        value = t.value if t.model_name is None else _model_tensor(model, t.model_name)
        owner, _, key = t.path.rpartition(".")
        parent = _place(root, owner, None)
        if t.kind == "parameter":
            parent.register_parameter(key, value)
        elif t.kind == "buffer":
            parent.register_buffer(key, value, persistent=t.persistent)
        else:
            setattr(parent, key, value)


def _holds(root: nn.Module, path: str) -> bool:
    owner, _, key = path.rpartition(".")
    try:
        mod = root.get_submodule(owner)
    except AttributeError:
        return False
    return key in mod._parameters or key in mod._buffers or key in vars(mod)


def _model_tensor(model: nn.Module, name: str) -> torch.Tensor:
    owner, _, key = name.rpartition(".")
    try:
        mod = model.get_submodule(owner)
        return getattr(mod, key)
    except AttributeError:
        raise TraceError(f"this rank's model has no tensor {name!r}, which rank 0's model "
                         f"has: every rank must build the same model") from None


def _place(root: nn.Module, path: str, mod: nn.Module | None) -> nn.Module:
    """The submodule at ``path`` under ``root``, made (``mod``, or empty modules on the way)
    where missing."""
    here = root
    parts = path.split(".") if path else []
    for i, part in enumerate(parts):
        child = here._modules.get(part)
        if child is None:
            child = mod if i == len(parts) - 1 and mod is not None else nn.Module()
            here.add_module(part, child)
        here = child
    return here


class CaptureCache:
    """Captures kept for later models of the same structure: in this process, and in
    ``folder`` for later processes.

    ``fxpar.compile(model, plan, x, captures=cache)`` looks ``model`` up by its structure (see
    :func:`structure`) and the example input's shape and dtype: the first such model is traced,
    each later one gets the same graph rebuilt over its own parameters (:func:`unpack`), as
    ranks of a job do. For compiling one model under several plans, or many models of a few
    kinds (a test suite). The structure is what the module tree shows -- classes, training
    modes, tensors, and every plain attribute -- not the ``forward`` code's free variables: a
    model whose graph depends on a global setting must not share a cache across that setting.

    folder: also keep each capture there, and look there first (fxpar.frontend.capture_store:
    the files are keyed by the source of the model's packages and fxpar, and torch's version,
    as well); ``FXPAR_CAPTURE_CACHE`` gives every compile without ``captures`` such a cache."""

    def __init__(self, folder: str | os.PathLike[str] | None = None) -> None:
        self._packed: dict[tuple[object, ...], bytes] = {}
        self.store = CaptureStore(folder) if folder else None
        self.hits = 0
        """How many captures were taken from the cache instead of traced."""
        self.disk_hits = 0
        """How many of those were read from ``folder``."""

    def packed(self, model: nn.Module, example: torch.Tensor | Sequence[int]) -> bytes:
        """:func:`pack` of ``model``'s trace at ``example``: kept, or traced now and kept."""
        key = (_signature(model, example), structure(model))
        if key in self._packed:
            self.hits += 1
            return self._packed[key]
        if self.store is None:
            found = pack(trace(model, example), model)
        else:
            disk = repr((key, code_digest(model)))
            found = self.store.get(disk)
            if found is None:
                found = pack(trace(model, example), model)
                self.store.put(disk, found)
            else:
                self.hits += 1
                self.disk_hits += 1
        self._packed[key] = found
        return found


_PLAIN = (bool, int, float, str, type(None), torch.dtype, torch.device, torch.Size)


def _setting(value: object) -> object:
    """A module attribute as a key: plain values (and tuples, lists, dicts of them) as they
    are, anything else by its type and repr."""
    if isinstance(value, _PLAIN):
        return value
    if isinstance(value, tuple | list):
        return (type(value).__name__, *map(_setting, value))
    if isinstance(value, dict):
        return ("dict", *((repr(k), _setting(v)) for k, v in value.items()))
    return (type(value).__module__, type(value).__qualname__, repr(value))


def structure(model: nn.Module) -> tuple[object, ...]:
    """What a trace of ``model`` depends on besides the example input and the classes' code:
    each module's path, class, training mode, hooks and plain attributes (settings such as a
    stride, an ``inplace`` flag or a config object's repr); each tensor's path, shape, dtype,
    device and ``requires_grad``; which paths share one tensor."""
    first: dict[int, str] = {}
    tensors = []
    for name, t in [*model.named_parameters(remove_duplicate=False),
                    *model.named_buffers(remove_duplicate=False)]:
        tensors.append((name, tuple(t.shape), str(t.dtype), t.device.type, t.requires_grad,
                        first.setdefault(id(t), name)))
    modules = []
    for path, mod in model.named_modules(remove_duplicate=False):
        attrs = tuple((k, _setting(v)) for k, v in sorted(vars(mod).items())
                      if k not in ("_parameters", "_buffers", "_modules")
                      and not isinstance(v, torch.Tensor))
        modules.append((path, type(mod).__module__, type(mod).__qualname__, attrs))
    return tuple(modules), tuple(tensors)


def shared_trace(model: nn.Module, example: torch.Tensor | Sequence[int],
                 comm: Comm | None, captures: CaptureCache | None = None,
                 plan: dict[str, object] | None = None) -> fx.GraphModule:
    """:func:`trace` on ``comm``'s rank 0, received by its other ranks (each over its own
    ``model``); every rank traces for itself when ``comm`` is None or has one rank.
    ``captures``: where rank 0 (or the one process) looks the capture up first. ``plan``: the
    plan's fields, which every rank must agree on too (a rank given another plan is told which
    fields differ, before its other differences show)."""
    if comm is None or comm.size == 1:
        if captures is None:
            return trace(model, example)
        return unpack(captures.packed(model, example), model)
    mine = (_signature(model, example), plan)
    if comm.rank == 0:
        try:
            data = captures.packed(model, example) if captures is not None else \
                pack(trace(model, example), model)
            sent: tuple[str, object] = ("graph", (mine, data))
        except Exception as e:  # noqa: BLE001 - every rank raises it, not only this one
            comm.barrier(poll=WAIT_POLL)
            comm.bcast_object(("error", (type(e), str(e))), root=0)
            raise
        comm.barrier(poll=WAIT_POLL)
        comm.bcast_object(sent, root=0)
    else:
        comm.barrier(poll=WAIT_POLL)  # asleep while rank 0 traces
        sent = comm.bcast_object(None, root=0)
    kind, value = sent
    if kind == "error":
        error_type, message = value  # type: ignore[misc]
        message = f"{message}\n(raised on rank 0, which traced the model for every rank)"
        try:
            error = error_type(message)
        except Exception:  # noqa: BLE001 - a type whose constructor takes other arguments
            error = TraceError(message)
        raise error
    theirs, data = value  # type: ignore[misc]
    if theirs[1] != mine[1] and theirs[1] is not None and mine[1] is not None:
        differ = ", ".join(f"{k}: {theirs[1].get(k)!r} vs {mine[1].get(k)!r}"
                           for k in sorted(set(theirs[1]) | set(mine[1]))
                           if theirs[1].get(k) != mine[1].get(k))
        raise TraceError(f"rank {comm.rank} compiles another plan than rank 0 ({differ}, rank "
                         f"0's first): every rank must compile the same plan (give every rank "
                         f"the same command line)")
    if theirs[0] != mine[0]:
        raise TraceError(f"rank {comm.rank} compiles for input {mine[0]} but rank 0, which "
                         f"traced the model for every rank, for {theirs[0]}: every rank must "
                         f"compile the same model for the same example input")
    # rank 0 too builds its graph from the bytes: every rank runs the passes on the same graph
    return unpack(data, model)


def _signature(model: nn.Module, example: torch.Tensor | Sequence[int]) -> tuple[object, ...]:
    """What a traced graph depends on besides the model's code: the input's shape and dtype
    (a shape alone traces in the parameters' dtype), and the model's class."""
    dtype = example.dtype if isinstance(example, torch.Tensor) else \
        next((p.dtype for p in model.parameters()), torch.float32)
    shape = tuple(example.shape) if isinstance(example, torch.Tensor) else tuple(example)
    return type(model).__qualname__, tuple(int(d) for d in shape), str(dtype)
