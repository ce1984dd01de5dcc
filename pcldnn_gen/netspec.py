"""net.json → NetSpec: validate the network description and infer every layer's shapes.

Every error names the file and the JSON path of the offending value, so a user can fix a
hand-written description without reading our source. Names are checked against a strict
pattern because they become C identifiers and file names in the build directory.
"""
from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import NetSpecError

NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")

# Fields each layer type takes: required, and optional with their defaults.
_COMMON = {"name", "type"}
LAYER_FIELDS: dict[str, tuple[set[str], dict[str, Any]]] = {
    "conv": ({"out_channels", "kernel"}, {"stride": 1, "pad": 0, "activation": None}),
    "fc": ({"out_features"}, {"activation": None}),
    "maxpool": ({"kernel"}, {"stride": None, "pad": 0}),
    "avgpool": ({"kernel"}, {"stride": None, "pad": 0}),
    "relu": (set(), {}),
    "dropout": (set(), {"rate": 0.5}),
    "softmax_cross_entropy": (set(), {}),
}
WEIGHTED = ("conv", "fc")
POOLS = ("maxpool", "avgpool")
ACTIVATIONS = ("relu",)


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
    relu: bool = False
    rate: float = 0.0  # dropout probability (dropout layers only)

    @property
    def weighted(self) -> bool:
        return self.type in WEIGHTED

    @property
    def weight_shape(self) -> tuple[int, ...] | None:
        """Canonical weight shape: conv (OC, IC, KH, KW), fc (OC, IC)."""
        oc, ic = self.out_shape[0], self.in_shape[0]
        if self.type == "conv":
            return (oc, ic, *self.kernel)
        if self.type == "fc":
            return (oc, ic * self.in_shape[1] * self.in_shape[2])
        return None

    def flops(self, batch: int) -> int:
        """Multiply-adds × 2 of the forward pass (same count for each backward pass)."""
        if not self.weighted:
            return 0
        oc, oh, ow = self.out_shape
        return 2 * batch * oc * oh * ow * self.in_shape[0] * self.kernel[0] * self.kernel[1]


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


