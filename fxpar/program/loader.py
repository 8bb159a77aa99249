"""Loading a saved program: this rank's RankProgram from the folder that
``fxpar.program.emit.save`` wrote.

The folder layout and why the code is generated the way it is: see :mod:`fxpar.program.emit`.
"""

from __future__ import annotations

import importlib
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import fx, nn

from fxpar.comm import failfast
from fxpar.comm.mpi import Comm
from fxpar.core.geometry import Grid, Rect
from fxpar.core.modelkeys import ModelKeys
from fxpar.core.outputs import out_spec_of
from fxpar.core.plan import Plan, PlanError, RankMap
from fxpar.core.schedule import Action
from fxpar.core.stages import StageGraph, StageInput, Transfer
from fxpar.program.graphdata import build
from fxpar.program.layout import rank_folder, read_program
from fxpar.program.program import (
    OptimizerFactory,
    Program,
    RankProgram,
    SpatialInfo,
)
from fxpar.runtime.loop import LossFn


def _resolve(name: str) -> Callable[..., Any]:
    mod, _, attr = name.rpartition(".")
    return getattr(importlib.import_module(mod), attr)


def _load_stage(sdir: Path, class_name: str) -> nn.Module:
    """A stage from its ``graph.json`` and ``weights.pt`` (fxpar.program.graphdata): no code from
    the folder runs (``module.py`` is there for reading)."""
    try:
        data = json.loads((sdir / "graph.json").read_text())
    except (OSError, ValueError) as e:
        raise PlanError(f"{sdir} has no readable graph.json ({e}): save the program "
                        f"again") from e
    state = torch.load(sdir / "weights.pt", map_location="cpu", weights_only=True)
    try:
        return build(data, state, class_name)
    except PlanError as e:
        raise PlanError(f"{sdir}: {e}") from e


def _actions(path: Path) -> list[Action]:
    return [Action.from_str(line.strip()) for line in path.read_text().splitlines()
            if line.strip() and not line.startswith("#")]


def _unavailable(*_: Any) -> fx.GraphModule:
    raise PlanError("a loaded program holds only its own rank's stage modules")


def load(folder: str | os.PathLike[str], comm: Comm | None = None, *,
         loss_fn: LossFn | None = None, optimizer: OptimizerFactory | None = None,
         rank: int | None = None) -> RankProgram:
    """This rank's program from a folder written by ``save``: under ``mpiexec -n N`` where N is
    the saved plan's world size (else a clear error, before any communication).

    loss_fn: default the one saved by name (e.g. torch.nn.functional.cross_entropy).
    rank: load that rank's program without a communicator (for inspection).

    In a job of more than one rank this installs the fail-fast hook (fxpar.comm.failfast)
    before the first communication; the rank program holds it until closed."""
    root = Path(folder)
    info = read_program(root)
    n = int(info["world_size"])
    held = False
    if rank is None:
        if comm is None and n == 1 and not failfast.launched():
            rank = 0
        else:
            from fxpar.comm.world import world

            comm = comm if comm is not None else world()
            if comm.size != n:
                raise PlanError(f"{root} was compiled for {n} ranks but the job has "
                                f"{comm.size}: run it with `mpiexec -n {n}`")
            held = failfast.install()  # a rank failing from here on ends the whole job
            if n > 1:  # the job's first communication: is it one program on every rank?
                failfast.agree(comm, {"saved program": failfast.digest(info)})
            rank = comm.rank
    if loss_fn is None:
        if info["loss_fn"] is None:
            raise PlanError(f"{root} was compiled with a loss function fxpar cannot import by "
                            f"name: pass loss_fn= to load()")
        loss_fn = _resolve(info["loss_fn"])
    plan = Plan(**info["plan"])
    rdir = root / rank_folder(rank)
    rank_info = json.loads((rdir / "rank.json").read_text())
    stages: dict[tuple[int, int], nn.Module] = {}
    for name, where in rank_info["stages"].items():
        stages[(where["copy"], where["stage"])] = _load_stage(rdir / name,
                                                             f"Stage{where['stage']}")
    program = Program(plan=plan, rank_map=RankMap(plan), graph=_graph(info),
                      schedule={r: _actions(root / rank_folder(r) / "actions.txt")
                                for r in range(n)},
                      loss_fn=loss_fn, optimizer=optimizer, batch_size=int(info["batch_size"]),
                      names=tuple(info["names"]), spatial=_spatial(info),
                      input_windows=_windows(info),
                      recompute=frozenset(info.get("recompute", ())),
                      keys=ModelKeys.from_json(info.get("model_keys", {})))
    rp = RankProgram(program, rank, stages, comm)  # type: ignore[arg-type]
    failfast.uninstall(held)  # the rank program holds its own
    return rp


def _graph(info: dict[str, Any]) -> StageGraph:
    stages = info["stages"]
    return StageGraph(
        modules=(None,) * len(stages),  # type: ignore[arg-type]
        inputs=tuple(tuple(StageInput(src, int(i)) for src, i in s["inputs"]) for s in stages),
        n_outputs=tuple(int(s["n_outputs"]) for s in stages),
        transfers=tuple(Transfer(t["id"], t["src"], t["src_out"], t["dst"], t["dst_in"],
                                 tuple(t["shape"]), getattr(torch, t["dtype"]), t["tiled"])
                        for t in info["transfers"]),
        mutated_inputs=tuple(frozenset(s["mutated_inputs"]) for s in stages),
        out_spec=out_spec_of(info.get("out_spec")))


def _windows(info: dict[str, Any]) -> tuple[Rect | None, ...] | None:
    """Each rank's input window as the compiler recorded it (None: not recorded, e.g. a folder
    saved before fxpar recorded them; RankProgram.input_window then needs the image size)."""
    windows = info.get("input_windows")
    if windows is None:
        return None
    return tuple(None if w is None else Rect(*(tuple(iv) for iv in w)) for w in windows)


def _spatial(info: dict[str, Any]) -> SpatialInfo | None:
    sp = info["spatial"]
    if sp is None:
        return None
    extents = tuple(None if e is None else tuple(e) for e in sp.get("out_extents", ()))
    return SpatialInfo(_unavailable, Grid(*sp["grid"]), sp["spatial_stages"], sp["out_tiled"],
                       tuple(sp["out_extent"]), extents)  # type: ignore[arg-type]
