"""docs/reliability.md and docs/reliability.json from the fault matrix (tools/reliability.py).

The JSON holds every round of every row (exit codes and seconds of each launch, the tail of
each launch's output); the page is rendered from the JSON alone, so a rerun of a few rows
(``--only ROW --write``) merges into the last full run.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import os
import platform
import statistics
import subprocess
from pathlib import Path
from typing import Any

from reliability import BOUND, FAULTS, LAYOUTS, ROOT, ROWS, STALL_WATCHDOG, TIMEOUT, Outcome


def write(docs: Path, results: dict[str, list[Outcome]], rounds: int, jobs: int,
          seconds: float, merge: bool = False) -> Path:
    """Write (or, with ``merge``, update) docs/reliability.json, then render the page."""
    path = docs / "reliability.json"
    data: dict[str, Any] = json.loads(path.read_text()) if merge and path.exists() else \
        {"rows": {}}
    rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, text=True,
                         capture_output=True).stdout.strip()
    run = {"date": datetime.date.today().isoformat(), "commit": rev, "rounds": rounds,
           "jobs": jobs, "minutes": round(seconds / 60, 1), "rows": len(results)}
    if merge and "run" in data:
        data.setdefault("reruns", []).append(run)
    else:
        data["run"] = run
    data["machine"] = {"cores": os.cpu_count(), "python": platform.python_version(),
                       "torch": importlib.metadata.version("torch"),
                       "mpich": _version("mpich")}
    data["limits"] = {"stall_watchdog": STALL_WATCHDOG, "bound_s": BOUND,
                      "harness_timeout_s": TIMEOUT}
    for rid, outcomes in results.items():
        row = ROWS[rid]
        data["rows"][rid] = {
            "fault": row.fault.name, "layout": row.layout.key, "ranks": row.layout.ranks,
            "FXPAR_FAULT": row.spec(), "env": dict(row.fault.env), "key": row.key(),
            "rounds": [o.to_json() for o in outcomes]}
    order = list(ROWS)
    data["rows"] = dict(sorted(data["rows"].items(),
                               key=lambda kv: order.index(kv[0]) if kv[0] in order else 999))
    docs.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1) + "\n")
    return rerender(docs)


def rerender(docs: Path) -> Path:
    """docs/reliability.md from docs/reliability.json."""
    md = docs / "reliability.md"
    md.write_text(render(json.loads((docs / "reliability.json").read_text())))
    return md


def _version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "?"


def _seconds(rounds: list[dict[str, Any]]) -> str:
    xs = [r["seconds"] for r in rounds]
    med = f"{statistics.median(xs):.1f}"
    return med if len(xs) == 1 else f"{med} ({min(xs):.1f}–{max(xs):.1f})"


def _same(values: list[str]) -> str:
    """One value when every round agrees, else each round's, separated by ' / '."""
    return values[0] if len(set(values)) == 1 else " / ".join(values)


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _lost(rounds: list[dict[str, Any]]) -> str:
    """The rounds' "lost" cell; for a slow rank the step times' medians and the range of the
    slowdown over the rounds."""
    ms = [r["measures"] for r in rounds]
    if all("slowdown" in m for m in ms):
        before = statistics.median(m["step_before"] for m in ms)
        after = statistics.median(m["step_after"] for m in ms)
        lo, hi = min(m["slowdown"] for m in ms), max(m["slowdown"] for m in ms)
        times = f"{lo:.0f}x" if round(lo) == round(hi) else f"{lo:.0f}–{hi:.0f}x"
        return f"nothing; a step took {before:.3f} s before, {after:.3f} s after ({times})"
    return _same([_cell(r["lost"]) for r in rounds])


def table(data: dict[str, Any]) -> str:
    head = ("| fault | layout | ranks | ended after s | exit | printed (the key line; ×N: "
            "times, per round) | what was lost | as expected |\n|---|---|---|---|---|---|---|---|")
    lines = [head]
    for row in data["rows"].values():
        rs = row["rounds"]
        rc = _same(["HUNG" if r["rc"] is None else str(r["rc"]) for r in rs])
        shown = f"`{_cell(rs[0]['shown'])}` ×" + "/".join(str(r["key_count"]) for r in rs)
        lost = _lost(rs)
        problems = sorted({p for r in rs for p in r["problems"]})
        ok = "yes" if not problems else "**no**: " + _cell("; ".join(problems))
        lines.append(f"| {row['fault']} | {LAYOUTS[row['layout']].name} | {row['ranks']} | "
                     f"{_seconds(rs)} | {rc} | {shown} | {lost} | {ok} |")
    return "\n".join(lines)


