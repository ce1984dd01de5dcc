"""pcldnn_runtime: load build directories made by pcldnn-gen and run their kernels.

Needs only numpy, cffi (and mpi4py for distributed training): no compiler, no generator.
"""
from .data import ArrayDataset, digits, synthetic
from .errors import ArchError, BuildDirError, CheckpointError, PcldnnError
from .net import Net, load
from .optim import SGD
from .trainer import Trainer

__all__ = ["load", "Net", "SGD", "Trainer", "ArrayDataset", "digits", "synthetic",
           "PcldnnError", "ArchError", "BuildDirError", "CheckpointError"]
