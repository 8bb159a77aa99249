"""Run test cases on N ranks under a real ``mpiexec``; never hang.

Each ``mpiexec`` launch pays seconds of ``import torch`` per rank, so many cases share one
launch: :func:`run_cases` starts ``mpiexec -n N python -m fxpar.testing CASE...`` once and each
rank runs the cases in order. A case is a function in a file, ``"path/to/file.py::name"``,
called with no arguments on every rank (it gets the world from :func:`fxpar.comm.world.world`).

Ranks leave a marker per case (started / passed / traceback) in a scratch folder. When a case
raises on any rank, that rank writes its traceback and aborts the whole job (so no rank waits
forever on a peer that died); the cases no rank had started yet run again in a new launch. The
harness kills the job's process group after ``timeout``. Cases that never finished are reported
with the ranks that had started them.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from fxpar.core.options import setting


@dataclass(frozen=True)
class CaseResult:
    """What happened to one case across all ranks."""

    case: str
    passed: bool
    report: str
    output: str = ""
    """Everything the launch printed (shared by the cases of one launch)."""
    seconds: float = 0.0
    """Wall time of the case on rank 0 (0 if it did not finish)."""

    def check(self) -> None:
        """Raise AssertionError with every failing rank's traceback unless the case passed."""
        if not self.passed:
            raise AssertionError(f"{self.case} failed under mpiexec:\n{self.report}")


def torchrun() -> str:
    """The ``torchrun`` that belongs to this Python."""
    here = Path(sys.executable).parent / "torchrun"
    found = str(here) if here.exists() else shutil.which("torchrun")
    if found is None:
        raise RuntimeError("torchrun not found beside this Python: is torch installed here?")
    return found


def _command(launcher: str, n: int) -> list[str]:
    """How ``launcher`` starts ``n`` ranks of this module."""
    if launcher == "mpiexec":
        return [mpiexec(), "-n", str(n), sys.executable, "-m", "fxpar.testing"]
    if launcher == "torchrun":
        return [torchrun(), "--standalone", f"--nproc-per-node={n}", "--no-python",
                sys.executable, "-m", "fxpar.testing"]
    raise ValueError(f"unknown launcher {launcher!r}: use 'mpiexec' or 'torchrun'")


def mpiexec() -> str:
    """``FXPAR_MPIEXEC``, else the ``mpiexec`` that belongs to this Python (the mpich
    wheel's), else the one on PATH."""
    if setting("mpiexec"):
        return setting("mpiexec")
    here = Path(sys.executable).parent / "mpiexec"
    found = str(here) if here.exists() else shutil.which("mpiexec")
    if not found:
        raise RuntimeError("mpiexec not found: `pip install mpich` (or load your MPI module)")
    return found


def _marker(folder: Path, case: str, rank: int, kind: str) -> Path:
    safe = case.replace("/", "_").replace(":", "_").replace(".", "_")
    return folder / f"{safe}.rank{rank}.{kind}"


def run_cases(cases: Sequence[str], n: int, timeout: float = 600.0,
              env: dict[str, str] | None = None,
              pythonpath: Sequence[str | Path] = (), launcher: str = "mpiexec"
              ) -> dict[str, CaseResult]:
    """Run ``cases`` under ``mpiexec -n n``; one result per case, never hanging.

    One launch runs them all in order. A failing case ends its launch (every rank aborts), so
    the cases after it, which no rank started, run again in a fresh launch: one failure never
    hides the verdict of another. ``timeout`` bounds all launches together.

    pythonpath: folders the case files import helpers from (prepended to PYTHONPATH).
    launcher: "mpiexec", or "torchrun" (the ranks then communicate over torch.distributed
    alone: fxpar.comm.distributed)."""
    # FXPAR_POLL: a rank waiting for a message or a collective sleeps between tests of it
    # instead of spinning on a core the ranks still computing need (tests run more ranks than
    # cores); fxpar.comm.mpi
    full_env = {"FXPAR_POLL": "0.0005", **os.environ, "OMP_NUM_THREADS": "1",
                "PYTHONUNBUFFERED": "1", **(env or {})}
    if pythonpath:
        full_env["PYTHONPATH"] = os.pathsep.join(
            [*map(str, pythonpath), *filter(None, [full_env.get("PYTHONPATH")])])
    deadline = time.monotonic() + timeout
    results: dict[str, CaseResult] = {}
    pending = list(cases)
    while pending:
        got, unstarted = _launch(pending, n, max(1.0, deadline - time.monotonic()), full_env,
                                 launcher)
        results.update(got)
        if not unstarted or len(unstarted) == len(pending) or time.monotonic() >= deadline:
            for case in unstarted:  # nothing ran at all (e.g. an import failed): say so
                results[case] = got[case]
            break
        pending = unstarted
    return {case: results[case] for case in cases}


