"""LayerSpec × pass × Arch → KernelPlan: register and cache blocks from a balance model (docs/design.md §3).

    tiles    the register-tile model (RegisterTile) and the row cover of the conv kernels
    conv     conv forward, backward-data (general, few-channel), backward-weights
    fc       the three GEMMs
    memory   pooling, elementwise, batchnorm, join and loss kernels: no blocks to choose
    explain  the `reason` sentence of each plan
    plans    KernelPlan and one typed plan per kernel family: the contract with the templates
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

# Passes each layer type has (the loss's bwd_data is the gradient of the mean loss w.r.t. the
# logits): one table, in the manifest schema the runtime validates builds against.
from pcldnn_runtime import families
from pcldnn_runtime.manifest import LAYER_PASSES, PASSES

from ..arch import Arch
from ..errors import PlanError
from ..netspec import LayerSpec
from . import explain
from .amx import plan_conv_amx, plan_conv_bwd_weights_amx, plan_conv_packed_amx, plan_fc_tiles, plan_fc_tiles_bwd_weights
from .conv import (
    L1_BUDGET,
    kernel_layer,
    plan_conv_bwd_data,
    plan_conv_bwd_weights,
    plan_conv_bwd_weights_packed_bf16,
    plan_conv_fwd,
    plan_conv_fwd_packed_bf16,
    plane_as_row,
)
from .depthwise import plan_conv_depthwise
from .fc import plan_fc_bwd_data, plan_fc_bwd_weights, plan_fc_fwd
from .memory import BATCHNORM, ELTWISE, JOIN, LOSS, POOL, MemoryKernels, plan_memory_bound
from .plans import ConvBwdDataPlan, ConvFwdPlan, Fusion, KernelPlan, Measured, TileTiming
from .tiles import LATENCY_SLACK, RegisterTile

# The register-tile planners by (layer type, pass); the conv ones take the operands' bytes too
# (4: fp32, 2: the vdpbf16ps family's bf16 pairs).
_CONV_PLANNERS: dict[str, Callable[..., KernelPlan]] = {
    "fwd": plan_conv_fwd, "bwd_data": plan_conv_bwd_data, "bwd_weights": plan_conv_bwd_weights}
_PLANNERS: dict[tuple[str, str], Callable[[LayerSpec, Arch, tuple[int, int] | None], KernelPlan]] = {
    **{("conv", p): planner for p, planner in _CONV_PLANNERS.items()},
    ("fc", "fwd"): plan_fc_fwd, ("fc", "bwd_data"): plan_fc_bwd_data, ("fc", "bwd_weights"): plan_fc_bwd_weights,
}


def reads_packed_image(layer: LayerSpec, arch: Arch) -> bool:
    """Whether `layer` is the net's first convolution on the packed few-channel image
    (geometry.input_pixel_floats): its kernels are a family of their own (AMX or vdpbf16ps)."""
    return families.reads_packed_image(layer, arch.vector_floats)


def plan_layer(layer: LayerSpec, pass_name: str, arch: Arch, choice: tuple[int, int] | None = None,
               bf16: bool = False, amx: bool = False, activations: tuple[bool, bool] = (False, False),
               gradients: tuple[bool, bool] = (False, False)) -> KernelPlan:
    """The model's plan; with `choice` = (width, vectors), the plan built around that register
    tile instead (a measured choice: it must be one of the planner's own candidates). bf16: a
    kernel of the vdpbf16ps family for the layer (bf16 operands, two multiply-adds per
    dot-product lane); amx: of its AMX family (families.family_for: a build asks for the family
    families.choose picks); either reads and writes the (input, output) activations as bf16
    where `activations` says (families.bf16_outputs), and a backward pass the (input, output)
    gradients where `gradients` says (families.bf16_gradients)."""
    passes = LAYER_PASSES.get(layer.type, ())
    if pass_name not in passes:
        raise PlanError(f"{layer.name}: a {layer.type} layer has no {pass_name!r} pass "
                        f"(it has: {', '.join(passes) or 'none'})")
    engine = families.Engine.AMX if amx else families.Engine.VDPBF16 if bf16 else families.Engine.FP32
    family = families.family_for(layer, engine, arch.vector_floats)
    if family is None:
        raise PlanError(f"{layer.name}: no {engine.value} kernels for a {layer.type} layer")
    planner = _FAMILY_PLANNERS[family.name]
    row = plane_as_row(layer, pass_name) if planner.plane_as_row else None
    plan = planner.plan(row or layer, pass_name, arch, choice, activations, gradients)
    if row is not None:
        assert isinstance(plan, (ConvFwdPlan, ConvBwdDataPlan))
        plan = dataclasses.replace(plan, plane_as_row=True, reason=plan.reason + explain.plane_as_row(layer))
    if plan.activations != activations:  # a conv kernel planned without them: say what it reads and writes
        plan = dataclasses.replace(plan, activations=activations,
                                   reason=plan.reason + explain.bf16_activations(pass_name, activations))
    if any(gradients):
        plan = dataclasses.replace(plan, gradients=gradients,
                                   reason=plan.reason + explain.bf16_gradients(pass_name, gradients))
    return plan


_Planner = Callable[[LayerSpec, str, Arch, "tuple[int, int] | None", "tuple[bool, bool]", "tuple[bool, bool]"],
                    KernelPlan]


def _register_tiled(layer: LayerSpec, pass_name: str, arch: Arch, choice: tuple[int, int] | None,
                    activations: tuple[bool, bool], gradients: tuple[bool, bool]) -> KernelPlan:
    """conv_direct, fc_gemm: the fp32 register-tile kernels."""
    return _PLANNERS[(layer.type, pass_name)](layer, arch, choice)


def _conv_vdpbf16(layer: LayerSpec, pass_name: str, arch: Arch, choice: tuple[int, int] | None,
                  activations: tuple[bool, bool], gradients: tuple[bool, bool]) -> KernelPlan:
    """The fp32 kernels' planners with 2-byte operands, at the dot product's latency."""
    return _CONV_PLANNERS[pass_name](layer, arch.for_dot_products(), choice, 2)


def _conv_packed_vdpbf16(layer: LayerSpec, pass_name: str, arch: Arch, choice: tuple[int, int] | None,
                         activations: tuple[bool, bool], gradients: tuple[bool, bool]) -> KernelPlan:
    if pass_name == "bwd_data":
        raise PlanError(f"{layer.name}: a packed first layer's {pass_name} pass has no vdpbf16ps kernel")
    planner = plan_conv_fwd_packed_bf16 if pass_name == "fwd" else plan_conv_bwd_weights_packed_bf16
    return planner(layer, arch.for_dot_products(), choice)


def _fc_tiles(amx: bool) -> _Planner:
    def plan(layer: LayerSpec, pass_name: str, arch: Arch, choice: tuple[int, int] | None,
             activations: tuple[bool, bool], gradients: tuple[bool, bool]) -> KernelPlan:
        planning = arch if amx else arch.for_dot_products()
        return plan_fc_tiles_bwd_weights(layer, planning, amx) if pass_name == "bwd_weights" else \
            plan_fc_tiles(layer, pass_name, planning, amx)
    return plan


def _conv_amx(layer: LayerSpec, pass_name: str, arch: Arch, choice: tuple[int, int] | None,
              activations: tuple[bool, bool], gradients: tuple[bool, bool]) -> KernelPlan:
    return plan_conv_bwd_weights_amx(layer, arch, activations) if pass_name == "bwd_weights" else \
        plan_conv_amx(layer, pass_name, arch, activations, gradients)


def _memory_bound(kernels: MemoryKernels) -> _Planner:
    """pool, eltwise, batchnorm, join, loss: no blocks to choose."""
    def plan(layer: LayerSpec, pass_name: str, arch: Arch, choice: tuple[int, int] | None,
             activations: tuple[bool, bool], gradients: tuple[bool, bool]) -> KernelPlan:
        if choice is not None:
            raise PlanError(f"{layer.name}: the {pass_name} pass of a {layer.type} layer has no register tile to choose")
        return plan_memory_bound(layer, pass_name, arch, kernels, activations)
    return plan


@dataclass(frozen=True)
class FamilyPlanner:
    """The generator's half of a kernel family: its planner and what the planner needs of it, so a
    family cannot come without them (tests/test_families.py checks every family's record; the
    fp32 compute families' thread-division models are planner/parallel.py's LOOPS, on the cluster
    side of the layering)."""
    plan: _Planner
    memory: MemoryKernels | None = None  # a memory-bound family's kinds: templates and sentences
    plane_as_row: bool = False           # its convolutions read a small 1x1 plane as one row (conv.plane_as_row)


def _memory_family(kernels: MemoryKernels) -> FamilyPlanner:
    return FamilyPlanner(_memory_bound(kernels), kernels)


# Each kernel family's planner (families.FAMILIES names them): the planner's half of the registry.
_FAMILY_PLANNERS: dict[str, FamilyPlanner] = {
    "conv_packed_amx": FamilyPlanner(lambda layer, p, arch, choice, act, grad: plan_conv_packed_amx(layer, p, arch)),
    "conv_amx": FamilyPlanner(_conv_amx),
    "fc_tiles_amx": FamilyPlanner(_fc_tiles(True)),
    "conv_packed_vdpbf16": FamilyPlanner(_conv_packed_vdpbf16),
    "conv_vdpbf16": FamilyPlanner(_conv_vdpbf16, plane_as_row=True),
    "fc_tiles_vdpbf16": FamilyPlanner(_fc_tiles(False)),
    "conv_depthwise": FamilyPlanner(lambda layer, p, arch, choice, act, grad: plan_conv_depthwise(layer, p, arch)),
    "conv_direct": FamilyPlanner(_register_tiled, plane_as_row=True),
    "fc_gemm": FamilyPlanner(_register_tiled),
    "pool": _memory_family(POOL),
    "eltwise": _memory_family(ELTWISE),
    "batchnorm": _memory_family(BATCHNORM),
    "join": _memory_family(JOIN),
    "loss": _memory_family(LOSS),
}


__all__ = ["L1_BUDGET", "LATENCY_SLACK", "LAYER_PASSES", "PASSES", "Fusion", "KernelPlan", "Measured", "RegisterTile",
           "TileTiming", "kernel_layer", "plan_layer", "reads_packed_image"]
