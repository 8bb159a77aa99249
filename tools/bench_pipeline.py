"""Benchmark (by hand, not in CI): fxpar's pipeline schedules (gpipe, 1f1b, zero_bubble,
interleaved_1f1b, zero_bubble_v) vs torch.distributed.pipelining's (ScheduleGPipe, Schedule1F1B,
ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble) on torchvision
resnet18, batch 32 at 128x128, CPU, one thread per rank, at 2 ranks and at 4 ranks (more ranks
than this VM's 2 cores: oversubscribed, said so in the output); and fxpar's measured pipeline
bubble per schedule against the simulator's and the textbook formula's.

All systems get the same model and seed, the same stage cut (``pipeline_workers.CUTS``: 2, 4
or 8 stages, starting at resnet18's layers or blocks), the same micro-batches and one compute
thread per rank, under the same launcher (``mpiexec -n RANKS``); only the transport differs:
fxpar talks MPI (mpi4py over the MPICH wheel, shared memory), torch talks gloo (TCP over
loopback). A torch schedule that fails is dropped with its error in the output.

A section of the suite (``tools/benchlib.py`` has the contract; ``tools/bench.py`` renders
docs/benchmarks.md). Alone, it prints the Section JSON::

    .venv/bin/python tools/bench_pipeline.py --quick --retries 0 --max-foreign 2
    .venv/bin/python tools/bench_pipeline.py --rounds 5 --pipeline-rev HEAD

The workers are ``tools/pipeline_workers.py`` (``--worker SYSTEM``, which this script also
accepts); the summaries ``tools/pipeline_report.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from benchlib import (
    ROOT,
    interleave,
    machine,
    measure,
    nested,
    snapshot,
    thread_env,
    worker_command,
)
from pipeline_report import (
    aim_row,
    bubble_plot,
    bubble_rows,
    disturbed,
    launch_bubble,
    notes,
    pairs_table,
    same_cut,
    summarize,
    throughput_plot,
    throughput_table,
)
from pipeline_workers import BATCH, CLASSES, CUTS, IMAGE, SEED, SYSTEMS, worker

TITLE = "Pipeline schedules: fxpar vs torch.distributed.pipelining, and the bubble"


@dataclass(frozen=True)
class Config:
    """The run's settings after ``--quick`` has been applied."""

    rounds: int
    warmup: int
    steps: int
    microbatches: int
    ranks: tuple[int, ...]
    systems: tuple[str, ...]
    bubble_ms: tuple[int, ...]
    bubble_rounds: int
    threads: int
    max_foreign: float
    retries: int
    timeout: float
    rev: str


def add_args(parser: argparse.ArgumentParser) -> None:
    """This section's options (the suite's common ones are --rounds, --quick, ...)."""
    g = parser.add_argument_group("pipeline")
    g.add_argument("--pipeline-ranks", default="2,4",
                   help="comma-separated pipeline widths (ranks), each a configuration")
    g.add_argument("--pipeline-systems", default=",".join(SYSTEMS),
                   help=f"comma-separated, of {', '.join(SYSTEMS)}")
    g.add_argument("--pipeline-microbatches", type=int, default=4,
                   help="micro-batches of the comparison")
    g.add_argument("--pipeline-warmup", type=int, default=2, help="untimed steps per launch")
    g.add_argument("--pipeline-steps", type=int, default=5, help="timed steps per launch")
    g.add_argument("--pipeline-threads", type=int, default=1, help="intra-op threads per rank")
    g.add_argument("--pipeline-bubble-microbatches", default="1,2,4,8",
                   help="comma-separated m of the bubble sweep of fxpar's schedules at the "
                   "first --pipeline-ranks (quick: 2)")
    g.add_argument("--pipeline-bubble-rounds", type=int, default=3,
                   help="launches per (schedule, m) of the bubble sweep, at most --rounds")
    g.add_argument("--pipeline-rev", default="", help="measure this commit (git archive to a "
                   "temporary folder) instead of the working tree")


