"""What differs between the torch releases fxpar supports, in one place.

fxpar is tested at both ends of its range: the whole suite on torch 2.14, a core subset on torch
2.11 (``make test-oldest-torch``), and it admits 2.15. Each function here papers over one
difference and says which releases need it; the rest of fxpar calls these and never compares
torch versions itself.
"""

from __future__ import annotations

import inspect
import operator
from collections.abc import Callable

from torch import fx
from torch.fx.passes.split_module import split_module

TESTED = ("2.11", "2.14")
"""The oldest and the newest torch release the suites run on."""

_SPLIT_HAS_TUPLE_RETURN = "tuple_return" in inspect.signature(split_module).parameters


def split_module_tuples(gm: fx.GraphModule, stage_of: Callable[[fx.Node], int],
                        qualnames: dict[str, str]) -> fx.GraphModule:
    """torch.fx's ``split_module`` (the original node order kept), every submodule returning a
    tuple. torch 2.11's ``split_module`` has no ``tuple_return`` (2.14's has): a submodule with
    one output returns it bare, so it is wrapped here and its users read item 0."""
    if _SPLIT_HAS_TUPLE_RETURN:
        return split_module(gm, gm, stage_of, qualname_map=qualnames, keep_original_order=True,
                            tuple_return=True)
    top = split_module(gm, gm, stage_of, qualname_map=qualnames, keep_original_order=True)
    for call in [n for n in top.graph.nodes if n.op == "call_module"]:
        sub = top.get_submodule(str(call.target))
        out = next(n for n in reversed(sub.graph.nodes) if n.op == "output")
        if isinstance(out.args[0], (tuple, list)):
            continue
        out.args = ((out.args[0],),)
        sub.recompile()
        users = list(call.users)
        with top.graph.inserting_after(call):
            item = top.graph.call_function(operator.getitem, (call, 0))
        for user in users:
            user.replace_input_with(call, item)
    top.recompile()
    return top
