"""The fault matrix (issue 23): nothing hangs, nothing is lost -- measured.

Each row injects one fault (``FXPAR_FAULT``, fxpar.core.faults) into a real ``mpiexec`` launch
of ``fxpar-run`` (the tiny float32 classifier of tests/mpi/cases/jobs.py) under one layout, and
measures how long the job took to end (the launcher returned), its exit code, the key line it
printed and how many times, and what was lost. Rows that involve checkpoints are several
launches in a row (save, then resume). Writes docs/reliability.md (tools/reliability_report.py)
and docs/reliability.json (the raw numbers)::

    python tools/reliability.py --rounds 2            # the whole matrix (~25 min on 2 cores)
    python tools/reliability.py --only stall          # every row of one fault (prints only)
    python tools/reliability.py --only raise/sp_pp    # one row; --write merges it into docs/

tests/mpi/test_fault_matrix.py runs a subset of these very rows (:data:`ROWS`) and asserts
:func:`check` finds nothing wrong.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from tempfile import TemporaryDirectory

import torch

from fxpar.program.checkpoint import export
from fxpar.testing import mpiexec

ROOT = Path(__file__).resolve().parent.parent
JOBS = ROOT / "tests" / "mpi" / "cases" / "jobs.py"
MODEL = (f"{JOBS}:classifier --image-size 16 --batch-size 8 --num-classes 4 "
         f"--dtype float32")
VICTIM = 1
"""The rank that misbehaves in every row."""
TIMEOUT = 300.0
"""Seconds before the harness kills a launch and calls the row a hang."""
BOUND = 120.0
"""A row's job must end within this many seconds (imports and compile included, several
launches sharing the machine)."""
STALL_WATCHDOG = "auto:5"
"""FXPAR_WATCHDOG of the stall rows: both auto floors at 5 s instead of 300 s / 1800 s."""
BANNERS = ("failed; ending the whole job", "is leaving with a failed program",
           "every rank stopped with this error", "a peer rank is stuck, deadlocked or dead",
           "left the job (its process exited)")
"""fxpar's end-of-job messages: a job should print at most one of them, once."""


@dataclass(frozen=True)
class Layout:
    key: str
    name: str
    ranks: int
    flags: str


LAYOUTS = {x.key: x for x in (
    Layout("sp", "SP2", 2, "--spatial-parts 2"),
    Layout("pp", "PP2, m=2", 2, "--stages 2 --parts 2"),
    Layout("sp_pp", "SP2+PP2", 3, "--spatial-parts 2 --stages 2"),
    Layout("gems", "GEMS PP2 (2 copies)", 2, "--stages 2 --gems"),
    Layout("dp", "DP2", 2, "--data-parallel 2"),
)}
ALL = tuple(LAYOUTS)


@dataclass(frozen=True)
class Fault:
    """One kind of row. ``fault``: the FXPAR_FAULT value ({rank} is :data:`VICTIM`);
    ``key``: the text that must be printed exactly once ({rank}, {size}); ``rc``: the exit
    code expected (1: MPI_Abort(1) by fxpar; 9: mpiexec passing on a SIGKILL; 2: fxpar-run's
    user error), or "non-zero"; ``scenario``: one launch ("one"), save-corrupt-refuse-resume
    ("corrupt"), or reference-kill-resume-compare ("resume")."""

    name: str
    does: str
    fault: str
    key: str
    rc: str
    layouts: tuple[str, ...]
    env: tuple[tuple[str, str], ...] = ()
    steps: int = 3
    scenario: str = "one"


