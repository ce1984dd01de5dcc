"""fc_gemm: fp32 fully-connected layers as register-tiled GEMMs (templates fc_fwd, fc_bwd_data,
fc_bwd_weights; planner/fc.py), on a slice of output blocks for model parallelism."""
from __future__ import annotations

from .base import BWD_DATA, BWD_WEIGHTS, FP32_CALLS, FWD, SLICE, Engine, Family

FAMILY = Family(
    "fc_gemm", Engine.FP32, ("fc",), calls=FP32_CALLS,
    signatures={"fc_fwd": FWD + SLICE, "fc_bwd_data": BWD_DATA + SLICE, "fc_bwd_weights": BWD_WEIGHTS + SLICE})
