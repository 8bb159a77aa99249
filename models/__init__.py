"""fxpar's model zoo: ordinary single-device CNNs that the compiler parallelises unchanged.

``MODELS`` maps a short name (as used on command lines and in benchmark configs) to a factory;
``build(name, **kwargs)`` calls it.  Only the small model modules are imported here, so importing
the registry stays cheap (no torchvision).
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from fxpar.models.amoebanet import amoebanetd
from fxpar.models.cosmoflow import cosmoflow
from fxpar.models.resnet_v2 import resnet110_v2, resnet_v2
from fxpar.models.unet import unet
from fxpar.models.unet3d import unet3d

__all__ = [
    "MODELS",
    "amoebanetd",
    "build",
    "cosmoflow",
    "resnet110_v2",
    "resnet_v2",
    "unet",
    "unet3d",
]

MODELS: dict[str, Callable[..., nn.Module]] = {
    "amoebanet": amoebanetd,
    "cosmoflow": cosmoflow,
    "resnet_v2": resnet_v2,
    "resnet110": resnet110_v2,
    "unet": unet,
    "unet3d": unet3d,
}


def build(name: str, **kwargs: object) -> nn.Module:
    """Build the model registered as ``name`` with the factory's keyword arguments.

    Raises ``ValueError`` naming the known models, so a typo on a command line is self-explaining.
    """
    try:
        factory = MODELS[name]
    except KeyError:
        known = ", ".join(sorted(MODELS))
        raise ValueError(f"unknown model {name!r}; known models: {known}") from None
    return factory(**kwargs)
