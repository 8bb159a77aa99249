"""An exponential moving average of a rank program's weights, kept sharded like the weights.

Each rank keeps the average of the parameters and floating-point buffers (BatchNorm running
statistics) its stages hold, under the original model's names; other buffers
(``num_batches_tracked``) are copied, as timm's ``ModelEmaV3`` does. The update is
``torch.optim.swa_utils.get_ema_multi_avg_fn`` (one foreach lerp per dtype)::

    ema = decay_t * ema + (1 - decay_t) * weight,   after every optimizer step t = 0, 1, ...
    decay_t = min(decay, (1 + t) / (10 + t))         (warmup=True: TensorFlow's
                                                      ExponentialMovingAverage(num_updates=t))
    decay_t = decay                                  (warmup=False)

and the average starts from the weights at :class:`EMA`'s creation (as timm's and
TensorFlow's do; ``AveragedModel`` instead copies the first update in). Without the warm-up,
an average of decay 0.9999 would hold the random initial weights for thousands of steps.

GEMS copies and data-parallel replicas hold identical weights, so each rank averages one
tensor per name (its first copy's) and :meth:`EMA.applied` puts the average into every copy it
holds. :meth:`EMA.full_state_dict` gathers the whole model's average to rank 0, keyed and
ordered as ``RankProgram.full_state_dict``; a checkpoint keeps each rank's shard
(``Trainer``: ``fxpar.program.checkpoint.save(..., state=...)``) and
``fxpar.program.checkpoint.export(folder, ema=True)`` reads the average back without MPI.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
from torch.optim.swa_utils import get_ema_multi_avg_fn

if TYPE_CHECKING:
    from fxpar.program.program import RankProgram


def decay_at(decay: float, t: int, warmup: bool = True) -> float:
    """The decay of update ``t`` (0 for the first; the module doc)."""
    return min(decay, (1 + t) / (10 + t)) if warmup else decay


class EMA:
    """The moving average of ``rp``'s parameters and buffers (the module doc). Build it before
    training (or before resuming: :meth:`load_state_dict` then restores the saved average),
    after ``rp.to(device)`` (the average lives beside the weights); call :meth:`update` after
    each optimizer step on every rank. ``with ema.applied(): rp.predict(image)`` predicts with
    the average."""

    def __init__(self, rp: RankProgram, decay: float, warmup: bool = True) -> None:
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"EMA decay {decay}: give a decay in [0, 1), e.g. 0.999 "
                             f"(0.9999 for long runs)")
        self.rp, self.decay, self.warmup = rp, float(decay), warmup
        self.updates = 0
        """Optimizer steps averaged so far."""
        known = set(rp.program.names)
        live: dict[str, list[torch.Tensor]] = {}
        for _, module in sorted(rp.stages.items()):  # copy 0 first
            for name, t in module.state_dict(keep_vars=True).items():
                ts = live.setdefault(name, [])
                if name in known and all(t is not u for u in ts):
                    ts.append(t)
        order = rp.program.name_order
        self.live = {k: live[k] for k in sorted(live, key=lambda k: order.get(k, len(order)))
                     if live[k]}
        """Every tensor of this rank under each name (one per model copy it holds)."""
        first: dict[int, torch.Tensor] = {}  # aliases (one tensor, two names) share an average
        self.shadow = {k: first.setdefault(id(ts[0]), ts[0].detach().clone())
                       for k, ts in self.live.items()}
        """The average, under the original model's names."""

    def _pairs(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """(average, tensor it follows) once per distinct average."""
        seen: set[int] = set()
        for k, avg in self.shadow.items():
            if id(avg) not in seen:
                seen.add(id(avg))
                yield avg, self.live[k][0].detach()

    @torch.no_grad()
    def update(self) -> None:
        """Average in the current weights (one optimizer step more)."""
        groups: dict[tuple[torch.dtype, torch.device], tuple[list, list]] = {}
        for avg, now in self._pairs():
            if avg.is_floating_point():
                a, b = groups.setdefault((avg.dtype, avg.device), ([], []))
                a.append(avg)
                b.append(now)
            else:
                avg.copy_(now)
        ema = get_ema_multi_avg_fn(decay_at(self.decay, self.updates, self.warmup))
        for avgs, nows in groups.values():
            ema(avgs, nows, None)
        self.updates += 1

    @contextmanager
    def applied(self) -> Iterator[None]:
        """Inside, every copy of the weights this rank holds is the average (validation,
        prediction); the weights are put back exactly afterwards. Not collective, but every rank
        of a forward must be inside it."""
        saved = [(t, t.detach().clone()) for ts in self.live.values() for t in ts]
        try:
            with torch.no_grad():
                for k, ts in self.live.items():
                    for t in ts:
                        t.copy_(self.shadow[k])
            yield
        finally:
            with torch.no_grad():
                for t, was in saved:
                    t.copy_(was)

    def state_dict(self) -> dict[str, Any]:
        """This rank's average (for its checkpoint shard)."""
        return {"updates": self.updates, "shadow": dict(self.shadow)}

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a saved average (the same model and plan: same names and shapes) and its
        count of updates, in place (the decay stays this one's)."""
        saved = state["shadow"]
        if set(saved) != set(self.shadow):
            raise ValueError(f"this EMA state averages {len(saved)} tensors, this rank "
                             f"{len(self.shadow)}: not this rank's state of this model")
        for k, avg in self.shadow.items():
            avg.copy_(saved[k])
        self.updates = int(state["updates"])

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """Collective: the whole model's average on rank 0 (the keys and order of
        ``RankProgram.full_state_dict``), None on the other ranks."""
        comm = self.rp.comm
        local = dict(self.shadow)
        parts = [local] if comm is None else comm.gather_object(local, root=0)
        if parts is None:
            return None
        merged: dict[str, torch.Tensor] = {}
        for part in parts:
            merged.update(part)
        return {k: merged[k] for k in self.rp.program.names if k in merged}