def findings(data: dict[str, Any]) -> str:
    hung = [rid for rid, row in data["rows"].items()
            if any(x["rc"] is None for r in row["rounds"] for x in r["launches"])]
    wrong = {rid: sorted({p for r in row["rounds"] for p in r["problems"]})
             for rid, row in data["rows"].items()}
    wrong = {k: v for k, v in wrong.items() if v}
    resumed = [row for row in data["rows"].values() if row["fault"] == "sigkill-resume"]
    same = [row for row in resumed
            if all(r["measures"].get("differ") == [] for r in row["rounds"])]
    out = ["- **Hangs:** " + (
        "none: every launch ended by itself, well before the harness's "
        f"{data['limits']['harness_timeout_s']:.0f} s." if not hung else
        "**" + ", ".join(hung) + " did not end by itself** (killed by the harness).")]
    out.append(f"- **Resume after a kill:** {len(same)} of {len(resumed)} layouts end "
               f"bit-identical to the uninterrupted run (every tensor of "
               f"`fxpar.program.checkpoint.export`, compared byte for byte, every round).")
    corrupt = [row for row in data["rows"].values() if row["fault"].startswith("corrupt")]
    refused = [row for row in corrupt if all(
        r["rc"] == 2 and r["key_count"] == 1 and r["measures"].get("resumed_at") is not None
        for r in row["rounds"])]
    out.append(f"- **Corrupt checkpoint shards:** {len(refused)} of {len(corrupt)} rows: "
               f"`--resume` refused on every rank, naming the damaged shard, and the previous "
               f"version it proposes resumed (the damaged step is redone; nothing else is "
               f"lost).")
    if wrong:
        out.append("- **Not as expected:**")
        out += [f"  - `{rid}`: {'; '.join(ps)}" for rid, ps in wrong.items()]
    else:
        out.append("- Every row behaved as expected, every round.")
    return "\n".join(out)


def render(data: dict[str, Any]) -> str:
    run, m, lim = data["run"], data["machine"], data["limits"]
    reruns = "".join(f" Rows rerun with `--only ... --write` on {r['date']} at {r['commit']} "
                     f"({r['rows']} row(s), {r['rounds']} round(s))." for r in
                     data.get("reruns", []))
    faults = "\n".join(f"| {f.name} | `{f.fault.format(rank=1) or '-'}`"
                       f"{''.join(f' {k}={v}' for k, v in f.env)} | {f.does} |"
                       for f in FAULTS.values())
    return f"""# Reliability: the fault matrix

Nothing hangs and nothing is lost — measured, not claimed. Generated by `python
tools/reliability.py --rounds {run['rounds']}` on {run['date']} at {run['commit']}
({run['minutes']} min; {m['cores']} cores, Python {m['python']}, torch {m['torch']}, mpich
{m['mpich']}).{reruns} Raw numbers, each launch's exit code and seconds and the tail of its
output: [reliability.json](reliability.json). What each mechanism does, its settings and what
it costs: [failures.md](failures.md).

Each row is one real `mpiexec -n RANKS fxpar-run tests/mpi/cases/jobs.py:classifier --image-size
16 --batch-size 8 --num-classes 4 --dtype float32 --steps 3` (float32, synthetic data; 5
steps for slow-rank, 4 for sigkill-resume; the layout's flags below) with
`FXPAR_FAULT=RANK:STEP:KIND[:ARG]` set (fxpar.core.faults): rank 1 misbehaves in every
row. Rows with checkpoints are several launches in a row.

| row | FXPAR_FAULT | what it does |
|---|---|---|
{faults}

Layouts: {'; '.join(f'{x.name} = `{x.flags}` ({x.ranks} ranks)' for x in LAYOUTS.values())}.

**Ended** means the launcher (`mpiexec`) returned: every rank is gone. The seconds run from
starting `mpiexec` to that moment, so they include starting the ranks, importing torch and
compiling (a launch without a fault, the `none` rows, takes about as long): {run['jobs']}
launches ran at a time on a {m['cores']}-core machine, so the seconds are wall-clock under that
sharing, not the cost of one fault alone. With several rounds the cell is the median (range). A
row of several launches reports the launch the fault ends: the killed run (sigkill-resume), the
refused resume (corrupt-*); its other launches must exit 0 (checked; their codes are in the
JSON). **Exit** is `mpiexec`'s exit code (1: fxpar's MPI_Abort; 9: `mpiexec` passing on
SIGKILL; 2: fxpar-run's refusal). **Printed** is the line that says what happened (paths
shortened to `DIR`) and how many times the job printed it (it should be once: one rank speaks
for the job). **As expected** checks the exit code, that the key line came exactly once, at
most one fxpar end-of-job message, an end within {lim['bound_s']:.0f} s, and the row's own
measure (the slowdown, the resumed step, bit-identical state).

Limits measured with: the watchdog at its defaults (`auto`: a communication call may wait 10 x
the slowest step, at least 300 s, and 1800 s before the first step ends), except the stall
rows: `FXPAR_WATCHDOG={lim['stall_watchdog']}` lowers both floors to 5 s so a hung rank ends
the job in seconds. At the defaults the same stall ends the job after 300 s (1800 s in the
first step): expect that in production, or set `--watchdog auto:FLOOR`. A killed rank (SIGKILL)
is noticed by `mpiexec` itself, which ends the other ranks; an exception, caught or not, by
fxpar's fail-fast (MPI_Abort). Without `--checkpoint` a failed job loses what it had trained
(the "in memory only" cells): that is the reason for `--checkpoint-every`.

## Findings

{findings(data)}

## The matrix

{table(data)}

Rerun one row: `python tools/reliability.py --only stall/sp_pp` (prints; add `--write` to
merge it into this page). `tests/mpi/test_fault_matrix.py` runs a subset of these rows under
`pytest -m mpi` and asserts the same checks.
"""
