"""Per-rank run metrics: where each rank's step time goes, its peak memory, and the timeline of
its last step; gathered to rank 0, printed as a table and written as JSON (``--metrics``).

The JSON is a contract with ``fxpar-inspect --timeline FILE.png --from-metrics``::

    {"fxpar_metrics": 1, "model": str, "world_size": int, "plan": {Plan fields},
     "steps": int, "batch_size": int, "images_per_s": float,
     "ranks": [{"rank": int, "roles": [{"copy": int, "stage": int, "tile": int}],
                "peak_memory_bytes": int, "compute_s": float, "comm_s": float, "step_s": float,
                "device_compute_s": float,           # on a GPU only (CUDA events)
                "timeline": [{"action": "c0.0F0", "kind": "F", "stage": 0, "mb": 0, "copy": 0,
                              "start": s, "end": s, "wait": s,
                              "device_s": s}, ...]}, ...],   # device_s: on a GPU only
     "eval": [...]}                          # only with fxpar-run --val-data (see below)

Per step: compute = F/B/STEP time minus the time they sat blocked on communication (receive
waits, the send completion before STEP/ALLREDUCE, the gradient sync); comm = that wait plus the
whole of the SEND/RECV/ALLREDUCE actions. step_s is the wall time of ``train_step`` (which also
holds the loss allreduce). compute_s, comm_s, step_s and images_per_s are medians over steps
2.. (step 1 warms up; with one step, that step). Timeline times are seconds from the start of
the last step's ``train_step`` on that rank. A halo exchange inside a spatial stage runs inside
its F/B action, so it counts as compute (see fxpar.runtime.loop).

On a GPU the host times above are the times to queue the work; ``device_s`` is each action's
time on the GPU between CUDA events recorded before and after it on the current stream, and
``device_compute_s`` the median over steps of the compute actions' sum (fxpar.runtime.clock).

``eval`` (optional: present when the run validated, ``--val-data``) lists every validation
pass in order (fxpar.train.evaluate; every metric over the whole validation set, padding
excluded)::

    {"step": int, "loss": float, "samples": int, "accuracy": float, "seconds": float,
     "correct": int,                              # classification: correct images
     # segmentation (mask targets) also has, with accuracy the pixel accuracy:
     "pixels": int, "dice": float, "iou": float,  # means over the classes defined below
     "per_class": [{"class": int, "dice": float | null, "iou": float | null,
                    "pixels": int, "predicted": int}, ...]}

loss is the mean over every sample (every pixel for a segmentation loss, as F.cross_entropy
averages); a class absent from both prediction and target has null dice and iou.
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from fxpar.core.units import nbytes
from fxpar.runtime.clock import ActionTime, Clock, device_clock

if TYPE_CHECKING:
    from fxpar.program.program import RankProgram

FORMAT = 1
COMPUTE_KINDS = ("F", "B", "W", "STEP")
COMM_KINDS = ("SEND_F", "RECV_F", "SEND_B", "RECV_B", "ALLREDUCE")


class MetricsError(ValueError):
    """A metrics file that does not follow the format (the message says which key)."""


@dataclass(frozen=True)
class StepTimes:
    step_s: float
    compute_s: float
    comm_s: float
    device_s: float | None = None
    """GPU time of the compute actions (CUDA events, fxpar.runtime.clock); None on CPU."""


def split_times(timeline: list[ActionTime]) -> tuple[float, float]:
    """(compute, comm) seconds of one step's actions (see the module doc)."""
    compute = comm = 0.0
    for t in timeline:
        took = t.end - t.start
        if t.action.kind in COMPUTE_KINDS:
            compute += max(took - t.wait, 0.0)
            comm += min(t.wait, took)
        else:
            comm += took
    return compute, comm


