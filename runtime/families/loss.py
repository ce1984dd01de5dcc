"""loss: softmax cross-entropy (templates loss_fwd, loss_bwd_data), run by runtime/layers.py's
LossLayer: the loss summed in double, its gradient the probabilities less the one-hot labels."""
from __future__ import annotations

from .base import Engine, Family

FAMILY = Family(
    "loss", Engine.FP32, ("softmax_cross_entropy",),
    memory_bound=True,
    signatures={
        "softmax_cross_entropy_fwd":
            "const float *logits, const int *labels, float *probs, double *loss, int batch, int nthreads",
        "softmax_cross_entropy_bwd_data": "const float *probs, const int *labels, float *dx, int batch, int nthreads",
    })
