"""eltwise: the activation layers, dropout and drop_path (templates eltwise_fwd, eltwise_bwd_data;
planner/memory.py), bound by memory; run by runtime/layers.py's ActivationLayer and DropoutLayer."""
from __future__ import annotations

from ..activations import ACTIVATIONS
from ..layer_types import DROPS
from .base import Engine, Family

# Activations and gradients fp32 or bf16 as for pooling (families.bf16_outputs, bf16_gradients).
FAMILY = Family(
    "eltwise", Engine.FP32, (*ACTIVATIONS, *DROPS),
    memory_bound=True,
    signatures={
        # an activation's backward reads its forward output (a mask) or its input (activations.py);
        # ReLU's activations may be bf16 (families.bf16_outputs), the others' are fp32
        **{f"{a.name}_fwd": "const void *in, void *out, int batch, int nthreads" for a in ACTIVATIONS.values()},
        **{f"{a.name}_bwd_data": f"const void *dy, const void *{'in' if a.from_input else 'out'}, void *dx, int batch, "
           "int nthreads" for a in ACTIVATIONS.values()},
        # the mask is a counter hash of (seed, element): nothing stored between the passes
        "dropout_fwd": "const void *in, void *out, unsigned long long seed, int batch, int nthreads",
        "dropout_bwd_data": "const void *dy, void *dx, unsigned long long seed, int batch, int nthreads",
        # the same hash, of (seed, image): an image is kept or dropped whole (fp32 activations only)
        "drop_path_fwd": "const void *in, void *out, unsigned long long seed, int batch, int nthreads",
        "drop_path_bwd_data": "const void *dy, void *dx, unsigned long long seed, int batch, int nthreads",
    })