def _launch(cases: list[str], n: int, timeout: float, env: dict[str, str],
            launcher: str = "mpiexec") -> tuple[dict[str, CaseResult], list[str]]:
    """One ``mpiexec`` over ``cases``: (results of the cases some rank started, or every
    case's result if none started; the cases no rank started)."""
    folder = Path(tempfile.mkdtemp(prefix="fxpar-mpi-"))
    cmd = [*_command(launcher, n), str(folder), *cases]
    start = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
        timed_out = False
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        timed_out = True
    except BaseException:  # interrupted (Ctrl-C, pytest-timeout): leave no ranks running
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        shutil.rmtree(folder, ignore_errors=True)
        raise
    elapsed = time.monotonic() - start
    results: dict[str, CaseResult] = {}
    unstarted: list[str] = []
    for case in cases:
        errors = [(r, _marker(folder, case, r, "err")) for r in range(n)]
        errors = [(r, p.read_text()) for r, p in errors if p.exists()]
        passed = not errors and all(_marker(folder, case, r, "ok").exists() for r in range(n))
        if passed:
            took = _marker(folder, case, 0, "ok").read_text().strip()
            results[case] = CaseResult(case, True, "", output, float(took or 0.0))
            continue
        started = [r for r in range(n) if _marker(folder, case, r, "start").exists()]
        if not started and not timed_out:
            unstarted.append(case)
        lines = [f"--- rank {r} ---\n{text}" for r, text in errors]
        if not errors:
            why = (f"killed after the {timeout:.0f}s timeout" if timed_out
                   else f"{launcher} exited with code {proc.returncode}")
            lines.append(f"case did not finish ({why}, {elapsed:.0f}s in); "
                         f"ranks that started it: {started}")
        lines.append(f"--- {launcher} output (last 4000 chars) ---\n{output[-4000:]}")
        results[case] = CaseResult(case, False, "\n".join(lines), output)
    shutil.rmtree(folder, ignore_errors=True)
    return results, unstarted


def load_case(case: str) -> Callable[[], object]:
    """Import ``"path/to/file.py::name"`` and return the function."""
    path, _, name = case.partition("::")
    spec = importlib.util.spec_from_file_location(Path(path).stem, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    # importable by name while it runs: a class it defines (a model's output dataclass) is
    # pickled by reference when rank 0 sends the traced graph
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return getattr(module, name)


def _worker(folder: Path, cases: Sequence[str]) -> None:
    from fxpar.comm.world import world

    comm = world()
    rank = comm.rank
    for case in cases:
        # every rank starts the case together; one done early sleeps meanwhile instead of
        # spinning in the case's first collective on a core a busy rank needs
        comm.barrier(poll=0.005)
        _marker(folder, case, rank, "start").touch()
        start = time.perf_counter()
        try:
            load_case(case)()
        except BaseException:  # noqa: BLE001 - report anything, then end every rank
            _marker(folder, case, rank, "err").write_text(traceback.format_exc())
            print(f"[rank {rank}] {case} failed:\n{traceback.format_exc()}", flush=True)
            time.sleep(1.0)  # let peers failing at the same point write their tracebacks
            comm.abort(1)
            os._exit(1)  # Abort can return when the peers have already exited
        _marker(folder, case, rank, "ok").write_text(f"{time.perf_counter() - start:.2f}")


if __name__ == "__main__":
    _worker(Path(sys.argv[1]), sys.argv[2:])
