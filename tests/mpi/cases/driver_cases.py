"""fxpar-run's driver under mpiexec (run by tests/mpi/test_programs.py, 4 ranks): a spatial plan
trained from an image folder, each rank reading only its window, equals one process trained on
the whole images (float64); the CLI's progress, per-rank table and metrics file; a saved
program run by folder."""

import contextlib
import copy
import io
import re
import shutil
import tempfile
from pathlib import Path
from unittest import mock

import numpy as np
import torch
import torch.nn.functional as F
from helpers.equivalence import RTOL64, assert_buffers, assert_same, atol64, reference_step
from helpers.transparency import sgd, sub_comm
from PIL import Image
from torch import nn

import fxpar
from fxpar.cli import run as run_cli
from fxpar.cli.run import main as fxpar_run
from fxpar.core.geometry import Rect
from fxpar.data.data import FolderBatches, ImageFolder
from fxpar.frontend import share
from fxpar.models.zoo import build_model
from fxpar.planner.planner import describe
from fxpar.train.metrics import load_metrics

HERE = Path(__file__)
SIZE = 20


def tiny_net(num_classes: int = 3) -> nn.Module:
    """A model file for ``fxpar-run tests/mpi/cases/driver_cases.py:tiny_net``."""
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(4, 6, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
        nn.Linear(6, num_classes))


def write_folder(root: Path, size: int = SIZE, seed: int = 0) -> Path:
    """An image folder of three classes and three formats, 2 images each: float .npy arrays
    (C, H, W), RGB PNGs and RGB TIFFs (uint8, lossless)."""
    rng = np.random.default_rng(seed)
    for name, kind in (("cat", "npy"), ("dog", "png"), ("emu", "tif")):
        (root / name).mkdir(parents=True, exist_ok=True)
        for k in range(2):
            if kind == "npy":
                np.save(root / name / f"{k}.npy", rng.standard_normal((3, size, size)))
            else:
                pixels = rng.integers(0, 256, (size, size, 3), dtype=np.uint8)
                Image.fromarray(pixels).save(root / name / f"{k}.{kind}")
    return root


def _shared_dir(comm) -> Path:
    name = tempfile.mkdtemp(prefix="fxpar-driver-") if comm.rank == 0 else None
    return Path(comm.bcast_object(name))


def _remove(comm, folder: Path) -> None:
    """Delete a shared scratch folder once every rank of ``comm`` is done with it."""
    comm.barrier()
    if comm.rank == 0:
        shutil.rmtree(folder, ignore_errors=True)


def _folder(comm) -> Path:
    root = _shared_dir(comm)
    if comm.rank == 0:
        write_folder(root)
    comm.barrier()
    return root


def case_image_folder_spatial_plan_equals_one_process_and_reads_only_windows():
    plan = fxpar.Plan(stages=2, spatial_parts=3, microbatches=2, schedule="1f1b")
    comm = sub_comm(plan.world_size)
    if comm is None:
        return
    root = _folder(comm)
    torch.manual_seed(0)
    model = tiny_net().double()
    ref = copy.deepcopy(model)
    shape = (4, 3, SIZE, SIZE)
    rp = fxpar.compile(model, plan, torch.empty(shape, dtype=torch.float64, device="meta"),
                       optimizer=sgd, comm=comm).local(comm)
    data = ImageFolder.scan(root, SIZE, 3)
    data.reads = []
    # NaN outside the window: any read there would poison the loss and every gradient
    src = FolderBatches(data, 4, torch.float64, seed=5, fill=float("nan"))
    window = rp.input_window()
    tiles = {0: (0, 7), 1: (5, 14), 2: (12, 20)}  # columns of 1x3 tiles of 20, 3x3 conv halo
    last = {s for _, s in rp.stages} == {1}
    assert window == (None if last else Rect((0, SIZE), tiles[comm.rank])), window
    whole = ImageFolder.scan(root, SIZE, 3)  # what one process reads: every pixel
    ref_opt = sgd(ref.parameters())
    steps = 3  # 6 images, batch 4: one step per epoch, a new shuffle each step
    for step in range(steps):
        x, y = src.batch(step, window)
        assert (x is None) == last
        loss = rp.train_step(x, y if last else None)
        idx = src.indices(step)
        xs = torch.stack([whole.read(i, Rect((0, SIZE), (0, SIZE)), torch.float64)
                          for i in idx])
        ys = torch.tensor([whole.label(i) for i in idx])
        want = reference_step(ref, ref_opt, xs, ys, plan.chunks(), F.cross_entropy)
        tol = (atol64(step), RTOL64)
        assert_same(f"step {step} loss", loss, want, *tol)
        refp = dict(ref.named_parameters())
        for name, p in rp.named_parameters():
            assert_same(f"step {step} grad of {name}", p.grad, refp[name].grad, *tol)
            assert_same(f"step {step} {name}", p.detach(), refp[name].detach(), *tol)
        if not last:  # the BatchNorm is in stage 0
            assert_buffers(rp.state_dict(), ref, *tol)
    # what each rank read: its window of each image of each batch, nothing else
    assert len(data.reads) == (0 if last else 4 * steps)
    assert all(w == window for _, w in data.reads)
    wanted = [str(data.samples[i][0].relative_to(root)) for step in range(steps)
              for i in src.indices(step)]
    assert last or [f for f, _ in data.reads] == wanted
    _remove(comm, root)