def config(opts: argparse.Namespace) -> Config:
    """``opts`` with this section's defaults for what the caller did not set."""
    p = argparse.ArgumentParser(add_help=False)
    add_args(p)
    o = {**vars(p.parse_args([])), **vars(opts)}
    ints = (lambda s: tuple(int(v) for v in str(s).split(",") if v))  # noqa: E731
    quick = bool(o.get("quick"))
    cfg = Config(
        rounds=1 if quick else int(o.get("rounds", 5)),
        warmup=1 if quick else o["pipeline_warmup"], steps=2 if quick else o["pipeline_steps"],
        microbatches=o["pipeline_microbatches"], ranks=ints(o["pipeline_ranks"]),
        systems=tuple(s for s in o["pipeline_systems"].split(",") if s),
        bubble_ms=(2,) if quick else ints(o["pipeline_bubble_microbatches"]),
        bubble_rounds=1 if quick else min(int(o.get("rounds", 5)), o["pipeline_bubble_rounds"]),
        threads=o["pipeline_threads"], max_foreign=float(o.get("max_foreign", 0.25)),
        retries=int(o.get("retries", 3)), timeout=float(o.get("timeout", 300.0)),
        rev=o["pipeline_rev"])
    bad = [m for m in (cfg.microbatches, *cfg.bubble_ms) if m < 1 or BATCH % m]
    unknown = set(cfg.systems) - set(SYSTEMS)
    uncut = sorted({p * SYSTEMS[s].per_rank for p in cfg.ranks for s in cfg.systems
                    if s in SYSTEMS and SYSTEMS[s].impl != "single"} - set(CUTS))
    if bad or unknown or uncut or not cfg.ranks:
        raise SystemExit(f"bench_pipeline: micro-batch counts must divide the batch {BATCH} "
                         f"(got {bad}), systems be among {list(SYSTEMS)} (unknown: "
                         f"{sorted(unknown)}), and ranks x stages per rank have a cut in "
                         f"pipeline_workers.CUTS {sorted(CUTS)} (missing: {uncut})")
    return cfg


def _measure(key: str, p: int, m: int, cfg: Config, src: Path) -> dict[str, Any]:
    """One fresh worker launch, with benchlib's quiet-machine guard."""
    args = ["--worker", key, "--microbatches", str(m), "--warmup", str(cfg.warmup),
            "--steps", str(cfg.steps), "--threads", str(cfg.threads)]
    ranks = None if SYSTEMS[key].impl == "single" else p
    rec = measure(worker_command("pipeline_workers.py", args, ranks),
                  thread_env(cfg.threads, src), retries=cfg.retries,
                  max_foreign=cfg.max_foreign, timeout=cfg.timeout)
    print(f"  pipeline p={p} m={m} {key:22} {BATCH / statistics.median(rec['times']):6.1f}"
          f" img/s  foreign {rec['foreign']:.2f}  ({rec['wall']:.0f} s)", file=sys.stderr,
          flush=True)
    return rec


def reason(err: str) -> str:
    """The last exception line of a failed worker's output (``[rank1]: `` prefixes and
    mpiexec's banner dropped), or its last line."""
    found = re.findall(r"^(?:\[rank\d+\]:\s*)?(\w+(?:Error|Exception|Interrupt)\b.*)$", err,
                       re.MULTILINE)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    return (found[-1] if found else lines[-1] if lines else "no output").strip()[:300]


def _try(key: str, p: int, m: int, cfg: Config, src: Path,
         failed: dict[str, str]) -> dict[str, Any] | None:
    """``_measure``, or None with the failure's reason in ``failed`` (printed)."""
    try:
        return _measure(key, p, m, cfg, src)
    except RuntimeError as e:
        failed[key] = f"m = {m}: {reason(str(e))}"
        print(f"  pipeline p={p} m={m} {key} FAILED, dropped: {failed[key]}", file=sys.stderr,
              flush=True)
        return None


