"""Sampled, augmented windows read per rank train as one process on whole augmented regions (run
by tests/mpi/test_augment.py, 2 ranks).

A small segmentation net (tests/mpi/cases/loss_cases.py's SegNet) trains 2 SGD steps under SP2
from regions drawn from two generated "slides" (2 channels, 3 classes per pixel): each rank
draws the step's regions and augmentation (flip, rot90 on a non-square region, affine, elastic,
intensity, noise) from the shared seed, reads only its input window of each augmented image
(the rest of the batch is NaN) and only its target window of each augmented label map; one
process trains on the whole augmented regions. Loss, every gradient, the parameters after each
step and the buffers must match in float64. The mutation: each rank augments its window on its
own (its own seed) -- the same comparison must fail.
"""

from __future__ import annotations

import copy

import numpy as np
import torch
import torch.nn.functional as F
from cases.loss_cases import SegNet
from helpers.equivalence import (
    RTOL64,
    assert_buffers,
    assert_same,
    atol64,
    collect_failures,
    reference_step,
)
from helpers.transparency import CAPTURES, sgd, sub_comm

import fxpar
from fxpar.core.geometry import Rect
from fxpar.data.augment import parse_augment
from fxpar.data.loader import ArrayImage, AugmentedBatches, Slide
from fxpar.data.sampling import Foreground

OUT = (11, 10)
"""The model input: odd, non-square (uneven tiles; a quarter turn transposes the region)."""
SPEC = "flip,rot90,affine,elastic:spacing=4,intensity,noise"
PLAN = fxpar.Plan(spatial_parts=2, slice="horizontal")


def _slides() -> list[Slide]:
    g = np.random.default_rng(11)
    return [Slide(ArrayImage(g.standard_normal((2, 37, 41))),
                  ArrayImage(g.integers(0, 3, (1, 37, 41)))) for _ in range(2)]


def _source(seed: int = 5) -> AugmentedBatches:
    masks = [np.ones((4, 4)), np.eye(4)]  # low-resolution tissue masks
    return AugmentedBatches(_slides(), Foreground(masks), parse_augment(SPEC), OUT, 4,
                            seed=seed, dtype=torch.float64, fill=float("nan"))


def _train(own_seed: bool) -> list[str] | None:
    """Train compiled vs one process; the comparison's failures (empty: all matched; None: this
    rank sat the case out). With ``own_seed`` every rank draws from its own seed (the
    mutation)."""
    comm = sub_comm(PLAN.world_size)
    if comm is None:
        return None
    torch.manual_seed(0)
    model = SegNet(2).double()
    ref = copy.deepcopy(model)
    shape = (4, 2, *OUT)
    rp = fxpar.compile(model, PLAN, torch.empty(shape, dtype=torch.float64, device="meta"),
                       optimizer=sgd, loss_fn=F.cross_entropy, comm=comm,
                       captures=CAPTURES).local(comm)  # the second case: the first's capture
    window, target = rp.input_window(), rp.target_window()
    assert window is not None and window != Rect.whole(OUT), "a rank reads only its window"
    mine = _source(5 + comm.rank if own_seed else 5)
    whole = _source(5)
    ref_opt = sgd(ref.parameters())
    worst = 0.0
    with collect_failures() as failures:
        for step in range(2):
            x, y = mine.batch(step, window, target, targets=rp.needs_targets)
            loss = rp.train_step(x, y)
            xs, ys = whole.batch(step, Rect.whole(OUT))
            assert torch.isfinite(xs).all()
            want = reference_step(ref, ref_opt, xs, ys, PLAN.chunks(), F.cross_entropy)
            tol = (atol64(step), RTOL64)
            assert_same(f"step {step} loss", loss, want, *tol)
            refp = dict(ref.named_parameters())
            for name, p in rp.named_parameters():
                assert_same(f"step {step} grad of {name}", p.grad, refp[name].grad, *tol)
                worst = max(worst, (p.grad - refp[name].grad).abs().max().item())
                assert_same(f"step {step} {name}", p.detach(), refp[name].detach(), *tol)
            assert_buffers(rp.state_dict(), ref, *tol)
    if not own_seed:
        reads = [r for s in mine.slides for r in s.image.reads]
        assert reads and all(r.size < 37 * 41 for r in reads)
        if comm.rank == 0:
            print(f"SP2 vs one process: largest gradient difference {worst:.3g}", flush=True)
    rp.close()
    return failures


def case_sampled_augmented_windows_train_as_one_process():
    failures = _train(own_seed=False)
    assert failures in ([], None), failures[:3]


def case_windows_augmented_on_their_own_are_caught():
    failures = _train(own_seed=True)
    if failures is not None:
        assert any("grad of" in f for f in failures), failures[:3]
        print(f"per-rank augmentation: {len(failures)} failures, first: {failures[0][:160]}")
