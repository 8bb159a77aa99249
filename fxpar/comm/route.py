"""How tensors reach MPI: CPU tensors through their own memory, device tensors either straight
to a CUDA-aware MPI or through pooled pinned host buffers (:class:`Staging`); the choice is made
once per communicator family (:class:`Route`, shared by a world and its splits). See
fxpar.comm.mpi for the calls that use it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from fxpar.comm.device import cuda_aware_mpi
from fxpar.core.options import flag, setting

# dtypes NumPy or the MPI has no type for travel as same-width integers (bit patterns are
# preserved); they can be sent and received but not reduced. float16: NumPy has it, but Open
# MPI 4 has no MPI type for it ("MPI_ERR_TYPE: invalid datatype"; MPICH has one).
BITCAST = {torch.bfloat16: torch.int16, torch.float16: torch.int16,
           torch.float8_e4m3fn: torch.int8, torch.float8_e5m2: torch.int8}


def _prepared(t: torch.Tensor, *, writable: bool) -> torch.Tensor:
    """``t`` as MPI reads it: contiguous (a receive buffer must already be: data would land
    in a copy), detached, bit-cast where NumPy has no type for its dtype."""
    if not t.is_contiguous():
        if writable:
            raise ValueError("receive buffer must be contiguous (data would land in a copy)")
        t = t.contiguous()
    t = t.detach()
    return t.view(BITCAST[t.dtype]) if t.dtype in BITCAST else t


def as_buffer(t: torch.Tensor, *, writable: bool) -> np.ndarray:
    """A NumPy view of CPU tensor ``t``'s memory (no copy)."""
    return _prepared(t, writable=writable).numpy()


def _pinned(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A flat host buffer; page-locked when it stages a CUDA tensor (fast, async-capable DMA)."""
    return torch.empty(numel, dtype=dtype, pin_memory=device.type == "cuda")


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Blocking copy between host and device: the host side is safe to reuse when it returns."""
    dst.copy_(src)


class Staging:
    """Host copies of tensors MPI cannot read in place (device memory without CUDA-aware MPI).

    A pool of flat host buffers per (numel, dtype): :meth:`take` lends one (new when none is
    free), :meth:`give` returns it, keeping at most ``keep`` free per key so a run with changing
    shapes does not hoard pinned memory. ``alloc`` and ``copy`` are the seam tests replace."""

    def __init__(self, alloc: Callable[[int, torch.dtype, torch.device], torch.Tensor] = _pinned,
                 copy: Callable[[torch.Tensor, torch.Tensor], None] = _copy,
                 keep: int = 4) -> None:
        self.alloc = alloc
        self.copy = copy
        self.keep = keep
        self._free: dict[tuple[int, torch.dtype], list[torch.Tensor]] = {}
        self.allocated = 0
        """Host buffers made so far (tests check that buffers are reused)."""

    def take(self, t: torch.Tensor) -> torch.Tensor:
        free = self._free.get((t.numel(), t.dtype))
        if free:
            return free.pop()
        self.allocated += 1
        return self.alloc(t.numel(), t.dtype, t.device)

    def give(self, host: torch.Tensor) -> None:
        free = self._free.setdefault((host.numel(), host.dtype), [])
        if len(free) < self.keep:
            free.append(host)

    def out(self, t: torch.Tensor) -> tuple[np.ndarray, Callable[[], None]]:
        """A host buffer holding ``t``'s values for MPI to read, and the call that releases it."""
        host = self.take(t)
        self.copy(host.view(t.shape), t)
        return as_buffer(host, writable=False), lambda: self.give(host)

    def into(self, t: torch.Tensor) -> tuple[np.ndarray, Callable[[], None]]:
        """A host buffer for MPI to write, and the call that copies it into ``t`` and releases
        it (run it after the operation completed)."""
        if not t.is_contiguous():
            raise ValueError("receive buffer must be contiguous (data would land in a copy)")
        host = self.take(t)

        def land() -> None:
            self.copy(t, host.view(t.shape))
            self.give(host)

        return as_buffer(host, writable=True), land

    def inout(self, t: torch.Tensor) -> tuple[np.ndarray, Callable[[], None]]:
        """Both: ``t``'s values in a host buffer that MPI updates in place (reductions,
        broadcast roots), copied back into ``t`` by the returned call."""
        if not t.is_contiguous():
            raise ValueError("in-place buffer must be contiguous (data would land in a copy)")
        host = self.take(t)
        self.copy(host.view(t.shape), t)

        def land() -> None:
            self.copy(t, host.view(t.shape))
            self.give(host)

        return as_buffer(host, writable=True), land


def direct(t: torch.Tensor, *, writable: bool) -> torch.Tensor:
    """``t`` itself for a CUDA-aware MPI (read through ``__cuda_array_interface__``/DLPack),
    after its stream has finished every kernel queued on it."""
    t = _prepared(t, writable=writable)
    torch.cuda.current_stream(t.device).synchronize()
    return t


def nothing() -> None:
    pass


class Route:
    """How a communicator family hands tensors to MPI (shared by a world and its splits):
    CPU tensors through their own memory, CUDA ones directly or through staging."""

    def __init__(self, stage: bool | None = None, poll: float | None = None) -> None:
        if stage is None:
            stage = flag("force_staging")
        if poll is None and setting("poll") not in ("", "off"):
            poll = float(setting("poll"))
        self.force = stage
        self.poll = poll
        """Seconds between tests of a pending receive or collective (None: MPI's busy wait)."""
        self.staging = Staging()
        self._aware: bool | None = None

    def aware(self) -> bool:
        if self._aware is None:  # asked on the first CUDA tensor only
            self._aware = cuda_aware_mpi()
        return self._aware

    def _check(self, t: torch.Tensor) -> None:
        if t.device.type == "meta":
            raise ValueError("a meta tensor has no data to communicate: materialise it first")

    def _plain(self, t: torch.Tensor) -> bool:
        """A CPU tensor goes to MPI through its own memory (unless staging is forced)."""
        self._check(t)
        return t.device.type == "cpu" and not self.force

    def _direct(self, t: torch.Tensor) -> bool:
        return t.device.type == "cuda" and not self.force and self.aware()

    def out(self, t: torch.Tensor) -> tuple[Any, Callable[[], None]]:
        """What MPI reads to send ``t``, and the call that releases it afterwards."""
        if self._plain(t):
            return as_buffer(t, writable=False), nothing
        if self._direct(t):
            return direct(t, writable=False), nothing
        return self.staging.out(t)

    def into(self, t: torch.Tensor) -> tuple[Any, Callable[[], None]]:
        """What MPI writes to receive into ``t``, and the call that lands it there afterwards."""
        if self._plain(t):
            return as_buffer(t, writable=True), nothing
        if self._direct(t):
            return direct(t, writable=True), nothing
        return self.staging.into(t)

    def inout(self, t: torch.Tensor) -> tuple[Any, Callable[[], None]]:
        """Both, for in-place collectives (reductions, broadcast roots)."""
        if self._plain(t):
            return as_buffer(t, writable=True), nothing
        if self._direct(t):
            return direct(t, writable=True), nothing
        return self.staging.inout(t)
