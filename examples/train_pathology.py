"""A 2-D pathology recipe on 4 tiles, against the same recipe on one process.

segmentation-models-pytorch's U-Net (resnet18 encoder, depth 3) with an auxiliary class head
(``aux_params={"classes": 2}``: does the region hold tumour?), the loss Dice + CE on the mask
plus 0.4 CE on the region's label, AdamW with a linear warm-up and a cosine decay, an EMA of
the weights, HED stain jitter and flips, regions drawn where there is tissue on a generated
slide (pink tissue blobs holding darker tumour blobs, as tools/make_slide.py draws them, in
memory). After training, the validation Dice of the tumour class with the EMA weights, compiled
and on one process. Everything in float64.

    mpiexec -n 4 python examples/train_pathology.py       # SP4, a 2x2 grid of tiles
    python examples/train_pathology.py                     # one process (the reference only)

The compiled run trains on every rank; then rank 0 trains the same recipe on one process
(plain PyTorch: torch's schedulers, the same EMA update) and prints both.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import segmentation_models_pytorch as smp
import torch
import torch.nn.functional as F
from torch.optim.swa_utils import get_ema_multi_avg_fn

import fxpar
from fxpar.comm.world import world
from fxpar.core.geometry import Rect
from fxpar.data.augment import parse_augment
from fxpar.data.loader import ArrayImage, AugmentedBatches, Slide
from fxpar.data.sampling import Foreground, Uniform
from fxpar.train.ema import decay_at
from fxpar.train.recipe import Recipe
from fxpar.train.schedules import warmup_cosine


@dataclass(frozen=True)
class Sizes:
    slide: int = 768
    region: int = 256
    batch: int = 2
    epochs: int = 3
    steps_per_epoch: int = 8
    warmup: int = 4
    ema: float = 0.9
    val_batches: int = 2

    @property
    def steps(self) -> int:
        return self.epochs * self.steps_per_epoch


def slide(side: int, seed: int) -> tuple[Slide, np.ndarray]:
    """A generated slide: RGB in [0, 1], labels 1 where tumour; and its tissue mask (1/8
    resolution) for the sampler."""
    g = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:side, 0:side].astype(np.float64)
    tissue = np.zeros((side, side), bool)
    tumour = np.zeros((side, side), bool)
    for _ in range(4):
        cy, cx, r = g.uniform(0, side), g.uniform(0, side), g.uniform(side / 8, side / 4)
        wobble = 1 + 0.15 * np.sin(xx / 37.0 + cy) * np.cos(yy / 53.0 + cx)
        tissue |= (yy - cy) ** 2 + (xx - cx) ** 2 < (r * wobble) ** 2
        if g.random() < 0.7:  # a tumour inside some of the blobs
            ty, tx = cy + g.uniform(-r, r) / 3, cx + g.uniform(-r, r) / 3
            tumour |= (yy - ty) ** 2 + (xx - tx) ** 2 < (r / 3) ** 2
    tumour &= tissue
    noise = g.normal(0, 0.05, (side, side, 1))
    rgb = np.where(tissue[..., None], [0.78, 0.47, 0.67], [0.93, 0.92, 0.94]) + noise
    rgb = np.where(tumour[..., None], [0.45, 0.2, 0.5] + noise, rgb)
    image = np.clip(rgb, 0, 1).transpose(2, 0, 1).copy()
    labels = tumour.astype(np.int64)[None]
    return Slide(ArrayImage(image), ArrayImage(labels)), tissue[::8, ::8].astype(np.float64)


def build() -> smp.Unet:
    torch.manual_seed(0)  # every rank builds the same initial weights
    return smp.Unet("resnet18", encoder_weights=None, encoder_depth=3,
                    decoder_channels=(16, 8, 8), classes=2,
                    aux_params={"classes": 2}).double()  # returns (mask logits, label logits)


dice = smp.losses.DiceLoss("multiclass")


def loss(out: tuple[torch.Tensor, torch.Tensor], mask: torch.Tensor,
         label: torch.Tensor) -> torch.Tensor:
    """Dice + CE on the mask, 0.4 CE on the region's label (the loss over the structure)."""
    seg, cls = out
    return dice(seg, mask) + F.cross_entropy(seg, mask) + 0.4 * F.cross_entropy(cls, label)


def sources(s: Sizes) -> tuple[AugmentedBatches, AugmentedBatches]:
    """Training regions (tissue-weighted, flips + HED jitter), validation regions (another
    slide, uniform, no augmentation)."""
    train, mask = slide(s.slide, seed=0)
    val, _ = slide(s.slide, seed=1)
    out = (s.region, s.region)
    return (AugmentedBatches([train], Foreground([mask]), parse_augment("flip,hed"), out,
                             s.batch, seed=0, steps_per_epoch=s.steps_per_epoch,
                             dtype=torch.float64),
            AugmentedBatches([val], Uniform(), parse_augment("none"), out, s.batch, seed=1,
                             steps_per_epoch=1, dtype=torch.float64))


