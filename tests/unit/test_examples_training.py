"""Smoke tests of the two training recipes of docs/training.md (examples/train_nnunet3d.py,
examples/train_pathology.py): each example's ``main`` at tiny sizes, in one process under
``Plan()``, compiled run against plain PyTorch. The SP4 runs themselves are the
``mpiexec -n 4`` commands of docs/training.md."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

import fxpar

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _example(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_nnunet3d_recipe_matches_one_process() -> None:
    pytest.importorskip("monai")
    ex = _example("train_nnunet3d")
    diffs = ex.main(ex.Sizes(volume=24, region=16, steps=2, filters=(2, 4, 4, 4)), fxpar.Plan(),
                    variants=("tuple",))
    assert diffs["tuple"] < 1e-10


def test_pathology_recipe_matches_one_process() -> None:
    pytest.importorskip("segmentation_models_pytorch")
    ex = _example("train_pathology")
    diff, ours, ref = ex.main(ex.Sizes(slide=64, region=32, epochs=1, steps_per_epoch=2,
                                       warmup=1, val_batches=1), fxpar.Plan())
    assert diff < 1e-10
    assert ours == pytest.approx(ref, abs=1e-12)
