"""`make demo`: a real spatial + pipeline job on 5 ranks (CPU): AmoebaNet-D at 256x256,
stage 0 on a 2x2 tile grid (4 ranks), stage 1 on one rank, 2 micro-batches."""

from __future__ import annotations

import os
import subprocess
import sys

from fxpar.testing import mpiexec


def main() -> int:
    args = ["models:amoebanet", "--num-layers", "3", "--num-filters", "32",
            "--image-size", "256", "--batch-size", "4", "--steps", "5",
            "--split-size", "2", "--num-spatial-parts", "4", "--slice-method", "square",
            "--parts", "2"]
    cmd = [mpiexec(), "-n", "5", sys.executable, "-m", "fxpar.cli.run", *args]
    print("$ mpiexec -n 5 fxpar-run " + " ".join(args), flush=True)
    return subprocess.call(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"})


if __name__ == "__main__":
    sys.exit(main())
