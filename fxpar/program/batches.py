"""What a rank program does with a batch's parts and a model's state at its edges: the targets
cut into the plan's chunks, the chunks' outputs put back together as the model's structure
(fxpar.core.outputs), and a single-device ``state_dict`` loaded into the stages a rank holds."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import fx

from fxpar.core.outputs import from_leaves, leaves_of
from fxpar.core.roles import chunks_per_copy
from fxpar.program.checkpoint_folder import CheckpointError, some_keys
from fxpar.program.compiled import RunnableProgram
from fxpar.runtime.loop import Tiling
from fxpar.runtime.spatial.group import TileGroups
from fxpar.runtime.spatial.ops import Join, group_key


def split_targets(y: Any, n: int) -> list[Any]:
    """The targets of each of ``n`` chunks: a tensor split along the batch, or a tuple of
    tensors (a target and a mask: ``loss_fn(output, *y)``) each split alike."""
    if y is None:
        return [None] * n
    if isinstance(y, torch.Tensor):
        return list(torch.tensor_split(y, n))
    if isinstance(y, tuple) and y and all(isinstance(t, torch.Tensor) for t in y):
        return [tuple(part) for part in zip(*(torch.tensor_split(t, n) for t in y),
                                            strict=True)]
    if n == 1:
        return [y]
    raise TypeError(f"targets of type {type(y).__name__} cannot be split into {n} chunks: "
                    f"pass a tensor whose first dimension is the batch, or a tuple of such "
                    f"tensors (a target and a mask)")


def joined_outputs(program: RunnableProgram, tiling: Tiling | None, groups: TileGroups,
                   results: dict[int, Any]) -> dict[int, tuple[Any, ...]]:
    """Each chunk's output (the last stage's value) as its leaves, the tiled ones joined over
    the tile group of the copy that ran it (collective over the tile groups)."""
    spec = program.graph.out_spec
    out = {k: leaves_of(spec, v) for k, v in results.items()}
    info, plan = program.spatial, program.plan
    last = plan.stages - 1
    if info is None or tiling is None or not info.out_tiled or not tiling.spatial(last):
        return out
    per_copy = chunks_per_copy(plan)
    rects = {e: tuple(info.grid.tile_rect(e, u) for u in range(info.grid.size))
             for e in info.leaf_extents if e is not None}
    with groups.bound(), torch.no_grad():
        for chunk in sorted(out):
            c = (chunk // per_copy) % plan.copies
            out[chunk] = tuple(x if e is None else
                               Join(rects[e], tiling.tiles[c], group_key(last, c))(x)
                               for x, e in zip(out[chunk], info.leaf_extents, strict=True))
    return out


def output_of(spec: Any, results: dict[int, tuple[Any, ...]]) -> Any:
    """The whole batch's output from its chunks' leaves, in the model's structure; None when
    this rank has none."""
    if not results:
        return None
    outs = [results[i] for i in sorted(results)]
    return from_leaves(spec, tuple(_concat(parts) for parts in zip(*outs, strict=True)))


def _concat(parts: tuple[Any, ...]) -> Any:
    """One leaf of the output over the chunks: tensors concatenated along the batch, 0-dim
    ones stacked (one per chunk: fxpar.compiler.outputs warns at compile), a constant once."""
    if not isinstance(parts[0], torch.Tensor):
        return parts[0]
    return torch.cat(parts) if parts[0].dim() else torch.stack(parts)


def load_stages(stages: dict[tuple[int, int], fx.GraphModule], names: Sequence[str],
                state_dict: dict[str, torch.Tensor], strict: bool, rank: int,
                order: Callable[[str], int]) -> list[str]:
    """Load a single-device ``state_dict`` into ``stages`` (every copy, in place); keys of
    other ranks' stages are ignored. Returns the keys loaded, in ``order``. strict: every key
    these stages need must be there, and no key outside the model (``names``)."""
    known = set(names)
    wanted: dict[tuple[int, int], list[str]] = {
        key: [k for k in m.state_dict() if k in known] for key, m in stages.items()}
    needed = sorted({k for keys in wanted.values() for k in keys}, key=order)
    if strict:
        missing = [k for k in needed if k not in state_dict]
        unknown = [k for k in state_dict if k not in known]
        if missing or unknown:
            what = []
            if missing:
                what.append(f"missing {len(missing)} key(s) rank {rank} needs: "
                            f"{some_keys(missing)}")
            if unknown:
                what.append(f"{len(unknown)} key(s) the compiled model does not have: "
                            f"{some_keys(unknown)}")
            raise CheckpointError(
                f"load_state_dict: {'; '.join(what)}. Pass the whole single-device "
                f"state_dict of the same model (model.state_dict()), or strict=False to "
                f"load what matches")
    with torch.no_grad():
        for key, module in stages.items():
            part = {k: state_dict[k] for k in wanted[key] if k in state_dict}
            try:
                module.load_state_dict(part, strict=False)  # copy_ into the existing tensors
            except RuntimeError as e:
                raise CheckpointError(f"load_state_dict into (copy, stage) {key}: {e}") from e
    return [k for k in needed if k in state_dict]
