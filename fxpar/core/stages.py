"""The stages of one model copy as data: each stage's module, where its inputs come from, and the
tensors that travel between stages (built by fxpar.compiler.stages, executed by the runtime)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import fx

from fxpar.core.schedule import Links


@dataclass(frozen=True)
class Transfer:
    """Output ``src_out`` of stage ``src`` is input ``dst_in`` of stage ``dst`` (per micro-batch).

    ``grad``: a floating-point tensor, whose gradient travels back from ``dst`` to ``src``.
    """

    id: int
    src: int
    src_out: int
    dst: int
    dst_in: int
    shape: tuple[int, ...]
    """The whole tensor's shape (a tiled tensor's tiles are cut from it)."""
    dtype: torch.dtype
    tiled: bool = False
    """The tensor is tiled (it leaves a spatial stage as tiles)."""

    @property
    def grad(self) -> bool:
        return self.dtype.is_floating_point

    @property
    def nbytes(self) -> int:
        return int(torch.Size(self.shape).numel()) * torch.empty((), dtype=self.dtype).itemsize


@dataclass(frozen=True)
class StageInput:
    """Where a stage's input comes from: model input ``index`` ("batch"), or transfer ``index``."""

    source: str
    index: int


@dataclass(frozen=True)
class StageGraph:
    """All stages of one model copy."""

    modules: tuple[fx.GraphModule, ...]
    inputs: tuple[tuple[StageInput, ...], ...]
    """Per stage, its module's positional inputs in order."""
    n_outputs: tuple[int, ...]
    """Per stage, the length of the tuple its module returns."""
    transfers: tuple[Transfer, ...]
    mutated_inputs: tuple[frozenset[int], ...] = ()
    """Per stage, positions of inputs that an in-place op writes to (the runtime hands those
    ops a copy: autograd forbids in-place writes to a leaf that requires grad)."""
    out_spec: Any = None
    """The model output's structure (a ``torch.utils._pytree.TreeSpec``; None: one tensor):
    the last stage returns its leaves, flat (fxpar.core.outputs)."""

    def sends(self, stage: int) -> list[Transfer]:
        return [t for t in self.transfers if t.src == stage]

    def recvs(self, stage: int) -> list[Transfer]:
        return [t for t in self.transfers if t.dst == stage]


def links_of(graph: StageGraph) -> Links:
    """Which stages each stage sends to (from the transfers)."""
    links: Links = {s: set() for s in range(len(graph.modules))}
    for t in graph.transfers:
        links[t.src].add(t.dst)
    return links
