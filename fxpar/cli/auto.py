"""``--plan auto`` (fxpar-run) and ``--auto`` (fxpar-inspect): let fxpar.plan_auto choose the
layout, keeping the options that are not layout (precision, channels_last, halo fusion,
checkpoint segments) as given.

fxpar-run ranks the plans on ``--profile`` when given, else on a profile of the machine the
job runs on (fxpar.planner.localprofile: cached, or measured now by every rank in a few
seconds); the report's first line says which. fxpar-inspect plans for ``--world-size`` ranks
it does not run on, so it keeps the shipped profile as its default."""

from __future__ import annotations

import argparse
import dataclasses

import torch
from torch import nn

from fxpar.comm.protocol import Comm
from fxpar.core.plan import Plan
from fxpar.perf.profile import Profile
from fxpar.planner.localprofile import NAME, cache_folder, local_profile
from fxpar.planner.planner import DEFAULT_PROFILE, AutoPlan, plan_auto

LAYOUT_FLAGS = {"stages": "--stages", "balance": "--balance", "microbatches": "--microbatches",
                "schedule": "--schedule", "stages_per_rank": "--stages-per-rank",
                "spatial_parts": "--spatial-parts",
                "grid": "--grid", "spatial_stages": "--spatial-stages", "gems": "--gems",
                "times": "--times", "data_parallel": "--data-parallel",
                "recompute": "--recompute"}
"""Plan options the planner chooses (argparse dest -> flag)."""


class AutoUsageError(ValueError):
    """--plan auto together with an option the planner chooses."""


def add_args(g: argparse._ActionsContainer, run: bool) -> None:
    """The planner's options (``run``: fxpar-run's ``--plan auto``, else fxpar-inspect's
    ``--auto``)."""
    if run:
        g.add_argument("--plan", choices=("auto",), default=None,
                       help="auto: choose the layout with the planner (fxpar.plan_auto) for "
                       "the ranks of this job and --memory-per-rank, ranked on --profile (by "
                       "default this machine's, measured once and cached)")
    else:
        g.add_argument("--auto", action="store_true",
                       help="search the plans of --world-size ranks (fxpar.plan_auto) and "
                       "print the top ones with predicted step and memory")
        g.add_argument("--world-size", type=int, default=None, metavar="N",
                       help="with --auto: ranks to plan for")
    g.add_argument("--max-stages", type=int, default=8, metavar="K",
                   help="with auto planning: most stages to try (default 8)")
    if run:
        g.add_argument("--profile", default=None, metavar="PROFILE",
                       help=f"with --plan auto: machine profile to rank plans on (an "
                       f"fxpar-calibrate JSON, or the shipped {DEFAULT_PROFILE}); default: "
                       f"'{NAME}', a profile of the hosts, ranks and threads of this job, "
                       f"read from FXPAR_PROFILE_CACHE (~/.cache/fxpar/profiles), or on the "
                       f"first run measured by every rank in a few seconds and kept there")


def check_no_layout(a: argparse.Namespace, defaults: dict[str, object]) -> None:
    """Raise when a layout option was given next to auto planning."""
    given = [flag for dest, flag in LAYOUT_FLAGS.items()
             if getattr(a, dest, None) not in (None, defaults.get(dest))]
    given = [f for f in given if not (f == "--recompute" and a.recompute == "never")]
    if given:
        raise AutoUsageError(f"the planner chooses {', '.join(given)}: drop "
                             f"{'it' if len(given) == 1 else 'them'}, or drop auto planning")


def choose(model: nn.Module, shape: tuple[int, ...], comm: Comm | None,
           a: argparse.Namespace, extra: Plan) -> tuple[Plan, AutoPlan]:
    """The planner's plan for ``model`` on the ranks of ``comm`` (None: this process alone)
    with the non-layout fields of ``extra``; and the search's result (for its report).
    Without ``--profile``, collective on ``comm`` (:func:`profile_of`)."""
    profile, note = profile_of(comm, a)
    found = plan_auto(model, torch.empty(shape, device="meta"),
                      comm.size if comm is not None else 1, a.memory_per_rank, profile,
                      max_stages=a.max_stages, check=False)
    found = dataclasses.replace(found, profile_note=note)
    plan = dataclasses.replace(found.plan, precision=extra.precision,
                               channels_last=extra.channels_last,
                               halo_fusion=extra.halo_fusion,
                               recompute_segments=extra.recompute_segments,
                               memory_per_rank=extra.memory_per_rank, compile=extra.compile)
    return plan, found


def profile_of(comm: Comm | None, a: argparse.Namespace) -> tuple[Profile | str, str]:
    """The profile to rank plans on, and a note for the report on where it came from:
    ``--profile``, else this machine's (fxpar.planner.localprofile.local_profile, collective
    on ``comm``) for the device the job computes on."""
    if a.profile is not None:
        return a.profile, f"--profile {a.profile}"
    gpu = getattr(a, "device", "cpu") != "cpu" and torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if gpu else torch.device("cpu")
    local = local_profile(comm, device, cache_folder())
    return local.profile, local.note
