"""A persistent pool of ranks that checks fuzzed cases: ``mpiexec -n 4 python worker.py``.

mpiexec forwards its stdin to rank 0. Rank 0 reads one JSON request per line
(``{"id": ..., "spec": ..., "plan": ...}``), broadcasts it, and every rank runs
``transparency.check`` on it (the plan's first ``world_size`` ranks take part, the others sit
it out). Each rank catches its own exception and prints the traceback at once (so it is in the
pool's output even when a peer then waits forever in a collective: the pytest side times the
request out and restarts the pool). Rank 0 gathers every rank's error text and prints one
``RESULT`` line. An empty line or the end of stdin ends the pool.
"""

from __future__ import annotations

import json
import sys
import time
import traceback
from contextlib import nullcontext
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/: the helpers package

import fxpar  # noqa: E402
from fxpar.comm.world import world  # noqa: E402
from helpers.fuzz.graphs import LOSSES, build, targets  # noqa: E402
from helpers.fuzz.pool import FAILED, READY, RESULT  # noqa: E402
from helpers.torchbugs import InstanceNormGradFix  # noqa: E402
from helpers.transparency import Case, check  # noqa: E402


def run(request: dict) -> str:
    """Check one case on this rank; the traceback, or "" when it passed here."""
    spec = request["spec"]
    shape = (spec["batch"], spec["channels"], *spec["size"])
    try:
        seg = spec["head"] == "seg"
        check(Case(lambda: build(spec), shape, fxpar.Plan(**request["plan"]),
                   classes=spec["classes"], segmentation=seg,
                   loss=LOSSES[spec["loss"]] if seg else None,
                   targets=targets(spec) if seg else None,
                   reference_mode=InstanceNormGradFix if request.get("fix_torch")
                   else nullcontext))
    except BaseException:  # noqa: BLE001 - every failure is a result to report
        return traceback.format_exc()
    return ""


def idle_until_all_arrive() -> None:
    """A barrier that sleeps instead of spinning: MPICH busy-polls in blocking collectives, and
    on a 2-core machine ranks waiting for rank 0's next request (or sitting out a case for a
    smaller plan) would take the CPU from the ranks doing the work."""
    from mpi4py import MPI

    request = MPI.COMM_WORLD.Ibarrier()
    while not request.Test():
        time.sleep(0.002)


def main() -> None:
    comm = world()
    if comm.rank == 0:
        print(READY, flush=True)
    while True:
        line = sys.stdin.readline() if comm.rank == 0 else None
        idle_until_all_arrive()
        line = comm.bcast_object(line)
        if not line or not line.strip():
            break
        request = json.loads(line)
        start = time.perf_counter()
        error = run(request)
        if error:
            print(f"{FAILED}{request['id']} on rank {comm.rank}:\n{error}", flush=True)
        idle_until_all_arrive()
        errors = comm.gather_object(error)
        if comm.rank == 0:
            assert errors is not None
            print(RESULT + json.dumps({"id": request["id"],
                                       "seconds": round(time.perf_counter() - start, 3),
                                       "errors": {r: e for r, e in enumerate(errors) if e}}),
                  flush=True)


if __name__ == "__main__":
    main()
