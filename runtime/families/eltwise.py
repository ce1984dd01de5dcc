"""eltwise: ReLU and dropout (templates eltwise_fwd, eltwise_bwd_data; planner/memory.py), bound
by memory; run by runtime/layers.py's ReluLayer and DropoutLayer."""
from __future__ import annotations

from .base import Engine, Family

# Activations and gradients fp32 or bf16 as for pooling (families.bf16_outputs, bf16_gradients).
FAMILY = Family(
    "eltwise", Engine.FP32, ("relu", "relu6", "dropout"),
    signatures={
        "relu_fwd": "const void *in, void *out, int batch, int nthreads",
        "relu_bwd_data": "const void *dy, const void *out, void *dx, int batch, int nthreads",
        # min(max(x, 0), 6); its backward lets dy through where 0 < y < 6 (fp32 activations only)
        "relu6_fwd": "const void *in, void *out, int batch, int nthreads",
        "relu6_bwd_data": "const void *dy, const void *out, void *dx, int batch, int nthreads",
        # the mask is a counter hash of (seed, element): nothing stored between the passes
        "dropout_fwd": "const void *in, void *out, unsigned long long seed, int batch, int nthreads",
        "dropout_bwd_data": "const void *dy, void *dx, unsigned long long seed, int batch, int nthreads",
    })
