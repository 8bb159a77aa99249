"""The pytest side of the fuzz pool: one ``mpiexec`` launch that checks many cases.

Starting ``mpiexec -n 4`` costs seconds of ``import torch`` per rank, so one launch serves every
hypothesis example (shrinking included): :meth:`Pool.check` writes one JSON request to the
pool's stdin and waits, with a timeout, for its result line. A pool that died, or that did not
answer in time (a rank stuck in a collective because a peer raised), is killed with its whole
process group, the example fails with what the pool printed, and the next request starts a
fresh pool. Nothing waits without a timeout.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fxpar.testing import mpiexec

WORKER = Path(__file__).with_name("worker.py")
READY = "FXPAR-FUZZ-READY"
RESULT = "FXPAR-FUZZ-RESULT "
FAILED = "FXPAR-FUZZ-FAILED "
GRACE = 5.0
"""Seconds to wait for a result once some rank reported an exception."""


@dataclass(frozen=True)
class Outcome:
    """One case's result across the pool's ranks."""

    passed: bool
    report: str
    """Every failing rank's traceback, or why the pool gave no answer, and what it printed."""
    seconds: float = 0.0
    """Wall time of the check on rank 0."""


class Pool:
    """``mpiexec -n ranks python worker.py``, started on first use and after a failure.

    timeout: seconds one case may take. recycle: start a fresh pool after this many cases
    (every case makes MPI communicators that are never freed, and MPI has a finite number)."""

    def __init__(self, ranks: int = 4, timeout: float = 60.0, start_timeout: float = 180.0,
                 recycle: int = 200) -> None:
        self.ranks = ranks
        self.timeout = timeout
        self.start_timeout = start_timeout
        self.recycle = recycle
        self.starts = 0
        self.start_seconds = 0.0
        self._proc: subprocess.Popen[str] | None = None
        self._lines: queue.Queue[str | None] = queue.Queue()
        self._served = 0
        self._next_id = 0

    def _start(self) -> None:
        # a deadlocked case ends the pool at once, saying where each rank waited, instead of
        # running into the timeout (shrinking a hang would otherwise take minutes)
        # FXPAR_POLL: waiting ranks sleep instead of spinning on cores the others need
        env = {"FXPAR_POLL": "0.0005", **os.environ, "OMP_NUM_THREADS": "1",
               "PYTHONUNBUFFERED": "1", "FXPAR_WATCHDOG": f"{max(10.0, self.timeout / 3):g}"}
        began = time.monotonic()
        self._proc = subprocess.Popen(
            [mpiexec(), "-n", str(self.ranks), sys.executable, str(WORKER)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            env=env, start_new_session=True, bufsize=1)
        self._lines = queue.Queue()
        threading.Thread(target=self._read, args=(self._proc, self._lines), daemon=True).start()
        self.starts += 1
        self._served = 0
        found, log = self._wait(lambda line: line.startswith(READY), self.start_timeout)
        self.start_seconds += time.monotonic() - began
        if found is None:
            self.close()
            raise RuntimeError(f"the fuzz pool did not start within {self.start_timeout:.0f} s "
                               f"(`{mpiexec()} -n {self.ranks} python {WORKER}`):\n{log}")

    @staticmethod
    def _read(proc: subprocess.Popen[str], lines: queue.Queue[str | None]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)

    def _wait(self, match: Any, timeout: float, failed: str = "") -> tuple[str | None, str]:
        """The first output line ``match`` accepts (None at a timeout or the pool's end) and
        every line before it. Once a line starts with ``failed`` (a rank reporting its
        exception), wait only ``GRACE`` seconds more: its peers may be stuck waiting for it."""
        deadline = time.monotonic() + timeout
        log: list[str] = []
        while True:
            try:
                line = self._lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                log.append(f"[no answer within {timeout:.0f} s, or {GRACE:.0f} s after a rank "
                           f"failed: ranks left waiting for a failed peer]\n")
                return None, "".join(log)
            if line is None:
                code = self._proc.wait() if self._proc is not None else None
                log.append(f"[the pool ended, exit code {code}]\n")
                return None, "".join(log)
            if failed and line.startswith(failed):
                deadline = min(deadline, time.monotonic() + GRACE)
            if match(line):
                return line, "".join(log)
            log.append(line)

    def check(self, spec: dict[str, Any], plan: dict[str, Any],
              timeout: float | None = None, fix_torch: bool = False) -> Outcome:
        """Run ``transparency.check`` on the case; never waits longer than ``timeout`` (default:
        the pool's). ``fix_torch``: the reference trains under the fixes of
        tests/helpers/torchbugs.py."""
        if self._proc is not None and self._served >= self.recycle:
            self.close()
        if self._proc is None:
            self._start()
        assert self._proc is not None and self._proc.stdin is not None
        self._next_id += 1
        tag = self._next_id
        self._served += 1
        try:
            self._proc.stdin.write(json.dumps({"id": tag, "spec": spec, "plan": plan,
                                              "fix_torch": fix_torch}) + "\n")
            self._proc.stdin.flush()
        except OSError as e:  # the pool died between cases
            self.close()
            return Outcome(False, f"the fuzz pool was gone: {e}")
        found, log = self._wait(
            lambda line: line.startswith(RESULT) and json.loads(line[len(RESULT):])["id"] == tag,
            timeout or self.timeout, f"{FAILED}{tag} ")
        if found is None:
            self.close(wait=False)  # a rank may be stuck in a collective: start afresh
            return Outcome(False, f"no result from the pool:\n{log[-6000:]}")
        result = json.loads(found[len(RESULT):])
        errors = result["errors"]
        report = "\n".join(f"--- rank {r} ---\n{e}" for r, e in errors.items())
        return Outcome(not errors, report, float(result["seconds"]))

    def close(self, wait: bool = True) -> None:
        """End the pool: politely (end of stdin) when ``wait``, then by killing its process
        group."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        try:
            assert proc.stdin is not None
            proc.stdin.close()
            proc.wait(timeout=5 if wait else 0.1)
        except (OSError, subprocess.TimeoutExpired):
            pass
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
