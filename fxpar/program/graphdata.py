"""A stage module as data: its fx graph, submodules and tensors as JSON, and back again.

``fxpar.program.emit`` writes each stage's ``graph.json`` beside its generated ``module.py`` (which
stays, for reading); ``fxpar.program.loader`` builds the stage from ``graph.json`` and
``weights.pt`` (read with ``weights_only=True``). Loading a saved program therefore runs no
code from its folder: every function a node calls, every class a submodule is made from and
every value type is named in the JSON and resolved against a fixed list of homes (ATen ops
through ``torch.ops``, ``operator``, ``math``, ``torch`` and ``fxpar``), so a folder from
elsewhere can at worst name a function fxpar itself or torch defines; anything else is a
:class:`PlanError` naming it.

One node is one JSON object::

    {"name": "conv2d", "op": "call_function", "target": {"aten": "conv2d.default"},
     "args": [{"node": "x"}, {"node": "conv1.weight"}, null, {"tuple": [2, 2]}, ...]}

Values keep their Python types through one-key tags (fxpar.core.values, which fxpar's custom
ops share): ``{"tuple": [...]}``, ``{"node": name}``, ``{"dataclass": "module:Class", "fields":
{...}}`` (fxpar's own records, such as a halo exchange) and so on.
"""

from __future__ import annotations

import operator
from operator import attrgetter
from typing import Any

import torch
from torch import fx, nn

from fxpar.core.fxgraph import graph_module
from fxpar.core.modelkeys import put
from fxpar.core.plan import PlanError
from fxpar.core.values import decode, encode, qualified, resolve

FORMAT = 1
"""The version of a ``graph.json`` (its "fxpar_graph")."""


# -- targets ----------------------------------------------------------------------------------
def _target(n: fx.Node) -> Any:
    t = n.target
    if n.op in ("placeholder", "output", "get_attr", "call_module", "call_method"):
        return t
    if isinstance(t, torch._ops.OpOverload):
        return {"ops": f"{t.namespace}.{t._opname}.{t._overloadname}"}
    if isinstance(t, torch._ops.OpOverloadPacket):
        return {"ops": f"{t._qualified_op_name.replace('::', '.')}"}
    if t is operator.getitem:
        return {"function": "operator:getitem"}
    return {"function": qualified(t)}


def _resolve_target(op: str, t: Any) -> Any:
    if op in ("placeholder", "output", "get_attr", "call_module"):
        return str(t)
    if op == "call_method":
        if not (isinstance(t, str) and t.isidentifier() and not t.startswith("_")
                and callable(getattr(torch.Tensor, t, None))):
            raise PlanError(f"a saved graph calls {t!r}, which is not a torch.Tensor method")
        return t
    if isinstance(t, dict) and "ops" in t:
        obj: Any = torch.ops
        try:
            for part in str(t["ops"]).split("."):
                obj = getattr(obj, part)
        except (AttributeError, RuntimeError) as e:
            raise PlanError(f"a saved graph calls torch.ops.{t['ops']}, which this torch "
                            f"does not have: save the program again with this torch") from e
        return obj
    if isinstance(t, dict) and "function" in t:
        fn = resolve(str(t["function"]))
        if not callable(fn):
            raise PlanError(f"a saved graph calls {t['function']}, which is not callable")
        return fn
    raise PlanError(f"a saved graph has a node target fxpar does not read: {t!r}")


# -- a whole stage module ---------------------------------------------------------------------
def graph_data(gm: fx.GraphModule) -> dict[str, Any]:
    """Stage module ``gm`` as JSON: its nodes, its submodules (fxpar's own ops, by their
    ``emit_args``) and how each of its tensors is held (their values go to weights.pt)."""
    nodes = []
    for n in gm.graph.nodes:
        entry: dict[str, Any] = {"name": n.name, "op": n.op, "target": _target(n),
                                 "args": encode(list(n.args))}
        if n.kwargs:
            entry["kwargs"] = encode(dict(n.kwargs))["dict"]
        nodes.append(entry)
    modules = []
    called = [str(n.target) for n in gm.graph.nodes if n.op == "call_module"]
    for path in dict.fromkeys(called):
        m = gm.get_submodule(path)
        if not hasattr(m, "emit_args"):
            raise PlanError(f"submodule {path} is a {type(m).__name__}, not one of fxpar's ops")
        modules.append({"path": path, "class": qualified(type(m)),
                        "args": encode(m.emit_args())})
    return {"fxpar_graph": FORMAT, "nodes": nodes, "modules": modules,
            "tensors": _tensors(gm, called)}


