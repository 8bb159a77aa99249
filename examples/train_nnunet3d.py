"""An nnU-Net-style 3-D recipe on 4 tiles, against the same recipe on one process.

MONAI's ``DynUNet`` with deep supervision (two extra heads, which DynUNet interpolates to the
full size and stacks along dim 1 in training mode), MONAI's ``DiceCELoss`` on each head with
nnU-Net's halving weights (MONAI's ``DeepSupervisionLoss``), SGD Nesterov (momentum 0.99,
lr 0.01), the polynomial LR (power 0.9), clipping at a global norm of 12, flips / quarter turns /
intensity augmentation, and foreground-weighted regions from generated volumes with blob
foreground. Everything in float64: the two loss columns must agree to 1e-10.

    mpiexec -n 4 python examples/train_nnunet3d.py        # SP4, a 2x2x1 grid of tiles
    python examples/train_nnunet3d.py                      # one process (the reference only)

The compiled run trains on every rank; then rank 0 trains the same recipe on one process
(plain PyTorch: the whole batch, torch's scheduler and clipping) and prints both columns.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from monai.losses import DeepSupervisionLoss, DiceCELoss
from monai.networks.nets import DynUNet

import fxpar
from fxpar.comm.world import world
from fxpar.core.geometry import Rect
from fxpar.data.augment import parse_augment
from fxpar.data.loader import ArrayImage, AugmentedBatches, Slide
from fxpar.data.sampling import Foreground
from fxpar.train.recipe import Recipe
from fxpar.train.schedules import polynomial


@dataclass(frozen=True)
class Sizes:
    volume: int = 48
    """Side of each generated volume."""
    volumes: int = 2
    region: int = 32
    """Side of the training regions (the model input)."""
    batch: int = 2
    steps: int = 20
    filters: tuple[int, ...] = (4, 8, 16, 16)


def volumes(n: int, side: int, seed: int = 0) -> tuple[list[Slide], list[np.ndarray]]:
    """``n`` volumes of ``side``^3: a noisy background with a few spherical blobs (label 1)
    brighter than it; and their foreground masks (for the sampler)."""
    g = np.random.default_rng(seed)
    zz, yy, xx = np.mgrid[0:side, 0:side, 0:side].astype(np.float64)
    slides, masks = [], []
    for _ in range(n):
        label = np.zeros((side,) * 3, np.int64)
        for _ in range(3):
            c, r = g.uniform(side * 0.2, side * 0.8, 3), g.uniform(side / 10, side / 5)
            label[(zz - c[0]) ** 2 + (yy - c[1]) ** 2 + (xx - c[2]) ** 2 < r * r] = 1
        image = 0.2 + 0.6 * label + g.normal(0, 0.1, label.shape)
        slides.append(Slide(ArrayImage(image[None]), ArrayImage(label[None])))
        masks.append(label[::4, ::4, ::4].astype(np.float64) + 0.05)  # mostly foreground
    return slides, masks


class HeadsDynUNet(DynUNet):
    """DynUNet returning its deep-supervision heads as a tuple ``(main, head1, head2)`` (each
    interpolated to the full size, as DynUNet does) instead of ``torch.stack``-ing them along
    dim 1: fxpar has no tile rule for ``aten.stack``, so the stock model's output is joined
    there (exact, but the heads' last work and the loss then run whole on every rank). In
    eval mode both return the main head alone."""

    def forward(self, x: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
        out = self.output_block(self.skip_layers(x))
        if not (self.training and self.deep_supervision):
            return out
        return (out, *(F.interpolate(h, out.shape[2:]) for h in self.heads))


def build(s: Sizes, heads: str = "tuple") -> DynUNet:
    """The model: ``heads="stack"`` MONAI's own DynUNet, ``"tuple"`` :class:`HeadsDynUNet`."""
    torch.manual_seed(0)  # every rank builds the same initial weights
    k = len(s.filters)
    cls = {"stack": DynUNet, "tuple": HeadsDynUNet}[heads]
    return cls(3, 1, 2, kernel_size=[3] * k, strides=[1] + [2] * (k - 1),
               upsample_kernel_size=[2] * (k - 1), filters=list(s.filters),
               deep_supervision=True, deep_supr_num=2).double()


DS = DeepSupervisionLoss(DiceCELoss(to_onehot_y=True, softmax=True), weight_mode="exp")


def loss(out: torch.Tensor | tuple[torch.Tensor, ...], y: torch.Tensor) -> torch.Tensor:
    """Dice + CE on each head, weighted 1, 1/2, 1/4 (nnU-Net's halving; MONAI's
    ``DeepSupervisionLoss(weight_mode="exp")``, whose own ``forward`` casts each head to
    float32: its weights and per-head loss are used here, in the heads' float64)."""
    heads = torch.unbind(out, dim=1) if isinstance(out, torch.Tensor) else out
    weights = DS.get_weights(len(heads))
    return sum(w * DS.get_loss(h, y[:, None]) for w, h in zip(weights, heads, strict=True))


def source(s: Sizes) -> AugmentedBatches:
    slides, masks = volumes(s.volumes, s.volume)
    return AugmentedBatches(slides, Foreground(masks), parse_augment("flip,rot90,intensity"),
                            (s.region,) * 3, s.batch, seed=0, steps_per_epoch=10,
                            dtype=torch.float64)


def recipe(s: Sizes) -> fxpar.TrainConfig:
    return fxpar.TrainConfig(steps=s.steps, lr_schedule=polynomial(s.steps, power=0.9),
                             clip_grad=12.0)


def sgd(params: Iterable[torch.nn.Parameter]) -> torch.optim.SGD:
    return torch.optim.SGD(params, lr=0.01, momentum=0.99, nesterov=True)


def compiled(s: Sizes, plan: fxpar.Plan, heads: str) -> list[float]:
    """The recipe under ``plan``: every rank reads only its windows of the batch."""
    model = build(s, heads)
    data = source(s)
    shape = (s.batch, 1, *(s.region,) * 3)
    _, y0 = data.batch(0, None)
    program = fxpar.compile(model, plan, torch.zeros(shape, dtype=torch.float64),
                            loss_fn=loss, target=y0, optimizer=sgd)
    losses = []
    if world().rank == 0 and program.spatial is not None:
        tiled = ["tiled" if e else "whole" for e in program.spatial.leaf_extents]
        print(f"heads={heads}: output leaves {tiled}; loss on "
              f"{'the tiles' if program.spatial.out_tiled else 'the joined output'}")
    with program.local() as rp:
        rec = Recipe(rp, recipe(s))
        window, target = rp.input_window(), rp.target_window()
        for step in range(s.steps):
            x, y = data.batch(step, window, target)
            rec.before_batch()
            losses.append(rp.train_step(x, y))
            rec.after_batch(step + 1)
    return losses


def reference(s: Sizes) -> list[float]:
    """The same recipe on one process, in plain PyTorch."""
    model = build(s, "stack").train()
    data = source(s)
    opt = sgd(model.parameters())
    sched = recipe(s).lr_schedule(opt)
    losses = []
    for step in range(s.steps):
        x, y = data.batch(step, Rect.whole((s.region,) * 3))
        opt.zero_grad()
        value = loss(model(x), y)
        value.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 12.0)
        opt.step()
        sched.step()
        losses.append(float(value.detach()))
    return losses


