"""Every error a user of fxpar can hit: when, a trigger that raises it (no MPI), the fix.

tests/unit/test_errors.py runs each trigger and checks the exception type and its distinctive text;
tools/errors_doc.py runs them again and pastes the real messages into docs/errors.md. A trigger
runs in an empty scratch folder (the current directory), so the paths it writes and the messages
it gets back are relative and the same on every machine. Entries without a trigger are runtime
failures reachable only under ``mpiexec``; their text comes from fxpar.comm.failfast.
"""

from __future__ import annotations

import contextlib
import io
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import fxpar
import helpers.errors_reliability as rel
from fxpar import Plan, PlanError, TraceError
from fxpar.cli.auto import AutoUsageError
from fxpar.cli.inspect import UsageError
from fxpar.cli.losses import LossArgError, make_loss
from fxpar.comm import device as fxdevice
from fxpar.comm import failfast
from fxpar.comm import world as fxcomm
from fxpar.comm.device import DeviceError
from fxpar.compiler.passdriver import PassError
from fxpar.compiler.receptive import ReachError, reach_model
from fxpar.core.faults import FaultSpecError
from fxpar.data import images as fxpar_images
from fxpar.data.data import DataError, FolderBatches, ImageFolder
from fxpar.models import zoo
from fxpar.models.zoo import ModelSpecError
from fxpar.perf.profile import Profile, ProfileError
from fxpar.program import checkpoint as ckpt
from fxpar.program.checkpoint import CheckpointError
from fxpar.report.draw import DotMissing, ExtraMissing
from fxpar.runtime.guard import NonFiniteError, ProgramFailed
from fxpar.runtime.loop import ActionFailed
from fxpar.runtime.materialize import MaterializeError
from fxpar.testing import load_case
from fxpar.train.metrics import MetricsError
from helpers.errors_triggers import (
    DataDependent,
    FakeComm,
    Gated,
    Twice,
    agree,
    bad_pointer,
    build,
    cnn,
    conv_then,
    cuda_aware,
    damaged_checkpoint,
    device_index,
    device_no_cuda,
    failing_loss,
    foreign_manifest,
    images,
    manifest_not_json,
    meta_model,
    mixed_dtypes,
    moved_after_step,
    no_communicator,
    no_dot,
    no_graphviz_package,
    pass_bug,
    peer_cannot_load,
    rank_failed,
    run_inspect,
    run_setup,
    saved,
    saved_checkpoint,
    sgd,
    shard_missing,
    shared_attribute,
    small_tag_ub,
    too_many_tags,
    torn_checkpoint,
    unchecked_unreadable,
    version_missing,
    watchdog_fired,
)


def _running_sum_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out, y) + out.cumsum(2).mean()  # a running sum down the rows


def _tile_loss_with(target: Any) -> None:
    from fxpar.core.geometry import Grid
    from fxpar.program.tileloss import TileLoss

    TileLoss(None, F.cross_entropy, Grid(2, 1), (8, 8), 0, lambda: torch.device("cpu"),
             False)(0, 0, torch.zeros(2, 3, 4, 8), target)  # type: ignore[arg-type]


GROUPS: dict[str, str] = {
    "plan": "Plan fields",
    "model": "Model, example input and tracing",
    "spatial": "Spatial parallelism (spatial_parts > 1)",
    "stages": "Stages and pipelines",
    "batch": "Batches, train_step and forward",
    "launch": "Launching: mpiexec -n and ranks",
    "loader": "Saved programs (program.save, fxpar-run DIR)",
    "checkpoint": "Checkpoints",
    "data": "Data (fxpar-run --data)",
    "cli": "fxpar-run and fxpar-inspect command lines",
    "predict": "Region-by-region inference (fxpar.predict, fxpar-predict)",
    "device": "Devices",
    "runtime": "Runtime failures under mpiexec",
}
"""Sections of docs/errors.md, in order."""


@dataclass(frozen=True)
class Entry:
    """One user-facing error."""

    id: str
    group: str
    when: str
    """What the user did, in a few words."""
    error: type[BaseException] | None
    """The exception class (None: not an exception, a text printed before the job ends)."""
    match: str
    """A regular expression that this entry's message matches and no other entry's does."""
    fix: str
    trigger: Callable[[], Any] | None = None
    """Raises the error (in a scratch folder, without MPI); None for runtime-only failures."""
    text: Callable[[], str] | None = None
    """For runtime-only failures: the text fxpar prints, built by failfast's functions."""


