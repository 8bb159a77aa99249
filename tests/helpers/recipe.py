"""The training recipe (LR schedule, weight average, clipping, accumulation) on one process in
plain PyTorch: the reference of tests/unit/test_trainer.py and tests/mpi/cases/
schedule_ema_cases.py, written from torch's own pieces, not from fxpar.train."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn


@dataclass
class Plain:
    """One process's run of the recipe: its model, optimizer, scheduler, average, losses."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler | None
    ema: dict[str, torch.Tensor] | None
    losses: list[float] = field(default_factory=list)
    lrs: list[float] = field(default_factory=list)
    """The LR each optimizer step used."""


def train_plain(model: nn.Module, optimizer: Callable, batches: Callable, steps: int, *,
                chunks: int = 1, accumulate: int = 1, schedule: Callable | None = None,
                ema: float | None = None, clip_grad: float | None = None,
                clip_value: float | None = None, loss_fn: Callable | None = None) -> Plain:
    """``steps`` batches of ``batches(step) -> (x, y)``, each over ``chunks`` equal parts with
    gradient accumulation, ``accumulate`` batches per optimizer step; clipping before the step,
    then the average (decay min(ema, (1 + t) / (10 + t)) at update t, from the initial
    weights; other buffers copied) and the scheduler after it."""
    loss_fn = loss_fn or nn.functional.cross_entropy
    opt = optimizer(model.parameters())
    sched = schedule(opt) if schedule is not None else None
    avg = None if ema is None else {k: v.detach().clone() for k, v in model.state_dict().items()}
    run = Plain(model, opt, sched, avg)
    updates = 0
    for step in range(steps):
        x, y = batches(step)
        if step % accumulate == 0:
            opt.zero_grad(set_to_none=True)
        total = 0.0
        for xc, yc in zip(torch.tensor_split(x, chunks), torch.tensor_split(y, chunks),
                          strict=True):
            loss = loss_fn(model(xc), yc) / (chunks * accumulate)
            loss.backward()
            total += loss.item()
        run.losses.append(total * accumulate)
        if (step + 1) % accumulate:
            continue
        if clip_grad is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip_grad)
        if clip_value is not None:
            torch.nn.utils.clip_grad_value_(model.parameters(), clip_value)
        run.lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        if avg is not None:
            d = min(ema, (1 + updates) / (10 + updates))
            updates += 1
            with torch.no_grad():
                for k, v in model.state_dict().items():
                    if v.is_floating_point():
                        avg[k].lerp_(v, 1 - d)
                    else:
                        avg[k].copy_(v)
        if sched is not None:
            sched.step()
    return run
