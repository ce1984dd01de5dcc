"""Memory-bound kernels (pooling, elementwise, batchnorm, loss): no register tile to choose, only
the template and, for dropout, the mask's constants."""
from __future__ import annotations

from pcldnn_runtime.abi import DROPOUT_HASH_STEP
from pcldnn_runtime.activations import ACTIVATIONS
from pcldnn_runtime.layer_types import JOINS

from ..arch import Arch
from ..netspec import LayerSpec
from . import explain
from .plans import DropoutPlan, KernelPlan

TEMPLATES = {
    "maxpool_fwd": "pool_fwd.c.j2", "avgpool_fwd": "pool_fwd.c.j2",
    "maxpool_bwd_data": "pool_bwd_data.c.j2", "avgpool_bwd_data": "pool_bwd_data.c.j2",
    **{f"{t}_fwd": "eltwise_fwd.c.j2" for t in (*ACTIVATIONS, "dropout")},
    **{f"{t}_bwd_data": "eltwise_bwd_data.c.j2" for t in (*ACTIVATIONS, "dropout")},
    "softmax_cross_entropy_fwd": "loss_fwd.c.j2", "softmax_cross_entropy_bwd_data": "loss_bwd_data.c.j2",
    **{f"batchnorm_{p}": "batchnorm.c.j2" for p in ("fwd", "bwd_data", "bwd_weights")},
    **{f"{t}_{p}": "join.c.j2" for t in JOINS for p in ("fwd", "bwd_data")},
}


def plan_memory_bound(layer: LayerSpec, pass_name: str, arch: Arch,
                      activations: tuple[bool, bool] = (False, False)) -> KernelPlan:
    kind = f"{layer.type}_{pass_name}"
    reason = explain.memory_bound(kind)
    if any(activations):
        which = " and ".join(w for w, b in zip(("input", "output"), activations) if b)
        reason += f"; its {which} stored as bf16 (families.bf16_outputs): half the bytes"
    plan = KernelPlan(layer=layer.name, pass_name=pass_name, kind=kind, template=TEMPLATES[kind], isa=arch.isa,
                      vector_floats=arch.vector_floats, reason=reason, activations=activations)
    if layer.type == "dropout":
        # the runtime shifts seeds by multiples of the hash step, so it is the ABI's constant
        return DropoutPlan(**vars(plan), keep_threshold=round(layer.rate * 2 ** 32), scale=1.0 / (1.0 - layer.rate),
                           hash_step=DROPOUT_HASH_STEP)
    return plan