FAULTS = {f.name: f for f in (
    Fault("none", "no fault: the baseline launch (imports, compile, 3 steps)",
          "", "done: median", "0", ALL),
    Fault("raise", "an exception in rank 1's first forward of step 2 (a failing layer)",
          "{rank}:2:raise", "fxpar: rank {rank} of {size} failed; ending the whole job", "1",
          ALL),
    Fault("caught-raise", "the same exception, caught by the script, which leaves with "
          "sys.exit(3)", "{rank}:2:caught-raise",
          "fxpar: rank {rank} of {size} is leaving with a failed program", "1", ALL),
    Fault("sigkill", "rank 1 kills itself with SIGKILL in step 2 (as the OOM killer does)",
          "{rank}:2:sigkill", "EXIT STRING: Killed (signal 9)", "9", ALL),
    Fault("stall", "rank 1 sleeps forever in step 2 (a hung rank)", "{rank}:2:stall",
          "a peer rank is stuck, deadlocked or dead", "1", ALL,
          (("FXPAR_WATCHDOG", STALL_WATCHDOG),)),
    Fault("stall-step1", "rank 1 sleeps forever in step 1 (before any step has ended: the "
          "watchdog's start limit)", "{rank}:1:stall",
          "a peer rank is stuck, deadlocked or dead", "1", ("sp_pp",),
          (("FXPAR_WATCHDOG", STALL_WATCHDOG),)),
    Fault("nan-stop", "NaN into rank 1's forward of step 2, FXPAR_NONFINITE=stop (default)",
          "{rank}:2:nan-loss", "fxpar: every rank stopped with this error", "1", ALL,
          (("FXPAR_NONFINITE", "stop"),)),
    Fault("nan-skip", "the same NaN, FXPAR_NONFINITE=skip", "{rank}:2:nan-loss",
          "skipped 1 step(s) with NaN/inf", "0", ALL, (("FXPAR_NONFINITE", "skip"),)),
    Fault("slow-rank", "rank 1 sleeps 0.5 s before each forward from step 3 on (watchdog "
          "at auto defaults)", "{rank}:3:slow-rank:0.5", "done: median", "0", ALL, steps=5),
    Fault("corrupt-truncate", "rank 1's shard of the step-3 checkpoint cut to half after the "
          "save (--checkpoint-every 1); then --resume DIR, then --resume DIR/step-00000002",
          "{rank}:3:corrupt-checkpoint:truncate", "rank{rank:05d}.pt is damaged", "2",
          ("sp_pp", "dp"), scenario="corrupt"),
    Fault("corrupt-flip", "the same with one byte of tensor data changed (torch.load would "
          "not notice)", "{rank}:3:corrupt-checkpoint:flip", "rank{rank:05d}.pt is damaged",
          "2", ("sp_pp", "gems"), scenario="corrupt"),
    Fault("sigkill-resume", "checkpoints every step, rank 1 SIGKILLed in step 3 of 4, then "
          "--resume DIR to step 4; compared with an uninterrupted run", "{rank}:3:sigkill",
          "resumed from", "9", ("sp_pp", "gems", "dp"), steps=4, scenario="resume"),
)}


@dataclass(frozen=True)
class Row:
    fault: Fault
    layout: Layout

    @property
    def id(self) -> str:
        return f"{self.fault.name}/{self.layout.key}"

    def spec(self) -> str:
        return self.fault.fault.format(rank=VICTIM)

    def key(self) -> str:
        return self.fault.key.format(rank=VICTIM, size=self.layout.ranks)


ROWS = {r.id: r for r in (Row(f, LAYOUTS[k]) for f in FAULTS.values() for k in f.layouts)}


@dataclass
class Launch:
    what: str
    args: str
    env: dict[str, str]
    rc: int | None
    """mpiexec's exit code; None: the harness killed it after :data:`TIMEOUT` (a hang)."""
    seconds: float
    out: str = field(repr=False)


def launch(what: str, layout: Layout, extra: str, env: dict[str, str],
           timeout: float = TIMEOUT) -> Launch:
    """One ``mpiexec -n RANKS fxpar-run ...``; stdout and stderr together."""
    run = str(Path(sys.executable).parent / "fxpar-run")
    args = [mpiexec(), "-n", str(layout.ranks), run, *MODEL.split(), *layout.flags.split(),
            *extra.split()]
    full = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
            "PYTHONPATH": str(ROOT), **env}
    for k in ("FXPAR_FAULT", "FXPAR_WATCHDOG", "FXPAR_NONFINITE"):
        if k not in env:
            full.pop(k, None)
    start = time.monotonic()
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=full, start_new_session=True, cwd=ROOT)
    try:
        out, _ = proc.communicate(timeout=timeout)
        rc: int | None = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        out, _ = proc.communicate()
        rc = None
    return Launch(what, " ".join(args[3:]), env, rc, time.monotonic() - start, out)


