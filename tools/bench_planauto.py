"""Benchmark section ``planauto``: `--plan auto` without `--profile` (issue 39). On 2 ranks,
ResNet-18 at 128² with a batch of 8: what the planner chooses on the profile it measures of this
machine (``fxpar.planner.localprofile.local_profile``, the CLI's path when no ``--profile`` is
given, measured afresh in every launch: no cache) against the best of 8 hand plans, all trained
in the same launch (tools/bench_planner.py's worker, ``--local-auto``). Run through
``tools/bench.py --only planauto``."""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib  # noqa: E402

TITLE = "--plan auto without --profile: the planner on this machine's own profile"
MODEL = ("torchvision:resnet18", {"num_classes": 10})
IMAGE, BATCH, AIM = 128, 8, 0.05
HAND = {  # name -> Plan fields, all on 2 ranks
    "DP2": {"data_parallel": 2},
    "SP2 vertical": {"spatial_parts": 2, "slice": "vertical"},
    "LP2": {"stages": 2},
    "PP2 m2 1f1b": {"stages": 2, "microbatches": 2, "schedule": "1f1b"},
    "PP2 m4 1f1b": {"stages": 2, "microbatches": 4, "schedule": "1f1b"},
    "PP2 m8 1f1b": {"stages": 2, "microbatches": 8, "schedule": "1f1b"},
    "GEMS LP2": {"stages": 2, "gems": True},
    "GEMS m2 1f1b": {"stages": 2, "gems": True, "microbatches": 2, "schedule": "1f1b"},
}
CHOSEN = "planner (this machine's profile)"


def build(meta: bool = False) -> Any:
    from fxpar.models.zoo import build_model

    spec, kw = MODEL
    return build_model(spec, meta=meta, **kw)


def fields_of(plan: Any) -> dict[str, Any]:
    """``plan``'s fields that differ from ``Plan()``'s (the JSON a worker's ``--plans`` takes)."""
    import fxpar

    default = fxpar.Plan().to_json()
    return {k: v for k, v in plan.to_json().items() if v != default[k]}


def choose(comm: Any) -> tuple[dict[str, Any], str, str]:
    """Every rank: the profile `fxpar-run --plan auto` ranks on without --profile
    (``fxpar.cli.auto.profile_of``: this machine's, measured now: the launch sets
    FXPAR_PROFILE_CACHE=off) and the planner's plan on it; the plan's non-default fields, its
    description and the profile's note."""
    from types import SimpleNamespace

    import fxpar
    from fxpar.cli.auto import profile_of
    from fxpar.planner.planner import describe

    profile, note = profile_of(comm, SimpleNamespace(profile=None, device="cpu"))
    found = fxpar.plan_auto(build(meta=True), (BATCH, 3, IMAGE, IMAGE), comm.size, None,
                            profile)
    return fields_of(found.plan), describe(found.plan), note


def launch(opts: Any, k: int) -> dict[str, Any]:
    """One launch (round ``k``): the planner's choice on a fresh profile, then it and the hand
    plans trained in turn (order rotated by round)."""
    order = dict(benchlib.rotate(list(HAND.items()), k))
    args = ["--worker", "--local-auto", "--model", "resnet18", "--plans", json.dumps(order),
            "--image", str(IMAGE), "--batch", str(BATCH), "--steps", str(opts.planauto_steps)]
    env = {**benchlib.thread_env(1), "FXPAR_PROFILE_CACHE": "off"}  # a first run's calibration
    return benchlib.measure(benchlib.worker_command("bench_planner.py", args, 2), env,
                            retries=opts.retries, max_foreign=opts.max_foreign,
                            timeout=opts.timeout)


def section_parts(records: list[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The table and the aim from the launches' records (each: ``step_s`` per plan, the
    chosen plan's description, its equal hand plan if any, the profile note)."""
    rows, ratios = [], []
    for k, rec in enumerate(records, 1):
        steps = rec["step_s"]
        best = min(HAND, key=lambda n: steps[n])
        ratio = steps[CHOSEN] / steps[best]
        ratios.append(ratio)
        same = f" (= {rec['same']})" if rec.get("same") else ""
        rows.append([str(k), rec["chosen"] + same, f"{steps[CHOSEN]:.3f}", best,
                     f"{steps[best]:.3f}", f"{ratio:.3f}", rec["note"]])
    r = benchlib.spread(ratios)
    met = r["median"] <= 1 + AIM
    table = {"title": "`--plan auto` without `--profile`: ResNet-18 128² b8 on 2 ranks, the "
                      "planner's choice on a profile of this machine measured in the launch, "
                      "against the best of 8 hand plans trained in the same launch",
             "columns": ["launch", "planner's choice", "its step s", "best hand plan",
                         "its step s", "choice / best", "profile"], "rows": rows}
    aim = {"what": "`--plan auto` without `--profile` (this machine's profile): choice / best "
                   "of 8 hand plans, ResNet-18 128² b8, 2 ranks",
           "aim": f"<= {1 + AIM:.2f}", "measured": benchlib.fmt_spread(r, "", 3), "met": met,
           "why": None if met else
           "the profile's calibration is a few seconds on a shared core (the table's choices)"}
    return table, aim


def median_steps(records: list[dict[str, Any]]) -> dict[str, float]:
    """Per plan, the median step over the launches (for the raw data)."""
    names = records[0]["step_s"] if records else {}
    return {n: statistics.median(r["step_s"][n] for r in records) for n in names}


def add_args(parser: Any) -> None:
    parser.add_argument("--planauto-steps", type=int, default=3, help="timed steps per plan")


def run(opts: Any) -> dict[str, Any]:
    rounds = 1 if getattr(opts, "quick", False) else opts.rounds
    records = []
    for k in range(rounds):
        benchlib.progress("planauto", k + 1, rounds, "calibrate, choose, train 9 plans")
        records.append(launch(opts, k))
    table, aim = section_parts(records)
    method = (f"`mpiexec -n 2`, 1 thread per rank, torchvision resnet18 (10 classes), batch "
              f"{BATCH} at {IMAGE}x{IMAGE}, float32, SGD momentum 0.9. Each of {rounds} "
              f"launch(es), after a quiet spell: every rank measures this machine's profile "
              f"together (`local_profile`, the calibration `fxpar-run --plan auto` runs when "
              f"no --profile is given and nothing is cached; here never cached), "
              f"`fxpar.plan_auto` chooses on it, then the choice and the 8 hand plans each "
              f"compile, run 1 warm-up and {opts.planauto_steps} timed steps (the slowest "
              f"rank's median), in an order rotated per launch. When the choice is one of the "
              f"hand plans it is still trained as its own entry: the ratio then shows two runs "
              f"of one plan.")
    return {"name": "planauto", "title": TITLE, "method": method, "tables": [table],
            "plots": [], "aims": [aim], "notes": "",
            "raw": {"launches": records, "median_step_s": median_steps(records)}}


def main(argv: list[str] | None = None) -> int:
    return benchlib.standalone(__doc__.split("\n\n")[0], add_args, run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
