"""pcldnn-gen: generates, compiles and caches specialized CPU kernels for DNN training."""
__version__ = "0.1.0"


def from_torch(module, input_shape, name=None, loss=True):
    """(net dict, state) from a PyTorch module; see pcldnn_gen.torch_frontend (torch imported
    there, on call)."""
    from .torch_frontend import from_torch as convert
    return convert(module, input_shape, name, loss)


def compile(net, arch: str = "native", out=None, weights=None):
    """Compile a net description (a dict like net.json's, or a path to one) for `arch` into a
    build directory (default build/<net>-<isa>); `weights` (a state dict, canonical layouts)
    become the build's initial weights. Returns the directory, for pcldnn_runtime.load."""
    from pathlib import Path

    from .arch import get_arch
    from .build import build
    from .netspec import load_netspec, parse_netspec
    spec = parse_netspec(net) if isinstance(net, dict) else load_netspec(net)
    return build(spec, get_arch(arch), Path(out) if out is not None else None, weights=weights).directory


def source_state(net, state):
    """A state dict under the original framework's names (see pcldnn_gen.frontend.source_state)."""
    from .frontend import source_state as rename
    return rename(net, state)