@dataclass
class Outcome:
    """One row, one round. ``seconds``, ``rc``, ``banners``: the launch the fault ends (the
    refused resume for a corrupt checkpoint); ``key_count``, ``shown``: the launch that must
    say the row's key (the resume after a kill; else the same)."""

    row: str
    seconds: float
    rc: int | None
    key_count: int
    shown: str
    banners: int
    lost: str
    measures: dict[str, object]
    launches: list[Launch]
    problems: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, object]:
        d = asdict(self)
        d["launches"] = [{k: v for k, v in asdict(x).items() if k != "out"}
                         for x in self.launches]
        d["tails"] = {x.what: x.out[-4000:] for x in self.launches}
        return d


def steps_done(out: str) -> int:
    """The last step rank 0 reported as done (0: none)."""
    done = [int(m) for m in re.findall(r"step +(\d+)/\d+  loss ", out)]  # may follow a grid
    return max(done, default=0)


def step_seconds(out: str) -> dict[int, float]:
    return {int(n): float(s) for n, s in
            re.findall(r"step +(\d+)/\d+  loss .*?\((\d+\.\d+) s, data", out)}


def shorten(line: str, work: Path | None, width: int = 120) -> str:
    line = line.strip()
    if work is not None:
        line = line.replace(str(work), "DIR")
    line = line.replace(str(ROOT) + "/", "")
    return line if len(line) <= width else line[:width - 1] + "…"


def _shown(out: str, key: str) -> str:
    """The line holding ``key``; else the first fxpar end-of-job banner, else the last line."""
    lines = out.splitlines()
    for want in (key, *BANNERS):
        for ln in lines:
            if want in ln:
                return ln
    return lines[-1] if lines else ""


