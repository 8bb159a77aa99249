"""Run compiler passes in order; lint and recompile after each; dump the graph after any.

A pass is ``fn(gm, plan) -> gm`` that records its decisions in ``node.meta`` (see fxpar.meta).
User errors (PlanError, TraceError) pass through unchanged; anything else is a compiler bug and
is reported with the pass that raised it and the passes that ran before it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from torch import fx

from fxpar.plan import Plan, PlanError
from fxpar.trace import TraceError

Pass = Callable[[fx.GraphModule, Plan], fx.GraphModule]


class PassError(RuntimeError):
    """A pass failed on a valid model and plan: a bug in fxpar."""


def run_passes(gm: fx.GraphModule, plan: Plan, passes: Sequence[tuple[str, Pass]],
               after: Callable[[str, fx.GraphModule], None] | None = None) -> fx.GraphModule:
    """Apply ``passes``; ``after(name, gm)`` is called after each (for dumps)."""
    done: list[str] = []
    for name, fn in passes:
        try:
            gm = fn(gm, plan)
            gm.graph.lint()
            gm.recompile()
        except (PlanError, TraceError):
            raise
        except Exception as e:
            raise PassError(f"pass {name!r} failed (after {done or 'no passes'}): "
                            f"{type(e).__name__}: {e}") from e
        done.append(name)
        if after is not None:
            after(name, gm)
    return gm
