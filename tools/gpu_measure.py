"""The measurements of ``make gpu-check`` (tools/gpu_check.py), one worker process each.

Each worker prints one ``BENCH {json}`` line per finished item (benchlib.emit) and flushes it,
so the driver keeps what was measured when it stops a worker at the section's time cap:

    single        one process: fxpar's one-rank program vs the eager loop, per model and precision
    sp            mpiexec -n P, ranks sharing the device: float64 correctness of SP-P against one
                  process, then fp32 step time of SP-P and of one process (rank 0, others waiting)
    largest-eager one process: the largest image one fp32 eager step fits (pixel doubling)
    largest-sp    mpiexec -n P: the same search for SP-P + bf16 + recompute segments; an
                  out-of-memory error on any rank ends the job (the others wait in its step):
                  that rank reports it, then :func:`main` aborts every rank
    predict       one process: a tiled TIFF, the whole-image forward, fxpar.predict's region
                  loop and MONAI's sliding_window_inference on the device (tools/gpu_predict.py)

GPU timings synchronise the device around every step; medians and ranges over the steps.
"""

from __future__ import annotations

import argparse
import copy
import gc
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_spatial  # noqa: E402
import benchlib  # noqa: E402

CLASSES = {"resnet18": 10, "resnet50": 10, "unet": 3}
LR, MOMENTUM = 0.01, 0.9


@dataclass(frozen=True)
class Sizes:
    """What the check measures: :data:`FULL` on a GPU, :data:`QUICK` anywhere (plumbing)."""

    single: tuple[tuple[str, int, int], ...] = (("resnet50", 1024, 4), ("unet", 1024, 2))
    """(model, image side, batch) of the one-rank comparison, channels-last."""
    precisions: tuple[str, ...] = ("fp32", "bf16")
    steps: int = 5
    """Timed steps of each system (after ``warmup`` untimed ones)."""
    warmup: int = 2
    parts: tuple[int, ...] = (2, 4)
    """Spatial parts (ranks sharing the device) of the SP section."""
    check: tuple[str, int, int] = ("resnet50", 128, 2)
    """(model, side, batch) of the float64 correctness step."""
    overhead: tuple[str, int, int] = ("resnet50", 1024, 2)
    """(model, side, batch) of the fp32 SP step time against one process."""
    unet: tuple[int, int] = (32, 4)
    """U-Net (base channels, depth)."""
    largest_model: str = "unet"
    largest_start: int = 1024
    largest_max: tuple[int, int] = (65536, 65536)
    """Largest side tried: (one process, SP)."""
    largest_parts: int = 2
    segments: int = 8
    """``Plan.recompute_segments`` of the SP search."""
    predict_size: int = 16384
    predict_region: int = 1024
    monai_modes: tuple[str, ...] = ("constant", "gaussian")
    monai_overlap: float = 0.25


FULL = Sizes()
# the code paths in about a minute on two cores (SP4 is SP2's path with 4 ranks: left out)
QUICK = replace(FULL, single=(("resnet18", 64, 2), ("unet", 64, 2)), steps=1, warmup=1,
                parts=(2,), check=("unet", 64, 2), overhead=("unet", 64, 2), unet=(8, 2),
                largest_start=64, largest_max=(64, 96), segments=2, predict_size=512,
                predict_region=256)


def sizes(quick: bool) -> Sizes:
    return QUICK if quick else FULL


# -- helpers --------------------------------------------------------------------------------------
def build(name: str, s: Sizes) -> torch.nn.Module:
    """torchvision ``resnet18`` / ``resnet50`` or the repository's U-Net, in train mode."""
    if name == "unet":
        from fxpar.models.unet import UNet

        return UNet(3, CLASSES[name], *s.unet).train()
    return bench_spatial.build(name, classes=CLASSES[name]).train()


