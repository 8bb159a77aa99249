"""Training logs for plots and dashboards: one row per step and one per validation pass,
written by rank 0 to a CSV file, a JSON-lines file and / or a TensorBoard folder
(``TrainConfig.log_csv`` / ``log_jsonl`` / ``tensorboard``; ``fxpar-run --log-csv FILE
--log-jsonl FILE --tensorboard DIR``).

The values are the progress line's (fxpar.train.trainer), unrounded: the loss is the global
batch's (the same on every rank, so one rank writes it), the LR the step trained with, the
whole model's gradient norm before clipping (measured at every optimizer step while a log is
open: one scalar allreduce, fxpar.train.recipe; empty on the other batches of an accumulation
cycle), the throughput (``images_per_s`` = batch / ``step_s``) and the time spent waiting for
the batch (``data_s``). A validation row holds the step and the eval's metrics under ``val_``
names (fxpar.train.evaluate). The columns are :data:`COLUMNS` (one entry each: its CSV / JSON
name and its TensorBoard tag); a CSV row leaves a column empty and a JSON line leaves the key
out when the row has no value for it::

    step,loss,lr,grad_norm,images_per_s,step_s,data_s,val_loss,val_accuracy,val_dice,val_iou
    1,2.3514,0.01,1.842,41.3,0.0968,0.0004,,,,
    2,,,,,,,2.2907,0.125,,

Every row is flushed as it is written, so a killed job keeps its log. A run that starts at step
s (a resume) keeps the rows of steps up to s and appends after them (a header once; the rows
past s, from the steps the checkpoint did not keep, are dropped, as TensorBoard's
``purge_step`` does for its events). TensorBoard needs the ``tensorboard`` package (``pip
install 'fxpar[tensorboard]'``); the check is made when the configuration is built.
"""

from __future__ import annotations

import csv
import importlib.util
import io
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

Row = dict[str, float | int | None]


@dataclass(frozen=True)
class Column:
    """One logged value: its CSV column / JSON key and its TensorBoard scalar tag."""

    name: str
    tag: str
    doc: str


COLUMNS: tuple[Column, ...] = (
    Column("step", "", "the step (batch, 1-based) just trained, or validated after"),
    Column("loss", "train/loss", "the global batch's loss"),
    Column("lr", "train/lr", "the LR the step trained with"),
    Column("grad_norm", "train/grad_norm", "the whole model's gradient norm before clipping"),
    Column("images_per_s", "train/images_per_s", "global batch / step_s"),
    Column("step_s", "train/step_s", "seconds of the step's train_step"),
    Column("data_s", "train/data_s", "seconds waiting for the step's batch"),
    Column("val_loss", "val/loss", "the validation loss (every sample)"),
    Column("val_accuracy", "val/accuracy", "accuracy (pixel accuracy for masks)"),
    Column("val_dice", "val/dice", "mean Dice over the classes (masks)"),
    Column("val_iou", "val/iou", "mean IoU over the classes (masks)"),
)
"""The logged values (adding one is adding an entry here and filling it in a row)."""
NAMES = tuple(c.name for c in COLUMNS)


def train_row(step: int, loss: float, lr: float | None, grad_norm: float | None,
              batch: int, step_s: float, data_s: float) -> Row:
    """The row of one training step (the progress line's values)."""
    return {"step": step, "loss": loss, "lr": lr, "grad_norm": grad_norm,
            "images_per_s": batch / step_s, "step_s": step_s, "data_s": data_s}


def eval_row(m: dict[str, Any]) -> Row:
    """The row of one validation pass (``m``: fxpar.train.evaluate's dict)."""
    return {"step": m["step"], **{f"val_{k}": m[k] for k in ("loss", "accuracy", "dice", "iou")
                                  if k in m}}


class Logger(Protocol):
    """Where rows go: one writer per format."""

    def write(self, row: Row) -> None: ...

    def close(self) -> None: ...


def _kept(lines: list[str], start: int, step_of: Callable[[str], int | None]) -> list[str]:
    """The lines of steps up to ``start`` (a resume keeps them; a fresh run none)."""
    out = []
    for text in lines:
        step = step_of(text)
        if step is not None and step <= start:
            out.append(text)
    return out


def _open(path: Path, kept: list[str], header: str = "") -> io.TextIOWrapper:
    path.parent.mkdir(parents=True, exist_ok=True)
    f = open(path, "w", encoding="utf-8", newline="")  # noqa: SIM115 - closed by the Logger
    f.write(header + "".join(kept))
    f.flush()
    return f


