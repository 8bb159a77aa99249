"""Fixed bugs, each kept fixed under a real mpiexec (run by tests/mpi/test_bugfixes.py, 4 ranks,
float64 against one process with tests/helpers/transparency.py's ``check``).

- Parameters and buffers the forward never uses (an ``nn.Linear`` attribute never called, a
  BatchNorm never run, a plain buffer) were dropped from the program: named_parameters,
  state_dict, full_state_dict, checkpoints and saved programs lost them. They now live on the
  last stage, get no gradient (None, as on one process, so weight decay and momentum leave them
  alone) and are saved and loaded.
- A tensor the model reaches under two names (a submodule held twice, as MONAI's DynUNet holds
  its blocks in ``skip_layers`` too) appeared under one of them only: ``full_state_dict()`` now
  has exactly the keys of ``model.state_dict()``, in its order, and loads into the model with
  ``strict=True``."""

import copy
import shutil
import tempfile
from pathlib import Path

import torch
from helpers.equivalence import assert_same
from helpers.transparency import Case, check, sgd, sub_comm
from torch import nn

import fxpar
from fxpar.program import checkpoint
from fxpar.program.loader import load

SHAPE = (4, 3, 11, 13)


class Unused(nn.Module):
    """A small CNN with modules its forward never calls and a buffer it never reads."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 6, 3, padding=1)
        self.bn = nn.BatchNorm2d(6)
        self.spare = nn.Linear(6, 4)            # never called
        self.conv2 = nn.Conv2d(6, 6, 3, padding=1)
        self.spare_bn = nn.BatchNorm2d(6)       # never called
        self.register_buffer("table", torch.arange(5.0))  # never read
        self.fc = nn.Linear(6, 5)

    def forward(self, x):
        x = torch.relu(self.bn(self.conv(x)))
        x = torch.relu(self.conv2(x))
        return self.fc(x.mean((2, 3)))


class Aliased(nn.Module):
    """The same submodule under two attribute names (``stem`` and ``skip``), used through
    both, and a second module reached under two names but used through one."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 6, 3, padding=1), nn.BatchNorm2d(6), nn.ReLU())
        self.body = nn.Conv2d(6, 6, 3, padding=1)
        self.skip = self.stem                  # an alias of stem
        self.again = nn.ModuleList([self.body])  # an alias of body
        self.fc = nn.Linear(6, 5)

    def forward(self, x):
        x = self.skip(x)
        return self.fc(torch.relu(self.body(x) + x).mean((2, 3)))


class Both(Aliased):
    """Aliases and unused modules together (as smp's PSPNet and MONAI's DynUNet)."""

    def __init__(self) -> None:
        super().__init__()
        self.spare = nn.Linear(6, 4)
        self.spare_alias = self.spare


def case_unused_parameters_lp2():
    check(Case(Unused, SHAPE, fxpar.Plan(stages=2)))


def case_unused_parameters_pp2_gems():
    check(Case(Unused, SHAPE, fxpar.Plan(stages=2, microbatches=2, gems=True)))


def case_unused_parameters_sp3():
    check(Case(Unused, SHAPE, fxpar.Plan(spatial_parts=3, slice="horizontal")))


def case_unused_parameters_sp2_dp2():
    check(Case(Unused, SHAPE, fxpar.Plan(spatial_parts=2, data_parallel=2)))


def case_aliases_lp2():
    check(Case(Aliased, SHAPE, fxpar.Plan(stages=2)))


def case_aliases_sp2_pp2():
    check(Case(Aliased, SHAPE, fxpar.Plan(spatial_parts=2, stages=2, microbatches=2)))


def case_aliases_and_unused_sp2_dp2():
    check(Case(Both, SHAPE, fxpar.Plan(spatial_parts=2, data_parallel=2)))


def _folder(comm) -> Path:
    return Path(comm.bcast_object(tempfile.mkdtemp(prefix="fxpar-bugfix-") if comm.rank == 0
                                  else None))


def _same_state(what: str, got: dict, want: dict) -> None:
    assert list(got) == list(want), f"{what}: keys {list(got)} != {list(want)}"
    for k, v in want.items():
        assert_same(f"{what}[{k}]", got[k], v, 0.0, 0.0)


def _on_rank0(comm, check_fn) -> None:
    """``check_fn()`` on rank 0; its AssertionError raised on every rank (no rank is left
    waiting in a collective the failing one never reaches)."""
    problem = None
    if comm.rank == 0:
        try:
            check_fn()
        except AssertionError as e:
            problem = str(e)
    problem = comm.bcast_object(problem, root=0)
    assert problem is None, problem


def _train(rp, steps: int = 2) -> None:
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        rp.train_step(torch.randn(SHAPE, dtype=torch.float64, generator=g),
                      torch.randint(0, 5, (SHAPE[0],), generator=g))


def _check_state_roundtrips(plan: fxpar.Plan) -> None:
    """full_state_dict has model.state_dict()'s keys (aliases, unused tensors) and loads into
    the model strictly; unused tensors keep their values through training with weight decay;
    a saved program, a checkpoint and its export keep every key; the rank program accepts the
    model's own state_dict (aliased keys included)."""
    comm = sub_comm(plan.world_size)
    if comm is None:
        return
    torch.manual_seed(0)
    model = Both().double()
    with torch.no_grad():  # unused tensors with values of their own, to see them survive
        model.spare.weight.normal_()
        model.spare.bias.fill_(0.25)
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    twin = copy.deepcopy(model)
    example = torch.empty(SHAPE, dtype=torch.float64, device="meta")
    program = fxpar.compile(model, plan, example, optimizer=sgd)
    folder = _folder(comm)
    # no try/finally with a barrier: a rank that failed would meet its peers' next collective
    # there and hang the job instead of ending it (the folder stays in /tmp then)
    if comm.rank == 0:
        program.save(folder / "program")
    comm.barrier()
    loaded = load(folder / "program", comm, optimizer=sgd)
    got = loaded.full_state_dict()
    _on_rank0(comm, lambda: _same_state("saved program", got, initial))
    rp = program.local(comm)
    assert dict(loaded.named_parameters()).keys() == dict(rp.named_parameters()).keys()
    _train(rp)
    full = rp.full_state_dict()

    def trained() -> None:
        assert list(full) == list(initial), f"{list(full)} != {list(initial)}"
        for k in ("spare.weight", "spare.bias", "spare_alias.weight"):  # no gradient
            assert_same(k, full[k], initial[k], 0.0, 0.0)
        fresh = Both().double()
        fresh.load_state_dict(full, strict=True)

    _on_rank0(comm, trained)
    checkpoint.save(rp, folder / "ckpt", step=2)
    _on_rank0(comm, lambda: _same_state("export", checkpoint.export(folder / "ckpt"), full))
    other = fxpar.compile(twin, plan, example, optimizer=sgd).local(comm)
    assert checkpoint.load(other, folder / "ckpt") == 2
    got = other.full_state_dict()
    _on_rank0(comm, lambda: _same_state("loaded checkpoint", got, full))
    other.load_state_dict(initial, strict=True)  # every aliased key accepted
    got = other.full_state_dict()
    _on_rank0(comm, lambda: _same_state("load_state_dict", got, initial))
    comm.barrier()
    if comm.rank == 0:
        shutil.rmtree(folder, ignore_errors=True)


def case_state_of_aliases_and_unused_roundtrips_lp2():
    _check_state_roundtrips(fxpar.Plan(stages=2))


def case_state_of_aliases_and_unused_roundtrips_sp2_pp():
    _check_state_roundtrips(fxpar.Plan(spatial_parts=2, stages=2, microbatches=2))
