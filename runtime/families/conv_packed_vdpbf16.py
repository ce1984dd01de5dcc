"""conv_packed_vdpbf16: the net's first convolution on its packed few-channel image, on
vdpbf16ps (templates conv_fwd_packed_bf16, conv_bwd_weights_packed_bf16): a kernel row's window
values in pairs, read in place from a padded bf16 copy the kernel makes. Its backward-data is
not part of training: that pass stays fp32."""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from ..geometry import packed_bf16_weight_values
from .base import Calls, Engine, Family, Part, gradient_window_at_least
from .conv_packed_amx import forward_packed

if TYPE_CHECKING:
    from ..layers import WeightedLayer

# Backward-weights goes on vdpbf16ps from windows of this many values, where it gains less than
# the tiles over the fp32 kernel. At Zen's dot rate emulated (Ice Lake VM, mb 16, speed over the
# fp32 kernel): 27 values 0.75-0.99 (MobileNet's 3x3 stride 2: 4.01 -> 5.22 ms), 75 and 81 values
# 1.11-1.19 on one thread but 0.84-1.06 on two, 147 values 1.32-1.33 and 363 values 1.47-1.51 on
# both; between 81 and 147 not measured.
BF16_PACKED_GRADIENT_WINDOW = 100


def _backward_weights(layer: WeightedLayer, xb: np.ndarray, dyb: np.ndarray, mask: np.ndarray | None,
                      dw: np.ndarray, db: np.ndarray, part: Part, batch: int, threads: int) -> bool:
    """The fp32 kernel's arguments: it pairs its own copies, without scratch, and leaves dy as it is."""
    p = layer.ptr  # an array as a pointer to its data, None as NULL
    layer.kernels["bwd_weights"](p(xb), p(dyb), p(mask), p(dw), p(db), batch, threads)
    return False


def _no_backward_data(layer: WeightedLayer, dyb: np.ndarray, mask: np.ndarray | None, dxb: np.ndarray, part: Part,
                      batch: int, threads: int) -> None:
    raise AssertionError("conv_packed_vdpbf16 has no backward-data kernel")  # the family declines that pass


FAMILY = Family(
    "conv_packed_vdpbf16", Engine.VDPBF16, ("conv",), packed=True, passes=("fwd", "bwd_weights"),
    policy=gradient_window_at_least(BF16_PACKED_GRADIENT_WINDOW, "pixel pairs gain less than the fp32 kernel's "
                                    "single pass"),
    calls=Calls(forward_packed, _backward_weights, _no_backward_data,
                weight_copy_values=lambda layer, pass_name: packed_bf16_weight_values(
                    layer.in_shape[0], layer.out_shape[0], layer.kernel, layer.vector_floats)),
    signatures={
        # its weights made by conv_weight_tiles (geometry.packed_bf16_weight_values)
        "conv_fwd_packed_bf16": "const float *in, const unsigned short *wt, const float *bias, void *out, "
                                "int batch, int nthreads",
        # dy masked by the ReLU's output as it is paired (dy itself left as it is)
        "conv_bwd_weights_packed_bf16": "const float *in, const float *dy, const void *out, float *dwt, "
                                        "float *dbias, int batch, int nthreads",
    })