def _lines(out: str, prefix: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith(prefix)]


def _assert_one_process_losses(root: Path, losses: list[float], chunks: int) -> None:
    """The losses fxpar-run printed equal the same training in one process (seed 3, tiny_net
    with 3 classes, batch 4 of the folder in the same order, SGD lr 0.02 with momentum 0.9)
    accumulated over ``chunks`` equal parts of each batch."""
    torch.manual_seed(3)
    ref = build_model(f"{HERE}:tiny_net", num_classes=3).double()
    opt = torch.optim.SGD(ref.parameters(), lr=0.02, momentum=0.9)
    src = FolderBatches(ImageFolder.scan(root, SIZE, 3), 4, torch.float64, seed=3)
    for step, got in enumerate(losses):
        x, y = src.batch(step, Rect((0, SIZE), (0, SIZE)))
        want = reference_step(ref, opt, x, y, chunks, F.cross_entropy)
        assert abs(got - want) <= 1e-6, f"step {step + 1}: printed loss {got} != {want:.6f}"


def case_cli_trains_image_folder_prints_table_and_writes_metrics():
    plan = fxpar.Plan(stages=2, spatial_parts=2, microbatches=2)
    comm = sub_comm(plan.world_size)
    if comm is None:
        return
    root = _folder(comm)
    metrics = root / "metrics.json"
    argv = [f"{HERE}:tiny_net", "--num-classes", "3", "--image-size", str(SIZE),
            "--batch-size", "4", "--data", str(root), "--epochs", "2", "--dtype", "float64",
            "--lr", "0.02", "--seed", "3", "--split-size", "2", "--num-spatial-parts", "2",
            "--parts", "2", "--metrics", str(metrics)]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert fxpar_run(argv, comm=comm) == 0
    text = out.getvalue()
    if comm.rank != 0:
        assert text == "", f"rank {comm.rank} printed:\n{text}"
        return
    steps = _lines(text, "step ")
    assert len(steps) == 2, text  # 2 epochs x (6 images // batch 4)
    losses = [float(re.search(r"loss (\S+)", s).group(1)) for s in steps]
    assert all("img/s" in s for s in steps)
    _assert_one_process_losses(root, losses, plan.chunks())
    head = next(i for i, line in enumerate(text.splitlines()) if line.split()[:3] ==
                ["rank", "stage", "tile"])
    rows = [line.split() for line in text.splitlines()[head + 1:head + 4]]
    assert [r[:3] for r in rows] == [["0", "0", "0"], ["1", "0", "1"], ["2", "1", "0"]], rows
    assert text.splitlines()[-1].startswith("done: median")
    m = load_metrics(metrics)
    assert m["world_size"] == 3 and m["steps"] == 2 and m["batch_size"] == 4
    assert m["plan"]["spatial_parts"] == 2 and m["model"] == f"{HERE}:tiny_net"
    program = fxpar.compile(tiny_net(), plan, torch.empty((4, 3, SIZE, SIZE), device="meta"))
    for r, entry in enumerate(m["ranks"]):
        assert entry["rank"] == r
        assert entry["roles"] == [{"copy": 0, "stage": s, "tile": t}
                                  for s, t in [(0, 0), (0, 1), (1, 0)][r:r + 1]]
        # every action once, in the order it ran: receives are posted before the compute
        # action they follow in the schedule (fxpar.runtime.loop), so only the multiset is fixed
        assert sorted(e["action"] for e in entry["timeline"]) == sorted(str(a) for a in
                                                                    program.schedule[r])
        ends = [e["end"] for e in entry["timeline"]]
        assert ends == sorted(ends) and all(0 <= e["start"] <= e["end"] for e in
                                            entry["timeline"])
        assert all(0 <= e["wait"] <= e["end"] - e["start"] + 1e-6 for e in entry["timeline"])
        assert entry["peak_memory_bytes"] > 10 * 2**20  # a Python process with torch loaded
        assert entry["compute_s"] > 0 and entry["comm_s"] >= 0
        assert entry["compute_s"] + entry["comm_s"] <= entry["step_s"] * 1.01 + 1e-4
    # the last stage's rank waits for its inputs: its RECV/F waits are communication
    assert m["ranks"][2]["comm_s"] > 0
    shutil.rmtree(root, ignore_errors=True)  # the other ranks finished with it inside main


