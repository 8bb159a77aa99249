"""Sharded checkpoints: save and resume a compiled program's training state; convert it to and
from a single-device ``state_dict``.

A checkpoint is a folder::

    checkpoint.json     rank 0: format, step, world size, the plan, the model's state_dict keys
                        in order, which rank holds which (copy, stage, tile), and which shard
                        holds each key for export
    rank00000.pt        one shard per rank: each (copy, stage) module's state_dict (parameters,
    rank00001.pt        BatchNorm buffers incl. num_batches_tracked), the optimizer's
    ...                 state_dict, the step, the torch RNG state

Each rank writes only what it holds, so saving costs no communication beyond a gather of key
names. Every file is written under a temporary name and renamed (``os.replace``), and the
manifest last, after every shard is in place: a crash never leaves a half-written file under a
final name, and :func:`load` refuses shards whose step differs from the manifest's.

Resuming (:func:`load`) needs the same plan on the same number of ranks: it copies into the
existing parameters and buffers (the optimizer, the gradient hooks and the gradient-sync buckets
hold references to those objects) and gives bit-identical training to an uninterrupted run.
To change plans, go through the single-device form: :func:`export` (no MPI, reads the files)
then ``RankProgram.load_state_dict`` (the optimizer state and step do not carry over).

Files must be visible to every rank (a shared file system on a cluster).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from fxpar.program import Program, RankProgram

FORMAT = "fxpar-checkpoint"
VERSION = 1
MANIFEST = "checkpoint.json"

StageKey = tuple[int, int]  # (copy, stage)


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used here; the message says what to do instead."""


def shard_name(rank: int) -> str:
    return f"rank{rank:05d}.pt"