def run(opts: argparse.Namespace) -> dict[str, Any]:
    """Comparison rounds (every system once per configuration and round, order rotated; the
    one-process reference once per round), then fxpar's bubble sweep over m at the first
    configuration (the comparison's fxpar launches serve its m)."""
    cfg = config(opts)
    src, rev = snapshot(cfg.rev) if cfg.rev else (ROOT, "working tree")
    m0 = cfg.microbatches
    failed: dict[int, dict[str, str]] = {p: {} for p in cfg.ranks}
    singles: dict[int, dict[str, Any]] = {}  # round -> the one-process launch

    def one(system: tuple[int, str], r: int) -> dict[str, Any] | None:
        p, key = system
        if key in failed[p]:
            return None
        if SYSTEMS[key].impl == "single" and r in singles:
            return singles[r]  # one process: the same in every configuration
        rec = _try(key, p, m0, cfg, src, failed[p])
        if rec is not None and SYSTEMS[key].impl == "single":
            singles[r] = rec
        return rec

    systems = [(p, key) for p in cfg.ranks for key in cfg.systems]
    launched = nested(interleave("pipeline", cfg.rounds, systems, one,
                                 key=lambda s: f"{s[0]}/{s[1]}"))
    comp = {p: [{k: rec for k, rec in rnd.get(str(p), {}).items() if rec is not None}
                for rnd in launched] for p in cfg.ranks}
    fx = [k for k in cfg.systems if SYSTEMS[k].impl == "fxpar"]
    bubble: dict[int, dict[str, dict[int, list[dict[str, Any]]]]] = {p: {} for p in cfg.ranks}
    for p, rounds in comp.items():
        for k in fx:
            recs = [rnd[k] for rnd in rounds if k in rnd]
            if recs:
                bubble[p].setdefault(SYSTEMS[k].schedule, {})[m0] = [
                    {**launch_bubble(rec["ranks"]), "sim": rec["sim_bubble"]} for rec in recs]
    bubble_raw: list[dict[str, Any]] = []
    p0 = cfg.ranks[0]
    sweep = [(key, m) for key in fx for m in cfg.bubble_ms if m != m0
             # interleaving runs rounds of p micro-batches
             and not (SYSTEMS[key].schedule == "interleaved_1f1b" and m % p0)]

    def one_m(system: tuple[str, int], r: int) -> dict[str, Any] | None:
        key, m = system
        return None if key in failed[p0] else _try(key, p0, m, cfg, src, failed[p0])

    for rnd in interleave("pipeline bubble", cfg.bubble_rounds, sweep, one_m,
                          key=lambda s: f"{s[0]}/m={s[1]}"):
        for key, m in sweep:
            rec = rnd[f"{key}/m={m}"]
            if rec is None:
                continue
            schedule = SYSTEMS[key].schedule
            bubble[p0].setdefault(schedule, {}).setdefault(m, []).append(
                {**launch_bubble(rec["ranks"]), "sim": rec["sim_bubble"]})
            bubble_raw.append({"p": p0, "schedule": schedule, "m": m, "ranks": rec["ranks"],
                               "foreign": rec["foreign"], "attempt": rec["attempt"]})
    return section(cfg, comp, bubble, bubble_raw, failed, rev)


def section(cfg: Config, comp: dict[int, list[dict[str, Any]]],
            bubble: dict[int, dict[str, dict[int, list[dict[str, Any]]]]],
            bubble_raw: list[dict[str, Any]], failed: dict[int, dict[str, str]],
            rev: str) -> dict[str, Any]:
    """The Section (see benchlib) from the launches' records."""
    m = cfg.microbatches
    results = {p: summarize(comp[p], cfg.systems) for p in cfg.ranks}
    foreign = [rec["foreign"] for rounds in comp.values() for rnd in rounds
               for rec in rnd.values()] + [b["foreign"] for b in bubble_raw]
    argv = [str(Path(sys.argv[0]).resolve().relative_to(ROOT))
            if Path(sys.argv[0]).resolve().is_relative_to(ROOT) else sys.argv[0], *sys.argv[1:]]
    per_rank = {SYSTEMS[k].schedule: SYSTEMS[k].per_rank for k in cfg.systems
                if SYSTEMS[k].impl == "fxpar"}
    tables = []
    for p in cfg.ranks:
        tables.append(throughput_table(p, m, results[p], failed[p]))
        tables.append(pairs_table(p, m, results[p]))
    tables.append({"title": f"Pipeline bubble of fxpar, batch {BATCH} (p: ranks, v: stages per "
                            f"rank)",
                   "columns": ["ranks", "schedule", "m", "formula", "simulator (unit costs)",
                               "measured (median, range)", "slowest / fastest rank compute",
                               "img/s", "launches"],
                   "rows": bubble_rows(bubble, per_rank)})
    plots = [throughput_plot(results)]
    if bubble.get(cfg.ranks[0]):
        plots.append(bubble_plot(cfg.ranks[0], bubble[cfg.ranks[0]], per_rank))
    first = {k: rec for rounds in comp.values() for rnd in rounds[:1] for k, rec in rnd.items()}
    return {
        "name": "pipeline", "title": TITLE, "command": "python " + " ".join(argv),
        "method": method(cfg, max(foreign, default=0.0), rev), "machine": machine(),
        "tables": tables, "plots": plots,
        "aims": [aim_row(p, m, results[p]) for p in cfg.ranks],
        "notes": notes(m, results, bubble, failed, disturbed(comp, bubble_raw, cfg.max_foreign),
                       cfg.max_foreign, os.cpu_count(),
                       same_cut({p: rounds[0] for p, rounds in comp.items() if rounds})),
        "raw": {"config": asdict(cfg), "revision": rev,
                "results": {str(p): v for p, v in results.items()},
                "failed": {str(p): v for p, v in failed.items()},
                "bubble": {str(p): {s: {str(mm): v for mm, v in per_m.items()}
                                    for s, per_m in per.items()} for p, per in bubble.items()},
                "comparison": {str(p): [{k: {f: rec[f] for f in ("times", "foreign", "attempt")}
                                         for k, rec in rnd.items()} for rnd in rounds]
                               for p, rounds in comp.items()},
                "bubble_launches": bubble_raw,
                "stage_params": {str(p): {k: rnd[k]["stage_params"] for k in rnd}
                                 for p, rounds in comp.items() for rnd in rounds[:1]},
                "balance": {str(p): {k: rnd[k]["balance"] for k in rnd if "balance" in rnd[k]}
                            for p, rounds in comp.items() for rnd in rounds[:1]},
                "fxpar_imported_from": next((r["fxpar"] for r in first.values() if "fxpar" in r),
                                            None),
                "transport": {k: r["transport"] for k, r in first.items()},
                "max_foreign_cores": max(foreign, default=0.0)},
    }


