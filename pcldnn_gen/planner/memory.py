"""Memory-bound kernels (pooling, elementwise, batchnorm, joins, loss): no register tile to
choose, only the template and, for dropout, the mask's constants. Each such family's kernels are
one `MemoryKernels` record, its kinds' templates beside the sentence `inspect` and the C header
give for them (the planner's registry holds it: planner._FAMILY_PLANNERS)."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from pcldnn_runtime.abi import DROPOUT_HASH_STEP
from pcldnn_runtime.activations import ACTIVATIONS
from pcldnn_runtime.layer_types import DROPS, JOINS

from ..arch import Arch
from ..netspec import LayerSpec
from .plans import DropoutPlan, KernelPlan


@dataclass(frozen=True)
class MemoryKernels:
    """A memory-bound family's kinds (families.Family.kinds' names): each one's template and what
    it does, in one sentence."""
    templates: Mapping[str, str]
    reasons: Mapping[str, str]

    def __post_init__(self) -> None:
        if set(self.templates) != set(self.reasons):
            raise ValueError(f"templates for {sorted(self.templates)}, reasons for {sorted(self.reasons)}")


POOL = MemoryKernels(
    {"maxpool_fwd": "pool_fwd.c.j2", "avgpool_fwd": "pool_fwd.c.j2",
     "maxpool_bwd_data": "pool_bwd_data.c.j2", "avgpool_bwd_data": "pool_bwd_data.c.j2"},
    {"maxpool_fwd": "one vector of channels per output pixel, max over the clipped window; the argmax "
                    "(index in the input plane, per lane) is kept for the backward pass",
     "maxpool_bwd_data": "scatter-add of each output gradient to its argmax; overlapping windows "
                         "accumulate, threads own whole (image, channel block) planes so no races",
     "avgpool_fwd": "one vector per output pixel, mean over the window (divisor: kernel area, padding counts as 0)",
     "avgpool_bwd_data": "each output gradient / kernel area added to its window; threads own whole planes"})

ELTWISE = MemoryKernels(
    {**{f"{t}_fwd": "eltwise_fwd.c.j2" for t in (*ACTIVATIONS, *DROPS)},
     **{f"{t}_bwd_data": "eltwise_bwd_data.c.j2" for t in (*ACTIVATIONS, *DROPS)}},
    {**{f"{a.name}_fwd": f"elementwise {a.formula} on the blocked buffer" for a in ACTIVATIONS.values()},
     **{f"{a.name}_bwd_data": (f"elementwise dy * {a.derivative}, using the forward output as the mask"
                               if not a.from_input else f"elementwise dy * ({a.derivative}), from the forward input")
        for a in ACTIVATIONS.values()},
     "dropout_fwd": "elementwise keep/drop from a counter-based hash of (seed, element index): "
                    "deterministic for any thread count, nothing stored; kept values scaled by 1/(1-rate)",
     "dropout_bwd_data": "the forward mask recomputed from the same seed, applied to dy",
     "drop_path_fwd": "each image kept whole or dropped from the hash of (seed, image index), kept ones scaled by "
                      "1/(1-rate); (image, chunk) items a thread",
     "drop_path_bwd_data": "the forward's per-image mask recomputed from the same seed, applied to dy"})

BATCHNORM = MemoryKernels(
    {f"batchnorm_{p}": "batchnorm.c.j2" for p in ("fwd", "bwd_data", "bwd_weights")},
    {"batchnorm_fwd": "training: each channel block's mean, then its variance about it (two passes, rows summed "
                      "in fp32 vectors into double lanes; none where the convolution before computed them), then "
                      "one scale-and-shift pass; eval: that pass on the running statistics; threads own channel "
                      "blocks for the sums, (image, block) planes after",
     "batchnorm_bwd_data": "the sums of dy and dy x-hat per channel (as backward-weights), then dx in one pass",
     "batchnorm_bwd_weights": "dgamma = sum dy x-hat, dbeta = sum dy per channel, a channel block a thread"})

JOIN = MemoryKernels(
    {f"{t}_{p}": "join.c.j2" for t in JOINS for p in ("fwd", "bwd_data")},
    {"add_fwd": "the inputs summed element by element (and the fused ReLU), (image, block) planes a thread",
     "add_bwd_data": "dy masked by the fused ReLU in place: it is then each input's gradient, unchanged",
     "concat_fwd": "each input's channels copied into theirs, whole vectors where its channels start a block",
     "concat_bwd_data": "each input's channels of dy copied out, the inverse of the forward",
     "mul_fwd": "the two inputs multiplied element by element (a C x 1 x 1 input's lane scaling every pixel of the "
                "other), (image, block) planes a thread",
     "mul_bwd_data": "each input's gradient, dy times the other input (a C x 1 x 1 input's summed over the pixels, "
                     "in fp32 chunks into double lanes)"})

LOSS = MemoryKernels(
    {"softmax_cross_entropy_fwd": "loss_fwd.c.j2", "softmax_cross_entropy_bwd_data": "loss_bwd_data.c.j2"},
    {"softmax_cross_entropy_fwd": "per row: max-shifted softmax, loss = log-sum-exp - logit[label], "
                                  "accumulated in double; mean over the minibatch",
     "softmax_cross_entropy_bwd_data": "(softmax - onehot(label)) / minibatch, padded lanes zero"})


def plan_memory_bound(layer: LayerSpec, pass_name: str, arch: Arch, kernels: MemoryKernels,
                      activations: tuple[bool, bool] = (False, False)) -> KernelPlan:
    """The plan of one of `kernels`' kinds: its template and its sentence."""
    kind = f"{layer.type}_{pass_name}"
    reason = kernels.reasons[kind] + "; memory-bound, no register tile to choose"
    if any(activations):
        which = " and ".join(w for w, b in zip(("input", "output"), activations) if b)
        reason += f"; its {which} stored as bf16 (families.bf16_outputs): half the bytes"
    plan = KernelPlan(layer=layer.name, pass_name=pass_name, kind=kind, template=kernels.templates[kind], isa=arch.isa,
                      vector_floats=arch.vector_floats, reason=reason, activations=activations)
    if layer.type in DROPS:
        # the runtime shifts seeds by multiples of the hash step, so it is the ABI's constant
        return DropoutPlan(**vars(plan), keep_threshold=round(layer.rate * 2 ** 32), scale=1.0 / (1.0 - layer.rate),
                           hash_step=DROPOUT_HASH_STEP)
    return plan
