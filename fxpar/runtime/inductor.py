"""``Plan(compile=True)``: each stage module a rank runs goes through ``torch.compile`` (Inductor).

A stage is an ordinary graph of ATen ops and fxpar's communicating custom ops
(fxpar.runtime.spatial.library): TorchDynamo traces it whole, AOTAutograd makes its forward and
backward graphs, and Inductor fuses the code between the communicating ops (a convolution's
BatchNorm, ReLU and residual add become one loop), which stay calls. Stage boundaries are
the pipeline's messages: the runtime loop calls the
compiled stage as it called the module.

Compilation happens at the first call with a given input shape, dtype, device, grad mode and
training flag (a guard failure compiles again, up to torch's recompile limit, after which that
stage runs eagerly and torch warns). Inductor's caches (FX graph cache, AOTAutograd cache,
``TORCHINDUCTOR_CACHE_DIR``, by default a folder under the system temp directory) are shared by
every rank on a node and by later runs: only the first rank to compile a graph pays for it
cold. The first step's time includes the compilation (``fxpar-run`` says so).

What stays eager: the loss (the user's function; fxpar.runtime.loop calls it on the last
stage's output), a stage cut into checkpoint segments (``Plan.recompute_segments > 1``:
``torch.utils.checkpoint`` replays each segment's exchanges from a record, in Python), and, for
now, every spatial stage. Inductor (torch 2.14.1) does not keep the order of fxpar's ops
although they are registered as ordered effects: in a compiled ResNet-18 SP2 stage at 128x128
its generated code ran layer2.0's downsample convolution (halo tag 40) and its BatchNorm
statistics before layer2.0.conv1 (tag 32) on rank 1 and between conv1 and conv2 on rank 0 (the
graph has them after conv2). Halo messages match by tag and survive that; the statistics'
allgathers do not: rank 1 waited in one allgather while rank 0 waited for the receive of
conv1's halo (a deadlock, turned into an error by the watchdog), and two allgathers of equal
size would have paired silently. Until the ops carry their order as a data dependency, tiles
run eagerly (a warning says so); pipeline and other non-spatial stages, which hold no fxpar op,
compile. A compiled spatial stage also gained nothing yet: its BatchNorm and pooling are custom
ops Inductor cannot fuse into (SP2 ResNet-18 at 512x512 measured 1.05x slower compiled,
docs/benchmarks.md).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx

from fxpar.core.fxgraph import generated

Key = tuple[int, int]

OPTIONS = {"inplace_buffers": False}
"""Inductor settings of every compiled stage (``torch.compile(options=...)``: this compile
only, no process-wide config). ``inplace_buffers`` off works around an Inductor memory-planning
bug seen in torch 2.14.1 on an SP2 stage with GroupNorm, a max pool and an upsampling skip
(``tests/mpi/cases/inductor_cases.py``): a kernel wrote its output in place into a view of a
``torch.stack`` buffer, and the buffer was then reused for a later output while that view was
still saved for backward, so two saved tensors shared memory and the gradients came out wrong
by O(1). Reusing freed buffers (``allow_buffer_reuse``) stays on; turning either one off fixes
that graph."""


@dataclass
class CompiledStages:
    """The compiled callables of a rank's stage modules, ``{(copy, stage): fn}``, and the
    stages that have run through them."""

    calls: dict[Key, Callable[..., Any]]
    ran: set[Key] = field(default_factory=set)

    @classmethod
    def of(cls, stages: dict[Key, fx.GraphModule]) -> CompiledStages:
        """Every stage module compiled (lazily: torch.compile compiles at the first call)."""
        return cls({k: torch.compile(generated(m), backend="inductor", dynamic=False,
                                     options=dict(OPTIONS))
                    for k, m in stages.items()})

    def __call__(self, key: Key, module: fx.GraphModule, *ins: Any) -> Any:
        """Stage ``key``'s compiled callable on ``ins``, or its ``module`` where it has none."""
        fn = self.calls.get(key)
        if fn is None:
            return module(*ins)
        self.ran.add(key)
        return fn(*ins)

    def describe(self) -> str:
        """One line: what was compiled, and where Inductor caches it."""
        # torch's inductor package (and dynamo under it) loads only for a compiled plan
        from torch._inductor.runtime.cache_dir_utils import cache_dir

        return (f"torch.compile (Inductor): rank 0's {len(self.calls)} non-spatial stage "
                f"graph(s), "
                f"forward and backward, compiled during step 1 (its time includes that); "
                f"cached in {cache_dir()} (TORCHINDUCTOR_CACHE_DIR) for later runs and the "
                f"other ranks of this node")


def compiled_stages(compile: bool, segments: int, stages: dict[Key, fx.GraphModule],
                    spatial_stages: int = 0, split: frozenset[Key] = frozenset()
                    ) -> CompiledStages | None:
    """``Plan(compile=..., recompute_segments=...)``'s compiled stages, or None (eager). The
    first ``spatial_stages`` stages (tiles) stay eager (the module doc says why), and so do
    the stages in ``split`` (whose backward the schedule splits: zero bubble) on a torch whose
    autograd cannot run a compiled node's backward by its edges (:func:`edges_of_compiled`)."""
    if not compile:
        return None
    if segments > 1:
        warnings.warn("Plan(compile=True) with recompute_segments > 1: stages cut into "
                      "checkpoint segments run eagerly (not compiled)", stacklevel=3)
        return None
    tiles = {k for k in stages if k[1] < spatial_stages}
    if tiles:
        warnings.warn("Plan(compile=True): spatial stages run eagerly (not compiled; "
                      "fxpar.runtime.inductor says why); the other stages are compiled",
                      stacklevel=3)
    held = set(split) & set(stages) if not edges_of_compiled() else set()
    if held:
        warnings.warn(f"Plan(compile=True): torch {torch.__version__} cannot split the "
                      f"backward of a compiled stage (zero bubble's W); those stages run "
                      f"eagerly", stacklevel=3)
    return CompiledStages.of({k: m for k, m in stages.items() if k not in tiles | held})


SPLIT_BACKWARD_TORCH = "2.14"
"""The first torch with which a compiled stage's backward splits (zero bubble's W,
fxpar.runtime.splitgrad) in fxpar's tests. torch 2.11 fails there: ``torch.autograd.backward``
of a ``GradientEdge`` of the compiled graph's node reads its ``_input_metadata``, which that
node refuses ("a legacy access pattern that is no longer supported"); 2.12 and 2.13 were not
tried."""


def edges_of_compiled() -> bool:
    """Whether this torch splits a compiled stage's backward (:data:`SPLIT_BACKWARD_TORCH`)."""
    return torch.__version__ >= SPLIT_BACKWARD_TORCH  # a TorchVersion: compares as versions
