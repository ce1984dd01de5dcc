"""conv_direct: fp32 direct convolution on register tiles (templates conv_fwd, conv_bwd_data,
conv_bwd_data_few, conv_bwd_weights; planner/conv.py), every convolution of an fp32 build and
every pass a bf16 family declines."""
from __future__ import annotations

from .base import BWD_DATA, BWD_WEIGHTS, FP32_CALLS, FWD, Engine, Family

FAMILY = Family(
    "conv_direct", Engine.FP32, ("conv",), calls=FP32_CALLS,
    signatures={
        # every conv kernel takes its output y (`out`: the forward's result, the backward passes'
        # ReLU mask) as fp32 or, in a bf16 build where families.bf16_outputs says, bf16 (the
        # kernel knows which); an fp32 kernel's input x is fp32
        "conv_fwd": FWD.replace("float *out", "void *out"),
        "conv_bwd_data": BWD_DATA.replace("const float *out", "const void *out"),
        "conv_bwd_weights": BWD_WEIGHTS.replace("const float *out", "const void *out"),
    })
