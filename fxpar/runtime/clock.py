"""Device time of a rank's actions: CUDA events around each one, read after the step.

On a GPU an action's host time is the time to queue its kernels, not to run them: the host
races ahead and waits later, wherever a value is read. :class:`CudaClock` records an event on
the current stream before and after each action (no host wait) and turns pairs into seconds
once the step's one host read has drained the queue (fxpar.train.metrics reads them after
``train_step``). On a CPU there is nothing to record: the host times are the device times.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from fxpar.core.schedule import Action


@dataclass(frozen=True)
class ActionTime:
    """When one action ran (``time.perf_counter`` seconds) and how long of it was spent blocked
    on communication (``wait``): the runtime's timeline (fxpar.runtime.loop)."""

    action: Action
    start: float
    end: float
    wait: float
    marks: tuple[Any, Any] | None = None
    """Marks on the device's queue before and after it (:class:`Clock`; None on CPU)."""


class Clock(Protocol):
    """Marks on a device's queue, and the seconds between two of them."""

    def mark(self) -> Any: ...

    def seconds(self, start: Any, end: Any) -> float: ...


class CudaClock:
    """CUDA events (``enable_timing``) on the current stream of the rank's GPU."""

    def mark(self) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, start: torch.cuda.Event, end: torch.cuda.Event) -> float:
        end.synchronize()  # a no-op after the step's host read; safe before it
        return float(start.elapsed_time(end)) / 1e3


def device_clock(device: torch.device) -> Clock | None:
    """The clock of ``device``'s queue; None where host times are device times (CPU)."""
    return CudaClock() if device.type == "cuda" else None
