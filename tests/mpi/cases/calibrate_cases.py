"""fxpar-calibrate under a real mpiexec (run by tests/mpi/test_programs.py, 4 ranks): every rank
takes part, rank 0 gets a complete profile whose links and tile-op cost were measured (the
rates themselves are this machine's; tests/unit/test_costmodel.py checks the fits against known
costs)."""

import json
import tempfile
from pathlib import Path

from fxpar.cli.calibrate import main
from fxpar.comm.world import world
from fxpar.perf.profile import Profile


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
