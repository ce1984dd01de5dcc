"""pcldnn-gen: generates, compiles and caches specialized CPU kernels for DNN training."""
__version__ = "0.1.0"
