"""fxpar: compile an ordinary single-device CNN into per-rank programs for hybrid spatial,
layer, pipeline, bidirectional (GEMS) and data-parallel training under MPI."""

from fxpar import failfast
from fxpar.compiler import compile
from fxpar.emit import load as load_program
from fxpar.plan import Plan, PlanError, RankMap
from fxpar.program import Program, RankProgram
from fxpar.trace import TraceError, analyze, trace

__all__ = ["compile", "load_program", "Plan", "PlanError", "RankMap", "Program", "RankProgram",
           "TraceError", "analyze", "trace"]
__version__ = "0.1.0"

failfast.install()  # under mpiexec -n >1: an uncaught exception on any rank ends the whole job
