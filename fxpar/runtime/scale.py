"""Dynamic loss scaling for float16 training (``Plan(precision="fp16")``), agreed by all ranks.

float16 gradients underflow below 6e-8, so the loss is multiplied by a scale S before backward
and every gradient divided by S before the optimizer step (torch.amp.GradScaler's scheme, with
its defaults: S starts at 2**16, halves on a step with an inf or NaN gradient, doubles after
2000 good steps in a row). In a compiled program the gradients of one model live on many ranks,
so the overflow check must be one decision: each rank unscales its own gradients and checks
them (``torch._amp_foreach_non_finite_check_and_unscale_``, GradScaler's kernel), then ONE
allreduce (max) over the world tells every rank whether any rank saw an inf. If so, every rank
skips the optimizer step and halves S; otherwise every rank steps. All ranks therefore hold the
same S and the same parameters as one process running GradScaler on the whole model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fxpar.comm.mpi import Comm
from fxpar.runtime.guard import loss_total


@dataclass
class LossScale:
    """The state of a dynamic loss scale (one per rank program; equal on every rank)."""

    scale: float = 2.0 ** 16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    good_steps: int = 0
    """Steps since the scale last changed with finite gradients everywhere."""
    skipped: int = 0
    """Optimizer steps skipped so far (an inf or NaN gradient on some rank)."""

    total: float | None = None
    """The sum of the last step's losses over every rank, read with the overflow flag."""

    def unscale(self, grads: list[torch.Tensor], comm: Comm | None,
                device: torch.device, losses: list[torch.Tensor] | None = None) -> bool:
        """Divide ``grads`` (this rank's) by the scale in place; True when the gradients of
        every rank of ``comm`` are finite (the step may go ahead), False when any rank saw an
        inf or NaN. Updates the scale either way; every rank must call it once per step.
        The flags and the sum of ``losses`` (this rank's) travel in one allreduce and come
        back to the host in one read: :attr:`total`."""
        found = torch.zeros(1, dtype=torch.float32, device=device)
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for g in grads:
            by_dtype.setdefault(g.dtype, []).append(g)
        inv = torch.full((1,), 1.0 / self.scale, dtype=torch.float32, device=device)
        for group in by_dtype.values():
            torch._amp_foreach_non_finite_check_and_unscale_(group, found, inv)
        both = torch.zeros(2, dtype=torch.float64, device=device)
        both[0] = found[0]  # 0 or 1 per rank: the sum is the ranks that saw an inf
        both[1] = loss_total(losses or (), device)
        if comm is not None and comm.size > 1:
            comm.allreduce(both)
        flags, self.total = both.tolist()
        finite = not flags
        self.update(finite)
        return finite

    def update(self, finite: bool) -> None:
        """GradScaler's rule: halve on overflow, double after ``growth_interval`` good steps."""
        if not finite:
            self.scale *= self.backoff_factor
            self.good_steps = 0
            self.skipped += 1
            return
        self.good_steps += 1
        if self.good_steps == self.growth_interval:
            self.scale *= self.growth_factor
            self.good_steps = 0