def compare(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    """The keys whose tensors differ in any bit (or in presence, dtype, shape)."""
    differ = sorted(set(a) ^ set(b))
    for k in sorted(set(a) & set(b)):
        x, y = a[k], b[k]
        if x.dtype != y.dtype or x.shape != y.shape or not torch.equal(
                x.contiguous().view(-1).view(torch.uint8),
                y.contiguous().view(-1).view(torch.uint8)):
            differ.append(k)
    return differ


def shard_digests(folder: Path) -> list[str]:
    """The sha256 of every shard of the version ``folder`` names, from its manifest."""
    from fxpar.program.checkpoint import read_manifest

    return [str(r.get("sha256")) for r in read_manifest(folder)["ranks"]]


def run_row(row: Row, work: Path) -> Outcome:
    """Run ``row`` once in the empty folder ``work`` (checkpoints go there)."""
    f, lay = row.fault, row.layout
    env = dict(f.env)
    if f.fault:
        env["FXPAR_FAULT"] = row.spec()
    steps = f"--steps {f.steps}"
    measures: dict[str, object] = {}
    if f.scenario == "one":
        hit = said = launch("fault", lay, steps, env)
        launches = [hit]
        lost = _lost(f, hit, measures)
    elif f.scenario == "corrupt":
        d = work / "ckpt"
        save = launch("save", lay, f"{steps} --checkpoint {d} --checkpoint-every 1", env)
        hit = said = launch("resume latest", lay, f"--steps {f.steps + 1} --resume {d}", {})
        prev = d / f"step-{f.steps - 1:08d}"
        again = launch("resume previous", lay,
                       f"--steps {f.steps + 1} --resume {prev} --checkpoint {d}", {})
        launches = [save, hit, again]
        back = _resumed_at(again.out)
        measures.update(resumed_at=back)
        lost = f"the damaged version (step {f.steps}): resumed from step {back}, " \
               f"{f.steps - back} step redone" if back is not None else \
            "? (the previous version did not load)"
    else:  # resume: the kill ends a job; the resume must make up for it bit for bit
        ref_dir, run_dir = work / "ref", work / "run"
        ck = "--checkpoint-every 1 --checkpoint"
        ref = launch("reference", lay, f"{steps} {ck} {ref_dir}", {})
        hit = launch("killed", lay, f"{steps} {ck} {run_dir}", env)
        said = launch("resume latest", lay, f"{steps} {ck} {run_dir} --resume {run_dir}", {})
        launches = [ref, hit, said]
        lost = "? (a launch failed: nothing to compare)"
        if ref.rc == 0 and said.rc == 0:
            a, b = export(ref_dir), export(run_dir)
            differ = compare(a, b)
            same = shard_digests(ref_dir) == shard_digests(run_dir)
            measures.update(tensors=len(a), differ=differ, shards_identical=same,
                            resumed_at=_resumed_at(said.out))
            lost = (f"nothing (bit-identical: {len(a)} of {len(a)} tensors"
                    f"{', every shard byte-identical' if same else ''})" if not differ
                    else f"DIFFERS: {len(differ)} of {len(a)} tensors")
    key = row.key()
    return Outcome(row.id, round(hit.seconds, 2), hit.rc, said.out.count(key),
                   shorten(_shown(said.out, key), work),
                   sum(hit.out.count(b) for b in BANNERS), lost, measures, launches)


def _resumed_at(out: str) -> int | None:
    m = re.search(r"resumed from \S* at step (\d+)", out)
    return int(m.group(1)) if m else None


def _lost(f: Fault, hit: Launch, measures: dict[str, object]) -> str:
    """What a one-launch row lost, from its output (slow-rank: measures the slowdown)."""
    done = steps_done(hit.out)
    lost = "nothing" if hit.rc == 0 else \
        f"{done} trained step(s), in memory only (no --checkpoint asked)"
    if f.name == "nan-stop":
        return f"step {done + 1} undone on every rank; " + lost
    if f.name == "nan-skip":
        m = re.search(r"skipped (\d+) step\(s\)", hit.out)
        return f"{m.group(1)} step's batch (skipped on every rank)" if m else \
            "? (no 'skipped' line)"
    if f.name == "slow-rank":
        t = step_seconds(hit.out)
        before, after = t.get(2), [s for n, s in t.items() if n >= 3]
        if before and after:
            slow = statistics.median(after)
            measures.update(step_before=before, step_after=slow, slowdown=slow / before)
            return f"nothing; step {before:.3f} s -> {slow:.3f} s ({slow / before:.0f}x)"
    return lost


def check(row: Row, o: Outcome) -> list[str]:
    """What is wrong with outcome ``o`` of ``row`` (empty: as expected)."""
    f, problems = row.fault, []
    for x in o.launches:
        if x.rc is None:
            problems.append(f"{x.what}: HUNG (killed by the harness after {x.seconds:.0f} s)")
        crash = re.search(r"EXIT STRING: ((?!Killed)[^\n]*\(signal \d+\))", x.out)
        if crash and not (f.fault.endswith("sigkill") and x.what in ("fault", "killed")):
            problems.append(f"{x.what}: a rank crashed: {crash.group(1)} (mpiexec)")
    if o.rc is not None:
        want = f.rc
        ok = (o.rc == 0) if want == "0" else (o.rc != 0) if want == "non-zero" else \
            o.rc == int(want)
        if not ok:
            problems.append(f"exit code {o.rc}, expected {want}")
    if o.seconds > BOUND:
        problems.append(f"took {o.seconds:.0f} s (bound {BOUND:.0f} s)")
    if o.key_count != 1:
        problems.append(f"{row.key()!r} printed {o.key_count} times, expected once")
    if o.banners > 1:
        problems.append(f"{o.banners} end-of-job messages, expected at most one")
    if f.scenario == "corrupt":
        save, _, again = o.launches
        if save.rc != 0 or again.rc != 0:
            problems.append(f"save exit {save.rc}, resume from the previous version exit "
                            f"{again.rc}: both should be 0")
        if o.measures.get("resumed_at") != f.steps - 1:
            problems.append(f"resumed at {o.measures.get('resumed_at')}, not {f.steps - 1}")
    if f.scenario == "resume":
        ref, kill, again = o.launches
        if ref.rc != 0 or again.rc != 0 or kill.rc == 0:
            problems.append(f"exit codes reference {ref.rc}, killed {kill.rc}, resumed "
                            f"{again.rc}: expected 0, non-zero, 0")
        if o.measures.get("differ") != []:
            problems.append(f"not bit-identical to the uninterrupted run: "
                            f"{o.measures.get('differ')}")
    if f.name == "slow-rank" and not float(str(o.measures.get("slowdown", 0))) > 2:
        problems.append(f"no slowdown measured: {o.measures}")
    return problems


def run_rows(rows: list[Row], jobs: int, progress: bool = True) -> list[Outcome]:
    """Each row once, ``jobs`` at a time, each in a fresh temporary folder."""
    t0 = time.monotonic()

    def one(row: Row) -> Outcome:
        with TemporaryDirectory(prefix="fxpar-fault-") as tmp:
            o = run_row(row, Path(tmp))
            o.problems = check(row, o)
        if progress:
            state = "ok" if not o.problems else "PROBLEM: " + "; ".join(o.problems)
            print(f"[{time.monotonic() - t0:6.0f} s] {row.id:<24} exit {o.rc} after "
                  f"{o.seconds:6.1f} s  {state}", flush=True)
        return o

    # rows of several launches first: started last, they would run on alone at the end
    first = sorted(rows, key=lambda r: r.fault.scenario == "one")
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        done = dict(zip((r.id for r in first), pool.map(one, first), strict=True))
    return [done[r.id] for r in rows]


def select(only: list[str] | None) -> list[Row]:
    """The rows named by ``only`` (row ids, fault names or layout keys), or all."""
    if not only:
        return list(ROWS.values())
    picked = [r for r in ROWS.values()
              if any(o in (r.id, r.fault.name, r.layout.key) for o in only)]
    if not picked:
        raise SystemExit(f"--only {only}: no such row; rows are {', '.join(ROWS)}")
    return picked


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=1, help="launches per row (median, range)")
    ap.add_argument("--jobs", type=int, default=3, help="launches at a time (default 3)")
    ap.add_argument("--only", action="append", metavar="ROW",
                    help="a row (raise/sp_pp), a fault (stall) or a layout (dp); repeatable")
    ap.add_argument("--write", action="store_true",
                    help="with --only: merge the rows into docs/reliability.json and .md")
    ap.add_argument("--docs", type=Path, default=ROOT / "docs")
    ap.add_argument("--render", action="store_true",
                    help="only render docs/reliability.md again from docs/reliability.json")
    a = ap.parse_args(argv)
    if a.render:
        from reliability_report import rerender

        print(f"wrote {rerender(a.docs)}")
        return 0
    rows = select(a.only)
    print(f"{len(rows)} row(s) x {a.rounds} round(s), {a.jobs} launches at a time", flush=True)
    t0 = time.monotonic()
    rounds = [run_rows(rows, a.jobs) for _ in range(a.rounds)]
    took = time.monotonic() - t0
    if a.only and not a.write:
        return 0 if all(not o.problems for r in rounds for o in r) else 1
    from reliability_report import write  # tools/ is on sys.path when run as a script

    results = {row.id: [r[i] for r in rounds] for i, row in enumerate(rows)}
    md = write(a.docs, results, rounds=a.rounds, jobs=a.jobs, seconds=took,
               merge=bool(a.only))
    print(f"wrote {md} and {md.with_suffix('.json')} in {took / 60:.1f} min", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
