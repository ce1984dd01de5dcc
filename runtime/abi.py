"""The C ABI between generated kernels and the runtime: every kernel kind's parameter list, and
the constants both sides must share. No cffi here: the generator renders prototypes from it
without loading the runtime's machinery."""
from __future__ import annotations

from .families import all_kinds

# Parameter lists, by kernel kind. Activations are blocked (N, C/V, H, W, V); weights are
# blocked (OC/V, IC/V, KH, KW, V_ic, V_oc); `batch` is the minibatch, `nthreads` the
# OpenMP thread count of this call.
_FWD = "const float *in, const float *wt, const float *bias, float *out, int batch, int nthreads"
# Backward kernels take the forward output `out` (or NULL): with a fused ReLU they first zero dy
# where out <= 0, in place. bwd_data gets scratch for the transposed weights (conv only).
_BWD_DATA = "float *dy, const float *out, const float *wt, float *scratch, float *dx, int batch, int nthreads"
_BWD_WEIGHTS = "const float *in, float *dy, const float *out, float *dwt, float *dbias, int batch, int nthreads"
# fc kernels compute only the output-feature blocks [ocb_lo, ocb_hi): a model-parallel rank's
# slice of the layer (0, OC/V: the whole layer).
_SLICE = ", int ocb_lo, int ocb_hi"
SIGNATURES: dict[str, str] = {
    # every conv kernel takes its output y (`out`: the forward's result, the backward passes'
    # ReLU mask) as fp32 or, in a bf16 build where families.bf16_outputs says, bf16 (the kernel
    # knows which); an fp32 kernel's input x is fp32
    "conv_fwd": _FWD.replace("float *out", "void *out"), "fc_fwd": _FWD + _SLICE,
    "conv_bwd_data": _BWD_DATA.replace("const float *out", "const void *out"), "fc_bwd_data": _BWD_DATA + _SLICE,
    "conv_bwd_weights": _BWD_WEIGHTS.replace("const float *out", "const void *out"),
    "fc_bwd_weights": _BWD_WEIGHTS + _SLICE,
    # pooling, ReLU and dropout take their activations (in, out) as fp32 or, where
    # families.bf16_outputs says, bf16, and the gradients (dy, dx) as fp32 or, where
    # families.bf16_gradients says, bf16 (the kernel knows which)
    "maxpool_fwd": "const void *in, void *out, int *argmax, int batch, int nthreads",
    # max pooling's backward takes its own forward output `out` (or NULL): where given, it
    # routes no gradient to inputs that were not positive (the fused ReLU of the layer below)
    "maxpool_bwd_data": "const void *dy, const int *argmax, const void *out, void *dx, int batch, int nthreads",
    "avgpool_fwd": "const void *in, void *out, int batch, int nthreads",
    "avgpool_bwd_data": "const void *dy, void *dx, int batch, int nthreads",
    "relu_fwd": "const void *in, void *out, int batch, int nthreads",
    "relu_bwd_data": "const void *dy, const void *out, void *dx, int batch, int nthreads",
    "dropout_fwd": "const void *in, void *out, unsigned long long seed, int batch, int nthreads",
    "dropout_bwd_data": "const void *dy, void *dx, unsigned long long seed, int batch, int nthreads",
    "softmax_cross_entropy_fwd":
        "const float *logits, const int *labels, float *probs, double *loss, int batch, int nthreads",
    "softmax_cross_entropy_bwd_data":
        "const float *probs, const int *labels, float *dx, int batch, int nthreads",
    "act_layout": "const float *src, float *dst, int batch, int nthreads",
    # bf16 builds: a conv forward kernel on bf16 input (the input stored as bf16, or a
    # round-to-nearest-even copy by act_to_bf16) and a bf16 copy of the weights (made by
    # conv_weight_tiles after each change of the weights), fp32 bias. The three vdpbf16ps conv
    # kinds take the output y (`out`: the forward's result, the backward passes' ReLU mask) as
    # fp32 or, where families.bf16_outputs says, bf16 (the kernel knows which), and
    # backward-weights its input x so too.
    "conv_fwd_bf16": "const unsigned short *in, const unsigned short *wt, const float *bias, void *out, "
                     "int batch, int nthreads",
    # bwd_data reads a bf16 copy of the transposed weights (conv_weight_tiles) and converts dy,
    # masked by the ReLU as it is copied (dy itself left as it is), into bf16 scratch; a bf16 dy
    # with no mask to apply it reads in place.
    # The backward kinds of bf16 and AMX convolutions take the gradients (dy, dx) as fp32 or,
    # where families.bf16_gradients says, bf16 (the kernel knows which).
    "conv_bwd_data_bf16": "void *dy, const void *out, const unsigned short *wt, unsigned short *scratch, void *dx, "
                          "int batch, int nthreads",
    # bwd_weights pairs neighbouring output pixels: bf16 pair copies of x and of dy (masked by
    # the ReLU as it is copied; dy itself left as it is) in scratch (geometry.bf16_weight_scratch),
    # the bias gradient from the masked dy, in fp32.
    "conv_bwd_weights_bf16": "const void *in, void *dy, const void *out, unsigned short *scratch, float *dwt, "
                             "float *dbias, int batch, int nthreads",
    # AMX builds: a conv forward on tiles, converting its input into its bf16 scratch itself
    # (geometry.AmxConvGeometry), its weights the layer's B tiles (made by conv_weight_tiles after
    # each change of the weights). The three AMX conv kinds take their activations (x, y: `in`,
    # `out`) as fp32 or, where families.bf16_outputs says, bf16, and the backward ones the
    # gradients (dy, dx) as families.bf16_gradients says (the kernel knows which).
    "conv_fwd_amx": "const void *in, const unsigned short *wt, const float *bias, void *out, unsigned short *scratch, "
                    "int batch, int nthreads",
    # the fp32 blocked weights as the bf16 copy an AMX (B tiles) or vdpbf16ps conv forward or
    # backward-data kernel reads (a second function of that kernel's library: the layout is its own)
    "conv_weight_tiles": "const float *wt, unsigned short *tiles, int nthreads",
    # and the packed few-channel first layer's forward pass, its kernel rows read in place (its
    # weights: B tiles made by conv_weight_tiles, geometry.amx_packed_weight_values)
    "conv_fwd_packed_amx": "const float *in, const unsigned short *wt, const float *bias, void *out, "
                           "int batch, int nthreads",
    # and its backward-weights pass (dy masked by the ReLU's output as it is copied, dy itself left
    # as it is; scratch: geometry.amx_packed_gradient_values)
    "conv_bwd_weights_packed_amx": "const float *in, const float *dy, const void *out, unsigned short *scratch, "
                                   "float *dwt, float *dbias, int batch, int nthreads",
    # and its backward-data pass (dy masked by the ReLU's output as it converts it; its weights: B
    # tiles made by conv_weight_tiles, geometry.amx_packed_data_weight_values; dx the packed image)
    "conv_bwd_data_packed_amx": "const float *dy, const void *out, const unsigned short *wt, float *dx, int batch, "
                                "int nthreads",
    # and backward-data: dy masked by the ReLU's output as it is copied
    "conv_bwd_data_amx": "void *dy, const void *out, const unsigned short *wt, unsigned short *scratch, void *dx, "
                         "int batch, int nthreads",
    # and backward-weights: x and dy (masked as it is copied; dy itself left as it is) copied into scratch
    "conv_bwd_weights_amx": "const void *in, void *dy, const void *out, unsigned short *scratch, float *dwt, "
                            "float *dbias, int batch, int nthreads",
    # and an fc layer's passes on tiles; bf16 builds without AMX have vdpbf16ps kernels of the
    # same signatures (*_bf16). The weights are the layer's bf16 tile copies
    # (geometry.FcTileGeometry, made by fc_weight_tiles), the activations copied into scratch.
    **{f"fc_{p}_{impl}": sig for impl in ("amx", "bf16") for p, sig in (
        ("fwd", "const float *in, const unsigned short *wt, const float *bias, float *out, unsigned short *scratch, "
                "int batch, int nthreads, int ocb_lo, int ocb_hi"),
        ("bwd_data", "float *dy, const float *out, const unsigned short *wt, unsigned short *scratch, float *dx, "
                     "int batch, int nthreads, int ocb_lo, int ocb_hi"),
        ("bwd_weights", "const float *in, float *dy, const float *out, unsigned short *scratch, float *dwt, "
                        "float *dbias, int batch, int nthreads, int ocb_lo, int ocb_hi"))},
    # the fp32 blocked weights of output blocks [ocb_lo, ocb_hi) into both tile copies
    "fc_weight_tiles": "const float *src, unsigned short *fwd_tiles, unsigned short *data_tiles, int ocb_lo, "
                       "int ocb_hi, int nthreads",
    # bf16 builds without AMX: the packed first layer's forward on vdpbf16ps register tiles, a
    # kernel row's window values in pairs read in place from a padded bf16 copy of the image it
    # makes itself (its weights: made by conv_weight_tiles, geometry.packed_bf16_weight_values)
    "conv_fwd_packed_bf16": "const float *in, const unsigned short *wt, const float *bias, void *out, "
                            "int batch, int nthreads",
    # and its backward-weights pass: the fp32 kernel's arguments, dy masked by the ReLU's output as
    # it is paired (dy itself left as it is); the pair copies are the kernel's own
    "conv_bwd_weights_packed_bf16": "const float *in, const float *dy, const void *out, float *dwt, float *dbias, "
                                    "int batch, int nthreads",
    "act_to_bf16": "const float *src, unsigned short *dst, int batch, int nthreads",
    "peak": "long long iters, int nthreads, float *sink",
    # one SGD update of n parameters (templates/sgd.c.j2); decay NULL: decay_all for every one;
    # *nonfinite: 1 where an updated weight is NaN or infinite, else 0
    "sgd": "float *p, float *v, const float *g, const float *decay, float decay_all, float lr, float momentum, "
           "long long n, int nthreads, int *nonfinite",
    "weight_layout": "const float *src, float *dst",
}

# Timing loops of `bench` (templates/repeat.c.j2): a weighted kernel's own arguments after the
# kernel, the call count and where the seconds per call go; one for every kind of the families
# of conv and fc layers (families.all_kinds).
REPEATED_KINDS = tuple(k.name for k in all_kinds() if k.layer_type in ("conv", "fc"))
SIGNATURES |= {f"repeat_{kind}": "void *fn, long long reps, double *seconds, " + SIGNATURES[kind]
               for kind in REPEATED_KINDS}

# G of the dropout kernels' counter hash (the golden-ratio increment of SplitMix64): the
# generator emits it into the kernels, the runtime shifts seeds by multiples of it.
DROPOUT_HASH_STEP = 0x9E3779B97F4A7C15
