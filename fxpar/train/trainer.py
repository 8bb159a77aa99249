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
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fxpar.core.geometry import Rect
from fxpar.data.data import Batch
from fxpar.program.checkpoint import CheckpointError, load, save
from fxpar.program.program import RankProgram
from fxpar.runtime.guard import nonfinite_policy
from fxpar.train.evaluate import BEST, Validation, better, evaluate, line
from fxpar.train.metrics import Recorder, gather, table, write_metrics


@dataclass(frozen=True)
class TrainConfig:
    """How to train: one field per ``fxpar-run`` training flag."""

    steps: int
    """Train until this step (a resumed run starts at its checkpoint's step)."""
    log_every: int | None = None
    """Rank 0 prints a progress line every this many steps (None: about 50 lines a run),
    and at the first and last step."""
    eval_every: int | None = None
    """Validate every this many steps (None: after the last step only); needs ``val``."""
    best_metric: str = "loss"
    """The validation metric ``checkpoint/best`` keeps the best model by (fxpar.train.evaluate)."""
    checkpoint: Path | None = None
    """Save the training state here after the last step (and every ``checkpoint_every``)."""
    checkpoint_every: int | None = None
    resume: Path | None = None
    """Start from this checkpoint folder's state and step."""
    metrics: Path | None = None
    """Rank 0 writes the run's metrics (throughput, per-rank times, evals) here as JSON."""
    nonfinite: str | None = None
    """NaN/inf policy (stop, skip, off); None: FXPAR_NONFINITE (fxpar.core.options)."""
    name: str = "model"
    """The model's name in the metrics."""

    def __post_init__(self) -> None:
        if self.steps < 0:
            raise ValueError(f"steps must be >= 0, got {self.steps}")
        for what, v in (("log_every", self.log_every), ("eval_every", self.eval_every),
                        ("checkpoint_every", self.checkpoint_every)):
            if v is not None and v < 1:
                raise ValueError(f"{what} must be >= 1, got {v}")
        if self.best_metric not in BEST:
            raise ValueError(f"best_metric {self.best_metric!r}: use one of {', '.join(BEST)}")
        if self.checkpoint_every is not None and self.checkpoint is None:
            raise ValueError("checkpoint_every needs checkpoint (a folder)")
        if self.nonfinite is not None:
            nonfinite_policy(self.nonfinite)


@dataclass
class Evals:
    """The evals of one run, in order, and the best so far (``best_metric``)."""

    val: Validation
    window: Rect | None
    metric: str = "loss"
    history: list[dict[str, Any]] = field(default_factory=list)
    best: float | None = None

    def run(self, rp: RankProgram, config: TrainConfig, n: int) -> None:
        """Collective: validate after step n; rank 0 prints it; save ``best`` when better."""
        m = {"step": n, **evaluate(rp, self.val, self.window)}
        self.history.append(m)
        if rp.rank == 0:
            print(line(m, n, config.steps), flush=True)
        if config.checkpoint is None or not better(self.metric, m[self.metric], self.best):
            return
        old, self.best = self.best, m[self.metric]
        best = Path(config.checkpoint) / "best"
        save(rp, best, n, extra={"eval": m, "best_metric": self.metric}, keep=1)
        if rp.rank == 0:
            was = "" if old is None else f" (was {old:.6f})"
            print(f"best: step {n} {self.metric} {self.best:.6f}{was} -> {best}", flush=True)


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
        self.evals = None if val is None else Evals(val, self.window, config.best_metric)

    def fit(self, start: int | None = None) -> dict[str, Any] | None:
        """Collective: train from step ``start`` (None: :meth:`resume` first) to
        ``config.steps`` with validation and checkpoints as due (a run with no step left
        validates once), then :meth:`finish`. Returns the metrics on rank 0, None on the other
        ranks and after a resume error."""
        start = self.resume() if start is None else start
        if start is None:
            return None
        rec = self.train(start, self.after_step)
        if self.evals is not None and not self.evals.history:
            self.evals.run(self.rp, self.config, max(start, self.config.steps))
        return self.finish(rec)

    def after_step(self, n: int) -> None:
        """Collective, after step n (1-based): validation and checkpoint when due."""
        c = self.config
        if self.evals is not None and (n == c.steps or (c.eval_every and n % c.eval_every == 0)):
            self.evals.run(self.rp, c, n)
        self.checkpoint(n)

    def train(self, start_step: int = 0,
              after_step: Callable[[int], None] | None = None) -> Recorder:
        """Steps ``start_step .. steps - 1``; rank 0 prints a progress line (step, loss,
        images/s) every ``log_every`` steps and at the first and last. after_step(n): called
        after step n (1-based) finishes."""
        rp, steps = self.rp, self.config.steps
        rec = Recorder(rp)
        every = self.config.log_every or max(1, steps // 50)
        for step in range(start_step, steps):
            t = time.perf_counter()
            x, y = self.batches(step)
            data_s = time.perf_counter() - t
            skipped = rp.guard.skipped
            loss, took = rec.step(x, y)
            n = step + 1
            dropped = rp.guard.skipped > skipped  # policy skip: every rank dropped it
            if rp.rank == 0 and (n % every == 0 or n == steps or n == start_step + 1
                                 or dropped):
                ls = rp.loss_scale
                scale = "" if ls is None else \
                    f"  loss scale {ls.scale:g} ({ls.skipped} skipped)"
                skip = "  skipped: NaN/inf, undone on every rank" if dropped else ""
                print(f"step {n:>4}/{steps}  loss {loss:.6f}  "
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
            step = load(rp, folder)
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
            save(self.rp, c.checkpoint, n)
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
