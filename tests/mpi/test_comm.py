"""Comm over mpi4py and the mpiexec harness, on 3 real ranks."""

from pathlib import Path

import pytest
from helpers.launch import PATHS

from fxpar.testing import run_cases

HERE = Path(__file__).parent / "cases" / "comm_cases.py"
CASES = [f"{HERE}::{n}" for n in ("case_p2p_ring", "case_recv_lands_in_place",
                                  "case_collectives", "case_subcommunicators",
                                  "case_device_paths", "case_one_host_read_per_step")]

pytestmark = pytest.mark.mpi


@pytest.fixture(scope="module")
def results():
    return run_cases(CASES, n=3, timeout=240, pythonpath=PATHS)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.split("::")[1])
def test_comm(results, case):
    results[case].check()


def test_failing_rank_ends_the_job_with_its_traceback():
    """A rank that raises must end the job (its peer is blocked in a receive) and the report
    must carry that rank's traceback; the case after it runs in a fresh launch, with its own
    verdict."""
    failing = f"{HERE}::case_fails_on_rank_1"
    later = f"{HERE}::case_collectives"
    res = run_cases([failing, later], n=2, timeout=60, pythonpath=PATHS)
    assert not res[failing].passed
    assert "injected failure on rank 1" in res[failing].report
    assert "--- rank 1 ---" in res[failing].report
    assert res[later].passed, res[later].report
    with pytest.raises(AssertionError, match="injected failure"):
        res[failing].check()


def test_hung_job_is_killed_at_the_timeout():
    """Both ranks wait for a message nobody sends: the harness kills the job at the timeout."""
    # 20 s: both ranks must have started (imports under load)
    res = run_cases([f"{Path(__file__).parent / 'cases' / 'hang_cases.py'}::case_hang"], n=2,
                    timeout=20, pythonpath=PATHS)
    (only,) = res.values()
    assert not only.passed
    assert "timeout" in only.report and "ranks that started it: [0, 1]" in only.report


def test_an_interrupted_launch_leaves_no_rank_running():
    """pytest-timeout (or Ctrl-C) interrupting ``run_cases`` must take the job's ranks with it:
    a hung launch left running burns cores for the rest of the suite."""
    import signal
    import subprocess

    hang = f"{Path(__file__).parent / 'cases' / 'hang_cases.py'}::case_hang"

    def interrupt(*_):
        raise KeyboardInterrupt

    before = signal.signal(signal.SIGALRM, interrupt)
    signal.alarm(15)
    try:
        with pytest.raises(KeyboardInterrupt):
            run_cases([hang], n=2, timeout=300, pythonpath=PATHS)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, before)
    left = subprocess.run(["pgrep", "-f", "hang_cases.py::case_hang"], capture_output=True,
                          text=True).stdout.split()
    assert not left, f"ranks still running: {left}"


def test_failure_after_the_peers_exited_is_still_a_failure():
    """MPI_Abort may return when no peer is left to end: the rank must still exit non-zero and
    the case must not be reported as passed."""
    late = f"{HERE}::case_fails_after_peers_left"
    res = run_cases([late], n=2, timeout=60, pythonpath=PATHS)[late]
    assert not res.passed
    assert "injected late failure on rank 0" in res.report
