"""`make demo`: compile AmoebaNet-D for a plan and train a few steps under mpiexec."""

from __future__ import annotations

import os
import subprocess
import sys

from fxpar.testing import mpiexec


def main() -> int:
    ranks = 1
    cmd = [mpiexec(), "-n", str(ranks), sys.executable, "-m", "fxpar.cli.run",
           "models:amoebanet", "--num-layers", "3", "--num-filters", "32",
           "--image-size", "256", "--batch-size", "4", "--steps", "5"]
    print("$", " ".join(["mpiexec", *cmd[1:3], "fxpar-run", *cmd[6:]]), flush=True)
    return subprocess.call(cmd, env={**os.environ, "OMP_NUM_THREADS": "2"})


if __name__ == "__main__":
    sys.exit(main())
