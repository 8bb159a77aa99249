"""A profile of the machine a job runs on, for ``fxpar-run --plan auto`` without ``--profile``.

The shipped ``h100-nvlink-ib`` profile ranks plans for a DGX H100; on a CPU node it chose LP2
for ResNet-18 at 128², batch 8, on 2 ranks, which ran 1.54x slower than DP2 (issue 39). So the
CLI planner ranks on this machine's own profile, measured once and kept:

1. every rank says what it runs on (:class:`RankInfo`: host, CPU model, GPU, torch, threads)
   in one collective (an allgather in the message format of failfast.agree: a rank that failed
   before it answers with its error from ``fxpar-run``'s error path, and every rank stops
   there with that error instead of waiting);
2. rank 0 looks for a profile of that machine and job shape (:class:`MachineKey`) in the cache
   folder (``FXPAR_PROFILE_CACHE``, default ``~/.cache/fxpar/profiles``) and sends what it
   found to the others;
3. none found: every rank takes part in a short calibration (fxpar.planner.calibrate at
   :data:`~fxpar.planner.calibrate.LOCAL` effort: the same shapes as ``fxpar-calibrate``, fewer
   timed calls; a few seconds), rank 0's profile is sent to all (every rank then plans alike),
   and rank 0 keeps it in the folder: a temporary file renamed over the old one, so no reader
   sees half a file. An error inside the calibration ends the whole job (failfast.fail): the
   other ranks would otherwise wait in it forever.

A cached profile decides the plan of every later job that matches it, so the folder must be
yours and not writable by others: another one is not used (a warning says why and what to do),
and the calibration is then not kept. Delete a file (or the folder) to measure again, for
example after changing the machine's load or BIOS settings the key cannot see.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import platform
import socket
import tempfile
import time
import warnings
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from fxpar.comm import failfast
from fxpar.comm.protocol import Comm
from fxpar.core.options import setting
from fxpar.core.version import __version__
from fxpar.perf.profile import Profile
from fxpar.planner.calibrate import LOCAL, calibrate

NAME = "this machine"
"""The name of a profile measured here (the planner's report shows it)."""
FORMAT = 2
"""Bumped when what a cached profile means changes: older files then miss (2: a call's fixed
cost, ``Profile.conv_pixels``)."""


class ProfileCacheWarning(UserWarning):
    """The profile cache folder cannot be used (not yours, writable by others, not writable)."""


@dataclass(frozen=True)
class RankInfo:
    """What one rank runs on."""

    host: str
    cpu: str
    gpu: str
    """The GPU's name when the job computes on one, else ""."""
    torch: str
    threads: int

    @classmethod
    def here(cls, device: torch.device) -> RankInfo:
        gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else ""
        return cls(socket.gethostname(), cpu_model(), gpu, torch.__version__,
                   torch.get_num_threads())


def cpu_model() -> str:
    """The CPU's model name (Linux: /proc/cpuinfo), else what platform knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


@dataclass(frozen=True)
class MachineKey:
    """What a measured profile is valid for: the same hosts, CPU and GPU models, device kind,
    torch and fxpar versions, and job shape (ranks, ranks per node, threads per rank)."""

    hosts: tuple[str, ...]
    cpus: tuple[str, ...]
    gpus: tuple[str, ...]
    device: str
    torch: str
    fxpar: str
    ranks: int
    ranks_per_node: int
    threads: int
    """Threads per rank (the most any rank has)."""

    @classmethod
    def of(cls, ranks: Sequence[RankInfo], device: str) -> MachineKey:
        """The key of a job whose ranks run on ``ranks`` (rank order)."""
        return cls(hosts=tuple(sorted({r.host for r in ranks})),
                   cpus=tuple(sorted({r.cpu for r in ranks})),
                   gpus=tuple(sorted({r.gpu for r in ranks if r.gpu})), device=device,
                   torch=",".join(sorted({r.torch for r in ranks})), fxpar=__version__,
                   ranks=len(ranks),
                   ranks_per_node=max(Counter(r.host for r in ranks).values()),
                   threads=max(r.threads for r in ranks))

    def to_json(self) -> dict[str, Any]:
        return {"format": FORMAT, **{k: list(v) if isinstance(v, tuple) else v
                                     for k, v in asdict(self).items()}}

    def file_name(self) -> str:
        """``cpu-2r-<16 hex>.json``: readable at a glance, a SHA-256 of the whole key."""
        digest = hashlib.sha256(json.dumps(self.to_json(), sort_keys=True).encode())
        return f"{self.device}-{self.ranks}r-{digest.hexdigest()[:16]}.json"


def cache_folder(environ: Mapping[str, str] | None = None) -> Path | None:
    """The folder ``FXPAR_PROFILE_CACHE`` names; unset: ``$XDG_CACHE_HOME/fxpar/profiles``
    (``~/.cache/fxpar/profiles``); None for ``off``."""
    value = setting("profile_cache", environ)
    if value == "off":
        return None
    if value:
        return Path(value).expanduser()
    env = os.environ if environ is None else environ
    base = env.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "fxpar" / "profiles"


def shown(path: Path) -> str:
    """``path`` with the home folder as ``~``."""
    try:
        return "~/" + str(path.relative_to(Path.home()))
    except ValueError:
        return str(path)


class ProfileCache:
    """Measured profiles in ``folder`` (None: none kept), one JSON file per :class:`MachineKey`.
    ``refused`` says why the folder is not used (None when it is); nothing here raises or
    warns (:func:`local_profile` warns once its collectives are over)."""

    def __init__(self, folder: Path | None) -> None:
        self.folder = folder
        self.refused = "FXPAR_PROFILE_CACHE=off" if folder is None else _refused(folder)

    def path(self, key: MachineKey) -> Path | None:
        return None if self.folder is None else self.folder / key.file_name()

    def get(self, key: MachineKey) -> Profile | None:
        """The profile kept for ``key``; None when there is none, or it is damaged or of
        another key (it is measured again and replaced)."""
        path = self.path(key)
        if self.refused is not None or path is None:
            return None
        try:
            data = json.loads(path.read_text())
            if data.get("measured", {}).get("machine") != key.to_json():
                return None
            return Profile.from_json(data, str(path))
        except (OSError, ValueError, TypeError, AttributeError):
            return None

    def put(self, key: MachineKey, profile: Profile) -> Path | None:
        """Keep ``profile`` for ``key`` (written whole or not at all); its path, or None (with
        ``refused`` saying why) when it could not be written."""
        path = self.path(key)
        if self.refused is not None or path is None or self.folder is None:
            return None
        fd, tmp = tempfile.mkstemp(dir=self.folder, prefix=".", suffix=".part")
        try:
            with os.fdopen(fd, "w") as f:
                f.write(json.dumps(profile.to_json(), indent=1) + "\n")
            os.replace(tmp, path)
            return path
        except OSError as e:
            Path(tmp).unlink(missing_ok=True)
            self.refused = f"writing {path} failed ({e})"
            return None


def _refused(folder: Path) -> str | None:
    """Why ``folder`` cannot hold profiles (made, private to this user, if missing), or None."""
    try:
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = folder.stat()
    except OSError as e:
        return f"it cannot be made or read ({e})"
    if hasattr(os, "getuid") and st.st_uid != os.getuid():
        why = "it belongs to another user"
    elif st.st_mode & 0o022:
        why = "others may write to it"
    elif not os.access(folder, os.W_OK | os.X_OK):
        return "it is not writable: give FXPAR_PROFILE_CACHE a folder you can write to"
    else:
        return None
    return (f"{why} (a profile there decides the plan of every later job): give "
            f"FXPAR_PROFILE_CACHE a folder of your own, or chmod go-w {folder}")


@dataclass(frozen=True)
class LocalProfile:
    """The profile the CLI planner ranks on, and where it came from."""

    profile: Profile
    note: str
    """For the planner's report: ``calibrated now in 3.1 s, cached in ~/...json`` or ``cached
    in ~/...json, measured 2026-01-02 10:11``."""


def local_profile(comm: Comm | None, device: torch.device, folder: Path | None
                  ) -> LocalProfile:
    """This machine's profile for a job of ``comm``'s ranks (None: this process alone):
    cached, or measured now and cached (module doc). Collective on every rank of ``comm``, as
    its first communication. folder: the cache (:func:`cache_folder`; None: keep nothing).

    Raises failfast.Disagreement on every rank when a rank arrives with an error instead.
    Warns (ProfileCacheWarning, rank 0) when ``folder`` cannot be used: after the collectives,
    so that a warning turned into an error cannot leave the other ranks waiting in them."""
    key = MachineKey.of(_gather(comm, RankInfo.here(device)), device.type)
    lead = comm is None or comm.rank == 0
    cache = ProfileCache(folder) if lead else None
    found = cache.get(key) if cache is not None else None
    if comm is not None and comm.size > 1:
        sent = comm.bcast_object(found.to_json() if found is not None else None)
        found = Profile.from_json(sent) if sent is not None else None
    if found is not None:
        path = cache.path(key) if cache is not None else None
        where = f"cached in {shown(path)}, " if path is not None else "cached, "
        return LocalProfile(found, f"{where}measured {found.measured.get('measured_at', '?')}")
    t0 = time.perf_counter()
    profile = _measure(comm, device, key)
    took = f"calibrated now in {time.perf_counter() - t0:.1f} s"
    if cache is None:
        return LocalProfile(profile, took)
    kept = cache.put(key, profile)
    if kept is None and folder is not None:
        warnings.warn(f"profile cache {folder} is not used: {cache.refused}",
                      ProfileCacheWarning, stacklevel=2)
    return LocalProfile(profile, f"{took}, cached in {shown(kept)}" if kept is not None
                        else f"{took}, not cached: {cache.refused}")


def _gather(comm: Comm | None, here: RankInfo) -> list[RankInfo]:
    """Every rank's :class:`RankInfo`; a rank that arrives from fxpar-run's error path
    (failfast.agree with its error) makes every rank raise failfast.Disagreement."""
    if comm is None or comm.size == 1:
        return [here]
    everyone: list[tuple[dict[str, Any] | None, str | None]] = \
        comm.allgather_object((asdict(here), None))
    failed = [(r, e) for r, (_, e) in enumerate(everyone) if e]
    if failed:
        first = failed[0][1]
        if all(e == first for _, e in failed):
            ranks = ", ".join(str(r) for r, _ in failed)
            detail = f"on rank{'s' if len(failed) > 1 else ''} {ranks}: {first}"
        else:
            detail = "; ".join(f"on rank {r}: {e}" for r, e in failed)
        raise failfast.Disagreement(failfast.disagreement_message("error", detail))
    return [RankInfo(**info) for info, _ in everyone if info is not None]


def _measure(comm: Comm | None, device: torch.device, key: MachineKey) -> Profile:
    """The calibration, on every rank of ``comm``; rank 0's profile, stamped with ``key`` and
    the time, on all. Any error ends the whole job (the other ranks wait in the calibration)."""
    many = comm is not None and comm.size > 1
    try:
        profile = calibrate(comm if many else None, NAME, effort=LOCAL, device=device)
        stamped = dataclasses.replace(profile, measured={
            **profile.measured, "machine": key.to_json(),
            "measured_at": time.strftime("%Y-%m-%d %H:%M")})
        data = json.loads(json.dumps(stamped.to_json()))  # as the cache will read it back
        if many:
            assert comm is not None
            data = comm.bcast_object(data)
        profile = Profile.from_json(data)
    except Exception as e:
        if many:
            failfast.fail(e)  # ends every rank of the job
        raise
    return profile
