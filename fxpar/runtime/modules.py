"""Mode-dependent ATen ops as small modules that read their stage module's train/eval mode.

``torch.export`` bakes the mode into the graph as a constant; capture (fxpar.frontend.capture)
replaces those calls with these modules, so ``program.train()`` / ``program.eval()`` work as on
the model. They run in every emitted stage, hence they live with the runtime.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


class BatchNormOp(nn.Module):
    """``aten.batch_norm`` with the mode read from this module (the stage's mode): batch
    statistics in training mode or without running statistics; running statistics and
    ``num_batches_tracked`` updated in training mode, as ``nn.BatchNorm2d`` does."""

    def __init__(self, momentum: float, eps: float, owner: str = "") -> None:
        super().__init__()
        self.momentum, self.eps = momentum, eps
        self.captured_training = True
        self.owner = owner
        """The path of the module owning the running statistics (``layer1.0.bn1``); '' when
        there are none."""

    def emit_args(self) -> dict[str, Any]:
        return {"momentum": self.momentum, "eps": self.eps, "owner": self.owner}

    def forward(self, x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                running_mean: torch.Tensor | None, running_var: torch.Tensor | None,
                num_batches_tracked: torch.Tensor | None = None) -> torch.Tensor:
        batch_stats = self.training or running_mean is None
        if self.training and num_batches_tracked is not None:
            num_batches_tracked.add_(1)
        return F.batch_norm(x, running_mean, running_var, weight, bias, batch_stats,
                            self.momentum, self.eps)

    def extra_repr(self) -> str:
        return f"{self.owner or 'no running statistics'}: momentum={self.momentum}, eps={self.eps}"


class DropoutOp(nn.Module):
    """``aten.dropout`` (and its feature / alpha variants) active only in training mode."""

    def __init__(self, p: float, kind: str = "dropout") -> None:
        super().__init__()
        self.p, self.kind = p, kind
        self.captured_training = True

    def emit_args(self) -> dict[str, Any]:
        return {"p": self.p, "kind": self.kind}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fn = {"dropout": F.dropout, "feature_dropout": F.dropout2d,
              "alpha_dropout": F.alpha_dropout}[self.kind]
        return fn(x, self.p, self.training)

    def extra_repr(self) -> str:
        return f"p={self.p}, {self.kind}"