@dataclass
class Recorder:
    """Runs one rank's training steps with the runtime's action timing switched on."""

    rp: RankProgram
    clock: Clock | None = None
    """Marks on the device's queue (default: CUDA events on a GPU, none on CPU)."""
    steps: list[StepTimes] = field(default_factory=list)
    last: list[dict[str, Any]] = field(default_factory=list)
    """The last step's timeline, as the JSON entries."""

    def step(self, x: torch.Tensor | None, y: Any, accumulate: int = 1) -> tuple[float, float]:
        """One ``train_step`` (of ``accumulate`` per optimizer step); returns (loss, seconds)."""
        runtime = self.rp.runtime
        runtime.timeline = []
        runtime.clock = self.clock if self.clock is not None else device_clock(self.rp.device)
        start = time.perf_counter()
        try:
            loss = self.rp.train_step(x, y, accumulate=accumulate)
            took = time.perf_counter() - start
            timeline = runtime.timeline
        finally:
            runtime.timeline = None
        clock, runtime.clock = runtime.clock, None
        compute, comm = split_times(timeline)
        device = [clock.seconds(*t.marks) if clock is not None and t.marks is not None
                  else None for t in timeline]
        busy = sum(d for t, d in zip(timeline, device, strict=True)
                   if d is not None and t.action.kind in COMPUTE_KINDS) \
            if clock is not None else None
        self.steps.append(StepTimes(took, compute, comm, busy))
        self.last = [{"action": str(t.action), "kind": t.action.kind, "stage": t.action.stage,
                      "mb": t.action.mb, "copy": t.action.copy,
                      "start": round(t.start - start, 6), "end": round(t.end - start, 6),
                      "wait": round(t.wait, 6),
                      **({"device_s": round(d, 6)} if d is not None else {})}
                     for t, d in zip(timeline, device, strict=True)]
        return loss, took

    def steady(self) -> list[StepTimes]:
        """The steps after the first (warm-up) one; the only step if there is one."""
        return self.steps[1:] or self.steps

    def rank_entry(self) -> dict[str, Any]:
        """This rank's entry of the metrics file."""
        steady = self.steady()
        med = (lambda xs: statistics.median(xs) if xs else 0.0)  # noqa: E731
        rm = self.rp.program.rank_map
        return {
            "rank": self.rp.rank,
            "roles": [{"copy": r.copy, "stage": r.stage, "tile": r.tile}
                      for r in rm.roles_of(self.rp.rank)],
            "peak_memory_bytes": peak_memory(self.rp),
            "compute_s": med([s.compute_s for s in steady]),
            "comm_s": med([s.comm_s for s in steady]),
            "step_s": med([s.step_s for s in steady]),
            **({"device_compute_s": med([s.device_s for s in steady if s.device_s is not None])}
               if any(s.device_s is not None for s in steady) else {}),
            "timeline": self.last,
        }


def peak_memory(rp: RankProgram | None = None) -> int:
    """This process's peak memory in bytes: ``torch.cuda.max_memory_allocated`` when the rank's
    parameters live on a GPU, else the peak resident set size (``getrusage``; KiB on Linux,
    bytes on macOS)."""
    if rp is not None and torch.cuda.is_available():
        dev = next((p.device for p in rp.parameters()), None)
        if dev is not None and dev.type == "cuda":
            return int(torch.cuda.max_memory_allocated(dev))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


def gather(rec: Recorder, model: str, batch_size: int,
           evals: list[dict[str, Any]] | None = None) -> dict[str, Any] | None:
    """Collective over the rank program's communicator: the whole metrics object on rank 0,
    None on the other ranks. evals: the validation passes (the "eval" key), when any."""
    rp = rec.rp
    entry = rec.rank_entry()
    entries = [entry] if rp.comm is None else rp.comm.gather_object(entry, root=0)
    if entries is None:
        return None
    steady = rec.steady()
    rates = [batch_size / s.step_s for s in steady if s.step_s > 0]
    out = {
        "fxpar_metrics": FORMAT, "model": model, "world_size": rp.program.world_size,
        "plan": rp.plan.to_json(), "steps": len(rec.steps), "batch_size": batch_size,
        "images_per_s": statistics.median(rates) if rates else 0.0,
        "ranks": sorted(entries, key=lambda e: e["rank"]),
    }
    if evals is not None:
        out["eval"] = [_json_safe(e) for e in evals]
    return out


def _json_safe(value: Any) -> Any:
    """NaN (no sample scored) as null: JSON has no NaN."""
    if isinstance(value, float) and value != value:
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_json_safe(v) for v in value]
    return value


