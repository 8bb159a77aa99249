"""Emission: a compiled Program as plain files, one folder per rank, and back again.

    program.save("job/")          # writes the layout below, for every rank
    rp = fxpar.load_program("job/")  # under ``mpiexec -n <world size>``: this rank's RankProgram

    job/program.json              plan, rank layout, stage inputs and transfers, parameter names,
                                  each rank's input window (the part of the image it reads)
    job/rank00001/rank.json       this rank's plan, roles (copy, stage, tile) and input window
    job/rank00001/actions.txt     this rank's action list for one training step, one per line
    job/rank00001/c0_s1/graph.json the stage as data: its fx graph and submodules
                                  (fxpar.program.graphdata); what the loader builds the stage from
    job/rank00001/c0_s1/weights.pt its parameters and buffers, under the original model's names
    job/rank00001/c0_s1/module.py the stage's generated code, for reading (and importing, by
                                  choice: the loader never runs it)

Why not ``GraphModule.to_folder``: it writes absolute paths into the code (the folder cannot
move), pickles every child that is not one of seven layer types (a whole ResNet layer becomes
one opaque blob), and does not import functions the graph calls from outside torch (fxpar's
halo ops), so its folders neither move nor import. Here the code comes from torch.fx's own code
generator (``graph.python_code``), every global it names is imported, and each submodule is
written as its constructor call: torch.nn layers from their repr (checked at save time by
building them again and comparing), fxpar's own ops from their ``emit_args``. Captured stages
hold nothing else (user modules are traced through to ATen ops), so nothing is pickled.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import json
import math
import os
import re
import sys
import types
from collections.abc import Callable
from operator import attrgetter
from pathlib import Path
from typing import Any

import torch
from torch import fx, nn

from fxpar.core import meta
from fxpar.core.meta import TensorInfo, module_path
from fxpar.core.modelkeys import put
from fxpar.core.outputs import out_spec_json
from fxpar.core.plan import PlanError
from fxpar.core.version import __version__
from fxpar.program.compiled import CompiledProgram
from fxpar.program.graphdata import graph_data
from fxpar.program.layout import FORMAT, rank_folder, read_program, stage_folder

__all__ = ["program_json", "put", "rank_sources", "read_program", "save",
           "stage_source"]


# -- code generation --------------------------------------------------------------------------
class _Imports:
    """The import lines a generated file needs, each once, in a stable order."""

    def __init__(self) -> None:
        self.lines: set[str] = {"import torch"}

    def name(self, obj: Any, as_name: str | None = None) -> str:
        """A name bound to ``obj`` in the generated file (adding its import)."""
        mod, qual = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
        if not mod or not qual or "<" in qual or "." in qual:
            raise _NotEmittable(f"{obj!r} is not importable by name")
        if mod == "builtins":
            return qual
        try:
            found = getattr(importlib.import_module(mod), qual)
        except (ImportError, AttributeError) as e:
            raise _NotEmittable(f"{mod}.{qual} cannot be imported") from e
        if found is not obj:
            raise _NotEmittable(f"{mod}.{qual} is not {obj!r}")
        for short in _public_homes(mod):  # torch.nn.ReLU rather than torch.nn.modules...
            if getattr(sys.modules.get(short), qual, None) is obj:
                mod = short
                break
        alias = as_name or qual
        self.lines.add(f"from {mod} import {qual}" + (f" as {alias}" if alias != qual else ""))
        return alias

    def text(self) -> str:
        plain = sorted(x for x in self.lines if x.startswith("import "))
        froms: dict[str, list[str]] = {}
        for line in self.lines:
            if line.startswith("from "):
                mod, _, names = line.removeprefix("from ").partition(" import ")
                froms.setdefault(mod, []).append(names)
        rest = sorted(x for x in self.lines if not x.startswith(("import ", "from ")))
        return "\n".join(plain + [f"from {m} import {', '.join(sorted(n))}"
                                  for m, n in sorted(froms.items())] + rest)


class _NotEmittable(Exception):
    pass


def _public_homes(mod: str) -> list[str]:
    """Parent packages of ``mod``, shortest first, that may re-export its names."""
    parts = mod.split(".")
    return [".".join(parts[:i]) for i in range(2 if parts[0] == "torch" else 1, len(parts))]


def _literal(v: Any, imp: _Imports) -> str:
    """Python source that rebuilds the plain value ``v``."""
    if v is None or isinstance(v, (bool, int, str)):
        return repr(v)
    if isinstance(v, float):
        if math.isinf(v):
            return "float('inf')" if v > 0 else "float('-inf')"
        return "float('nan')" if math.isnan(v) else repr(v)
    if isinstance(v, torch.dtype):
        return str(v)
    if isinstance(v, tuple):
        inner = ", ".join(_literal(x, imp) for x in v)
        return f"({inner},)" if len(v) == 1 else f"({inner})"
    if isinstance(v, list):
        return "[" + ", ".join(_literal(x, imp) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{_literal(k, imp)}: {_literal(x, imp)}"
                               for k, x in v.items()) + "}"
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        args = ", ".join(f"{f.name}={_literal(getattr(v, f.name), imp)}"
                         for f in dataclasses.fields(v) if f.init)
        return f"{imp.name(type(v))}({args})"
    raise _NotEmittable(f"no literal for {type(v).__name__}")


def _float_dtype(m: nn.Module) -> torch.dtype | None:
    dtypes = {t.dtype for t in [*m.parameters(), *m.buffers()] if t.is_floating_point()}
    return dtypes.pop() if len(dtypes) == 1 else None


def _signature(m: nn.Module) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    return sorted((k, tuple(t.shape), t.dtype) for k, t in m.state_dict().items())


def _constructor(m: nn.Module, imp: _Imports) -> str:
    """Source that builds a module like ``m`` (its weights come from weights.pt)."""
    if hasattr(m, "emit_args"):  # fxpar's own ops
        args = ", ".join(f"{k}={_literal(v, imp)}" for k, v in m.emit_args().items())
        return f"{imp.name(type(m))}({args})"
    cls = type(m)
    if not cls.__module__.startswith("torch.nn.") or len(m._modules):
        raise _NotEmittable(f"{cls.__name__} is not a torch.nn layer")
    text = repr(m)
    name = imp.name(cls)
    expr = name + text[len(cls.__name__):]
    dtype = _float_dtype(m)
    if dtype is not None and dtype != torch.get_default_dtype():
        expr += f".to({dtype})"
    try:
        with torch.device("meta"):
            again = eval(expr, {name: cls, "torch": torch})  # noqa: S307 - our own repr
    except Exception as e:  # a repr that is not a constructor call
        raise _NotEmittable(f"{cls.__name__}'s repr does not rebuild it") from e
    if type(again) is not cls or repr(again) != text or _signature(again) != _signature(m):
        raise _NotEmittable(f"{cls.__name__}'s repr does not rebuild it exactly")
    return expr


def _tensor_ctor(t: torch.Tensor) -> str:
    return f"torch.empty({tuple(t.shape)!r}, dtype={t.dtype})"


@dataclasses.dataclass(frozen=True)
class StageSource:
    """One stage module as files: ``module.py`` and what weights.pt holds."""

    code: str
    weights: dict[str, torch.Tensor]


def _referenced(gm: fx.GraphModule) -> list[str]:
    """Attribute paths the graph reads (call_module and get_attr targets), outermost first."""
    seen: dict[str, None] = {}
    for n in gm.graph.nodes:
        if n.op in ("call_module", "get_attr"):
            seen.setdefault(str(n.target))
    modules = {p for p in seen if isinstance(attrgetter(p)(gm), nn.Module)}
    return [p for p in seen if not any(p.startswith(q + ".") for q in modules)]


def _annotated(gm: fx.GraphModule, body: str) -> str:
    """Each op line of the generated forward with the model module it comes from, as a
    comment (``conv2d = torch.ops.aten.conv2d.default(...)  # layer1.0.conv1``)."""
    paths = {n.name: module_path(n) for n in gm.graph.nodes
             if n.op not in ("get_attr", "placeholder", "output")}
    lines = []
    for line in body.splitlines():
        m = re.match(r"\s*(\w+) = ", line)
        path = paths.get(m.group(1)) if m else None
        lines.append(f"{line}  # {path}" if path else line)
    return "\n".join(lines)


def stage_source(gm: fx.GraphModule, class_name: str, header: str) -> StageSource:
    """The generated ``module.py`` of stage module ``gm``, with its weights."""
    imp = _Imports()
    code = gm.graph.python_code(root_module="self")
    body = _annotated(gm, code.src.strip("\n"))
    for name, obj in code.globals.items():
        if not re.search(rf"\b{re.escape(name)}\b", body):
            continue
        if isinstance(obj, types.ModuleType):
            imp.lines.add(f"import {obj.__name__}" + (f" as {name}" if name != obj.__name__
                                                      else ""))
        elif obj is type(None):
            imp.lines.add("NoneType = type(None)")
        elif isinstance(obj, float):
            imp.lines.add(f"from math import {name}")
        else:
            imp.name(obj, name)
    init: list[str] = []
    weights: dict[str, torch.Tensor] = {}
    for path in _referenced(gm):
        obj = attrgetter(path)(gm)
        if isinstance(obj, nn.Module):
            try:
                expr = _constructor(obj, imp)
            except _NotEmittable as e:
                raise PlanError(f"stage module {path!r} cannot be written as code: {e}") from e
            weights.update({f"{path}.{k}": v for k, v in obj.state_dict().items()})
        elif isinstance(obj, nn.Parameter):
            expr = f"torch.nn.Parameter({_tensor_ctor(obj)}" + \
                (", requires_grad=False)" if not obj.requires_grad else ")")
            weights[path] = obj
        elif isinstance(obj, torch.Tensor):
            expr = _tensor_ctor(obj)
            weights[path] = obj
        else:
            raise PlanError(f"stage attribute {path} is a {type(obj).__name__}: fxpar can "
                            f"only save modules and tensors")
        init.append(f"        put(self, {path!r}, {expr})")
    init += _unread_state(gm, set(weights), weights)
    imp.lines.add("from fxpar.program.emit import put")
    imp.lines.add("from pathlib import Path")
    forward = "\n".join("    " + line if line else "" for line in body.splitlines())
    text = f'''"""{header}

Generated by fxpar {__version__}. Parameters and buffers are in weights.pt next to this
file, under the original model's names; ``load()`` builds the module and loads them.
"""

{imp.text()}

_HERE = Path(__file__).parent


class {class_name}(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
{chr(10).join(init) if init else "        pass"}

{forward}


def load(map_location: str | torch.device = "cpu") -> {class_name}:
    """This stage, with its saved parameters and buffers."""
    module = {class_name}()
    state = torch.load(_HERE / "weights.pt", map_location=map_location, weights_only=True)
    module.load_state_dict(state)
    return module.to(map_location)
'''
    return StageSource(text, {k: v.detach() for k, v in weights.items()})


def _unread_state(gm: nn.Module, written: set[str], weights: dict[str, torch.Tensor]
                  ) -> list[str]:
    """``put`` lines for the state_dict entries of ``gm`` its graph does not read (the model's
    unused tensors and aliases, fxpar.core.modelkeys), adding them to ``weights``. A tensor
    already written under another name is put there again as itself (an alias)."""
    names = {id(t): k for k, t in gm.state_dict(keep_vars=True).items() if k in written}
    lines = []
    for key, t in gm.state_dict(keep_vars=True).items():
        if key in written:
            continue
        first = names.setdefault(id(t), key)
        if first != key:
            get = "get_parameter" if isinstance(t, nn.Parameter) else "get_buffer"
            expr = f"self.{get}({first!r})"
        elif isinstance(t, nn.Parameter):
            expr = f"torch.nn.Parameter({_tensor_ctor(t)}" + \
                (", requires_grad=False)" if not t.requires_grad else ")")
        else:
            expr = _tensor_ctor(t)
        lines.append(f"        put(self, {key!r}, {expr})")
        weights[key] = t
    return lines


# -- the program as data ----------------------------------------------------------------------
def _qualname(fn: Callable[..., Any]) -> str | None:
    mod, qual = getattr(fn, "__module__", None), getattr(fn, "__qualname__", None)
    if not mod or not qual or "<" in qual:
        return None
    try:
        obj: Any = importlib.import_module(mod)
        for part in qual.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError):
        return None
    return f"{mod}.{qual}" if obj is fn else None