def case_cli_ranks_take_rank_0s_capture_and_compile_the_same_program():
    """fxpar-run captures the model on rank 0 only (the others receive it: the most of a
    compile, not done once per rank); each rank's program is the one it compiles alone."""
    plan = fxpar.Plan(stages=2, spatial_parts=2, microbatches=2)
    comm = sub_comm(plan.world_size)
    if comm is None:
        return
    traced: list[object] = []
    programs: list[fxpar.Program] = []
    real_trace, real_compile = share.trace, run_cli.fx_compile

    def counted(*args: object, **kwargs: object) -> object:
        traced.append(args)
        return real_trace(*args, **kwargs)

    def kept(*args: object, **kwargs: object) -> object:
        programs.append(real_compile(*args, **kwargs))
        return programs[-1]

    argv = [f"{HERE}:tiny_net", "--num-classes", "3", "--image-size", str(SIZE),
            "--batch-size", "4", "--steps", "1", "--dtype", "float64", "--split-size", "2",
            "--num-spatial-parts", "2", "--parts", "2"]
    with mock.patch.object(share, "trace", counted), \
            mock.patch.object(run_cli, "fx_compile", kept), \
            contextlib.redirect_stdout(io.StringIO()):
        assert fxpar_run(argv, comm=comm) == 0
    counts = comm.allgather_object(len(traced))
    assert counts[0] <= 1 and counts[1:] == [0] * (comm.size - 1), counts  # 0: a cached capture
    got, = programs
    example = torch.empty((4, 3, SIZE, SIZE), dtype=torch.float64, device="meta")
    alone = fxpar.compile(tiny_net().double(), plan, example)  # this process on its own
    assert got.schedule == alone.schedule and got.graph.transfers == alone.graph.transfers
    for s in range(plan.stages):
        assert got.graph.modules[s].code == alone.graph.modules[s].code, s
    for t in range(2):
        assert got.spatial.tile(0, t).code == alone.spatial.tile(0, t).code, t


def case_cli_a_rank_failing_alone_before_the_capture_stops_every_rank():
    """Rank 1 fails on its own before compiling (its model, its data): rank 0, about to
    capture the model for everyone, meets it at the first collective and both stop with its
    error (exit 2), instead of rank 0 waiting in the capture's broadcast."""
    comm = sub_comm(2)
    if comm is None:
        return
    argv = [f"{HERE}:tiny_net", "--num-classes", "3", "--image-size", str(SIZE),
            "--batch-size", "4", "--steps", "1", "--parts", "2"]

    def broken(*args: object, **kwargs: object) -> nn.Module:
        raise ValueError("rank 1 could not read its weights")

    err = io.StringIO()
    with contextlib.ExitStack() as stack:
        if comm.rank == 1:
            stack.enter_context(mock.patch.object(run_cli, "build_model", broken))
        stack.enter_context(contextlib.redirect_stderr(err))
        stack.enter_context(contextlib.redirect_stdout(io.StringIO()))
        code = fxpar_run(argv, comm=comm)
    assert code == 2, (comm.rank, err.getvalue())
    if comm.rank == 0:
        assert "on rank 1: rank 1 could not read its weights" in err.getvalue(), err.getvalue()


def case_fxpar_run_on_a_saved_program_trains_like_the_compiled_one():
    plan = fxpar.Plan(stages=2, spatial_parts=2)
    comm = sub_comm(plan.world_size)
    if comm is None:
        return
    folder = _shared_dir(comm)
    if comm.rank == 0:
        torch.manual_seed(0)  # what fxpar-run --seed 0 builds
        model = build_model(f"{HERE}:tiny_net", num_classes=10).double()
        fxpar.compile(model, plan, torch.empty((2, 3, 16, 16), dtype=torch.float64,
                                               device="meta")).save(folder)
    comm.barrier()
    common = ["--steps", "2", "--image-size", "16"]
    runs = {}
    for name, argv in (("saved", [str(folder), *common]),
                       ("compiled", [f"{HERE}:tiny_net", *common, "--batch-size", "2",
                                     "--dtype", "float64", "--stages", "2",
                                     "--spatial-parts", "2"])):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            assert fxpar_run(argv, comm=comm) == 0, name
        runs[name] = [re.search(r"loss (\S+)", s).group(1)
                      for s in _lines(out.getvalue(), "step ")]
    if comm.rank == 0:
        assert len(runs["saved"]) == 2 and runs["saved"] == runs["compiled"], runs
    # plan flags cannot change a saved program: refused before any communication
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert fxpar_run([str(folder), "--parts", "2", "--image-size", "16"], comm=comm) == 2
    if comm.rank == 0:  # said once, by rank 0, after every rank agreed it is an error
        assert "drop --microbatches/--parts" in err.getvalue(), err.getvalue()
    else:
        assert err.getvalue() == "", err.getvalue()
    _remove(comm, folder)


