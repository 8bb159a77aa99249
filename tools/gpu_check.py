"""``make gpu-check``: check a GPU node in one command that ends within one 8-minute call.

    python3 tools/gpu_check.py                         # a GPU node: tests, then docs/gpu.md
    python3 tools/gpu_check.py --device cpu --quick --out /tmp/gpu.md   # the plumbing, no GPU

Without a CUDA device it prints one line and exits 0. With one it runs the node's own python3
(not a virtual environment): fxpar is installed editable first if it is not importable (no
dependencies, no index), and the wheels in ``.gpu-wheels/`` when MONAI or zarr are missing. Then
``tests/mpi/test_gpu.py`` under pytest within :data:`TESTS_BUDGET_S` (pass/fail per test), and
the measurements of tools/gpu_measure.py, each section in its own worker process stopped at its
time cap, all within :data:`DEADLINE_S` of the start. A section stopped early keeps what it
measured and says "not measured: out of time (N s)" for the rest. The document is written
last (tools/gpu_report.py). Exit status 1 when a GPU test failed (the document is written all
the same), else 0.
"""

from __future__ import annotations

import argparse
import datetime
import glob
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib  # noqa: E402
import gpu_report  # noqa: E402

if TYPE_CHECKING:  # gpu_measure imports torch: only once a device was found
    from gpu_measure import Sizes

ROOT = benchlib.ROOT
DEADLINE_S = 450.0
"""Everything, from start to the written document (one 8-minute call, with room to spare)."""
TESTS_BUDGET_S = 240.0
"""The GPU transparency tests; pytest is interrupted after this."""
RESERVE_S = 8.0
"""Kept back from the sections for writing the document."""
MIN_CAP_S = 12.0
"""A section given less than this is not started: a worker needs seconds just to start."""
WEIGHTS = {"single": 55.0, "sp": 50.0, "largest": 45.0, "predict": 60.0}
"""How the time left after the tests is shared among the sections (time left x weight /
weights of the sections still to run, so a fast section leaves more to the later ones)."""
EAGER_SHARE = 0.4
"""The part of the ``largest`` section's cap its one-process search gets."""
TESTS = "tests/mpi/test_gpu.py"
WHEELS = ROOT / ".gpu-wheels"
ENV = {
    # Open MPI refuses to run as root without these (the GPU node runs commands as root), and
    # more ranks than the slots a scheduler gave (ranks share the GPU) without the third
    "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
    "OMPI_MCA_rmaps_base_oversubscribe": "1",
    # shared memory without cross-process reads (CMA), which sandboxed kernels may refuse
    "OMPI_MCA_btl_vader_single_copy_mechanism": "none",
    "PYTHONUNBUFFERED": "1",
    # a rank waiting while rank 0 times one process must not be ended as stuck; every worker
    # here has its own time cap instead
    "FXPAR_WATCHDOG": "0",
}
"""Every environment setting the check makes, for itself and every process it starts."""


class Clock:
    """Seconds since the start and until the deadline."""

    def __init__(self, deadline: float) -> None:
        self.t0, self.deadline = time.monotonic(), deadline

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def left(self) -> float:
        return self.deadline - self.elapsed()


def no_device_line() -> str | None:
    """The one line printed where torch sees no CUDA device, else None. A Python without torch
    sees none either, unless nvidia-smi lists a GPU: then this Python is the wrong one."""
    try:
        import torch
    except ImportError as e:
        if gpu_facts():
            raise SystemExit(f"fxpar gpu-check: nvidia-smi lists a GPU but {sys.executable} "
                             f"cannot import torch ({e}): run `make gpu-check PYTHON=...` with "
                             f"the Python that has it") from None
        return (f"fxpar gpu-check: no CUDA device visible (no torch in {sys.executable}: {e}): "
                f"nothing to check")
    if torch.cuda.is_available():
        return None
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "<unset>") or "<empty>"
    return (f"fxpar gpu-check: no CUDA device visible (torch {torch.__version__}, "
            f"CUDA_VISIBLE_DEVICES={visible}): nothing to check")


# -- the node's environment ----------------------------------------------------------------------
def _pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index",
                    *args], check=True, cwd=ROOT)


def ensure_fxpar() -> str:
    """fxpar importable (found without importing it: no torch import here), else installed
    editable from this checkout; says where it comes from."""
    spec = importlib.util.find_spec("fxpar")
    if spec is None:
        _pip("--no-build-isolation", "-e", str(ROOT))
        return "fxpar installed editable (pip --no-deps --no-build-isolation --no-index -e .)"
    return f"fxpar from {Path(spec.origin or '?').parent}"


