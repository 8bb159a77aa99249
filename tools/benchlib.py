"""Shared pieces of fxpar's benchmarks (``tools/bench.py`` is the entry point).

A benchmark is a module ``tools/bench_<name>.py`` with::

    TITLE: str                                  # section heading in docs/benchmarks.md
    def add_args(parser) -> None                # its own options (optional)
    def run(opts: argparse.Namespace) -> dict   # measure; returns a Section (below)

and, when it needs subprocesses, a worker mode reached through ``worker_command`` (the driver
never imports MPI itself: a singleton MPI_Init in the parent could clash with the mpiexec it
launches). A Section is plain JSON::

    {"name": "spatial", "title": TITLE, "command": "...", "method": "markdown paragraph",
     "tables": [{"title": "...", "columns": [...], "rows": [[...], ...]}],
     "plots": [{"file": "spatial_memory.png", "title": "...", "xlabel": "...", "ylabel": "...",
                "kind": "line" | "bar", "series": {"label": [[x, y], ...]}}],
     "aims": [{"what": "...", "aim": "<= 1.03x", "measured": "1.01x (0.99-1.04)",
               "met": true, "why": "markdown: why missed and what would close it"}],
     "notes": "markdown", "raw": {...anything else worth keeping...}}

``tools/bench.py`` collects the sections into one JSON file and renders docs/benchmarks.md
(tables, the aims summary, matplotlib plots under docs/bench/).

Noise: the machines are small shared VMs. Measure every system of a comparison in the same
round, rotate their order from round to round, wait for a quiet machine before each launch
(``wait_quiet``), and report medians and ranges of per-round ratios (``spread``).
:func:`interleave` is that loop, for every section.

A new benchmark is one function: its ``run`` names the systems it compares, each a
:class:`System` (a launch, and whether it is the machine's limit), and returns
:func:`compare`'s Section, which launches them in interleaved rounds, tabulates each figure's
median and range, and divides each by the baseline and by the limit measured in the same
rounds::

    TITLE = "SP2 against one process"

    def run(opts):
        one = benchlib.worker_command("bench_x.py", ["--worker", "--parts", "1"])
        sp2 = benchlib.worker_command("bench_x.py", ["--worker", "--parts", "2"], ranks=2)
        half = benchlib.worker_command("bench_x.py", ["--worker", "--half"])
        env = benchlib.thread_env(1)
        return benchlib.compare(opts, "x", TITLE, [
            benchlib.System("one process", one, env), benchlib.System("SP2", sp2, env),
            benchlib.System("half image, no messages", half, env, limit=True)],
            baseline="one process", method="...")
"""

from __future__ import annotations

import os
import platform
import re
import resource
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")
MPIEXEC = str(Path(sys.executable).parent / "mpiexec") if \
    (Path(sys.executable).parent / "mpiexec").exists() else \
    (shutil.which("mpiexec") or "mpiexec")  # the mpich wheel's, in the venv, else PATH's


def spread(values: Sequence[float]) -> dict[str, float]:
    """Median and range: a noisy 2-core VM makes means and single runs misleading."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values),
            "n": len(values)}


def fmt_spread(s: dict[str, float], unit: str = "", digits: int = 2) -> str:
    """``1.84x (1.79-1.90)``."""
    f = f"{{:.{digits}f}}"
    return (f"{f.format(s['median'])}{unit} ({f.format(s['min'])}-{f.format(s['max'])}"
            f"{unit})")


def machine() -> dict[str, Any]:
    """What the numbers depend on."""
    import torch

    cpu = re.search(r"model name\s*:\s*(.*)", Path("/proc/cpuinfo").read_text())
    return {"nproc": os.cpu_count(), "cpu": cpu.group(1) if cpu else platform.processor(),
            "torch": torch.__version__, "python": platform.python_version(),
            "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}


def cpu_busy() -> float:
    """CPU-seconds all cores have been busy since boot (/proc/stat: all but idle and iowait;
    steal counts, since a neighbour VM taking our cores is noise too)."""
    f = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    return (sum(f) - f[3] - f[4]) / os.sysconf("SC_CLK_TCK")


def children_cpu() -> float:
    """CPU-seconds of every waited-for descendant (mpiexec waits for its ranks)."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def wait_quiet(max_foreign: float = 0.25, limit: float = 120.0) -> float:
    """Wait (up to ``limit`` s) until other processes use under ``max_foreign`` cores; returns
    the seconds waited. On a 2-core machine one concurrent job halves a rank's speed."""
    t0 = time.time()
    while time.time() - t0 < limit:
        b0 = cpu_busy()
        time.sleep(2.0)
        if (cpu_busy() - b0) / 2.0 < max_foreign:
            break
    return time.time() - t0


