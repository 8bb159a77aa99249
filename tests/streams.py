"""``make test``: the suite in streams that keep both cores busy.

The files whose jobs must end within a bound of wall time (:data:`TIMED`: fault jobs, launch
limits, the fuzzer's limits) start first, beside ``tests/unit`` only: a single process, so
they keep about a core to themselves (beside the MPI streams their watchdog and 90-second bounds
failed). When they end, the other ``tests/mpi`` files start in two streams: :data:`MANY_RANKS`
in one (their cases share one 8-rank launch, tests/helpers/launch.py ``Batch(share=True)``),
the rest (4 ranks or fewer) in the other, so that no two 8-rank launches meet in memory. Every
``tests/mpi`` file runs in exactly one place; a file not named here joins the second MPI
stream.

``tests/unit`` stays one process: on two pytest-xdist workers it took 353 CPU-s instead of 284
(each worker imports torch and warms up torch.export, and the captures one process shares are
made twice), and the machine had no idle core for the second worker to use (measured in one
``make test`` each: 1,295 s with the second worker and the trimmed cases, 1,320 s before).

Each stream's report is printed whole when it ends; the exit code is non-zero when any failed.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
MPI = HERE / "mpi"
MANY_RANKS = ["test_volumes3d.py", "test_losses.py", "test_schedules_mpi.py", "test_gems_dp.py",
              "test_spatial.py", "test_recompute.py", "test_fusion.py", "test_pipeline.py",
              "test_halonet.py", "test_efficientvit.py"]
"""The files whose cases share one launch of 8 ranks: one stream. Those of 5 to 8 ranks, and
the 4-rank cases of test_fusion.py and test_pipeline.py, which even out the two MPI streams
(6a54aea: this one ended at 1,265 s, the other at 1,366 s; the fusion cases take about 65 s.
9eb2092, narrow resnets: this one 825 s, the other 872 s; the pipeline cases about 45 s;
HaloNet's and EfficientViT's 4-rank cases, about 65 and 55 s, for the attention files that
joined the other stream)."""
TIMED = ["test_faults.py", "test_fault_matrix.py", "test_comm.py", "test_checkpoint_crash.py",
         "test_fuzz.py"]
"""Files whose jobs or checks must end within a bound of wall time (a failing job within 90 s,
a launch within 20-60 s, a fuzz check within 30 s): beside nothing but ``tests/unit``."""
PYTEST = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
CORE_UNIT = ["test_trace.py", "test_split_stages.py", "test_emit.py", "test_fxpar_ops.py",
             "test_graphdata.py", "test_plan.py"]
CORE_MPI = ["test_programs.py", "test_pipeline.py", "test_spatial.py", "test_libraries.py"]
CORE_CASES = ("(not test_spatial and not test_libraries) or resnet18 or unet_segmentation or "
              "upsample_bilinear_p2 or maxpool_pad_p2 or conv_transpose_p2 or "
              "timm_convnext_atto__sp2 or smp_Unet__sp2")
"""``make test-oldest-torch``: the core subset the oldest supported torch runs (capture,
stages, emitted and saved programs, fxpar's custom ops, pipelines, spatial ops and models, two
library models), about 4 minutes: every file of :data:`CORE_UNIT` and :data:`CORE_MPI`, the
spatial and library files cut down to the cases :data:`CORE_CASES` names."""


@dataclass(frozen=True)
class Stream:
    """One pytest process of ``make test``."""

    args: list[str]
    after: str | None = None
    """The stream whose end this one waits for (None: it starts at once)."""
    captures: bool = True
    """Its processes share the run's capture folder (``FXPAR_CAPTURE_CACHE``): a model
    captured by one launch (one fault job, one batch of cases) is read back by the next
    instead of traced again. tests/unit does not: its tests of capturing must capture."""


def streams() -> dict[str, Stream]:
    """Every stream of ``make test``, by name."""
    files = sorted(p.name for p in MPI.glob("test_*.py"))
    missing = [f for f in MANY_RANKS + TIMED if f not in files]
    if missing:
        raise SystemExit(f"tests/streams.py names files that do not exist: {missing}")
    rest = [f for f in files if f not in MANY_RANKS + TIMED]
    timed = "tests/mpi, bound by wall time"
    return {
        "tests/unit": Stream(["--durations=5", str(HERE / "unit")], captures=False),
        timed: Stream(["--durations=5", *(str(MPI / f) for f in TIMED)]),
        "tests/mpi, 8-rank launch": Stream(["--durations=8", *(str(MPI / f) for f in MANY_RANKS)],
                                       after=timed),
        "tests/mpi, up to 4 ranks": Stream(["--durations=8", *(str(MPI / f) for f in rest)],
                                           after=timed),
    }


def run(plan: dict[str, Stream], env: dict[str, str], captures: Path) -> dict[str, int]:
    """Run every stream of ``plan``, each as soon as the one it waits for has ended; print each
    report when it ends; their exit codes. ``captures``: the run's capture folder."""
    logs = {name: Path(HERE.parent / f".test-{i}.log") for i, name in enumerate(plan)}
    start = time.monotonic()
    procs: dict[str, subprocess.Popen] = {}
    codes: dict[str, int] = {}
    while len(codes) < len(plan):
        for name, stream in plan.items():
            if name not in procs and (stream.after is None or stream.after in codes):
                with open(logs[name], "w") as out:
                    mine = {**env, "FXPAR_CAPTURE_CACHE": str(captures)} if stream.captures \
                        else {k: v for k, v in env.items() if k != "FXPAR_CAPTURE_CACHE"}
                    procs[name] = subprocess.Popen([*PYTEST, *stream.args], stdout=out,
                                                   stderr=subprocess.STDOUT, env=mine)
        for name, proc in procs.items():
            if name not in codes and proc.poll() is not None:
                codes[name] = proc.returncode
                took = time.monotonic() - start
                print(f"== {name}: exit {proc.returncode} after {took:.0f} s ==", flush=True)
                print(logs[name].read_text(), flush=True)
                logs[name].unlink()
        time.sleep(1.0)
    return codes


def core() -> list[str]:
    """The pytest arguments of the core subset (:data:`CORE_CASES`)."""
    return ["--durations=5", *(str(HERE / "unit" / f) for f in CORE_UNIT),
            *(str(MPI / f) for f in CORE_MPI), "-k", CORE_CASES]


def main() -> int:
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}"
           f"{os.environ.get('PATH', '')}"}  # mpiexec of this environment
    if sys.argv[1:] == ["--core"]:
        import torch

        print(f"== the core subset on torch {torch.__version__} ==", flush=True)
        return subprocess.run([*PYTEST, *core()], env=env).returncode
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="fxpar-captures-") as captures:
        codes = run(streams(), env, Path(captures))
    failed = [name for name, code in codes.items() if code != 0]
    print(f"== make test: {len(codes)} streams in {time.monotonic() - start:.0f} s; "
          f"{'failed: ' + ', '.join(failed) if failed else 'all passed'} ==", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
