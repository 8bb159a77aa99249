"""fxpar's values as JSON and back: tuples, slices, dtypes, enums and fxpar's own records
(dataclasses such as a halo exchange) keep their types through one-key tags, and functions and
classes are named ``"module:qualname"`` and resolved against a fixed list of homes.

A saved stage graph (fxpar.program.graphdata) writes its nodes' arguments this way, and fxpar's
custom ops (fxpar.runtime.spatial.library) take their static arguments as one such JSON string,
so that an exported graph holds them as plain strings. Decoding names only functions and classes
of :data:`HOMES`: a JSON value from elsewhere can at worst name something fxpar or torch
defines.

Tags: ``{"tuple": [...]}``, ``{"slice": [a, b, c]}``, ``{"dtype": "float64"}``, ``{"node":
name}`` (an fx node, with the nodes to resolve it against), ``{"dataclass": "module:Class",
"fields": {...}}``, ``{"dict": [[k, v], ...]}``, ``{"float": "inf"}``; lists, strings, numbers,
booleans and null are themselves.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import importlib
import json
import math
from typing import Any

import torch
from torch import fx

from fxpar.core.plan import PlanError

HOMES = ("operator", "math", "builtins", "torch", "fxpar")
"""The modules (and their submodules) a saved graph may name a function or class from."""

_BUILTINS = {"getattr": getattr, "slice": slice, "len": len, "int": int, "float": float}
"""The builtins an fx graph calls (``getattr`` on a tensor, sizes)."""


def qualified(obj: Any) -> str:
    """``"module:qualname"`` of a function or class of :data:`HOMES` (:func:`resolve` finds it
    again); a PlanError for anything else."""
    mod, qual = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    if mod == "builtins" and qual in _BUILTINS:
        return f"builtins:{qual}"
    if not mod or not qual or "<" in qual or not _at_home(mod):
        raise PlanError(f"{obj!r} is not a function or class of {', '.join(HOMES)}")
    for name in (f"{mod}:{qual}", f"{mod}:{getattr(obj, '__name__', '')}"):
        try:  # a torch builtin's qualname is its class's (torch.conv_transpose3d's is
            if resolve(name) is obj:  # _VariableFunctionsClass.conv_transpose3d)
                return name
        except PlanError:
            pass
    raise PlanError(f"{mod}.{qual} does not name {obj!r}")


def _at_home(mod: str) -> bool:
    return any(mod == h or mod.startswith(h + ".") for h in HOMES)


def resolve(name: str) -> Any:
    """The function or class ``"module:qualname"`` names, from :data:`HOMES` only."""
    mod, _, qual = name.partition(":")
    if mod == "builtins":
        if qual not in _BUILTINS:
            raise PlanError(f"a saved graph names builtins.{qual}, which fxpar does not load")
        return _BUILTINS[qual]
    if not _at_home(mod) or not qual:
        raise PlanError(f"a saved graph names {name!r}: fxpar loads only functions and "
                        f"classes of {', '.join(HOMES)} (the folder was not written by "
                        f"fxpar, or was edited)")
    try:
        obj: Any = importlib.import_module(mod)
        for part in qual.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as e:
        raise PlanError(f"a saved graph names {mod}.{qual}, which this fxpar and torch do "
                        f"not have: save the program again with this version") from e
    return obj


# -- values -----------------------------------------------------------------------------------
def encode(v: Any) -> Any:
    """``v`` as JSON (see the module docstring); a PlanError for a value with no JSON form."""
    if v is None or isinstance(v, (bool, int, str)):
        return v
    if isinstance(v, float):
        return v if math.isfinite(v) else {"float": repr(v)}
    if isinstance(v, fx.Node):
        return {"node": v.name}
    if isinstance(v, list):
        return [encode(x) for x in v]
    if isinstance(v, tuple):
        return {"tuple": [encode(x) for x in v]}
    if isinstance(v, dict):
        return {"dict": [[encode(k), encode(x)] for k, x in v.items()]}
    if isinstance(v, slice):
        return {"slice": [encode(v.start), encode(v.stop), encode(v.step)]}
    if v is Ellipsis:
        return {"ellipsis": None}
    if isinstance(v, torch.dtype):
        return {"dtype": str(v).removeprefix("torch.")}
    if isinstance(v, torch.device):
        return {"device": str(v)}
    if isinstance(v, torch.memory_format):
        return {"memory_format": str(v).removeprefix("torch.")}
    if isinstance(v, torch.layout):
        return {"layout": str(v).removeprefix("torch.")}
    if isinstance(v, enum.Enum):
        return {"enum": qualified(type(v)), "value": encode(v.value)}
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        return {"dataclass": qualified(type(v)),
                "fields": {f.name: encode(getattr(v, f.name))
                           for f in dataclasses.fields(v) if f.init}}
    raise PlanError(f"no JSON form for a {type(v).__name__} ({v!r})")


_TORCH_ENUMS = {"dtype": torch.dtype, "memory_format": torch.memory_format,
                "layout": torch.layout}


def decode(v: Any, nodes: dict[str, fx.Node] | None = None) -> Any:
    """The value :func:`encode` wrote; ``nodes``: the graph's nodes so far, by name."""
    if not isinstance(v, (dict, list)):
        return v
    if isinstance(v, list):
        return [decode(x, nodes) for x in v]
    if len(v) == 1 or set(v) in ({"enum", "value"}, {"dataclass", "fields"}):
        tag = next(iter(v))
        body = v[tag]
        if tag == "node":
            if nodes is None or body not in nodes:
                raise PlanError(f"a saved graph uses node {body!r} before defining it")
            return nodes[body]
        if tag == "tuple":
            return tuple(decode(x, nodes) for x in body)
        if tag == "dict":
            return {decode(k, nodes): decode(x, nodes) for k, x in body}
        if tag == "slice":
            return slice(*(decode(x, nodes) for x in body))
        if tag == "ellipsis":
            return Ellipsis
        if tag == "float":
            return float(body)
        if tag == "device":
            return torch.device(body)
        if tag in _TORCH_ENUMS:
            found = getattr(torch, str(body), None)
            if not isinstance(found, _TORCH_ENUMS[tag]):
                raise PlanError(f"a saved graph names torch.{body}, which is not a {tag}")
            return found
        if tag == "enum":
            return resolve(body)(decode(v["value"], nodes))
        if tag == "dataclass":
            cls = resolve(body)
            if not dataclasses.is_dataclass(cls):
                raise PlanError(f"a saved graph names {body} as a record, which it is not")
            return cls(**{k: decode(x, nodes) for k, x in v["fields"].items()})
    raise PlanError(f"a saved graph holds a value fxpar does not read: {v!r}")


def dumps(v: Any) -> str:
    """``v`` as one compact JSON string (:func:`encode`)."""
    return json.dumps(encode(v), separators=(",", ":"))


@functools.cache
def loads(s: str) -> Any:
    """The value :func:`dumps` wrote. Cached: a custom op decodes the same few specs on every
    call (the result is shared, so it must not be changed: records are frozen dataclasses)."""
    return decode(json.loads(s))