def load_netspec(path: str | Path) -> NetSpec:
    """Read and validate a net.json file."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise NetSpecError(f"{path}: cannot read: {e.strerror or e}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise NetSpecError(f"{path}: invalid JSON at line {e.lineno}, column {e.colno}: {e.msg}") from None
    return parse_netspec(data, str(path))


def parse_netspec(data: Any, origin: str = "<net>") -> NetSpec:
    """Validate an already-parsed description; `origin` names it in error messages."""
    p = _Parser(origin)
    p.expect_object(data, "", {"name", "input", "layers"}, {"classes"})
    name = p.name(data["name"], "name")
    inp = data["input"]
    p.expect_object(inp, "input", {"channels", "height", "width"}, set())
    shape = tuple(p.positive_int(inp[k], f"input.{k}") for k in ("channels", "height", "width"))
    classes = data.get("classes")
    if classes is not None:
        classes = p.positive_int(classes, "classes")
    layers_raw = data["layers"]
    if not isinstance(layers_raw, list) or not layers_raw:
        p.fail("layers", f"must be a non-empty list of layers, got {_show(layers_raw)}")

    layers: list[LayerSpec] = []
    seen: set[str] = set()
    flat = False  # once an fc layer ran, activations are vectors
    for i, raw in enumerate(layers_raw):
        where = f"layers[{i}]"
        if not isinstance(raw, dict):
            p.fail(where, f"must be an object, got {_show(raw)}")
        ltype = raw.get("type")
        if ltype not in LAYER_FIELDS:
            p.fail(f"{where}.type", f"unknown layer type {_show(ltype)}; known: {', '.join(LAYER_FIELDS)}")
        required, optional = LAYER_FIELDS[ltype]
        p.expect_object(raw, where, _COMMON | required, set(optional))
        lname = p.name(raw["name"], f"{where}.name")
        if lname in seen:
            p.fail(f"{where}.name", f"duplicate layer name {lname!r}")
        seen.add(lname)
        f = {**optional, **raw}
        c, h, w = shape
        if ltype == "softmax_cross_entropy" and i != len(layers_raw) - 1:
            p.fail(where, "softmax_cross_entropy must be the last layer")
        if ltype in ("conv", *POOLS) and flat:
            p.fail(where, f"{ltype} cannot follow an fc layer (its input is a flat vector)")
        relu = p.activation(f.get("activation"), f"{where}.activation")

        if ltype == "conv" or ltype in POOLS:
            kernel = p.pair(f["kernel"], f"{where}.kernel", positive=True)
            stride = kernel if f["stride"] is None else p.pair(f["stride"], f"{where}.stride", positive=True)
            pad = p.pair(f["pad"], f"{where}.pad", positive=False)
            oh = _out_size(h, kernel[0], stride[0], pad[0])
            ow = _out_size(w, kernel[1], stride[1], pad[1])
            if oh < 1 or ow < 1:
                p.fail(f"{where}.kernel", f"kernel {list(kernel)} is larger than the padded input "
                       f"{h + 2 * pad[0]}x{w + 2 * pad[1]}")
            if ltype in POOLS and (pad[0] >= kernel[0] or pad[1] >= kernel[1]):
                p.fail(f"{where}.pad", f"pooling pad {list(pad)} must be smaller than the kernel {list(kernel)}")
            oc = p.positive_int(f["out_channels"], f"{where}.out_channels") if ltype == "conv" else c
            spec = LayerSpec(i, lname, ltype, shape, (oc, oh, ow), kernel, stride, pad, relu)
        elif ltype == "fc":
            oc = p.positive_int(f["out_features"], f"{where}.out_features")
            spec = LayerSpec(i, lname, ltype, shape, (oc, 1, 1), (h, w), (1, 1), (0, 0), relu)
            flat = True
        elif ltype == "dropout":
            rate = f["rate"]
            if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0 <= rate < 1:
                p.fail(f"{where}.rate", f"must be a number in [0, 1), got {_show(rate)}")
            spec = LayerSpec(i, lname, ltype, shape, shape, rate=float(rate))
        else:  # relu, softmax_cross_entropy: shape-preserving
            spec = LayerSpec(i, lname, ltype, shape, shape, relu=(ltype == "relu"))
        layers.append(spec)
        shape = spec.out_shape

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
    canonical = json.dumps(data, sort_keys=True, separators=(",", ":"))
    return NetSpec(name, shape_in(data), classes, tuple(layers),
                   hashlib.sha256(canonical.encode()).hexdigest())


def shape_in(data: dict) -> tuple[int, int, int]:
    inp = data["input"]
    return (inp["channels"], inp["height"], inp["width"])


def _out_size(size: int, kernel: int, stride: int, pad: int) -> int:
    return (size + 2 * pad - kernel) // stride + 1


def _show(value: Any) -> str:
    return json.dumps(value) if _jsonable(value) else repr(value)


def _jsonable(value: Any) -> bool:
    try:
        json.dumps(value)
        return True
    except (TypeError, ValueError):
        return False


class _Parser:
    """Small typed checks that raise NetSpecError with '<file>: <json path>: <problem>'."""

    def __init__(self, origin: str):
        self.origin = origin

    def fail(self, where: str, problem: str):
        raise NetSpecError(f"{self.origin}: {where or '(top level)'}: {problem}")

    def expect_object(self, value: Any, where: str, required: set[str], optional: set[str]) -> None:
        if not isinstance(value, dict):
            self.fail(where, f"must be an object, got {_show(value)}")
        for key in sorted(required):
            if key not in value:
                self.fail(_join(where, key), "missing required field")
        for key in value:
            if key not in required and key not in optional:
                allowed = ", ".join(sorted(required | optional))
                self.fail(_join(where, key), f"unknown field (allowed: {allowed})")

    def positive_int(self, value: Any, where: str) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            self.fail(where, f"must be a positive int, got {_show(value)}")
        return value

    def pair(self, value: Any, where: str, positive: bool) -> tuple[int, int]:
        lo = 1 if positive else 0
        kind = "a positive int" if positive else "a non-negative int"

        def ok(v: Any) -> bool:
            return isinstance(v, int) and not isinstance(v, bool) and v >= lo

        if ok(value):
            return (value, value)
        if isinstance(value, list) and len(value) == 2 and all(ok(v) for v in value):
            return (value[0], value[1])
        self.fail(where, f"must be {kind} or [h, w], got {_show(value)}")

    def name(self, value: Any, where: str) -> str:
        if not isinstance(value, str) or not NAME_RE.match(value):
            self.fail(where, f"must match {NAME_RE.pattern} (letters, digits, underscore; "
                      f"it becomes a C identifier and a file name), got {_show(value)}")
        return value

    def activation(self, value: Any, where: str) -> bool:
        if value is None:
            return False
        if value not in ACTIVATIONS:
            self.fail(where, f"must be one of {', '.join(ACTIVATIONS)} or absent, got {_show(value)}")
        return True


def _join(where: str, key: str) -> str:
    return f"{where}.{key}" if where else key
