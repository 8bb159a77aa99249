"""The CLI planner's profile of the machine it runs on (fxpar.planner.localprofile, issue 39):
the cache key, the cache folder (its option, round trip, damaged files, a folder others may
write to), the collective's error path, and ``fxpar-run --plan auto`` without ``--profile``
ranking on this machine's profile and saying so. The calibration itself is faked here (it is
real in tests/mpi/cases/calibrate_cases.py, 2 ranks together)."""

import json
import os
import stat
from pathlib import Path

import pytest
import torch

from fxpar.cli import run
from fxpar.comm import failfast
from fxpar.perf.profile import Link, Profile
from fxpar.planner import localprofile
from fxpar.planner.localprofile import (
    NAME,
    MachineKey,
    ProfileCache,
    ProfileCacheWarning,
    RankInfo,
    cache_folder,
    local_profile,
)
from fxpar.planner.planner import DEFAULT_PROFILE

CASES = Path(__file__).parents[1] / "mpi" / "cases" / "driver_cases.py"
CPU = torch.device("cpu")


def _rank(host: str = "node1", threads: int = 1) -> RankInfo:
    return RankInfo(host, "AMD EPYC", "", "2.9.0", threads)


def _profile(name: str = NAME, conv: float = 5e10) -> Profile:
    link = Link(2e-5, 3e-10)
    return Profile(name=name, device="cpu", conv_flops=conv, matmul_flops=8e10, mem_bytes=5e9,
                   op_s=2e-6, p2p_intra=link, p2p_inter=link, allreduce_intra=link,
                   allreduce_inter=link, ranks_per_node=2, slots_per_node=2)


def _stamped(key: MachineKey) -> Profile:
    p = _profile()
    return Profile.from_json({**p.to_json(), "measured": {
        "machine": key.to_json(), "measured_at": "2026-01-02 10:11"}})


# -- the key ------------------------------------------------------------------------------------
def test_the_key_counts_ranks_per_node_and_changes_with_what_makes_a_profile_valid():
    two = MachineKey.of([_rank(), _rank()], "cpu")
    assert (two.hosts, two.ranks, two.ranks_per_node, two.threads) == (("node1",), 2, 2, 1)
    spread = MachineKey.of([_rank("a"), _rank("b"), _rank("a")], "cpu")
    assert (spread.hosts, spread.ranks, spread.ranks_per_node) == (("a", "b"), 3, 2)
    assert two.file_name().startswith("cpu-2r-") and two.file_name().endswith(".json")
    others = [MachineKey.of([_rank(), _rank()], "cuda"),
              MachineKey.of([_rank(), _rank("node2")], "cpu"),
              MachineKey.of([_rank(), _rank(threads=2)], "cpu"),
              MachineKey.of([_rank()], "cpu"),
              MachineKey.of([_rank(), RankInfo("node1", "AMD EPYC", "", "2.8.0", 1)], "cpu")]
    names = {k.file_name() for k in others}
    assert two.file_name() not in names and len(names) == len(others)
    assert MachineKey.of([_rank(), _rank()], "cpu").file_name() == two.file_name()


def test_rank_info_describes_this_process():
    here = RankInfo.here(CPU)
    assert here.host and here.cpu and here.gpu == "" and here.torch == torch.__version__
    assert here.threads == torch.get_num_threads()


