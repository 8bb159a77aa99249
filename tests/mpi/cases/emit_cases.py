"""Saved programs under mpiexec (run by tests/mpi/test_programs.py): a program written with
program.save and loaded back by each rank trains bit for bit like the in-memory program (which
the transparency suites compare with one process), in spatial + pipeline, fused-halo and GEMS
layouts."""

import copy
import tempfile
from pathlib import Path

import torch
import torchvision.models as tvm
from helpers.models import resnet18_narrow
from helpers.transparency import sgd, sub_comm

import fxpar
from fxpar.cli.run import main as fxpar_run
from fxpar.comm.world import world
from fxpar.core.fxgraph import generated
from fxpar.program.loader import load


def _shared_dir(comm) -> Path:
    """One scratch folder for all ranks of ``comm`` (rank 0 makes it)."""
    name = tempfile.mkdtemp(prefix="fxpar-emit-") if comm.rank == 0 else None
    return Path(comm.bcast_object(name))


def _check_saved_equals_memory(plan: fxpar.Plan, shape, steps: int = 2) -> None:
    comm = sub_comm(plan.world_size)
    if comm is None:
        return
    torch.manual_seed(0)
    model = resnet18_narrow().double()  # a saved program is the same at any width
    twin = copy.deepcopy(model)
    example = torch.empty(shape, dtype=torch.float64, device="meta")
    saved = fxpar.compile(model, plan, example, optimizer=sgd, comm=comm)
    folder = _shared_dir(comm)
    if comm.rank == 0:
        saved.save(folder)
    comm.barrier()
    loaded = load(folder, comm, optimizer=sgd)
    memory = fxpar.compile(twin, plan, example, optimizer=sgd, comm=comm).local(comm)
    assert loaded.actions == memory.actions
    g = torch.Generator().manual_seed(1)
    x = torch.randn(shape, dtype=torch.float64, generator=g)
    y = torch.randint(0, 5, (shape[0],), generator=g)
    for step in range(steps):
        a, b = loaded.train_step(x, y), memory.train_step(x, y)
        assert a == b, f"step {step}: loss {a} (loaded) != {b} (in memory)"
        got, want = dict(loaded.named_parameters()), dict(memory.named_parameters())
        assert set(got) == set(want)
        for name, p in want.items():
            assert torch.equal(got[name], p), f"step {step}: {name} differs"
            assert torch.equal(got[name].grad, p.grad), f"step {step}: grad of {name} differs"
        sa, sb = loaded.state_dict(), memory.state_dict()
        assert set(sa) == set(sb)
        assert all(torch.equal(sa[k], sb[k]) for k in sb), "buffers differ"
    loaded.eval()
    memory.eval()
    out_a, out_b = loaded.forward(x), memory.forward(x)
    assert (out_a is None) == (out_b is None)
    if out_b is not None:
        assert torch.equal(out_a, out_b)


def case_saved_spatial_pipeline_program_trains_like_memory():
    plan = fxpar.Plan(stages=2, spatial_parts=2, spatial_stages=1, microbatches=2,
                      schedule="1f1b")
    _check_saved_equals_memory(plan, (4, 3, 32, 32))


def case_saved_fused_halo_program_trains_like_memory():
    """Halo fusion's local windows and BatchNorm boxes survive the generated code."""
    _check_saved_equals_memory(fxpar.Plan(spatial_parts=4, halo_fusion="all"), (2, 3, 32, 32))


def case_saved_gems_program_trains_like_memory():
    _check_saved_equals_memory(fxpar.Plan(stages=2, gems=True, microbatches=2), (8, 3, 32, 32))


def case_fxpar_run_runs_a_saved_program_and_refuses_another_world_size():
    comm = world()
    folder = _shared_dir(comm)
    if comm.rank == 0:
        torch.manual_seed(0)
        model = tvm.resnet18(num_classes=4)
        plan = fxpar.Plan(stages=2, spatial_parts=2, spatial_stages=1)
        fxpar.compile(model, plan, torch.empty((2, 3, 32, 32), device="meta")).save(folder)
    comm.barrier()
    # 4 ranks for a 3-rank program: every rank says so and exits 2 (no communication)
    assert fxpar_run([str(folder), "--steps", "1"]) == 2


