"""The fault matrix, compact (issue 23): one row per fault kind of tools/reliability.py (the row
definitions and checks come from there), each a real ``mpiexec`` launch of ``fxpar-run``, four
at a time. Every job must end by itself, soon, with the expected exit code and its key line
printed exactly once; a rank killed between checkpoints resumes to the uninterrupted run's
state bit for bit, and the comparison that says so is shown to catch one changed bit.

The whole matrix (every layout, several rounds) is ``python tools/reliability.py --rounds 2``
(docs/reliability.md).
"""

from __future__ import annotations

import importlib.util
import re
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from fxpar.program.checkpoint import export

TOOLS = Path(__file__).resolve().parents[2] / "tools"
SUBSET = {  # one row per fault kind; SP+PP where a 3-rank launch says more, else 2 ranks
    # the rows of three launches in a row first, so that they do not finish last alone
    "sigkill": "sigkill-resume/sp_pp",  # the kill, then the resume compared bit for bit
    "corrupt-checkpoint": "corrupt-flip/gems",
    "raise": "raise/sp_pp",
    "caught-raise": "caught-raise/gems",
    "stall": "stall/sp_pp",  # two ranks wait on the stalled one: one of them reports
    "nan-stop": "nan-stop/dp",
    "nan-skip": "nan-skip/sp",
    "slow-rank": "slow-rank/pp",
}
pytestmark = [pytest.mark.mpi, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def rel():
    """tools/reliability.py (tools/ is not a package)."""
    spec = importlib.util.spec_from_file_location("reliability", TOOLS / "reliability.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["reliability"] = mod  # dataclasses look their module up
    try:
        spec.loader.exec_module(mod)
        yield mod
    finally:
        sys.modules.pop("reliability", None)


@pytest.fixture(scope="module")
def ran(rel, tmp_path_factory):
    """Row id -> (outcome, its folder), every row of SUBSET run once, four at a time."""
    works = {rid: tmp_path_factory.mktemp(rid.replace("/", "_")) for rid in SUBSET.values()}

    def one(rid: str):
        o = rel.run_row(rel.ROWS[rid], works[rid])
        print(f"{rid}: exit {o.rc} after {o.seconds:.1f} s; {o.lost}")
        return o, works[rid]

    with ThreadPoolExecutor(max_workers=4) as pool:
        return dict(zip(SUBSET.values(), pool.map(one, SUBSET.values()), strict=True))


@pytest.mark.parametrize("rid", list(SUBSET.values()))
def test_row_ends_as_expected(rel, ran, rid):
    """Ended by itself within the bound, the exit code, the key line once, at most one
    end-of-job message, the row's own measure (tools/reliability.py: check)."""
    o, _ = ran[rid]
    problems = rel.check(rel.ROWS[rid], o)
    assert not problems, (problems, o.launches[-1].out[-3000:])


def _out(ran, rid: str, what: str | None = None) -> str:
    o, _ = ran[rid]
    return next(x.out for x in o.launches if what is None or x.what == what)


def test_a_raise_names_the_failing_rank_action_and_grid_cell(ran):
    out = _out(ran, "raise/sp_pp")
    assert out.count("ActionFailed: rank 1, step 2, action 0F0: InjectedFault: "
                     "FXPAR_FAULT=1:2:raise") == 1, out[-3000:]
    assert "0F0 <-- ERROR HERE" in out


def test_a_stalled_rank_is_reported_once_by_a_waiting_peer(ran):
    """Ranks 0 (a halo exchange with tile 1) and 2 (the next stage) both wait on rank 1 with
    the same limit: one report, every rank's position in it."""
    out = _out(ran, "stall/sp_pp")
    assert out.count("Where every rank is:") == 1, out[-3000:]
    assert len(re.findall(r"fxpar watchdog: rank [02] waited 5 s in ", out)) == 1, out[-3000:]
    assert "  rank 1: step 2, action 0F0: running" in out, out[-3000:]  # the stuck one
    assert "  rank 2: step 2, action 1F0: waiting" in out, out[-3000:]


def test_a_nan_under_stop_ends_the_job_naming_the_step_and_ranks_once(ran):
    out = _out(ran, "nan-stop/dp")
    assert out.count("NonFiniteError: step 2: NaN or inf values (rank 0: gradients") == 1, out
    assert "failed; ending the whole job" not in out  # not one banner per rank


def test_a_skipped_nan_step_says_so_and_the_job_finishes(ran):
    o, _ = ran["nan-skip/sp"]
    out = o.launches[0].out
    assert o.rc == 0
    assert "loss nan" in out and "skipped: NaN/inf, undone on every rank" in out, out[-3000:]
    assert out.count("skipped 1 step(s) with NaN/inf") == 1


def test_a_slow_rank_finishes_under_the_default_watchdog(ran):
    o, _ = ran["slow-rank/pp"]
    assert o.rc == 0 and "fxpar watchdog" not in o.launches[0].out
    assert o.measures["slowdown"] > 2, o.measures  # 2 forwards x 0.5 s per step on rank 1


def test_a_corrupt_shard_is_refused_by_name_and_the_previous_version_resumes(ran):
    out = _out(ran, "corrupt-flip/gems", "resume latest")
    assert "fxpar-run: error: checkpoint" in out and "rank00001.pt is damaged" in out, out
    assert "Versions still kept in" in out and "step-00000002" in out
    assert "resumed from" not in out  # no rank trained on
    again = _out(ran, "corrupt-flip/gems", "resume previous")
    assert "at step 2" in again and "step    4/4" in again, again[-2000:]


def test_resume_after_a_kill_is_bit_identical_and_the_comparison_would_see_one_bit(rel, ran):
    o, work = ran["sigkill-resume/sp_pp"]
    assert o.launches[1].rc not in (None, 0), "the kill did not end the job"
    assert o.measures["differ"] == [] and o.measures["tensors"] >= 10, o.measures
    assert o.measures["shards_identical"], "optimizer momentum / RNG differ after resuming"
    ref, run = export(work / "ref"), export(work / "run")
    assert rel.compare(ref, run) == []
    # negative controls: one step fewer, and one float nudged by one ulp, are both caught
    earlier = rel.compare(ref, export(work / "ref" / "step-00000003"))
    assert earlier and all(k in ref for k in earlier), earlier
    key = next(k for k, t in ref.items() if t.is_floating_point())
    nudged = dict(ref)
    t = ref[key].clone().view(-1)
    t[0] = torch.nextafter(t[0], torch.tensor(float("inf"), dtype=t.dtype))
    nudged[key] = t.view(ref[key].shape)
    assert rel.compare(ref, nudged) == [key]