def method(cfg: Config, max_foreign: float, rev: str) -> str:
    """How it was measured."""
    cuts = "; ".join(f"{n} stages start at {', '.join(f'`{c}`' for c in cs)}"
                     for n, cs in CUTS.items())
    return (
        f"torchvision resnet18(num_classes={CLASSES}), float32, batch {BATCH} at {IMAGE}x{IMAGE},"
        f" SGD lr 0.01, synthetic data, seed {SEED}, {cfg.threads} intra-op thread(s) per rank, "
        f"{cfg.microbatches} micro-batches. "
        + (f"fxpar as of commit {rev} (`--pipeline-rev`, exported with `git archive`). "
           if cfg.rev else "")
        + f"Configurations: {', '.join(f'{p} ranks' for p in cfg.ranks)} under "
        f"`mpiexec -n RANKS` on a {os.cpu_count()}-core machine (more ranks than cores is "
        f"oversubscribed). Stage cuts, the same in fxpar (`Plan.balance` counted in compute "
        f"nodes up to the module) and torch (`split_spec`, `SplitPoint.BEGINNING`): {cuts}. A "
        f"schedule with 2 stages per rank cuts 2 x ranks stages; stage s sits on rank "
        f"s % ranks, or in a V for ZB-V (fxpar's `zero_bubble_v`, torch's ZBV: rank r holds r and "
        f"2 x ranks - 1 - r). torch's "
        f"`zero_bubble` counterpart is `ScheduleInterleavedZeroBubble` over one stage per rank "
        f"(ZB1P with one stage per rank is ZB-H1). Transports: fxpar MPI (mpi4py, shared "
        f"memory); torch gloo (TCP over loopback). {cfg.rounds} round(s), each launching every "
        f"system once per configuration as a fresh process in an order rotated per round (the "
        f"one-process reference once per round); a launch runs {cfg.warmup} warm-up + "
        f"{cfg.steps} timed steps and scores batch / median step time; ratios are per round, "
        f"then median (range). A launch during which other processes took over "
        f"{cfg.max_foreign} cores was redone (up to {cfg.retries} times); the kept launches saw "
        f"at most {max_foreign:.2f}. A system whose launch fails is dropped from later rounds "
        f"and listed with its error.\n\n"
        f"Bubble: fxpar's runtime records every action's start, end and receive wait "
        f"(`Runtime.timeline`, as `fxpar-run --metrics` does). A rank's busy time in a step is "
        f"the sum of its F, B and W actions minus their waits; the step's bubble is 1 - (sum "
        f"of the ranks' busy time) / (p x the step's wall time, the slowest rank's "
        f"`train_step`), median over the timed steps, then median (range) over the launches "
        f"({cfg.bubble_rounds} per schedule and m in the sweep at {cfg.ranks[0]} ranks; at "
        f"m = {cfg.microbatches} the comparison's). The simulator column is "
        f"`fxpar.perf.simulate.simulate(program.schedule, links_of(program.graph)).bubble` "
        f"with unit costs.")


def main() -> None:
    """Standalone: the suite's common options plus this section's; prints the Section JSON."""
    if "--worker" in sys.argv[1:]:
        worker(sys.argv[1:])
        return
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--quick", action="store_true",
                   help="1 round, 1 warm-up + 2 steps, bubble sweep at m = 2 only")
    p.add_argument("--max-foreign", type=float, default=0.25,
                   help="cores other processes may use during a launch before it is redone")
    p.add_argument("--retries", type=int, default=3)
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per launch")
    add_args(p)
    t0 = time.time()
    sec = run(p.parse_args())
    print(json.dumps(sec, indent=2))
    print(f"bench_pipeline: {time.time() - t0:.0f} s", file=sys.stderr)


if __name__ == "__main__":
    main()
