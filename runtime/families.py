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
"""
from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from .geometry import input_pixel_floats


class Engine(enum.Enum):
    """What computes the dot products: fp32 FMAs, vdpbf16ps on bf16 pairs, or AMX tiles."""
    FP32 = "fp32"
    VDPBF16 = "vdpbf16ps"
    AMX = "amx"


@dataclass(frozen=True)
class Kind:
    """A kernel's kind: layer type x pass x engine (and whether it reads the first layer's
    packed image); `name` is the string builds record (`conv_fwd_packed_amx`)."""
    layer_type: str
    pass_name: str
    engine: Engine
    packed: bool = False

    @property
    def weight_copy(self) -> bool:
        """Whether the kernel's library also makes its bf16 copy of the weights (`<pass>_tiles`,
        kind conv_weight_tiles): a bf16 convolution's forward and backward-data (fc layers' tile
        copies are made by their layout library)."""
        return self.layer_type == "conv" and self.pass_name in ("fwd", "bwd_data") and self.engine is not Engine.FP32

    @property
    def name(self) -> str:
        if self.engine is Engine.FP32:
            return f"{self.layer_type}_{self.pass_name}"
        return (f"{self.layer_type}_{self.pass_name}" + ("_packed" if self.packed else "")
                + ("_amx" if self.engine is Engine.AMX else "_bf16"))

    def __str__(self) -> str:
        return self.name


@dataclass(frozen=True)
class Target:
    """What the choice needs of a build: its precision, whether its CPU has AMX tiles, and the
    vector width in floats."""
    precision: str
    amx: bool
    vector_floats: int


class LayerShape(Protocol):
    """What the families read of a layer: the generator's LayerSpec and the manifest's LayerEntry."""
    @property
    def index(self) -> int: ...
    @property
    def type(self) -> str: ...
    @property
    def in_shape(self) -> tuple[int, int, int]: ...
    @property
    def kernel(self) -> tuple[int, int]: ...
    @property
    def stride(self) -> tuple[int, int]: ...
    @property
    def pad(self) -> tuple[int, int]: ...


@dataclass(frozen=True)
class Shape:
    """A LayerShape from plain values (a manifest entry while it is being read)."""
    index: int
    type: str
    in_shape: tuple[int, int, int]
    kernel: tuple[int, int]
    stride: tuple[int, int] = (1, 1)
    pad: tuple[int, int] = (0, 0)


def reads_packed_image(layer: LayerShape, v: int) -> bool:
    """Whether `layer` is the net's first convolution on the packed few-channel image
    (geometry.input_pixel_floats): its bf16 and AMX kernels are families of their own."""
    return input_pixel_floats(layer.index, layer.type, layer.in_shape[0], v) < v


def window_values(layer: LayerShape) -> int:
    """KH x KW x C: the values one output pixel's window reads."""
    return layer.kernel[0] * layer.kernel[1] * layer.in_shape[0]


# The packed first layer's backward-weights pass goes on tiles from windows of this many values
# (KH x KW x C): below it the pass is bound by reading dy once, which the fp32 kernel does in one
# pass and the tile kernel after copying it. Measured, mb 16-64, one thread, Xeon VM (tiles /
# fp32 ms): VGG-A conv1, 27 values, 30.2 / 25.4; ResNet-style 7x7 stride 2, 147 values, 15.2 /
# 23.2; AlexNet-style 11x11 stride 4, 363 values, 6.4 / 9.4.
AMX_PACKED_GRADIENT_WINDOW = 64
# The same for its vdpbf16ps kernel (pixel pairs, bands of pair copies), which gains less than
# the tiles over the fp32 kernel. At Zen's dot rate emulated (Ice Lake VM, mb 16, speed over the
# fp32 kernel): 27 values 0.75-0.99 (MobileNet's 3x3 stride 2: 4.01 -> 5.22 ms), 75 and 81 values
# 1.11-1.19 on one thread but 0.84-1.06 on two, 147 values 1.32-1.33 and 363 values 1.47-1.51 on
# both; between 81 and 147 not measured.
BF16_PACKED_GRADIENT_WINDOW = 100