def free_port() -> int:
    """A port for a torch.distributed rendezvous; fresh per launch."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def thread_env(threads: int, src: Path = ROOT) -> dict[str, str]:
    """The environment of a worker: ``threads`` intra-op threads, fxpar imported from ``src``."""
    return {**os.environ, **dict.fromkeys(THREAD_VARS, str(threads)),
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
            "PYTHONPATH": os.pathsep.join([str(src), os.environ.get("PYTHONPATH", "")])}


def worker_command(script: str, args: Sequence[str], ranks: int | None = None) -> list[str]:
    """``python tools/<script> --worker ...``, under ``mpiexec -n ranks`` when ranks is given."""
    cmd = [sys.executable, str(ROOT / "tools" / script), *args]
    return [MPIEXEC, "-n", str(ranks), *cmd] if ranks is not None else cmd


def launch(cmd: Sequence[str], env: dict[str, str], timeout: float = 900.0,
           cwd: Path = ROOT) -> dict[str, Any]:
    """Run one worker; its last ``BENCH {json}`` stdout line, with ``foreign`` (the cores other
    processes used meanwhile: busy CPU minus our own) and ``wall`` added. A failure raises
    with the worker's output tail; a timeout kills the whole process group."""
    import json

    t0, b0, c0 = time.time(), cpu_busy(), children_cpu()
    proc = subprocess.Popen(list(cmd), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=cwd, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # our own session: mpiexec and its ranks
        out, err = proc.communicate()
    wall = time.time() - t0
    foreign = max(0.0, (cpu_busy() - b0) - (children_cpu() - c0)) / wall
    lines = [ln for ln in out.splitlines() if ln.startswith("BENCH ")]
    if proc.returncode or not lines:
        raise RuntimeError(f"worker {' '.join(cmd)} failed (rc {proc.returncode}):\n"
                           f"{out[-4000:]}\n{err[-8000:]}")
    return {**json.loads(lines[-1].removeprefix("BENCH ")), "foreign": foreign, "wall": wall}


def measure(cmd: Sequence[str], env: dict[str, str], *, retries: int = 3,
            max_foreign: float = 0.25, timeout: float = 900.0) -> dict[str, Any]:
    """``launch`` after a quiet spell, repeated while another process took more than
    ``max_foreign`` cores during it (the last attempt is kept either way, marked)."""
    rec: dict[str, Any] = {}
    for attempt in range(retries + 1):
        waited = wait_quiet(max_foreign)
        rec = launch(cmd, env, timeout)
        rec.update(attempt=attempt, waited=waited)
        if rec["foreign"] < max_foreign:
            break
        again = "; again" if attempt < retries else "; kept (no retries left)"
        print(f"  {rec['foreign']:.2f} foreign cores meanwhile{again}", file=sys.stderr,
              flush=True)
    return rec


def emit(record: dict[str, Any]) -> None:
    """A worker's result: one ``BENCH {json}`` line on stdout (rank 0 only, by convention)."""
    import json

    print("BENCH " + json.dumps(record), flush=True)


def rotate(items: Sequence[Any], round_: int) -> list[Any]:
    """``items`` rotated by ``round_``: each round measures the systems in another order."""
    if not items:
        return []
    k = round_ % len(items)
    return list(items[k:]) + list(items[:k])


def interleave(section: str, rounds: int, systems: Sequence[Any],
               one: Callable[[Any, int], dict[str, Any]],
               key: Callable[[Any], str] = str) -> list[dict[str, dict[str, Any]]]:
    """The harness's rounds: ``one(system, round)`` for every system once per round, in an
    order rotated by the round (:func:`rotate`), with a progress line per launch naming the
    system. One dict per round, ``key(system)`` -> what ``one`` returned (usually
    :func:`measure`'s record)."""
    out: list[dict[str, dict[str, Any]]] = []
    for k in range(rounds):
        rec: dict[str, dict[str, Any]] = {}
        for i, s in enumerate(rotate(systems, k)):
            progress(section, k + 1, rounds, f"{i + 1}/{len(systems)} {key(s)}")
            rec[key(s)] = one(s, k)
        out.append(rec)
    return out


def nested(rounds: list[dict[str, dict[str, Any]]]) -> list[dict[str, dict[str, Any]]]:
    """:func:`interleave`'s rounds keyed ``"model/system"`` as ``{model: {system: record}}``
    (split at the first ``/``)."""
    out: list[dict[str, dict[str, Any]]] = []
    for r in rounds:
        two: dict[str, dict[str, Any]] = {}
        for k, rec in r.items():
            outer, _, inner = k.partition("/")
            two.setdefault(outer, {})[inner] = rec
        out.append(two)
    return out


@dataclass(frozen=True)
class System:
    """One side of a comparison: a launch (``measure``'s command and environment) whose last
    ``BENCH {json}`` line holds the figures (``step_s`` and the like)."""

    name: str
    command: list[str]
    env: dict[str, str]
    limit: bool = False
    """The machine's limit for the others, measured in the same rounds (message-free partial
    processes, the hardware's own kernel)."""


def compare(opts: Any, name: str, title: str, systems: Sequence[System], *, baseline: str,
            method: str, figure: str = "step_s", unit: str = "s", lower_is_better: bool = True,
            aims: Sequence[dict[str, Any]] = ()) -> dict[str, Any]:
    """A whole section from its systems: each launched once per round (:func:`interleave` of
    :func:`measure`, ``opts.rounds`` rounds), then one table row per system: the median and
    range of ``figure``; its speed-up over ``baseline`` (baseline / this for a time, this /
    baseline for a rate), per round; and the share of the limit it reaches (limit / this for a
    time), per round. The limit's own row gives its speed-up: the figure to read each other
    against."""
    names = [s.name for s in systems]
    limits = [s.name for s in systems if s.limit]
    if baseline not in names or len(set(names)) != len(names) or len(limits) > 1:
        raise ValueError(f"{name}: systems {names} need unique names, the baseline "
                         f"{baseline!r} among them and at most one limit (have {limits})")
    rounds = interleave(name, opts.rounds, systems, lambda s, _k: measure(
        s.command, s.env, retries=opts.retries, max_foreign=opts.max_foreign,
        timeout=opts.timeout), key=lambda s: s.name)

    def ratios(a: str, b: str) -> dict[str, float]:
        pairs = [(r[a][figure], r[b][figure]) for r in rounds]
        return spread([x / y if lower_is_better else y / x for x, y in pairs])

    columns = ["system", f"{figure} ({unit})", f"speed-up over {baseline}"] + \
        (["share of the limit"] if limits else [])
    rows = []
    for s in names:
        row = [s + (" (limit)" if s in limits else ""),
               fmt_spread(spread([r[s][figure] for r in rounds]), digits=3),
               fmt_spread(ratios(baseline, s), "x")]
        if limits:
            row.append(fmt_spread(ratios(limits[0], s), "x"))
        rows.append(row)
    return {"name": name, "title": title, "method": method + f" {len(rounds)} round(s), "
            "systems in rotated order, each launch after a quiet spell; median (range).",
            "tables": [{"title": title, "columns": columns, "rows": rows}], "plots": [],
            "aims": list(aims), "notes": "", "raw": {"rounds": rounds}}


def peak_rss_mib() -> float:
    """This process's peak resident set (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def rss_bytes() -> int:
    """This process's resident set now (/proc/self/statm, pages)."""
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def reset_peak_rss() -> None:
    """Start a new peak (Linux's VmHWM) from what is resident now: a compiler's transient peak
    is not training memory. Freed heap goes back to the system first (malloc_trim)."""
    import ctypes
    import gc

    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    Path("/proc/self/clear_refs").write_text("5")


def peak_rss_bytes() -> int:
    """This process's peak resident set since :func:`reset_peak_rss` (VmHWM)."""
    status = Path("/proc/self/status").read_text()
    return int(status.split("VmHWM:")[1].split()[0]) * 1024


_SECTION_T0: dict[str, float] = {}


def progress(section: str, done: int, total: int, what: str = "") -> None:
    """``[single] round 2/5 resnet18 (41 s elapsed)`` on stderr: a benchmark that runs for
    minutes shows where it is. Elapsed counts from the section's first progress line."""
    t0 = _SECTION_T0.setdefault(section, time.time())
    extra = f" {what}" if what else ""
    print(f"[{section}] round {done}/{total}{extra} ({time.time() - t0:.0f} s elapsed)",
          file=sys.stderr, flush=True)


def snapshot(rev: str) -> tuple[Path, str]:
    """``rev`` exported to a temporary folder (``git archive``; the repository is only read)
    and its short hash: workers import fxpar from there (``thread_env(threads, src=folder)``),
    so a long run measures one commit however the working tree changes meanwhile."""
    import atexit
    import io
    import shutil
    import tarfile
    import tempfile

    folder = Path(tempfile.mkdtemp(prefix="bench-fxpar-"))
    atexit.register(shutil.rmtree, folder, True)  # also when a worker fails
    archive = subprocess.run(["git", "archive", rev], cwd=ROOT, capture_output=True, check=True)
    tarfile.open(fileobj=io.BytesIO(archive.stdout)).extractall(folder, filter="data")
    # passes/ and models/ install as fxpar.passes and fxpar.models (pyproject's package-dir):
    # without these links, the editable install would import them from the working tree
    for sub in ("passes", "models"):
        if (folder / sub).is_dir() and not (folder / "fxpar" / sub).exists():
            (folder / "fxpar" / sub).symlink_to(Path("..") / sub)
    short = subprocess.run(["git", "rev-parse", "--short", rev], cwd=ROOT, capture_output=True,
                           check=True, text=True).stdout.strip()
    return folder, short


def entry(description: str, add_args: Any, run: Any, argv: Sequence[str] | None,
          worker: Any, worker_parser: Any, rounds: int = 1) -> int:
    """A section's ``main``: ``--worker ...`` runs ``worker(worker_parser().parse_args(argv))``
    (the per-launch process), anything else :func:`standalone`."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--worker" in argv:
        worker(worker_parser().parse_args(argv))
        return 0
    return standalone(description, add_args, run, argv, rounds)


def standalone(description: str, add_args: Any, run: Any, argv: Sequence[str] | None,
               rounds: int = 1) -> int:
    """``python tools/bench_<name>.py [--quick] ...``: one section alone, its Section JSON on
    stdout (the common options of tools/bench.py, then the section's own)."""
    import argparse
    import json

    p = argparse.ArgumentParser(description=description)
    p.add_argument("--rounds", type=int, default=rounds)
    p.add_argument("--quick", action="store_true", help="tiny sizes: checks the plumbing")
    p.add_argument("--max-foreign", type=float, default=0.25)
    p.add_argument("--retries", type=int, default=3)
    p.add_argument("--timeout", type=float, default=900.0)
    add_args(p)
    print(json.dumps(run(p.parse_args(argv)), indent=1))
    return 0