def batch(name: str, side: int, n: int, dev: torch.device, dtype: torch.dtype = torch.float32,
          seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """A synthetic batch: images and class targets (per pixel for the U-Net)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 3, side, side, generator=g, dtype=dtype)
    shape = (n, side, side) if name == "unet" else (n,)
    return x.to(dev), torch.randint(0, CLASSES[name], shape, generator=g).to(dev)


def sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=LR, momentum=MOMENTUM)


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def timed(step: Callable[[], Any], dev: torch.device) -> tuple[float, Any]:
    """Seconds of one call of ``step``, the device synchronised before and after."""
    sync(dev)
    t0 = time.perf_counter()
    out = step()
    sync(dev)
    return time.perf_counter() - t0, out


def ms(times: list[float]) -> dict[str, float]:
    return benchlib.spread([t * 1000 for t in times])


def release() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def eager_step(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor,
               precision: str = "fp32") -> Callable[[], float]:
    """The loop a user writes (autocast for bf16): zero_grad, forward, loss, backward, step."""
    opt = sgd(model.parameters())
    dtype = torch.bfloat16 if precision == "bf16" else None

    def step() -> float:
        opt.zero_grad(set_to_none=True)
        with torch.autocast(x.device.type, dtype=dtype, enabled=dtype is not None):
            loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        return float(loss.detach())

    return step


def is_oom(e: BaseException) -> bool:
    return isinstance(e, torch.cuda.OutOfMemoryError) or "out of memory" in str(e).lower()


def device_info(dev: torch.device) -> dict[str, Any]:
    if dev.type != "cuda":
        return {"device": "cpu"}
    p = torch.cuda.get_device_properties(dev)
    info = {"device": p.name, "memory_gib": p.total_memory / 2**30, "cuda": torch.version.cuda,
            "cudnn": torch.backends.cudnn.version()}
    try:  # the driver's version, where nvidia-smi is not on PATH (nvidia-ml-py)
        import pynvml

        pynvml.nvmlInit()
        info["driver"] = str(pynvml.nvmlSystemGetDriverVersion())
    except Exception:  # noqa: BLE001 - optional
        pass
    return info


# -- single: one-rank program vs eager --------------------------------------------------------
def worker_single(a: argparse.Namespace) -> None:
    s, dev = sizes(a.quick), torch.device(a.device)
    benchlib.emit({"item": "device", **device_info(dev)})
    for name, side, n in s.single:
        for precision in s.precisions:
            try:  # a configuration that fails is reported; the next one still runs
                benchlib.emit(single(s, dev, name, side, n, precision))
            except Exception as e:  # noqa: BLE001
                benchlib.emit({"item": f"{name}/{precision}", "error": error(e)})
            release()


def error(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0][:300] if lines else ''}"


def single(s: Sizes, dev: torch.device, name: str, side: int, n: int,
           precision: str) -> dict[str, Any]:
    """fxpar's one-rank step against the eager step, interleaved, on identical copies."""
    import fxpar

    torch.manual_seed(0)
    model = build(name, s)
    eager = copy.deepcopy(model).to(dev).to(memory_format=torch.channels_last)
    x, y = batch(name, side, n, dev)
    x = x.contiguous(memory_format=torch.channels_last)
    t0 = time.perf_counter()
    plan = fxpar.Plan(precision=precision, channels_last=True)
    rp = fxpar.compile(model, plan, torch.empty(x.shape, device="meta"),
                       optimizer=sgd).for_rank(0).to(dev)
    compile_s = time.perf_counter() - t0
    systems = {"eager": eager_step(eager, x, y, precision), "fxpar": partial(rp.train_step, x, y)}
    times: dict[str, list[float]] = {"eager": [], "fxpar": []}
    losses: dict[str, list[float]] = {"eager": [], "fxpar": []}
    for i in range(s.warmup + s.steps):
        for k in (["eager", "fxpar"] if i % 2 else ["fxpar", "eager"]):
            dt, loss = timed(systems[k], dev)
            losses[k].append(loss)
            if i >= s.warmup:
                times[k].append(dt)
    diff = max(abs(e - f) for e, f in zip(losses["eager"], losses["fxpar"], strict=True))
    return {"item": f"{name}/{precision}", "model": name, "side": side, "batch": n,
            "precision": precision, "compile_s": compile_s, "eager_ms": ms(times["eager"]),
            "fxpar_ms": ms(times["fxpar"]), "max_loss_diff": diff,
            "ratio": statistics.median(times["fxpar"]) / statistics.median(times["eager"])}


# -- sp: correctness and overhead of SP-P with the ranks sharing the device --------------------
def _bind(device: str) -> torch.device:
    from fxpar.comm.device import bind

    return bind(None, device)  # by the launcher's node-local rank: every rank on GPU 0 here


def _max_diff(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    return max((float((got[k].double() - want[k].double()).abs().max()) for k in got
                if k in want and got[k] is not None and got[k].is_floating_point()),
               default=0.0)


def worker_sp(a: argparse.Namespace) -> None:
    import fxpar
    from fxpar.comm.world import world

    s, comm = sizes(a.quick), world()
    dev, parts, item = _bind(a.device), comm.size, f"sp{comm.size}"
    plan = fxpar.Plan(spatial_parts=parts, slice="square")
    # (1) float64: one step of SP-P against one process, both on the device
    name, side, n = s.check
    torch.manual_seed(0)
    model = build(name, s).double()
    ref = copy.deepcopy(model).to(dev)
    x, y = batch(name, side, n, dev, torch.float64)
    rp = fxpar.compile(model, plan, torch.empty(x.shape, dtype=torch.float64, device="meta"),
                       optimizer=sgd, comm=comm).local(comm).to(dev)
    loss = rp.train_step(x, y)
    if comm.rank == 0:  # every tile holds the whole (summed) gradients: rank 0's suffice
        got_g = {k: p.grad for k, p in rp.named_parameters()}
        ref_step = eager_step(ref, x, y)
        ref_loss = ref_step()  # eager_step's optimizer steps after backward; grads are kept
        want_g = {k: p.grad for k, p in ref.named_parameters()}
        got_p = {k: p.detach() for k, p in rp.named_parameters()}
        want_p = {k: p.detach() for k, p in ref.named_parameters()}
        benchlib.emit({"item": f"{item}/check", "model": name, "side": side, "batch": n,
                       "loss_diff": abs(loss - ref_loss), "grad_diff": _max_diff(got_g, want_g),
                       "param_diff": _max_diff(got_p, want_p),
                       "buffer_diff": _max_diff(rp.state_dict(), ref.state_dict()),
                       "grad_max": max(float(g.abs().max()) for g in want_g.values())})
    rp.close()
    del rp, ref, model
    release()
    # (2) fp32 step time: one process on rank 0 (the others wait), then SP-P
    name, side, n = s.overhead
    torch.manual_seed(0)
    model = build(name, s)
    x, y = batch(name, side, n, dev)
    one: list[float] = []
    if comm.rank == 0:
        step = eager_step(copy.deepcopy(model).to(dev), x, y)
        for i in range(s.warmup + s.steps):
            dt, _ = timed(step, dev)
            one += [dt] if i >= s.warmup else []
        del step
        release()
    comm.barrier()
    rp = fxpar.compile(model, plan, torch.empty(x.shape, device="meta"), optimizer=sgd,
                       comm=comm).local(comm).to(dev)
    for _ in range(s.warmup):
        rp.train_step(x, y)
    comm.barrier()
    sp = [timed(lambda: rp.train_step(x, y), dev)[0] for _ in range(s.steps)]
    if comm.rank == 0:
        benchlib.emit({"item": f"{item}/time", "model": name, "side": side, "batch": n,
                       "one_ms": ms(one), "sp_ms": ms(sp),
                       "overhead_ms": (statistics.median(sp) - statistics.median(one)) * 1000,
                       "ratio": statistics.median(sp) / statistics.median(one)})
    rp.close()


# -- largest: a pixel-doubling search ----------------------------------------------------------
def sides(start: int, stop: int, align: int = 32) -> list[int]:
    """``start`` and then twice the pixels each time (sides x sqrt 2), multiples of ``align``,
    up to ``stop``."""
    out, k = [], 0
    while True:
        side = max(align, round(start * 2 ** (k / 2) / align) * align)
        if side > stop:
            return out
        if not out or side > out[-1]:
            out.append(side)
        k += 1


def _image(name: str, side: int, dev: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """A (1, 3, side, side) image and its targets as views of one random column each
    (stride 0 along the width): only what the model reads is ever made whole."""
    x = torch.randn(1, 3, side, 1, device=dev).expand(1, 3, side, side)
    y = torch.randint(0, CLASSES[name], (1, side, 1), device=dev).expand(1, side, side)
    return x, y


def _peak(dev: torch.device) -> float:
    """GiB the caching allocator held at most since the last reset (0 on the CPU)."""
    return torch.cuda.max_memory_allocated(dev) / 2**30 if dev.type == "cuda" else 0.0


def _reset(dev: torch.device) -> None:
    release()
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)


def _go_on(t0: float, last: float, cap: float) -> bool:
    """Another attempt (about 2.5x the last: twice the pixels, plus its set-up) fits the cap."""
    return time.perf_counter() - t0 + 2.5 * last < cap


def worker_largest_eager(a: argparse.Namespace) -> None:
    s, dev, t0 = sizes(a.quick), torch.device(a.device), time.perf_counter()
    name = s.largest_model
    torch.manual_seed(0)
    model = build(name, s).to(dev)
    opt = sgd(model.parameters())
    for side in sides(a.start or s.largest_start, s.largest_max[0]):
        t1 = time.perf_counter()
        _reset(dev)
        try:
            x, y = _image(name, side, dev)
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(model(x), y).backward()
            opt.step()
            sync(dev)
        except Exception as e:  # noqa: BLE001 - only an out-of-memory error ends the search
            if not is_oom(e):
                raise
            benchlib.emit({"item": "eager", "side": side, "ok": False, "why": "out of memory"})
            return
        last = time.perf_counter() - t1
        benchlib.emit({"item": "eager", "side": side, "ok": True, "step_s": last,
                       "peak_gib": _peak(dev)})
        if not _go_on(t0, last, a.cap):
            benchlib.emit({"item": "eager", "stopped": "time cap"})
            return
    benchlib.emit({"item": "eager", "stopped": "size limit"})


def worker_largest_sp(a: argparse.Namespace) -> None:
    import fxpar
    from fxpar.comm.world import world

    s, comm, t0 = sizes(a.quick), world(), time.perf_counter()
    dev, name = _bind(a.device), s.largest_model
    plan = fxpar.Plan(spatial_parts=comm.size, precision="bf16",
                      recompute_segments=s.segments)
    torch.manual_seed(0)
    model = build(name, s)
    for side in sides(a.start or s.largest_start, s.largest_max[1]):
        t1 = time.perf_counter()
        _reset(dev)
        try:
            x, y = _image(name, side, dev)
            example = torch.empty(x.shape, device="meta")
            rp = fxpar.compile(copy.deepcopy(model), plan, example, optimizer=sgd,
                               comm=comm).local(comm).to(dev)
            step_s, _ = timed(partial(rp.train_step, x, y), dev)
        except Exception as e:
            if is_oom(e):  # the other ranks wait in this step: say so before the job ends
                benchlib.emit({"item": "sp", "side": side, "ok": False, "rank": comm.rank,
                               "why": "out of memory"})
            raise  # main() ends the whole job
        peaks = comm.allgather_object(_peak(dev))
        rp.close()
        del rp, x, y
        last = time.perf_counter() - t1
        if comm.rank == 0:
            benchlib.emit({"item": "sp", "side": side, "ok": True, "step_s": step_s,
                           "peak_gib": sum(peaks), "peak_rank_gib": max(peaks),
                           "attempt_s": last})
        if not comm.bcast_object(_go_on(t0, last, a.cap)):
            if comm.rank == 0:
                benchlib.emit({"item": "sp", "stopped": "time cap"})
            return
    if comm.rank == 0:
        benchlib.emit({"item": "sp", "stopped": "size limit"})


def worker_predict(a: argparse.Namespace) -> None:
    import gpu_predict  # its own module: the inference comparison

    s = sizes(a.quick)
    gpu_predict.run(torch.device(a.device), s.predict_size, s.predict_region, s.monai_modes,
                    s.monai_overlap)


WORKERS = {"single": worker_single, "sp": worker_sp, "largest-eager": worker_largest_eager,
           "largest-sp": worker_largest_sp, "predict": worker_predict}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="a worker of tools/gpu_check.py")
    p.add_argument("--worker", choices=WORKERS, required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--cap", type=float, default=60.0, help="seconds this worker may take")
    p.add_argument("--start", type=int, default=0, help="largest-*: the first side tried")
    a = p.parse_args(argv)
    try:
        WORKERS[a.worker](a)
    except BaseException:
        if a.worker in ("sp", "largest-sp"):  # the other ranks would wait for this one
            import traceback

            from mpi4py import MPI

            traceback.print_exc()
            sys.stderr.flush()
            MPI.COMM_WORLD.Abort(1)
        raise
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
