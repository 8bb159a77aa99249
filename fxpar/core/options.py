"""Every setting fxpar reads from the environment, declared once: :data:`OPTIONS`.

One entry per option: its variable, the value it has when unset, and what it does. Code reads an
option when it needs it, through :func:`setting` (never at import time, so a test or a script
that sets a variable before using fxpar is heard), and parses it where the feature lives (the
NaN policy in fxpar.runtime.guard, faults in fxpar.core.faults, the watchdog's limit in
fxpar.comm.watchdog). An explicit argument wins over the environment: ``world(backend=...)``,
``Comm(poll=...)``, ``set_watchdog``, ``fxpar-run --nonfinite`` / ``--watchdog``.
``docs/options.md`` is rendered from this table (tools/options_doc.py; tests/unit check it).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class Option:
    """One environment setting."""

    env: str
    """The variable (``FXPAR_...``)."""
    default: str
    """Its value when unset, as written in the environment ("" for none)."""
    values: str
    """What may be written, for the docs."""
    doc: str
    """What it does."""


OPTIONS: dict[str, Option] = {
    "comm": Option(
        "FXPAR_COMM", "", "mpi | torch",
        "The communication backend of `world()`: mpi4py, or torch.distributed (NCCL "
        "collectives on GPUs, gloo on CPU); unset: the launcher decides (torch.distributed "
        "under torchrun, MPI under mpiexec and srun)."),
    "mpiexec": Option(
        "FXPAR_MPIEXEC", "", "path",
        "The mpiexec fxpar.testing launches test cases with (a system Open MPI or the site's "
        "MPI); unset: the one beside this Python (pip's mpich), else the one on PATH."),
    "torch_backend": Option(
        "FXPAR_TORCH_BACKEND", "", "nccl | gloo",
        "torch.distributed's backend under FXPAR_COMM=torch; unset: nccl when the rank has a "
        "GPU, else gloo."),
    "torch_timeout": Option(
        "FXPAR_TORCH_TIMEOUT", "600", "seconds",
        "How long torch.distributed waits for a collective before it fails."),
    "p2p": Option(
        "FXPAR_P2P", "", "nccl | staged | issue",
        "How point-to-point messages of GPU tensors travel under torch.distributed "
        "(torchrun, FXPAR_COMM=torch): unset or nccl: NCCL send/recv, device to device, each "
        "pair's messages issued in the order both ends agree on (fxpar.core.wire); staged: "
        "through pinned host buffers over gloo, matched by tag. issue: gloo too ignores tags "
        "and matches messages in issue order, as NCCL does (tests that order on CPU)."),
    "cuda_aware": Option(
        "FXPAR_CUDA_AWARE", "", "1 | 0",
        "Whether the MPI takes CUDA buffers; unset: asked from the MPI library "
        "(MPIX_Query_cuda_support). 0 stages device tensors through pinned host buffers."),
    "force_staging": Option(
        "FXPAR_FORCE_STAGING", "0", "1 | 0",
        "1: CPU tensors too go through the host staging buffers (tests the GPU path without "
        "a GPU)."),
    "poll": Option(
        "FXPAR_POLL", "off", "seconds | off",
        "A rank waiting for a message or a collective tests it every this many seconds and "
        "sleeps in between, instead of MPI's busy wait: for more ranks than cores (the test "
        "harness sets 0.0005). off: MPI's own wait, as on a cluster."),
    "failfast": Option(
        "FXPAR_FAILFAST", "1", "1 | 0",
        "1: an uncaught exception on any rank ends the whole job (MPI_Abort) after printing "
        "its traceback; 0: leave Python's hooks alone."),
    "watchdog": Option(
        "FXPAR_WATCHDOG", "auto", "auto | auto:FLOOR | seconds | 0",
        "A rank stuck longer than this in one communication call reports what every rank "
        "waits for and ends the job: auto scales with the slowest step seen (auto:FLOOR sets "
        "its least seconds), a number is fixed seconds, 0 turns it off. fxpar-run --watchdog "
        "wins."),
    "nonfinite": Option(
        "FXPAR_NONFINITE", "stop", "stop | skip | off",
        "What a NaN or inf in a step's loss, gradients or buffers does: stop (undo the step, "
        "end the job naming the step and ranks), skip (undo it on every rank and go on), off "
        "(no check). fxpar-run --nonfinite wins."),
    "fault": Option(
        "FXPAR_FAULT", "", "RANK:STEP:KIND[:ARG],...",
        "Faults to inject, to test recovery: raise, caught-raise, sigkill, stall, nan-loss, "
        "slow-rank or corrupt-checkpoint on RANK at STEP (docs/failures.md); unset: none."),
    "capture_cache": Option(
        "FXPAR_CAPTURE_CACHE", "", "folder",
        "Keep each model capture (torch.export) in this folder and reuse it in later "
        "processes that compile a model of the same structure, code and input shape "
        "(fxpar.frontend.capture_store); unset: every process captures its model."),
    "profile_cache": Option(
        "FXPAR_PROFILE_CACHE", "", "folder | off",
        "Where `fxpar-run --plan auto` without --profile keeps the profile it measures of the "
        "machine and job shape it runs on (a few seconds' calibration, "
        "fxpar.planner.localprofile), one file each, for the next run; a folder writable by "
        "others is not used. unset: $XDG_CACHE_HOME/fxpar/profiles (~/.cache/fxpar/profiles); "
        "off: measure every run, keep nothing."),
    "halo_window": Option(
        "FXPAR_HALO_WINDOW", "0", "1 | 0",
        "1: every halo convolution assembles its whole input window first (the path before "
        "the split interior/border convolution; tools/bench_spatial.py compares them)."),
    "predict_overlap": Option(
        "FXPAR_PREDICT_OVERLAP", "1", "1 | 0",
        "1: fxpar.predict reads the next batch of regions in a reader thread and writes the "
        "last one in a writer thread while a batch computes (fxpar.compiler.predict_pipeline); "
        "0: the main thread reads, computes and writes in turn (for debugging and timing)."),
}
"""Option name -> its declaration, in the order the docs list them."""


def setting(name: str, environ: Mapping[str, str] | None = None) -> str:
    """The value of option ``name`` now: the environment's (``environ``, default
    ``os.environ``), else its declared default."""
    option = OPTIONS[name]
    env = os.environ if environ is None else environ
    return env.get(option.env, option.default)


def flag(name: str, environ: Mapping[str, str] | None = None) -> bool:
    """A 1/0 option as a bool ("" and "0" are off)."""
    return setting(name, environ) not in ("", "0")