# -- the folder ---------------------------------------------------------------------------------
def test_the_cache_folder_comes_from_its_option(monkeypatch, tmp_path):
    monkeypatch.delenv("FXPAR_PROFILE_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert cache_folder() == tmp_path / "fxpar" / "profiles"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert cache_folder() == Path.home() / ".cache" / "fxpar" / "profiles"
    assert cache_folder({"FXPAR_PROFILE_CACHE": str(tmp_path / "p")}) == tmp_path / "p"
    assert cache_folder({"FXPAR_PROFILE_CACHE": "~/p"}) == Path.home() / "p"
    assert cache_folder({"FXPAR_PROFILE_CACHE": "off"}) is None


def test_a_profile_is_kept_whole_and_read_back_for_its_key_only(tmp_path):
    key = MachineKey.of([_rank(), _rank()], "cpu")
    folder = tmp_path / "made" / "here"
    cache = ProfileCache(folder)
    assert cache.refused is None and stat.S_IMODE(folder.stat().st_mode) == 0o700
    assert cache.get(key) is None
    path = cache.put(key, _stamped(key))
    assert path == folder / key.file_name() and sorted(os.listdir(folder)) == [path.name]
    assert cache.get(key) == _stamped(key)
    other = MachineKey.of([_rank(), _rank(threads=2)], "cpu")
    assert cache.get(other) is None
    (folder / other.file_name()).write_text(path.read_text())  # a file under another's name
    assert cache.get(other) is None
    path.write_text(path.read_text()[:100])  # damaged: measured again (a miss), then replaced
    assert cache.get(key) is None
    data = json.loads(json.dumps(_stamped(key).to_json()))
    del data["conv_flops"]
    path.write_text(json.dumps(data))
    assert cache.get(key) is None


@pytest.mark.skipif(not hasattr(os, "getuid"), reason="POSIX permissions")
def test_a_folder_others_may_write_to_is_refused_with_the_fix(tmp_path, fake_calibration):
    folder = tmp_path / "shared"
    folder.mkdir()
    folder.chmod(0o777)
    key = MachineKey.of([RankInfo.here(CPU)], "cpu")
    planted = json.dumps(_stamped(key).to_json())
    (folder / key.file_name()).write_text(planted)
    cache = ProfileCache(folder)
    assert cache.refused.startswith("others may write to it")
    assert cache.get(key) is None  # a planted profile is not read
    assert cache.put(key, _stamped(key)) is None
    with pytest.warns(ProfileCacheWarning, match=r"is not used: others may write to it .*"
                      r"FXPAR_PROFILE_CACHE a folder of your own, or chmod go-w"):
        got = local_profile(None, CPU, folder)
    assert len(fake_calibration) == 1 and got.profile.conv_flops == _profile().conv_flops
    assert "not cached: others may write to it" in got.note
    assert (folder / key.file_name()).read_text() == planted  # nor replaced


# -- measuring once, then the cache ---------------------------------------------------------------
@pytest.fixture
def fake_calibration(monkeypatch):
    """calibrate() replaced by an instant one; the list counts its calls."""
    calls = []

    def calibrate(comm, name, quick=False, ranks_per_node=None, *, effort=None, device=None):
        calls.append((comm, name, effort, device))
        return _profile(name)

    monkeypatch.setattr(localprofile, "calibrate", calibrate)
    return calls


def test_a_missing_profile_is_measured_once_then_read_from_the_cache(fake_calibration,
                                                                     tmp_path):
    first = local_profile(None, CPU, tmp_path)
    assert len(fake_calibration) == 1 and fake_calibration[0][2] == localprofile.LOCAL
    assert first.note.startswith("calibrated now in ") and \
        f"s, cached in {tmp_path}/cpu-1r-" in first.note, first.note
    assert first.profile.measured["machine"]["ranks"] == 1
    again = local_profile(None, CPU, tmp_path)
    assert len(fake_calibration) == 1 and again.profile == first.profile
    assert again.note.startswith(f"cached in {tmp_path}/cpu-1r-") and \
        f", measured {first.profile.measured['measured_at']}" in again.note, again.note
    kept = local_profile(None, CPU, None)
    assert len(fake_calibration) == 2 and kept.note.endswith("not cached: FXPAR_PROFILE_CACHE=off")


class _Gathered:
    """A rank 0 of 2 whose peer arrived from fxpar-run's error path (failfast.agree)."""

    rank, size = 0, 2

    def __init__(self, peer: tuple) -> None:
        self.peer = peer

    def allgather_object(self, obj):
        return [obj, self.peer]

    def bcast_object(self, obj, root=0):
        return obj


def test_a_rank_that_failed_before_makes_every_rank_stop_with_its_error(fake_calibration,
                                                                         tmp_path):
    comm = _Gathered((None, "--data /x: no such folder"))
    with pytest.raises(failfast.Disagreement, match=r"on rank 1: --data /x: no such folder "
                       r"\(every rank stops here"):
        local_profile(comm, CPU, tmp_path)
    assert not fake_calibration and not os.listdir(tmp_path)


def test_a_failing_calibration_ends_the_whole_job(monkeypatch, tmp_path):
    def broken(*args, **kwargs):
        raise RuntimeError("a tile op failed")

    ended = []

    def fail(e):
        ended.append(e)
        raise SystemExit(1)

    monkeypatch.setattr(localprofile, "calibrate", broken)
    monkeypatch.setattr(failfast, "fail", fail)
    comm = _Gathered((vars(_rank()), None))
    with pytest.raises(SystemExit):
        local_profile(comm, CPU, tmp_path)
    assert [str(e) for e in ended] == ["a tile op failed"]


# -- fxpar-run --plan auto ------------------------------------------------------------------------
ARGV = [f"{CASES}:tiny_net", "--num-classes", "3", "--image-size", "20", "--batch-size", "4",
        "--steps", "1", "--plan", "auto", "--device", "cpu"]


def test_fxpar_run_without_profile_ranks_on_this_machine_and_says_so(
        fake_calibration, monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("FXPAR_PROFILE_CACHE", str(tmp_path))
    assert run.main(ARGV) == 0
    out = capsys.readouterr().out
    assert f"profile '{NAME}' (calibrated now in " in out and \
        f"s, cached in {tmp_path}/cpu-1r-" in out, out
    assert run.main(ARGV) == 0
    out = capsys.readouterr().out
    assert f"profile '{NAME}' (cached in {tmp_path}/cpu-1r-" in out and ", measured " in out
    assert len(fake_calibration) == 1


def test_fxpar_run_with_profile_measures_nothing(fake_calibration, monkeypatch, tmp_path,
                                                 capsys):
    monkeypatch.setenv("FXPAR_PROFILE_CACHE", str(tmp_path))
    assert run.main([*ARGV, "--profile", DEFAULT_PROFILE]) == 0
    out = capsys.readouterr().out
    assert f"profile '{DEFAULT_PROFILE}' (--profile {DEFAULT_PROFILE}): " in out, out
    assert not fake_calibration and not os.listdir(tmp_path)


def test_the_profile_help_says_what_the_default_is():
    text = " ".join(run.parser().format_help().split())
    assert f"default: '{NAME}', a profile of the hosts, ranks and threads of this job" in text
