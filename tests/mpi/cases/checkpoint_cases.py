"""Sharded checkpoints under a real mpiexec (run by tests/mpi/test_programs.py, 4 ranks, float64).

Resume is checked bitwise against an uninterrupted run: parameters, BatchNorm buffers and
momentum buffers of every (copy, stage) module on every rank, from a checkpoint folder that also
holds what a save killed part way leaves (a newer version folder without its manifest). Export /
import are checked against one process (export bitwise, training after import to float64
tolerances). tests/mpi/test_checkpoint_crash.py kills a rank during a real save."""

import copy
import shutil
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F
from helpers.equivalence import (
    ATOL64_LATER,
    RTOL64,
    assert_buffers,
    assert_same,
    atol64,
    reference_step,
)
from helpers.transparency import sgd, sub_comm

import fxpar
from fxpar import models
from fxpar.program import checkpoint
from fxpar.program.checkpoint import CheckpointError


def _resnet():
    """A pre-activation ResNet-8 (3 residual blocks, BatchNorm throughout, ~80k parameters)."""
    return models.build("resnet_v2", depth=8, num_classes=5)


# 2 + 1 + 1 ranks: stage 0 on two tiles, then a two-micro-batch pipeline
SP_PP = fxpar.Plan(stages=3, spatial_parts=2, slice="horizontal", microbatches=2,
                   schedule="1f1b")
# two ranks per layout, both GEMS copies on each, two data-parallel replicas
GEMS_DP = fxpar.Plan(stages=2, gems=True, data_parallel=2)
SHAPE = (8, 3, 32, 32)


def _batches(n: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(SHAPE, dtype=torch.float64, generator=g),
             torch.randint(0, 5, (SHAPE[0],), generator=g)) for _ in range(n)]


def _compile(plan, seed, comm, model=None):
    """A rank program of a fresh model (initialised from ``seed``) and the model."""
    torch.manual_seed(seed)
    model = model if model is not None else _resnet().double()
    program = fxpar.compile(model, plan, torch.empty(SHAPE, dtype=torch.float64, device="meta"),
                            optimizer=sgd)
    return program.local(comm), model


def _folder(comm) -> Path:
    """One scratch folder every rank sees (made by rank 0)."""
    return Path(comm.bcast_object(tempfile.mkdtemp(prefix="fxpar-ckpt-") if comm.rank == 0
                                  else None))


def _remove(comm, folder: Path) -> None:
    comm.barrier()
    if comm.rank == 0:
        shutil.rmtree(folder)


def _training_state(rp, momentum: bool = True) -> list[tuple[str, torch.Tensor]]:
    """Every tensor that determines further training on this rank, in a fixed order."""
    out = [(f"copy {c} stage {s} {k}", v) for (c, s), m in sorted(rp.stages.items())
           for k, v in m.state_dict().items()]
    for name, p in rp.named_parameters() if momentum else []:
        out.append((f"momentum of {name}", rp.optimizer.state[p]["momentum_buffer"]))
    return out


def _resume(plan, steps: int = 3, saved_at: int = 1) -> None:
    comm = sub_comm(plan.world_size)
    if comm is None:
        return
    data = _batches(steps)
    straight, _ = _compile(plan, 0, comm)
    for x, y in data:
        straight.train_step(x, y)

    first, _ = _compile(plan, 0, comm)
    for x, y in data[:saved_at]:
        first.train_step(x, y)
    folder = _folder(comm)
    rng = torch.get_rng_state()
    version = checkpoint.save(first, folder, step=saved_at, extra={"epoch": 0})
    assert version == folder / f"step-{saved_at:08d}" and version.is_dir()
    if comm.rank == 0:  # what a later save killed part way leaves: shards, no manifest
        unfinished = folder / f"step-{saved_at + 5:08d}"
        unfinished.mkdir()
        (unfinished / "rank00000.pt").write_bytes(b"PK\x03\x04 not this job's")
        (unfinished / ".rank00001.pt.tmp99").write_bytes(b"PK\x03")
    comm.barrier()

    resumed, _ = _compile(plan, 123, comm)  # a fresh, differently initialised model
    objects = [id(p) for p in resumed.parameters()]
    before = _training_state(resumed, momentum=False)[0][1].clone()
    assert not torch.equal(before, _training_state(first)[0][1]), "the init did not differ"
    assert checkpoint.load(resumed, folder) == saved_at
    assert torch.equal(torch.get_rng_state(), rng), "RNG state not restored"
    assert [id(p) for p in resumed.parameters()] == objects, "parameters were replaced"
    assert checkpoint.read_manifest(folder)["extra"] == {"epoch": 0}
    for x, y in data[saved_at:]:
        resumed.train_step(x, y)
    checkpoint.save(resumed, folder, step=steps, keep=1)  # prunes step 1 and the unfinished
    if comm.rank == 0:
        assert sorted(p.name for p in folder.iterdir()) == ["latest", f"step-{steps:08d}"]

    got, want = _training_state(resumed), _training_state(straight)
    assert [k for k, _ in got] == [k for k, _ in want]
    assert any("num_batches_tracked" in k for k, _ in got)
    for (name, a), (_, b) in zip(got, want, strict=True):
        assert torch.equal(a, b), f"rank {comm.rank}: {name} differs after resume " \
                                  f"(max diff {(a - b).abs().max().item():.3e})"
    _remove(comm, folder)