def _tensors(gm: nn.Module, modules: list[str]) -> list[dict[str, Any]]:
    """Every state_dict entry outside the called submodules: a parameter, a buffer, or an
    alias of an entry before it (the model's tied weights, fxpar.core.modelkeys)."""
    first: dict[int, str] = {}
    out = []
    for key, t in gm.state_dict(keep_vars=True).items():
        if any(key.startswith(p + ".") for p in modules):
            continue
        seen = first.setdefault(id(t), key)
        if seen != key:
            out.append({"path": key, "alias_of": seen})
        elif isinstance(t, nn.Parameter):
            out.append({"path": key, "parameter": True, "requires_grad": t.requires_grad})
        else:
            out.append({"path": key, "parameter": False})
    # a tensor the graph reads that no state_dict lists (a non-persistent buffer)
    listed = {e["path"] for e in out}
    for n in gm.graph.nodes:
        if n.op == "get_attr" and str(n.target) not in listed:
            obj = attrgetter(str(n.target))(gm)
            if not isinstance(obj, torch.Tensor):
                raise PlanError(f"attribute {n.target} is a {type(obj).__name__}, not a tensor")
            out.append({"path": str(n.target), "parameter": False, "persistent": False})
            listed.add(str(n.target))
    return out


def build(data: dict[str, Any], state: dict[str, torch.Tensor], class_name: str = "Stage"
          ) -> fx.GraphModule:
    """The stage module :func:`graph_data` described, holding the tensors of ``state`` (the
    saved weights.pt, read with ``weights_only=True``)."""
    if data.get("fxpar_graph") != FORMAT:
        raise PlanError(f"a saved graph has format {data.get('fxpar_graph')!r}; this fxpar "
                        f"reads format {FORMAT}: save the program again")
    root = nn.Module()
    for m in data["modules"]:
        cls = resolve(m["class"])
        if not (isinstance(cls, type) and issubclass(cls, nn.Module)
                and hasattr(cls, "emit_args")):
            raise PlanError(f"a saved graph builds {m['class']}, which is not one of fxpar's "
                            f"ops")
        put(root, m["path"], cls(**decode(m["args"])))
    later = []
    for t in data["tensors"]:
        if "alias_of" in t:
            later.append(t)
            continue
        if t["path"] not in state:
            raise PlanError(f"weights.pt has no tensor {t['path']!r} that graph.json names")
        value = state[t["path"]]
        if t["parameter"]:
            put(root, t["path"], nn.Parameter(value, requires_grad=t["requires_grad"]))
        else:
            put(root, t["path"], value, persistent=t.get("persistent", True))
    graph = fx.Graph()
    nodes: dict[str, fx.Node] = {}
    for e in data["nodes"]:
        args = tuple(decode(e["args"], nodes))
        kwargs = {k: decode(x, nodes) for k, x in e.get("kwargs", [])}
        node = graph.create_node(e["op"], _resolve_target(e["op"], e["target"]), args,
                                 kwargs, name=e["name"])
        nodes[e["name"]] = node
    gm = graph_module(root, graph, class_name)
    for t in data["tensors"]:  # what the graph does not read is not copied by GraphModule
        if "alias_of" not in t and not _has(gm, t["path"]):
            put(gm, t["path"], attrgetter(t["path"])(root),
                persistent=t.get("persistent", True))
    for t in later:  # aliases: the very tensor of the entry they alias
        if not _has(gm, t["alias_of"]):
            raise PlanError(f"graph.json names {t['path']!r} an alias of "
                            f"{t['alias_of']!r}, which it does not hold")
        put(gm, t["path"], attrgetter(t["alias_of"])(gm))
    listed = set(gm.state_dict())
    loose = set(state) - listed - {t["path"] for t in data["tensors"]}
    if loose:
        raise PlanError(f"weights.pt holds tensors graph.json does not place: "
                        f"{sorted(loose)[:5]}")
    gm.load_state_dict({k: v for k, v in state.items() if k in listed}, strict=True)
    return gm


def _has(root: nn.Module, path: str) -> bool:
    try:
        attrgetter(path)(root)
    except AttributeError:
        return False
    return True
