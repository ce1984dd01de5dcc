"""pcldnn_runtime: load build directories made by pcldnn-gen and run their kernels.

Needs only numpy, cffi (and mpi4py for distributed training): no compiler, no generator.
"""
from .errors import ArchError, BuildDirError, PcldnnError
from .net import Net, load

__all__ = ["load", "Net", "PcldnnError", "ArchError", "BuildDirError"]