# -- the catalogue -------------------------------------------------------------------------------
CATALOGUE: list[Entry] = [
    # plan fields
    Entry("plan-integer-field", "plan", "a count field is not a positive integer", PlanError,
          r"Plan\.stages must be an integer >= 1",
          "Give stages, microbatches, spatial_parts, spatial_stages, gems_times and "
          "data_parallel as integers >= 1 (1 turns that kind of parallelism off).",
          lambda: Plan(stages="2")),
    Entry("plan-schedule", "plan", "an unknown pipeline schedule", PlanError,
          r"Plan\.schedule must be one of", 'Use one of the names listed, e.g. schedule="1f1b".',
          lambda: Plan(schedule="zero-bubble")),
    Entry("plan-interleaved-one-stage", "plan", "the interleaved schedule with one stage per "
          "rank", PlanError, r"interleaved_1f1b' places several stages on each rank",
          "Give stages_per_rank >= 2 with stages a multiple of it, or use schedule=\"1f1b\".",
          lambda: Plan(stages=4, microbatches=4, schedule="interleaved_1f1b")),
    Entry("plan-interleaved-rounds", "plan", "interleaved micro-batches that do not fill "
          "rounds", PlanError, r"rounds of one per pipeline rank",
          "Make microbatches a multiple of stages // stages_per_rank.",
          lambda: Plan(stages=4, stages_per_rank=2, microbatches=3,
                       schedule="interleaved_1f1b")),
    Entry("plan-interleaved-spatial", "plan", "virtual stages with only some stages spatial",
          PlanError, r"must have the same tiles",
          "Make every stage spatial (spatial_stages=stages) or drop spatial_parts.",
          lambda: Plan(stages=4, stages_per_rank=2, microbatches=2, spatial_parts=2,
                       schedule="interleaved_1f1b")),
    Entry("plan-zero-bubble-v-shape", "plan", "a V schedule without two stages per rank",
          PlanError, r"zero_bubble_v' places 2 stages on each rank",
          "Set stages_per_rank=2 and stages to twice the pipeline ranks.",
          lambda: Plan(stages=4, microbatches=2, schedule="zero_bubble_v")),
    Entry("plan-stages-per-rank-schedule", "plan", "several stages per rank under a "
          "one-stage schedule", PlanError, r"needs schedule='interleaved_1f1b' or",
          "Use schedule=\"interleaved_1f1b\" or \"zero_bubble_v\", or stages_per_rank=1.",
          lambda: Plan(stages=4, stages_per_rank=2, microbatches=2, schedule="1f1b")),
    Entry("plan-zero-bubble-segments", "plan", "zero bubble with checkpoint segments",
          PlanError, r"zero_bubble' splits each backward",
          "Use recompute_segments=1 (stage recompute works with it) or schedule=\"1f1b\".",
          lambda: Plan(stages=2, microbatches=2, schedule="zero_bubble", recompute_segments=2)),
    Entry("plan-slice", "plan", "an unknown way to cut the image", PlanError,
          r"Plan\.slice must be one of", 'Use slice="vertical", "horizontal" or "square" '
          '(images and volumes), "slab", "pencil" or "cube" (volumes), or an explicit grid.',
          lambda: Plan(slice="diagonal")),
    Entry("plan-grid-values", "plan", "an explicit grid that is not 1 to 3 positive integers",
          PlanError, r"Plan\.grid must hold 1 to 3 integers >= 1", "Give one tile count >= 1 "
          "per spatial dim: grid=(2, 2) for an image (H, W), grid=(2, 2, 2) for a volume "
          "(D, H, W).", lambda: Plan(grid=(2, 0, 2))),
    Entry("plan-grid-parts", "plan", "an explicit grid and spatial_parts that disagree",
          PlanError, r"Plan\.grid=\(2, 2\) makes 4 tiles but spatial_parts=3",
          "Give only grid (spatial_parts becomes its product), or make spatial_parts equal to "
          "the product.", lambda: Plan(grid=(2, 2), spatial_parts=3)),
    Entry("plan-grid-dims", "spatial", "an explicit grid with another number of dims than the "
          "input", PlanError, r"Plan\.grid=\(2, 2\) has 2 dims but the input is a volume",
          "Give one tile count per spatial dim of the input: (D, H, W) for a volume, (H, W) "
          "for an image.",
          lambda: build(Plan(grid=(2, 2)), shape=(2, 3, 8, 8, 8),
                        model=nn.Sequential(nn.Conv3d(3, 4, 3, padding=1), nn.ReLU()))),
    Entry("plan-recompute", "plan", "an unknown activation recompute mode", PlanError,
          r"Plan\.recompute must be one of", 'Use recompute="never", "always", "except_last" or '
          '"auto" (fxpar-run: --recompute).', lambda: Plan(recompute="sometimes")),
    Entry("plan-recompute-budget", "plan", 'recompute="auto" without a memory budget',
          PlanError, r'recompute="auto" chooses the stages to recompute for a memory budget',
          "Give memory_per_rank in bytes (fxpar-run: --memory-per-rank 4GiB), or choose the "
          'stages yourself with "always" / "except_last".', lambda: Plan(recompute="auto")),
    Entry("plan-recompute-segments", "plan", "recompute_segments is not a positive integer",
          PlanError, r"Plan\.recompute_segments must be an integer >= 1",
          "Give the number of checkpoint segments per stage, 1 for none (fxpar-run: "
          "--recompute-segments 8).", lambda: Plan(recompute_segments=0)),
    Entry("plan-precision", "plan", "an unknown precision", PlanError,
          r"Plan\.precision must be one of \('fp32', 'bf16', 'fp16'\)",
          'Use precision="fp32", "bf16" or "fp16" (fxpar-run: --precision bf16).',
          lambda: Plan(precision="half")),
    Entry("plan-halo-fusion", "plan", "an unknown halo_fusion mode", PlanError,
          r"Plan\.halo_fusion must be one of \('off', 'auto', 'all'\)",
          'Use halo_fusion="off", "auto" (fuse where the cost model says it pays) or "all" '
          "(fxpar-run: --halo-fusion auto).", lambda: Plan(halo_fusion=True)),
    Entry("plan-memory-budget", "plan", "memory_per_rank is not a positive number of bytes",
          PlanError, r"Plan\.memory_per_rank must be a number of bytes",
          "Give bytes as an integer, e.g. 4 * 2**30 for 4 GiB.",
          lambda: Plan(memory_per_rank="4GB")),
    Entry("plan-gems-flag", "plan", "gems is not a bool", PlanError,
          r"Plan\.gems must be True or False", "Pass gems=True or gems=False.",
          lambda: Plan(gems=1)),
    Entry("plan-strict-flag", "plan", "strict is not a bool", PlanError,
          r"Plan\.strict must be True or False", "Pass strict=True or strict=False.",
          lambda: Plan(strict="yes")),
    Entry("plan-spatial-stages", "plan", "more spatial stages than stages", PlanError,
          r"exceeds stages=", "The spatial stages are the leading stages: set "
          "spatial_stages <= stages, or raise stages.",
          lambda: Plan(spatial_parts=2, spatial_stages=2)),
    Entry("plan-gems-times", "plan", "gems_times without gems", PlanError,
          r"gems_times > 1 needs gems=True", "Set gems=True, or leave gems_times=1.",
          lambda: Plan(gems_times=2)),
    Entry("plan-balance-type", "plan", "balance is a number or a string", PlanError,
          r"Plan\.balance must be a sequence", "Give one node count per stage, e.g. "
          "balance=(40, 29) for stages=2 (fxpar-run: --balance 40,29).",
          lambda: Plan(stages=2, balance=69)),
    Entry("plan-balance-entries", "plan", "a balance entry is not a positive integer",
          PlanError, r"Plan\.balance entries must be integers >= 1",
          "Every stage needs at least one node: give integers >= 1.",
          lambda: Plan(stages=2, balance=(0, 69))),
    Entry("plan-balance-length", "plan", "balance has not one entry per stage", PlanError,
          r"Plan\.balance has \d+ entries but stages=", "Give exactly `stages` node counts.",
          lambda: Plan(stages=2, balance=(20, 20, 29))),
    Entry("plan-unknown-field", "plan", "a misspelt Plan field", TypeError,
          r"unexpected keyword argument", "Use the field names of fxpar.Plan (stages, balance, "
          "microbatches, schedule, spatial_parts, slice, grid, spatial_stages, gems, "
          "gems_times, data_parallel, recompute, recompute_segments, memory_per_rank, "
          "precision, channels_last, strict); Plan takes keywords only.",
          lambda: Plan(stage=2)),
    Entry("plan-not-a-plan", "plan", "build() is given something else than a Plan",
          TypeError, r"needs plan=fxpar\.Plan", "Build the plan with fxpar.Plan(**fields).",
          lambda: build({"stages": 2})),  # type: ignore[arg-type]
    # model, example input, tracing
    Entry("model-not-a-module", "model", "the model is a function, not an nn.Module",
          TypeError, r"model as a torch\.nn\.Module",
          "Put the computation in the forward() of an nn.Module.",
          lambda: fxpar.compile(F.relu, Plan(), (4, 3, 8, 8))),  # type: ignore[arg-type]
    Entry("model-no-example", "model", "build() without an example input", TypeError,
          r"needs example_input", "Pass the global batch, a meta tensor of its shape, or just "
          "its shape: fxpar.compile(model, plan, (8, 3, 1024, 1024)).",
          lambda: fxpar.compile(cnn(), Plan())),
    Entry("model-example-type", "model", "the example input is neither a tensor nor a shape",
          TypeError, r"example_input must be a tensor or a shape",
          "Pass a tensor (meta is fine) or a tuple of integers.",
          lambda: build(shape="4x3x8x8")),  # type: ignore[arg-type]
    Entry("model-example-empty", "model", "the example input has a zero-sized dimension",
          ValueError, r"every size >= 1", "Give the real global batch shape, batch first.",
          lambda: build(shape=(4, 3, 0, 8))),
    Entry("model-untraceable", "model", "forward() has Python control flow on tensor values",
          TraceError, r"could not capture DataDependent at .*errors_triggers\.py:\d+ in forward "
          r"\(`if y\.sum\(\) > 0",
          "The message names the source line: express the choice with tensor ops "
          "(torch.where, masks).",
          lambda: build(model=DataDependent())),
    Entry("model-untraceable-module", "model", "a submodule cannot be traced", TraceError,
          r"could not capture Gated in module 'gate' \(Gate\) at .*errors_triggers\.py:\d+",
          "The message names the innermost module and the source line: rewrite that choice "
          "with tensor ops (torch.where, masks).",
          lambda: build(model=Gated())),
    Entry("model-shape", "model", "the example input does not fit the model", TraceError,
          r"could not capture Sequential in module '0' \(Conv2d\): RuntimeError: .*expected "
          r"input",
          "Check the example input's shape (channels, image large enough for every stride and "
          "pooling window) and the model's layer sizes; the message names the module.",
          lambda: build(shape=(4, 5, 8, 8))),
    Entry("model-lazy", "model", "the model has lazy modules (nn.LazyLinear, ...)", TraceError,
          r"uninitialized lazy parameters", "Run the model once on a small batch before "
          "compiling, or give the layer its sizes.",
          lambda: build(model=nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten(),
                                               nn.LazyLinear(3)))),
    Entry("model-meta-init", "model", "a model built on meta has a module without "
          "reset_parameters()", MaterializeError, r"has no reset_parameters\(\)",
          "Pass init=fn to fxpar.compile; fn(qualified_name, module) fills the module's tensors.",
          meta_model),
    # spatial
    Entry("spatial-not-4d", "spatial", "spatial_parts > 1 for a model whose input is neither an "
          "image, a volume nor a sequence", PlanError, r"splits the spatial dims of an image "
          r"\(N, C, H, W\), a volume", "Set spatial_parts=1: stages, microbatches, gems and "
          "data_parallel work on any input.",
          lambda: build(Plan(spatial_parts=2), shape=(4, 16),
                           model=nn.Sequential(nn.Linear(16, 4), nn.ReLU()))),
    Entry("spatial-image-too-small", "spatial", "the image has fewer rows or columns than "
          "the tile grid", PlanError, r"use an image of at least",
          "Use a larger image, fewer spatial_parts, or another slice (the message gives the "
          "numbers that fit).",
          lambda: build(Plan(spatial_parts=16, slice="vertical"))),
    Entry("spatial-first-op", "spatial", "the very first op on the image cannot run on tiles",
          PlanError, r"the first op on the image must run on tiles",
          "Change that op as the message says (e.g. padding as numbers instead of 'same'), or "
          "set spatial_parts=1.",
          lambda: build(Plan(spatial_parts=2), model=nn.Sequential(
              nn.Conv2d(3, 4, 3, padding="same"), nn.Flatten()))),
    Entry("spatial-mean-first", "spatial", "the image goes straight into a global reduction "
          "(mean, sum, amax over H and W)",
          PlanError, r"a reduction over all of H and W, so there is no per-pixel work",
          "Set spatial_parts=1, or put the convolutions before the reduction.",
          lambda: build(Plan(spatial_parts=2), model=nn.Sequential(
              nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(3, 3)))),
    Entry("spatial-stage-empty", "spatial", "a spatial stage starts after the spatial region "
          "has ended", PlanError, r"would have no tiled work",
          "The message says where and why the region ends (flatten, linear, an op fxpar does "
          "not tile, a tile grid larger than the feature map). Use fewer spatial_stages, move "
          "the cut with Plan.balance, or change that op.",
          lambda: build(Plan(stages=3, spatial_parts=2, spatial_stages=2), model=nn.Sequential(
              conv_then(), nn.Flatten(), nn.Linear(256, 8), nn.ReLU(), nn.Linear(8, 3)))),
    Entry("spatial-coverage-strict", "spatial", "with Plan(strict=True), the spatial region "
          "runs too little of the model on tiles", PlanError,
          r"the spatial region runs only \d+% of the spatial stages' forward FLOPs "
          r".*Plan\(strict=True\)",
          "The message names the op that ends the region and where it is in the model's code; "
          "change that op, or accept the plan with strict=False (it then warns).",
          lambda: build(Plan(spatial_parts=2, strict=True), model=nn.Sequential(
              nn.Conv2d(3, 4, 3, padding=1), nn.Flatten(), nn.Unflatten(1, (1, 16, 16)),
              nn.Conv2d(1, 8, 3, padding=1),
              nn.Conv2d(8, 8, 3, padding=1), nn.Flatten(), nn.Linear(8 * 16 * 16, 3)))),
    Entry("loss-joined-strict", "spatial", "with Plan(strict=True), a loss on a tiled output "
          "with an op that has no tile rule", PlanError,
          r"in the loss .*Plan\(strict=True\) refuses to join the output",
          "The message names the op and the loss's line. Reduce over the image only with sums, "
          "means, maxima or norms over all of H and W (or none of them), or accept the plan "
          "with strict=False: the loss then runs on the joined output, exactly, with a "
          "LossWarning.",
          lambda: fxpar.compile(
              nn.Conv2d(3, 3, 3, padding=1), Plan(spatial_parts=2, slice="horizontal",
                                                  strict=True), (2, 3, 8, 8),
              loss_fn=_running_sum_loss,
              target=torch.empty(2, 8, 8, dtype=torch.int64, device="meta"))),
    Entry("cli-loss-option", "cli", "fxpar-run --loss with an option that loss has not",
          LossArgError, r"--loss tversky has no --class-weights",
          "Drop the option, or choose a --loss that has it (fxpar-run --help lists them).",
          lambda: make_loss("tversky", None, "1,2")),
    Entry("loss-targets-not-tensors", "batch", "a tiled output's targets are not tensors",
          TypeError, r"the loss of a tiled output takes tensors as targets",
          "Pass the targets as a tensor, or a tuple of tensors such as (target, mask), each "
          "with the batch first.",
          lambda: _tile_loss_with({"mask": None})),
    # stages and pipelines
    Entry("stages-too-many", "stages", "more stages than compute nodes", PlanError,
          r"but the model has only \d+ compute nodes", "Use at most that many stages.",
          lambda: build(Plan(stages=12))),
    Entry("stages-balance-sum", "stages", "balance does not add up to the graph's nodes",
          PlanError, r"sums to \d+ but the model has",
          "Make the counts sum to the number of compute nodes (fxpar-inspect lists the nodes).",
          lambda: build(Plan(stages=2, balance=(2, 2)))),
    Entry("stages-shared-parameter", "stages", "a module used in two stages", PlanError,
          r"parameters shared across stages are not supported",
          "Set Plan.balance so that every use of the module falls in one stage.",
          lambda: build(Plan(stages=2, balance=(3, 3)), model=Twice())),
    Entry("stages-shared-attribute", "stages", "a tensor attribute used in two stages",
          PlanError, r"a tensor attribute shared across stages",
          "Set Plan.balance so that every use of the attribute falls in one stage.",
          shared_attribute),
    Entry("stages-too-many-tags", "stages", "the plan needs MPI tags above 32767 (micro-batches "
          "x tensors crossing the cuts)", PlanError,
          r"MPI tags exceed 32767, the largest tag every MPI accepts",
          "Use fewer micro-batches (or gems_times), or cuts that fewer tensors cross "
          "(Plan.balance): every message of a step has its own tag.", too_many_tags),
    Entry("stages-mixed-dtypes", "stages", "gradients summed over ranks for a stage whose "
          "parameters have several dtypes", PlanError, r"parameters have several dtypes",
          "Give the model one parameter dtype (model.to(dtype)), or put the layers of the "
          "other dtype in a stage of their own (Plan.balance).", mixed_dtypes),
    Entry("stages-compiler-bug", "stages", "a compiler pass fails on a valid model and plan",
          PassError, r"pass 'my_pass' failed \(after",
          "A bug in fxpar: report it with the model, the plan and this message (it names the "
          "pass and the passes that ran before it).", pass_bug),
    # batch
    Entry("batch-chunks", "batch", "the batch does not split into equal chunks", PlanError,
          r"does not split into \d+ equal chunks",
          "Use a batch size that is a multiple of data_parallel x (2 with GEMS) x gems_times x "
          "microbatches, or change those fields.",
          lambda: build(Plan(microbatches=4), shape=(6, 3, 8, 8))),
    Entry("batch-empty", "batch", "an empty batch", PlanError, r"needs at least one sample",
          "Train on at least one sample per chunk.",
          lambda: Plan(microbatches=2).check_batch(0)),
    Entry("batch-other-size", "batch", "train_step on another batch size than compiled for",
          PlanError, r"compiled for a global batch of",
          "Compile with an example of the batch size you train with.",
          lambda: build(Plan(stages=2)).for_rank(1).train_step(
              torch.randn(8, 3, 8, 8), torch.zeros(8, dtype=torch.long))),
    Entry("batch-no-input", "batch", "x=None on a rank whose stages read the input",
          ValueError, r"read the model input: pass x",
          "Pass x (at least rp.input_window() of it) on that rank.",
          lambda: build(Plan(stages=2)).for_rank(0).train_step(None, None)),
    Entry("batch-no-target", "batch", "y=None on the rank holding the last stage",
          ValueError, r"which computes the loss: pass the targets",
          "Pass the targets y on the last stage's ranks.",
          lambda: build(Plan(stages=2)).for_rank(1).train_step(
              torch.randn(4, 3, 8, 8), None)),
    Entry("batch-target-type", "batch", "targets that are not a tensor, with micro-batches",
          TypeError, r"cannot be split into \d+ chunks",
          "Pass the targets as a tensor whose first dimension is the batch.",
          lambda: build(Plan(microbatches=2)).local().train_step(
              torch.randn(4, 3, 8, 8), [0, 1, 2, 0])),
    # launch
    Entry("launch-world-size", "launch", "the job's size does not match the plan", PlanError,
          r"this plan needs \d+ ranks but the job has",
          "Run with `mpiexec -n <program.world_size>` (or `torchrun --nproc-per-node`, "
          "`srun -n`), or change the plan.",
          lambda: build(Plan(stages=2)).local(comm=FakeComm(3))),  # type: ignore[arg-type]
    Entry("launch-rank-outside", "launch", "for_rank() of a rank the plan does not have",
          PlanError, r"^rank \d+ is outside this plan's",
          "Use a rank in 0 .. program.world_size - 1.",
          lambda: build(Plan(stages=2)).for_rank(5)),
    Entry("launch-tag-ub", "launch", "the job's MPI accepts smaller tags than the program uses",
          PlanError, r"exceed this MPI's MPI_TAG_UB",
          "Use an MPI with a larger MPI_TAG_UB, or a plan with fewer micro-batches or fewer "
          "tensors crossing the cuts (the message lists which tags are too large).",
          small_tag_ub),
    Entry("launch-no-communicator", "launch", "training a multi-rank program made with "
          "for_rank(r), outside mpiexec", PlanError, r"program has no communicator",
          "for_rank(r) is for inspection: train with program.local() under mpiexec.",
          no_communicator),
    Entry("launch-backend", "launch", "FXPAR_COMM names an unknown backend", ValueError,
          r"unknown communication backend",
          "Set FXPAR_COMM to mpi (the default) or torch, or unset it.",
          lambda: fxcomm.world("carrier-pigeon")),
    # saved programs
    Entry("loader-not-a-program", "loader", "loading a folder that is not a saved program",
          PlanError, r"is not a saved fxpar program",
          "Point to a folder written by program.save(DIR) or fxpar-run --save-program DIR.",
          lambda: fxpar.load_program("job")),
    Entry("loader-format", "loader", "a program saved by another fxpar version", PlanError,
          r"has format .*; this fxpar", "Save the program again with this fxpar version.",
          lambda: fxpar.load_program(foreign_manifest("job", "program.json",
                                                       {"fxpar_program": 99}))),
    Entry("loader-world-size", "loader", "mpiexec -n does not match the saved program",
          PlanError, r"was compiled for \d+ ranks but the job has",
          "Run it with `mpiexec -n` as the message says.",
          lambda: fxpar.load_program(saved(Plan(stages=2)),
                                     comm=FakeComm(3))),  # type: ignore[arg-type]
    Entry("loader-loss", "loader", "a saved program whose loss function has no importable "
          "name", PlanError, r"cannot import by name",
          "Pass loss_fn= to fxpar.load_program (a lambda or local function is saved as None).",
          lambda: fxpar.load_program(saved(Plan(), loss_fn=lambda o, y: o.sum()))),
    # checkpoints
    Entry("checkpoint-missing", "checkpoint", "resuming from a folder that holds no complete "
          "checkpoint", CheckpointError, r"not a \(complete\) fxpar checkpoint",
          "Resume from a folder that fxpar.program.checkpoint.save (fxpar-run --checkpoint) "
          "finished.",
          lambda: ckpt.read_manifest("ckpt")),
    Entry("checkpoint-pointer", "checkpoint", "the folder's 'latest' file is damaged",
          CheckpointError, r"is not an fxpar checkpoint pointer",
          "Delete the 'latest' file and load a version by its folder (ckpt/step-NNNNNNNN).",
          bad_pointer),
    Entry("checkpoint-version-gone", "checkpoint", "'latest' names a version that is gone or "
          "that this rank cannot see", CheckpointError, r"names step-\d+ .*which is missing",
          "Put the checkpoint on a file system every rank sees, or load a complete version by "
          "its folder (the message lists them).", version_missing),
    Entry("checkpoint-version", "checkpoint", "a checkpoint of another format version",
          CheckpointError, r"is not an fxpar checkpoint of version",
          "Use a checkpoint written by this fxpar version (or export/import it through a "
          "single-device state_dict).",
          lambda: ckpt.read_manifest(foreign_manifest("ckpt", "checkpoint.json",
                                                       {"format": "other", "version": 0}))),
    Entry("checkpoint-other-job", "checkpoint", "resuming with another model, plan or world "
          "size", CheckpointError,
          r"was saved by another job: (it has \d+ ranks|its plan|it is of another model \(its)",
          "Resume with the same model and plan, or change plans through the single-device "
          "form (fxpar.program.checkpoint.export, then rank_program.load_state_dict).",
          lambda: ckpt.load(saved_checkpoint() and build(Plan(microbatches=2)).local(), "ckpt")),
    Entry("checkpoint-not-collective", "checkpoint", "saving a multi-rank program outside "
          "mpiexec", CheckpointError, r"save is collective",
          "Call fxpar.program.checkpoint.save on every rank of program.local() under mpiexec.",
          lambda: ckpt.save(build(Plan(stages=2)).for_rank(0), "ckpt", step=1)),
    Entry("checkpoint-extra", "checkpoint", "extra= holds something JSON cannot store",
          TypeError, r"checkpoint extra must hold JSON values",
          "Keep extra to JSON values; save tensors in the model or in your own file.",
          lambda: ckpt.save(build().local(), "ckpt", step=1, extra={"t": torch.ones(1)})),
    Entry("checkpoint-shard-missing", "checkpoint", "a rank cannot see its shard",
          CheckpointError, r"is missing: every rank must see",
          "Put the checkpoint on a file system every rank reads.", shard_missing),
    Entry("checkpoint-torn", "checkpoint", "a version folder mixes files of two saves",
          CheckpointError, r"files of two saves are mixed",
          "Load another version (save each step into its own version: "
          "fxpar.program.checkpoint.save does so by itself).",
          torn_checkpoint),
    Entry("checkpoint-other-shapes", "checkpoint", "resuming with a model of the same keys but "
          "other shapes (another width, another number of classes)", CheckpointError,
          r"was saved by another job: it is of another model \(tensors of other shapes",
          "Resume with the model that saved the checkpoint (the message names each tensor whose "
          "shape differs).",
          lambda: ckpt.load(saved_checkpoint() and build(model=cnn(1), shape=(4, 1, 8, 8))
                            .local(), "ckpt")),
    Entry("checkpoint-shard-cut", "checkpoint", "a shard is shorter or longer than when it was "
          "saved (a full disk, a copy that did not finish)", CheckpointError,
          r"^\S+ is damaged: it has \d+ bytes where checkpoint\.json recorded",
          "Load a version the message lists (`fxpar-checkpoint verify DIR/step-NNNNNNNN` checks "
          "one first); find out what cut the file.",
          lambda: ckpt.load(damaged_checkpoint(), "ckpt")),
    Entry("checkpoint-shard-changed", "checkpoint", "a shard's bytes changed after the save (a "
          "disk or file system fault)", CheckpointError, r"^\S+ is damaged: its sha256 is",
          "Load a version the message lists (verify it first); check the storage.",
          lambda: ckpt.load(damaged_checkpoint("flip"), "ckpt")),
    Entry("checkpoint-shard-unreadable", "checkpoint", "torch.load cannot read a shard of a "
          "checkpoint saved before fxpar recorded checksums", CheckpointError,
          r"cannot be read by torch\.load", "Load another version (the message lists them).",
          unchecked_unreadable),
    Entry("checkpoint-manifest-json", "checkpoint", "a version's checkpoint.json is not JSON",
          CheckpointError, r"is not valid JSON .*the manifest was damaged",
          "Load another version (the message lists them).", manifest_not_json),
    Entry("checkpoint-peer-cannot-load", "checkpoint", "resuming when some rank cannot load the "
          "checkpoint (a damaged or missing shard)", CheckpointError,
          r"not loaded on any rank: ",
          "Act on what the message says of the ranks it names: every rank refused, so that "
          "none trains alone.", peer_cannot_load),
    Entry("checkpoint-verify", "checkpoint", "fxpar-checkpoint verify (checkpoint.verify) finds "
          "a damaged or missing shard", CheckpointError, r"shards? of \S+ failed the check",
          "Load a version the message lists instead.",
          lambda: damaged_checkpoint() and ckpt.verify("ckpt")),
    Entry("checkpoint-optimizer", "checkpoint", "resuming with or without an optimizer, unlike "
          "the job that saved", CheckpointError, r"an optimizer, this program has",
          "Compile with the same optimizer= as the job that saved the checkpoint.",
          lambda: ckpt.load(saved_checkpoint() and build(optimizer=sgd).local(), "ckpt")),
    Entry("checkpoint-keys", "checkpoint", "load_state_dict with missing or unknown keys",
          CheckpointError, r"load_state_dict: missing",
          "Pass the whole single-device state_dict of the same model, or strict=False.",
          lambda: build().local().load_state_dict({"0.weight": torch.zeros(4, 3, 3, 3)})),
    Entry("checkpoint-shapes", "checkpoint", "load_state_dict with tensors of other shapes",
          CheckpointError, r"load_state_dict into \(copy, stage\)",
          "Load the state_dict of the same architecture (the message names the tensor).",
          lambda: build().local().load_state_dict(
              {**cnn().state_dict(), "0.weight": torch.zeros(4, 3, 5, 5)})),
    # data
    Entry("data-no-folder", "data", "--data names no folder", DataError, r"no such folder",
          "Give a folder laid out as DIR/<class>/<image>.",
          lambda: ImageFolder.scan("images", 8)),
    Entry("data-no-classes", "data", "--data has no class folders", DataError,
          r"has no class folders", "Put each class's images in DIR/<class name>/.",
          lambda: ImageFolder.scan(str(Path("images").mkdir() or "images"), 8)),
    Entry("data-no-images", "data", "the class folders hold no images", DataError,
          r"hold no images", "Add .npy, .png, .jpg, .jpeg, .tif or .tiff files.",
          lambda: ImageFolder.scan(str(Path("images/cat").mkdir(parents=True) or "images"), 8)),
    Entry("data-image-size", "data", "an image of another size than --image-size", DataError,
          r"every image must be", "Resize or crop the data, or change --image-size.",
          lambda: ImageFolder.scan(images(), 16)),
    Entry("data-channels", "data", "an image with another channel count", DataError,
          r"channel\(s\) but the model takes", "Convert the images, or set --channels.",
          lambda: ImageFolder.scan(images(), 8, channels=1)),
    Entry("data-array-shape", "data", "a .npy file that is not (C, H, W) or (H, W)",
          DataError, r"expected \(C, H, W\) or \(H, W\)", "Save images as (C, H, W) arrays.",
          lambda: ImageFolder.scan(images(shape=(1, 3, 8, 8)), 8)),
    Entry("data-unreadable", "data", "a file that is not an image", DataError,
          r"not a readable image", "Remove or replace the file.",
          lambda: ImageFolder.scan(str(Path("images/cat").mkdir(parents=True) or
                                       Path("images/cat/a.png").write_text("text") and
                                       "images"), 8)),
    Entry("data-too-few", "data", "fewer images than one batch", DataError,
          r"fewer than one batch", "Lower --batch-size or add images.",
          lambda: FolderBatches(ImageFolder.scan(images(n=1), 8), 4)),
    Entry("data-classes", "data", "more class folders than --num-classes", DataError,
          r"classes but the model has --num-classes", "Raise --num-classes.",
          lambda: run_setup(["models:unet", "--data", images(), "--image-size", "8",
                              "--num-classes", "1"])),
    Entry("data-epochs-synthetic", "data", "--epochs without --data", DataError,
          r"--epochs needs --data", "Use --steps with synthetic data.",
          lambda: run_setup(["torchvision:resnet18", "--epochs", "1"])),
    Entry("data-steps-and-epochs", "data", "both --steps and --epochs", DataError,
          r"give --steps or --epochs, not both", "Give one of them.",
          lambda: run_setup(["torchvision:resnet18", "--data", images(), "--image-size",
                              "8", "--batch-size", "2", "--steps", "2", "--epochs", "1"])),
    Entry("data-csv-header", "data", "a CSV of samples without an image column and a label "
          "or mask column", DataError, r"the header row has columns",
          "Write a header: image,label (a class per image) or image,mask (a class map per "
          "pixel), optionally level, y, x.",
          lambda: Path("s.csv").write_text("file,class\na.npy,0\n") and run_setup(
              ["torchvision:resnet18", "--data", "s.csv", "--image-size", "8"])),
    Entry("data-csv-region", "data", "a CSV row whose region (y, x and --image-size) leaves "
          "its image", DataError, r"columns .*: the region .* of size",
          "Move y / x so that the --image-size region lies inside the image at that level.",
          lambda: _csv_region()),
    Entry("data-level", "data", "a pyramid level the file does not have", DataError,
          r"no pyramid level \d+; the file has",
          "Give a level from the list in the message.",
          lambda: _one_level_tiff() and fxpar_images.open_image("one.tif", 2)),
    Entry("eval-needs-val-data", "cli", "--eval-every / --val-batches / --best-metric without "
          "--val-data", ValueError, r"need\(s\) --val-data PATH",
          "Add --val-data (a class folder or a CSV), or drop the validation flags.",
          lambda: run_setup(["torchvision:resnet18", "--eval-every", "10"])),
    Entry("eval-best-needs-checkpoint", "cli", "--best-metric without --checkpoint", ValueError,
          r"keeps the best model in DIR/best",
          "Add --checkpoint DIR: the best is kept in DIR/best.",
          lambda: run_setup(["torchvision:resnet18", "--data", images(), "--image-size", "8",
                             "--batch-size", "2", "--val-data", images(), "--best-metric",
                             "accuracy"])),
    Entry("eval-dice-of-labels", "cli", "--best-metric dice or iou for images with one label "
          "each", DataError, r"needs masks, but --val-data",
          "Use --best-metric loss or accuracy, or validate on a CSV with a mask column.",
          lambda: run_setup(["torchvision:resnet18", "--data", images(), "--image-size", "8",
                             "--batch-size", "2", "--val-data", images(), "--best-metric",
                             "dice", "--checkpoint", "ck"])),
    # region-by-region inference
    Entry("predict-norm-over-image", "predict", "a model with GroupNorm / InstanceNorm",
          ReachError, r"normalises each sample over the whole image",
          "Use BatchNorm (eval mode: running statistics), or one region as large as the image.",
          lambda: reach_model(nn.Sequential(nn.Conv2d(3, 4, 3, padding=1),
                                            nn.GroupNorm(2, 4)), 3, (64, 64))),
    Entry("predict-global-mean", "predict", "a model with a global mean inside (squeeze-"
          "excite, attention gates)", ReachError, r"reduces over the whole image",
          "Run the whole image as one region, or predict with a model without global means.",
          lambda: reach_model(_SqueezeExcite(), 3, (64, 64))),
    Entry("predict-classifier", "predict", "a classifier (no spatial output) given to "
          "fxpar-predict", ReachError, r"has no spatial dims \(a classifier\?\)",
          "Predict maps with a segmentation model, or score a classifier's patches with "
          "fxpar-run --val-data.", lambda: reach_model(nn.Sequential(
              nn.Conv2d(3, 4, 3), nn.AdaptiveAvgPool2d(1), nn.Flatten()), 3, (64, 64))),
    Entry("predict-align-corners", "predict", "bilinear interpolation with align_corners="
          "True", ReachError, r"align_corners=True.*samples at",
          "Interpolate with align_corners=False, or run one region.",
          lambda: fxpar.predict(_AlignCorners(), Plan(), torch.zeros(3, 32, 32), region=8,
                                progress=False)),
    Entry("predict-output-format", "predict", "fxpar-predict's output is neither .zarr nor "
          ".tif", DataError, r"write a \.zarr array or a \.tif",
          "Name the output OUT.zarr or OUT.tif.",
          lambda: _predict_cli(["mask.png"])),
    Entry("predict-weights", "predict", "--weights that do not fit the model", DataError,
          r"the weights do not fit",
          "Build the model with the arguments it was trained with (e.g. --num-classes).",
          lambda: _predict_cli(["mask.zarr", "--weights", _bad_weights()])),
    Entry("predict-resume-settings", "predict", "an existing output from a run with other "
          "settings", DataError, r"holds a prediction with other settings",
          "Resume with the same settings, choose another output, or pass --overwrite.",
          lambda: [_predict_cli(["mask.zarr", "--region", r]) for r in ("16", "32")]),
    # command lines
    Entry("cli-model-spec", "cli", "a model argument of no known form", ModelSpecError,
          r"model spec '[^']*': expected torchvision:NAME",
          "Name the model as torchvision:NAME, models:NAME or path/to/file.py:FACTORY.",
          lambda: zoo.build_model("resnet18")),
    Entry("cli-torchvision-name", "cli", "a torchvision model that does not exist",
          ModelSpecError, r"torchvision has no classification model",
          "Use a name from torchvision.models.list_models().",
          lambda: zoo.build_model("torchvision:resnet19")),
    Entry("cli-model-file", "cli", "path/to/file.py:FACTORY names no file", ModelSpecError,
          r"is not an existing \.py file", "Check the path (relative to where you run).",
          lambda: zoo.build_model("nets.py:build")),
    Entry("cli-model-factory", "cli", "the model file has no such factory", ModelSpecError,
          r"has no callable", "Name a function of that file that returns the model.",
          lambda: Path("nets.py").write_text("x = 1\n") and zoo.build_model(
              "nets.py:build")),
    Entry("cli-model-returns", "cli", "the factory returns something else than a module",
          ModelSpecError, r"not an nn\.Module", "Return an nn.Module from the factory.",
          lambda: Path("nets.py").write_text("def build():\n    return 1\n") and
          zoo.build_model("nets.py:build")),
    Entry("cli-model-arg", "cli", "-k / --model-arg is not key=value", ModelSpecError,
          r"is not key=value", "Write model arguments as key=value, e.g. -k num_layers=2.",
          lambda: zoo.parse_kwargs(["num_layers"])),
    Entry("cli-saved-with-plan", "cli", "plan flags next to a saved program", PlanError,
          r"is a saved program, whose plan and model are fixed",
          "Drop the plan and model flags, or compile again from the model.",
          lambda: run_setup([saved(Plan()), "--split-size", "2"])),
    Entry("cli-saved-batch", "cli", "--batch-size unlike the saved program's", PlanError,
          r"was compiled for a batch of \d+, not --batch-size", "Drop --batch-size.",
          lambda: run_setup([saved(Plan()), "--batch-size", "8"])),
    Entry("cli-balance", "cli", "--balance is not comma-separated integers", PlanError,
          r"--balance 40;29: give comma-separated node counts", "Write e.g. --balance 40,29.",
          lambda: run_setup(["torchvision:resnet18", "--stages", "2", "--balance", "40;29"])),
    Entry("cli-watchdog", "cli", "--watchdog below 0", ValueError,
          r"watchdog seconds must be >= 0", "Give the seconds a communication call may wait "
          "(e.g. --watchdog 600), or 0 for no watchdog.",
          lambda: run_setup(["torchvision:resnet18", "--watchdog", "-1"])),
    Entry("cli-log-every", "cli", "--log-every below 1", ValueError,
          r"--log-every must be >= 1", "Use --log-every 1 or more.",
          lambda: run_setup(["torchvision:resnet18", "--log-every", "0"])),
    Entry("cli-checkpoint-every", "cli", "--checkpoint-every without --checkpoint",
          ValueError, r"--checkpoint-every K needs --checkpoint DIR",
          "Add --checkpoint DIR (and K >= 1).",
          lambda: run_setup(["torchvision:resnet18", "--checkpoint-every", "2"])),
    Entry("cli-inspect-pass", "cli", "fxpar-inspect --after an unknown pass", UsageError,
          r"unknown pass .* for --after", "Use one of the pass names the message lists.",
          lambda: run_inspect(["torchvision:resnet18", "--image-size", "32", "--after", "cut"])),
    Entry("cli-inspect-code", "cli", "fxpar-inspect --code without --after", UsageError,
          r"--code prints the graph of --after PASS", "Add --after PASS.",
          lambda: run_inspect(["torchvision:resnet18", "--image-size", "32", "--code"])),
    Entry("cli-inspect-metrics", "cli", "fxpar-inspect --from-metrics without --timeline",
          UsageError, r"--from-metrics draws a timeline", "Add --timeline FILE.png.",
          lambda: run_inspect(["--from-metrics", "run.json"])),
    Entry("cli-inspect-model", "cli", "fxpar-inspect without a model or --image-size",
          UsageError, r"give a model and --image-size", "Give both.",
          lambda: run_inspect(["torchvision:resnet18"])),
    Entry("cli-inspect-rank", "cli", "fxpar-inspect --rank outside the plan", UsageError,
          r"--rank \d+ is outside", "Use a rank the message lists.",
          lambda: run_inspect(["torchvision:resnet18", "--image-size", "32", "--batch-size", "2",
                            "--rank", "3"])),
    Entry("cli-inspect-halo", "cli", "fxpar-inspect --after halo for a plan without tiles",
          UsageError, r"--after halo shows the tile-rewritten",
          "Add --spatial-parts P (P > 1).",
          lambda: run_inspect(["torchvision:resnet18", "--image-size", "32", "--batch-size", "2",
                            "--after", "halo"])),
    Entry("cli-inspect-profile-run", "cli",
          "fxpar-inspect --from-metrics --profile without the run's model", UsageError,
          r"--from-metrics with --profile draws the prediction next to the run",
          "Give the model, --image-size and plan options the run used.",
          lambda: run_inspect(["--from-metrics", "run.json", "--timeline", "t.png",
                               "--profile", "h100-nvlink-ib"])),
    Entry("cli-auto-world-size", "cli", "fxpar-inspect --auto without the number of ranks",
          UsageError, r"--auto plans for a number of ranks: add --world-size N",
          "Add --world-size N (the ranks the job will have).",
          lambda: run_inspect(["torchvision:resnet18", "--image-size", "64", "--auto"])),
    Entry("cli-auto-layout", "cli", "auto planning next to an option the planner chooses",
          AutoUsageError, r"the planner chooses --stages: drop it, or drop auto planning",
          "Drop the layout options (stages, micro-batches, tiles, GEMS, data parallelism, "
          "recompute), or drop --plan auto / --auto and give the plan yourself.",
          lambda: run_inspect(["torchvision:resnet18", "--image-size", "64", "--auto",
                               "--world-size", "4", "--stages", "2"])),
    Entry("plan-auto-no-fit", "plan", "no plan of the given ranks fits the memory per rank",
          PlanError, r"no plan of 4 rank\(s\) fits \(closest: .* needs .* per rank",
          "Give more ranks or memory per rank, or a smaller batch or image; the message "
          "names the plan that came closest and what it needs.",
          lambda: fxpar.plan_auto(zoo.build_model("torchvision:resnet18", meta=True),
                                  (8, 3, 64, 64), 4, 2**10)),
    Entry("profile-missing", "cli", "a machine profile that is neither a file nor shipped",
          ProfileError, r"no profile file .* and no shipped profile of that name",
          "Give a file fxpar-calibrate --out wrote, or a shipped name the message lists.",
          lambda: Profile.load("my-cluster")),
    Entry("profile-field", "cli", "a profile file with a missing or malformed field",
          ProfileError, r"p2p_intra must be \[alpha seconds, beta seconds per byte\]",
          "Fix the field the message names (fxpar-calibrate writes complete profiles).",
          lambda: Profile.from_json({**Profile.load("h100-nvlink-ib").to_json(),
                                     "p2p_intra": [1e-6]}, "cluster.json")),
    Entry("cli-metrics-file", "cli", "--from-metrics names a file that cannot be read",
          MetricsError, r"cannot read metrics file",
          "Point to the JSON file fxpar-run --metrics FILE wrote.",
          lambda: run_inspect(["--from-metrics", "run.json", "--timeline", "t.png"])),
    Entry("cli-metrics-format", "cli", "--from-metrics names another kind of JSON file",
          MetricsError, r"is not an fxpar metrics file",
          "Point to the JSON file fxpar-run --metrics FILE wrote.",
          lambda: Path("run.json").write_text("{}") and run_inspect(
              ["--from-metrics", "run.json", "--timeline", "t.png"])),
    # devices
    Entry("cli-svg-no-dot", "cli", "fxpar-inspect --svg where graphviz is not installed",
          DotMissing, r"the graphviz 'dot' program is not installed",
          "Install graphviz, or write the DOT text with --dot FILE and render it elsewhere.",
          no_dot),
    Entry("cli-picture-no-extra", "cli", "a picture (--dot, --svg, --timeline) asked for without "
          "the viz extra", ExtraMissing, r"needs the Python package 'graphviz'.*fxpar\[viz\]",
          "pip install 'fxpar[viz]' (graphviz and matplotlib); text output never needs them.",
          no_graphviz_package),
    Entry("device-unknown", "device", "--device / device= names no device", ValueError,
          r"unknown device", "Use auto, cpu, cuda or cuda:N.",
          lambda: fxdevice.bind(None, "tpu")),
    Entry("device-no-cuda", "device", "a GPU asked for where CUDA is not available",
          DeviceError, r"torch\.cuda\.is_available\(\) is False",
          "Use --device cpu or auto, or run where a GPU is visible (check the torch build and "
          "CUDA_VISIBLE_DEVICES, both in the message).", device_no_cuda),
    Entry("device-index", "device", "cuda:N beyond the node's GPUs", DeviceError,
          r"does not exist: this node has", "Use cuda (GPU by node-local rank) or a smaller N.",
          device_index),
    Entry("device-cuda-aware", "device", "FXPAR_CUDA_AWARE is neither 0 nor 1", ValueError,
          r"FXPAR_CUDA_AWARE=.*use 1", "Set FXPAR_CUDA_AWARE=1 or 0, or unset it.", cuda_aware),
    Entry("device-move-late", "device", "RankProgram.to(device) after training started",
          RuntimeError, r"move a rank program before its first step",
          "Call rp.to(device) (or program.local(device=...)) before the first train_step.",
          moved_after_step),
    # runtime
    Entry("runtime-action-failed", "runtime", "user code (a loss, a module) raises during a "
          "step", ActionFailed, r"rank \d+, step \d+, action \S+: ValueError",
          "Fix the error the message ends with; it names the rank, the step of the schedule "
          "and the action (stage, forward/backward, micro-batch) it happened in.",
          failing_loss),
    Entry("runtime-rank-failed", "runtime", "any rank raises an uncaught exception under "
          "mpiexec (in fxpar, a loss, a data loader) or runs out of memory", None,
          r"failed; ending the whole job \(MPI_Abort\)",
          "Read the traceback under the banner: it is the failing rank's, printed once. "
          "FXPAR_FAILFAST=0 turns this off (not recommended: the other ranks then wait "
          "forever).", text=rank_failed),
    Entry("runtime-watchdog", "runtime", "a communication call waits longer than the "
          "watchdog allows (FXPAR_WATCHDOG, fxpar-run --watchdog)", None,
          r"fxpar watchdog: rank \d+ waited",
          "Look at the rank named for the peer that is stuck or dead; if the step can really "
          "wait that long, raise the limit.", text=watchdog_fired),
    Entry("runtime-watchdog-setting", "runtime", "FXPAR_WATCHDOG is not auto or a number",
          ValueError, r"FXPAR_WATCHDOG=.*give auto",
          "Give auto, auto:FLOOR, the seconds a communication call may wait, or 0.",
          rel.bad_watchdog_setting),
    Entry("runtime-left-failed", "runtime", "a script catches a failed step and exits (or "
          "closes the program)", None, r"is leaving with a failed program",
          "Nothing to do for the hang: the job ends. Fix the error named; resume from the "
          "last checkpoint in a new job.", text=rel.left_failed),
    Entry("runtime-peer-left", "runtime", "a rank's process exits while the others train on "
          "(fewer steps on one rank)", None, r"left the job \(its process exited\)",
          "Run the same number of steps on every rank; a rank that must stop early must end "
          "the job (raise, or sys.exit after a failed step).", text=rel.peer_left),
    Entry("runtime-nonfinite", "runtime", "a NaN or inf in a step's loss, gradients or "
          "buffers on some rank", NonFiniteError, r"NaN or inf values \(rank",
          "Find the cause (learning rate, input data, a layer's numerics), or set "
          "FXPAR_NONFINITE=skip to drop such steps on every rank.", rel.nan_batch),
    Entry("runtime-nonfinite-setting", "runtime", "FXPAR_NONFINITE is not stop, skip or off",
          PlanError, r"FXPAR_NONFINITE=.*use stop", "Use stop, skip or off.",
          rel.bad_nonfinite_setting),
    Entry("runtime-program-failed", "runtime", "train_step again after a step failed",
          ProgramFailed, r"program failed earlier",
          "End the job and resume from a checkpoint: a failed step cannot be retried, its "
          "peers are still in it.", rel.train_after_failure),
    Entry("runtime-fault-spec", "runtime", "FXPAR_FAULT does not parse", FaultSpecError,
          r"FXPAR_FAULT=.*Write RANK:STEP:KIND",
          "Write RANK:STEP:KIND[:ARG] (kinds: raise, caught-raise, sigkill, stall, nan-loss, "
          "slow-rank, corrupt-checkpoint), or unset it.", rel.bad_fault_spec),
    Entry("runtime-disagree", "runtime", "the ranks compiled different programs (another "
          "plan, seed, script or version on some rank)", failfast.Disagreement,
          r"the ranks compiled different programs",
          "Run the same script, model, plan and versions on every rank, and build the initial "
          "weights identically (torch.manual_seed before building the model).",
          lambda: agree([({"plan": "5f2a", "weights": "07b1"}, None),
                          ({"plan": "5f2a", "weights": "07b1"}, None),
                          ({"plan": "5f2a", "weights": "c3d9"}, None)])),
    Entry("runtime-rank-error", "runtime", "some ranks failed to compile or load while "
          "others did not", failfast.Disagreement,
          r"nothing was communicated but this check",
          "Fix the error the message gives for the rank(s) named; usually a file or "
          "environment that differs between nodes.",
          lambda: agree([({"plan": "5f2a"}, None),
                          (None, "OSError: [Errno 28] No space left on device: 'job'")])),
]

