"""The training recipe under a real mpiexec (run by tests/mpi/test_schedule_ema.py, float64):
fxpar.Trainer with an LR schedule, a moving average of the weights, gradient clipping and
accumulation, against the same recipe on one process in plain PyTorch (tests/helpers/
recipe.py): every step's loss, every parameter, the optimizer's and the scheduler's state and
the average (this rank's shard, and gathered whole on rank 0), under SP2, SP4 square,
SP2+PP2 (whose last stage holds no parameter: its rank schedules a placeholder optimizer),
SP2+DP2 and GEMS. Resuming from a checkpoint in the middle (SP2+PP2, GEMS) ends bitwise where
the uninterrupted run ends, schedule and average included."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F
from helpers.equivalence import RTOL64, assert_same, atol64
from helpers.recipe import Plain, train_plain
from helpers.transparency import CAPTURES, sub_comm
from torch import nn

import fxpar
from fxpar.train import schedules
from fxpar.train.evaluate import Validation

SHAPE = (4, 3, 16, 16)
CLASSES = 5
STEPS = 6  # batches: 3 optimizer steps of 2 accumulated batches


def _net() -> nn.Module:
    """Conv-BN-ReLU-conv to CLASSES channels, then a pool: its last stage (ReLU, pool,
    flatten) holds no parameter when cut in two."""
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.Conv2d(8, CLASSES, 3, padding=1), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten())


def _batches(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return (torch.randn(SHAPE, dtype=torch.float64, generator=g),
            torch.randint(0, CLASSES, (SHAPE[0],), generator=g))


def _adamw(params):
    return torch.optim.AdamW(params, lr=0.02, weight_decay=0.05)


def _sgd(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-4)


# (optimizer, schedule, clipping): one recipe per plan, so the suite covers each schedule
COSINE = (_adamw, schedules.warmup_cosine(3, warmup=1), {"clip_grad": 0.05})
POLY = (_adamw, schedules.polynomial(3, warmup=1), {"clip_grad": 0.05})
ONE_CYCLE = (_sgd, schedules.one_cycle(3), {"clip_value": 0.01})


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return _net().double()


class _Samples:
    """A validation source: sample i (the whole image, whatever the window) at step i."""

    def batch(self, step: int, window: object) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(500 + step)
        return (torch.randn((1, *SHAPE[1:]), dtype=torch.float64, generator=g),
                torch.randint(0, CLASSES, (1,), generator=g))


def _val() -> Validation:
    """6 validation images: a padded second batch."""
    return Validation(_Samples(), samples=6, task="classify", classes=CLASSES, shape=SHAPE,
                      dtype=torch.float64)


def _ema_eval_loss(plain: Plain, val: Validation) -> float:
    """The validation loss of one process's averaged weights, in eval mode."""
    model = _model(0)
    model.load_state_dict(plain.ema)
    model.eval()
    xs, ys = zip(*(val.source.batch(i, None) for i in range(val.samples)), strict=True)
    with torch.no_grad():
        return F.cross_entropy(model(torch.cat(xs)), torch.cat(ys)).item()


def _trainer(plan: fxpar.Plan, comm, recipe, seed: int = 0, val: Validation | None = None,
             **config) -> fxpar.Trainer:
    optimizer, schedule, clip = recipe
    program = fxpar.compile(_model(seed), plan, torch.empty(SHAPE, dtype=torch.float64,
                                                            device="meta"),
                            optimizer=optimizer, comm=comm, captures=CAPTURES)
    config = {"steps": STEPS, "log_every": STEPS, **config}
    return fxpar.Trainer(program.local(comm), fxpar.TrainConfig(
        lr_schedule=schedule, ema=0.9, accumulate=2, **clip, **config), _batches, val=val)


def _worst(name: str, got: torch.Tensor, want: torch.Tensor, worst: dict[str, float]) -> None:
    assert_same(name, got, want, atol64(1), RTOL64)
    d = (got.detach().double() - want.detach().double()).abs().max().item() if got.numel() \
        else 0.0
    kind = name.split()[0]
    worst[kind] = max(worst.get(kind, 0.0), d)


