"""``Plan(compile=True)`` under mpiexec (run by tests/mpi/test_programs.py): each rank's stages
go through torch.compile with Inductor, halo exchanges and collectives inside the compiled
graphs, and training equals one process in float64 (loss, every gradient, parameters after 2
steps, every buffer): the transparency check every other plan passes."""

from __future__ import annotations

import torch
from helpers.transparency import Case, check
from torch import nn

import fxpar


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
    """The compiled stages, not the modules, ran every stage of this rank."""
    if rp is None:
        return
    compiled = rp.runtime.compiled
    assert compiled is not None, "Plan(compile=True) built no compiled stages"
    assert compiled.ran == set(rp.stages), (compiled.ran, set(rp.stages))


def case_compiled_sp2_segmentation_equals_one_process():
    """SP2 (22 rows: tiles of 11, odd after the pool): halos, synchronised BatchNorm,
    GroupNorm's moments and the upsampling's halo run inside Inductor-compiled forward and
    backward graphs. (This case found an Inductor memory-planning bug: OPTIONS in
    fxpar.runtime.inductor.)"""
    rp = check(Case(_SegNet, (2, 3, 22, 18), fxpar.Plan(spatial_parts=2, slice="horizontal",
                                                        compile=True),
                    segmentation=True))
    _ran_compiled(rp)


def case_compiled_zero_bubble_pipeline_equals_one_process():
    """PP2, zero bubble with 2 micro-batches: a split backward (input gradients first, weight
    gradients later) through the compiled backward graph."""
    rp = check(Case(_Chain, (4, 3, 12, 12), fxpar.Plan(stages=2, microbatches=2,
                                                       schedule="zero_bubble", compile=True)))
    _ran_compiled(rp)

