"""GraphModules whose Python code is generated when it is first needed.

``fx.GraphModule`` generates and compiles Python source for its graph when it is built and each
time its graph is set. A compile builds the whole model's module, its split, every stage's
module and tile 0 of each spatial stage on every rank, and a rank then calls one or two of
them (a resnet18 SP2+PP2+GEMS+DP2 compile generated code 21 times; lazily, 8 times, all inside
torch.export, and it took 1.03 instead of 1.64 CPU-s). torch.fx's ``_LazyGraphModule``
(what torch.compile uses for the same reason) defers it to the first call, ``.code`` or pickle,
and is otherwise a GraphModule. It is torch-private (in torch.fx since 2.2, unchanged through
2.14): this module is its one user in fxpar.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import fx
from torch.fx._lazy_graph_module import _LazyGraphModule, _use_lazy_graph_module


def graph_module(root: torch.nn.Module | dict[str, object], graph: fx.Graph,
                 class_name: str = "GraphModule") -> fx.GraphModule:
    """``fx.GraphModule(root, graph, class_name)``, its code generated on first use."""
    return _LazyGraphModule(root, graph, class_name)


def replace_node(g: fx.Graph, old: fx.Node, new: fx.Node) -> None:
    """Swap ``old`` for ``new`` in ``g``: ``new`` keeps ``old``'s metadata (the global shape and
    layout of the value, which later passes read), every user of ``old`` reads ``new``."""
    new.meta.update(old.meta)
    old.replace_all_uses_with(new)
    g.erase_node(old)


def generated(gm: fx.GraphModule) -> fx.GraphModule:
    """``gm`` with its code generated now (in place): what ``torch.compile`` needs, since
    TorchDynamo does not trace a code generation still pending (torch 2.14: "Attempted to
    inline function marked as skipped ... _LazyGraphModule._lazy_forward"). A copy of a
    GraphModule (``copy.deepcopy``) defers its code again."""
    _LazyGraphModule.force_recompile(gm)
    return gm


@contextmanager
def lazy_code() -> Iterator[None]:
    """GraphModules that torch.fx builds inside (``split_module``'s) generate their code on
    first use."""
    with _use_lazy_graph_module(True):
        yield
