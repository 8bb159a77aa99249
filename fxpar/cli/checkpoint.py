"""``fxpar-checkpoint``: inspect or convert a sharded checkpoint (fxpar.program.checkpoint).

    fxpar-checkpoint info ckpt/              # step, versions kept, plan, which rank holds what
    fxpar-checkpoint export ckpt/ model.pt   # the single-device state_dict
    fxpar-checkpoint verify ckpt/            # every shard's size and sha256 (exit 1: damaged)
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from fxpar.program.checkpoint import (
    LATEST,
    CheckpointError,
    ShardCheck,
    _open,
    check_shards,
    damaged,
    export,
)
from fxpar.program.checkpoint_folder import complete, read_latest, some_keys, version_folders


def main(argv: Sequence[str] | None = None) -> int:
    """``fxpar-checkpoint export CKPT_DIR OUT.pt``: write the single-device state_dict;
    ``fxpar-checkpoint info CKPT_DIR``: print its step, versions, plan and layout;
    ``fxpar-checkpoint verify CKPT_DIR``: check every shard, exit 1 when one is damaged."""
    parser = argparse.ArgumentParser(
        prog="fxpar-checkpoint", description="Inspect or convert an fxpar sharded checkpoint.")
    sub = parser.add_subparsers(dest="command", required=True)
    ex = sub.add_parser("export", help="write the single-device state_dict (torch.save) that "
                                       "model.load_state_dict accepts")
    where = ("checkpoint folder (its 'latest' version is used), or one version's folder "
             "(DIR/step-NNNNNNNN)")
    ex.add_argument("folder", help=where)
    ex.add_argument("out", help="output file, e.g. model.pt")
    info = sub.add_parser("info", help="print the checkpoint's step, plan and layout")
    info.add_argument("folder", help=where)
    verify = sub.add_parser("verify", help="check every shard's size and sha256 against "
                                           "checkpoint.json; exit 1 when one is damaged")
    verify.add_argument("folder", help=where)
    args = parser.parse_args(argv)
    try:
        version, manifest = _open(args.folder)
        if args.command == "info":
            print(_describe(Path(args.folder), version, manifest))
            return 0
        if args.command == "verify":
            version, checks = check_shards(version)
            print(f"{version}: step {manifest['step']}, {_shards(len(checks))}")
            for check in checks:
                print(f"  {check.file}: {_status(check)}")
            if any(c.problem is not None for c in checks):
                raise CheckpointError(damaged(version, checks, why=False))  # printed above
            print(f"all {_shards(len(checks))} intact")
            return 0
        state = export(version)
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
        print(f"not in the checkpoint (used by no stage): {some_keys(manifest['unsaved'])}")
    return 0


def _describe(root: Path, version: Path, manifest: dict[str, Any]) -> str:
    from fxpar.core.plan import Plan

    default = Plan().to_json()
    plan = {k: v for k, v in manifest["plan"].items() if default.get(k) != v}
    lines = [f"step {manifest['step']}, {manifest['world_size']} ranks, "
             f"{len(manifest['names'])} tensors", f"folder: {version}"]
    pointer = read_latest(root)
    if pointer is not None and version != root:
        kept = ", ".join(pointer["versions"])
        lines[-1] += f" (named by {root / LATEST}; versions kept: {kept})"
        unfinished = [p.name for p in version_folders(root) if not complete(p)]
        if unfinished:
            lines.append(f"unfinished saves (ignored; the next save removes them): "
                         f"{', '.join(unfinished)}")
    lines.append(f"plan: {plan}")
    for row in manifest["ranks"]:
        roles = ", ".join(f"dp {r['dp']} copy {r['copy']} stage {r['stage']} tile {r['tile']}"
                          for r in row["roles"])
        lines.append(f"  {row['file']}: {roles}")
    if manifest.get("extra"):
        lines.append(f"extra: {manifest['extra']}")
    return "\n".join(lines)


def _shards(n: int) -> str:
    return f"{n} shard" + "s" * (n != 1)


def _status(check: ShardCheck) -> str:
    if check.size is None:
        return "MISSING"
    if check.problem is not None:
        return f"DAMAGED: {check.problem}"
    if check.sha256 is None:
        return (f"readable, {check.size} bytes (no checksum recorded: saved before fxpar "
                f"recorded them; not verified)")
    return f"ok, {check.size} bytes, sha256 {check.sha256}"


if __name__ == "__main__":
    sys.exit(main())
