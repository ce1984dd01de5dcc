"""net.json → NetSpec: validate the network description and infer every layer's shapes.

Every error names the file and the JSON path of the offending value, so a user can fix a
hand-written description without reading our source. Names are checked against a strict
pattern because they become C identifiers and file names in the build directory.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pcldnn_runtime import limits
from pcldnn_runtime.activations import ACTIVATIONS, Activation, activation
from pcldnn_runtime.layer_types import (
    DROPS,
    INITS,
    JOIN_NEEDS,
    JOINS,
    LAYER_TYPES,
    REQUIRED,
    WEIGHTED,
    ConvKind,
    LayerType,
    conv_kind,
    joined_shape,
)
from pcldnn_runtime.validate import NAME_RE, Fields, read_json, show

from .errors import NetSpecError

# Every layer has a name and a type and may also carry `source`: the framework's name of the
# module or node it was imported from (from_torch, `pcldnn-gen import`), informational only, and
# `inputs`: the earlier layers it reads ("input": the net's input; default: the layer before it).
_COMMON = {"name", "type"}
NET_INPUT = "input"


def _fields(layer_type: LayerType) -> tuple[set[str], dict[str, Any]]:
    return ({k for k, v in layer_type.fields.items() if v is REQUIRED},
            {k: v for k, v in layer_type.fields.items() if v is not REQUIRED})


# Fields each layer type takes, required and optional with their defaults (layer_types.LAYER_TYPES;
# global_avgpool: an avgpool whose window is its whole input, C x 1 x 1, a spelling of net.json only)
LAYER_FIELDS: dict[str, tuple[set[str], dict[str, Any]]] = {}
for _type in LAYER_TYPES.values():
    LAYER_FIELDS[_type.name] = _fields(_type)
    if _type.name == "avgpool":
        LAYER_FIELDS["global_avgpool"] = (set(), {})
POOLS = ("maxpool", "avgpool")


@dataclass(frozen=True)
class LayerSpec:
    """One layer with every shape resolved. Shapes are (channels, height, width).

    An fc layer is described like a convolution whose kernel covers its whole input
    (kernel = input H, W; output 1×1): that is exactly how its weights are laid out.
    """

    index: int
    name: str
    type: str
    in_shape: tuple[int, int, int]
    out_shape: tuple[int, int, int]
    kernel: tuple[int, int] = (1, 1)
    stride: tuple[int, int] = (1, 1)
    pad: tuple[int, int] = (0, 0)
    activation: str | None = None  # fused into this layer, or the standalone activation's own (activations.py)
    rate: float = 0.0  # dropout probability (dropout layers only)
    eps: float = 1e-5  # batchnorm: added to the variance before its square root
    momentum: float = 0.1  # batchnorm: running = (1 - momentum) running + momentum batch statistic
    inputs: tuple[str, ...] = ()  # the layers it reads, NET_INPUT for the net's input (set by parse_netspec)
    in_shapes: tuple[tuple[int, int, int], ...] = ()  # add / concat: each input's shape
    init: str = "pytorch"  # conv / fc: how the weights start (INITS)
    bias: bool = True  # conv / fc: false keeps the bias at zero (PyTorch's bias=False)
    groups: int = 1  # conv: 1, or the channels (depthwise: each channel convolved with its own window)

    @property
    def weighted(self) -> bool:
        return self.type in WEIGHTED

    @property
    def act(self) -> Activation | None:
        """The activation this layer applies to its output: its row of the table, or None."""
        return activation(self.activation)

    @property
    def conv_kind(self) -> ConvKind | None:
        """A convolution's kind (dense, grouped, depthwise); None for other layers."""
        return conv_kind(self.type, self.groups, self.in_shape[0])

    @property
    def normalizes(self) -> bool:
        """A batchnorm layer: per-channel scale and shift (`weight`, `bias`) and running statistics."""
        return self.type == "batchnorm"

    @property
    def weight_shape(self) -> tuple[int, ...] | None:
        """Canonical weight shape: conv (OC, IC / groups, KH, KW), fc (OC, IC)."""
        oc, ic = self.out_shape[0], self.in_shape[0]
        if self.type == "conv":
            return (oc, ic // self.groups, *self.kernel)
        if self.type == "fc":
            return (oc, ic * self.in_shape[1] * self.in_shape[2])
        return None

    def flops(self, batch: int) -> int:
        """Multiply-adds × 2 of the forward pass (same count for each backward pass)."""
        if not self.weighted:
            return 0
        oc, oh, ow = self.out_shape
        return 2 * batch * oc * oh * ow * self.in_shape[0] // self.groups * self.kernel[0] * self.kernel[1]

    def useful_flops(self, batch: int) -> int:
        """The FLOPs of `flops` whose input is not padding: each kernel tap counted only at the
        outputs where it reads inside the input (what a kernel that skips padding executes,
        padded channel lanes aside)."""
        if self.type != "conv":
            return self.flops(batch)

        def inside(out: int, size: int, k: int, stride: int, pad: int) -> int:
            return sum(1 for o in range(out) for t in range(k) if 0 <= o * stride - pad + t < size)

        (oh, ow), (ih, iw) = self.out_shape[1:], self.in_shape[1:]
        rows = inside(oh, ih, self.kernel[0], self.stride[0], self.pad[0])
        cols = inside(ow, iw, self.kernel[1], self.stride[1], self.pad[1])
        return 2 * batch * self.out_shape[0] * self.in_shape[0] // self.groups * rows * cols


@dataclass(frozen=True)
class NetSpec:
    name: str
    input: tuple[int, int, int]
    classes: int | None
    layers: tuple[LayerSpec, ...]
    source_hash: str  # sha256 of the canonical JSON: identifies the net across ranks/checkpoints

    def layer(self, name: str) -> LayerSpec:
        for layer in self.layers:
            if layer.name == name:
                return layer
        raise NetSpecError(f"{self.name}: no layer named {name!r}; layers: "
                           + ", ".join(l.name for l in self.layers))


def load_netspec(path: str | Path, max_memory: int | None = None) -> NetSpec:
    """Read and validate a net.json file (see `parse_netspec`)."""
    return parse_netspec(read_json(path, NetSpecError), str(path), max_memory)


def parse_netspec(data: Any, origin: str = "<net>", max_memory: int | None = None) -> NetSpec:
    """Validate an already-parsed description; `origin` names it in error messages. Every size
    has a range (`pcldnn_runtime.limits`), and a net that needs more than `max_memory` bytes
    to train at minibatch 1 is refused before anything is planned."""
    p = _Parser(origin, NetSpecError)
    p.obj(data, "", {"name", "input", "layers"}, {"classes"})
    name = p.name(data["name"], "name")
    inp = p.obj(data["input"], "input", {"channels", "height", "width"})
    shape = (p.int_in(inp["channels"], "input.channels", 1, limits.MAX_CHANNELS),
             p.int_in(inp["height"], "input.height", 1, limits.MAX_SPATIAL),
             p.int_in(inp["width"], "input.width", 1, limits.MAX_SPATIAL))
    classes = data.get("classes")
    if classes is not None:
        classes = p.int_in(classes, "classes", 1, limits.MAX_FEATURES)
    layers_raw = data["layers"]
    if not isinstance(layers_raw, list) or not layers_raw:
        p.fail("layers", f"must be a non-empty list of layers, got {show(layers_raw)}")
    if len(layers_raw) > limits.MAX_LAYERS:
        p.fail("layers", f"has {len(layers_raw)} layers, more than the {limits.MAX_LAYERS} allowed")

    layers: list[LayerSpec] = []
    seen: set[str] = set()
    outputs = {NET_INPUT: (shape, False)}  # each activation's shape, and whether it is a vector (after an fc)
    consumed: set[str] = set()
    for i, raw in enumerate(layers_raw):
        where = f"layers[{i}]"
        if not isinstance(raw, dict):
            p.fail(where, f"must be an object, got {show(raw)}")
        ltype = raw.get("type")
        if not isinstance(ltype, str) or ltype not in LAYER_FIELDS:
            p.fail(f"{where}.type", f"unknown layer type {show(ltype)}; known: {', '.join(LAYER_FIELDS)}")
        required, optional = LAYER_FIELDS[ltype]
        p.obj(raw, where, _COMMON | required, {*optional, "source", "inputs"})
        lname = p.name(raw["name"], f"{where}.name")
        if "source" in raw:
            p.text(raw["source"], f"{where}.source")
        if lname in seen or lname == NET_INPUT:
            p.fail(f"{where}.name", f"duplicate layer name {lname!r}" if lname in seen else
                   f"{NET_INPUT!r} names the net's input")
        inputs = _inputs(p, raw.get("inputs"), ltype, where, layers[-1].name if layers else NET_INPUT, seen)
        consumed.update(inputs)
        seen.add(lname)
        f = {**optional, **raw}
        shape, flat = outputs[inputs[0]]
        c, h, w = shape
        if ltype == "softmax_cross_entropy" and i != len(layers_raw) - 1:
            p.fail(where, "softmax_cross_entropy must be the last layer")
        if ltype == "global_avgpool":  # the average pooling whose window is the input
            ltype, f = "avgpool", {"kernel": [shape[1], shape[2]], "stride": None, "pad": 0}
        if ltype in ("conv", *POOLS) and flat:
            p.fail(where, f"{ltype} cannot follow an fc layer (its input is a flat vector)")
        act = p.activation(f.get("activation"), ltype, f"{where}.activation")

        if ltype in JOINS:
            spec = _join(p, ltype, i, lname, inputs, [outputs[n] for n in inputs], act, where)
        elif ltype == "conv" or ltype in POOLS:
            kernel, stride, pad, (oh, ow) = check_window(p, ltype, f["kernel"], f["stride"], f["pad"], where, (h, w))
            oc = (p.int_in(f["out_channels"], f"{where}.out_channels", 1, limits.MAX_CHANNELS)
                  if ltype == "conv" else c)
            groups = check_groups(p, f.get("groups", 1), c, oc, where) if ltype == "conv" else 1
            spec = LayerSpec(i, lname, ltype, shape, (oc, oh, ow), kernel, stride, pad, act,
                             bias=p.boolean(f["bias"], f"{where}.bias") if ltype == "conv" else True, groups=groups,
                             init=p.choice(f["init"], f"{where}.init", INITS) if ltype == "conv" else "pytorch")
        elif ltype == "fc":
            oc = p.int_in(f["out_features"], f"{where}.out_features", 1, limits.MAX_FEATURES)
            spec = LayerSpec(i, lname, ltype, shape, (oc, 1, 1), (h, w), (1, 1), (0, 0), act,
                             bias=p.boolean(f["bias"], f"{where}.bias"), init=p.choice(f["init"], f"{where}.init", INITS))
        elif ltype in DROPS:
            rate = p.number_in(f["rate"], f"{where}.rate", 0.0, 1.0, open_hi=True)
            spec = LayerSpec(i, lname, ltype, shape, shape, rate=rate)
        elif ltype == "batchnorm":
            if flat:
                p.fail(where, "batchnorm normalizes the channels of an image (BatchNorm2d); it cannot follow an fc layer")
            spec = LayerSpec(i, lname, ltype, shape, shape, activation=act,
                             eps=p.number_in(f["eps"], f"{where}.eps", 1e-12, 1.0),
                             momentum=p.number_in(f["momentum"], f"{where}.momentum", 0.0, 1.0))
        else:  # an activation, softmax_cross_entropy: shape-preserving
            spec = LayerSpec(i, lname, ltype, shape, shape, activation=ltype if ltype in ACTIVATIONS else None)
        for size, what in ((spec.out_shape[0] * spec.out_shape[1] * spec.out_shape[2], "output"),
                           (math.prod(spec.weight_shape or ()), "weight")):
            if size > limits.MAX_TENSOR_FLOATS:
                p.fail(where, f"its {what} tensor has {size} elements per image, more than the "
                       f"{limits.MAX_TENSOR_FLOATS} allowed")
        layers.append(dataclasses.replace(spec, inputs=inputs))
        outputs[lname] = (spec.out_shape, flat or ltype == "fc")
    unused = [l.name for l in layers[:-1] if l.name not in consumed]
    if unused:
        p.fail(f"layers[{[l.name for l in layers].index(unused[0])}]",
               f"the output of layer {unused[0]!r} is not read by any layer (every layer but the last must feed one)")

    if layers[-1].type == "softmax_cross_entropy" and layers[-1].in_shape[1:] != (1, 1):
        p.fail(f"layers[{len(layers) - 1}]", "softmax_cross_entropy needs a vector of logits (put an fc layer "
               f"before it), got a {'x'.join(map(str, layers[-1].in_shape))} tensor")
    weighted = [l for l in layers if l.weighted]
    if not weighted:
        p.fail("layers", "the net has no conv or fc layer")
    if classes is not None:
        last = weighted[-1]
        if last.type != "fc":
            p.fail("classes", f"the last weighted layer {last.name!r} is a {last.type}, not an fc producing {classes} classes")
        if last.out_shape[0] != classes:
            p.fail("classes", f"is {classes} but the last fc layer {last.name!r} has "
                   f"out_features {last.out_shape[0]}")
    need = limits.training_bytes((l.in_shape, l.out_shape, math.prod(l.weight_shape or (0,))) for l in layers)
    bound = limits.max_memory(max_memory)
    if need > bound:
        p.fail("(net)", f"training needs about {limits.format_bytes(need)} at minibatch 1 (weights, gradients, "
               f"momentum, activations), more than the {limits.format_bytes(bound)} allowed; raise the bound "
               f"with --max-memory or {limits.MEMORY_ENV} if this machine has the memory")
    canonical = json.dumps(data, sort_keys=True, separators=(",", ":"))
    return NetSpec(name, shape_in(data), classes, tuple(layers),
                   hashlib.sha256(canonical.encode()).hexdigest())


def check_window(p: Fields, ltype: str, kernel: Any, stride: Any, pad: Any, where: str,
                 size: tuple[int, int]) -> tuple[tuple[int, int], tuple[int, int], tuple[int, int], tuple[int, int]]:
    """(kernel, stride, pad, output size) of a conv or pooling window over a `size` input, each
    checked in its range before any arithmetic (stride None: the kernel). The model front ends
    check what they read with the same function. Pooling windows may cover the whole input
    (global pooling); conv windows are unrolled at their edges in the generated C, so their side
    is bounded."""
    kmax = limits.MAX_KERNEL if ltype == "conv" else limits.MAX_SPATIAL
    k = p.int_pair(kernel, f"{where}.kernel", 1, kmax)
    s = k if stride is None else p.int_pair(stride, f"{where}.stride", 1, max(limits.MAX_STRIDE, kmax))
    pd = p.int_pair(pad, f"{where}.pad", 0, limits.MAX_PAD)
    if ltype in POOLS and (pd[0] >= k[0] or pd[1] >= k[1]):
        p.fail(f"{where}.pad", f"pooling pad {list(pd)} must be smaller than the kernel {list(k)}")
    h, w = size
    oh, ow = limits.out_size(h, k[0], s[0], pd[0]), limits.out_size(w, k[1], s[1], pd[1])
    if oh < 1 or ow < 1:
        p.fail(f"{where}.kernel", f"kernel {list(k)} is larger than the padded input {h + 2 * pd[0]}x{w + 2 * pd[1]}")
    return k, s, pd, (oh, ow)


def _inputs(p: Fields, raw: Any, ltype: str, where: str, previous: str, earlier: set[str]) -> tuple[str, ...]:
    """The layers a layer reads: `inputs` as given (names of earlier layers, or NET_INPUT), else the
    layer before it; add and concat read two or more, every other layer one."""
    joins = ltype in JOINS
    if raw is None:
        if joins:
            p.fail(f"{where}.inputs", f"an {ltype} layer needs its inputs: a list of two or more earlier layers")
        return (previous,)
    if not isinstance(raw, list) or not (2 if joins else 1) <= len(raw) <= (limits.MAX_LAYERS if joins else 1):
        p.fail(f"{where}.inputs", f"must be a list of {'two or more layer names' if joins else 'one layer name'}, "
               f"got {show(raw)}")
    for k, name in enumerate(raw):
        if not isinstance(name, str) or (name != NET_INPUT and name not in earlier):
            p.fail(f"{where}.inputs[{k}]", f"{show(name)} is not an earlier layer (or {NET_INPUT!r}): a net reads "
                   "layers above it, in file order")
        if name == NET_INPUT and earlier:
            p.fail(f"{where}.inputs[{k}]", f"only the first layer reads {NET_INPUT!r} (the net's input)")
        if name in raw[:k]:
            p.fail(f"{where}.inputs[{k}]", f"{name!r} is named twice")
    if ltype == "softmax_cross_entropy" and raw != [previous]:
        p.fail(f"{where}.inputs", f"the loss reads the layer before it ({previous!r})")
    return tuple(raw)


def _join(p: Fields, ltype: str, index: int, name: str, inputs: tuple[str, ...],
          sources: list[tuple[tuple[int, int, int], bool]], act: str | None, where: str) -> LayerSpec:
    """add: inputs of one shape, summed (and the fused activation); concat: inputs of one height and
    width, their channels in order; mul: two inputs, multiplied (joined_shape)."""
    shapes = tuple(s for s, _ in sources)
    for k, (_, flat) in enumerate(sources):
        if flat:
            p.fail(f"{where}.inputs[{k}]", f"{inputs[k]!r} is a vector (after an fc layer): {ltype} joins images")
    if ltype == "mul":
        out = joined_shape(ltype, shapes)
        if out is None:
            p.fail(f"{where}.inputs", f"inputs of shapes {' and '.join('x'.join(map(str, s)) for s in shapes)}: "
                   f"mul takes {JOIN_NEEDS['mul']}")
        return LayerSpec(index, name, ltype, out, out, activation=act, in_shapes=shapes)
    for k, (s, _) in enumerate(sources):
        if (s if ltype == "add" else s[1:]) != (shapes[0] if ltype == "add" else shapes[0][1:]):
            what = "shape" if ltype == "add" else "height and width"
            p.fail(f"{where}.inputs[{k}]", f"{inputs[k]!r} has {what} {'x'.join(map(str, s))}, "
                   f"{inputs[0]!r} {'x'.join(map(str, shapes[0]))}: {ltype} needs the same {what}")
    out = shapes[0] if ltype == "add" else (sum(s[0] for s in shapes), *shapes[0][1:])
    if out[0] > limits.MAX_CHANNELS:
        p.fail(where, f"{out[0]} channels, more than the {limits.MAX_CHANNELS} allowed")
    return LayerSpec(index, name, ltype, out, out, activation=act, in_shapes=shapes)


def check_groups(p: Fields, groups: Any, channels: int, out_channels: int, where: str) -> int:
    """A convolution's groups: 1, or depthwise (groups = input channels = output channels: each
    channel convolved with its own window, as PyTorch's Conv2d(C, C, k, groups=C)). Grouped
    convolutions of several channels a group, and depthwise ones with a channel multiplier, are
    refused by name."""
    g = p.int_in(groups, f"{where}.groups", 1, limits.MAX_CHANNELS)
    if g == 1 or g == channels == out_channels:
        return g
    if channels % g or out_channels % g:
        p.fail(f"{where}.groups", f"{g} groups must divide the {channels} input and {out_channels} output channels")
    what = (f"a channel multiplier of {out_channels // g}" if g == channels else
            f"{channels // g} input channels a group")
    return p.fail(f"{where}.groups", f"{g} groups with {what} is not supported: groups must be 1, or equal the input and "
           f"output channels ({channels}) for a depthwise convolution")


def shape_in(data: dict) -> tuple[int, int, int]:
    inp = data["input"]
    return (inp["channels"], inp["height"], inp["width"])


class _Parser(Fields):
    """Net-description checks on top of the shared typed field checks."""

    def name(self, value: Any, where: str) -> str:
        return self.string(value, where, NAME_RE, "letters, digits, underscore; it becomes a C identifier "
                           "and a file name")

    def activation(self, value: Any, layer_type: str, where: str) -> str | None:
        """A layer's fused `activation`: a name of the table that fuses into this layer type."""
        if value is None:
            return None
        if not any(value == a for a in ACTIVATIONS if isinstance(value, str)):
            self.fail(where, f"must be one of {', '.join(ACTIVATIONS)} or absent, got {show(value)}")
        act = ACTIVATIONS[value]
        if layer_type not in act.fuses_into:
            self.fail(where, f"{value} is fused into {', '.join(sorted(act.fuses_into))} layers only; after a "
                      f"{layer_type} put a {value} layer")
        return act.name
