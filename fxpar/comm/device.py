"""Which device a rank computes on, and whether its MPI can read that device's memory.

Ranks bind to GPUs by node-local rank (rank ``r`` of a node takes GPU ``r % gpus``), so one
``mpiexec`` line works on any node layout. Everything here runs on machines without CUDA: the
CUDA calls sit behind ``torch.cuda`` checks that tests replace.
"""

from __future__ import annotations

import ctypes
import os
import warnings
from typing import Any

import torch

from fxpar.comm import failfast, launch
from fxpar.comm.protocol import Comm
from fxpar.core.options import setting

DEVICES = ("auto", "cpu", "cuda")
_warned_sharing = False


class DeviceError(ValueError):
    """The device asked for does not exist here (a user error: say which to use instead)."""


def node_local(comm: Comm | None = None) -> tuple[int, int]:
    """(rank on this node, ranks on this node). With ``comm``: exact, from MPI's shared-memory
    split (collective on every rank of ``comm``); without: the launcher's environment variables,
    else (0, 1) for a process not started by a launcher. The size is 0 when unknown."""
    if comm is not None:
        node = comm.node()
        return node.rank, node.size
    found = launch.detect()
    return (found.local_rank, found.local_size) if found is not None else (0, 1)


def local_rank(comm: Comm | None = None) -> int:
    """This process's rank among the ranks on its node (see :func:`node_local`)."""
    return node_local(comm)[0]


def bind(comm: Comm | None = None, device: str = "auto") -> torch.device:
    """The device this rank computes on, made current: ``cpu``, ``cuda`` (GPU ``local rank %
    GPUs on the node``), ``cuda:N`` (that GPU) or ``auto`` (cuda when available, else cpu).

    Collective on ``comm`` when a GPU is chosen by local rank (see :func:`node_local`). More
    ranks on a node than GPUs share them round-robin, with one warning."""
    global _warned_sharing
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        return torch.device("cpu")
    if device != "cuda" and not device.startswith("cuda:"):
        raise ValueError(f"unknown device {device!r}: use one of {', '.join(DEVICES)} or cuda:N")
    if not torch.cuda.is_available():
        raise DeviceError(
            f"device {device!r} asked for but torch.cuda.is_available() is False (torch "
            f"{torch.__version__}, built for CUDA {torch.version.cuda}, CUDA_VISIBLE_DEVICES="
            f"{os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')}): use --device cpu or auto, "
            f"or run where a GPU is visible")
    count = torch.cuda.device_count()
    if device.startswith("cuda:"):
        index = int(device.split(":", 1)[1])
        if not 0 <= index < count:
            raise DeviceError(f"{device} does not exist: this node has {count} GPU(s)")
    else:
        rank, size = node_local(comm)
        index = rank % count
        if size > count and not _warned_sharing:
            _warned_sharing = True
            warnings.warn(f"{size} ranks on this node share {count} GPU(s) (rank r uses GPU "
                          f"r % {count}): run at most {count} ranks per node for full speed",
                          stacklevel=2)
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def _libmpi() -> Any:
    """The loaded MPI library, for MPIX extension queries mpi4py does not wrap."""
    failfast.mpi()  # loads libmpi

    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libmpi" in line}
    except OSError:
        paths = set()
    for path in sorted(paths):
        if os.path.basename(path).startswith("libmpi.") or \
                os.path.basename(path).startswith("libmpi_"):
            return ctypes.CDLL(path)
    return ctypes.CDLL(None)


def cuda_aware_mpi() -> bool:
    """Whether MPI can read and write CUDA device memory directly.

    ``FXPAR_CUDA_AWARE=1``/``0`` decides when set (for MPIs that cannot say). Otherwise MPICH
    and Open MPI answer ``MPIX_Query_cuda_support()`` at run time; MVAPICH2-GDR is CUDA-aware
    with ``MV2_USE_CUDA=1``; anything else is assumed not to be (device tensors are then staged
    through pinned host memory: correct, one host copy slower)."""
    env = setting("cuda_aware")
    if env in ("0", "1"):
        return env == "1"
    if env:
        raise ValueError(f"FXPAR_CUDA_AWARE={env!r}: use 1 (MPI reads device memory) or 0")
    MPI = failfast.mpi()
    query = getattr(MPI, "Query_cuda_support", None)  # in case a later mpi4py wraps it
    if query is not None:
        return bool(query())
    try:
        fn = _libmpi().MPIX_Query_cuda_support
    except (AttributeError, OSError):
        fn = None
    if fn is not None:
        fn.restype = ctypes.c_int
        fn.argtypes = []
        return bool(fn())
    return "MVAPICH2-GDR" in MPI.Get_library_version() and os.environ.get("MV2_USE_CUDA") == "1"
