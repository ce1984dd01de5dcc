"""What a kernel family is: its kind, the layers and passes it takes and why it declines one, its
C signatures, and how the runtime calls its kernels. The family modules beside this one each
declare theirs; `families/__init__.py` orders them (the policy) and answers which one computes
a pass."""
from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import numpy as np

from ..geometry import input_pixel_floats
from ..layer_types import LAYER_PASSES, ConvKind, conv_kind

if TYPE_CHECKING:
    from ..layers import WeightedLayer


class Engine(enum.Enum):
    """What computes the dot products: fp32 FMAs, vdpbf16ps on bf16 pairs, or AMX tiles."""
    FP32 = "fp32"
    VDPBF16 = "vdpbf16ps"
    AMX = "amx"


@dataclass(frozen=True)
class Kind:
    """A kernel's kind: layer type x pass x engine (and whether it reads the first layer's
    packed image, and which kind of convolution); `name` is the string builds record
    (`conv_fwd_packed_amx`, `conv_bwd_data_depthwise`)."""
    layer_type: str
    pass_name: str
    engine: Engine
    packed: bool = False
    conv_kind: ConvKind = ConvKind.DENSE

    @property
    def weight_copy(self) -> bool:
        """Whether the kernel's library also makes its bf16 copy of the weights (`<pass>_tiles`,
        kind conv_weight_tiles): a bf16 convolution's forward and backward-data (fc layers' tile
        copies are made by their layout library)."""
        return self.layer_type == "conv" and self.pass_name in ("fwd", "bwd_data") and self.engine is not Engine.FP32

    @property
    def name(self) -> str:
        if self.engine is Engine.FP32:
            return f"{self.layer_type}_{self.pass_name}" + (
                "" if self.conv_kind is ConvKind.DENSE else f"_{self.conv_kind.value}")
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
    @property
    def groups(self) -> int: ...
    @property
    def conv_kind(self) -> ConvKind | None: ...
    @property
    def name(self) -> str: ...
    @property
    def inputs(self) -> tuple[str, ...]: ...


@dataclass(frozen=True)
class Shape:
    """A LayerShape from plain values (a manifest entry while it is being read)."""
    index: int
    type: str
    in_shape: tuple[int, int, int]
    kernel: tuple[int, int]
    stride: tuple[int, int] = (1, 1)
    pad: tuple[int, int] = (0, 0)
    groups: int = 1
    name: str = ""
    inputs: tuple[str, ...] = ()

    @property
    def conv_kind(self) -> ConvKind | None:
        return conv_kind(self.type, self.groups, self.in_shape[0])


def reads_packed_image(layer: LayerShape, v: int) -> bool:
    """Whether `layer` is the net's first convolution on the packed few-channel image
    (geometry.input_pixel_floats): its bf16 and AMX kernels are families of their own."""
    return input_pixel_floats(layer.index, layer.type, layer.in_shape[0], v, layer.groups) < v


def window_values(layer: LayerShape) -> int:
    """KH x KW x C: the values one output pixel's window reads."""
    return layer.kernel[0] * layer.kernel[1] * layer.in_shape[0]


def gradient_window_at_least(minimum: int, why_not: str) -> Callable[[LayerShape, str, Target], str | None]:
    """A packed first layer's policy: backward-weights from windows of `minimum` values (KH x KW
    x C) or more; below, the reason `why_not`."""
    def policy(layer: LayerShape, pass_name: str, target: Target) -> str | None:
        if pass_name == "bwd_weights" and window_values(layer) < minimum:
            return f"a window of {window_values(layer)} values (< {minimum}): {why_not}"
        return None
    return policy


Part = tuple[int, int] | None  # an fc layer's output blocks [lo, hi) this process computes (conv: None)


@dataclass(frozen=True)
class Calls:
    """How the runtime calls a weighted layer's kernels of one family (WeightedLayer.run_forward
    and run_backward dispatch here). Each takes the layer and the pass's blocked buffers;
    `backward_weights` returns whether it masked dy by the ReLU in place (then backward-data has
    nothing left to mask); `weight_copy_values` is the bf16 values of the weight copy its forward
    or backward-data kernel reads (None: it reads the fp32 weights or the fc tile copies)."""
    forward: Callable[[WeightedLayer, np.ndarray, np.ndarray, Part, int, int], None]
    backward_weights: Callable[[WeightedLayer, np.ndarray, np.ndarray, np.ndarray | None, np.ndarray, np.ndarray,
                                Part, int, int], bool]
    backward_data: Callable[[WeightedLayer, np.ndarray, np.ndarray | None, np.ndarray, Part, int, int], None]
    weight_copy_values: Callable[[WeightedLayer, str], int] | None = None


