"""Host reads of tensor values: what makes a GPU's host wait for its queue, counted anywhere.

On a GPU, ``loss.item()``, ``bool(t)``, ``t.tolist()`` and friends stop the host until every
kernel queued before them has run: the next step's work cannot be queued meanwhile.
``torch.cuda.set_sync_debug_mode`` reports them on a GPU only. :class:`HostReads` counts the
same calls on any device (a ``TorchFunctionMode``: it sees each Python-level read of a tensor's
values), so a test on a CPU machine pins how many a training step makes: fxpar's step makes
one, the loss it returns (read together with the NaN/inf flags, fxpar.runtime.guard).

Not counted: MPI reading a CPU tensor's memory in place (``numpy()``, no copy), which is how
messages travel on a CPU; on a GPU a message is a device buffer handed to NCCL or a CUDA-aware
MPI (fxpar.comm).
"""

from __future__ import annotations

import traceback
from collections import Counter
from collections.abc import Callable
from typing import Any

from torch.overrides import TorchFunctionMode

READS = frozenset({"item", "tolist", "__bool__", "__float__", "__int__", "__index__",
                   "__complex__"})
"""The Tensor methods that read values back to the host."""


class HostReads(TorchFunctionMode):
    """Counts host reads of tensor values while active (per thread, like every torch mode).

    ``where`` counts them by the innermost frame of fxpar (or the caller) that made them, for
    a failing test to say which line to look at."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0
        self.where: Counter[str] = Counter()

    def __torch_function__(self, func: Callable[..., Any], types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        if getattr(func, "__name__", "") in READS:
            self.count += 1
            frames = [f for f in traceback.extract_stack()[:-1]
                      if "torch/" not in f.filename.replace("\\", "/")]
            if frames:
                f = frames[-1]
                self.where[f"{func.__name__} at {f.filename}:{f.lineno}"] += 1
        return func(*args, **(kwargs or {}))

    def report(self) -> str:
        return "; ".join(f"{n} x {w}" for w, n in self.where.most_common())
