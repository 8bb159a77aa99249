"""fxpar: compile an ordinary single-device CNN into per-rank programs for hybrid spatial,
layer, pipeline, bidirectional (GEMS) and data-parallel training under MPI."""

from fxpar.compiler.driver import compile, predict
from fxpar.compiler.predict import Prediction
from fxpar.core.plan import Plan, PlanError, RankMap
from fxpar.core.version import __version__
from fxpar.frontend.share import CaptureCache
from fxpar.frontend.trace import TraceError, analyze, trace
from fxpar.planner.planner import AutoPlan, plan_auto
from fxpar.program.loader import load as load_program
from fxpar.program.program import Program, RankProgram
from fxpar.runtime.guard import NonFiniteError, ProgramFailed
from fxpar.train.trainer import TrainConfig, Trainer

__all__ = ["compile", "plan_auto", "AutoPlan", "predict", "Prediction", "load_program", "Plan",
           "PlanError", "RankMap", "Program", "RankProgram", "TraceError", "analyze", "trace",
           "NonFiniteError", "ProgramFailed", "Trainer", "TrainConfig", "CaptureCache",
           "__version__"]

# Importing fxpar changes nothing in the process: the fail-fast exception hook (an uncaught
# exception on any rank ends the whole job) is installed by the rank programs made for MPI
# (Program.local, load_program) and fxpar-run, and put back when they close.