INTERNAL = {
    "TooSmall": "raised by receptive.reach on a small image and caught by reach_model, which "
                "analyses a larger probe (a model whose margins pass 16384 cells gets it)",
    "ScheduleError": "the schedule checks (perf.simulate, core.lowering, core.wire): a bug in "
                     "fxpar",
    "Clash": "two collectives of one communicator met in fxpar.core.lowering.check: caught "
             "there and raised as a ScheduleError naming both ranks",
    "PictureError": "the base class of DotMissing and ExtraMissing (each has its entry)",
    "InjectedFault": "raised only when FXPAR_FAULT asks for it (a rehearsal); users meet it "
                     "wrapped in ActionFailed, whose entry covers it",
    "SavedOnly": "not an error: fxpar-run --save-program outside mpiexec ends after saving",
    "NoRule": "a loss op without a tile rule (fxpar.frontend.rules.dims): caught by "
              "fxpar.compiler.loss, which joins the output with a LossWarning or raises the "
              "loss-joined-strict PlanError",
    "LossCaptureError": "a loss torch.export cannot capture: caught by fxpar.compiler.loss, as "
                        "NoRule",
}
"""Error classes defined in fxpar/ or passes/ that users do not meet as such, and why."""


_SqueezeExcite, _AlignCorners = (
    load_case(f"{Path(__file__).parents[1] / 'mpi' / 'cases' / 'predict_cases.py'}::{name}")
    for name in ("SqueezeExcite", "AlignCorners"))


