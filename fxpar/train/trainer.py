"""The training loop of a rank program, as a library: steps with a progress line, validation
passes, checkpoints (the latest, and the best by a validation metric), resume, NaN policy, and
the closing metrics. ``fxpar-run`` parses its flags into a :class:`TrainConfig` and runs a
:class:`Trainer`; a script does the same::

    program = fxpar.compile(model, plan, (8, 3, 512, 512), loss_fn=loss, optimizer=opt)
    with program.local() as rp:
        fxpar.Trainer(rp, fxpar.TrainConfig(steps=100, eval_every=20), batches,
                      val=val).fit()

``batches(step) -> (x, y)`` gives the global batch of a step (a rank may pass only its
``rp.input_window()`` of x). Validation (``val``, a ``fxpar.train.evaluate.Validation``, e.g.
``open_validation(folder, shape, dtype, classes)``) runs after step n when n is a multiple of
``eval_every`` and after the last step; with ``checkpoint`` set, an eval that improves
``best_metric`` saves the training state to ``checkpoint/best`` before the step's regular
checkpoint. Every method that trains is collective: call it on every rank.

The recipe around each optimizer step (fxpar.train.recipe) is configured there too: an LR
schedule (``lr_schedule=fxpar.train.schedules.warmup_cosine(total, warmup)``), a moving
average of the weights (``ema=0.999``, fxpar.train.ema; ``ema_eval`` validates with it),
clipping (``clip_grad``, ``clip_value``) and accumulation (``accumulate=k``). Checkpoints keep
the scheduler's and the average's state; a resumed run goes on exactly as an uninterrupted one.
``log_csv``, ``log_jsonl`` and ``tensorboard`` log every step's progress values and every eval
on rank 0 (fxpar.train.logs; a resumed run appends).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fxpar.core.geometry import Rect
from fxpar.data.data import Batch
from fxpar.program.checkpoint import CheckpointError, load, save
from fxpar.program.program import RankProgram
from fxpar.train.config import TrainConfig
from fxpar.train.evaluate import Validation, better, evaluate, line
from fxpar.train.logs import Logs, eval_row, open_logs, train_row
from fxpar.train.metrics import Recorder, gather, table, write_metrics
from fxpar.train.recipe import Recipe


@dataclass
class Evals:
    """The evals of one run, in order, and the best so far (``best_metric``)."""

    val: Validation
    window: Rect | None
    metric: str = "loss"
    history: list[dict[str, Any]] = field(default_factory=list)
    best: float | None = None
    recipe: Recipe | None = None
    """Where validation runs (the averaged weights with ``ema_eval``) and what ``best`` keeps
    of the schedule and average."""

    def run(self, rp: RankProgram, config: TrainConfig, n: int) -> dict[str, Any]:
        """Collective: validate after step n; rank 0 prints it; save ``best`` when better.
        Returns the eval's metrics."""
        with self.recipe.evaluating() if self.recipe is not None else nullcontext():
            m = {"step": n, **evaluate(rp, self.val, self.window)}
        self.history.append(m)
        if rp.rank == 0:
            print(line(m, n, config.steps), flush=True)
        if config.checkpoint is None or not better(self.metric, m[self.metric], self.best):
            return m
        old, self.best = self.best, m[self.metric]
        best = Path(config.checkpoint) / "best"
        save(rp, best, n, extra={"eval": m, "best_metric": self.metric}, keep=1,
             state=None if self.recipe is None else self.recipe.state())
        if rp.rank == 0:
            was = "" if old is None else f" (was {old:.6f})"
            print(f"best: step {n} {self.metric} {self.best:.6f}{was} -> {best}", flush=True)
        return m


