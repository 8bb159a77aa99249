"""Build a model from a command-line spec: ``torchvision:resnet50``, ``models:amoebanet``,
or ``path/to/file.py:factory``, with keyword arguments given as ``key=value`` strings."""

from __future__ import annotations

import ast
import importlib
import importlib.util
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn


class ModelSpecError(ValueError):
    """A model spec that names nothing buildable; the message shows the accepted forms."""


FORMS = ("torchvision:NAME (e.g. torchvision:resnet50), timm:NAME (e.g. timm:efficientnet_b0), "
         "models:NAME (e.g. models:amoebanet), or path/to/file.py:FACTORY")


def parse_kwargs(items: Sequence[str]) -> dict[str, Any]:
    """``["num_layers=2", "name=x"]`` -> ``{"num_layers": 2, "name": "x"}`` (Python literals
    where they parse, else strings)."""
    out: dict[str, Any] = {}
    for item in items:
        key, eq, value = item.partition("=")
        if not eq or not key.isidentifier():
            raise ModelSpecError(f"model argument {item!r} is not key=value (e.g. num_layers=2)")
        try:
            out[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            out[key] = value
    return out


def build_model(spec: str, *, meta: bool = False, **kwargs: Any) -> nn.Module:
    """Build the model ``spec`` names, passing ``kwargs`` to its factory.

    meta: build on the ``meta`` device (no parameter memory, for analysis); a factory that
    computes with tensors while building (torchvision's RegNet does; MONAI's SwinUNETR reads
    ``.item()`` of its drop-path rates) is built on CPU instead.
    """
    if meta:
        try:
            with torch.device("meta"):
                return build_model(spec, **kwargs)
        except NotImplementedError:
            pass
        except RuntimeError as e:
            if "meta" not in str(e):
                raise
    source, sep, name = spec.rpartition(":")
    if not sep or not name:
        raise ModelSpecError(f"model spec {spec!r}: expected {FORMS}")
    if source == "torchvision":
        try:
            import torchvision.models as tvm
        except ImportError:
            raise ModelSpecError(f"model spec {spec!r} needs torchvision: pip install "
                                 f"'fxpar[vision]' (pip pairs it with the torch installed)"
                                 ) from None

        known = tvm.list_models(module=tvm)
        if name not in known:
            raise ModelSpecError(f"torchvision has no classification model {name!r}; "
                                 f"some it has: {', '.join(sorted(known)[:12])}, ...")
        return tvm.get_model(name, weights=None, **kwargs)
    if source == "timm":
        try:
            import timm
        except ImportError:
            raise ModelSpecError(f"model spec {spec!r} needs timm: pip install timm") from None
        if not timm.is_model(name):
            raise ModelSpecError(f"timm has no model {name!r}; e.g. timm:efficientnet_b0, "
                                 f"timm:convnext_atto, timm:regnety_002")
        return timm.create_model(name, pretrained=False, **kwargs)
    if source == "models":
        from fxpar import models

        return models.build(name, **kwargs)
    path = Path(source)
    if path.suffix != ".py" or not path.exists():
        raise ModelSpecError(f"model spec {spec!r}: {source!r} is not an existing .py file; "
                             f"expected {FORMS}")
    module_spec = importlib.util.spec_from_file_location(path.stem, path)
    assert module_spec is not None and module_spec.loader is not None
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    factory = getattr(module, name, None)
    if not callable(factory):
        raise ModelSpecError(f"{path} has no callable {name!r}")
    model = factory(**kwargs)
    if not isinstance(model, nn.Module):
        raise ModelSpecError(f"{spec} returned {type(model).__name__}, not an nn.Module")
    return model
