"""fxpar-calibrate under a real mpiexec (run by tests/mpi/test_programs.py, 4 ranks): every rank
takes part, rank 0 gets a complete profile whose links and tile-op cost were measured (the
rates themselves are this machine's; tests/unit/test_costmodel.py checks the fits against known
costs). And fxpar-run --plan auto's profile of the machine it runs on, measured by 2 ranks
together and then read from its cache (tests/unit/test_localprofile.py: the rest, faked)."""

import contextlib
import io
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from helpers.transparency import sub_comm

from fxpar.cli.calibrate import main
from fxpar.cli.run import main as fxpar_run
from fxpar.comm.world import world
from fxpar.perf.profile import Profile
from fxpar.planner.calibrate import LOCAL
from fxpar.planner.localprofile import NAME, local_profile

CPU = torch.device("cpu")
DRIVER = Path(__file__).with_name("driver_cases.py")


def case_calibrate_quick_writes_a_measured_profile():
    comm = world()
    folder = comm.bcast_object(tempfile.mkdtemp(prefix="fxpar-cal-") if comm.rank == 0
                               else None)
    out = Path(folder) / "p.json"
    assert main(["--quick", "--out", str(out), "--name", "ci"]) == 0
    comm.barrier()
    p = Profile.load(out)
    assert p.name == "ci" and p.slots_per_node >= 1 and p.ranks_per_node >= comm.size
    assert p.conv_flops > 0 and p.mem_bytes > 0 and p.norm_bytes > 0 and p.dwconv_flops > 0
    assert p.p2p_intra.alpha > 0 and p.allreduce_intra.alpha > 0, p.to_json()
    assert p.tile_op_s > 0, p.measured["tile_ops"]
    data = json.loads(out.read_text())
    assert len(data["measured"]["p2p_points"]) == 5


def case_local_profile_two_ranks_calibrate_together_then_hit_the_cache():
    """fxpar-run --plan auto without --profile (fxpar.planner.localprofile): 2 ranks with an
    empty cache folder measure this machine together, both get rank 0's profile, rank 0 keeps
    it; the next time (the library call, then fxpar-run itself) it is read from the folder."""
    comm = sub_comm(2)
    if comm is None:
        return
    scratch = Path(comm.bcast_object(tempfile.mkdtemp(prefix="fxpar-lp-") if comm.rank == 0
                                     else None))
    folder = scratch / "profiles"
    first = local_profile(comm, CPU, folder)
    assert first.note.startswith("calibrated now in "), first.note
    both = comm.allgather_object(first.profile.to_json())
    assert both[0] == both[1]  # every rank plans on the same figures
    p = first.profile
    assert p.name == NAME and p.measured["machine"]["ranks"] == 2, p.measured["machine"]
    assert p.p2p_intra.alpha > 0 and p.allreduce_intra.alpha > 0 and p.tile_op_s > 0
    assert p.measured["effort"]["layers"] == LOCAL.layers
    if comm.rank == 0:
        files = os.listdir(folder)
        assert len(files) == 1 and files[0].startswith("cpu-2r-"), files
        assert f"cached in {folder / files[0]}" in first.note, first.note
        assert Profile.load(folder / files[0]) == p
    comm.barrier()
    again = local_profile(comm, CPU, folder)
    assert again.profile == p and again.note.startswith("cached"), again.note
    if comm.rank == 0:  # the rank that read the file names it
        assert again.note.startswith(f"cached in {folder}/cpu-2r-"), again.note
    argv = [f"{DRIVER}:tiny_net", "--num-classes", "3", "--image-size", "20", "--batch-size",
            "4", "--steps", "1", "--plan", "auto", "--device", "cpu"]
    out = io.StringIO()
    before = os.environ.get("FXPAR_PROFILE_CACHE")
    os.environ["FXPAR_PROFILE_CACHE"] = str(folder)
    try:
        with contextlib.redirect_stdout(out):
            assert fxpar_run(argv, comm=comm) == 0
    finally:
        if before is None:
            del os.environ["FXPAR_PROFILE_CACHE"]
        else:
            os.environ["FXPAR_PROFILE_CACHE"] = before
    if comm.rank == 0:
        assert f"plan search: 2 rank(s), memory per rank no limit, profile '{NAME}' (cached in " \
            f"{folder}/cpu-2r-" in out.getvalue(), out.getvalue()
    comm.barrier()
    if comm.rank == 0:
        shutil.rmtree(scratch, ignore_errors=True)
