"""Typed node metadata: one namespaced ``node.meta`` key per concern, one frozen dataclass each.

Every pass records its decisions as a frozen dataclass whose class attribute ``KEY`` names its
slot (``"fxpar.cost"``, ``"fxpar.stage"``, ...). Read and write them only through :func:`get`
and :func:`put`, so a typo in a key is an AttributeError, not a silent miss::

    put(node, NodeCost(flops=..., out_bytes=..., param_bytes=...))
    cost = get(node, NodeCost)          # KeyError with the node's name if missing
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import ClassVar, Protocol, TypeVar

import torch
from torch import fx


class Meta(Protocol):
    KEY: ClassVar[str]


M = TypeVar("M", bound=Meta)


def put(node: fx.Node, value: Meta) -> None:
    """Store ``value`` on ``node`` under its class's key (replacing any older value)."""
    node.meta[type(value).KEY] = value


def get(node: fx.Node, cls: type[M]) -> M:
    """The ``cls`` record of ``node``; KeyError naming the node and the pass that writes it."""
    try:
        value = node.meta[cls.KEY]
    except KeyError:
        raise KeyError(f"node {node.name!r} has no {cls.KEY!r} metadata "
                       f"(has the pass that writes {cls.__name__} run?)") from None
    if not isinstance(value, cls):
        raise TypeError(f"node {node.name!r}: {cls.KEY!r} holds {type(value).__name__}, "
                        f"expected {cls.__name__}")
    return value


def find(node: fx.Node, cls: type[M]) -> M | None:
    """Like :func:`get`, but None when the node has no such record."""
    value = node.meta.get(cls.KEY)
    return value if isinstance(value, cls) else None


@dataclass(frozen=True)
class TensorInfo:
    """Shape and dtype of a node's tensor output(s), from shape propagation on fake tensors.

    ``shapes`` holds one entry per output tensor (one for an ordinary op; several for a node
    returning a tuple); empty for nodes that produce no tensor.
    """

    KEY: ClassVar[str] = "fxpar.tensor"
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[torch.dtype, ...]

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape of the single output tensor."""
        if len(self.shapes) != 1:
            raise ValueError(f"node has {len(self.shapes)} tensor outputs, not one")
        return self.shapes[0]

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the single output tensor."""
        return self.dtypes[0]

    @property
    def cell_bytes(self) -> int:
        """Bytes of one spatial cell (one pixel or voxel) of the single output tensor, over
        its batch and channels: what a halo row of one cell costs to send."""
        shape = self.shape
        return shape[0] * shape[1] * torch.empty((), dtype=self.dtype).element_size()


@dataclass(frozen=True)
class NodeCost:
    """What a node costs, per forward pass of the example batch.

    flops: floating-point operations of the forward (multiply-add = 2), from torch's
    FlopCounterMode; ops it has no formula for (pointwise, pooling) count 0.
    out_bytes: bytes of the node's output tensor(s).
    param_bytes: bytes of parameters and buffers the node owns (call_module / get_attr).
    """

    KEY: ClassVar[str] = "fxpar.cost"
    flops: int
    out_bytes: int
    param_bytes: int


def pretty_path(path: str) -> str:
    """export's module paths spell indices as ``layer1[0]`` or ``getattr(L['self'], ...)``
    on some versions; give the dotted name a user would write."""
    path = re.sub(r"L\['self'\]\.?", "", path)
    path = re.sub(r"\[(\d+)\]", r".\1", path)
    return path.strip(".")


def module_path(n: fx.Node) -> str:
    """The model module a node comes from (``layer1.0.conv1``), '' if unknown."""
    stack = n.meta.get("nn_module_stack")
    if not stack:
        return str(n.target) if n.op == "call_module" else ""
    return pretty_path(list(stack.values())[-1][0])
