"""`make demo`: a real spatial + pipeline job on 5 ranks (CPU): AmoebaNet-D at 256x256,
stage 0 on a 2x2 tile grid (4 ranks), stage 1 on one rank, 2 micro-batches, 5 steps (two
normal cells and lr 0.003 keep it well under a minute on 2 cores, with a falling loss).

fxpar-run prints a progress line per step, then the per-rank table (stage, tile, peak memory,
compute vs communication time) and writes the same as JSON (``--metrics``), which
``fxpar-inspect --timeline FILE.png --from-metrics FILE`` draws as a Gantt chart."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

from fxpar.testing import mpiexec

RANKS = 5
ARGS = ["models:amoebanet", "--num-layers", "2", "--num-filters", "32", "--image-size", "256",
        "--batch-size", "4", "--split-size", "2", "--num-spatial-parts", "4", "--slice-method",
        "square", "--parts", "2", "--lr", "0.003"]
"""The demo's fxpar-run arguments, without --steps and --metrics (tools/bench_compile.py times
its compile)."""


def main() -> int:
    metrics = Path(tempfile.gettempdir()) / "fxpar-demo-metrics.json"
    args = [*ARGS, "--steps", "5", "--metrics", str(metrics)]
    cmd = [mpiexec(), "-n", str(RANKS), sys.executable, "-m", "fxpar.cli.run", *args]
    print(f"$ mpiexec -n {RANKS} fxpar-run " + " ".join(args), flush=True)
    code = subprocess.call(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if code == 0:
        print(f"timeline: fxpar-inspect --timeline demo.png --from-metrics {metrics}")
    return code


if __name__ == "__main__":
    sys.exit(main())
