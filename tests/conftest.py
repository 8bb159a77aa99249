"""Make tests/ importable (equivalence helpers) from test modules and MPI case files."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