def _replace_into(path: Path, write: Any) -> None:
    """Write via ``write(tmp_path)`` then rename onto ``path`` (atomic on POSIX)."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


# -- save / load (collective; same plan) --------------------------------------------------------
def save(rp: RankProgram, folder: str | os.PathLike[str], step: int,
         extra: dict[str, Any] | None = None) -> None:
    """Collective: every rank writes its shard of the training state to ``folder``, rank 0 the
    manifest. ``extra``: JSON values kept in the manifest (rank 0's), e.g. the epoch;
    read them back with :func:`read_manifest`."""
    folder = Path(folder)
    if rp.comm is None and rp.program.world_size > 1:
        raise CheckpointError(f"save is collective over the plan's {rp.program.world_size} "
                              f"ranks: call it on every rank of program.local() under mpiexec")
    if extra is not None:
        try:
            json.dumps(extra)
        except TypeError as e:
            raise TypeError(f"checkpoint extra must hold JSON values only ({e}): save tensors "
                            f"and other objects yourself, next to the checkpoint") from e
    folder.mkdir(parents=True, exist_ok=True)
    shard = {
        "format": VERSION, "rank": rp.rank, "step": int(step),
        "stages": {key: m.state_dict() for key, m in rp.stages.items()},
        "optimizer": rp.optimizer.state_dict() if rp.optimizer is not None else None,
        "rng": torch.get_rng_state(),
    }
    _replace_into(folder / shard_name(rp.rank), lambda p: torch.save(shard, p))
    mine = ({key: list(m.state_dict()) for key, m in rp.stages.items()},
            [n for n, _ in rp.named_parameters()])
    everyone = rp.comm.gather_object(mine, root=0) if rp.comm is not None else [mine]
    if everyone is not None:  # rank 0 (all shards are in place: each rank wrote before this)
        text = json.dumps(_manifest(rp.program, int(step), extra, everyone), indent=1)
        _replace_into(folder / MANIFEST, lambda p: p.write_text(text))
    if rp.comm is not None:
        rp.comm.barrier()


def _manifest(program: Program, step: int, extra: dict[str, Any] | None,
              everyone: Sequence[tuple[dict[StageKey, list[str]], list[str]]]) -> dict[str, Any]:
    rm = program.rank_map
    holders: dict[str, list[int]] = {}  # key -> [rank, copy, stage]: copy 0, tile 0, replica 0
    for stage in range(program.plan.stages):
        rank = rm.rank_of(0, 0, stage, 0)
        for key in everyone[rank][0].get((0, stage), []):
            holders.setdefault(key, [rank, 0, stage])
    params = {n for _, names in everyone for n in names}
    return {
        "format": FORMAT, "version": VERSION, "step": step, "world_size": program.world_size,
        "plan": program.plan.to_json(),
        "names": list(program.names),
        "parameters": [n for n in program.names if n in params],
        "unsaved": [n for n in program.names if n not in holders],
        "ranks": [{"rank": r, "file": shard_name(r),
                   "roles": [{"dp": rm.dp_index(r), "copy": role.copy, "stage": role.stage,
                              "tile": role.tile} for role in rm.roles_of(r)]}
                  for r in range(program.world_size)],
        "holders": {n: holders[n] for n in program.names if n in holders},
        "extra": extra,
    }


def read_manifest(folder: str | os.PathLike[str]) -> dict[str, Any]:
    """The checkpoint's ``checkpoint.json`` (step, plan, layout, names, extra)."""
    path = Path(folder) / MANIFEST
    if not path.exists():
        raise CheckpointError(f"{path} does not exist: not a (complete) fxpar checkpoint. "
                              f"fxpar.checkpoint.save writes it last, after every shard")
    manifest = json.loads(path.read_text())
    if manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
        raise CheckpointError(f"{path} is not an fxpar checkpoint of version {VERSION} "
                              f"(format {manifest.get('format')!r}, version "
                              f"{manifest.get('version')!r})")
    return manifest


def _check_same_job(manifest: dict[str, Any], program: Program, folder: Path) -> None:
    """Raise (on every rank alike: each reads the same manifest) unless ``program`` is the job
    that wrote the checkpoint."""
    problems = []
    if manifest["world_size"] != program.world_size:
        problems.append(f"it has {manifest['world_size']} ranks, this program "
                        f"{program.world_size}")
    plan = program.plan.to_json()
    diff = [f"{k}={manifest['plan'].get(k)!r} (now {v!r})" for k, v in plan.items()
            if manifest["plan"].get(k) != v]
    if diff:
        problems.append("its plan has " + ", ".join(diff))
    if manifest["names"] != list(program.names):
        problems.append("it is of another model (its state_dict keys differ)")
    if problems:
        raise CheckpointError(
            f"checkpoint {folder} was saved by another job: {'; '.join(problems)}. Resume with "
            f"the same model and plan on the same number of ranks, or change plans through "
            f"the single-device form: state = fxpar.checkpoint.export({str(folder)!r}) (or "
            f"`python -m fxpar.checkpoint export {folder} model.pt`), then "
            f"rank_program.load_state_dict(state) (the optimizer state and step start afresh)")


def load(rp: RankProgram, folder: str | os.PathLike[str]) -> int:
    """Restore this rank's shard in place (parameters, buffers, optimizer, RNG); returns the
    step it was saved at. Collective in the sense that every rank must call it; it communicates
    nothing, and a checkpoint of another plan or world size raises on every rank alike."""
    folder = Path(folder)
    manifest = read_manifest(folder)
    _check_same_job(manifest, rp.program, folder)
    path = folder / manifest["ranks"][rp.rank]["file"]
    if not path.exists():
        raise CheckpointError(f"{path} is missing: every rank must see the whole checkpoint "
                              f"folder (a shared file system)")
    shard = torch.load(path, map_location="cpu", weights_only=True)
    if shard["step"] != manifest["step"]:
        raise CheckpointError(
            f"{path} is from step {shard['step']} but {folder / MANIFEST} from step "
            f"{manifest['step']}: a save into this folder did not finish; use an earlier "
            f"checkpoint (save each step into its own folder to always keep one)")
    if set(shard["stages"]) != set(rp.stages):
        raise CheckpointError(f"{path} holds (copy, stage) {sorted(shard['stages'])}, this "
                              f"rank runs {sorted(rp.stages)}: not this job's checkpoint")
    with torch.no_grad():
        for key, module in rp.stages.items():
            try:  # copies into the existing tensors (assign=False)
                module.load_state_dict(shard["stages"][key], strict=True)
            except RuntimeError as e:
                raise CheckpointError(f"{path}, (copy, stage) {key}: {e}") from e
    if (shard["optimizer"] is None) != (rp.optimizer is None):
        saved = "without" if shard["optimizer"] is None else "with"
        now = "none" if rp.optimizer is None else "one"
        raise CheckpointError(f"{path} was saved {saved} an optimizer, this program has {now}: "
                              f"compile with the same optimizer= as the job that saved it")
    if rp.optimizer is not None:
        rp.optimizer.load_state_dict(shard["optimizer"])
    torch.set_rng_state(shard["rng"])
    return int(manifest["step"])


# -- the single-device form ------------------------------------------------------------------
def export(folder: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """The single-device ``state_dict`` of a checkpoint, in the original model's key order
    (each key from copy 0, tile 0, replica 0 of its stage). Reads files only: no MPI."""
    folder = Path(folder)
    manifest = read_manifest(folder)
    shards: dict[int, dict[str, Any]] = {}
    out: dict[str, torch.Tensor] = {}
    for name in manifest["names"]:
        if name not in manifest["holders"]:
            continue  # used by no stage: never saved (listed in manifest["unsaved"])
        rank, copy_, stage = manifest["holders"][name]
        if rank not in shards:
            path = folder / manifest["ranks"][rank]["file"]
            if not path.exists():
                raise CheckpointError(f"{path} is missing: export needs the shards listed in "
                                      f"{folder / MANIFEST}")
            shards[rank] = torch.load(path, map_location="cpu", weights_only=True)
        out[name] = shards[rank]["stages"][(copy_, stage)][name]
    return out


def load_state_dict(rp: RankProgram, state_dict: dict[str, torch.Tensor],
                    strict: bool = True) -> list[str]:
    """``RankProgram.load_state_dict``: the keys of this rank's modules (every copy) copied in
    place from a single-device ``state_dict``; returns the keys loaded."""
    program = rp.program
    known = set(program.names)
    wanted: dict[StageKey, list[str]] = {
        key: [k for k in m.state_dict() if k in known] for key, m in rp.stages.items()}
    needed = sorted({k for keys in wanted.values() for k in keys}, key=rp._order)
    if strict:
        missing = [k for k in needed if k not in state_dict]
        unknown = [k for k in state_dict if k not in known]
        if missing or unknown:
            what = []
            if missing:
                what.append(f"missing {len(missing)} key(s) rank {rp.rank} needs: "
                            f"{_some(missing)}")
            if unknown:
                what.append(f"{len(unknown)} key(s) the compiled model does not have: "
                            f"{_some(unknown)}")
            raise CheckpointError(f"load_state_dict: {'; '.join(what)}. Pass the whole "
                                  f"single-device state_dict of the same model "
                                  f"(model.state_dict()), or strict=False to load what matches")
    with torch.no_grad():
        for key, module in rp.stages.items():
            part = {k: state_dict[k] for k in wanted[key] if k in state_dict}
            try:
                module.load_state_dict(part, strict=False)  # copy_ into the existing tensors
            except RuntimeError as e:
                raise CheckpointError(f"load_state_dict into (copy, stage) {key}: {e}") from e
    return [k for k in needed if k in state_dict]


def _some(keys: Sequence[str], n: int = 8) -> str:
    return ", ".join(keys[:n]) + (f", ... ({len(keys) - n} more)" if len(keys) > n else "")


# -- command line --------------------------------------------------------------------------------
def main(argv: Sequence[str] | None = None) -> int:
    """``fxpar-checkpoint export CKPT_DIR OUT.pt``: write the single-device state_dict."""
    parser = argparse.ArgumentParser(
        prog="fxpar-checkpoint", description="Inspect or convert an fxpar sharded checkpoint.")
    sub = parser.add_subparsers(dest="command", required=True)
    ex = sub.add_parser("export", help="write the single-device state_dict (torch.save) that "
                                       "model.load_state_dict accepts")
    ex.add_argument("folder", help="checkpoint folder (holds checkpoint.json)")
    ex.add_argument("out", help="output file, e.g. model.pt")
    info = sub.add_parser("info", help="print the checkpoint's step, plan and layout")
    info.add_argument("folder")
    args = parser.parse_args(argv)
    try:
        manifest = read_manifest(args.folder)
        if args.command == "info":
            print(_describe(manifest))
            return 0
        state = export(args.folder)
    except CheckpointError as e:
        print(f"fxpar-checkpoint: {e}", file=sys.stderr)
        return 1
    torch.save(state, args.out)
    params = set(manifest["parameters"])
    n_params = sum(1 for k in state if k in params)
    size = sum(t.numel() * t.element_size() for t in state.values())
    print(f"wrote {args.out}: {len(state)} tensors ({n_params} parameters, "
          f"{len(state) - n_params} buffers, {size / 2**20:.2f} MiB) of step "
          f"{manifest['step']}, from a {manifest['world_size']}-rank checkpoint")
    if manifest["unsaved"]:
        print(f"not in the checkpoint (used by no stage): {_some(manifest['unsaved'])}")
    return 0


def _describe(manifest: dict[str, Any]) -> str:
    from fxpar.plan import Plan

    default = Plan().to_json()
    plan = {k: v for k, v in manifest["plan"].items() if default.get(k) != v}
    lines = [f"step {manifest['step']}, {manifest['world_size']} ranks, "
             f"{len(manifest['names'])} tensors", f"plan: {plan}"]
    for row in manifest["ranks"]:
        roles = ", ".join(f"dp {r['dp']} copy {r['copy']} stage {r['stage']} tile {r['tile']}"
                          for r in row["roles"])
        lines.append(f"  {row['file']}: {roles}")
    if manifest.get("extra"):
        lines.append(f"extra: {manifest['extra']}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
