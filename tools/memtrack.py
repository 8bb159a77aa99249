"""The memory section's per-step measurements (tools/bench_memory.py; saved_step also serves
tools/bench_spatial.py's, bench_volume.py's and bench_costmodel.py's workers).

:func:`saved_step`: what one step's forward saves for backward and its peak RSS growth.
:func:`breakdown_step`: where that peak goes, from every live tensor storage tracked through
the step (:class:`PeakTracker`, a TorchDispatchMode), /proc/self/status and glibc's free heap
(mallinfo2).
"""

from __future__ import annotations

import ctypes
import resource
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import benchlib
from torch.utils._python_dispatch import TorchDispatchMode


# -- measuring one step (run inside a benchmark's worker) ----------------------------------------
def saved_step(step: Callable[[], float], params: list[Any]) -> dict[str, Any]:
    """Run ``step`` once, recording what its forward saves for backward and its memory peak.

    saved_bytes: unique storages (views counted once, by data pointer) packed by
    ``torch.autograd.graph.saved_tensors_hooks`` outside backward (recomputation inside a
    backward is not an activation), parameters excluded. Custom autograd Functions'
    ``ctx.save_for_backward`` goes through the same hooks, so fxpar's halo and BatchNorm ops are
    seen. peak_growth: peak RSS after the step (ru_maxrss, KiB on Linux) minus the RSS just
    before it; exact only when the step raised the process's high-water mark (``raised``)."""
    import torch

    skip = {p.untyped_storage().data_ptr() for p in params}
    saved: dict[int, int] = {}
    seen = [0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        if torch._C._current_graph_task_id() == -1:  # not inside a backward pass
            seen[0] += 1
            st = t.untyped_storage()
            if st.data_ptr() not in skip:
                saved[st.data_ptr()] = st.nbytes()
        return t

    before, max0 = benchlib.rss_bytes(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = step()
    wall = time.perf_counter() - t0
    max1 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"saved_bytes": sum(saved.values()), "saved_tensors": seen[0],
            "peak_growth": max1 * 1024 - before, "rss_before": before, "raised": max1 > max0,
            "param_bytes": sum(p.numel() * p.element_size() for p in params),
            "loss": loss, "step_s": wall}


# -- where the peak goes ---------------------------------------------------------------------
def proc_status() -> dict[str, int]:
    """VmRSS, VmHWM (peak since the last reset) and the RSS split into anonymous memory, file
    pages (libraries' code and data) and shared memory (MPI's), in bytes."""
    keys = ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem")
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in keys:
            out[key] = int(value.split()[0]) * 1024
    return out


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


def heap_free() -> int:
    """Bytes glibc's malloc holds free in its heaps (mallinfo2's fordblks: freed, still
    resident, reused by later mallocs but not returned to the system); 0 without glibc 2.33."""
    libc = ctypes.CDLL("libc.so.6")
    if not hasattr(libc, "mallinfo2"):
        return 0
    libc.mallinfo2.restype = _Mallinfo2
    return int(libc.mallinfo2().fordblks)


def _storage(t: Any) -> tuple[int, int]:
    st = t.untyped_storage()
    return st.data_ptr(), st.nbytes()


class PeakTracker(TorchDispatchMode):
    """Every tensor storage an ATen op (or an ``fxpar::`` op) returns during one step, held by
    weak reference, and what was live when the process's peak RSS last rose.

    At each op: the live storages and the RSS before it; if VmHWM rose while it ran, that op
    holds the peak so far, and the live storages before it are sorted into parameters,
    input, gradients (``p.grad``), momentum (the state of the optimizer stepping), received
    halo pieces (``fxpar::halo_op``'s second output), saved activations (packed by
    ``saved_tensors_hooks`` outside backward) and other live tensors (activation gradients,
    op inputs in flight). ``live_peak``: the most tensor bytes live at once (each op's inputs
    and new outputs), the CPU counterpart of ``torch.cuda.max_memory_allocated``."""

    def __init__(self, params: list[Any], inputs: list[Any]) -> None:
        super().__init__()
        self.refs: dict[int, tuple[Any, int, int]] = {}  # id(tensor) -> (weakref, ptr, bytes)
        self.params = params
        self.optimizers: list[Any] = []  # those that stepped (a pre-step hook adds them)
        self.inputs = {_storage(t)[0] for t in inputs}
        self.pieces: set[int] = set()
        self.saved: dict[int, Any] = {}
        self.peak: dict[str, Any] = {}
        self.live_peak = 0
        for t in [*params, *inputs]:
            self._add(t)
        self.hwm = 0  # the peak when the step starts (breakdown_step sets it)

    def _add(self, t: Any) -> None:
        import torch

        if isinstance(t, torch.Tensor) and t.device.type == "cpu":
            self.refs[id(t)] = (weakref.ref(t), *_storage(t))

    def live(self) -> dict[int, int]:
        """Live storages now: data pointer -> bytes."""
        out: dict[int, int] = {}
        for key, (ref, ptr, n) in list(self.refs.items()):
            if ref() is None:
                del self.refs[key]
            else:
                out[ptr] = max(out.get(ptr, 0), n)
        return out

    def pack(self, t: Any) -> Any:
        """The saved-tensors pack hook: remembers activations saved for backward."""
        import torch

        if torch._C._current_graph_task_id() == -1 and t.device.type == "cpu":
            self.saved[_storage(t)[0]] = weakref.ref(t)
        return t

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        import torch

        before, live, free = proc_status(), self.live(), heap_free()
        out = func(*args, **(kwargs or {}))
        outs = [o for o in (out if isinstance(out, (tuple, list)) else (out,))
                if isinstance(o, torch.Tensor) and o.device.type == "cpu"]
        new = {p: n for p, n in map(_storage, outs) if p not in live}
        for o in outs:
            self._add(o)
        if "fxpar.halo_op" in str(func) and len(outs) > 1:
            self.pieces.add(_storage(outs[1])[0])
        self.live_peak = max(self.live_peak, sum(live.values()) + sum(new.values()))
        hwm = proc_status()["VmHWM"]
        if hwm > self.hwm:
            self.hwm = hwm
            self.peak = {"op": str(func), "status": before, "hwm": hwm, "heap_free": free,
                         "outputs": sum(new.values()), "live": self.sort(live)}
        return out

    def sort(self, live: dict[int, int]) -> dict[str, int]:
        """Live bytes by component (the first that claims a storage)."""
        owners = [("parameters", {_storage(p)[0] for p in self.params}),
                  ("input", self.inputs),
                  ("gradients", {_storage(p.grad)[0] for p in self.params
                                 if p.grad is not None}),
                  ("momentum", {_storage(v)[0] for o in self.optimizers
                                for state in o.state.values() for v in state.values()
                                if hasattr(v, "untyped_storage")}),
                  ("received halo pieces", self.pieces),
                  ("saved activations", {p for p, r in self.saved.items() if r() is not None})]
        out = dict.fromkeys([name for name, _ in owners] + ["other live tensors"], 0)
        for ptr, n in live.items():
            name = next((name for name, ptrs in owners if ptr in ptrs), "other live tensors")
            out[name] += n
        return out


def breakdown_step(step: Callable[[], float], params: list[Any], x: Any,
                   input_bytes: int) -> dict[str, Any]:
    """Run ``step`` once under :class:`PeakTracker`, from a clean start (freed heap returned
    with malloc_trim, the peak reset), and split its peak RSS growth into components that add
    up to it (bytes): what was live at the peak op's start, that op's new outputs and
    workspace (the rest of the RSS it added), glibc's free heap, library pages and shared
    memory paged in, and the rest (Python objects, autograd nodes, allocator headers)."""
    import torch
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    tracker = PeakTracker(params, [x])
    hook = register_optimizer_step_pre_hook(
        lambda opt, args, kwargs: tracker.optimizers.append(opt))
    benchlib.reset_peak_rss()
    start, free0 = proc_status(), heap_free()
    tracker.hwm, base = start["VmHWM"], sum(tracker.live().values())
    try:
        with torch.autograd.graph.saved_tensors_hooks(tracker.pack, lambda t: t), tracker:
            loss = step()
    finally:
        hook.remove()
    peak = tracker.peak
    at = peak["status"]
    live = {k: v for k, v in peak["live"].items() if k not in ("parameters", "input")}
    parts = {**live, "the op at the peak: new outputs": peak["outputs"],
             "the op at the peak: workspace": max(0, peak["hwm"] - at["VmRSS"] - peak["outputs"]),
             "glibc free heap": peak["heap_free"] - free0,
             "library pages": at["RssFile"] - start["RssFile"],
             "MPI shared memory": at["RssShmem"] - start["RssShmem"]}
    growth = proc_status()["VmHWM"] - start["VmRSS"]
    parts["rest (Python, autograd nodes, native)"] = growth - sum(parts.values())
    return {"growth": growth, "parts": parts, "peak_op": peak["op"],
            "held": {"parameters": peak["live"]["parameters"], "input": input_bytes},
            "live_peak_growth": tracker.live_peak - base, "loss": loss}
