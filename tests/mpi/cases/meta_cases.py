"""Compiling models built on the meta device, under a real mpiexec (run by
tests/mpi/test_programs.py, 4 ranks, float64).

Each rank must hold real memory for its own stages only, with the values a single process gets
from ``materialize_model`` on the same meta model (bitwise), and then train like it."""

import copy

import torch
import torch.nn.functional as F
from helpers.equivalence import RTOL64, assert_same, atol64, reference_step
from helpers.transparency import sgd, sub_comm
from torch import nn

import fxpar
from fxpar import models
from fxpar.runtime.materialize import materialize_model


class Scaled(nn.Module):
    """A residual branch scaled by a parameter the block owns itself (like ConvNeXt's layer
    scale): traced through, so stages read ``gamma`` by get_attr, and it has no
    reset_parameters, so it needs ``init=``."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)
        self.gamma = nn.Parameter(torch.empty(1, channels, 1, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.gamma * self.conv(x)


def _scaled_net() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                         Scaled(8), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
                         Scaled(8), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 5))


def _init(name: str, module: nn.Module) -> None:
    if isinstance(module, Scaled):
        nn.init.normal_(module.gamma, std=0.5)
    else:
        module.reset_parameters()


def _nbytes(tensors) -> int:
    seen = {id(t): t for t in tensors}
    return sum(t.numel() * t.element_size() for t in seen.values())


def _train_like_one_process(build, plan, shape, seed=0, init=None, check_memory=False):
    comm = sub_comm(plan.world_size)
    if comm is None:
        return
    with torch.device("meta"):
        model = build().double()
    reference = copy.deepcopy(model)  # still meta: materialised whole below
    whole = _nbytes(model.parameters())
    program = fxpar.compile(model, plan, torch.empty(shape, dtype=torch.float64, device="meta"),
                            optimizer=sgd, seed=seed, init=init, comm=comm)
    rp = program.local(comm)

    mine = {r.stage for r in program.rank_map.roles_of(comm.rank)}
    for s, gm in enumerate(program.graph.modules):
        tensors = [*gm.parameters(), *gm.buffers()]
        on_meta = [t.is_meta for t in tensors]
        if s in mine:
            assert not any(on_meta), f"rank {comm.rank}: stage {s} not materialised"
        else:
            assert all(on_meta), f"rank {comm.rank}: stage {s} of another rank materialised"
    for m in rp.stages.values():
        assert not any(t.is_meta for t in [*m.parameters(), *m.buffers()])
    if check_memory:  # the model's real memory is exactly this rank's stages' parameters
        stage_bytes = _nbytes(p for s in mine for p in program.graph.modules[s].parameters())
        real = _nbytes(p for p in model.parameters() if not p.is_meta)
        assert real == stage_bytes == _nbytes(rp.parameters()), (real, stage_bytes)
        assert real < whole
        held = comm.gather_object(real)
        if comm.rank == 0:
            print(f"parameter bytes per rank {held} of {whole} for the whole model", flush=True)

    # one process's reference runs on rank 0 only (N oversubscribed ranks each repeating the
    # whole model's step would cost N times the CPU); every rank's tensors are compared there
    reference = materialize_model(reference, seed=seed, init=init) if comm.rank == 0 else None
    _compare(comm, rp, reference, "initial", exact=True)  # the values one process draws
    g = torch.Generator().manual_seed(1)
    ref_opt = sgd(reference.parameters()) if reference is not None else None
    for step in range(2):
        x = torch.randn(shape, dtype=torch.float64, generator=g)
        y = torch.randint(0, 5, (shape[0],), generator=g)
        loss = rp.train_step(x, y)
        if reference is not None:
            ref_loss = reference_step(reference, ref_opt, x, y, plan.chunks(), F.cross_entropy)
            assert_same(f"step {step} loss", loss, ref_loss, atol64(step), RTOL64)
        _compare(comm, rp, reference, f"step {step}", atol=atol64(step))


def _compare(comm, rp, reference, when: str, exact: bool = False, atol: float = 0.0) -> None:
    """Every rank's (copy, stage) state and gradients against ``reference`` (on rank 0)."""
    mine = [(f"rank {comm.rank} copy {c} stage {s}", m.state_dict(),
             {n: p.grad for n, p in m.named_parameters()}) for (c, s), m in rp.stages.items()]
    everyone = comm.gather_object(mine)
    if reference is None:
        return
    want = reference.state_dict()
    grads = {n: p.grad for n, p in reference.named_parameters()}
    for where, state, got_grads in (x for part in everyone for x in part):
        for k, v in state.items():
            if exact:
                assert torch.equal(v, want[k]), f"{when}: {where}: {k} differs"
            else:
                assert_same(f"{when}: {where}: {k}", v, want[k], atol, RTOL64)
        for k, g in got_grads.items():
            assert_same(f"{when}: {where}: grad of {k}", g, grads[k], atol, RTOL64)


def case_meta_resnet_spatial_pipeline():
    plan = fxpar.Plan(stages=3, spatial_parts=2, microbatches=2, schedule="1f1b")
    _train_like_one_process(lambda: models.build("resnet_v2", depth=14, num_classes=5), plan,
                            (4, 3, 32, 32), seed=3, check_memory=True)


def case_meta_init_fn_spatial_gems():
    # get_attr parameters in tile modules and in the GEMS mirror's deep copies
    plan = fxpar.Plan(stages=3, spatial_parts=2, gems=True)
    _train_like_one_process(_scaled_net, plan, (4, 3, 16, 16), init=_init)
