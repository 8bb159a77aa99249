"""What stands around each training step of a rank program: nothing hangs, nothing is lost.

* **Failed steps.** An exception out of a step marks the program failed
  (fxpar.comm.failfast.mark_failed): its peers wait in that step, so leaving the process
  (caught or not) ends the whole job, and the program refuses further steps.
* **NaN and inf.** Before the optimizer step, every rank checks its losses, gradients and
  floating buffers; one allreduce (a flag per rank) makes it one decision for the job
  (:data:`NONFINITE_ENV`, ``fxpar-run --nonfinite``):

  - ``stop`` (default): the optimizer step is skipped and the step's buffer updates undone on
    every rank, then every rank raises the same :class:`NonFiniteError`, naming the step and
    the ranks. The program stays consistent: the state is that after the previous step, so a
    script may catch it and go on (lower the learning rate, skip the batch).
  - ``skip``: the same, without the error: the step is dropped everywhere (``skipped`` counts).
  - ``off``: no check, no allreduce.

  Float16 plans keep their dynamic loss scale's own check (fxpar.runtime.scale) instead.
* **Faults** (``FXPAR_FAULT``, fxpar.runtime.inject) and the watchdog's step clock
  (fxpar.comm.watchdog: the auto limit follows the slowest step).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch

from fxpar.comm import failfast, watchdog
from fxpar.comm.mpi import Comm
from fxpar.core.faults import from_env
from fxpar.core.options import setting
from fxpar.core.plan import PlanError
from fxpar.runtime.inject import Injector

NONFINITE_ENV = "FXPAR_NONFINITE"
POLICIES = ("stop", "skip", "off")
_LOSS, _GRAD, _BUF = 1, 2, 4


class NonFiniteError(RuntimeError):
    """A NaN or inf in a step's loss, gradients or buffers, on some rank; raised on every
    rank alike after the step was undone."""

    everywhere = True


class ProgramFailed(RuntimeError):
    """A step of this rank program failed earlier: it cannot train on."""


def nonfinite_policy(value: str | None = None) -> str:
    """``value`` (default: the option ``FXPAR_NONFINITE``, fxpar.core.options), checked."""
    v = (setting("nonfinite") if value is None else value) or "stop"
    if v not in POLICIES:
        raise PlanError(f"{NONFINITE_ENV}={v!r}: use stop (end the job naming the step and "
                        f"ranks), skip (drop such steps on every rank) or off (no check)")
    return v


def nonfinite_message(step: int, bad: dict[int, int]) -> str:
    def what(flags: int) -> str:
        parts = [n for f, n in ((_LOSS, "loss"), (_GRAD, "gradients"), (_BUF, "buffers"))
                 if flags & f]
        return " and ".join(parts)

    where = "; ".join(f"rank {r}: {what(f)}" for r, f in sorted(bad.items()))
    return (f"step {step}: NaN or inf values ({where}). The step was undone on every rank "
            f"(no optimizer step, buffers as before it): the state is that after step "
            f"{step - 1}. Look for the cause (learning rate, the input batch, a layer's "
            f"numerics; torch.autograd.detect_anomaly on one device), or drop such steps on "
            f"every rank: {NONFINITE_ENV}=skip (fxpar-run --nonfinite skip).")


def loss_total(losses: Iterable[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The sum of a step's losses as a float64 0-d tensor on ``device`` (no host read)."""
    return sum((t.to(device, torch.float64) for t in losses),
               torch.zeros((), dtype=torch.float64, device=device))


def _nonfinite(ts: Iterable[torch.Tensor]) -> torch.Tensor | None:
    """A 0-d bool tensor on the tensors' device: whether some element of ``ts`` is NaN or inf,
    read from their norms (one fused pass per dtype, as ``clip_grad_norm_(error_if_nonfinite=
    True)`` does: 10x faster than testing every element; a norm overflows only for values near
    the dtype's largest). None for no elements. Nothing is read back to the host here."""
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for t in ts:
        if t.numel():
            groups.setdefault((t.device, t.dtype), []).append(t.detach())
    bad = [~torch.isfinite(torch.stack(torch._foreach_norm(g))).all() for g in groups.values()]
    if not bad:
        return None
    return torch.stack([b.to(bad[0].device) for b in bad]).any()