def main(s: Sizes = Sizes(), plan: fxpar.Plan | None = None,
         variants: tuple[str, ...] = ("tuple", "stack")) -> dict[str, float]:
    """Train each variant compiled, then (rank 0) the one-process reference; rank 0 prints
    the columns. Returns the max difference per variant (rank 0; empty elsewhere)."""
    size = world().size
    if plan is None:
        plan = fxpar.Plan(spatial_parts=size, slice="square") if size > 1 else fxpar.Plan()
    runs, times = {}, {}
    for heads in variants:
        t0 = time.perf_counter()
        runs[heads] = compiled(s, plan, heads)
        times[heads] = time.perf_counter() - t0
    if world().rank != 0:
        return {}
    t0 = time.perf_counter()
    ref = reference(s)
    times["one process"] = time.perf_counter() - t0
    print(f"DynUNet filters {s.filters}, deep_supr_num=2, {s.batch}x1x{s.region}^3 regions of "
          f"{s.volumes} {s.volume}^3 volumes, {size} rank(s), float64")
    names = [f"compiled ({h})" for h in variants]
    print(f"{'step':>4} " + " ".join(f"{n:>20}" for n in [*names, "one process"])
          + " " + " ".join(f"{'|diff| ' + h:>12}" for h in variants))
    for i, b in enumerate(ref):
        row = [runs[h][i] for h in variants]
        print(f"{i:4d} " + " ".join(f"{v:20.16f}" for v in [*row, b]) + " "
              + " ".join(f"{abs(a - b):12.2e}" for a in row))
    diffs = {h: max(abs(a - b) for a, b in zip(runs[h], ref, strict=True)) for h in variants}
    for h in variants:
        print(f"compiled ({h}): max |diff| {diffs[h]:.3e}, {times[h]:.1f} s")
    print(f"one process: {times['one process']:.1f} s")
    assert all(d < 1e-10 for d in diffs.values()), diffs
    return diffs


if __name__ == "__main__":
    main()
