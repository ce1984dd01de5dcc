"""conv_amx: convolutions on AMX tiles (tdpbf16ps, fp32 tiles) in bf16 builds on CPUs with AMX,
every convolution but the packed first layer: templates conv_amx (forward, backward-data) and
conv_bwd_weights_amx; planner/amx.py. Each kernel copies its source into bf16 scratch with the
padding written out (geometry.AmxConvGeometry) and reads the weights as B tiles."""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from ..geometry import AmxConvGeometry, amx_conv_geometry
from .base import Calls, Engine, Family, Part

if TYPE_CHECKING:
    from ..layers import WeightedLayer


def geometry(layer: WeightedLayer, pass_name: str) -> AmxConvGeometry:
    return amx_conv_geometry(pass_name, layer.in_shape, layer.out_shape, layer.kernel, layer.spec.pad,
                             layer.spec.stride)


def _forward(layer: WeightedLayer, xb: np.ndarray, yb: np.ndarray, part: Part, batch: int, team: int) -> None:
    p = layer.ptr  # an array as a pointer to its data, None as NULL
    scratch = layer.scratch16(geometry(layer, "fwd").scratch_values(batch))
    layer.kernels["fwd"](p(xb), p(layer.conv_weight_tiles("fwd")), layer.bias_ptr, p(yb), p(scratch), batch, team)


def _backward_weights(layer: WeightedLayer, xb: np.ndarray, dyb: np.ndarray, mask: np.ndarray | None,
                      dw: np.ndarray, db: np.ndarray, part: Part, batch: int, threads: int) -> bool:
    """x and dy (masked as it is copied) copied into scratch."""
    p = layer.ptr  # an array as a pointer to its data, None as NULL
    taps = layer.kernel[0] * layer.kernel[1]
    scratch = layer.scratch16(geometry(layer, "bwd_weights").gradient_scratch_values(batch, taps))
    layer.kernels["bwd_weights"](p(xb), p(dyb), p(mask), p(scratch), p(dw), p(db), batch, threads)
    return False


def _backward_data(layer: WeightedLayer, dyb: np.ndarray, mask: np.ndarray | None, dxb: np.ndarray, part: Part,
                   batch: int, threads: int) -> None:
    """dy's padded bf16 copy in scratch."""
    p = layer.ptr  # an array as a pointer to its data, None as NULL
    scratch = layer.scratch16(geometry(layer, "bwd_data").scratch_values(batch))
    layer.kernels["bwd_data"](p(dyb), p(mask), p(layer.conv_weight_tiles("bwd_data")), p(scratch), p(dxb), batch, threads)


FAMILY = Family(
    "conv_amx", Engine.AMX, ("conv",), packed=False,
    calls=Calls(_forward, _backward_weights, _backward_data,
                weight_copy_values=lambda layer, pass_name: geometry(layer, pass_name).weight_values),
    signatures={
        # the input converted into bf16 scratch by the kernel, the weights the layer's B tiles
        # (made by conv_weight_tiles after each change of the weights); activations (x, y: `in`,
        # `out`) fp32 or, where families.bf16_outputs says, bf16, and the gradients (dy, dx) as
        # families.bf16_gradients says (the kernel knows which)
        "conv_fwd_amx": "const void *in, const unsigned short *wt, const float *bias, void *out, "
                        "unsigned short *scratch, int batch, int nthreads",
        # dy masked by the ReLU's output as it is copied
        "conv_bwd_data_amx": "void *dy, const void *out, const unsigned short *wt, unsigned short *scratch, "
                             "void *dx, int batch, int nthreads",
        # x and dy (masked as it is copied; dy itself left as it is) copied into scratch
        "conv_bwd_weights_amx": "const void *in, void *dy, const void *out, unsigned short *scratch, float *dwt, "
                                "float *dbias, int batch, int nthreads",
    })