def ensure_wheels() -> str:
    """MONAI and zarr (fxpar reads TIFF windows through zarr) from ``.gpu-wheels/`` when they
    are not importable and wheels were carried."""
    missing = [m for m in ("monai", "zarr") if importlib.util.find_spec(m) is None]
    wheels = sorted(glob.glob(str(WHEELS / "*.whl")))
    if not missing:
        return "monai and zarr importable"
    if not wheels:
        return f"{', '.join(missing)} not importable and no wheels in .gpu-wheels/"
    _pip(*wheels)
    return f"installed {', '.join(Path(w).name for w in wheels)} ({', '.join(missing)} missing)"


def git_commit() -> str:
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, check=True,
                              capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=ROOT, capture_output=True, text=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown (no git checkout)"
    return head + (" with local changes" if dirty else "")


def gpu_facts() -> dict[str, str]:
    """Name, memory and driver from nvidia-smi (the check's own process makes no CUDA
    context: the workers need the memory)."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return {}
    out = subprocess.run([smi, "--query-gpu=name,memory.total,driver_version",
                          "--format=csv,noheader"], capture_output=True, text=True).stdout
    parts = [p.strip() for p in out.splitlines()[0].split(",")] if out.strip() else []
    return dict(zip(("name", "memory", "driver"), parts, strict=False))


# -- the tests -----------------------------------------------------------------------------------
OUTCOME = re.compile(r"^(\S+::\S+)\s+(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)"
                     r"(?:\s+\((.*)\))?\s*(?:\[\s*\d+%\])?\s*$", re.M)
REASON = re.compile(r"^(?:FAILED|ERROR) (\S+::\S+)(?: - (.*))?$", re.M)


def run_tests(budget: float) -> dict[str, Any]:
    """pytest on :data:`TESTS` for at most ``budget`` seconds, then interrupted (SIGINT:
    fxpar.testing.run_cases ends its mpiexec on the way out); the outcome of each test pytest
    reported."""
    cmd = [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", "-rfE", "--tb=line",
           TESTS]
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True,
                            env={**os.environ, "COLUMNS": "240"})  # reasons in full
    stopped = False
    try:
        out, _ = proc.communicate(timeout=budget)
    except subprocess.TimeoutExpired:
        stopped = True
        os.killpg(proc.pid, signal.SIGINT)
        try:
            out, _ = proc.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
    reasons = {m.group(1): (m.group(2) or "").strip() for m in REASON.finditer(out)}
    tests = [{"test": m.group(1).split("::", 1)[1], "outcome": m.group(2).lower(),
              "why": reasons.get(m.group(1)) or m.group(3) or ""}
             for m in OUTCOME.finditer(out)]
    return {"tests": tests, "seconds": time.monotonic() - t0, "budget": budget,
            "stopped": stopped, "returncode": proc.returncode, "tail": out[-3000:]}


# -- the sections --------------------------------------------------------------------------------
def launch(args: list[str], ranks: int | None, cap: float) -> dict[str, Any]:
    """One worker of tools/gpu_measure.py for at most ``cap`` seconds: the records it printed
    and, when it did not finish, why."""
    cores = os.cpu_count() or 1
    env = benchlib.thread_env(max(1, cores // (ranks or 1)))
    if ranks and ranks > cores:  # waiting ranks sleep between polls instead of spinning
        env["FXPAR_POLL"] = "0.0005"
    cmd = benchlib.worker_command("gpu_measure.py", args, ranks)
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    why = None
    try:
        out, err = proc.communicate(timeout=max(1.0, cap))
    except subprocess.TimeoutExpired:
        out, err = end_session(proc)
        why = f"out of time ({cap:.0f} s)"
    records = [json.loads(line[6:]) for line in out.splitlines() if line.startswith("BENCH ")]
    if why is None and proc.returncode:
        last = [ln for ln in err.splitlines() if ln.strip()][-3:]
        why = f"the worker failed (exit {proc.returncode}): {' / '.join(last)[-600:]}"
    if why is not None:
        print(f"  {args[1]}: {why}", file=sys.stderr, flush=True)
    return {"records": records, "why": why, "seconds": time.monotonic() - t0, "cap": cap}


def end_session(proc: subprocess.Popen[str]) -> tuple[str, str]:
    """Stop a worker started in its own session, mpiexec and every rank: SIGTERM to its group
    first (mpiexec ends the ranks it started), then SIGKILL to every process still in the
    session (a launcher may have moved ranks to groups of their own). Its output so far."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        return proc.communicate(timeout=5)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        pass
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[3]) == proc.pid:  # its session
                os.kill(int(stat.parent.name), signal.SIGKILL)
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile
    return proc.communicate()


