"""conv_direct: fp32 direct convolution on register tiles (templates conv_fwd, conv_bwd_data,
conv_bwd_data_few, conv_bwd_weights; planner/conv.py), every convolution of an fp32 build and
every pass a bf16 family declines."""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from .base import BWD_DATA, BWD_WEIGHTS, FWD, Calls, Engine, Family, Part, fp32_backward_data, fp32_backward_weights

if TYPE_CHECKING:
    from ..layers import WeightedLayer


def _forward(layer: WeightedLayer, xb: np.ndarray, yb: np.ndarray, part: Part, batch: int, team: int) -> None:
    """`layer.statistics`: (mean, var) rows a statistics fusion fills, or None."""
    p = layer.ptr  # an array as a pointer to its data, None as NULL
    mean, var = layer.statistics or (None, None)
    layer.kernels["fwd"](p(xb), layer.weights_ptr, layer.bias_ptr, p(yb), p(mean), p(var), batch, team)


FAMILY = Family(
    "conv_direct", Engine.FP32, ("conv",), calls=Calls(_forward, fp32_backward_weights, fp32_backward_data),
    signatures={
        # every conv kernel takes its output y (`out`: the forward's result, the backward passes'
        # ReLU mask) as fp32 or, in a bf16 build where families.bf16_outputs says, bf16 (the
        # kernel knows which); an fp32 kernel's input x is fp32
        # mean, var (or NULL): a statistics fusion's (families.fusion) per-channel batch mean and
        # biased variance of the output, for the batchnorm that reads it
        "conv_fwd": FWD.replace("float *out", "void *out, float *mean, float *var"),
        "conv_bwd_data": BWD_DATA.replace("const float *out", "const void *out"),
        "conv_bwd_weights": BWD_WEIGHTS.replace("const float *out", "const void *out"),
    })
