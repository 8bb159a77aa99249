"""Stage modules and the tensors that cross between them, from a stage-annotated graph.

torch.fx's ``split_module`` cuts the graph by the ``fxpar.stage`` annotation. Its top-level
graph says which output of which stage feeds which input of which later stage; that becomes a
list of :class:`Transfer` records (pure data: the runtime only follows them). Each stage module
is rebuilt with the original model's attribute paths, so its parameters carry the original names
(``layer2.0.bn1.weight``, not ``layer2_0_bn1.weight``).
"""

from __future__ import annotations

import operator

import torch
from torch import fx

from fxpar.core import meta
from fxpar.core.fxgraph import graph_module, lazy_code
from fxpar.core.meta import TensorInfo
from fxpar.core.outputs import OUT_SPEC, register_spec
from fxpar.core.stages import StageGraph, StageInput, Transfer
from fxpar.core.torchcompat import split_module_tuples
from fxpar.passes.split_stages import StageAssignment
from fxpar.runtime.segments import writes_in_place


def _attr(root: torch.nn.Module, target: str) -> object:
    return operator.attrgetter(target)(root)


def _with_original_names(sub: fx.GraphModule, prefix: str, qualnames: dict[str, str],
                         original_root: torch.nn.Module) -> fx.GraphModule:
    """``sub`` rebuilt so its attributes sit at the original model's paths."""
    graph = sub.graph
    root: dict[str, object] = {}
    for n in graph.nodes:
        if n.op in ("call_module", "get_attr"):
            original = qualnames.get(f"{prefix}.{n.target}", str(n.target))
            try:
                obj = _attr(sub, str(n.target))
            except AttributeError:  # a tensor attribute moved in by _own_attributes
                obj = _attr(original_root, original)
            root[original] = obj
            n.target = original
    gm = graph_module(root, graph, f"Stage{prefix.removeprefix('submod_')}")
    state = original_root.state_dict(keep_vars=True)
    for path in root:  # tensors the graph reads that are not the model's state stay out of it
        if path not in state and isinstance(root[path], torch.Tensor) and \
                not isinstance(root[path], torch.nn.Parameter):
            *parents, leaf = path.split(".")
            gm.get_submodule(".".join(parents))._non_persistent_buffers_set.add(leaf)
    return gm


def mutated_inputs(gm: fx.GraphModule) -> frozenset[int]:
    """Positions of ``gm``'s inputs that an in-place op writes to (as its first argument)."""
    out = set()
    for i, ph in enumerate(n for n in gm.graph.nodes if n.op == "placeholder"):
        if any(writes_in_place(gm, u) and u.args and u.args[0] is ph for u in ph.users):
            out.add(i)
    return frozenset(out)


def _own_attribute(sub: fx.GraphModule, placeholder: fx.Node, target: str,
                   before: fx.Node) -> fx.Node:
    """split_module passes tensor attributes (a root-level ``weight``) in as inputs; make the
    stage read them itself (a ``get_attr`` just before ``before``), so it owns (and trains)
    them. The tensor is attached when the stage is rebuilt (:func:`_with_original_names`), so
    the node is made without looking it up. Returns the node."""
    with sub.graph.inserting_before(before):
        node = sub.graph.create_node("get_attr", target)
    node.meta = placeholder.meta.copy()
    placeholder.replace_all_uses_with(node)
    sub.graph.erase_node(placeholder)
    return node


def build_stages(gm: fx.GraphModule) -> StageGraph:
    """Split a stage-annotated GraphModule into stage modules and transfers."""
    qualnames: dict[str, str] = {}
    with lazy_code():  # the split's modules are read, never run
        top = split_module_tuples(gm, lambda n: meta.get(n, StageAssignment).stage, qualnames)
    calls = [n for n in top.graph.nodes if n.op == "call_module"]
    stage_of = {n: int(str(n.target).removeprefix("submod_")) for n in calls}
    count = len(calls)
    if sorted(stage_of.values()) != list(range(count)):
        raise AssertionError(f"split_module produced stages {sorted(stage_of.values())}")
    placeholders = [n for n in top.graph.nodes if n.op == "placeholder"]
    modules: list[fx.GraphModule] = [None] * count  # type: ignore[list-item]
    inputs: list[tuple[StageInput, ...]] = [()] * count
    n_outputs = [0] * count
    transfers: list[Transfer] = []
    for call in calls:
        k = stage_of[call]
        sub = top.get_submodule(str(call.target))
        sub_inputs = [n for n in sub.graph.nodes if n.op == "placeholder"]
        out_node = next(n for n in sub.graph.nodes if n.op == "output")
        n_outputs[k] = len(out_node.args[0])
        ins: list[StageInput] = []
        # each get_attr goes before the one made before it: the order the stage's parameters
        # (and so its optimizer state and checkpoints) have always had
        first = next(n for n in sub.graph.nodes if n.op != "placeholder")
        q = -1
        for arg, ph in zip(call.args, sub_inputs, strict=True):
            if arg.op == "get_attr":
                first = _own_attribute(sub, ph, str(arg.target), first)
                continue
            q += 1
            if arg in placeholders:
                ins.append(StageInput("batch", placeholders.index(arg)))
                continue
            if arg.op == "call_function" and arg.target is operator.getitem:
                producer, out_index = arg.args
            else:
                raise AssertionError(f"unexpected stage input {arg.format_node()}")
            info = meta.get(ph, TensorInfo)
            lay = ph.meta.get("fxpar.spatial")
            t = Transfer(len(transfers), stage_of[producer], int(out_index), k, q,
                         info.shape, info.dtype, tiled=bool(lay is not None and lay.tiled))
            transfers.append(t)
            ins.append(StageInput("transfer", t.id))
        inputs[k] = tuple(ins)
        modules[k] = _with_original_names(sub, str(call.target), qualnames, gm)
    spec = gm.meta.get(OUT_SPEC)
    return StageGraph(tuple(modules), tuple(inputs), tuple(n_outputs), tuple(transfers),
                      tuple(mutated_inputs(m) for m in modules),
                      register_spec(spec) if spec is not None else None)