def _compare(t: fxpar.Trainer, plain: Plain, losses: list[float], what: str) -> None:
    """Everything the recipe determines, on every rank, against one process."""
    rp, ref = t.rp, plain.model
    worst: dict[str, float] = {}
    for step, (got, want) in enumerate(zip(losses, plain.losses, strict=True)):
        assert_same(f"step {step} loss", got, want, atol64(step), RTOL64)
        worst["loss"] = max(worst.get("loss", 0.0), abs(got - want))
    ref_params = dict(ref.named_parameters())
    for name, p in rp.named_parameters():  # both GEMS copies, where a rank holds two
        _worst(f"parameter {name}", p, ref_params[name], worst)
        for k, v in rp.optimizer.state[p].items():
            _worst(f"optimizer {k} of {name}", v, plain.optimizer.state[ref_params[name]][k],
                   worst)
    ref_state = ref.state_dict()
    for k, v in rp.state_dict().items():
        _worst(f"buffer {k}", v, ref_state[k], worst)
    # the schedule: the same LR sequence, exactly, on every rank (a placeholder's included)
    sched = t.recipe.schedule
    assert sched.scheduler.state_dict() == plain.scheduler.state_dict(), what
    assert sched.lr == plain.optimizer.param_groups[0]["lr"], what
    ema = t.recipe.ema
    assert ema.updates == STEPS // 2
    for k, v in ema.shadow.items():
        _worst(f"ema {k}", v, plain.ema[k], worst)
    full, ema_full = rp.full_state_dict(), ema.full_state_dict()
    if rp.rank == 0:
        assert list(full) == list(ema_full) == list(ref_state)
        for k, v in ema_full.items():
            _worst(f"ema {k}", v, plain.ema[k], worst)
    every = rp.comm.gather_object(worst, root=0)
    if rp.rank == 0:
        merged = {k: max(w.get(k, 0.0) for w in every) for k in every[0]}
        print(f"max |diff| {what}: " + ", ".join(f"{k} {v:.2e}" for k, v in merged.items()),
              flush=True)


def _recorded(rp: fxpar.RankProgram) -> list[float]:
    """The loss of every train_step call of ``rp`` from now on (the Trainer prints them)."""
    losses: list[float] = []
    step = rp.train_step

    def recording(*args, **kwargs) -> float:
        losses.append(step(*args, **kwargs))
        return losses[-1]
    rp.train_step = recording  # type: ignore[method-assign]
    return losses


def _transparent(plan: fxpar.Plan, recipe, what: str, resume: bool = False) -> None:
    comm = sub_comm(plan.world_size)
    if comm is None:
        return
    folder = Path(comm.bcast_object(tempfile.mkdtemp(prefix="fxpar-recipe-")
                                    if comm.rank == 0 else None)) if resume else None
    # resuming: checkpoints every 2 steps, and validation with the average after the last
    saving = {"checkpoint": folder, "checkpoint_every": 2, "ema_eval": True} if resume else {}
    t = _trainer(plan, comm, recipe, val=_val() if resume else None, **saving)
    losses = _recorded(t.rp)
    t.train(0, t.after_step)  # with the checkpoints (steps 2, 4 and 6) when resuming
    optimizer, schedule, clip = recipe
    plain = train_plain(_model(0), optimizer, _batches, STEPS, chunks=plan.chunks(),
                        accumulate=2, schedule=schedule, ema=0.9, **clip)
    _compare(t, plain, losses, what)
    if t.rp.optimizer is None:
        assert t.recipe.schedule.placeholder is not None
    if what == "SP2+PP2":  # its last stage's rank has no parameter
        assert any(comm.allgather_object(t.rp.optimizer is None))
    if not resume:
        return
    assert t.evals is not None
    (m,) = t.evals.history
    want = _ema_eval_loss(plain, t.evals.val)
    assert_same("validation loss of the average", m["loss"], want, atol64(1), RTOL64)
    if comm.rank == 0:
        print(f"max |diff| {what}: validation loss with the average "
              f"{abs(m['loss'] - want):.2e}", flush=True)
    # from step 4 of 6 (a fresh, differently initialised model), to the end
    again = _trainer(plan, comm, recipe, seed=7, resume=folder / "step-00000004")
    assert again.resume() == 4
    again.train(4)
    got, want = again.rp, t.rp
    for (c, s), m in sorted(want.stages.items()):
        for k, v in m.state_dict().items():
            assert torch.equal(got.stages[(c, s)].state_dict()[k], v), f"{k} after resume"
    for (name, p), (_, q) in zip(got.named_parameters(), want.named_parameters(), strict=True):
        for k, v in want.optimizer.state[q].items():
            assert torch.equal(got.optimizer.state[p][k], v), f"{k} of {name} after resume"
    assert again.recipe.schedule.state_dict() == t.recipe.schedule.state_dict()
    assert again.recipe.ema.updates == t.recipe.ema.updates
    for k, v in t.recipe.ema.shadow.items():
        assert torch.equal(again.recipe.ema.shadow[k], v), f"ema {k} after resume"
    comm.barrier()
    if comm.rank == 0:
        shutil.rmtree(folder)


def case_sp2_one_cycle_clip_value():
    _transparent(fxpar.Plan(spatial_parts=2), ONE_CYCLE, "SP2")


def case_sp4_square_poly():
    _transparent(fxpar.Plan(spatial_parts=4, slice="square"), POLY, "SP4 square")


def case_sp2_pp2_cosine_resume():
    _transparent(fxpar.Plan(stages=2, microbatches=2, spatial_parts=2), COSINE, "SP2+PP2",
                 resume=True)


def case_sp2_dp2_cosine():
    _transparent(fxpar.Plan(spatial_parts=2, data_parallel=2), COSINE, "SP2+DP2")


def case_gems_one_cycle_resume():
    _transparent(fxpar.Plan(stages=2, gems=True), ONE_CYCLE, "GEMS", resume=True)