def section(name: str, base: list[str], s: Sizes, cap: float) -> dict[str, Any]:
    """Run section ``name``'s workers within ``cap`` seconds."""
    t0 = time.monotonic()

    def left() -> float:
        return cap - (time.monotonic() - t0)

    if name == "single":
        return launch(["--worker", "single", *base], None, cap)
    if name == "predict":
        return launch(["--worker", "predict", *base], None, cap)
    if name == "sp":
        runs = []
        for i, parts in enumerate(s.parts):
            share = left() / (len(s.parts) - i)
            runs.append(launch(["--worker", "sp", *base], parts, share))
        return merge(runs, cap, t0)
    eager = launch(["--worker", "largest-eager", *base, "--cap",
                    f"{max(1.0, cap * EAGER_SHARE - 8):.0f}"], None, cap * EAGER_SHARE)
    fits = [r["side"] for r in eager["records"] if r.get("ok")]
    start = str(max(fits) if fits else s.largest_start)
    sp = launch(["--worker", "largest-sp", *base, "--start", start, "--cap",
                 f"{max(1.0, left() - 10):.0f}"], s.largest_parts, left())
    if any(r.get("ok") is False for r in sp["records"]):
        sp["why"] = None  # out of memory ends the SP job (fail-fast): the search's expected end
    return merge([eager, sp], cap, t0)


def merge(runs: list[dict[str, Any]], cap: float, t0: float) -> dict[str, Any]:
    whys = [r["why"] for r in runs if r["why"]]
    return {"records": [x for r in runs for x in r["records"]],
            "why": "; ".join(whys) if whys else None, "seconds": time.monotonic() - t0,
            "cap": cap}


def measure(clock: Clock, device: str, quick: bool) -> dict[str, dict[str, Any]]:
    """Every section in turn, each capped (:data:`WEIGHTS`)."""
    import gpu_measure

    s = gpu_measure.sizes(quick)
    base = ["--device", device] + (["--quick"] if quick else [])
    names, out = list(WEIGHTS), {}
    for i, name in enumerate(names):
        left = max(0.0, clock.left() - RESERVE_S)
        cap = left * WEIGHTS[name] / sum(WEIGHTS[n] for n in names[i:])
        if cap < MIN_CAP_S:
            out[name] = {"records": [], "why": f"out of time ({cap:.0f} s)", "seconds": 0.0,
                         "cap": cap}
            continue
        print(f"gpu-check: {name} (cap {cap:.0f} s, {clock.elapsed():.0f} s in)",
              file=sys.stderr, flush=True)
        out[name] = section(name, base, s, cap)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                   help="cpu: measure on the CPU (with --quick: checks the code paths)")
    p.add_argument("--quick", action="store_true", help="tiny sizes (gpu_measure.QUICK)")
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "gpu.md")
    p.add_argument("--skip-tests", action="store_true", help=f"do not run {TESTS}")
    p.add_argument("--deadline", type=float, default=DEADLINE_S, help="seconds for it all")
    p.add_argument("--tests-budget", type=float, default=TESTS_BUDGET_S)
    a = p.parse_args(argv)
    clock = Clock(a.deadline)
    if a.device != "cpu":
        line = no_device_line()
        if line is not None:
            print(line, flush=True)
            return 0
    os.environ.update(ENV)
    device = "cpu" if a.device == "cpu" else "cuda"
    setup = [ensure_fxpar(), ensure_wheels()]
    import gpu_measure
    import torch

    facts = {"gpu": gpu_facts() if device == "cuda" else {}, "commit": git_commit(),
             "torch": torch.__version__, "cuda": torch.version.cuda,
             "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
             "device": device, "quick": a.quick, "setup": setup, "deadline": a.deadline,
             "sizes": asdict(gpu_measure.sizes(a.quick))}
    tests = None
    if not a.skip_tests:
        print(f"gpu-check: {TESTS} (budget {a.tests_budget:.0f} s)", file=sys.stderr, flush=True)
        tests = run_tests(min(a.tests_budget, max(10.0, clock.left() * 0.6)))
    sections = measure(clock, device, a.quick)
    facts["seconds"] = clock.elapsed()
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(gpu_report.render(facts, tests, sections))
    done = "" if tests is None else f"; tests: {gpu_report.test_counts(tests)}"
    print(f"fxpar gpu-check: wrote {a.out} in {clock.elapsed():.0f} s{done}", flush=True)
    failed = tests is not None and any(t["outcome"] in ("failed", "error")
                                       for t in tests["tests"])
    return 1 if failed else 0  # a failing GPU test fails the check; measurements never do


if __name__ == "__main__":
    raise SystemExit(main())
