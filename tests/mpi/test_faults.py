"""Fail-fast and determinism under a real mpiexec (issue 8).

Each job is a plain user script (tests/mpi/cases/jobs.py) or fxpar-run, launched on its own: a
fault must end the WHOLE job, by itself (well before the harness's timeout), printing the
failing rank's error once. The launches run a few at a time (most of a fault job is ranks
importing torch and waiting on each other), so together they cost about one launch's time.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from fxpar.testing import mpiexec

JOBS = Path(__file__).parent / "cases" / "jobs.py"
TIMEOUT = 150.0
"""Seconds before the harness kills a launch; a job that ends by itself takes far less."""
BOUND = 90.0
"""A failing job must have ended within this many seconds of its launch (imports included,
four launches of 2-3 ranks sharing 2 cores: about 40-55 s each; alone about 10 s)."""
CLI = (f"{JOBS}:classifier --image-size 16 --batch-size 8 --steps 2 --stages 2 --parts 2 "
       f"--num-classes 4")

pytestmark = pytest.mark.mpi


@dataclass(frozen=True)
class Ran:
    rc: int | None
    """mpiexec's exit code; None when the harness had to kill the launch (a hang)."""
    out: str
    seconds: float


def _launch(args: list[str], env: dict[str, str]) -> Ran:
    full = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
            "PYTHONPATH": str(JOBS.parent.parent.parent), **env}
    start = time.monotonic()
    proc = subprocess.Popen([mpiexec(), *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=full,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=TIMEOUT)
        return Ran(proc.returncode, out, time.monotonic() - start)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        out, _ = proc.communicate()
        return Ran(None, out, time.monotonic() - start)


def _job(n: int, name: str, out: Path | None = None) -> list[str]:
    return ["-n", str(n), sys.executable, str(JOBS), name, str(out or "/nonexistent")]


def _cli(extra0: str = "", extra1: str = "") -> list[str]:
    run = [str(Path(sys.executable).parent / "fxpar-run")]
    return ["-n", "1", *run, *CLI.split(), *extra0.split(), ":",
            "-n", "1", *run, *CLI.split(), *extra1.split()]


@pytest.fixture(scope="module")
def ran(tmp_path_factory) -> dict[str, Ran]:
    det = [tmp_path_factory.mktemp(f"det{i}") for i in range(2)]
    nan = tmp_path_factory.mktemp("nan")
    launches = {
        "loss_raises": (_job(2, "loss_raises"), {}),
        "data_loader_raises": (_job(2, "data_loader_raises"), {}),
        "out_of_memory_in_forward": (_job(3, "out_of_memory_in_forward"), {}),
        "rank_killed": (_job(2, "rank_killed"), {}),
        "rank_stuck": (_job(2, "rank_stuck"), {"FXPAR_WATCHDOG": "3"}),
        "rank_stuck_torch": (_job(2, "rank_stuck_before_sending"),
                             {"FXPAR_WATCHDOG": "3", "FXPAR_COMM": "torch"}),
        "ranks_seeded_differently": (_job(2, "ranks_seeded_differently"), {}),
        "caught_and_exits": (_job(3, "caught_and_exits"), {"FXPAR_FAULT": "2:2:raise"}),
        "caught_and_closes": (_job(3, "caught_and_closes"), {"FXPAR_FAULT": "0:2:raise"}),
        "one_rank_stops_early": (_job(2, "one_rank_stops_early"), {}),
        "stall_reported": (_job(3, "hybrid"), {"FXPAR_FAULT": "1:2:stall",
                                               "FXPAR_WATCHDOG": "auto:4"}),
        "nan_undone": (_job(3, "nan_undone", nan), {"FXPAR_FAULT": "1:2:nan-loss"}),
        "cli_data_on_one_rank": (_cli("", "--data /nonexistent"), {}),
        "cli_plans_differ": (_cli("", "--parts 4"), {}),
        "determinism0": (_job(3, "determinism", det[0]), {}),
        "determinism1": (_job(3, "determinism", det[1]), {}),
    }
    with ThreadPoolExecutor(max_workers=4) as pool:
        futures = {k: pool.submit(_launch, *v) for k, v in launches.items()}
        results = {k: f.result() for k, f in futures.items()}
    for k, r in results.items():
        print(f"{k}: exit {r.rc} after {r.seconds:.1f} s")
    results["_nan"] = Ran(0, json.dumps(sorted(p.name for p in nan.iterdir())), 0.0)
    results["_det"] = Ran(0, json.dumps([
        {p.name: json.loads(p.read_text()) for p in sorted(d.iterdir())} for d in det]), 0.0)
    return results


def _failed_alone(r: Ran, rank: int, size: int) -> None:
    """The job ended by itself, non-zero, soon, with exactly one rank's failure banner."""
    assert r.rc is not None, f"the job hung (killed after {TIMEOUT:.0f} s):\n{r.out[-3000:]}"
    assert r.rc != 0 and r.seconds < BOUND, (r.rc, r.seconds, r.out[-3000:])
    assert r.out.count("failed; ending the whole job") == 1, r.out[-3000:]
    assert f"fxpar: rank {rank} of {size} failed; ending the whole job" in r.out, r.out[-3000:]


def test_user_loss_raising_on_the_last_stage_ends_the_job_with_the_grid(ran):
    r = ran["loss_raises"]
    _failed_alone(r, rank=1, size=2)
    assert r.out.count("fxpar.runtime.loop.ActionFailed: rank 1, step 2, action 1F0: ValueError: "
                       "injected failure in the user's loss") == 1, r.out[-3000:]
    assert "[fxpar rank 1] action 1F0 failed" in r.out
    assert "1F0 <-- ERROR HERE" in r.out  # the failing cell of the step x rank grid


def test_data_loader_failing_on_one_rank_ends_the_job(ran):
    r = ran["data_loader_raises"]
    _failed_alone(r, rank=0, size=2)
    assert r.out.count("OSError: injected failure in the data loader: cannot read image 17") \
        == 1, r.out[-3000:]


def test_out_of_memory_in_a_stage_forward_ends_the_job(ran):
    r = ran["out_of_memory_in_forward"]
    _failed_alone(r, rank=2, size=3)
    assert r.out.count("fxpar.runtime.loop.ActionFailed: rank 2, step 2, action 1F0: "
                       "RuntimeError: [enforce fail") == 1, r.out[-3000:]
    assert "DefaultCPUAllocator: can't allocate memory" in r.out


def test_killed_rank_ends_the_job(ran):
    r = ran["rank_killed"]
    assert r.rc is not None, f"the job hung:\n{r.out[-3000:]}"
    assert r.rc != 0 and r.seconds < BOUND, (r.rc, r.seconds, r.out[-3000:])
    assert "signal 9" in r.out or "KILLED BY SIGNAL: 9" in r.out, r.out[-3000:]


def test_stuck_rank_is_ended_by_the_watchdog(ran):
    r = ran["rank_stuck"]
    assert r.rc is not None, f"the job hung:\n{r.out[-3000:]}"
    assert r.rc != 0 and r.seconds < BOUND, (r.rc, r.seconds, r.out[-3000:])
    assert r.out.count("fxpar watchdog: rank 0 waited") == 1, r.out[-3000:]
    assert "over ranks [0, 1] (while running action 0F0)" in r.out, r.out[-3000:]


def test_watchdog_ends_a_job_stuck_in_a_torch_distributed_receive(ran):
    """FXPAR_COMM=torch (gloo on CPU): the waiting rank's watchdog describes the receive it
    waits in and ends the job (the description once crashed the watchdog thread)."""
    r = ran["rank_stuck_torch"]
    assert r.rc is not None, f"the job hung:\n{r.out[-3000:]}"
    assert r.rc != 0 and r.seconds < BOUND, (r.rc, r.seconds, r.out[-3000:])
    assert r.out.count("fxpar watchdog: rank 1 waited") == 1, r.out[-3000:]
    assert "float64 from rank 0 (tag " in r.out and "(while running action 1F0)" in r.out, \
        r.out[-3000:]
    assert "failed; ending the whole job" not in r.out, r.out[-3000:]  # no crash in it


def test_ranks_that_built_different_weights_stop_at_start_up(ran):
    r = ran["ranks_seeded_differently"]
    assert r.rc is not None and r.rc != 0 and r.seconds < BOUND, (r.rc, r.out[-3000:])
    assert r.out.count("the ranks compiled different programs (initial weights differ: "
                       "rank 0 vs rank 1)") == 1, r.out[-3000:]


def test_fxpar_run_setup_error_on_one_rank_stops_every_rank_with_one_message(ran):
    r = ran["cli_data_on_one_rank"]
    assert r.rc == 2 and r.seconds < BOUND, (r.rc, r.out[-3000:])
    assert r.out.count("fxpar-run: error:") == 1, r.out
    assert "fxpar-run: error: on rank 1: --data /nonexistent: no such folder" in r.out, r.out
    assert "step " not in r.out  # nobody trained


def test_fxpar_run_ranks_with_different_plans_stop_at_start_up(ran):
    r = ran["cli_plans_differ"]
    assert r.rc == 2 and r.seconds < BOUND, (r.rc, r.out[-3000:])
    assert r.out.count("fxpar-run: error:") == 1, r.out
    # rank 0 captures the model for both (fxpar.frontend.share), so the plans are compared
    # there, before the start-up check of the programs
    assert ("rank 1 compiles another plan than rank 0 (microbatches: 2 vs 4, rank 0's "
            "first): every rank must compile the same plan") in r.out, r.out


def test_same_seed_and_plan_are_bit_identical_across_runs(ran):
    for k in ("determinism0", "determinism1"):
        assert ran[k].rc == 0, ran[k].out[-3000:]
    first, second = json.loads(ran["_det"].out)
    assert sorted(first) == ["rank0.json", "rank1.json", "rank2.json"]
    for name, got in first.items():
        assert got["tensors"] >= 11  # parameters, BN buffers and gradients of its stages
        assert len(set(got["losses"])) == 3  # it trained: each step's loss differs
        assert second[name] == got, name  # digest of every tensor's bytes, and the losses


def test_a_caught_failure_and_sys_exit_still_end_the_job(ran):
    """Issue 23's hang: the script catches the failed step (SP2+PP, rank 2, step 2) and
    leaves with sys.exit(2); the program was marked failed, so leaving ends the job."""
    r = ran["caught_and_exits"]
    assert r.rc is not None, f"the job hung (killed after {TIMEOUT:.0f} s):\n{r.out[-3000:]}"
    assert r.rc != 0 and r.seconds < BOUND, (r.rc, r.seconds, r.out[-3000:])
    assert "[rank 2] caught ActionFailed; exiting with code 2" in r.out, r.out[-3000:]
    assert r.out.count("is leaving with a failed program") == 1, r.out[-3000:]
    assert "fxpar: rank 2 of 3 is leaving with a failed program (rank 2, step 2: " \
           "ActionFailed" in r.out, r.out[-3000:]


def test_closing_a_failed_program_ends_the_job(ran):
    r = ran["caught_and_closes"]
    assert r.rc is not None, f"the job hung (killed after {TIMEOUT:.0f} s):\n{r.out[-3000:]}"
    assert r.rc != 0 and r.seconds < BOUND, (r.rc, r.seconds, r.out[-3000:])
    assert "[rank 0] caught ActionFailed; going on" in r.out, r.out[-3000:]
    assert "fxpar: rank 0 of 3 is leaving with a failed program" in r.out, r.out[-3000:]


def test_a_rank_that_leaves_early_ends_the_job_naming_it(ran):
    r = ran["one_rank_stops_early"]
    assert r.rc is not None, f"the job hung (killed after {TIMEOUT:.0f} s):\n{r.out[-3000:]}"
    assert r.rc != 0 and r.seconds < BOUND, (r.rc, r.seconds, r.out[-3000:])
    assert "fxpar watchdog: rank 1 left the job (its process exited) after 1 step while " \
           "rank 0 is in step 2" in r.out, r.out[-3000:]


def test_a_nan_step_is_undone_on_every_rank_under_stop_and_skip(ran):
    """NaN injected on one tile (SP2+PP): under stop every rank raises NonFiniteError and the
    script goes on; under skip the step is dropped. Both end bit-identical (parameters,
    BatchNorm buffers, momentum, losses) to the job trained without that batch."""
    r = ran["nan_undone"]
    assert r.rc == 0, r.out[-3000:]
    assert json.loads(ran["_nan"].out) == ["rank0.ok", "rank1.ok", "rank2.ok"]


def test_a_stalled_rank_is_found_and_every_rank_says_where_it_is(ran):
    """FXPAR_FAULT=1:2:stall (a tile of SP2+PP sleeps in its step-2 forward) with the auto
    watchdog at a 4 s floor: a waiting rank's watchdog ends the job, listing every rank."""
    r = ran["stall_reported"]
    assert r.rc is not None, f"the job hung (killed after {TIMEOUT:.0f} s):\n{r.out[-3000:]}"
    assert r.rc != 0 and r.seconds < BOUND, (r.rc, r.seconds, r.out[-3000:])
    assert "[fxpar rank 1] FXPAR_FAULT=1:2:stall: stalling in step 2, action 0F0" in r.out
    # the limit is the 4 s floor, or 10 x the slowest step where a loaded machine made that
    # longer ("The limit was 4.18798 s (auto: 10 x the slowest step, 0.419 s, at least 4 s)")
    limit = re.search(r"The limit was ([0-9.]+) s \(auto", r.out)
    assert "fxpar watchdog: rank " in r.out and limit and float(limit[1]) >= 4, r.out
    report = r.out[r.out.index("Where every rank is:"):]
    assert "  rank 1: step 2, action 0F0: running " in report, report
    assert "not communicating" in report, report
    assert report.count(": waiting ") >= 1 and "<-- HERE" in report, report
    assert "no answer" not in report, report
