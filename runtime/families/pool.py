"""pool: max and average pooling (templates pool_fwd, pool_bwd_data; planner/memory.py), bound
by memory; run by runtime/layers.py's MaxPoolLayer and AvgPoolLayer."""
from __future__ import annotations

from .base import Engine, Family

# The activations (in, out) are fp32 or, where families.bf16_outputs says, bf16, and the
# gradients (dy, dx) fp32 or, where families.bf16_gradients says, bf16 (the kernel knows which).
FAMILY = Family(
    "pool", Engine.FP32, ("maxpool", "avgpool"),
    memory_bound=True,
    signatures={
        "maxpool_fwd": "const void *in, void *out, int *argmax, int batch, int nthreads",
        # its backward takes its own forward output `out` (or NULL): where given, it routes no
        # gradient to inputs that were not positive (the fused ReLU of the layer below)
        "maxpool_bwd_data": "const void *dy, const int *argmax, const void *out, void *dx, int batch, int nthreads",
        "avgpool_fwd": "const void *in, void *out, int batch, int nthreads",
        "avgpool_bwd_data": "const void *dy, void *dx, int batch, int nthreads",
    })