@dataclass(frozen=True)
class Family:
    """One kernel family. `layer_types` and `packed` say which layers its kernels are written
    for (the shape it handles, whatever the policy); `policy(layer, pass, target)` says why it
    declines a pass it could compute (None: it takes it)."""
    name: str
    engine: Engine
    layer_types: tuple[str, ...]
    packed: bool | None = None  # True: only the packed first layer; False: never it; None: either
    policy: Callable[[LayerShape, str, Target], str | None] = lambda layer, pass_name, target: None
    passes: tuple[str, ...] | None = None  # the passes it has kernels for (None: every pass of its layers)

    def has_pass(self, layer_type: str, pass_name: str) -> bool:
        from .manifest import LAYER_PASSES
        return pass_name in (self.passes if self.passes is not None else LAYER_PASSES[layer_type])

    def kind(self, layer_type: str, pass_name: str) -> Kind:
        return Kind(layer_type, pass_name, self.engine, bool(self.packed))

    def handles(self, layer: LayerShape, v: int) -> bool:
        """Whether its kernels are written for this layer (type, packed image or not)."""
        return layer.type in self.layer_types and (self.packed is None
                                                   or self.packed == reads_packed_image(layer, v))

    def declines(self, layer: LayerShape, pass_name: str, target: Target) -> str | None:
        """Why this family does not compute the pass in this build (None: it does)."""
        if layer.type not in self.layer_types:
            return f"computes {', '.join(self.layer_types)} layers, not {layer.type}"
        if self.packed is not None and self.packed != reads_packed_image(layer, target.vector_floats):
            return "reads the first layer's packed image only" if self.packed else "not the packed first layer"
        if not self.has_pass(layer.type, pass_name):
            return f"has no {pass_name} kernel"
        if self.engine is not Engine.FP32:
            if target.precision != "bf16":
                return f"a {target.precision} build"
            if (self.engine is Engine.AMX) != target.amx:
                return "the CPU has AMX (its tiles take bf16 work)" if target.amx else "the CPU has no AMX"
        return self.policy(layer, pass_name, target)


def _packed_amx(layer: LayerShape, pass_name: str, target: Target) -> str | None:
    if pass_name == "bwd_weights" and window_values(layer) < AMX_PACKED_GRADIENT_WINDOW:
        return (f"a window of {window_values(layer)} values (< {AMX_PACKED_GRADIENT_WINDOW}): backward-weights "
                "is bound by reading dy, which the fp32 kernel does in one pass")
    return None


def _packed_vdpbf16(layer: LayerShape, pass_name: str, target: Target) -> str | None:
    if pass_name == "bwd_weights" and window_values(layer) < BF16_PACKED_GRADIENT_WINDOW:
        return (f"a window of {window_values(layer)} values (< {BF16_PACKED_GRADIENT_WINDOW}): pixel pairs gain "
                "less than the fp32 kernel's single pass")
    return None


def _conv_vdpbf16(layer: LayerShape, pass_name: str, target: Target) -> str | None:
    if pass_name == "bwd_data" and layer.in_shape[0] < target.vector_floats:
        return (f"{layer.in_shape[0]} input channels, fewer than a vector: the few-channel backward-data kernel "
                "has no channel pairs to take")
    return None


FAMILIES: tuple[Family, ...] = (
    Family("conv_packed_amx", Engine.AMX, ("conv",), packed=True, policy=_packed_amx),
    Family("conv_amx", Engine.AMX, ("conv",), packed=False),
    Family("fc_tiles_amx", Engine.AMX, ("fc",)),
    # (the packed first layer's backward-data is not part of training: it stays fp32)
    Family("conv_packed_vdpbf16", Engine.VDPBF16, ("conv",), packed=True, policy=_packed_vdpbf16,
           passes=("fwd", "bwd_weights")),
    Family("conv_vdpbf16", Engine.VDPBF16, ("conv",), packed=False, policy=_conv_vdpbf16),
    Family("fc_tiles_vdpbf16", Engine.VDPBF16, ("fc",)),
    Family("conv_direct", Engine.FP32, ("conv",)),
    Family("fc_gemm", Engine.FP32, ("fc",)),
    Family("pool", Engine.FP32, ("maxpool", "avgpool")),
    Family("eltwise", Engine.FP32, ("relu", "dropout")),
    Family("loss", Engine.FP32, ("softmax_cross_entropy",)),
)


