"""Kernel families: which kernel computes each (layer, pass) of a build, decided once.

A family is a kind of kernel (operation, engine, precision) with a rule saying which layers and
passes it takes. The families are tried in order and the first that accepts computes the pass,
as oneDNN walks its implementation list: the generator plans and renders that family's kernel,
the manifest records its kind, and the runtime checks and calls it, all from `choose`. A
family that declines says why (`Family.declines`), which `inspect` and the tests read.

The order is the policy: on a CPU with AMX a bf16 build puts convolutions and fc layers on
tiles (vdpbf16ps issues at half the fp32 FMA's rate there, so the passes AMX does not take stay
fp32); without AMX it uses vdpbf16ps where it has channel pairs to take; everything else, and
every fp32 build, runs the fp32 families.

Each family is a module of this package declaring its `Family` (base.py: its kinds, the layers
and passes it takes, its C signatures, how the runtime calls it); the planner registers its
plan() and templates against it (pcldnn_gen/planner/__init__.py). Adding a family is its module,
its line in FAMILIES below, its planner and its templates (docs/design.md, section 2).
"""
from __future__ import annotations

from collections.abc import Sequence

from ..layer_types import JOINS, LAYER_PASSES, ConvKind
from . import (
    batchnorm,
    conv_amx,
    conv_depthwise,
    conv_direct,
    conv_packed_amx,
    conv_packed_vdpbf16,
    conv_vdpbf16,
    eltwise,
    fc_gemm,
    fc_tiles,
    join,
    loss,
    pool,
)
from .base import Calls, Engine, Family, Kind, LayerShape, Shape, Target, reads_packed_image, window_values
from .conv_packed_amx import AMX_PACKED_GRADIENT_WINDOW
from .conv_packed_vdpbf16 import BF16_PACKED_GRADIENT_WINDOW

FAMILIES: tuple[Family, ...] = (
    conv_packed_amx.FAMILY,
    conv_amx.FAMILY,
    fc_tiles.AMX,
    conv_packed_vdpbf16.FAMILY,
    conv_vdpbf16.FAMILY,
    fc_tiles.VDPBF16,
    conv_depthwise.FAMILY,
    conv_direct.FAMILY,
    fc_gemm.FAMILY,
    pool.FAMILY,
    eltwise.FAMILY,
    batchnorm.FAMILY,
    join.FAMILY,
    loss.FAMILY,
)

__all__ = ["AMX_PACKED_GRADIENT_WINDOW", "BF16_PACKED_GRADIENT_WINDOW", "FAMILIES", "Calls", "Engine", "Family",
           "Kind", "LayerShape", "Shape", "Target", "all_kinds", "amx_passes", "bf16_gradients", "bf16_outputs",
           "bf16_passes", "choose", "declined", "family_for", "family_named", "family_of", "isa_suffix", "kind_named",
           "reads_packed_image", "window_values"]


def all_kinds() -> tuple[Kind, ...]:
    """Every kernel kind some family computes, in the families' order."""
    return tuple(kind for family in FAMILIES for kind in family.kinds)


def family_named(name: str) -> Family:
    """The family of this name (as `Family.name`)."""
    return next(f for f in FAMILIES if f.name == name)


def _all_kinds() -> dict[str, Kind]:
    return {k.name: k for k in all_kinds()}


def kind_named(name: str) -> Kind | None:
    """The Kind of a kernel kind's name as builds record it (None: a layout or other kind)."""
    global _KINDS
    if _KINDS is None:
        _KINDS = _all_kinds()
    return _KINDS.get(name)


_KINDS: dict[str, Kind] | None = None  # every family's kinds by name, made on first use (a cache)


def family_of(kind: Kind) -> Family:
    """The family whose kernels have this kind."""
    return next(f for f in FAMILIES if kind in f.kinds)


def isa_suffix(kind_name: str) -> str:
    """What PCLDNN_VERBOSE adds to the ISA of a kernel of this kind: _amx, _bf16 (vdpbf16ps
    kernels and the copies into their bf16 operands), else nothing."""
    kind = kind_named(kind_name)
    if kind is not None and kind.engine is not Engine.FP32:
        return "_amx" if kind.engine is Engine.AMX else "_bf16"
    return "_bf16" if kind_name == "act_to_bf16" else ""


def choose(layer: LayerShape, pass_name: str, target: Target) -> tuple[Family, Kind]:
    """The family that computes this pass in this build (the first that accepts) and its kind."""
    for family in FAMILIES:
        if family.declines(layer, pass_name, target) is None:
            return family, family.kind(layer.type, pass_name)
    raise ValueError(f"no kernel family computes a {layer.type} layer")  # every layer type has an fp32 family


def declined(layer: LayerShape, pass_name: str, target: Target) -> list[tuple[str, str]]:
    """(family, reason) of every family before the chosen one that could have computed the
    layer's pass but declined: what `inspect --explain` and the tests show."""
    out = []
    for family in FAMILIES:
        reason = family.declines(layer, pass_name, target)
        if reason is None:
            break
        if family.handles(layer, target.vector_floats):
            out.append((family.name, reason))
    return out


def family_for(layer: LayerShape, engine: Engine, v: int) -> Family | None:
    """The family of `engine` whose kernels are written for this layer (planning a given
    engine's kernel, whatever the policy would choose: the tuner's and the tests' way in)."""
    return next((f for f in FAMILIES if f.engine is engine and f.handles(layer, v)), None)


