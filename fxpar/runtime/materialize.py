"""Give a model built on the ``meta`` device real memory: the whole of it, or one rank's part.

A model too big for one process is built without memory (``with torch.device("meta"):``) and
compiled as usual; ``program.for_rank(r)`` then materialises only the modules that rank ``r``'s
stages use. Every rank must draw the same values a single process would, whatever the plan, so
each module is initialised under its own seed, derived from ``(seed, its qualified name in the
original model)`` with a stable hash (zlib.crc32: Python's ``hash`` of a string differs from
process to process)::

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(module_seed(seed, "layer1.0.conv1"))
        model.layer1[0].conv1.reset_parameters()

The values therefore come from each module's ``reset_parameters()`` (BatchNorm's also resets its
running statistics), not from a custom loop in the model's constructor (torchvision's ResNet
re-initialises its convolutions with kaiming_normal_ there): pass ``init=`` to reproduce such a
scheme. :func:`materialize_model` does the same to a whole model on one process: the reference a
user (or a test) compares a compiled program with.

Stage and tile modules hold the original model's layers (shared objects), but a tensor attribute
read directly by the traced code (``get_attr``: a LayerScale ``gamma`` owned by a block that was
traced through) is attached to a placeholder module in each stage or tile module. Materialising
replaces a meta tensor by a new one, so every such reference is re-pointed (:func:`rebind`).
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Iterable

import torch
from torch import nn

InitFn = Callable[[str, nn.Module], None]
"""``init(qualified_name, module)``: fill every parameter and buffer ``module`` owns directly
(its tensors are real but uninitialised memory when it is called)."""

Replaced = dict[int, tuple[torch.Tensor, torch.Tensor]]
"""id(meta tensor) -> (that meta tensor, its real replacement); the meta tensor is kept so its
id is not reused while the mapping lives."""


class MaterializeError(TypeError):
    """A module on the meta device that fxpar cannot initialise; the message says what to pass."""


def module_seed(seed: int, name: str) -> int:
    """The seed module ``name`` is initialised under: the same on every rank and for every plan.
    32 bits, because torch's CPU generator (mt19937) ignores the upper half of a 64-bit seed."""
    return zlib.crc32(f"{int(seed)}:{name}".encode())


def has_meta(module: nn.Module) -> bool:
    """True if any parameter or buffer of ``module`` is on the meta device."""
    return any(t.is_meta for t in _tensors(module, recurse=True))


def meta_model_of(model: nn.Module, init: InitFn | None) -> nn.Module | None:
    """``model`` if it has meta tensors, else None; checked at compile time (no memory) so a
    module fxpar cannot initialise fails before any rank starts."""
    if not has_meta(model):
        return None
    if init is None:
        for name, module in model.named_modules():
            if _owns_meta(module):
                _check_initializable(name, module)
    return model


def _tensors(module: nn.Module, recurse: bool) -> Iterable[torch.Tensor]:
    yield from module.parameters(recurse=recurse)
    yield from (b for b in module.buffers(recurse=recurse) if b is not None)


def _owns_meta(module: nn.Module) -> bool:
    return any(t.is_meta for t in _tensors(module, recurse=False))


def _check_initializable(name: str, module: nn.Module) -> None:
    if callable(getattr(module, "reset_parameters", None)):
        return
    owned = [n for n, t in [*module.named_parameters(recurse=False),
                            *module.named_buffers(recurse=False)] if t.is_meta]
    raise MaterializeError(
        f"module {name!r} ({type(module).__name__}) owns tensors on the meta device "
        f"({', '.join(owned)}) but has no reset_parameters() to initialise them: pass "
        f"init=fn to fxpar.compile / materialize_model, where fn(qualified_name, module) "
        f"fills them (it is called for every module that owns meta tensors, instead of "
        f"reset_parameters; call module.reset_parameters() in it for ordinary layers)")


def _init_one(name: str, module: nn.Module, seed: int, init: InitFn | None,
              device: torch.device | str) -> Replaced:
    """Real memory for ``module``'s own meta tensors, filled under the module's own seed."""
    if init is None:
        _check_initializable(name, module)
    old = {**module._parameters, **module._buffers}
    module.to_empty(device=device, recurse=False)
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(module_seed(seed, name))
        if init is not None:
            init(name, module)
        else:
            module.reset_parameters()  # type: ignore[operator]
    new = {**module._parameters, **module._buffers}
    return {id(t): (t, new[k]) for k, t in old.items()  # type: ignore[misc]
            if t is not None and t.is_meta and new.get(k) is not None}


def materialize(model: nn.Module, names: Iterable[str] | None = None, *, seed: int = 0,
                init: InitFn | None = None, device: torch.device | str = "cpu") -> Replaced:
    """Materialise the modules of ``model`` named in ``names`` (qualified names of modules that
    own meta tensors; None: every such module), in ``model``'s module order, each under
    :func:`module_seed`. Returns which meta tensors were replaced by which real ones (for
    :func:`rebind`)."""
    wanted = None if names is None else set(names)
    replaced: Replaced = {}
    for name, module in model.named_modules():
        if (wanted is None or name in wanted) and _owns_meta(module):
            replaced.update(_init_one(name, module, seed, init, device))
    return replaced


def materialize_model(model: nn.Module, seed: int = 0, init: InitFn | None = None,
                      device: torch.device | str = "cpu") -> nn.Module:
    """The whole ``model`` materialised in place (and returned), with the values each rank of a
    compiled program gets for the same ``seed`` and ``init``."""
    materialize(model, seed=seed, init=init, device=device)
    return model


def rebind(modules: Iterable[nn.Module], replaced: Replaced) -> None:
    """Point every parameter / buffer slot in ``modules`` (recursively) that still holds a
    replaced meta tensor at its real replacement."""
    if not replaced:
        return
    for root in modules:
        for m in root.modules():
            for slots in (m._parameters, m._buffers):
                for k, t in slots.items():
                    if t is not None and id(t) in replaced and replaced[id(t)][0] is t:
                        slots[k] = replaced[id(t)][1]


def _owner_names(model: nn.Module, stage: nn.Module) -> set[str]:
    """Qualified names, in ``model``, of the modules owning ``stage``'s meta tensors (a stage
    module keeps the original attribute paths)."""
    canonical = {id(m): n for n, m in model.named_modules()}
    out = set()
    for path, t in [*stage.named_parameters(remove_duplicate=False),
                    *stage.named_buffers(remove_duplicate=False)]:
        if not t.is_meta:
            continue
        prefix, _, attr = path.rpartition(".")
        try:
            owner = model.get_submodule(prefix)
        except AttributeError:
            owner = None
        if owner is None or not any(s.get(attr) is t for s in (owner._parameters,
                                                               owner._buffers)):
            raise MaterializeError(
                f"tensor {path!r} is on the meta device but is not a parameter or buffer of "
                f"module {prefix!r} of the model: register it (nn.Parameter or "
                f"register_buffer) so it can be materialised, or build it on a real device")
        out.add(canonical[id(owner)])
    return out


def materialize_stages(model: nn.Module, stages: list[nn.Module], tiles: list[nn.Module],
                       seed: int, init: InitFn | None) -> None:
    """Materialise the modules of ``model`` (built on meta) that the stage modules ``stages``
    use, and re-point them and the tile modules ``tiles`` built from them at the new tensors
    (``Program.materialize``: one rank's stages; the other stages stay on meta)."""
    names: set[str] = set()
    for stage in stages:
        names |= _owner_names(model, stage)
    replaced = materialize(model, names, seed=seed, init=init)
    rebind([*stages, *tiles], replaced)
