"""conv_vdpbf16: convolutions on vdpbf16ps (bf16 pairs of input channels, fp32 accumulators) in
bf16 builds on CPUs without AMX: the fp32 register-tile templates with 2-byte operands
(conv_fwd, conv_bwd_data) and conv_bwd_weights_bf16 (neighbouring output pixels paired)."""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from ..geometry import bf16_weight_scratch
from .base import Calls, Engine, Family, LayerShape, Part, Target

if TYPE_CHECKING:
    from ..layers import WeightedLayer


def _policy(layer: LayerShape, pass_name: str, target: Target) -> str | None:
    if pass_name == "bwd_data" and layer.in_shape[0] < target.vector_floats:
        return (f"{layer.in_shape[0]} input channels, fewer than a vector: the few-channel backward-data kernel "
                "has no channel pairs to take")
    return None


def _forward(layer: WeightedLayer, xb: np.ndarray, yb: np.ndarray, part: Part, batch: int, team: int) -> None:
    """The input's bf16 copy (unless it is stored as bf16: families.bf16_outputs) and the weights'."""
    p = layer.ptr  # an array as a pointer to its data, None as NULL
    xb16 = xb
    if not layer.in_bf16:
        xb16 = layer.buffer("bf16.x", xb.shape, np.uint16)
        layer.kernels["in_to_bf16"](p(xb), p(xb16), batch, team)
    layer.kernels["fwd"](p(xb16), p(layer.conv_weight_tiles("fwd")), layer.bias_ptr, p(yb), batch, team)


def _backward_weights(layer: WeightedLayer, xb: np.ndarray, dyb: np.ndarray, mask: np.ndarray | None,
                      dw: np.ndarray, db: np.ndarray, part: Part, batch: int, threads: int) -> bool:
    """Pair copies of x and of dy (masked as it is copied) in scratch."""
    p = layer.ptr  # an array as a pointer to its data, None as NULL
    scratch = layer.scratch16(bf16_weight_scratch(layer.in_shape, layer.out_shape, layer.kernel, layer.spec.stride,
                                                  layer.vector_floats, batch))
    layer.kernels["bwd_weights"](p(xb), p(dyb), p(mask), p(scratch), p(dw), p(db), batch, threads)
    return False


def _backward_data(layer: WeightedLayer, dyb: np.ndarray, mask: np.ndarray | None, dxb: np.ndarray, part: Part,
                   batch: int, threads: int) -> None:
    """dy as bf16 in scratch (masked as it is copied)."""
    p = layer.ptr  # an array as a pointer to its data, None as NULL
    scratch = layer.scratch16(dyb.size)
    layer.kernels["bwd_data"](p(dyb), p(mask), p(layer.conv_weight_tiles("bwd_data")), p(scratch), p(dxb), batch, threads)


FAMILY = Family(
    "conv_vdpbf16", Engine.VDPBF16, ("conv",), packed=False, policy=_policy,
    calls=Calls(_forward, _backward_weights, _backward_data,
                weight_copy_values=lambda layer, pass_name: layer.weights_size),  # the weights re-laid in pairs
    signatures={
        # bf16 input (the input stored as bf16, or a round-to-nearest-even copy by act_to_bf16)
        # and a bf16 copy of the weights (made by conv_weight_tiles after each change of the
        # weights), fp32 bias; the output y (`out`: the forward's result, the backward passes'
        # ReLU mask) fp32 or, where families.bf16_outputs says, bf16, and backward-weights'
        # input x so too; the gradients (dy, dx) fp32 or bf16 as families.bf16_gradients says
        "conv_fwd_bf16": "const unsigned short *in, const unsigned short *wt, const float *bias, void *out, "
                         "int batch, int nthreads",
        # a bf16 copy of the transposed weights; dy, masked by the ReLU as it is copied (dy itself
        # left as it is), into bf16 scratch; a bf16 dy with no mask to apply it reads in place
        "conv_bwd_data_bf16": "void *dy, const void *out, const unsigned short *wt, unsigned short *scratch, "
                              "void *dx, int batch, int nthreads",
        # neighbouring output pixels paired: bf16 pair copies of x and of dy in scratch
        # (geometry.bf16_weight_scratch), the bias gradient from the masked dy, in fp32
        "conv_bwd_weights_bf16": "const void *in, void *dy, const void *out, unsigned short *scratch, float *dwt, "
                                 "float *dbias, int batch, int nthreads",
    })
