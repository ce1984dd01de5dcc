"""conv_depthwise: depthwise convolutions (groups = input channels = output channels: each
channel convolved with its own KH x KW window), fp32 on every ISA and in every build: template
conv_depthwise, planner/depthwise.py. A channel is a lane of the blocked layouts, so a vector
holds V channels' values and every FMA is useful; the kernels are bound by memory, not by FMAs
(2 KH KW FLOPs per 4-byte input value read once), and are planned for bandwidth."""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from ..layer_types import ConvKind
from .base import FWD, Calls, Engine, Family, Part, fp32_backward_weights, statistics_forward

if TYPE_CHECKING:
    from ..layers import WeightedLayer


def _backward_data(layer: WeightedLayer, dyb: np.ndarray, mask: np.ndarray | None, dxb: np.ndarray, part: Part,
                   batch: int, threads: int) -> None:
    p = layer.ptr  # an array as a pointer to its data, None as NULL
    layer.kernels["bwd_data"](p(dyb), p(mask), layer.weights_ptr, p(dxb), batch, threads)


FAMILY = Family(
    "conv_depthwise", Engine.FP32, ("conv",), conv_kind=ConvKind.DEPTHWISE, memory_bound=True, fills_statistics=True,
    calls=Calls(statistics_forward, fp32_backward_weights, _backward_data),
    signatures={
        # weights blocked (C/V, KH, KW, V): a window per channel lane; the output fp32; mean, var
        # (or NULL): a statistics fusion's, as conv_direct's
        "conv_fwd_depthwise": FWD.replace("float *out", "float *out, float *mean, float *var"),
        # with a fused ReLU dy is first zeroed where out <= 0, in place (as conv_direct's)
        "conv_bwd_data_depthwise": "float *dy, const float *out, const float *wt, float *dx, int batch, int nthreads",
        "conv_bwd_weights_depthwise": "const float *in, float *dy, const float *out, float *dwt, float *dbias, "
                                      "int batch, int nthreads",
    })
