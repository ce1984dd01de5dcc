"""batchnorm: per-channel batch normalization (template batchnorm.c.j2, planned as memory-bound:
planner/memory.py), computed in fp32, run by runtime/layers.py's NormLayer. Its activations and
gradients are fp32 or, in bf16 builds, bf16 where families.bf16_outputs / bf16_gradients say
(the `void *` arguments; a residual fusion's shortcut and output stay fp32). A channel is a
lane of the blocked layouts: the statistics are sums over (image, pixel) of whole vectors."""
from __future__ import annotations

from .base import Engine, Family

FAMILY = Family(
    "batchnorm", Engine.FP32, ("batchnorm",),
    memory_bound=True,
    signatures={
        # training (1): the batch's per-channel mean and biased variance into mean, var, then
        # out = (in - mean) / sqrt(var + eps) x gamma + beta (and the fused ReLU); 2: only the
        # statistics (one rank's shard, for sync_batchnorm); 0: mean and var are read (the
        # running statistics, or the statistics of every rank's shard: or a fused convolution's).
        # `residual` (or NULL): a residual fusion's shortcut (families.fusion), added before the
        # add's ReLU, into the add's output `out`
        "batchnorm_fwd": "const void *in, const float *gamma, const float *beta, float *mean, float *var, "
                         "void *out, const float *residual, int training, int batch, int nthreads",
        # dy masked in place by the fused ReLU's output `out` (or NULL); then dx: training, from
        # the batch statistics' gradient (the means of dy and dy x-hat over each channel: this
        # minibatch's, or batch_means, 2 x channels, when it spans ranks); else dy gamma /
        # sqrt(var + eps)
        "batchnorm_bwd_data": "void *dy, const void *out, const void *in, const float *gamma, const float *mean, "
                              "const float *var, const float *batch_means, void *dx, int training, int batch, "
                              "int nthreads",
        # dgamma = sum dy x-hat, dbeta = sum dy (dy masked in place as above); `dy2` (or NULL; an
        # fp32 dy only): a second gradient of the output added into dy first, in place (a residual
        # fusion's add output read by two layers: its gradients summed in this pass)
        "batchnorm_bwd_weights": "const void *in, void *dy, const float *dy2, const void *out, const float *mean, "
                                 "const float *var, float *dgamma, float *dbeta, int batch, int nthreads",
    })