class CsvLog:
    """A CSV file: the header of :data:`COLUMNS`, then one row per line."""

    def __init__(self, path: Path, start: int = 0) -> None:
        self.path = Path(path)
        header = ",".join(NAMES) + "\r\n"
        old = self.path.read_text(encoding="utf-8").splitlines(keepends=True) \
            if start and self.path.is_file() else []
        if old and old[0].strip() != header.strip():
            raise ValueError(f"--log-csv {self.path}: its header is {old[0].strip()!r}, not "
                             f"fxpar's {header.strip()!r}: give another file to log to")
        self._f = _open(self.path, _kept(old[1:], start, self._step), header)
        self._w = csv.writer(self._f)

    @staticmethod
    def _step(line: str) -> int | None:
        head = line.split(",", 1)[0].strip()
        return int(head) if head.isdigit() else None

    def write(self, row: Row) -> None:
        self._w.writerow(["" if row.get(n) is None else row[n] for n in NAMES])
        self._f.flush()

    def close(self) -> None:
        self._f.close()


def _finite(v: float | int | None) -> float | int | None:
    return None if isinstance(v, float) and not math.isfinite(v) else v


class JsonlLog:
    """A JSON-lines file: one object per line, only the row's keys (in :data:`COLUMNS`
    order); NaN and inf as JSON null."""

    def __init__(self, path: Path, start: int = 0) -> None:
        self.path = Path(path)
        old = self.path.read_text(encoding="utf-8").splitlines(keepends=True) \
            if start and self.path.is_file() else []
        self._f = _open(self.path, _kept(old, start, self._step))

    @staticmethod
    def _step(line: str) -> int | None:
        try:
            step = json.loads(line).get("step")
        except (ValueError, AttributeError):
            return None
        return step if isinstance(step, int) else None

    def write(self, row: Row) -> None:
        out = {n: _finite(row[n]) for n in NAMES if row.get(n) is not None}
        self._f.write(json.dumps(out) + "\n")
        self._f.flush()

    def close(self) -> None:
        self._f.close()


EXTRA = "pip install 'fxpar[tensorboard]'"


def check_tensorboard(where: str = "tensorboard") -> None:
    """Raise ValueError naming the extra when the ``tensorboard`` package is absent."""
    if importlib.util.find_spec("tensorboard") is None:
        raise ValueError(f"{where} writes TensorBoard events, which needs the tensorboard "
                         f"package: {EXTRA} (or pip install tensorboard)")


class TensorBoardLog:
    """A TensorBoard folder (``torch.utils.tensorboard.SummaryWriter``): each value a scalar
    at the row's step, under its column's tag; a resumed run purges the events past its
    start."""

    def __init__(self, folder: Path, start: int = 0) -> None:
        check_tensorboard()
        from torch.utils.tensorboard import SummaryWriter

        self._w = SummaryWriter(str(folder), purge_step=start + 1 if start else None)

    def write(self, row: Row) -> None:
        step = int(row["step"] or 0)
        for c in COLUMNS[1:]:
            v = row.get(c.name)
            if v is not None:
                self._w.add_scalar(c.tag, v, step)
        self._w.flush()

    def close(self) -> None:
        self._w.close()


@dataclass(frozen=True)
class Writer:
    """One log format: the TrainConfig field that names its file or folder, the flag, and how
    to open it at a start step."""

    field: str
    flag: str
    make: Callable[[Path, int], Logger]


WRITERS: tuple[Writer, ...] = (
    Writer("log_csv", "--log-csv", CsvLog),
    Writer("log_jsonl", "--log-jsonl", JsonlLog),
    Writer("tensorboard", "--tensorboard", TensorBoardLog),
)
"""The log formats (adding one is adding an entry, and a TrainConfig field of its name)."""


class Logs:
    """The open loggers of a run (none on ranks other than 0): a row goes to each."""

    def __init__(self, loggers: Sequence[Logger] = ()) -> None:
        self.loggers = list(loggers)

    def __bool__(self) -> bool:
        return bool(self.loggers)

    def write(self, row: Row) -> None:
        for log in self.loggers:
            log.write(row)

    def close(self) -> None:
        for log in self.loggers:
            log.close()
        self.loggers = []


def open_logs(config: Any, start: int, rank: int) -> Logs:
    """The loggers ``config`` names (its :data:`WRITERS` fields), opened at step ``start`` on
    rank 0; none elsewhere."""
    if rank != 0:
        return Logs()
    return Logs([w.make(Path(getattr(config, w.field)), start) for w in WRITERS
                 if getattr(config, w.field) is not None])


def wanted(config: Any) -> bool:
    """Whether ``config`` names any log (every rank alike: the gradient norm is measured
    then, a collective)."""
    return any(getattr(config, w.field) is not None for w in WRITERS)
