"""conv_packed_amx: the net's first convolution on its packed few-channel image, on AMX tiles
(templates conv_packed_amx, conv_bwd_data_packed_amx; planner/amx.py): the image's kernel rows
read in place from a padded bf16 copy, or as im2col rows."""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from ..geometry import amx_packed_data_weight_values, amx_packed_gradient_values, amx_packed_weight_values
from .base import Calls, Engine, Family, Part, gradient_window_at_least

if TYPE_CHECKING:
    from ..layers import WeightedLayer

# Backward-weights goes on tiles from windows of this many values (KH x KW x C): below it the
# pass is bound by reading dy once, which the fp32 kernel does in one pass and the tile kernel
# after copying it. Measured, mb 16-64, one thread, Xeon VM (tiles / fp32 ms): VGG-A conv1, 27
# values, 30.2 / 25.4; ResNet-style 7x7 stride 2, 147 values, 15.2 / 23.2; AlexNet-style 11x11
# stride 4, 363 values, 6.4 / 9.4.
AMX_PACKED_GRADIENT_WINDOW = 64


def forward_packed(layer: WeightedLayer, xb: np.ndarray, yb: np.ndarray, part: Part, batch: int, team: int) -> None:
    """The packed first layer's forward (AMX or vdpbf16ps): the kernel converts the image itself."""
    p = layer.ptr  # an array as a pointer to its data, None as NULL
    layer.kernels["fwd"](p(xb), p(layer.conv_weight_tiles("fwd")), layer.bias_ptr, p(yb), batch, team)


def _backward_weights(layer: WeightedLayer, xb: np.ndarray, dyb: np.ndarray, mask: np.ndarray | None,
                      dw: np.ndarray, db: np.ndarray, part: Part, batch: int, threads: int) -> bool:
    p = layer.ptr  # an array as a pointer to its data, None as NULL
    scratch = layer.scratch16(amx_packed_gradient_values(layer.in_shape, layer.out_shape, layer.kernel, batch))
    layer.kernels["bwd_weights"](p(xb), p(dyb), p(mask), p(scratch), p(dw), p(db), batch, threads)
    return False


def _backward_data(layer: WeightedLayer, dyb: np.ndarray, mask: np.ndarray | None, dxb: np.ndarray, part: Part,
                   batch: int, threads: int) -> None:
    p = layer.ptr  # an array as a pointer to its data, None as NULL
    layer.kernels["bwd_data"](p(dyb), p(mask), p(layer.conv_weight_tiles("bwd_data")), p(dxb), batch, threads)


def _weight_copy_values(layer: WeightedLayer, pass_name: str) -> int:
    if pass_name == "fwd":
        return amx_packed_weight_values(layer.in_shape, layer.out_shape[0], layer.kernel)
    return amx_packed_data_weight_values(layer.out_shape[0], layer.kernel, layer.in_shape[0])


FAMILY = Family(
    "conv_packed_amx", Engine.AMX, ("conv",), packed=True,
    policy=gradient_window_at_least(AMX_PACKED_GRADIENT_WINDOW, "backward-weights is bound by reading dy, which the "
                                    "fp32 kernel does in one pass"),
    calls=Calls(forward_packed, _backward_weights, _backward_data, _weight_copy_values),
    signatures={
        # the kernel rows read in place (its weights: B tiles made by conv_weight_tiles,
        # geometry.amx_packed_weight_values)
        "conv_fwd_packed_amx": "const float *in, const unsigned short *wt, const float *bias, void *out, "
                               "int batch, int nthreads",
        # dy masked by the ReLU's output as it converts it; its weights: B tiles made by
        # conv_weight_tiles (geometry.amx_packed_data_weight_values); dx the packed image
        "conv_bwd_data_packed_amx": "const float *dy, const void *out, const unsigned short *wt, float *dx, "
                                    "int batch, int nthreads",
        # dy masked by the ReLU's output as it is copied, dy itself left as it is; scratch:
        # geometry.amx_packed_gradient_values
        "conv_bwd_weights_packed_amx": "const float *in, const float *dy, const void *out, unsigned short *scratch, "
                                       "float *dwt, float *dbias, int batch, int nthreads",
    })