class Trainer:
    """Trains ``rp`` on ``batches(step)`` as ``config`` says (see the module doc).

    window: the part of the input this rank reads for validation (default its
    ``rp.input_window()``)."""

    def __init__(self, rp: RankProgram, config: TrainConfig,
                 batches: Callable[[int], Batch], val: Validation | None = None,
                 window: Rect | None = None) -> None:
        self.rp, self.config, self.batches, self.val = rp, config, batches, val
        self.window = window if window is not None or val is None else \
            rp.input_window(tuple(val.shape[2:]))
        if config.nonfinite is not None:  # wins over FXPAR_NONFINITE
            rp.guard.policy = config.nonfinite
        self.recipe = Recipe(rp, config)
        """The schedule, average and clipping (fxpar.train.recipe)."""
        self.evals = None if val is None else Evals(val, self.window, config.best_metric,
                                                    recipe=self.recipe)
        self.logs = Logs()
        """The run's open logs (fxpar.train.logs; on rank 0, while :meth:`fit` runs)."""

    def fit(self, start: int | None = None) -> dict[str, Any] | None:
        """Collective: train from step ``start`` (None: :meth:`resume` first) to
        ``config.steps`` with validation and checkpoints as due (a run with no step left
        validates once), then :meth:`finish`. Returns the metrics on rank 0, None on the other
        ranks and after a resume error."""
        start = self.resume() if start is None else start
        if start is None:
            return None
        self.logs = open_logs(self.config, start, self.rp.rank)
        try:
            rec = self.train(start, self.after_step)
            if self.evals is not None and not self.evals.history:
                self.validate(max(start, self.config.steps))
            return self.finish(rec)
        finally:
            self.logs.close()

    def validate(self, n: int) -> None:
        """Collective: the validation pass after step n, logged."""
        assert self.evals is not None
        m = self.evals.run(self.rp, self.config, n)
        self.logs.write(eval_row(m))

    def after_step(self, n: int) -> None:
        """Collective, after step n (1-based): validation and checkpoint when due."""
        c = self.config
        if self.evals is not None and (n == c.steps or (c.eval_every and n % c.eval_every == 0)):
            self.validate(n)
        self.checkpoint(n)

    def train(self, start_step: int = 0,
              after_step: Callable[[int], None] | None = None) -> Recorder:
        """Steps ``start_step .. steps - 1``; rank 0 prints a progress line (step, loss, the
        LR it trained with, the gradient norm when clipping measured it, images/s) every
        ``log_every`` steps and at the first and last. after_step(n): called after step n
        (1-based) finishes."""
        rp, steps, recipe = self.rp, self.config.steps, self.recipe
        rec = Recorder(rp)
        every = self.config.log_every or max(1, steps // 50)
        for step in range(start_step, steps):
            t = time.perf_counter()
            x, y = self.batches(step)
            data_s = time.perf_counter() - t
            skipped, lr = rp.guard.skipped, recipe.before_batch()
            loss, took = rec.step(x, y, self.config.accumulate)
            n = step + 1
            dropped = rp.guard.skipped > skipped  # policy skip: every rank dropped it
            recipe.after_batch(n)  # the schedule and the average, after an optimizer step
            if self.logs:
                self.logs.write(train_row(n, loss, lr, rp.grad_norm, rp.program.batch_size,
                                          took, data_s))
            if rp.rank == 0 and (n % every == 0 or n == steps or n == start_step + 1
                                 or dropped):
                ls = rp.loss_scale
                scale = "" if ls is None else \
                    f"  loss scale {ls.scale:g} ({ls.skipped} skipped)"
                skip = "  skipped: NaN/inf, undone on every rank" if dropped else ""
                print(f"step {n:>4}/{steps}  loss {loss:.6f}{recipe.progress(lr)}  "
                      f"{rp.program.batch_size / took:8.2f} img/s  ({took:.3f} s, data "
                      f"{data_s:.3f} s){scale}{skip}", flush=True)
            if rp.rank == 0 and n == start_step + 1 and rp.runtime.compiled is not None:
                print(rp.runtime.compiled.describe(), flush=True)
            if after_step is not None:
                after_step(n)
        return rec

    def resume(self) -> int | None:
        """The step to start from (``resume``: the checkpoint's); None after a resume error,
        on every rank alike (the ranks agree first, so none goes on training alone)."""
        rp, folder = self.rp, self.config.resume
        if folder is None:
            return 0
        step, error = None, None
        try:
            step = load(rp, folder, state=self.recipe.state())
        except CheckpointError as e:
            error = str(e)
        errors = [error] if rp.comm is None else rp.comm.allgather_object(error)
        if any(errors):
            if rp.rank == 0:
                bad = next(e for e in errors if e)
                print(f"fxpar-run: error: {bad}", file=sys.stderr)
            return None
        if rp.rank == 0:
            print(f"resumed from {folder} at step {step}", flush=True)
        return step

    def checkpoint(self, n: int) -> None:
        """Collective: save ``checkpoint`` after step n when due (every ``checkpoint_every``
        steps, and the last)."""
        c = self.config
        if c.checkpoint is None:
            return
        if n == c.steps or (c.checkpoint_every and n % c.checkpoint_every == 0):
            save(self.rp, c.checkpoint, n, state=self.recipe.state())
            if self.rp.rank == 0:
                print(f"checkpoint: step {n} -> {c.checkpoint}", flush=True)

    def finish(self, rec: Recorder, evals: list[dict[str, Any]] | None = None
               ) -> dict[str, Any] | None:
        """Collective: gather the metrics; rank 0 prints the table and writes ``metrics``
        (with the validation results under "eval": ``evals``, default this run's)."""
        rp, c = self.rp, self.config
        if evals is None and self.evals is not None:
            evals = self.evals.history
        metrics = gather(rec, c.name, rp.program.batch_size, evals)
        if metrics is None:
            return None
        print(table(metrics))
        if rp.guard.skipped:
            print(f"skipped {rp.guard.skipped} step(s) with NaN/inf (--nonfinite skip): "
                  f"their batches did not train", flush=True)
        if c.metrics is not None:
            print(f"metrics: {write_metrics(c.metrics, metrics)}")
        if rec.steps:
            n = len(rec.steps)
            over = f"this run's steps 2..{n} (its first step warms up)" if n > 1 else \
                "this run's one step (including warm-up)"
            print(f"done: median {metrics['images_per_s']:.2f} img/s over {over}", flush=True)
        return metrics