class _EveryTileOp(torch.nn.Module):
    """A net whose spatial stage calls every communicating fxpar op: a convolution split
    around its halo and synchronised BatchNorm on the replicated image's tiles, a max pool,
    GroupNorm (synchronised BatchNorm over (sample, group) rows), bilinear upsampling after a
    plain halo, a global mean (allreduce) and max (group_extreme), and a cumsum that ends the
    region (join)."""

    def __init__(self) -> None:
        super().__init__()
        nn = torch.nn
        self.c1, self.bn = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.pool = nn.MaxPool2d(3, 2, 1)
        self.c2, self.gn = nn.Conv2d(8, 8, 3, padding=1), nn.GroupNorm(2, 8)
        self.up = nn.Upsample(scale_factor=2, mode="bilinear")
        self.fc = nn.Linear(8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(torch.relu(self.bn(self.c1(x))))
        x = self.up(torch.relu(self.gn(self.c2(x))))
        side = torch.cumsum(x[:, :1], dim=3).mean((1, 2, 3))  # along the split W: a join
        return self.fc(x.mean((2, 3)) + x.amax((2, 3))) + side.unsqueeze(1)


def _run_stage(module, x: torch.Tensor, g: torch.Tensor) -> dict[str, torch.Tensor]:
    """Forward and backward of one stage module: its output, every parameter's gradient and
    every buffer after the step."""
    xr = x.clone().requires_grad_()
    (out,) = module(xr)  # a stage returns a tuple
    (out * g).sum().backward()
    module = getattr(module, "_orig_mod", module)  # torch.compile's wrapper: the names inside
    got = {"out": out.detach(), "grad of the input": xr.grad}
    got |= {f"grad of {n}": p.grad for n, p in module.named_parameters()}
    got |= {f"buffer {n}": b for n, b in module.named_buffers()}
    return got


def case_a_spatial_stage_is_an_aten_graph_that_exports_saves_loads_and_compiles():
    """fxpar's communicating ops are torch.library custom ops (fxpar.runtime.spatial.library):
    each rank's spatial stage exports with torch.export without communicating (fake kernels),
    holds only ATen and fxpar ops, survives torch.export.save / load, and compiles with
    torch.compile(fullgraph=True) through AOTAutograd (forward and backward graphs). The loaded
    and the compiled stage then run their messages for real under mpiexec and give the output,
    the input and parameter gradients and the BatchNorm buffers of the stage module fxpar
    built: bit for bit when loaded, to float64 rounding when compiled (AOTAutograd's
    decomposition of the tile's upsampling kernel rounds differently)."""
    import operator

    comm = sub_comm(2)
    if comm is None:
        return
    torch.manual_seed(0)
    model = _EveryTileOp().double()
    shape = (2, 3, 32, 32)
    program = fxpar.compile(model, fxpar.Plan(spatial_parts=2),
                            torch.empty(shape, dtype=torch.float64, device="meta"), comm=comm)
    rp = program.local(comm)
    (stage,) = rp.stages.values()
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(shape, dtype=torch.float64, generator=gen)
    g = torch.randn((2, 5), dtype=torch.float64, generator=gen)
    built, twin = copy.deepcopy(stage), copy.deepcopy(stage)
    exported = torch.export.export(copy.deepcopy(stage), (x,), strict=False)  # no binding
    ops = {n.target for n in exported.graph.nodes if n.op == "call_function"}
    spaces = {t.namespace for t in ops if isinstance(t, torch._ops.OpOverload)}
    assert spaces == {"aten", "fxpar"}, spaces
    assert {t for t in ops if not isinstance(t, torch._ops.OpOverload)} <= {operator.getitem,
                                                                             operator.ge}
    fx_ops = {t.name() for t in ops if isinstance(t, torch._ops.OpOverload)
              and t.namespace == "fxpar"}
    assert fx_ops == {f"fxpar::{op}" for op in ("halo", "halo_op", "sync_batch_norm",
                                                "allreduce", "group_extreme", "join")}, fx_ops
    folder = _shared_dir(comm)
    path = folder / f"stage{comm.rank}.pt2"
    torch.export.save(exported, path)
    loaded = torch.export.load(path).module()
    compiled = torch.compile(generated(twin), fullgraph=True, backend="aot_eager")
    with rp.groups.bound():
        want = _run_stage(built, x, g)
        for name, module in (("loaded", loaded), ("compiled", compiled)):
            got = _run_stage(module, x, g)
            assert set(got) == set(want), (name, set(got) ^ set(want))
            for k, v in want.items():
                if name == "loaded":
                    assert torch.equal(got[k], v), f"{name} stage: {k} differs by " \
                        f"{(got[k] - v).abs().max().item():.3g}"
                else:  # AOTAutograd decomposes upsample_bilinear2d (the tile's kernel) into
                    # pointwise ops that round differently: 4.4e-16 seen here
                    torch.testing.assert_close(got[k], v, rtol=1e-13, atol=1e-13,
                                               msg=lambda m, k=k: f"compiled stage: {k}: {m}")
    rp.close()