def _csv_region() -> None:
    import numpy as np

    np.save("a.npy", np.zeros((3, 16, 16), np.float32))
    Path("s.csv").write_text("image,label,y,x\na.npy,0,12,0\n")
    run_setup(["torchvision:resnet18", "--data", "s.csv", "--image-size", "8"])


def _one_level_tiff() -> bool:
    import numpy as np
    import tifffile

    tifffile.imwrite("one.tif", np.zeros((16, 16), np.uint8))
    return True


def _predict_cli(args: list[str]) -> None:
    """fxpar-predict on a small .npy image in the current folder, raising its error."""
    from fxpar.cli import predict as cli

    np_image = Path("image.npy")
    if not np_image.exists():
        import numpy as np

        np.save(np_image, np.zeros((3, 32, 32), np.float32))
    a = cli.parser().parse_args(["models:unet", str(np_image), *args[:1], "--num-classes",
                                 "2", "-k", "base_channels=4", "--no-progress", *args[1:]])
    model, plan, image, settings = cli.setup(a)
    fxpar.predict(model, plan, image, a.out, region=a.region, progress=False,
                  settings=settings)


def _bad_weights() -> str:
    torch.save({"conv.weight": torch.zeros(1)}, "w.pt")
    return "w.pt"


def scratch(fn: Callable[[], Any], folder: Path) -> BaseException:
    """Run ``fn`` in ``folder`` (made empty first) and return what it raised."""
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    here = os.getcwd()
    os.chdir(folder)
    try:
        with contextlib.redirect_stdout(io.StringIO()):  # fxpar-inspect prints as it goes
            fn()
    except BaseException as e:  # noqa: BLE001 - the error is the result
        return e
    finally:
        os.chdir(here)
    return AssertionError("the trigger did not raise")


def run_trigger(entry: Entry, folder: Path) -> tuple[BaseException, str]:
    """(the exception ``entry``'s trigger raised, its message as the user reads it)."""
    assert entry.trigger is not None, entry.id
    e = scratch(entry.trigger, folder)
    return e, str(e.args[0]) if isinstance(e, KeyError) and e.args else str(e)