def case_resume_spatial_pipeline_bitwise():
    _resume(SP_PP)


def case_resume_gems_data_parallel_bitwise():
    _resume(GEMS_DP)


def case_export_equals_full_state_dict_and_forward():
    comm = sub_comm(SP_PP.world_size)
    if comm is None:
        return
    rp, _ = _compile(SP_PP, 0, comm)
    (x, y), = _batches(1)
    rp.train_step(x, y)
    folder = _folder(comm)
    checkpoint.save(rp, folder, step=1)
    full = rp.full_state_dict()
    rp.eval()
    out = rp.forward(x)
    outs = comm.allgather_object(out)
    if comm.rank == 0:
        exported = checkpoint.export(folder)
        assert full is not None and list(exported) == list(full)
        for k, v in full.items():
            assert torch.equal(exported[k], v), f"export: {k} differs from full_state_dict"
        plain = _resnet().double()
        plain.load_state_dict(exported, strict=True)
        plain.eval()
        last = next(o for o in outs if o is not None)
        assert_same("single-device forward of the export", plain(x).detach(), last,
                    ATOL64_LATER, RTOL64)
    _remove(comm, folder)


def case_import_single_device_state_dict_then_train():
    plan = fxpar.Plan(stages=3, spatial_parts=2, gems=True)  # 4 ranks, odd mirror of SP
    comm = sub_comm(plan.world_size)
    if comm is None:
        return
    torch.manual_seed(7)
    source = _resnet().double()
    ref = copy.deepcopy(source)
    rp, _ = _compile(plan, 0, comm)  # another init
    loaded = rp.load_state_dict(source.state_dict())
    mine = {k for m in rp.stages.values() for k in m.state_dict()}  # both copies' stages
    assert sorted(loaded) == sorted(mine), "import did not load exactly this rank's keys"
    ref_opt = sgd(ref.parameters())
    ref_params = dict(ref.named_parameters())
    for step, (x, y) in enumerate(_batches(2)):
        atol, rtol = atol64(step), RTOL64
        loss = rp.train_step(x, y)
        ref_loss = reference_step(ref, ref_opt, x, y, plan.chunks(), F.cross_entropy)
        assert_same(f"step {step} loss", loss, ref_loss, atol, rtol)
        for name, p in rp.named_parameters():  # both GEMS copies
            assert_same(f"step {step} grad of {name}", p.grad, ref_params[name].grad, atol,
                        rtol)
            assert_same(f"step {step} {name}", p.detach(), ref_params[name].detach(), atol,
                        rtol)
        for (_copy, _stage), m in rp.stages.items():
            assert_buffers(m.state_dict(), ref, atol, rtol)


def case_load_of_another_plan_fails_on_every_rank():
    comm = sub_comm(SP_PP.world_size)
    if comm is None:
        return
    rp, _ = _compile(SP_PP, 0, comm)
    folder = _folder(comm)
    checkpoint.save(rp, folder, step=5)
    for plan in (fxpar.Plan(stages=4, microbatches=2),  # same world size, other plan
                 fxpar.Plan(stages=2)):  # other world size
        sub = sub_comm(plan.world_size)
        if sub is None:
            continue
        other, _ = _compile(plan, 0, sub)
        try:
            checkpoint.load(other, folder)
        except CheckpointError as e:
            message = str(e)
        else:
            message = ""
        assert "same model and plan" in message and "export" in message, message
        assert "load_state_dict" in message, message
        raised = sub.allgather_object(bool(message))
        assert all(raised), raised
    _remove(comm, folder)
