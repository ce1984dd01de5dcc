"""join: the layers of several inputs (template join.c.j2, planned as memory-bound:
planner/memory.py), fp32 in every build, run by runtime/layers.py's AddLayer and ConcatLayer: an
add sums its inputs (and applies a fused ReLU), a concat lays their channels one after another."""
from __future__ import annotations

from .base import Engine, Family

FAMILY = Family(
    "join", Engine.FP32, ("add", "concat"),
    signatures={
        # `in`: the inputs' blocked activations, as many as the layer has (compiled in)
        "add_fwd": "float *const *in, float *out, int batch, int nthreads",
        # dy masked in place by the fused ReLU's output `out` (or NULL): then it is every input's gradient
        "add_bwd_data": "float *dy, const float *out, int batch, int nthreads",
        "concat_fwd": "float *const *in, float *out, int batch, int nthreads",
        # each input's part of dy, into `dx` (as many as the layer has inputs)
        "concat_bwd_data": "const float *dy, float *const *dx, int batch, int nthreads",
    })