def engine_passes(layer: LayerShape, target: Target, *engines: Engine) -> tuple[str, ...]:
    """The passes of a layer whose chosen kernels run on one of `engines`."""
    return tuple(p for p in LAYER_PASSES[layer.type] if choose(layer, p, target)[0].engine in engines)


def bf16_passes(layer: LayerShape, target: Target) -> tuple[str, ...]:
    """The passes with bf16 kernels of either kind (AMX tiles or vdpbf16ps)."""
    return engine_passes(layer, target, Engine.AMX, Engine.VDPBF16)


def amx_passes(layer: LayerShape, target: Target) -> tuple[str, ...]:
    """The passes on AMX tiles."""
    return engine_passes(layer, target, Engine.AMX)


# Layers whose kernels take a bf16 activation as well as an fp32 one, in and out, in a bf16
# build (their backward passes read no activation but a standalone ReLU's own output and a
# batchnorm's input), and the gradients likewise
BF16_ACTIVATION_LAYERS = ("maxpool", "avgpool", "relu", "dropout", "batchnorm")


def bf16_outputs(precision: str, amx: bool, v: int, layers: Sequence[LayerShape]) -> tuple[bool, ...]:
    """Per layer, whether its output activation is stored as bf16 (half the bytes written, kept
    for the backward pass, and read by the next layer): where every kernel that touches it takes
    bf16, in a bf16 build. Its writer is a convolution (every conv kernel of a bf16 build, fp32
    ones included, stores its output as bf16 and reads it back as the ReLU's mask) or a pooling,
    ReLU, dropout or batchnorm layer; its reader is a convolution whose forward and backward-weights passes
    are bf16 kernels (AMX tiles, or vdpbf16ps without AMX: bf16_passes; they read it as x) or
    one of those layers. Every other activation (the net's input, into and out of fc layers, the
    input of a convolution with fp32 kernels) stays fp32; its gradient is bf16 where
    bf16_gradients says (the generator and the runtime both ask here)."""
    if precision != "bf16":
        return (False,) * len(layers)
    target = Target(precision, amx, v)

    def writes(layer: LayerShape) -> bool:  # (a depthwise convolution's kernels read and write fp32)
        return layer.conv_kind is ConvKind.DENSE or layer.type in BF16_ACTIVATION_LAYERS

    def reads(layer: LayerShape) -> bool:
        if layer.type in BF16_ACTIVATION_LAYERS:
            return True
        return layer.type == "conv" and {"fwd", "bwd_weights"} <= set(bf16_passes(layer, target))

    chained = chain_edges(layers)
    return tuple(writes(layer) and chained[i] and reads(layers[i + 1]) for i, layer in enumerate(layers))


def chain_edges(layers: Sequence[LayerShape]) -> tuple[bool, ...]:
    """Per layer, whether its output goes to the next layer and no other: the edges where an
    activation and its gradient may be stored as bf16 (a layer read by several, or by an add or
    a concat, keeps fp32 activations and sums its gradients in fp32)."""
    readers: dict[str, list[int]] = {}
    for j, layer in enumerate(layers):
        for name in layer.inputs:
            readers.setdefault(name, []).append(j)
    return tuple(i + 1 < len(layers) and readers.get(layer.name, [i + 1]) == [i + 1]
                 and layers[i + 1].type not in JOINS for i, layer in enumerate(layers))


def sides(per_output: Sequence[bool]) -> tuple[tuple[bool, bool], ...]:
    """Per layer, (its input's, its output's) value of a per-output flag (bf16_outputs,
    bf16_gradients): those hold on chain edges only, where layer i reads layer i - 1's output;
    the first layer's input (the net's) is never bf16."""
    return tuple((i > 0 and per_output[i - 1], flag) for i, flag in enumerate(per_output))


def bf16_gradients(precision: str, amx: bool, v: int, layers: Sequence[LayerShape]) -> tuple[bool, ...]:
    """Per layer, whether the gradient of its output activation is stored as bf16: where the
    activation itself is (bf16_outputs) and every kernel that touches the gradient takes bf16,
    as PyTorch's autocast and oneDNN's bf16 training keep an activation's gradient in the
    activation's type (half the bytes of the backward pass). Its writer is the next layer's
    backward-data pass: a pooling, ReLU, dropout or batchnorm layer's, or a convolution's bf16
    kernel (bf16_passes); its readers are this layer's backward passes: one of those layers', or
    a convolution whose backward-data and backward-weights passes are both bf16 kernels (the
    packed first layer's backward passes read fp32, on tiles or not). Rounded once
    where written, so a bf16 kernel reading it sees what it rounded itself before; what
    changes are the sums of gradients in fp32 (a bias gradient, overlapping pooling windows),
    which now add bf16-rounded terms, as oneDNN's do. Weight gradients stay fp32."""
    outputs = bf16_outputs(precision, amx, v, layers)
    target = Target(precision, amx, v)

    def bf16_backward(layer: LayerShape, needed: set[str]) -> bool:
        if layer.type in BF16_ACTIVATION_LAYERS:
            return True
        if reads_packed_image(layer, v):
            return False  # the packed first layer's AMX kernels read dy as fp32
        return layer.type == "conv" and needed <= set(bf16_passes(layer, target))

    return tuple(outputs[i] and bf16_backward(layers[i + 1], {"bwd_data"})  # the writer
                 and bf16_backward(layer, {"bwd_data", "bwd_weights"})        # the readers
                 for i, layer in enumerate(layers))