def case_cli_resume_from_checkpoint_equals_uninterrupted_and_saves_programs():
    """fxpar-run --checkpoint/--resume: 2 steps, save, resume to 4 == 4 steps in one go (every
    parameter and buffer, bitwise, via the exported checkpoints); --save-program under mpiexec
    writes one folder per rank that fxpar-run then runs."""
    from fxpar.program.checkpoint import export

    comm = sub_comm(3)
    if comm is None:
        return
    root = _shared_dir(comm)
    base = [f"{HERE}:tiny_net", "--image-size", "16", "--batch-size", "4", "--dtype",
            "float64", "--stages", "2", "--spatial-parts", "2", "--parts", "2"]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert fxpar_run([*base, "--steps", "4", "--checkpoint", str(root / "a"),
                          "--save-program", str(root / "prog")], comm=comm) == 0
        assert fxpar_run([*base, "--steps", "2", "--checkpoint", str(root / "b")],
                         comm=comm) == 0
        assert fxpar_run([*base, "--steps", "4", "--resume", str(root / "b"), "--checkpoint",
                          str(root / "c"), "--checkpoint-every", "1"], comm=comm) == 0
        assert fxpar_run([str(root / "prog"), "--steps", "1"], comm=comm) == 0
    comm.barrier()
    if comm.rank == 0:
        text = out.getvalue()
        assert "resumed from" in text and f"checkpoint: step 4 -> {root / 'c'}" in text, text
        a, c = export(root / "a"), export(root / "c")
        assert list(a) == list(c) and all(torch.equal(a[k], c[k]) for k in a)
        assert sorted(p.name for p in (root / "prog").iterdir()) == [
            "program.json", "rank00000", "rank00001", "rank00002"]
    _remove(comm, root)


def case_cli_plan_auto_chooses_the_planners_plan_and_trains_like_one_process():
    comm = sub_comm(4)
    if comm is None:
        return
    root = _folder(comm)
    metrics = root / "auto.json"
    # ranked on plan_auto's default profile, as below (without --profile fxpar-run ranks on
    # this machine's: calibrate_cases.py checks that)
    argv = [f"{HERE}:tiny_net", "--num-classes", "3", "--image-size", str(SIZE),
            "--batch-size", "4", "--data", str(root), "--epochs", "2", "--dtype", "float64",
            "--lr", "0.02", "--seed", "3", "--plan", "auto", "--memory-per-rank", "1GiB",
            "--profile", "h100-nvlink-ib", "--metrics", str(metrics)]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert fxpar_run(argv, comm=comm) == 0
    text = out.getvalue()
    if comm.rank != 0:
        assert text == "", f"rank {comm.rank} printed:\n{text}"
        _remove(comm, root)
        return
    # what the library's planner chooses for the same model, batch, ranks and budget
    found = fxpar.plan_auto(tiny_net().double(), (4, 3, SIZE, SIZE), 4, 2**30, check=False)
    assert "plan search: 4 rank(s), memory per rank 1.00 GiB, profile 'h100-nvlink-ib' " \
        "(--profile h100-nvlink-ib)" in text, text
    chosen = _lines(text, "chosen: ")
    assert chosen == [f"chosen: {describe(found.plan)}"], (chosen, found.report())
    plan = fxpar.Plan(**load_metrics(metrics)["plan"])
    assert plan.world_size == 4
    assert (plan.stages, plan.spatial_parts, plan.data_parallel, plan.microbatches) == (
        found.plan.stages, found.plan.spatial_parts, found.plan.data_parallel,
        found.plan.microbatches), (plan, found.plan)
    losses = [float(re.search(r"loss (\S+)", s).group(1)) for s in _lines(text, "step ")]
    assert len(losses) == 2, text
    _assert_one_process_losses(root, losses, plan.chunks())
    _remove(comm, root)
