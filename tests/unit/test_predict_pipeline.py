"""fxpar.predict reads, computes and writes in overlap (fxpar.compiler.predict_pipeline): the
helpers really run beside the main thread, the output equals the sequential path's bit for bit,
and a failing reader, writer or main thread gives its own error and leaves no thread behind.
(Under mpiexec, a failing helper ends the whole job: tests/mpi/test_predict.py.)"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from torch import nn

import fxpar
from fxpar.compiler.driver import predict
from fxpar.compiler.predict import ArrayImage
from fxpar.compiler.predict_pipeline import Drain, Prefetch
from fxpar.core.geometry import Rect
from fxpar.data.writers import PredictionStore
from fxpar.program.rank import RankProgram

WAIT = 10.0
"""Seconds a test waits for the other thread before calling it a failure (never, normally)."""


def _helpers() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("fxpar-predict")]


@pytest.fixture(autouse=True)
def no_threads_left():
    assert _helpers() == []
    yield
    assert _helpers() == [], "a helper thread outlived its with block"


# -- the helpers alone ---------------------------------------------------------------------------
def test_the_reader_runs_ahead_while_the_main_thread_holds_an_item():
    second = threading.Event()

    def produce(i: int) -> int:
        if i == 1:
            second.set()
        return i * 10

    with Prefetch(range(4), produce) as items:
        got = []
        for value in items:
            if value == 0:  # item 1 is produced while the main thread still holds item 0
                assert second.wait(WAIT)
            got.append(value)
    assert got == [0, 10, 20, 30]


def test_the_writer_consumes_while_the_main_thread_goes_on():
    first, seen = threading.Event(), []

    def consume(i: int) -> None:
        seen.append((i, threading.current_thread().name))
        first.set()

    with Drain(consume) as writes:
        writes.put(0)
        assert first.wait(WAIT)  # written while the main thread waits here, before put(1)
        for i in (1, 2, 3):
            writes.put(i)
        writes.finish()
    assert seen == [(i, "fxpar-predict-writer") for i in range(4)]


def test_without_threads_the_same_calls_run_in_turn_in_the_main_thread():
    names = []
    with Prefetch(range(3), lambda i: names.append(threading.current_thread().name) or i,
                  threaded=False) as items:
        assert list(items) == [0, 1, 2]
    with Drain(lambda i: names.append(threading.current_thread().name), threaded=False) as w:
        w.put(0)
        w.finish()
    assert names == ["MainThread"] * 4


def test_a_helper_error_is_raised_in_the_main_thread_with_a_note():
    def produce(i: int) -> int:
        if i == 2:
            raise OSError("tile 7 is corrupt")
        return i

    got = []
    with pytest.raises(OSError, match="tile 7 is corrupt") as e, \
            Prefetch(range(100), produce) as items:
        got.extend(items)
    assert got == [0, 1]
    assert "(raised in fxpar-predict's reader thread)" in e.value.__notes__

    def consume(i: int) -> None:
        raise ValueError(f"disk full at {i}")

    with pytest.raises(ValueError, match="disk full at 0") as e, Drain(consume) as writes:
        for i in range(100):  # raised at a later put (or at finish), never lost
            writes.put(i)
        writes.finish()
    assert "(raised in fxpar-predict's writer thread)" in e.value.__notes__


def test_leaving_early_stops_a_reader_blocked_on_a_full_queue():
    with Prefetch(range(1000), lambda i: i) as items:
        for value in items:
            if value == 1:
                break  # the reader waits to hand over item 3: close() stops it


# -- fxpar.predict -------------------------------------------------------------------------------
def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 6, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(6, 4, 3, padding=1), nn.Upsample(scale_factor=2),
                         nn.Conv2d(4, 3, 1)).double().eval()


def _x(seed: int = 0) -> torch.Tensor:
    return torch.randn((3, 48, 64), generator=torch.Generator().manual_seed(seed),
                       dtype=torch.float64)


class Reads(ArrayImage):
    """An in-memory image noting the thread of each read; read number ``fail_at`` raises."""

    def __init__(self, array: torch.Tensor, fail_at: int = 0) -> None:
        super().__init__(array)
        self.fail_at = fail_at
        self.threads: list[str] = []

    def read(self, window: Rect) -> np.ndarray:
        self.threads.append(threading.current_thread().name)
        if len(self.threads) == self.fail_at:
            raise OSError(f"cannot read {window}: the file went away")
        return super().read(window)


def _run(image, out=None, **kw):
    return predict(_model(), fxpar.Plan(), image, out, region=16, dtype=torch.float64,
                   progress=False, **kw)


@pytest.mark.parametrize("output, batch", [("logits", 1), ("argmax", 2), ("softmax", 3)])
def test_the_output_equals_the_sequential_paths_bit_for_bit(monkeypatch, tmp_path, output,
                                                            batch):
    import zarr

    got = {}
    for overlap in ("0", "1"):
        monkeypatch.setenv("FXPAR_PREDICT_OVERLAP", overlap)
        image = Reads(_x(1))
        whole = _run(image, output=output, batch=batch).output
        path = _run(Reads(_x(1)), tmp_path / f"o{overlap}.zarr", output=output,
                    batch=batch).output
        got[overlap] = (whole, np.asarray(zarr.open_array(str(path))[:]), image.reads)
        want = {"MainThread"} if overlap == "0" else {"fxpar-predict-reader"}
        assert set(image.threads) == want
    (w0, z0, r0), (w1, z1, r1) = got["0"], got["1"]
    assert w0.dtype == w1.dtype and np.array_equal(w0, w1) and np.array_equal(z0, z1)
    assert np.array_equal(w0, z0) and r0 == r1  # the same windows, in the same order


def test_a_failing_reader_stops_the_run_with_its_error(tmp_path):
    image = Reads(_x(), fail_at=3)
    with pytest.raises(OSError, match="the file went away") as e:
        _run(image, tmp_path / "o.zarr")
    assert "(raised in fxpar-predict's reader thread)" in e.value.__notes__
    assert len(image.threads) == 3  # it read no further


def test_a_failing_writer_stops_the_run_with_its_error(tmp_path, monkeypatch):
    real, written = PredictionStore.write, []

    def write(self, index, box, values):
        if len(written) == 2:
            raise OSError("no space left on device")
        written.append(index)
        real(self, index, box, values)

    monkeypatch.setattr(PredictionStore, "write", write)
    image = Reads(_x())
    with pytest.raises(OSError, match="no space left on device") as e:
        _run(image, tmp_path / "o.zarr")
    assert "(raised in fxpar-predict's writer thread)" in e.value.__notes__
    assert len(written) == 2 and len(image.threads) < 12  # it stopped before the end
    monkeypatch.setattr(PredictionStore, "write", real)
    assert _run(Reads(_x()), tmp_path / "o.zarr").skipped == 2  # and resumes from there


def test_an_interrupt_in_the_main_thread_stops_both_helpers(monkeypatch, tmp_path):
    real, calls = RankProgram.forward, []

    def forward(self, x):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(self, x)

    monkeypatch.setattr(RankProgram, "forward", forward)
    with pytest.raises(KeyboardInterrupt):
        _run(Reads(_x()), tmp_path / "o.zarr")
