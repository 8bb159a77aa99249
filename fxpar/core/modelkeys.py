"""The names a model's parameters and buffers go by, beyond the ones its graph reads.

A compiled program's stage modules hold the tensors their graphs read, each under one name.
Two kinds of state_dict entries are not among those, and a program must still keep them so
that ``full_state_dict()`` has exactly the keys of ``model.state_dict()``:

- **aliases**: a tensor the model reaches under two names (MONAI's DynUNet registers its blocks
  as ``input_block`` / ``downsamples`` and again inside ``skip_layers``; any module held under
  two attribute names). ``model.state_dict()`` lists it under every name,
  ``model.named_parameters()`` under the first only (its *canonical* name);
- **unused** tensors: parameters and buffers of modules whose forward never runs (an
  ``nn.Linear`` attribute never called, the deeper encoder stages smp's PSPNet skips at its
  default ``encoder_depth``). They get no gradient, as on one process.

:class:`ModelKeys` records both as data (the compiler gets the aliases from the model at
capture time; a saved program keeps them in program.json), and :func:`attach` puts them on a
stage module under their names (fxpar.program.program: aliases wherever their tensor is
held, unused tensors on the last stage).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

MODEL_KEYS = "fxpar.model_keys"
"""The ``GraphModule.meta`` key under which capture records the model's :class:`ModelKeys`."""


@dataclass(frozen=True)
class ModelKeys:
    """A model's state_dict keys that name a tensor another key names first, and the tensors
    no stage reads."""

    aliases: tuple[tuple[str, str], ...] = ()
    """(key, canonical key) for every state_dict key whose tensor the model reaches first
    under another name (the one ``named_parameters`` / ``named_buffers`` give it)."""
    unused: tuple[str, ...] = ()
    """Canonical keys of the parameters and buffers no stage's graph reads (state_dict
    order)."""

    @classmethod
    def of(cls, model: nn.Module) -> ModelKeys:
        """The aliases of ``model`` (``unused`` is for the compiler to fill in)."""
        first: dict[int, str] = {}
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            first.setdefault(id(t), name)
        aliases = []
        for key, t in model.state_dict(keep_vars=True).items():
            canonical = first.get(id(t), key)
            if canonical != key:
                aliases.append((key, canonical))
        return cls(tuple(aliases))

    def canonical(self, key: str) -> str:
        """The name ``model.named_parameters()`` / ``named_buffers()`` give ``key``'s tensor."""
        return self._canonical.get(key, key)

    @functools.cached_property
    def _canonical(self) -> dict[str, str]:
        return dict(self.aliases)

    @functools.cached_property
    def _names(self) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        for key, canonical in self.aliases:
            out.setdefault(canonical, [canonical]).append(key)
        return out

    def names_of(self, canonical: str) -> list[str]:
        """``canonical`` and every alias of its tensor."""
        return self._names.get(canonical, [canonical])

    def to_json(self) -> dict[str, list]:
        return {"aliases": [list(a) for a in self.aliases], "unused": list(self.unused)}

    @classmethod
    def from_json(cls, d: Mapping[str, Iterable]) -> ModelKeys:
        return cls(tuple((str(k), str(c)) for k, c in d.get("aliases", ())),
                   tuple(str(u) for u in d.get("unused", ())))


def lookup(root: nn.Module, path: str) -> torch.Tensor | None:
    """The parameter or buffer at dotted ``path`` under ``root``, or None."""
    *parents, leaf = path.split(".")
    owner: nn.Module | None = root
    for name in parents:
        owner = owner._modules.get(name) if owner is not None else None
    if owner is None:
        return None
    t = owner._parameters.get(leaf)
    return t if t is not None else owner._buffers.get(leaf)


def put(root: nn.Module, path: str, value: nn.Module | torch.Tensor, *,
        persistent: bool = True) -> None:
    """Attach ``value`` at dotted ``path`` under ``root``, creating empty parent modules: a
    module, a parameter, or (a plain tensor) a buffer. Generated stage modules call this
    (through fxpar.program.emit)."""
    *parents, leaf = path.split(".")
    owner = root
    for name in parents:
        child = owner._modules.get(name)
        if child is None:
            child = nn.Module()
            owner.add_module(name, child)
        owner = child
    if isinstance(value, nn.Module):
        owner.add_module(leaf, value)
    elif isinstance(value, nn.Parameter):
        owner.register_parameter(leaf, value)
    else:
        owner.register_buffer(leaf, value, persistent=persistent)


def with_unused(keys: ModelKeys, names: Iterable[str], model: nn.Module,
                stages: Sequence[nn.Module | None]) -> ModelKeys:
    """``keys`` with ``unused``: the canonical keys among ``names`` (the model's state_dict
    keys) of tensors ``model`` holds (the captured graph module, which keeps every one) but no
    module of ``stages`` does."""
    held = {keys.canonical(k) for m in stages if m is not None for k in m.state_dict()}
    unused = dict.fromkeys(c for k in names if (c := keys.canonical(k)) not in held
                           and lookup(model, c) is not None)
    return dataclasses.replace(keys, unused=tuple(unused))


def attach(module: nn.Module, keys: ModelKeys, source: nn.Module | None = None) -> None:
    """Put on ``module`` the unused tensors (``keys.unused``) that ``source`` holds, then every
    alias of a tensor ``module`` holds, as that same tensor object. Idempotent."""
    if source is not None:
        for name in keys.unused:
            t = lookup(source, name)
            if t is not None and lookup(module, name) is None:
                put(module, name, t)
    held: dict[str, torch.Tensor] = {}
    for name, t in module.state_dict(keep_vars=True).items():
        held.setdefault(keys.canonical(name), t)
    for canonical, t in held.items():
        for key in keys.names_of(canonical):
            if lookup(module, key) is None:
                put(module, key, t)


def complete(stages: Sequence[nn.Module], keys: ModelKeys, model: nn.Module) -> None:
    """Every module of ``stages`` with its tensors' aliases; the last one also with the unused
    tensors, taken from ``model``."""
    for s, m in enumerate(stages):
        attach(m, keys, model if s == len(stages) - 1 else None)