def _roles(program: CompiledProgram, rank: int) -> list[dict[str, int]]:
    return [{"copy": r.copy, "stage": r.stage, "tile": r.tile}
            for r in program.rank_map.roles_of(rank)]


def program_json(program: CompiledProgram) -> dict[str, Any]:
    """Everything but the modules and the action lists."""
    g, info = program.graph, program.spatial
    return {
        "fxpar_program": FORMAT, "fxpar_version": __version__,
        "world_size": program.world_size, "batch_size": program.batch_size,
        "input_shape": _input_shape(program), "output_shape": _output_shape(program),
        "plan": program.plan.to_json(), "loss_fn": _qualname(program.loss_fn),
        "names": list(program.names),
        "model_keys": program.model_keys.to_json(),
        "stages": [{"inputs": [[i.source, i.index] for i in g.inputs[s]],
                    "n_outputs": g.n_outputs[s],
                    "mutated_inputs": sorted(g.mutated_inputs[s]) if g.mutated_inputs else []}
                   for s in range(len(g.modules))],
        "transfers": [{"id": t.id, "src": t.src, "src_out": t.src_out, "dst": t.dst,
                       "dst_in": t.dst_in, "shape": list(t.shape),
                       "dtype": str(t.dtype).removeprefix("torch."), "tiled": t.tiled}
                      for t in g.transfers],
        "spatial": None if info is None else {
            "grid": list(info.grid.parts), "spatial_stages": info.spatial_stages,
            "out_tiled": info.out_tiled, "out_extent": list(info.out_extent),
            "out_extents": [None if e is None else list(e) for e in info.leaf_extents]},
        "out_spec": out_spec_json(g.out_spec),
        "ranks": [{"rank": r, "folder": rank_folder(r), "roles": _roles(program, r)}
                  for r in range(program.world_size)],
        "input_windows": _windows(program),
        "recompute": sorted(program.recompute),
    }


