"""``Plan(compile=True)`` under mpiexec (run by tests/mpi/test_programs.py): each rank's
non-spatial stages go through torch.compile with Inductor (tiles stay eager for now:
fxpar.runtime.inductor), and training equals one process in float64 (loss, every gradient,
parameters after 2 steps, every buffer): the transparency check every other plan passes.
(With tiles compiled, the SP2 version of the first case found an Inductor memory-planning bug:
OPTIONS in fxpar.runtime.inductor.)"""

from __future__ import annotations

import torch
from helpers.transparency import Case, check
from torch import nn

import fxpar
from fxpar.runtime.inductor import edges_of_compiled


class _SegNet(nn.Module):
    """Conv + BatchNorm + ReLU, a max pool, conv + GroupNorm, bilinear x2 upsampling with an
    additive skip and a 1x1 head: every tile op of a segmentation net, output tiled."""

    def __init__(self, classes: int = 5) -> None:
        super().__init__()
        self.c1, self.bn = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.pool = nn.MaxPool2d(2)
        self.c2, self.gn = nn.Conv2d(8, 8, 3, padding=1), nn.GroupNorm(2, 8)
        self.up = nn.Upsample(scale_factor=2, mode="bilinear")
        self.head = nn.Conv2d(8, classes, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = torch.relu(self.bn(self.c1(x)))
        b = torch.relu(self.gn(self.c2(self.pool(a))))
        return self.head(self.up(b) + a)


class _Chain(nn.Module):
    """A small classifier for pipelines: two conv blocks with BatchNorm, a pool and a head."""

    def __init__(self, classes: int = 5) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
            nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
            nn.Conv2d(8, 8, 3, stride=2, padding=1), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def _ran_compiled(rp: fxpar.RankProgram | None) -> None:
    """The compiled callables, not the modules, ran this rank's non-spatial stages; its tiles
    ran eagerly (fxpar.runtime.inductor)."""
    if rp is None:
        return
    compiled = rp.runtime.compiled
    assert compiled is not None, "Plan(compile=True) built no compiled stages"
    plan = rp.plan
    eager = {k for k in rp.stages if plan.spatial and k[1] < plan.spatial_stages}
    if not edges_of_compiled():  # this torch cannot split a compiled backward: W stays eager
        eager |= {k[:2] for k in rp.runtime._split}
    assert compiled.ran == set(rp.stages) - eager, (compiled.ran, set(rp.stages), eager)


def case_compiled_sp2_pp2_segmentation_equals_one_process():
    """SP2 + PP2 on 11-row tiles: the spatial stage (halos, synchronised BatchNorm, a max
    pool) runs eagerly, the second stage (GroupNorm, bilinear upsampling, the skip, the head)
    through Inductor; training equals one process."""
    rp = check(Case(_SegNet, (2, 3, 22, 18), fxpar.Plan(stages=2, spatial_parts=2,
                                                        slice="horizontal", compile=True),
                    segmentation=True))
    _ran_compiled(rp)


def case_compiled_zero_bubble_pipeline_equals_one_process():
    """PP2, zero bubble with 2 micro-batches: a split backward (input gradients first, weight
    gradients later) through the compiled backward graph (on torch >= 2.14; before, those
    stages stay eager: fxpar.runtime.inductor.SPLIT_BACKWARD_TORCH)."""
    rp = check(Case(_Chain, (4, 3, 12, 12), fxpar.Plan(stages=2, microbatches=2,
                                                       schedule="zero_bubble", compile=True)))
    _ran_compiled(rp)
