"""join: the layers of several inputs (template join.c.j2, planned as memory-bound:
planner/memory.py), fp32 in every build, run by runtime/layers.py's AddLayer, ConcatLayer and
MulLayer: an add sums its inputs (and applies a fused ReLU), a concat lays their channels one after
another, a mul multiplies two (a C x 1 x 1 one scaling every pixel of the other: squeeze-and-
excitation's gate)."""
from __future__ import annotations

from .base import Engine, Family

FAMILY = Family(
    "join", Engine.FP32, ("add", "concat", "mul"),
    memory_bound=True,
    signatures={
        # `in`: the inputs' blocked activations, as many as the layer has (compiled in)
        "add_fwd": "float *const *in, float *out, int batch, int nthreads",
        # dy masked in place by the fused ReLU's output `out` (or NULL): then it is every input's gradient
        "add_bwd_data": "float *dy, const float *out, int batch, int nthreads",
        "concat_fwd": "float *const *in, float *out, int batch, int nthreads",
        # each input's part of dy, into `dx` (as many as the layer has inputs)
        "concat_bwd_data": "const float *dy, float *const *dx, int batch, int nthreads",
        "mul_fwd": "float *const *in, float *out, int batch, int nthreads",
        # each input's gradient into `dx`: dy times the other input (a per-channel input's: summed over the pixels)
        "mul_bwd_data": "const float *dy, float *const *in, float *const *dx_in, int batch, int nthreads",
    })