def _windows(program: CompiledProgram) -> list[list[list[int]] | None] | None:
    """Per rank, the window of the model input it reads as ``[[h0, h1], [w0, w1]]`` (None:
    it reads none); None when the program records no windows."""
    if program.input_windows is None:
        return None
    return [None if w is None else [list(iv) for iv in w.dims] for w in program.input_windows]


def _input_shape(program: CompiledProgram) -> list[int] | None:
    """The global batch's shape (the graph holds the micro-batch's)."""
    gm = program.traced
    x = next((n for n in gm.graph.nodes if n.op == "placeholder"), None) if gm else None
    info = meta.find(x, TensorInfo) if x is not None else None
    if info is None:
        return None
    return [program.batch_size, *info.shape[1:]]


def _output_shape(program: CompiledProgram) -> list[int] | None:
    """The model output's shape for the global batch, when the model returns one tensor."""
    shape = program.output_shape
    return None if shape is None else [program.batch_size, *shape[1:]]


def _header(program: CompiledProgram, rank: int, copy: int, stage: int) -> str:
    role = next(r for r in program.rank_map.roles_of(rank)
                if (r.copy, r.stage) == (copy, stage))
    where = f"rank {rank} of {program.world_size}: model copy {copy}, stage {stage}"
    if program.spatial is not None and stage < program.spatial.spatial_stages:
        g = program.spatial.grid
        where += f", tile {role.tile} of a {g} grid"
    return f"fxpar stage module: {where}."


