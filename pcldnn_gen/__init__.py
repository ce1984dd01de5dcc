"""pcldnn-gen: generates, compiles and caches specialized CPU kernels for DNN training."""
__version__ = "0.1.0"


def from_torch(module, input_shape, name=None, loss=True):
    """(net dict, state) from a PyTorch module; see pcldnn_gen.torch_frontend (torch imported
    there, on call)."""
    from .torch_frontend import from_torch as convert
    return convert(module, input_shape, name, loss)
