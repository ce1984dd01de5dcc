"""pcldnn_runtime: load build directories made by pcldnn-gen and run their kernels.

Needs only numpy, cffi (and mpi4py for distributed training): no compiler, no generator. The
public names load lazily, so the generator can import the light modules (abi, manifest,
limits, validate) without loading cffi.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .errors import ArchError, BuildDirError, CheckpointError, NonFiniteError, PcldnnError

_LAZY = {"load": "net", "Net": "net", "SGD": "optim", "Trainer": "trainer",
         "ArrayDataset": "data", "MemmapDataset": "data", "ImageFolder": "data", "Augment": "data",
         "Dataset": "data", "digits": "data", "synthetic": "data"}

__all__ = [
    "SGD",
    "ArchError",
    "ArrayDataset",
    "Augment",
    "BuildDirError",
    "CheckpointError",
    "Dataset",
    "ImageFolder",
    "MemmapDataset",
    "Net",
    "NonFiniteError",
    "PcldnnError",
    "Trainer",
    "digits",
    "load",
    "synthetic",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


if TYPE_CHECKING:
    from .data import ArrayDataset, Augment, Dataset, ImageFolder, MemmapDataset, digits, synthetic
    from .net import Net, load
    from .optim import SGD
    from .trainer import Trainer
