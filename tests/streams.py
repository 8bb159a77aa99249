"""``make test``: the suite in streams that keep both cores busy, then the timing-bound files.

One stream of MPI launches leaves about a third of a 2-core machine idle (ranks importing
torch, waiting on peers, the harness between launches), so the MPI test files run in two
streams, beside a third running ``tests/unit`` in one process. The two MPI streams split the
files by the ranks they launch: the files of 5 to 8 ranks in one, the rest (4 ranks or fewer)
in the other, so that no two 8-rank launches meet in memory. The files whose jobs must end
within a bound of wall time (:data:`TIMED`) run after them, alone. Every ``tests/mpi`` file
runs in exactly one place; a file not named here joins the second stream.

Each stream's report is printed whole when it ends; the exit code is non-zero when any failed.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
MPI = HERE / "mpi"
MANY_RANKS = ["test_volumes3d.py", "test_losses.py", "test_schedules_mpi.py", "test_gems_dp.py",
              "test_spatial.py", "test_recompute.py"]
"""The files whose launches take 5 to 8 ranks: one stream."""
TIMED = ["test_faults.py", "test_fault_matrix.py", "test_comm.py", "test_checkpoint_crash.py",
         "test_fuzz.py"]
"""Files whose jobs or checks must end within a bound of wall time (a failing job within 90 s,
a launch within 20-60 s, a fuzz check within 30 s): run last, beside nothing else."""
PYTEST = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]


def streams() -> tuple[dict[str, list[str]], dict[str, list[str]]]:
    """(the streams that run together, what runs after them): name -> pytest arguments."""
    files = sorted(p.name for p in MPI.glob("test_*.py"))
    missing = [f for f in MANY_RANKS + TIMED if f not in files]
    if missing:
        raise SystemExit(f"tests/streams.py names files that do not exist: {missing}")
    rest = [f for f in files if f not in MANY_RANKS + TIMED]
    together = {
        "tests/mpi, 5-8 ranks": ["--durations=8", *(str(MPI / f) for f in MANY_RANKS)],
        "tests/mpi, up to 4 ranks": ["--durations=8", *(str(MPI / f) for f in rest)],
        "tests/unit": ["--durations=5", str(HERE / "unit")],
    }
    after = {"tests/mpi, bound by wall time": ["--durations=5", *(str(MPI / f) for f in TIMED)]}
    return together, after


def run(group: dict[str, list[str]], env: dict[str, str]) -> dict[str, int]:
    """Run ``group``'s streams at once; print each report when it ends; their exit codes."""
    logs = {name: Path(HERE.parent / f".test-{i}.log") for i, name in enumerate(group)}
    start = time.monotonic()
    procs = {}
    for name, args in group.items():
        with open(logs[name], "w") as out:
            procs[name] = subprocess.Popen([*PYTEST, *args], stdout=out,
                                           stderr=subprocess.STDOUT, env=env)
    codes: dict[str, int] = {}
    while len(codes) < len(procs):
        for name, proc in procs.items():
            if name not in codes and proc.poll() is not None:
                codes[name] = proc.returncode
                took = time.monotonic() - start
                print(f"== {name}: exit {proc.returncode} after {took:.0f} s ==", flush=True)
                print(logs[name].read_text(), flush=True)
                logs[name].unlink()
        time.sleep(1.0)
    return codes


def main() -> int:
    together, after = streams()
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}"
           f"{os.environ.get('PATH', '')}"}  # mpiexec of this environment
    start = time.monotonic()
    codes = run(together, env)
    codes.update(run(after, env))
    failed = [name for name, code in codes.items() if code != 0]
    print(f"== make test: {len(codes)} streams in {time.monotonic() - start:.0f} s; "
          f"{'failed: ' + ', '.join(failed) if failed else 'all passed'} ==", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
