"""The C ABI between generated kernels and the runtime: every kernel kind's parameter list, and
the constants both sides must share. No cffi here: the generator renders prototypes from it
without loading the runtime's machinery."""
from __future__ import annotations

from .families import FAMILIES, all_kinds

# Parameter lists, by kernel kind: every family's kinds (each family module declares its own
# signatures, with what each parameter holds), and the kinds outside the families: layouts,
# weight copies, the peak and SGD kernels.
SIGNATURES: dict[str, str] = {
    **{kind: params for family in FAMILIES for kind, params in family.signatures.items()},
    "act_layout": "const float *src, float *dst, int batch, int nthreads",
    # an activation rounded to bf16 (nearest even) for a vdpbf16ps conv forward's input
    "act_to_bf16": "const float *src, unsigned short *dst, int batch, int nthreads",
    # a canonical fp32 activation (or gradient) into the blocked bf16 one the kernels read, and
    # back: layout and rounding (or widening) in one pass (the per-layer API of bf16 builds)
    "act_layout_to_bf16": "const float *src, unsigned short *dst, int batch, int nthreads",
    "act_layout_from_bf16": "const unsigned short *src, float *dst, int batch, int nthreads",
    # the fp32 blocked weights as the bf16 copy an AMX (B tiles) or vdpbf16ps conv forward or
    # backward-data kernel reads (a second function of that kernel's library: the layout is its own)
    "conv_weight_tiles": "const float *wt, unsigned short *tiles, int nthreads",
    # an fc layer's fp32 blocked weights of output blocks [ocb_lo, ocb_hi) into both tile copies
    # its fc_tiles kernels read (geometry.FcTileGeometry)
    "fc_weight_tiles": "const float *src, unsigned short *fwd_tiles, unsigned short *data_tiles, int ocb_lo, "
                       "int ocb_hi, int nthreads",
    "peak": "long long iters, int nthreads, float *sink",
    # dst = src over n floats (templates/copy.c.j2): bench's memory copy rate, the bound of the
    # memory-bound kernels
    "copy": "const float *src, float *dst, long long n, int nthreads",
    # one SGD update of n parameters (templates/sgd.c.j2); decay NULL: decay_all for every one;
    # *nonfinite: 1 where an updated weight is NaN or infinite, else 0
    "sgd": "float *p, float *v, const float *g, const float *decay, float decay_all, float lr, float momentum, "
           "long long n, int nthreads, int *nonfinite",
    "weight_layout": "const float *src, float *dst",
}

# Timing loops of `bench` (templates/repeat.c.j2): a kernel's own arguments after the kernel,
# the call count and where the seconds per call go; one for every kind of the families of conv,
# fc and batchnorm layers (families.all_kinds).
REPEATED_KINDS = tuple(k.name for k in all_kinds() if k.layer_type in ("conv", "fc", "batchnorm"))
SIGNATURES |= {f"repeat_{kind}": "void *fn, long long reps, double *seconds, " + SIGNATURES[kind]
               for kind in REPEATED_KINDS}

# G of the dropout kernels' counter hash (the golden-ratio increment of SplitMix64): the
# generator emits it into the kernels, the runtime shifts seeds by multiples of it.
DROPOUT_HASH_STEP = 0x9E3779B97F4A7C15