def rank_sources(program: CompiledProgram, rank: int) -> dict[str, str]:
    """Rank ``rank``'s generated files as text (what ``save`` writes; no weights)."""
    out = {f"{stage_folder(c, s)}/module.py": src.code
           for (c, s), (_m, src) in _rank_stages(program, rank).items()}
    out["actions.txt"] = _actions_text(program, rank)
    return out


def _rank_stages(program: CompiledProgram, rank: int
                 ) -> dict[tuple[int, int], tuple[nn.Module, StageSource]]:
    """Rank ``rank``'s stage modules, each with its generated source."""
    mods = program.stage_modules(rank)
    return {(c, s): (m, stage_source(m, _class_name(m, s), _header(program, rank, c, s)))
            for (c, s), m in sorted(mods.items())}


def _class_name(m: nn.Module, stage: int) -> str:
    name = type(m).__name__
    return name if name.isidentifier() and name != "GraphModule" else f"Stage{stage}"


def _actions_text(program: CompiledProgram, rank: int) -> str:
    acts = program.schedule[rank]
    return (f"# rank {rank}: {len(acts)} actions per training step, in order "
            f"(c<copy>.<stage><KIND><micro-batch>)\n" + "".join(f"{a}\n" for a in acts))


def _write(path: Path, data: bytes | str) -> None:
    """Write via a temporary name, so a crash never leaves half a file under the real one."""
    tmp = path.with_name(path.name + ".tmp")
    if isinstance(data, str):
        tmp.write_text(data)
    else:
        tmp.write_bytes(data)
    os.replace(tmp, path)


