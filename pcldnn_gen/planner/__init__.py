"""LayerSpec × pass × Arch → KernelPlan: register and cache blocks from a balance model (DESIGN §6).

    tiles    the register-tile model (RegisterTile) and the row cover of the conv kernels
    conv     conv forward, backward-data (general, few-channel), backward-weights
    fc       the three GEMMs
    memory   pooling, elementwise and loss kernels: no blocks to choose
    explain  the `reason` sentence of each plan
    plans    KernelPlan and one typed plan per kernel family: the contract with the templates
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

# Passes each layer type has (the loss's bwd_data is the gradient of the mean loss w.r.t. the
# logits): one table, in the manifest schema the runtime validates builds against.
from pcldnn_runtime.limits import input_pixel_floats
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
from .fc import plan_fc_bwd_data, plan_fc_bwd_weights, plan_fc_fwd
from .memory import plan_memory_bound
from .plans import ConvBwdDataPlan, ConvFwdPlan, KernelPlan, Measured, TileTiming
from .tiles import LATENCY_SLACK, RegisterTile

_PLANNERS: dict[tuple[str, str], Callable[[LayerSpec, Arch, tuple[int, int] | None], KernelPlan]] = {
    ("conv", "fwd"): plan_conv_fwd, ("conv", "bwd_data"): plan_conv_bwd_data,
    ("conv", "bwd_weights"): plan_conv_bwd_weights,
    ("fc", "fwd"): plan_fc_fwd, ("fc", "bwd_data"): plan_fc_bwd_data, ("fc", "bwd_weights"): plan_fc_bwd_weights,
}


def reads_packed_image(layer: LayerSpec, arch: Arch) -> bool:
    """Whether `layer` is the net's first convolution on the packed few-channel image
    (limits.input_pixel_floats): its kernels are a family of their own (AMX or vdpbf16ps)."""
    return input_pixel_floats(layer.index, layer.type, layer.in_shape[0], arch.vector_floats) < arch.vector_floats


def plan_layer(layer: LayerSpec, pass_name: str, arch: Arch, choice: tuple[int, int] | None = None,
               bf16: bool = False, amx: bool = False, activations: tuple[bool, bool] = (False, False),
               gradients: tuple[bool, bool] = (False, False)) -> KernelPlan:
    """The model's plan; with `choice` = (width, vectors), the plan built around that register
    tile instead (a measured choice: it must be one of the planner's own candidates). bf16: a
    conv kernel on bf16 operands (2-byte values, two multiply-adds per dot-product lane); amx:
    its AMX tile kernel (limits.amx_kernels); either reads and writes the (input, output)
    activations as bf16 where `activations` says (limits.bf16_outputs), and a backward pass the
    (input, output) gradients where `gradients` says (limits.bf16_gradients)."""
    passes = LAYER_PASSES.get(layer.type, ())
    if pass_name not in passes:
        raise PlanError(f"{layer.name}: a {layer.type} layer has no {pass_name!r} pass "
                        f"(it has: {', '.join(passes) or 'none'})")
    row = None if amx or (bf16 and reads_packed_image(layer, arch)) else plane_as_row(layer, pass_name)
    plan = _model_plan(row or layer, pass_name, arch, choice, bf16, amx, activations, gradients)
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


def _model_plan(layer: LayerSpec, pass_name: str, arch: Arch, choice: tuple[int, int] | None,
                bf16: bool, amx: bool, activations: tuple[bool, bool], gradients: tuple[bool, bool]) -> KernelPlan:
    planner = _PLANNERS.get((layer.type, pass_name))
    if amx:
        if layer.type == "fc":
            return plan_fc_tiles_bwd_weights(layer, arch, amx) if pass_name == "bwd_weights" else \
                plan_fc_tiles(layer, pass_name, arch, amx)
        if reads_packed_image(layer, arch):
            return plan_conv_packed_amx(layer, pass_name, arch)
        if layer.type != "conv":
            raise PlanError(f"{layer.name}: AMX kernels exist for convolutions and fc layers only")
        return plan_conv_bwd_weights_amx(layer, arch, activations) if pass_name == "bwd_weights" else \
            plan_conv_amx(layer, pass_name, arch, activations, gradients)
    if bf16:
        arch = arch.for_dot_products()
        if layer.type == "fc":
            return plan_fc_tiles_bwd_weights(layer, arch, False) if pass_name == "bwd_weights" else \
                plan_fc_tiles(layer, pass_name, arch, False)
        if layer.type != "conv":
            raise PlanError(f"{layer.name}: no bf16 kernels for a {layer.type} layer")
        if reads_packed_image(layer, arch):
            if pass_name == "bwd_data":
                raise PlanError(f"{layer.name}: a packed first layer's {pass_name} pass has no vdpbf16ps kernel")
            return plan_conv_fwd_packed_bf16(layer, arch, choice) if pass_name == "fwd" else \
                plan_conv_bwd_weights_packed_bf16(layer, arch, choice)
        return _PLANNERS[("conv", pass_name)](layer, arch, choice, 2)  # type: ignore[call-arg]
    if planner:
        return planner(layer, arch, choice)
    if choice is not None:
        raise PlanError(f"{layer.name}: the {pass_name} pass of a {layer.type} layer has no register tile to choose")
    return plan_memory_bound(layer, pass_name, arch, activations)


__all__ = ["L1_BUDGET", "LATENCY_SLACK", "LAYER_PASSES", "PASSES", "KernelPlan", "Measured", "RegisterTile",
           "TileTiming", "kernel_layer", "plan_layer", "reads_packed_image"]