@dataclass(frozen=True)
class Family:
    """One kernel family. `layer_types` and `packed` say which layers its kernels are written
    for (the shape it handles, whatever the policy); `policy(layer, pass, target)` says why it
    declines a pass it could compute (None: it takes it). `signatures` gives each of its kinds'
    C parameter list (pcldnn_runtime.abi gathers them); `calls`, how a weighted layer runs its
    kernels (pooling, ReLU, dropout and the loss have a layer class each: runtime/layers.py)."""
    name: str
    engine: Engine
    layer_types: tuple[str, ...]
    signatures: Mapping[str, str]
    calls: Calls | None = None
    packed: bool | None = None  # True: only the packed first layer; False: never it; None: either
    conv_kind: ConvKind = ConvKind.DENSE  # the one kind of convolution its conv kernels compute
    policy: Callable[[LayerShape, str, Target], str | None] = lambda layer, pass_name, target: None
    passes: tuple[str, ...] | None = None  # the passes it has kernels for (None: every pass of its layers)
    # bound by memory, not FLOPs: its kernels are judged by bytes a second (bench's copy-rate rows)
    memory_bound: bool = False
    # its fp32 forward fills its batchnorm reader's batch statistics (fusion.py) where its output is fp32
    fills_statistics: bool = False
    kinds: tuple[Kind, ...] = field(init=False)

    def __post_init__(self) -> None:
        kinds = tuple(Kind(t, p, self.engine, bool(self.packed), self.conv_kind) for t in self.layer_types
                      for p in LAYER_PASSES[t] if self.passes is None or p in self.passes)
        object.__setattr__(self, "kinds", kinds)
        if set(self.signatures) != {k.name for k in kinds}:  # a family module's slip, found on import
            raise ValueError(f"family {self.name}: signatures for {sorted(self.signatures)}, "
                             f"kinds {sorted(k.name for k in kinds)}")

    def has_pass(self, layer_type: str, pass_name: str) -> bool:
        return any(k.layer_type == layer_type and k.pass_name == pass_name for k in self.kinds)

    def kind(self, layer_type: str, pass_name: str) -> Kind:
        return Kind(layer_type, pass_name, self.engine, bool(self.packed), self.conv_kind)

    def handles(self, layer: LayerShape, v: int) -> bool:
        """Whether its kernels are written for this layer (type, kind of convolution, packed image or not)."""
        return (layer.type in self.layer_types and self._conv_kind_matches(layer)
                and (self.packed is None or self.packed == reads_packed_image(layer, v)))

    def _conv_kind_matches(self, layer: LayerShape) -> bool:
        return layer.type != "conv" or layer.conv_kind is self.conv_kind

    def declines(self, layer: LayerShape, pass_name: str, target: Target) -> str | None:
        """Why this family does not compute the pass in this build (None: it does)."""
        if layer.type not in self.layer_types:
            return f"computes {', '.join(self.layer_types)} layers, not {layer.type}"
        if not self._conv_kind_matches(layer):
            kind = layer.conv_kind.value if layer.conv_kind else layer.type
            return f"computes {self.conv_kind.value} convolutions only, not {kind} ones"
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


# Parameter lists the families share. Activations are blocked (N, C/V, H, W, V); weights are
# blocked (OC/V, IC/V, KH, KW, V_ic, V_oc); `batch` is the minibatch, `nthreads` the OpenMP
# thread count of this call.
FWD = "const float *in, const float *wt, const float *bias, float *out, int batch, int nthreads"
# Backward kernels take the forward output `out` (or NULL): with a fused ReLU they first zero dy
# where out <= 0, in place. bwd_data gets scratch for the transposed weights (conv only).
BWD_DATA = "float *dy, const float *out, const float *wt, float *scratch, float *dx, int batch, int nthreads"
BWD_WEIGHTS = "const float *in, float *dy, const float *out, float *dwt, float *dbias, int batch, int nthreads"
# fc kernels compute only the output-feature blocks [ocb_lo, ocb_hi): a model-parallel rank's
# slice of the layer (0, OC/V: the whole layer).
SLICE = ", int ocb_lo, int ocb_hi"


# -- the calls of kernels that read the fp32 weights as they are (conv_direct, fc_gemm) ----------

def fp32_forward(layer: WeightedLayer, xb: np.ndarray, yb: np.ndarray, part: Part, batch: int, team: int) -> None:
    """fc: output blocks `part`."""
    p = layer.ptr  # an array as a pointer to its data, None as NULL
    layer.kernels["fwd"](p(xb), layer.weights_ptr, layer.bias_ptr, p(yb), batch, team, *(part or ()))


def statistics_forward(layer: WeightedLayer, xb: np.ndarray, yb: np.ndarray, part: Part, batch: int,
                       team: int) -> None:
    """A convolution that may fill its batchnorm's statistics (families.fusion): `layer.statistics`,
    the (mean, var) rows, or None (conv_direct, conv_depthwise)."""
    p = layer.ptr  # an array as a pointer to its data, None as NULL
    mean, var = layer.statistics or (None, None)
    layer.kernels["fwd"](p(xb), layer.weights_ptr, layer.bias_ptr, p(yb), p(mean), p(var), batch, team)


def fp32_backward_weights(layer: WeightedLayer, xb: np.ndarray, dyb: np.ndarray, mask: np.ndarray | None,
                          dw: np.ndarray, db: np.ndarray, part: Part, batch: int, threads: int) -> bool:
    p = layer.ptr  # an array as a pointer to its data, None as NULL
    layer.kernels["bwd_weights"](p(xb), p(dyb), p(mask), p(dw), p(db), batch, threads, *(part or ()))
    return True  # dy masked in place


def fp32_backward_data(layer: WeightedLayer, dyb: np.ndarray, mask: np.ndarray | None, dxb: np.ndarray, part: Part,
                       batch: int, threads: int) -> None:
    """conv: the transposed weights in fp32 scratch (room for all of them)."""
    p = layer.ptr  # an array as a pointer to its data, None as NULL
    scratch = layer.scratch(layer.weights_size if layer.type == "conv" else 0)
    layer.kernels["bwd_data"](p(dyb), p(mask), layer.weights_ptr, p(scratch), p(dxb), batch, threads, *(part or ()))


FP32_CALLS = Calls(fp32_forward, fp32_backward_weights, fp32_backward_data)