def all_kinds() -> tuple[Kind, ...]:
    """Every kernel kind some family computes, in the families' order."""
    from .manifest import LAYER_PASSES
    return tuple(f.kind(t, p) for f in FAMILIES for t in f.layer_types for p in LAYER_PASSES[t] if f.has_pass(t, p))


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
    return next(f for f in FAMILIES if f.engine is kind.engine and kind.layer_type in f.layer_types
                and (f.packed is None or f.packed == kind.packed))


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
    from .manifest import LAYER_PASSES
    return tuple(p for p in LAYER_PASSES[layer.type] if choose(layer, p, target)[0].engine in engines)


def bf16_passes(layer: LayerShape, target: Target) -> tuple[str, ...]:
    """The passes with bf16 kernels of either kind (AMX tiles or vdpbf16ps)."""
    return engine_passes(layer, target, Engine.AMX, Engine.VDPBF16)


def amx_passes(layer: LayerShape, target: Target) -> tuple[str, ...]:
    """The passes on AMX tiles."""
    return engine_passes(layer, target, Engine.AMX)


# Layers whose kernels take a bf16 activation as well as an fp32 one, in and out, in a bf16
# build (their backward passes read no activation but a standalone ReLU's own output)
BF16_ACTIVATION_LAYERS = ("maxpool", "avgpool", "relu", "dropout")


def bf16_outputs(precision: str, amx: bool, v: int, layers: Sequence[LayerShape]) -> tuple[bool, ...]:
    """Per layer, whether its output activation is stored as bf16 (half the bytes written, kept
    for the backward pass, and read by the next layer): where every kernel that touches it takes
    bf16, in a bf16 build. Its writer is a convolution (every conv kernel of a bf16 build, fp32
    ones included, stores its output as bf16 and reads it back as the ReLU's mask) or a pooling,
    ReLU or dropout layer; its reader is a convolution whose forward and backward-weights passes
    are bf16 kernels (AMX tiles, or vdpbf16ps without AMX: bf16_passes; they read it as x) or
    one of those layers. Every other activation (the net's input, into and out of fc layers, the
    input of a convolution with fp32 kernels) stays fp32; its gradient is bf16 where
    bf16_gradients says (the generator and the runtime both ask here)."""
    if precision != "bf16":
        return (False,) * len(layers)
    target = Target(precision, amx, v)

    def writes(layer: LayerShape) -> bool:
        return layer.type == "conv" or layer.type in BF16_ACTIVATION_LAYERS

    def reads(layer: LayerShape) -> bool:
        if layer.type in BF16_ACTIVATION_LAYERS:
            return True
        return layer.type == "conv" and {"fwd", "bwd_weights"} <= set(bf16_passes(layer, target))

    return tuple(writes(layer) and i + 1 < len(layers) and reads(layers[i + 1]) for i, layer in enumerate(layers))


def bf16_gradients(precision: str, amx: bool, v: int, layers: Sequence[LayerShape]) -> tuple[bool, ...]:
    """Per layer, whether the gradient of its output activation is stored as bf16: where the
    activation itself is (bf16_outputs) and every kernel that touches the gradient takes bf16,
    as PyTorch's autocast and oneDNN's bf16 training keep an activation's gradient in the
    activation's type (half the bytes of the backward pass). Its writer is the next layer's
    backward-data pass: a pooling, ReLU or dropout layer's, or a convolution's bf16 kernel
    (bf16_passes); its readers are this layer's backward passes: a pooling, ReLU or dropout
    layer's, or a convolution whose backward-data and backward-weights passes are both bf16
    kernels (the packed first layer's backward passes read fp32, on tiles or not). Rounded once
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
