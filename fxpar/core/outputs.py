"""The model's output as a pytree: a tensor, or tuples, lists, dicts, NamedTuples and dataclasses
of tensors (segmentation-models-pytorch's ``(mask, label)`` with ``aux_params``, torchvision's
``{"out": ..., "aux": ...}``, deep-supervision heads, a ``ModelOutput``-style dataclass).

The captured graph returns the output's *leaves*, flat, in ``torch.utils._pytree`` order; the
structure is a ``TreeSpec`` (:data:`OUT_SPEC` in the graph's meta, then
``StageGraph.out_spec``), and the structure is put back where the user sees the output: the
loss's argument and ``RankProgram.forward``'s result. Between stages, and in each leaf's layout
(tiled, replicated), only tensors travel.

Dataclasses are not pytree nodes until registered; :func:`register_types` registers those a
model returns (``torch.export.register_dataclass``, once per class; a registration is torch's,
for the process, and changes nothing else about the class), so no user code is needed.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree

OUT_SPEC = "fxpar.out_spec"
"""Graph meta key: the model output's ``TreeSpec`` (absent: one tensor)."""

LEAF = pytree.tree_structure(0)
"""The spec of a single tensor."""


def register_types(value: Any) -> None:
    """Register every dataclass type in ``value`` (a model's output) as a pytree node, so
    ``torch.export`` can return it: without, export refuses it ("register a pytree")."""
    stack = [value]
    while stack:
        v = stack.pop()
        if dataclasses.is_dataclass(v) and not isinstance(v, type):
            _register(type(v))
            stack.extend(getattr(v, f.name) for f in dataclasses.fields(v) if f.init)
        elif isinstance(v, (list, tuple)):
            stack.extend(v)
        elif isinstance(v, dict):
            stack.extend(v.values())


def register_spec(spec: pytree.TreeSpec) -> pytree.TreeSpec:
    """Register the dataclass types of ``spec`` (one made in another process: rank 0's capture,
    the capture cache) in this one; returns ``spec``."""
    stack = [spec]
    while stack:
        s = stack.pop()
        if s.type is not None and dataclasses.is_dataclass(s.type):
            _register(s.type)
        stack.extend(_children(s))
    return spec


def _register(cls: type) -> None:
    if cls not in pytree.SUPPORTED_NODES:
        torch.export.register_dataclass(cls, serialized_type_name=f"{cls.__module__}."
                                                                  f"{cls.__qualname__}")


def from_leaves(spec: pytree.TreeSpec | None, leaves: Sequence[Any]) -> Any:
    """The output from a tuple of its leaves (:func:`leaves_of` undone)."""
    return leaves[0] if spec is None or spec == LEAF else pytree.tree_unflatten(list(leaves),
                                                                                  spec)


def leaves_of(spec: pytree.TreeSpec | None, value: Any) -> tuple[Any, ...]:
    """The last stage's value as a tuple of leaves (one tensor: a tuple of one)."""
    return tuple(value) if spec is not None and spec != LEAF else (value,)


def leaf_names(spec: pytree.TreeSpec | None) -> list[str]:
    """Each leaf's path as the user writes it: ``['out']``, ``[1]``, ``.aux`` ('' for a
    single tensor)."""
    if spec is None or spec == LEAF:
        return [""]
    tree = pytree.tree_unflatten(list(range(spec.num_leaves)), spec)
    return [pytree.keystr(path) for path, _ in pytree.tree_flatten_with_path(tree)[0]]


def pick(spec: pytree.TreeSpec | None, key: str) -> int:
    """The index of the leaf ``key`` names: its path (``['out']``, ``[0]``, ``.aux``) or, for
    a dict or dataclass entry at the top, its bare name (``out``); an integer for a sequence.
    ValueError listing the leaves otherwise."""
    names = leaf_names(spec)
    wanted = {key, f"[{key!r}]", f"['{key}']", f"[{key}]", f".{key}"}
    hits = [i for i, n in enumerate(names) if n in wanted]
    if len(hits) != 1:
        raise ValueError(f"the model's output has no leaf {key!r}: its leaves are "
                         f"{', '.join(n or '(the tensor)' for n in names)}")
    return hits[0]


def plain(spec: pytree.TreeSpec) -> pytree.TreeSpec:
    """``spec`` with dataclasses as dicts of their fields and NamedTuples as tuples: what a
    program saved to disk can rebuild without importing the user's classes."""
    children = [plain(c) for c in _children(spec)]
    if spec.type is not None and dataclasses.is_dataclass(spec.type):
        names = [f.name for f in dataclasses.fields(spec.type) if f.init]
        kept = _dataclass_fields(spec, names)
        return pytree.TreeSpec(dict, kept, children)
    if spec.type is collections.namedtuple:  # torch's node type for every NamedTuple
        return pytree.TreeSpec(tuple, None, children)
    if spec.type is collections.OrderedDict:
        return pytree.TreeSpec(dict, list(spec.context), children)
    if not children:
        return spec
    return pytree.TreeSpec(spec.type, spec.context, children)


def _children(spec: pytree.TreeSpec) -> list[pytree.TreeSpec]:
    """A spec's child specs (``children()`` from torch 2.14, the field before)."""
    method = getattr(spec, "children", None)
    return list(method()) if callable(method) else list(spec.children_specs)


def _dataclass_fields(spec: pytree.TreeSpec, names: Sequence[str]) -> list[str]:
    """The field names of a dataclass spec's children (its context lists them in torch's
    dataclass flattening: (type, field names, none names) or similar)."""
    ctx = spec.context
    for part in ctx if isinstance(ctx, (tuple, list)) else ():
        if isinstance(part, (list, tuple)) and len(part) == spec.num_children and \
                all(isinstance(p, str) for p in part):
            return list(part)
    return list(names)[:spec.num_children]


def out_spec_json(spec: pytree.TreeSpec | None) -> str | None:
    """A spec as a saved program keeps it (:func:`plain`, then torch's treespec JSON)."""
    return None if spec is None or spec == LEAF else pytree.treespec_dumps(plain(spec))


def out_spec_of(text: str | None) -> pytree.TreeSpec | None:
    """:func:`out_spec_json` read back."""
    return None if text is None else pytree.treespec_loads(text)
