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


def raw_flop_formula(formula: Callable[..., int]) -> Callable[..., int]:
    """torch's FLOP formula ``formula`` (a name in torch.utils.flop_counter, such as
    ``conv_backward_flop``) as written: shapes in, ``out_shape`` an argument like the others.
    ``register_flop_formula`` returns the formula wrapped by ``shape_wrapper`` (which takes
    ``out_val`` and passes ``out_shape=`` by keyword), so calling the module's name with
    ``out_shape`` in its place raises "got multiple values for argument 'out_shape'". torch
    2.11 to 2.14 wrap with ``functools.wraps`` (the original is ``__wrapped__``; 2.13's and
    2.14's also take ``**kwargs``); a release that returns the formula unwrapped gets it as it
    is."""
    return getattr(formula, "__wrapped__", formula)