def batch(data: AugmentedBatches, step: int, window: Rect | None
          ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """x (``window`` of it filled), the whole mask and each region's label: 1 when it holds
    tumour (from the whole mask, so every rank agrees)."""
    x, mask = data.batch(step, window)
    assert x is not None and mask is not None
    return x, (mask, (mask.flatten(1).amax(1) > 0).long())


def optimizer(params: Iterable[torch.nn.Parameter]) -> torch.optim.AdamW:
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=1e-4)


def recipe(s: Sizes) -> fxpar.TrainConfig:
    return fxpar.TrainConfig(steps=s.steps, lr_schedule=warmup_cosine(s.steps, s.warmup),
                             ema=s.ema)


def scores(pred: list[torch.Tensor], truth: list[torch.Tensor]) -> float:
    """Dice of the tumour class over every validation pixel."""
    p, t = torch.cat(pred).flatten() == 1, torch.cat(truth).flatten() == 1
    return float(2 * (p & t).sum() / (p.sum() + t.sum()).clamp(min=1))


def compiled(s: Sizes, plan: fxpar.Plan) -> tuple[list[float], float]:
    data, val = sources(s)
    _, y0 = batch(data, 0, Rect.whole((s.region,) * 2))
    program = fxpar.compile(build(), plan, torch.zeros(s.batch, 3, s.region, s.region,
                                                       dtype=torch.float64),
                            loss_fn=loss, target=y0, optimizer=optimizer)
    losses, pred, truth = [], [], []
    with program.local() as rp:
        rec = Recipe(rp, recipe(s))
        window = rp.input_window()
        for step in range(s.steps):
            x, y = batch(data, step, window)
            rec.before_batch()
            losses.append(rp.train_step(x, y))
            rec.after_batch(step + 1)
        rp.eval()
        assert rec.ema is not None
        with rec.ema.applied():
            for step in range(s.val_batches):
                x, (mask, _) = batch(val, step, window)
                seg, _ = rp.forward(x)  # whole, on every rank of the last stage
                pred.append(seg.argmax(1))
                truth.append(mask)
    return losses, scores(pred, truth)


def reference(s: Sizes) -> tuple[list[float], float]:
    """The same recipe on one process, in plain PyTorch."""
    data, val = sources(s)
    model = build().train()
    opt = optimizer(model.parameters())
    sched = recipe(s).lr_schedule(opt)
    state = model.state_dict()
    avg = {k: v.detach().clone() for k, v in state.items()}
    whole = Rect.whole((s.region,) * 2)
    losses = []
    for step in range(s.steps):
        x, y = batch(data, step, whole)
        opt.zero_grad()
        value = loss(model(x), *y)
        value.backward()
        opt.step()
        sched.step()
        floats = [k for k, v in state.items() if v.is_floating_point()]
        get_ema_multi_avg_fn(decay_at(s.ema, step))([avg[k] for k in floats],
                                                    [state[k].detach() for k in floats], None)
        for k, v in state.items():
            if not v.is_floating_point():
                avg[k].copy_(v)
        losses.append(float(value.detach()))
    model.load_state_dict(avg)
    model.eval()
    pred, truth = [], []
    with torch.no_grad():
        for step in range(s.val_batches):
            x, (mask, _) = batch(val, step, whole)
            pred.append(model(x)[0].argmax(1))
            truth.append(mask)
    return losses, scores(pred, truth)


def main(s: Sizes = Sizes(), plan: fxpar.Plan | None = None) -> tuple[float, float, float]:
    """Train both; rank 0 prints them. Returns (max loss difference, compiled Dice,
    one-process Dice) on rank 0; zeros elsewhere."""
    size = world().size
    if plan is None:
        plan = fxpar.Plan(spatial_parts=size, slice="square") if size > 1 else fxpar.Plan()
    t0 = time.perf_counter()
    ours, ours_dice = compiled(s, plan)
    t1 = time.perf_counter()
    if world().rank != 0:
        return 0.0, 0.0, 0.0
    ref, ref_dice = reference(s)
    t2 = time.perf_counter()
    print(f"smp U-Net resnet18 depth 3 + aux head, {s.batch}x3x{s.region}^2 regions of a "
          f"{s.slide}^2 slide, {s.epochs} epochs x {s.steps_per_epoch} steps, {size} rank(s), "
          f"float64")
    print(f"{'step':>4} {'compiled':>20} {'one process':>20} {'|diff|':>9}")
    for i, (a, b) in enumerate(zip(ours, ref, strict=True)):
        print(f"{i:4d} {a:20.16f} {b:20.16f} {abs(a - b):9.2e}")
    diff = max(abs(a - b) for a, b in zip(ours, ref, strict=True))
    print(f"max |diff| {diff:.3e}")
    print(f"validation Dice (tumour, EMA weights): compiled {ours_dice:.12f}, one process "
          f"{ref_dice:.12f}, |diff| {abs(ours_dice - ref_dice):.2e}")
    print(f"compiled {t1 - t0:.1f} s, one process {t2 - t1:.1f} s")
    assert diff < 1e-10 and abs(ours_dice - ref_dice) < 1e-12, (diff, ours_dice, ref_dice)
    return diff, ours_dice, ref_dice


if __name__ == "__main__":
    main()