def table(metrics: dict[str, Any]) -> str:
    """The per-rank table the driver prints at the end of a run."""
    head = ("rank", "stage", "tile", "peak mem", "compute s", "comm s", "step s", "comm %")
    rows = [head]
    for e in metrics["ranks"]:
        roles = e["roles"]
        stage = "/".join(f"c{r['copy']}.{r['stage']}" if r["copy"] else str(r["stage"])
                         for r in roles)
        tiles = "/".join(str(r["tile"]) for r in roles)
        busy = e["compute_s"] + e["comm_s"]
        share = f"{100 * e['comm_s'] / busy:.0f}" if busy > 0 else "-"
        rows.append((str(e["rank"]), stage, tiles, nbytes(e["peak_memory_bytes"]),
                     f"{e['compute_s']:.3f}", f"{e['comm_s']:.3f}", f"{e['step_s']:.3f}", share))
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["  ".join(c.rjust(w) if i not in (1, 2) else c.ljust(w)
                       for i, (c, w) in enumerate(zip(r, widths, strict=True))).rstrip()
             for r in rows]
    steps = metrics["steps"]
    over = f"this run's steps 2..{steps}" if steps > 1 else "this run's one step"
    return (f"per rank, medians over {over} (comm: blocked on or running communication; "
            f"halo exchanges inside F/B count as compute):\n" + "\n".join(lines) +
            f"\nthroughput: {metrics['images_per_s']:.2f} images/s")


def write_metrics(path: str | os.PathLike[str], metrics: dict[str, Any]) -> Path:
    """Write (via a temporary name) and return the path."""
    out = Path(path)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(metrics, indent=1) + "\n")
    os.replace(tmp, out)
    return out


_TOP = {"fxpar_metrics": int, "model": str, "world_size": int, "plan": dict, "steps": int,
        "batch_size": int, "images_per_s": (int, float), "ranks": list}
_RANK = {"rank": int, "roles": list, "peak_memory_bytes": int, "compute_s": (int, float),
         "comm_s": (int, float), "step_s": (int, float), "timeline": list}
_ROLE = {"copy": int, "stage": int, "tile": int}
_EVAL = {"step": int, "loss": (int, float, type(None)), "samples": int,
         "accuracy": (int, float, type(None))}  # null: NaN (a diverged model)
_EVENT = {"action": str, "kind": str, "stage": int, "mb": int, "copy": int,
          "start": (int, float), "end": (int, float), "wait": (int, float)}


def _keys(obj: Any, spec: dict[str, Any], where: str, path: str) -> None:
    if not isinstance(obj, dict):
        raise MetricsError(f"{path}: {where} must be a JSON object, got {type(obj).__name__}")
    for key, typ in spec.items():
        if key not in obj:
            raise MetricsError(f"{path}: {where} has no {key!r}: write it with "
                               f"`fxpar-run ... --metrics FILE`")
        v = obj[key]
        if isinstance(v, bool) or not isinstance(v, typ):
            raise MetricsError(f"{path}: {where}[{key!r}] = {v!r} is not of the expected type")


def load_metrics(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a ``--metrics`` file, checking the format version and every key (see the module
    doc); raises MetricsError saying what is wrong."""
    p = Path(path)
    try:
        data = json.loads(p.read_text())
    except OSError as e:
        raise MetricsError(f"cannot read metrics file {p}: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise MetricsError(f"{p} is not JSON ({e})") from None
    if not isinstance(data, dict) or data.get("fxpar_metrics") != FORMAT:
        got = data.get("fxpar_metrics") if isinstance(data, dict) else None
        raise MetricsError(f"{p} is not an fxpar metrics file of format {FORMAT} "
                           f"(fxpar_metrics = {got!r}): write one with "
                           f"`fxpar-run ... --metrics FILE`")
    _keys(data, _TOP, "the file", str(p))
    if len(data["ranks"]) != data["world_size"]:
        raise MetricsError(f"{p}: {len(data['ranks'])} rank entries for world_size "
                           f"{data['world_size']}")
    for i, entry in enumerate(data["ranks"]):
        _keys(entry, _RANK, f"ranks[{i}]", str(p))
        for j, role in enumerate(entry["roles"]):
            _keys(role, _ROLE, f"ranks[{i}].roles[{j}]", str(p))
        for j, ev in enumerate(entry["timeline"]):
            _keys(ev, _EVENT, f"ranks[{i}].timeline[{j}]", str(p))
    if not isinstance(data.get("eval", []), list):
        raise MetricsError(f"{p}: 'eval' must be a list of validation passes")
    for i, ev in enumerate(data.get("eval", [])):
        _keys(ev, _EVAL, f"eval[{i}]", str(p))
    return data