@dataclass
class StepGuard:
    """One rank program's guard (see the module doc)."""

    rank: int
    comm: Comm | None
    buffers: Callable[[], list[torch.Tensor]]
    """This rank's buffers (BatchNorm statistics and counts), each once."""
    grads: Callable[[], list[torch.Tensor]]
    policy: str = field(default_factory=nonfinite_policy)
    steps: int = 0
    """Steps completed (set by a checkpoint load to the loaded step)."""
    skipped: int = 0
    """Steps dropped for NaN/inf (policy "skip")."""
    failed: str | None = None
    injector: Injector = field(init=False)
    _saved: list[torch.Tensor] | None = field(default=None, init=False)
    _bad: dict[int, int] = field(default_factory=dict, init=False)
    _start: float = field(default=0.0, init=False)
    _world: frozenset[int] | None = field(default=None, init=False)
    total: float | None = field(default=None, init=False)
    """The sum of this step's losses over every rank, read with the flags (None: not read)."""

    def __post_init__(self) -> None:
        nonfinite_policy(self.policy)
        self.injector = Injector(from_env(), self.rank)

    def begin(self) -> tuple[int, Callable[..., bool] | None]:
        """Before a step: its number and the runtime's fault hook for it."""
        if self.failed is not None:
            raise ProgramFailed(f"rank {self.rank}'s program failed earlier ({self.failed}); "
                                f"it cannot train on: its peers are still waiting in that "
                                f"step. End the job and resume from a checkpoint.")
        step = self.steps + 1
        dog = watchdog.current()
        if dog is not None:
            dog.step_began(step, self._members())
        self._bad = {}
        self.total = None
        self._saved = [b.detach().clone() for b in self.buffers()] \
            if self.policy != "off" else None
        self._start = time.perf_counter()
        return step, self.injector.hook(step)

    def finite(self, losses: list[torch.Tensor]) -> bool:
        """At STEP, on every rank: whether the step may go ahead. One allreduce and one read
        back to the host for everything: every rank's NaN/inf flags and the sum of the step's
        losses over all ranks (:attr:`total`, the loss the caller reports), so the step has
        no other host synchronisation (a GPU waits for its queue once)."""
        if self.policy == "off":
            return True
        grads = self.grads()
        buffers = [b for b in self.buffers() if b.is_floating_point()]
        where = next((t.device for t in (*losses, *grads, *buffers)), torch.device("cpu"))
        size = self.comm.size if self.comm is not None else 1
        me = self.rank if self.comm is not None else 0
        both = torch.zeros(size + 1, dtype=torch.float64, device=where)
        for bit, ts in ((_LOSS, losses), (_GRAD, grads), (_BUF, buffers)):
            bad = _nonfinite(ts)
            if bad is not None:
                both[me] += bad.to(where, torch.float64) * bit
        both[size] = loss_total(losses, where)
        if size > 1:
            self.comm.allreduce(both)  # type: ignore[union-attr]
        values = both.tolist()
        self._bad = {r: int(f) for r, f in enumerate(values[:size]) if f}
        self.total = values[size]
        return not self._bad

    def _members(self) -> frozenset[int] | None:
        """The world ranks of this program's communicator (None: unknown, every rank)."""
        ranks = getattr(self.comm, "world_ranks", None)
        if ranks is None:
            return None
        if self._world is None:
            self._world = frozenset(ranks())
        return self._world

    def end(self, step: int) -> None:
        """After the step's actions ran: undo a non-finite step (raising under "stop")."""
        if self._bad and self._saved is not None:
            with torch.no_grad():
                for b, saved in zip(self.buffers(), self._saved, strict=True):
                    b.copy_(saved)
        self._saved = None
        if self._bad:
            self.steps = step
            if self.policy == "stop":
                self._stop_clock()
                raise NonFiniteError(nonfinite_message(step, self._bad))
            self.skipped += 1
        self.steps = step
        self._stop_clock()

    def _stop_clock(self) -> None:
        dog = watchdog.current()
        if dog is not None:
            dog.step_ended(time.perf_counter() - self._start)

    def fail(self, step: int, error: BaseException, where: str = "") -> None:
        """Step ``step`` (or ``where``: another collective call) raised: mark the program
        failed (leaving the process ends the job); honour a ``caught-raise`` fault."""
        self.failed = f"{where or f'step {step}'}: {type(error).__name__}: {error}"
        failfast.mark_failed(f"rank {self.rank}, {self.failed}")
        if not where:
            self.injector.caught(step, error)
