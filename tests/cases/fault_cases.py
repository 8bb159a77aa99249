"""A failure inside a pipeline step must end the whole job with the schedule grid printed."""

import torch
import torch.nn.functional as F
from torch import nn

import fxpar


def _failing_loss(out, y):
    if out.shape[0] and y[0] == -1:  # the second micro-batch carries the poisoned target
        raise ValueError("injected failure in the loss")
    return F.cross_entropy(out, y)


def case_loss_raises_on_last_stage():
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Flatten(),
                          nn.Linear(4 * 4 * 4, 3))
    program = fxpar.compile(model, fxpar.Plan(stages=2, microbatches=2), (4, 3, 4, 4),
                            loss_fn=_failing_loss)
    rp = program.local()
    y = torch.tensor([0, 1, -1, 2])
    rp.train_step(torch.randn(4, 3, 4, 4), y)  # rank 0 waits for gradients that never come
