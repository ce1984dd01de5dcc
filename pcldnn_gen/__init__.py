"""pcldnn-gen: generates, compiles and caches specialized CPU kernels for DNN training."""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

    import numpy as np

__version__ = "0.1.0"


def from_torch(module: Any, input_shape: Sequence[int], name: str | None = None,
               loss: bool = True) -> tuple[dict, dict[str, np.ndarray]]:
    """(net dict, state) from a PyTorch module; see pcldnn_gen.torch_frontend (torch imported
    there, on call)."""
    from .torch_frontend import from_torch as convert
    return convert(module, input_shape, name, loss)


def compile(net: dict | str | Path, arch: str = "native", out: str | Path | None = None,
            weights: Mapping[str, Any] | None = None) -> Path:
    """Compile a net description (a dict like net.json's, or a path to one) for `arch` into a
    build directory (default build/<net>-<arch>: build/vgg_a-avx2 for arch "avx2",
    build/vgg_a-native-avx512 for "native" on an AVX-512 CPU); `weights` (a state dict, canonical layouts)
    become the build's initial weights. Returns the directory, for pcldnn_runtime.load."""
    from .arch import get_arch
    from .build import build
    from .netspec import load_netspec, parse_netspec
    spec = parse_netspec(net) if isinstance(net, dict) else load_netspec(net)
    return build(spec, get_arch(arch), Path(out) if out is not None else None, weights=weights).directory


def source_state(net: dict, state: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A state dict under the original framework's names (see pcldnn_gen.frontend.source_state)."""
    from .frontend import source_state as rename
    return rename(net, state)
