"""``fxpar-run --loss``: the losses segmentation users train with, by name (one entry each).

Each entry builds ``loss_fn(output, labels)`` for labels of one class index per pixel (or per
image), as fxpar-run's data gives them: ``(N, H, W)`` / ``(N, D, H, W)`` masks, ``(N,)``
classes. MONAI's losses take the labels with a channel dim (``(N, 1, H, W)``), so their entries
add it. ``--ignore-index`` and ``--class-weights`` go to the losses that have them; an entry
that has not says so. On a tiled output every one runs its sums over the tiles
(fxpar.compiler.loss): the loss is exactly the loss of the whole output.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


class LossArgError(ValueError):
    """A --loss that cannot take the given options (or whose library is missing)."""


@dataclass(frozen=True)
class LossSpec:
    """How to build one --loss: from the ignored label (or None) and the class weights (or
    None) to ``loss_fn(output, labels)``."""

    build: Callable[[int | None, torch.Tensor | None], Callable[..., torch.Tensor]]
    help: str
    ignore_index: bool = True
    class_weights: bool = True
    segmentation: bool = True
    """Needs one label per pixel (Dice, Tversky: ratios of per-class sums over the image)."""


class WithChannel(nn.Module):
    """A MONAI loss given labels with a channel dim: ``loss(output, labels[:, None])``."""

    def __init__(self, loss: nn.Module) -> None:
        super().__init__()
        self.loss = loss

    def forward(self, output: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.loss(output, labels.unsqueeze(1))


class CrossEntropy(nn.Module):
    """``F.cross_entropy`` with fixed ``weight`` / ``ignore_index`` (a module: its weights move
    with it)."""

    def __init__(self, ignore_index: int | None, weight: torch.Tensor | None) -> None:
        super().__init__()
        self.ignore_index = -100 if ignore_index is None else ignore_index
        self.register_buffer("weight", weight)

    def forward(self, output: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        w = None if self.weight is None else self.weight.to(output.dtype)
        return F.cross_entropy(output, labels, weight=w, ignore_index=self.ignore_index)


def _monai(name: str, **kw: object) -> nn.Module:
    try:
        import monai.losses as ml
    except ImportError:
        raise LossArgError(f"--loss needs MONAI for {name}: pip install monai "
                           f"(or fxpar[test])") from None
    return WithChannel(getattr(ml, name)(**{k: v for k, v in kw.items() if v is not None}))


LOSSES: dict[str, LossSpec] = {
    "ce": LossSpec(lambda ignore, w: CrossEntropy(ignore, w),
                   "cross-entropy (per pixel for masks), with --ignore-index and "
                   "--class-weights", segmentation=False),
    "dice": LossSpec(lambda ignore, w: _monai("DiceLoss", softmax=True, to_onehot_y=True,
                                              ignore_index=ignore, weight=w),
                     "MONAI DiceLoss (softmax, one-hot labels)"),
    "dicece": LossSpec(lambda ignore, w: _monai("DiceCELoss", softmax=True, to_onehot_y=True,
                                                weight=w),
                       "MONAI DiceCELoss: Dice + cross-entropy", ignore_index=False),
    "focal": LossSpec(lambda ignore, w: _monai("FocalLoss", to_onehot_y=True, weight=w),
                      "MONAI FocalLoss (computes in float32)", ignore_index=False,
                      segmentation=False),
    "tversky": LossSpec(lambda ignore, w: _monai("TverskyLoss", softmax=True,
                                                 to_onehot_y=True),
                        "MONAI TverskyLoss (alpha = beta = 0.5)", ignore_index=False,
                        class_weights=False),
}
"""One entry per ``--loss`` name."""


def make_loss(name: str, ignore_index: int | None = None,
              class_weights: str | None = None, classes: int | None = None,
              dtype: torch.dtype = torch.float32) -> Callable[..., torch.Tensor]:
    """The ``--loss`` ``name`` with its options (checked: a clear error says what to
    change). dtype: the model's, which the class weights take (MONAI's losses keep them as
    they are given, and cross-entropy refuses float32 weights for float64 logits)."""
    if name not in LOSSES:
        raise LossArgError(f"--loss {name}: one of {', '.join(LOSSES)}")
    spec = LOSSES[name]
    if ignore_index is not None and not spec.ignore_index:
        raise LossArgError(f"--loss {name} has no --ignore-index (ce and dice have)")
    weights = None
    if class_weights is not None:
        if not spec.class_weights:
            raise LossArgError(f"--loss {name} has no --class-weights")
        try:
            weights = torch.tensor([float(v) for v in class_weights.split(",")], dtype=dtype)
        except ValueError:
            raise LossArgError(f"--class-weights {class_weights}: give one number per class, "
                               f"comma-separated (e.g. 0.2,1,2.5)") from None
        if classes is not None and len(weights) != classes:
            raise LossArgError(f"--class-weights has {len(weights)} values for {classes} "
                               f"classes: give one per class")
        if (weights < 0).any():
            raise LossArgError("--class-weights must be >= 0")
    if name == "ce" and ignore_index is None and weights is None:
        return F.cross_entropy  # importable by name: a saved program keeps it
    return spec.build(ignore_index, weights)