def _save_tensor_file(path: Path, obj: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def save(program: CompiledProgram, folder: str | os.PathLike[str],
         ranks: list[int] | None = None, manifest: bool = True) -> Path:
    """Write ``program`` under ``folder`` (see the module docstring); returns the folder.

    ranks: only these ranks' folders (default all): under MPI each rank can write its own.
    manifest: write program.json (one writer: False on all ranks but one)."""
    root = Path(folder)
    root.mkdir(parents=True, exist_ok=True)
    info = program_json(program)
    if manifest:
        _write(root / "program.json", json.dumps(info, indent=1) + "\n")
    for rank in range(program.world_size) if ranks is None else ranks:
        rdir = root / rank_folder(rank)
        rdir.mkdir(exist_ok=True)
        program.complete_stages()  # the unused tensors too, before materialising
        if getattr(program, "meta_model", None) is not None:  # built on meta: weights first
            program.materialize(rank)
        windows = info["input_windows"]
        rank_info = {"rank": rank, "world_size": program.world_size,
                     "plan": info["plan"], "roles": info["ranks"][rank]["roles"],
                     "input_window": None if windows is None else windows[rank],
                     "stages": {}}
        for (c, s), (module, src) in _rank_stages(program, rank).items():
            try:  # the module as data: what the loader builds it from (fxpar.program.graphdata)
                data = graph_data(module)  # type: ignore[arg-type]
            except PlanError as e:
                raise PlanError(f"stage {s} of rank {rank} cannot be saved as data: {e}") from e
            sdir = rdir / stage_folder(c, s)
            sdir.mkdir(exist_ok=True)
            _write(sdir / "module.py", src.code)
            _write(sdir / "graph.json", json.dumps(data, separators=(",", ":")) + "\n")
            _write(sdir / "__init__.py", "from .module import *  # noqa: F403\n")
            _save_tensor_file(sdir / "weights.pt", src.weights)
            rank_info["stages"][stage_folder(c, s)] = {"copy": c, "stage": s}
        _write(rdir / "rank.json", json.dumps(rank_info, indent=1) + "\n")
        _write(rdir / "actions.txt", _actions_text(program, rank))
    return root


