"""conv_direct: fp32 direct convolution on register tiles (templates conv_fwd, conv_bwd_data,
conv_bwd_data_few, conv_bwd_weights; planner/conv.py), every convolution of an fp32 build and
every pass a bf16 family declines."""
from __future__ import annotations

from .base import (
    BWD_DATA,
    BWD_WEIGHTS,
    FWD,
    Calls,
    Engine,
    Family,
    fp32_backward_data,
    fp32_backward_weights,
    statistics_forward,
)

FAMILY = Family(
    "conv_direct", Engine.FP32, ("conv",), calls=Calls(statistics_forward, fp32_backward_weights, fp32_backward_data),
    fills_statistics=True,
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
