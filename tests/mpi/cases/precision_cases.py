"""Mixed precision (``Plan(precision="bf16" | "fp16")``) vs one process under ``torch.autocast``
with the same chunking (run by tests/mpi/test_precision.py): loss, every gradient, parameters and
buffers after each of 5 SGD steps, element-wise within the compute dtype's tolerance
(``MIXED_RTOL`` of each tensor's largest value), under SP, PP and SP+PP; float32 master weights;
fp16's loss scale against ``torch.amp.GradScaler``; an inf injected on one rank skips the step
on every rank and halves the scale."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from helpers.transparency import sub_comm
from torch import nn

import fxpar

P = fxpar.Plan
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
NOISE_FACTOR = 4.0
PERTURB = (1.0, 1 + 2 ** -12, 1 - 2 ** -12, 1 + 2 ** -11)
"""The reference run (first) and the perturbed one-process runs that measure its noise."""
STEPS = 5
WORST = [0.0]


def sgd(params):
    return torch.optim.SGD(params, lr=0.02, momentum=0.9)


class Net(nn.Module):
    """Every kind of op a spatial stage rewrites, at sizes where bfloat16 is well conditioned
    (norms over hundreds of values per channel): halo convolutions (3x3, strided, 1x1), max
    and average pooling, synchronised BatchNorm and GroupNorm, bilinear upsampling, a residual
    add, then a global mean and a linear layer. Convolutions followed by a norm have no bias
    (as in torchvision's and timm's CNNs): the norm removes it, so its gradient is zero plus
    rounding noise, which no tolerance relative to it can judge."""

    def __init__(self, classes: int = 5) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16),
                                  nn.ReLU(),
                                  nn.MaxPool2d(3, 2, 1))
        self.block = nn.Sequential(nn.Conv2d(16, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16),
                                   nn.ReLU(), nn.Conv2d(16, 16, 3, padding=1))
        self.down = nn.Sequential(nn.AvgPool2d(2),
                                  nn.Conv2d(16, 32, 3, stride=2, padding=1, bias=False),
                                  nn.GroupNorm(4, 32), nn.ReLU())
        self.up = nn.Sequential(nn.Upsample(scale_factor=2, mode="bilinear"),
                                nn.Conv2d(32, 32, 1), nn.ReLU())
        self.head = nn.Linear(32, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        x = torch.relu(x + self.block(x))
        x = self.up(self.down(x))
        return self.head(x.mean((2, 3)))


class Net3d(nn.Module):
    """A volume classifier: 3x3x3 convolutions, BatchNorm3d, a 3-D max pool (on autocast's
    CPU float32 list: the pass casts its input back to float32), trilinear upsampling."""

    def __init__(self, classes: int = 5) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv3d(3, 8, 3, padding=1, bias=False), nn.BatchNorm3d(8), nn.ReLU(),
            nn.MaxPool3d(2), nn.Conv3d(8, 16, 3, padding=1, bias=False), nn.BatchNorm3d(16),
            nn.ReLU(), nn.Upsample(scale_factor=2, mode="trilinear"), nn.Conv3d(16, 16, 1))
        self.head = nn.Linear(16, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x).mean((2, 3, 4)))


def reference_step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor,
                   y: torch.Tensor, chunks: int, dtype: torch.dtype,
                   scaler: torch.amp.GradScaler | None) -> float:
    """One step of plain PyTorch under autocast, ``chunks`` parts with gradient accumulation."""
    opt.zero_grad(set_to_none=True)
    total = 0.0
    for xc, yc in zip(torch.tensor_split(x, chunks), torch.tensor_split(y, chunks), strict=True):
        with torch.autocast("cpu", dtype=dtype):
            loss = F.cross_entropy(model(xc), yc) / chunks
        (loss if scaler is None else scaler.scale(loss)).backward()
        total += loss.item()
    if scaler is None:
        opt.step()
    else:
        scaler.step(opt)
        scaler.update()
    return total


def close(what: str, got: torch.Tensor | float, want: torch.Tensor | float,
          noise: torch.Tensor | float, eps: float, failures: list[str] | None,
          exact: bool = False) -> None:
    """``|got - want| <= NOISE_FACTOR * max(noise, eps * max|want|)`` at every element, where
    ``noise`` is how far one process moves by itself under a perturbation below the dtype's
    resolution (:func:`check_mixed`)."""
    got, want = torch.as_tensor(got).double(), torch.as_tensor(want).double()
    scale = max(float(torch.as_tensor(noise).double().abs().max()),
                eps * float(want.abs().max()), 1e-12)
    err = float((got - want).abs().max())
    WORST[0] = max(WORST[0], err / scale)
    if exact and err > 0:
        message = f"{what}: max |diff| {err:.3g}, expected bit-identical"
    elif err > NOISE_FACTOR * scale:
        message = (f"{what}: max |diff| {err:.3g} > {NOISE_FACTOR} x {scale:.3g} (one "
                   f"process's own noise)")
    else:
        return
    if failures is None:
        raise AssertionError(message)
    failures.append(message)


def _spread(values: list[Any]) -> torch.Tensor:
    """Largest distance of the perturbed runs from the first, element-wise."""
    first = torch.as_tensor(values[0]).double()
    return torch.stack([(torch.as_tensor(v).double() - first).abs() for v in values[1:]]).amax(0)


def check_mixed(build: Callable[[], nn.Module], shape: tuple[int, ...], plan: fxpar.Plan,
                precision: str, classes: int = 5, failures: list[str] | None = None) -> None:
    """``build()`` compiled with ``plan`` at ``precision`` vs one process under autocast in the
    same dtype with the same chunking (``torch.amp.GradScaler`` for fp16), STEPS SGD steps.

    Low-precision training of a network with BatchNorm is chaotic at the last bit: a second
    one-process run on the input scaled by 1 + 2**-12 (below bfloat16's and float16's
    resolution) moves conv-weight gradients by up to a few percent of their largest value.
    That second run's distance is the yardstick: every tensor of the compiled program must be
    within NOISE_FACTOR times it (or times the dtype's epsilon relative to the tensor's largest
    value, whichever is larger) of the first run. With ``failures`` given, failures are
    appended to it instead of raised (every rank finishes every step). Plans without spatial
    stages or GEMS run the same kernels on the same values and add gradients in the same order
    as one process: bit-identical."""
    plan = P(**{**plan.to_json(), "precision": precision})
    comm = sub_comm(plan.world_size)
    if comm is None:
        return
    torch.manual_seed(0)
    model = build().float()
    refs = [copy.deepcopy(model) for _ in PERTURB]
    g = torch.Generator().manual_seed(1)
    x = torch.randn(shape, generator=g)
    y = torch.randint(0, classes, (shape[0],), generator=g)
    xs = [x * f for f in PERTURB]
    program = fxpar.compile(model, plan, torch.empty(shape, device="meta"), optimizer=sgd,
                            comm=comm)
    rp = program.local(comm)
    opts = [sgd(r.parameters()) for r in refs]
    dtype = DTYPES[precision]
    scalers = [torch.amp.GradScaler("cpu") if precision == "fp16" else None for _ in refs]
    params = [dict(r.named_parameters()) for r in refs]
    eps = torch.finfo(dtype).eps
    exact = not plan.spatial and not plan.gems  # GEMS sums its copies' gradients
    for step in range(STEPS):
        loss = rp.train_step(x, y)
        losses = [reference_step(r, o, xi, y, plan.chunks(), dtype, sc)
                  for r, o, xi, sc in zip(refs, opts, xs, scalers, strict=True)]
        close(f"step {step} loss", loss, losses[0], _spread(losses), eps, failures,
              exact)
        for name, p in rp.named_parameters():
            assert p.dtype == torch.float32, f"{name} is {p.dtype}: master weights are float32"
            want = params[0][name]
            close(f"step {step} grad of {name}", p.grad, want.grad,
                  _spread([q[name].grad for q in params]), eps, failures, exact)
            close(f"step {step} {name}", p.detach(), want.detach(),
                  _spread([q[name].detach() for q in params]), eps, failures, exact)
        states = [r.state_dict() for r in refs]
        for name, b in rp.state_dict().items():
            if b.is_floating_point() and name not in params[0]:
                close(f"step {step} buffer {name}", b, states[0][name],
                      _spread([st[name] for st in states]), eps, failures, exact)
        if scalers[0] is not None:
            assert rp.loss_scale is not None
            assert rp.loss_scale.scale == scalers[0].get_scale(), \
                (rp.loss_scale, scalers[0].get_scale())
    print(f"[{precision} {plan.world_size} ranks] worst err / noise {WORST[0]:.3f}", flush=True)
    WORST[0] = 0.0


def _fp32_step(model, opt, x, y, chunks) -> float:
    opt.zero_grad(set_to_none=True)
    total = 0.0
    for xc, yc in zip(torch.tensor_split(x, chunks), torch.tensor_split(y, chunks), strict=True):
        loss = F.cross_entropy(model(xc), yc) / chunks
        loss.backward()
        total += loss.item()
    opt.step()
    return total


SHAPE = (4, 3, 64, 64)


def case_bf16_one_rank() -> None:
    check_mixed(Net, SHAPE, P(), "bf16")


def case_bf16_sp4() -> None:
    check_mixed(Net, SHAPE, P(spatial_parts=4), "bf16")


def case_bf16_pp2() -> None:
    check_mixed(Net, SHAPE, P(stages=2, microbatches=2, schedule="1f1b"), "bf16")


def case_bf16_sp2_pp2() -> None:
    check_mixed(Net, SHAPE, P(stages=2, spatial_parts=2, microbatches=2), "bf16")


def case_bf16_gems_dp2() -> None:
    check_mixed(Net, (8, 3, 64, 64), P(stages=2, gems=True, data_parallel=2, microbatches=2),
                "bf16")


def case_bf16_sp2_gems() -> None:
    check_mixed(Net, SHAPE, P(stages=2, spatial_parts=2, gems=True, microbatches=2), "bf16")


def case_bf16_volume_cube4() -> None:
    check_mixed(Net3d, (2, 3, 16, 16, 16), P(spatial_parts=4, slice="cube"), "bf16")


def case_fp16_sp4() -> None:
    check_mixed(Net, SHAPE, P(spatial_parts=4), "fp16")


def case_fp16_sp2_pp2() -> None:
    check_mixed(Net, SHAPE, P(stages=2, spatial_parts=2, microbatches=2), "fp16")


def case_bf16_sp4_zeroed_halo_piece_is_caught() -> None:
    """The noise-relative check sees a halo piece gone wrong: rank 0 zeroes the first piece
    of every forward halo exchange it sends (the fp64 suites catch far smaller errors; this
    shows the bf16 yardstick is not so loose that a broken exchange passes)."""
    from fxpar.comm.world import world
    from fxpar.runtime.spatial import exchange

    failures: list[str] = []
    original = exchange.swap

    def swap(like: Any, comm: Any, tag: int, recvs: Any, sends: Any) -> Any:
        if world().rank == 0 and sends and tag % 2 == 0:  # forward tags are even
            sends = [(sends[0][0], sends[0][1].mul(0)), *sends[1:]]
        return original(like, comm, tag, recvs, sends)

    exchange.swap = swap
    try:
        check_mixed(Net, SHAPE, P(spatial_parts=4), "bf16", failures=failures)
    finally:
        exchange.swap = original
    reports = world().allgather_object(failures[:2])
    assert any(reports), "a zeroed halo piece under bf16 went unnoticed"
    print("caught:", next(r for r in reports if r)[0])


def case_fp16_inf_on_one_rank_skips_the_step_everywhere() -> None:
    """SP2 + PP2 in float16: an inf in one gradient on one rank (the last, which holds the
    second stage) at step 2 skips that optimizer step on all 3 ranks and halves the scale on
    all of them; the steps before and after go ahead, and the returned loss stays finite."""

    plan = P(stages=2, spatial_parts=2, microbatches=2, precision="fp16")
    comm = sub_comm(plan.world_size)
    if comm is None:
        return
    torch.manual_seed(0)
    model = Net()
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(SHAPE, generator=g), torch.randint(0, 5, (SHAPE[0],), generator=g)
    rp = fxpar.compile(model, plan, torch.empty(SHAPE, device="meta"),
                       optimizer=sgd, comm=comm).local(comm)
    assert rp.loss_scale is not None
    rp.loss_scale.growth_interval = 2  # also see it grow back
    poisoned = next(iter(rp.parameters()))
    inject = [False]
    poisoned.register_hook(lambda grad: grad * float("inf") if inject[0] else grad)
    seen = []
    for step in range(5):
        inject[0] = comm.rank == 2 and step == 2
        before = [p.detach().clone() for p in rp.parameters()]
        scale = rp.loss_scale.scale
        loss = rp.train_step(x, y)
        moved = any(not torch.equal(b, p) for b, p in zip(before, rp.parameters(), strict=True))
        seen.append((step, scale, rp.loss_scale.scale, moved, rp.loss_scale.skipped))
        assert torch.isfinite(torch.tensor(loss)), (step, loss)
    everyone = comm.allgather_object(seen)
    assert all(s == everyone[0] for s in everyone), everyone  # one decision on every rank
    want = [(0, 65536.0, 65536.0, True, 0), (1, 65536.0, 131072.0, True, 0),
            (2, 131072.0, 65536.0, False, 1), (3, 65536.0, 65536.0, True, 1),
            (4, 65536.0, 131072.0, True, 1)]
    assert everyone[0] == want, everyone[0]


def case_fp16_checkpoint_keeps_the_loss_scale() -> None:
    """SP2 in float16 with a scale that changes every step: a job resumed from a checkpoint
    taken after step 2 continues bit for bit like the job that kept going (parameters and
    scale), because the checkpoint holds the scale."""
    import shutil
    import tempfile

    from fxpar.program import checkpoint

    plan = P(spatial_parts=2, precision="fp16")
    comm = sub_comm(plan.world_size)
    if comm is None:
        return
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(SHAPE, generator=g), torch.randint(0, 5, (SHAPE[0],), generator=g)
    folder = comm.bcast_object(tempfile.mkdtemp() if comm.rank == 0 else None)

    def job() -> fxpar.RankProgram:
        torch.manual_seed(0)
        rp = fxpar.compile(Net(), plan, torch.empty(SHAPE, device="meta"),
                           optimizer=sgd, comm=comm).local(comm)
        assert rp.loss_scale is not None
        rp.loss_scale.growth_interval = 1
        return rp

    first = job()
    for _ in range(2):
        first.train_step(x, y)
    checkpoint.save(first, folder, step=2)
    for _ in range(2):
        first.train_step(x, y)
    second = job()
    assert checkpoint.load(second, folder) == 2
    for _ in range(2):
        second.train_step(x, y)
    assert first.loss_scale == second.loss_scale and first.loss_scale.scale == 2.0 ** 20
    for (name, p), q in zip(first.named_parameters(), second.parameters(), strict=True):
        assert torch.equal(p, q), name
    comm.allgather_object(None)  # everyone has read it
    if comm.rank == 0:
        shutil.rmtree(folder)
