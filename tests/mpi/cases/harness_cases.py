"""The transparency harness catches small errors (run by tests/mpi/test_harness_catches.py,
2 ranks).

Each case takes a compiled-vs-one-process check that passes (tests/helpers/transparency.py,
float64, element-wise tolerances of tests/helpers/equivalence.py) and breaks the compiled run in
one small place:

- one element of one gradient scaled by 1 + 1e-6, just before the optimizer step;
- one row of one halo exchange zeroed on the way (the first halo piece tile 0 sends in a
  forward pass);
- micro-batches 0 and 1 swapped on the input side (micro-batch 0 computes on micro-batch 1's
  images, and the other way round), the targets left in place;
- under the zero-bubble schedule, one weight-gradient pass (W) left out.

The mutated checks run with :func:`equivalence.collect_failures`, so every rank reaches the end
of the check (a rank that raised would leave its peer in a collective) and every launch runs all
cases; each case then asserts on every rank what was reported: the tensor's name, the worst
element's index, got and want. The last case lets the harness raise as it does in the real
suites, and the pytest side checks that the failure reaches the launch's report.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from helpers.equivalence import ATOL64, RTOL64, collect_failures
from helpers.transparency import Case, check
from torch import nn

import fxpar
from fxpar.comm.world import world
from fxpar.runtime import loop
from fxpar.runtime.spatial import exchange

PERTURBED = "3.weight"
"""The parameter whose gradient gets one wrong element: the second convolution's weight."""
PERTURBED_SHAPE = (8, 8, 3, 3)
"""Its shape, unique in the model: how the runtime's optimizer finds it."""


def _net() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 5))


SHAPE = (4, 3, 12, 12)
PIPELINE = Case(_net, SHAPE, fxpar.Plan(stages=2, microbatches=2, schedule="1f1b"))
SPATIAL = Case(_net, SHAPE, fxpar.Plan(spatial_parts=2, slice="horizontal"))
ZERO_BUBBLE = Case(_net, SHAPE, fxpar.Plan(stages=2, microbatches=2, schedule="zero_bubble"))


# -- mutations ----------------------------------------------------------------------------------
@contextmanager
def _patched(owner: Any, name: str, value: Any) -> Iterator[None]:
    assert hasattr(owner, name), f"injection point {owner.__name__}.{name} is gone: update " \
                                 f"tests/mpi/cases/harness_cases.py"
    old = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, old)


@contextmanager
def perturbed_gradient(record: dict[str, Any]) -> Iterator[None]:
    """Before the first optimizer step, scale one element of ``PERTURBED``'s gradient by
    1 + 1e-6: the element whose size is nearest 1/20 of the tensor's largest, where a
    tolerance relative to the tensor's largest entry would not see it."""
    original = loop.Runtime._step

    def step(self: loop.Runtime, a: Any, st: Any) -> None:
        if "index" not in record and self.optimizer is not None:
            params = [p for group in self.optimizer.param_groups for p in group["params"]
                      if tuple(p.shape) == PERTURBED_SHAPE and p.grad is not None]
            if params:
                g = params[0].grad
                flat = int((g.abs() - g.abs().max() / 20).abs().flatten().argmin())
                index = [int(i) for i in torch.unravel_index(torch.tensor(flat), g.shape)]
                record.update(index=index, value=g.flatten()[flat].item(),
                              largest=g.abs().max().item())
                g.view(-1)[flat] *= 1 + 1e-6
        original(self, a, st)

    with _patched(loop.Runtime, "_step", step):
        yield


@contextmanager
def dropped_halo_row(record: dict[str, Any], active: bool) -> Iterator[None]:
    """On the rank where ``active``, zero the first row of the first halo piece sent in a
    forward exchange (once in the whole run): the neighbour tile computes on a window with one
    wrong row. Backward exchanges (gradients going back to their owners) are left alone."""
    original = exchange.swap
    record["fired"] = 0

    def swap(like: torch.Tensor, comm: Any, tag: int, recvs: Any, sends: Any) -> Any:
        caller = sys._getframe(1).f_code.co_name
        if active and not record["fired"] and caller == "send_halo" and sends:
            dst, piece = sends[0]
            piece = piece.clone()
            piece[:, :, 0, :] = 0
            sends = [(dst, piece), *sends[1:]]
            record["fired"] = 1
            record["rows"] = int(piece.shape[2])
        return original(like, comm, tag, recvs, sends)

    with _patched(exchange, "swap", swap):
        yield


@contextmanager
def swapped_microbatches(record: dict[str, Any]) -> Iterator[None]:
    """In training forwards of the stage that reads the batch, feed micro-batch 1's input as
    micro-batch 0's and micro-batch 0's as micro-batch 1's; the targets stay where they are."""
    original = loop.Runtime._forward
    record["fired"] = 0

    def forward(self: loop.Runtime, a: Any, st: Any) -> None:
        reads_batch = any(src.source == "batch" for src in self.graph.inputs[a.stage])
        if not (st.train and reads_batch and a.mb in (0, 1) and len(st.x_chunks) > 1):
            original(self, a, st)
            return
        xs = st.x_chunks
        i, j = self.chunk(a.copy, 0), self.chunk(a.copy, 1)
        xs[i], xs[j] = xs[j], xs[i]
        record["fired"] += 1
        try:
            original(self, a, st)
        finally:
            xs[i], xs[j] = xs[j], xs[i]

    with _patched(loop.Runtime, "_forward", forward):
        yield


