"""``fxpar-run``: train a zoo or user model under ``mpiexec`` with a parallel plan.

    mpiexec -n 5 fxpar-run models:amoebanet --num-layers 3 --num-filters 32 \\
        --image-size 256 --batch-size 4 --steps 5 --split-size 2 --num-spatial-parts 4 \\
        --parts 2 --metrics out.json
    mpiexec -n 3 fxpar-run job/ --data images/ --epochs 2    # a folder from program.save()
    mpiexec -n 8 fxpar-run volume.py:make --channels 1 --image-size 64x128x128 --grid 2x2x2

MPI4DL's flag names are accepted as aliases (``--split-size`` for ``--stages``, ``--parts``
for ``--microbatches``, ...). Data is synthetic (fixed seed) unless ``--data DIR`` names a
folder of images or volumes (.npy, NIfTI, PNG / JPEG / TIFF); each spatial rank then reads only
its tile (plus halo) of each image (fxpar.data.data). ``--image-size`` is N (a square image),
HxW, or DxHxW for 3-D volumes (batches N x C x D x H x W); ``--grid HxW`` / ``--grid DxHxW``
gives the process grid explicitly (``Plan.grid``; the tile count is its product).
Rank 0 prints a progress line per step and, at the end, a per-rank table (stage, tile, peak
memory, compute vs communication time); ``--metrics FILE`` writes the same as JSON
(fxpar.train.metrics). ``--val-data PATH --eval-every N`` validates in eval mode on a whole
held-out set (fxpar.train.evaluate; the loop is fxpar.cli.train). Every user error (bad plan,
model, data) is reported before any rank talks to another, as ``fxpar-run: error: ...`` with
exit code 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from fxpar.cli.args import bytes_arg, grid_arg, image_size_arg, user_error
from fxpar.cli.auto import AutoUsageError, add_args, check_no_layout, choose
from fxpar.cli.losses import LOSSES, LossArgError, make_loss
from fxpar.cli.train import (  # train and finish: re-exported (scripts import them here)
    Job,
    add_train_args,
    check_eval_args,
    check_task,
    optimizer,
    resume,
    run,
    sampled,
    sampled_source,
)
from fxpar.cli.train import finish as finish
from fxpar.cli.train import train as train
from fxpar.comm import failfast, watchdog
from fxpar.comm.mpi import Comm
from fxpar.compiler.driver import compile as fx_compile
from fxpar.core.plan import (
    HALO_FUSION,
    PRECISION_DTYPES,
    RECOMPUTE,
    SCHEDULES,
    SLICES,
    Plan,
    PlanError,
)
from fxpar.data.data import (
    BatchSource,
    DataError,
    FolderBatches,
    ImageFolder,
    Synthetic,
    spatial_size,
)
from fxpar.data.samples import describe, open_source
from fxpar.frontend.trace import TraceError
from fxpar.models.zoo import ModelSpecError, build_model, parse_kwargs
from fxpar.program.checkpoint import CheckpointError
from fxpar.runtime.guard import nonfinite_policy
from fxpar.train.evaluate import check_output, open_validation, output_shape

# (dest, flag, default) of the plan flags: defaults are applied after parsing, so a saved
# program can tell which plan flags were given (they are an error there: its plan is fixed).
PLAN_FLAGS = (("stages", "--stages/--split-size", 1), ("balance", "--balance", None),
              ("microbatches", "--microbatches/--parts", 1), ("schedule", "--schedule", "gpipe"),
              ("stages_per_rank", "--stages-per-rank", 1),
              ("spatial_parts", "--spatial-parts/--num-spatial-parts", 1),
              ("slice", "--slice/--slice-method", "square"), ("grid", "--grid", None),
              ("spatial_stages", "--spatial-stages/--spatial-size", 1), ("gems", "--gems", False),
              ("times", "--times", 1), ("data_parallel", "--data-parallel/--local-DP", 1),
              ("recompute", "--recompute", "never"),
              ("memory_per_rank", "--memory-per-rank", None),
              ("recompute_segments", "--recompute-segments", 1),
              ("channels_last", "--channels-last", False),
              ("precision", "--precision", "fp32"),
              ("halo_fusion", "--halo-fusion", "off"), ("compile", "--compile", False))
MODEL_FLAGS = (("model_arg", "-k"), ("num_layers", "--num-layers"),
               ("num_filters", "--num-filters"))
USER_ERRORS = (PlanError, ModelSpecError, TraceError, DataError, CheckpointError, ValueError,
               TypeError, AutoUsageError)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fxpar-run", description="Compile a model for a parallel "
                                "plan and train it (run under mpiexec -n WORLD_SIZE).")
    p.add_argument("model", help="torchvision:NAME, models:NAME, path/to/file.py:FACTORY, or a "
                   "folder written by program.save() (its plan, model and batch size are used)")
    p.add_argument("-k", "--model-arg", action="append", default=None, metavar="KEY=VALUE",
                   help="keyword argument for the model factory (repeatable)")
    p.add_argument("--image-size", type=image_size_arg, default=None, metavar="N|HxW|DxHxW",
                   help="input size: N for a square N x N image (default 256), HxW, or DxHxW "
                   "for a 3-D volume (batches N x C x D x H x W); N with a DxHxW --grid is a "
                   "cube [--image-size]")
    p.add_argument("--batch-size", type=int, default=None,
                   help="global batch per step (default 8) [--batch-size]")
    p.add_argument("--channels", type=int, default=3)
    p.add_argument("--num-classes", type=int, default=10, help="[--num-classes]")
    p.add_argument("--num-layers", type=int, help="AmoebaNet-D: normal cells [--num-layers]")
    p.add_argument("--num-filters", type=int, help="AmoebaNet-D: filters [--num-filters]")
    p.add_argument("--steps", type=int, default=None, help="batches to train (default 10)")
    p.add_argument("--epochs", type=int, default=None,
                   help="with --data: passes over the data; steps = epochs x (images // batch), "
                   "each epoch drops its last partial batch")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="where each rank computes: cuda binds rank r of a node to GPU r %% GPUs "
                   "(fxpar.comm.device); auto: cuda when available (default)")
    p.add_argument("--data", type=Path, default=None, metavar="DIR|CSV",
                   help="folder DIR/<class>/<file> of images (.npy, PNG, JPEG, TIFF, NIfTI) "
                   "or volumes (.npy, .nii, .nii.gz), all of --image-size, or a CSV of "
                   "image,label or image,mask rows (fxpar.data.samples); default: synthetic "
                   "data")
    p.add_argument("--level", type=int, default=0, metavar="L",
                   help="pyramid level of the --data / --val-data images (0: full resolution; "
                   "a CSV's level column overrides it per row)")
    p.add_argument("--no-shuffle", action="store_true", help="with --data: keep file order")
    p.add_argument("--log-every", type=int, default=None, metavar="K",
                   help="progress line every K steps (default 1, or about 50 lines in all)")
    p.add_argument("--metrics", type=Path, default=None, metavar="OUT.json",
                   help="write per-rank metrics (format: fxpar.train.metrics) on rank 0")
    p.add_argument("--save-program", type=Path, default=None, metavar="DIR",
                   help="write the compiled per-rank programs to DIR (fxpar.program.emit); "
                   "without mpiexec: write every rank's and exit; under mpiexec each rank writes "
                   "its "
                   "own, then trains (--steps 0: only write)")
    p.add_argument("--checkpoint", type=Path, default=None, metavar="DIR",
                   help="save a sharded checkpoint to DIR at the end (fxpar.program.checkpoint)")
    p.add_argument("--checkpoint-every", type=int, default=None, metavar="K",
                   help="with --checkpoint: also every K steps")
    p.add_argument("--watchdog", default=None, metavar="auto|auto:FLOOR|SECONDS",
                   help="end the whole job when a rank waits longer than this in one "
                        "communication call (a peer stuck or dead), printing where every rank "
                        "is; default FXPAR_WATCHDOG or auto (10 x the slowest step, at least "
                        "300 s); 0 turns it off")
    p.add_argument("--nonfinite", choices=("stop", "skip", "off"), default=None,
                   help="a NaN or inf loss or gradient on any rank: stop the job naming the "
                        "step and ranks (default, FXPAR_NONFINITE), skip that step on every "
                        "rank, or do not check")
    p.add_argument("--loss", choices=tuple(LOSSES), default="ce",
                   help="the loss to train with: " + "; ".join(
                       f"{k}: {v.help}" for k, v in LOSSES.items()) + " (default ce)")
    p.add_argument("--ignore-index", type=int, default=None, metavar="LABEL",
                   help="a label the loss leaves out (ce, dice)")
    p.add_argument("--class-weights", default=None, metavar="W1,W2,...",
                   help="one weight per class (ce, dice, dicece, focal)")
    p.add_argument("--resume", type=Path, default=None, metavar="DIR",
                   help="continue from the checkpoint in DIR (same plan and ranks)")
    g = p.add_argument_group("plan (MPI4DL's names in brackets)")
    g.add_argument("--stages", "--split-size", type=int, help="[--split-size] default 1")
    g.add_argument("--balance", type=str, help="comma-separated node counts per stage "
                   "[--balance]")
    g.add_argument("--microbatches", "--parts", type=int, help="[--parts] default 1")
    g.add_argument("--schedule", choices=SCHEDULES, help="default gpipe; zero_bubble splits "
                   "backwards into input and weight gradients (ZB-H1); interleaved_1f1b needs "
                   "--stages-per-rank")
    g.add_argument("--stages-per-rank", type=int, metavar="V",
                   help="stages each rank holds, for --schedule interleaved_1f1b (default 1)")
    g.add_argument("--spatial-parts", "--num-spatial-parts", type=int,
                   help="[--num-spatial-parts] default 1")
    g.add_argument("--slice", "--slice-method", choices=SLICES,
                   help="[--slice-method] default square; slab, pencil, cube split a volume's "
                   "D, D x H, D x H x W")
    g.add_argument("--grid", type=grid_arg, metavar="HxW|DxHxW",
                   help="explicit process grid: tiles per spatial dim (e.g. 2x2x2 for a "
                   "volume); --spatial-parts defaults to their product")
    g.add_argument("--spatial-stages", "--spatial-size", type=int,
                   help="[--spatial-size] default 1")
    g.add_argument("--gems", action="store_true", default=None)
    g.add_argument("--times", "--gems-times", type=int, help="[--times] default 1")
    g.add_argument("--data-parallel", "--local-DP", type=int, help="[--local-DP] default 1")
    g.add_argument("--recompute", choices=RECOMPUTE,
                   help="activation recompute per stage (default never): always, except_last, "
                   "or auto (the stages the memory estimate needs for --memory-per-rank)")
    g.add_argument("--memory-per-rank", type=bytes_arg, metavar="SIZE",
                   help="memory budget per rank for --recompute auto, e.g. 4GiB")
    g.add_argument("--recompute-segments", type=int, metavar="K",
                   help="checkpoint each stage in K segments, keeping only their inputs "
                   "(default 1: off)")
    g.add_argument("--channels-last", action="store_true", default=None,
                   help="convolutions in the channels-last memory format")
    g.add_argument("--precision", choices=tuple(PRECISION_DTYPES),
                   help="compute dtype (default fp32): bf16 or fp16 as under torch.autocast, "
                   "with float32 weights; fp16 adds a dynamic loss scale")
    g.add_argument("--halo-fusion", choices=HALO_FUSION,
                   help="spatial plans: consecutive convolutions / pools share one wider halo "
                   "exchange (default off; auto: where the cost model says it pays)")
    g.add_argument("--compile", action="store_true", default=None,
                   help="compile each rank's stages with torch.compile (Inductor): fused "
                   "pointwise code, the same values to rounding; compiles at the first step")
    add_args(g, run=True)
    add_train_args(p)
    return p


def plan_from_args(a: argparse.Namespace) -> Plan:
    v = {dest: default if getattr(a, dest) is None else getattr(a, dest)
         for dest, _, default in PLAN_FLAGS}
    try:
        balance = tuple(int(b) for b in v["balance"].split(",")) if v["balance"] else None
    except ValueError:
        raise PlanError(f"--balance {v['balance']}: give comma-separated node counts per "
                        f"stage, e.g. --balance 40,29") from None
    return Plan(stages=v["stages"], balance=balance, microbatches=v["microbatches"],
                schedule=v["schedule"], stages_per_rank=v["stages_per_rank"],
                spatial_parts=v["spatial_parts"], slice=v["slice"],
                grid=v["grid"], spatial_stages=v["spatial_stages"], gems=v["gems"],
                gems_times=v["times"], data_parallel=v["data_parallel"],
                recompute=v["recompute"], memory_per_rank=v["memory_per_rank"],
                recompute_segments=v["recompute_segments"],
                channels_last=v["channels_last"], precision=v["precision"],
                halo_fusion=v["halo_fusion"], compile=v["compile"])


def input_size(a: argparse.Namespace) -> tuple[int, ...]:
    """The spatial size to compile for: ``--image-size`` as (H, W) or (D, H, W); an int is a
    square image, or a cube when ``--grid`` is DxHxW. Raises DataError when --grid and
    --image-size disagree on the number of spatial dims."""
    given = 256 if a.image_size is None else a.image_size
    grid = getattr(a, "grid", None)
    if isinstance(given, int):
        size = spatial_size(given, 3 if grid is not None and len(grid) == 3 else 2)
    else:
        size = spatial_size(given)
    if grid is not None and len(grid) != len(size):
        kinds = {2: "an image (HxW)", 3: "a volume (DxHxW)"}
        raise DataError(f"--grid {'x'.join(map(str, grid))} splits {len(grid)} spatial dims "
                        f"but --image-size {'x'.join(map(str, size))} is "
                        f"{kinds.get(len(size), f'{len(size)}-D')}: give --grid with one tile "
                        f"count per dim of --image-size")
    return size


class SavedOnly(Exception):  # noqa: N818 - not an error: the run ends after saving
    """``--save-program`` outside mpiexec: the programs are written, nothing trains."""

    def __init__(self, folder: Path, world_size: int) -> None:
        super().__init__(folder, world_size)
        self.folder, self.world_size = folder, world_size


def _source(a: argparse.Namespace, shape: tuple[int, ...],
            dtype: torch.dtype) -> BatchSource:
    """The data source; sets ``a.steps`` (from --epochs with --data). Raises DataError."""
    if a.data is None:
        if a.epochs is not None:
            raise DataError("--epochs needs --data DIR (synthetic data has no epochs): "
                            "use --steps")
        a.steps = 10 if a.steps is None else a.steps
        return sampled_source(a, Synthetic(shape, a.num_classes, dtype, a.seed))
    # a CSV (labels or masks), or a folder at another pyramid level: fxpar.data.samples; a
    # plain folder: the image folder reader (NIfTI volumes, PIL images as before)
    samples = a.data.suffix.lower() == ".csv" or a.level != 0 or sampled(a)
    if samples:
        src: Any = open_source(a.data, shape, dtype, a.seed, shuffle=not a.no_shuffle,
                               level=a.level)
        classes = len(src.data.classes)
    else:
        data = ImageFolder.scan(a.data, tuple(shape[2:]), shape[1])
        classes = len(data.classes)
    if classes > a.num_classes:
        raise DataError(f"--data {a.data} has {classes} classes but the model has "
                        f"--num-classes {a.num_classes}: raise --num-classes")
    if not samples:
        src = FolderBatches(data, shape[0], dtype, a.seed, shuffle=not a.no_shuffle)
    if a.epochs is not None and a.steps is not None:
        raise DataError("give --steps or --epochs, not both")
    if a.epochs is not None:
        a.steps = a.epochs * src.steps_per_epoch
    a.steps = 10 if a.steps is None else a.steps
    return sampled_source(a, src)  # --sampler / --augment: drawn, augmented regions


def _compiled(a: argparse.Namespace, comm: Comm | None) -> Job:
    if a.model_arg is None:
        a.model_arg = []
    a.batch_size = 8 if a.batch_size is None else a.batch_size
    size = input_size(a)
    a.image_size = 256 if a.image_size is None else a.image_size
    torch.manual_seed(a.seed)  # every rank builds the same initial model
    dtype = getattr(torch, a.dtype)
    if a.plan == "auto":
        check_no_layout(a, {})
    plan = plan_from_args(a)
    if a.plan != "auto":
        plan.check_batch(a.batch_size)
    shape = (a.batch_size, a.channels, *size)
    source = _source(a, shape, dtype)
    kwargs = parse_kwargs(a.model_arg)
    kwargs.setdefault("num_classes", a.num_classes)
    if a.num_layers is not None:
        kwargs["num_layers"] = a.num_layers
    if a.num_filters is not None:
        kwargs["num_filters"] = a.num_filters
    model = build_model(a.model, **kwargs).to(dtype)
    t0 = time.perf_counter()
    if comm is None and failfast.launched():
        from fxpar.comm.world import world as mpi_world

        comm = mpi_world()  # rank 0 captures the model for every rank (fxpar.frontend.share)
    if comm is not None and comm.size > 1:
        # the first collective: a rank that failed on its own before (its data, say) arrives
        # here from its error path (failfast.agree), and every rank stops with its error
        failfast.agree(comm, None, counted=False)
    if a.plan == "auto":
        plan = _auto(a, model, shape, comm, plan)
    example = torch.empty(shape, dtype=dtype, device="meta")
    loss_fn = make_loss(a.loss, a.ignore_index, a.class_weights, a.num_classes, dtype)
    try:
        program = fx_compile(model, plan, example, loss_fn=loss_fn, comm=comm,
                             optimizer=optimizer(a))
    except PlanError:
        if a.plan != "auto" or plan.balance is None:
            raise
        plan = dataclasses.replace(plan, balance=None)  # the compiler's own cuts
        program = fx_compile(model, plan, example, loss_fn=loss_fn, comm=comm,
                             optimizer=optimizer(a))
    out = program.output_shape
    if isinstance(source, Synthetic) and out is not None and len(out) == len(shape):
        source.masks = tuple(out[2:])  # a segmentation model: one label per pixel
    if LOSSES[a.loss].segmentation and (out is None or len(out) < 3):
        raise LossArgError(f"--loss {a.loss} compares per-pixel masks, but {a.model} gives "
                           f"{'x'.join(map(str, out or ()))} outputs (one per image): use "
                           f"--loss ce or focal, or a segmentation model")
    took = time.perf_counter() - t0
    if a.save_program is not None and comm is None and not failfast.launched():
        raise SavedOnly(program.save(a.save_program), program.world_size)
    rp = program.local(comm)
    if a.save_program is not None:  # each rank writes its own folder, rank 0 the manifest
        from fxpar.program.emit import save

        save(program, a.save_program, ranks=[rp.rank], manifest=rp.rank == 0)
    return Job(rp, source, rp.input_window(), shape, dtype, took)


def _auto(a: argparse.Namespace, model: torch.nn.Module, shape: tuple[int, ...],
          comm: Comm | None, given: Plan) -> Plan:
    """``--plan auto``: every rank runs the same search (the same answer, on the same profile:
    without --profile, this machine's, which every rank measures together when it is not
    cached: fxpar.cli.auto.profile_of); rank 0 prints it."""
    plan, found = choose(model, shape, comm, a, given)
    if comm is None or comm.rank == 0:
        print(found.report(), flush=True)
    return plan


def _saved(a: argparse.Namespace, comm: Comm | None) -> Job:
    """A program folder written by ``program.save``: its plan, model and batch size."""
    from fxpar.program.layout import read_program
    from fxpar.program.loader import load

    given = [flag for dest, flag, _ in PLAN_FLAGS if getattr(a, dest) is not None]
    given += [flag for dest, flag in MODEL_FLAGS if getattr(a, dest) is not None]
    if given:
        raise PlanError(f"{a.model} is a saved program, whose plan and model are fixed: drop "
                        f"{', '.join(given)} (or compile again from the model)")
    info = read_program(a.model)  # load() below checks the job's size against the plan's
    batch = int(info["batch_size"])
    if a.batch_size is not None and a.batch_size != batch:
        raise PlanError(f"{a.model} was compiled for a batch of {batch}, not --batch-size "
                        f"{a.batch_size}: drop --batch-size")
    a.batch_size = batch
    recorded = info.get("input_shape")
    if recorded:
        _, channels, *spatial = (int(s) for s in recorded)
        size = tuple(spatial)
        if a.image_size is not None:
            given = (a.image_size,) * len(size) if isinstance(a.image_size, int) else \
                tuple(a.image_size)
            if given != size:
                raise DataError(f"{a.model} was compiled for inputs of "
                                f"{'x'.join(map(str, recorded))} (N x C x "
                                f"{'D x ' if len(size) == 3 else ''}H x W), not --image-size "
                                f"{'x'.join(map(str, given))}: drop --image-size")
        a.channels = channels
    elif a.image_size is None:
        raise PlanError(f"{a.model}/program.json does not record the input size: give "
                        f"--image-size (HxW, or DxHxW for a volume; and --channels if not 3)")
    else:
        size = spatial_size(a.image_size)
    shape = (batch, a.channels, *size)
    if info.get("output_shape") and len(info["output_shape"]) >= 2:
        a.num_classes = int(info["output_shape"][1])  # labels in range of the saved model's
    source = _source(a, shape, getattr(torch, a.dtype))
    t0 = time.perf_counter()
    chosen = a.loss != "ce" or a.ignore_index is not None or a.class_weights is not None
    rp = load(a.model, comm, optimizer=optimizer(a),
              loss_fn=make_loss(a.loss, a.ignore_index, a.class_weights, a.num_classes,
                                getattr(torch, a.dtype)) if chosen else None)
    dtype = next((p.dtype for p in rp.parameters()), getattr(torch, a.dtype))
    if hasattr(source, "dtype"):
        source.dtype = dtype  # the saved weights decide
    a.dtype = str(dtype).removeprefix("torch.")
    window = rp.input_window(image=shape[2:])
    if window is not None and window.ndim != len(shape) - 2:
        raise DataError(f"{a.model}/program.json records rank {rp.rank}'s input window as "
                        f"{window} ({window.ndim} spatial dims) but the input is "
                        f"{'x'.join(map(str, shape))} ({len(shape) - 2}): the folder does not "
                        f"match its input shape; save the program again")
    return Job(rp, source, window, shape, dtype, time.perf_counter() - t0, "loaded")


def setup(a: argparse.Namespace, comm: Comm | None = None) -> Job:
    """Check everything (plan, model, data), then build this rank's program. Raises one of
    USER_ERRORS before any communication."""
    if a.watchdog is not None:
        watchdog.set_watchdog(a.watchdog)
    if a.nonfinite is not None:
        nonfinite_policy(a.nonfinite)  # checked before any communication
    if a.log_every is not None and a.log_every < 1:
        raise ValueError("--log-every must be >= 1")
    if a.checkpoint_every is not None and (a.checkpoint is None or a.checkpoint_every < 1):
        raise ValueError("--checkpoint-every K needs --checkpoint DIR and K >= 1")
    check_eval_args(a)
    if a.resume is not None:
        from fxpar.program.checkpoint import read_manifest

        read_manifest(a.resume)  # a missing or foreign folder fails here, on every rank
    from fxpar.comm.device import bind
    from fxpar.comm.world import node_comm

    where = bind((comm or node_comm()) if a.device != "cpu" else None, a.device)
    job = _saved(a, comm) if Path(a.model).is_dir() else _compiled(a, comm)
    if a.val_data is not None:  # the model's classes: its output's, when the graph says
        out = output_shape(job.rp.program)
        classes = out[1] if out is not None and len(out) > 1 else a.num_classes
        job.val = open_validation(a.val_data, job.shape, job.dtype, classes, a.seed,
                                  level=a.level, limit=a.val_batches)
        check_task(a, job.val)
        check_output(job.val, out)
    job.rp.to(where)
    if a.nonfinite is not None:  # the flag wins over FXPAR_NONFINITE (fxpar.core.options)
        job.rp.guard.policy = a.nonfinite
    return job


def main(argv: Sequence[str] | None = None, comm: Comm | None = None) -> int:
    """The command line. comm: run on this communicator instead of every MPI rank (tests).

    In a job of more than one rank, fail-fast is on from the start (an uncaught exception on
    any rank ends the whole job) and the hooks found before are put back on return."""
    a = parser().parse_args(argv)
    held = failfast.install()
    code = _main(a, comm)
    failfast.uninstall(held)  # never reached by an exception: that must end the whole job
    return code


def _main(a: argparse.Namespace, comm: Comm | None) -> int:
    checks = failfast.agreements()
    try:
        job = setup(a, comm)
    except SavedOnly as done:
        print(f"fxpar-run: wrote the programs of {done.world_size} rank(s) to {done.folder}; "
              f"run them with `mpiexec -n {done.world_size} fxpar-run {done.folder}`")
        return 0
    except USER_ERRORS as e:
        return _user_error(e, comm, failfast.agreements() > checks)
    rp = job.rp
    if rp.rank == 0:
        mixed = rp.plan.precision
        scaled = ", dynamic loss scale" if mixed == "fp16" else ""
        compute = "" if mixed == "fp32" else f" (compute {mixed}{scaled})"
        print(f"fxpar-run: {a.model} {'x'.join(map(str, job.shape))} {a.dtype}{compute} on "
              f"{rp.program.world_size} rank(s); {job.how} in {job.compile_s:.2f} s; "
              f"{describe(job.source)}", flush=True)
        if job.val is not None:
            print(job.val.describe(), flush=True)
    start = resume(job, a)
    if start is None:
        rp.close()
        return 2
    try:
        run(job, a, start)
    except Exception as e:
        if rp.comm is None or rp.comm.size == 1:
            raise
        failfast.fail(e)  # one rank failing must end them all, never leave them waiting
    rp.close()
    return 0


def _user_error(e: Exception, comm: Comm | None, checked: bool) -> int:
    return user_error("fxpar-run", e, comm, checked)


if __name__ == "__main__":
    sys.exit(main())
