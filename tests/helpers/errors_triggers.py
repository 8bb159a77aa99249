"""The triggers of tests/helpers/errors_catalogue.py: tiny models and functions that raise
each error.

Each runs in an empty scratch folder (the current directory) and uses relative paths there.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np
import torch
from torch import nn

import fxpar
from fxpar import Plan
from fxpar.comm import failfast, watchdog
from fxpar.compiler.passdriver import run_passes
from fxpar.program import checkpoint as ckpt


# -- small things the triggers use --------------------------------------------------------------
class FakeComm:
    """Stands in for the job's communicator where only its size and rank are read."""

    def __init__(self, size: int, rank: int = 0) -> None:
        self.size, self.rank = size, rank


def cnn(channels: int = 3) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(channels, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
                         nn.Conv2d(4, 4, 3, padding=1), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(4, 3))


def build(plan: Plan | None = None, shape: tuple[int, ...] = (4, 3, 8, 8),
             **kw: Any) -> fxpar.Program:
    return fxpar.compile(kw.pop("model", None) or cnn(), plan or Plan(), shape, **kw)


def sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1)


class Gate(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x if x.sum() > 0 else -x


class Gated(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.gate = Gate()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gate(self.conv(x))


class DataDependent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x)
        if y.sum() > 0:
            return y
        return -y


class Table(nn.Module):
    """A module with a meta tensor and no reset_parameters()."""

    def __init__(self) -> None:
        super().__init__()
        self.g = nn.Parameter(torch.empty(4, 1, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.g


class Twice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 3, 3, padding=1)
        self.mid = nn.Sequential(*[nn.Conv2d(3, 3, 1) for _ in range(4)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(self.mid(self.conv(x)))


def conv_then(*layers: nn.Module) -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), *layers)


def saved(plan: Plan, folder: str = "job", **kw: Any) -> str:
    build(plan, **kw).save(folder)
    return folder


def saved_checkpoint(folder: str = "ckpt", optimizer: Any = None) -> fxpar.RankProgram:
    rp = build(optimizer=optimizer).for_rank(0)
    ckpt.save(rp, folder, step=3)
    return rp


def images(root: str = "images", n: int = 2, shape: tuple[int, ...] = (3, 8, 8)) -> str:
    for label in ("cat", "dog"):
        (Path(root) / label).mkdir(parents=True, exist_ok=True)
        for i in range(n):
            np.save(Path(root) / label / f"{i}.npy", np.zeros(shape, np.float32))
    return root


def run_setup(argv: list[str]) -> Any:
    from fxpar.cli import run

    return run.setup(run.parser().parse_args(argv))


def run_inspect(argv: list[str]) -> Any:
    from fxpar.cli import inspect

    return inspect._main(inspect.parser().parse_args(argv))  # main() prints what this raises


def torn_checkpoint() -> None:
    rp = saved_checkpoint()
    path = ckpt.resolve("ckpt") / ckpt.MANIFEST
    manifest = json.loads(path.read_text())
    manifest["step"] = 4
    path.write_text(json.dumps(manifest))
    ckpt.load(rp, "ckpt")


def shard_missing() -> None:
    rp = saved_checkpoint()
    (ckpt.resolve("ckpt") / ckpt.shard_name(0)).unlink()
    ckpt.load(rp, "ckpt")


def version_missing() -> None:
    saved_checkpoint()
    shutil.rmtree(ckpt.resolve("ckpt"))
    ckpt.read_manifest("ckpt")


def bad_pointer() -> None:
    Path("ckpt").mkdir()
    Path("ckpt", ckpt.LATEST).write_text("step 4")
    ckpt.read_manifest("ckpt")


def foreign_manifest(folder: str, name: str, text: dict[str, Any]) -> str:
    Path(folder).mkdir()
    Path(folder, name).write_text(json.dumps(text))
    return folder


def damaged_checkpoint(how: str = "truncate") -> fxpar.RankProgram:
    """Steps 3 and 4 saved in ckpt/, step 4 with its shard damaged by FXPAR_FAULT."""
    rp = saved_checkpoint()
    with mock.patch.dict(os.environ, {"FXPAR_FAULT": f"0:4:corrupt-checkpoint:{how}"}):
        ckpt.save(rp, "ckpt", step=4)
    return rp


def unchecked_unreadable() -> None:
    """A checkpoint saved before checksums, whose shard was cut short."""
    rp = saved_checkpoint()
    version = ckpt.resolve("ckpt")
    manifest = json.loads((version / ckpt.MANIFEST).read_text())
    for entry in manifest["ranks"]:
        del entry["size"], entry["sha256"]
    (version / ckpt.MANIFEST).write_text(json.dumps(manifest))
    shard = version / ckpt.shard_name(0)
    shard.write_bytes(shard.read_bytes()[:200])
    ckpt.load(rp, "ckpt")


def manifest_not_json() -> None:
    ckpt.save(saved_checkpoint(), "ckpt", step=4)
    Path("ckpt", "step-00000004", ckpt.MANIFEST).write_text('{"format": "fxpar-checkpoint", ')
    ckpt.read_manifest("ckpt")


class PeerLoads(FakeComm):
    """Rank 0 of two, whose peer could load: allgather gives [this rank's object, None]."""

    def __init__(self) -> None:
        super().__init__(2)

    def allgather_object(self, obj: object) -> list[object]:
        return [obj, None]


def peer_cannot_load() -> None:
    """What every rank raises when one rank's shard is damaged (here rank 0's)."""
    rp = damaged_checkpoint()
    rp.comm = PeerLoads()  # type: ignore[assignment]
    ckpt.load(rp, "ckpt")


def device_no_cuda() -> None:
    from fxpar.comm.device import bind

    with mock.patch("torch.cuda.is_available", return_value=False), \
            mock.patch.object(torch, "__version__", "2.x"), \
            mock.patch.object(torch.version, "cuda", None), \
            mock.patch.dict(os.environ, {"CUDA_VISIBLE_DEVICES": ""}):
        bind(None, "cuda")


def device_index() -> None:
    from fxpar.comm.device import bind

    with mock.patch("torch.cuda.is_available", return_value=True), \
            mock.patch("torch.cuda.device_count", return_value=1):
        bind(None, "cuda:2")


def cuda_aware() -> None:
    from fxpar.comm.device import cuda_aware_mpi

    with mock.patch.dict(os.environ, {"FXPAR_CUDA_AWARE": "yes"}):
        cuda_aware_mpi()


def moved_after_step() -> None:
    rp = build(optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)).local()
    rp.train_step(torch.randn(4, 3, 8, 8), torch.tensor([0, 1, 2, 0]))
    rp.to("meta")


def no_dot() -> None:
    from fxpar.report import draw

    with mock.patch("shutil.which", return_value=None):
        draw.render_svg(None, "graph.svg")  # type: ignore[arg-type]


def no_graphviz_package() -> None:
    """--dot where the graphviz Python package (the viz extra) is not installed."""
    from fxpar.report import draw

    with mock.patch.dict("sys.modules", {"graphviz": None}):  # None: import raises
        draw.program_dot(build(Plan(stages=2)))


def no_communicator() -> None:
    with mock.patch("sys.stderr"):  # the runtime also prints the step x rank grid there
        build(Plan(stages=2)).for_rank(0).train_step(torch.randn(4, 3, 8, 8), None)


def meta_model() -> None:
    with torch.device("meta"):
        model = nn.Sequential(conv_then(), Table())
    build(model=model).for_rank(0)


def failing_loss() -> None:
    def loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        raise ValueError("my loss needs float targets")

    with mock.patch("sys.stderr"):  # the runtime also prints the step x rank grid there
        build(loss_fn=loss).local().train_step(torch.randn(4, 3, 8, 8), torch.zeros(4))


def shared_attribute() -> None:
    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Conv2d(3, 3, 1), nn.Conv2d(3, 3, 1)
            self.register_buffer("scale", torch.ones(1))  # a tensor, not a parameter

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(self.a(x) * self.scale) * self.scale

    build(Plan(stages=2, balance=(2, 2)), model=Scaled())


def pass_bug() -> None:
    gm = fxpar.trace(cnn(), (4, 3, 8, 8))
    run_passes(gm, Plan(), [("my_pass", lambda gm, plan: gm.no_such_method())])


Said = tuple[dict[str, str] | None, str | None]
"""What a rank sends in the start-up check: (fingerprint, error)."""


class Gathering(FakeComm):
    """A communicator whose allgather returns what the ranks would have sent."""

    def __init__(self, everyone: list[Said]) -> None:
        super().__init__(len(everyone))
        self.everyone = everyone

    def allgather_object(self, obj: object) -> list[Said]:
        return self.everyone


def agree(everyone: list[Said]) -> None:
    failfast.agree(Gathering(everyone), everyone[0][0], everyone[0][1])


def rank_failed() -> str:
    return (failfast.failure_banner(2, 4) + "\nTraceback (most recent call last):\n  File "
            "\"train.py\", line 12, in <module>\n    ...\nValueError: my loss needs float targets")


def watchdog_fired() -> str:
    return watchdog.watchdog_message(3, 600, "receive of (2, 64, 32, 32) float32 from rank 1 "
                                     "(tag 14)", " (while running action 1RECV_F0)")


class MixedDtypes(nn.Module):
    """Parameters of two dtypes (float32 convolution, float64 scale)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.scale = nn.Parameter(torch.ones(1, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.conv(x) * self.scale.float()).mean((2, 3))


def mixed_dtypes() -> None:
    fxpar.compile(MixedDtypes(), Plan(data_parallel=2), torch.empty(2, 3, 8, 8, device="meta"))


def too_many_tags() -> None:
    mbs = 16385  # one tensor crosses the cut: tags up to 2 x 16385 - 1 = 32769
    build(Plan(stages=2, microbatches=mbs), shape=(mbs, 3, 8, 8))


class SmallTagComm(FakeComm):
    """An MPI whose MPI_TAG_UB is 5."""

    tag_ub = 5


def small_tag_ub() -> None:
    build(Plan(stages=2, microbatches=4)).for_rank(0, SmallTagComm(2))  # type: ignore[arg-type]