# -- what the harness must say -------------------------------------------------------------------
def _everyone(failures: list[str], record: dict[str, Any]) -> list[tuple[list[str], dict]]:
    """Every rank's (failures, record); rank 0 prints the first failures of each rank."""
    everyone = world().allgather_object((failures, record))
    if world().rank == 0:
        case = sys._getframe(1).f_code.co_name
        for rank, (got, _) in enumerate(everyone):
            for message in got[:3]:
                print(f"harness: {case}: rank {rank}, 1st-3rd of {len(got)}: {message}",
                      flush=True)
    return everyone


def _names(failures: list[str]) -> list[str]:
    return [f.split(": ", 1)[0] for f in failures]


def _well_formed(message: str) -> None:
    """A failure names the tensor, the number of elements out, the worst one's index, got and
    want."""
    assert " elements differ; worst at index [" in message and "got " in message \
        and ", want " in message, message


def case_unmutated_checks_pass() -> None:
    for case in (PIPELINE, SPATIAL):
        check(case)  # raising, as the suites run it


def case_gradient_element_off_by_1e6_relative() -> None:
    record: dict[str, Any] = {}
    with collect_failures() as failures, perturbed_gradient(record):
        check(PIPELINE)
    everyone = _everyone(failures, record)
    fired = [(f, r) for f, r in everyone if "index" in r]
    assert len(fired) == 1, f"the perturbation ran on {len(fired)} ranks, not 1"
    got, rec = fired[0]
    # the harness before element-wise tolerances (|diff| <= 1e-9 + 1e-7 x the tensor's largest
    # entry) would have passed it
    assert 1e-6 * abs(rec["value"]) <= 1e-9 + 1e-7 * rec["largest"], rec
    assert 1e-6 * abs(rec["value"]) > 2 * (ATOL64 + RTOL64 * abs(rec["value"])), rec
    assert got, f"the harness did not notice a gradient element off by 1e-6 relative: {rec}"
    _well_formed(got[0])
    assert got[0].startswith(f"step 0 grad of {PERTURBED}: 1 of {math.prod(PERTURBED_SHAPE)} "
                             f"elements differ; worst at index {rec['index']}: got "), got[0]
    assert f"want {rec['value']!r}" in got[0], (got[0], rec)


def case_dropped_halo_row() -> None:
    record: dict[str, Any] = {}
    with collect_failures() as failures, dropped_halo_row(record, world().rank == 0):
        check(SPATIAL)
    everyone = _everyone(failures, record)
    assert [r["fired"] for _, r in everyone] == [1, 0], everyone
    assert everyone[0][1]["rows"] >= 1
    for rank, (got, _) in enumerate(everyone):  # both tiles hold and compare every parameter
        assert got, f"rank {rank}: the harness did not notice a dropped halo row"
        for message in got:
            _well_formed(message)
        names = _names(got)
        assert names[0] == "step 0 loss", names
        assert "step 0 grad of 3.weight" in names, names  # the convolution that read the row


def case_swapped_microbatches() -> None:
    record: dict[str, Any] = {}
    with collect_failures() as failures, swapped_microbatches(record):
        check(PIPELINE)
    everyone = _everyone(failures, record)
    fired = [r["fired"] for _, r in everyone]
    assert fired == [4, 0], fired  # stage 0 (rank 0): micro-batches 0 and 1 in each of 2 steps
    loss_rank = everyone[1][0]  # the last stage computes the loss
    assert loss_rank and _names(loss_rank)[0] == "step 0 loss", loss_rank
    for got, _ in everyone:
        assert got
        for message in got:
            _well_formed(message)
    first_stage = _names(everyone[0][0])
    assert "step 0 grad of 0.weight" in first_stage, first_stage
    assert "buffer 1.running_mean" in first_stage, first_stage  # updated in the other order


def case_dropped_weight_pass() -> None:
    """Zero bubble: the last stage skips its weight-gradient pass (W) of micro-batch 1 in the
    first step. The loss and the input gradients are untouched; the weights of that stage
    miss half their gradient."""
    record: dict[str, Any] = {"fired": 0}
    original = loop.Runtime._weights

    def weights(self: loop.Runtime, a: Any, st: Any) -> None:
        if not record["fired"] and a.stage == 1 and a.mb == 1:
            record["fired"] = 1
            st.weights.pop((a.copy, a.stage, a.mb))
            return
        original(self, a, st)

    with collect_failures() as failures, _patched(loop.Runtime, "_weights", weights):
        check(ZERO_BUBBLE)
    everyone = _everyone(failures, record)
    assert [r["fired"] for _, r in everyone] == [0, 1], everyone
    first = [n for n in _names(everyone[0][0]) if n.startswith("step 0 ")]
    assert not first, first  # stage 0's gradients came whole (its weights differ from step 1)
    got = everyone[1][0]
    assert got, "the harness did not notice a weight-gradient pass left out"
    for message in got:
        _well_formed(message)
    names = _names(got)
    assert "step 0 loss" not in names and names[0].startswith("step 0 grad of "), names


def case_gradient_error_fails_the_case() -> None:
    """The same gradient perturbation, the harness raising as in the real suites: the launch
    must report this case failed, with the tensor named (tests/mpi/test_harness_catches.py)."""
    record: dict[str, Any] = {}
    with perturbed_gradient(record):
        check(PIPELINE)
