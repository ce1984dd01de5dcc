"""pcldnn_runtime: load build directories made by pcldnn-gen and run their kernels.

Needs only numpy, cffi (and mpi4py for distributed training): no compiler, no generator. The
public names load lazily, so the generator can import the light modules (abi, manifest,
limits, validate) without loading cffi. Layers: the core (net, layers, kernels, optim, data,
observe) imports no MPI; the cluster layer (mpi_safety, distributed, model_parallel,
layer_modes, scaling) builds on it, and `load` here joins the two.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .errors import ArchError, BuildDirError, CheckpointError, NonFiniteError, PcldnnError

_LAZY = {"Net": "net", "SGD": "optim", "Trainer": "trainer",
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


def load(build_dir: str | Path, threads: int | None = None, seed: int = 0) -> Net:
    """Load a build directory made by `pcldnn-gen compile` (`pcldnn_runtime.net.load`, the
    core, with the MPI job's part from the cluster layer).

    threads: OpenMP threads per kernel call. None: OMP_NUM_THREADS if set, else the cores this
    process may use divided among the MPI ranks on this node (so ranks do not oversubscribe).
    seed: seeds the He-normal weight initialisation (biases start at zero) and dropout.

    Under mpiexec with more than one rank, an uncaught exception on any rank from here on
    aborts the whole job (a rank whose load fails must not leave the others waiting).
    """
    from . import mpi_safety, net
    mpi_safety.guard_world()
    if threads is None:
        threads = net.default_threads(mpi_safety.ranks_on_this_node())
    return net.load(build_dir, threads, seed)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


if TYPE_CHECKING:
    from pathlib import Path

    from .data import ArrayDataset, Augment, Dataset, ImageFolder, MemmapDataset, digits, synthetic
    from .net import Net
    from .optim import SGD
    from .trainer import Trainer
