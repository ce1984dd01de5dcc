"""Models from other frameworks -> a net description and its weights: the part the PyTorch and
ONNX front ends share. A front end turns its graph into a chain of `Op`s (and a list of what it
could not translate); `net_from_ops` checks them against what net.json expresses, names the
layers after the framework's own names, fuses each activation into the layer before it where it
may, appends the loss and returns (net dict, state dict) that `parse_netspec` accepts and
`Net.load_state_dict` loads."""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pcldnn_runtime import limits
from pcldnn_runtime.activations import ACTIVATIONS
from pcldnn_runtime.layer_types import DROPS, JOIN_NEEDS, JOINS, joined_shape
from pcldnn_runtime.validate import Fields, show

from .errors import ModelImportError, NetSpecError
from .netspec import check_groups, check_window, parse_netspec

OP_KINDS = ("conv", "fc", "batchnorm", "maxpool", "avgpool", *ACTIVATIONS, *DROPS, *JOINS, "flatten",
            "softmax", "identity")
INPUT = "<input>"  # the tensor name of the model's input in Op.inputs


@dataclass(frozen=True)
class Op:
    """One node of the framework's graph, in net.json's terms."""
    kind: str                       # one of OP_KINDS
    source: str                     # the framework's name of the module or node
    type_name: str                  # the framework's type (Conv2d, Gemm, ...), for messages
    attrs: dict[str, Any] = field(default_factory=dict)  # kernel / stride / pad pairs, rate
    weight: np.ndarray | None = None  # conv (OC, IC, KH, KW), fc (OC, IC), batchnorm (C,): canonical layouts
    bias: np.ndarray | None = None
    running: tuple[np.ndarray, np.ndarray, int] | None = None  # batchnorm: running mean, variance, batch count
    tensor: str = ""                # the framework's name of the tensor it makes ("": the op's position)
    inputs: tuple[str, ...] = ()    # the tensors it reads, INPUT for the model's input (none: the previous op's)

    @property
    def label(self) -> str:
        return f"{printable(self.source)} ({printable(self.type_name)})"


def printable(text: Any, limit: int = 80) -> str:
    """A framework's name as it goes into an error line: itself when printable and short, else
    quoted with escapes (a node named "a\nb" must not break the one-line error)."""
    text = str(text)
    return text if text.isprintable() and len(text) <= limit else show(text, limit)


def fail_unsupported(framework: str, problems: list[str], supported: str = "") -> None:
    """One error listing every node the front end could not translate (then what it supports)."""
    if problems:
        raise ModelImportError(f"{framework}: {len(problems)} unsupported node(s): " + "; ".join(problems)
                               + (f". Supported: {supported}" if supported else ""))


def input_shape_of(shape: Any, origin: str = "from_torch") -> tuple[int, int, int]:
    """(C, H, W) as three ints within net.json's ranges; an error names `origin`."""
    try:
        c, h, w = (int(v) for v in shape)
        ok = tuple(shape) == (c, h, w)
    except (TypeError, ValueError):
        ok = False
    if not ok or not (1 <= c <= limits.MAX_CHANNELS and 1 <= h <= limits.MAX_SPATIAL and 1 <= w <= limits.MAX_SPATIAL):
        raise ModelImportError(f"{origin}: input_shape must be (C, H, W), three positive ints within net.json's "
                               f"ranges, got {show(shape if not isinstance(shape, tuple) else list(shape))}")
    return c, h, w


def layer_name(source: str, taken: set[str]) -> str:
    """A net.json name for a framework name: `features.0` -> `features_0`, unique in `taken`."""
    base = re.sub(r"[^A-Za-z0-9_]", "_", source).strip("_")[:56]
    if not base or not (base[0].isalpha() or base[0] == "_"):
        base = f"layer_{base}"[:56]
    name, i = base, 2
    while name in taken:
        name, i = f"{base}_{i}", i + 1
    taken.add(name)
    return name


def _listed(value: Any) -> Any:
    """A framework's (h, w) tuple as the list net.json's checks take, numpy scalars as Python
    numbers (np.int64(3) is a kernel side; 3.0 is not); anything else as it is."""
    value = list(value) if isinstance(value, tuple) else value
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return _plain(value)


def _plain(value: Any) -> Any:
    return value.item() if isinstance(value, (np.integer, np.floating)) else value


def _finite(array: np.ndarray, what: str, problems: list[str]) -> np.ndarray:
    array = np.ascontiguousarray(array, dtype=np.float32)
    if not np.isfinite(array).all():
        problems.append(f"{what}: holds NaN or infinity")
    return array


def net_from_ops(ops: list[Op], input_shape: tuple[int, int, int], name: str, origin: str,
                 loss: bool = True) -> tuple[dict, dict[str, np.ndarray]]:
    """The graph of ops (in a topological order: each reads tensors made before it) as (net dict,
    state): every op checked, every problem reported at once. An op's `inputs` name the tensors
    it reads (none: the previous op's); identity and flatten pass their input on, an activation
    after a layer whose output nothing else reads is fused into it where activations.py allows."""
    problems: list[str] = []
    layers: list[dict] = []
    state: dict[str, np.ndarray] = {}
    taken: set[str] = set()
    # each tensor: the layer that makes it ("input": the net's), its shape, whether it is a vector
    tensors: dict[str, tuple[str, tuple[int, int, int], bool]] = {INPUT: ("input", input_shape, False)}
    readers: dict[str, int] = {}
    previous = INPUT
    for i, op in enumerate(ops):
        for t in op.inputs or (previous,):
            readers[t] = readers.get(t, 0) + 1
        previous = op.tensor or f"#{i}"
    previous = INPUT
    for i, op in enumerate(ops):
        ins = op.inputs or (previous,)
        previous = op.tensor or f"#{i}"
        missing = [t for t in ins if t not in tensors]
        if missing:  # its producer was refused: reported there
            continue
        maker, (c, h, w), flat = tensors[ins[0]]
        if op.kind == "identity":
            tensors[previous] = tensors[ins[0]]
            continue
        if op.kind == "flatten":
            tensors[previous] = (maker, (c, h, w), True)
            continue
        if op.kind == "softmax":
            if any(o.kind not in ("identity", "flatten") for o in ops[i + 1:]):
                problems.append(f"{op.label}: a softmax is supported only as the last node (the loss replaces it)")
            tensors[previous] = tensors[ins[0]]
            continue
        last: dict[str, Any] = layers[-1] if layers else {"name": "input", "type": "input"}
        fusable = maker == last["name"] and readers.get(ins[0], 0) == 1 and "activation" not in last
        if fusable and op.kind in ACTIVATIONS and last["type"] in ACTIVATIONS[op.kind].fuses_into:
            last["activation"] = op.kind  # (where the table says it fuses: a ReLU6 into a batchnorm only)
            tensors[previous] = tensors[ins[0]]
            continue
        layer: dict[str, Any] = {"name": layer_name(op.source, taken), "type": op.kind}
        makers = [tensors[t][0] for t in ins]
        if makers != [last["name"]]:
            layer["inputs"] = makers
        if op.kind in JOINS:
            shapes = tuple(tensors[t][1] for t in ins)
            if any(tensors[t][2] for t in ins):
                problems.append(f"{op.label}: joins vectors (after a flatten); only images")
                continue
            joined = joined_shape(op.kind, shapes)
            if joined is None:
                verb = {"add": "added", "concat": "concatenated along the channels", "mul": "multiplied"}[op.kind]
                problems.append(f"{op.label}: inputs of shapes {[list(s) for s in shapes]} cannot be {verb} "
                                f"({op.kind} takes {JOIN_NEEDS[op.kind]})")
                continue
            c, h, w = joined
        elif op.kind in ("conv", "maxpool", "avgpool"):
            if flat:
                problems.append(f"{op.label}: follows a flatten (its input is a vector)")
                continue
            if "adaptive" in op.attrs:  # an adaptive average pool: a plain one when the size divides
                adaptive = _listed(op.attrs["adaptive"])
                if not isinstance(adaptive, list) or len(adaptive) != 2 or not all(
                        v is None or (type(v) is int and 1 <= v <= limits.MAX_SPATIAL) for v in adaptive):
                    problems.append(f"{op.label}: output size {show(adaptive)} (two positive ints or None)")
                    continue
                oh, ow = (size or dim for size, dim in zip(adaptive, (h, w)))
                if h % oh or w % ow:
                    problems.append(f"{op.label}: output size {oh}x{ow} does not divide the {h}x{w} input")
                    continue
                op = Op(op.kind, op.source, op.type_name, {"kernel": (h // oh, w // ow), "stride": (h // oh, w // ow),
                                                           "pad": (0, 0)})
            a = op.attrs  # a stride of None is net.json's "as the kernel": a framework's None is no stride
            kernel, stride, pad, (oh, ow) = check_window(
                Fields(origin, ModelImportError), op.kind, _listed(a.get("kernel")),
                [None, None] if a.get("stride") is None else _listed(a["stride"]),
                _listed(a.get("pad")), op.label, (h, w))
            layer |= {"kernel": list(kernel), "stride": list(stride), "pad": list(pad)}
            if op.kind == "conv":
                assert op.weight is not None
                if op.weight.ndim != 4:
                    problems.append(f"{op.label}: weight of shape {op.weight.shape}, expected (OC, IC, KH, KW)")
                    continue
                oc, ic = op.weight.shape[:2]
                groups = check_groups(Fields(origin, ModelImportError), _plain(a.get("groups", 1)), c, oc, op.label)
                if ic * groups != c or tuple(op.weight.shape[2:]) != tuple(kernel):
                    problems.append(f"{op.label}: weight shape {op.weight.shape} does not fit a {c}-channel input, "
                                    f"{groups} group(s) and kernel {list(kernel)}")
                    continue
                layer["out_channels"] = oc
                if groups > 1:
                    layer["groups"] = groups
                c = oc
            h, w = oh, ow
        elif op.kind == "fc":
            assert op.weight is not None
            if not flat and (h, w) != (1, 1):
                problems.append(f"{op.label}: applied to a {c}x{h}x{w} tensor without a flatten before it (PyTorch's "
                                "Linear would act on the last dimension only)")
                continue
            if op.weight.ndim != 2:
                problems.append(f"{op.label}: weight of shape {op.weight.shape}, expected (out, in) features")
                continue
            oc, features = op.weight.shape
            if features != c * h * w:
                problems.append(f"{op.label}: takes {features} input features, the tensor before it has {c * h * w}")
                continue
            layer["out_features"] = oc
            c, h, w, flat = oc, 1, 1, True
        elif op.kind == "batchnorm":
            if flat:
                problems.append(f"{op.label}: follows a flatten (BatchNorm1d on vectors is not supported)")
                continue
            fields = Fields(origin, ModelImportError)
            layer["eps"] = fields.number_in(_plain(op.attrs["eps"]), f"{op.label}.eps", 1e-12, 1.0)
            layer["momentum"] = fields.number_in(_plain(op.attrs["momentum"]), f"{op.label}.momentum", 0.0, 1.0)
            assert op.weight is not None and op.bias is not None and op.running is not None
            if any(np.shape(a) != (c,) for a in (op.weight, op.bias, *op.running[:2])):
                problems.append(f"{op.label}: scale, shift and running statistics must each have {c} values "
                                f"(the {c} channels before it)")
                continue
            mean, var, count = op.running
            if (np.asarray(var) < 0).any():
                problems.append(f"{op.label}: a negative running variance")
                continue
            state[f"{layer['name']}.running_mean"] = _finite(mean, f"{op.label} running_mean", problems)
            state[f"{layer['name']}.running_var"] = _finite(var, f"{op.label} running_var", problems)
            state[f"{layer['name']}.num_batches_tracked"] = np.array(
                fields.int_in(_plain(count), f"{op.label}.num_batches_tracked", 0, 2 ** 24 - 1), dtype=np.int64)
        elif op.kind in DROPS:
            layer["rate"] = Fields(origin, ModelImportError).number_in(_plain(op.attrs["rate"]), f"{op.label}.rate",
                                                                       0, 1, open_hi=True)
        elif op.kind not in ACTIVATIONS:
            raise AssertionError(op.kind)
        if op.weight is not None:
            state[f"{layer['name']}.weight"] = _finite(op.weight, f"{op.label} weight", problems)
            if op.bias is None:
                layer["bias"] = False  # kept at zero and not trained, as the framework's layer
            elif np.shape(op.bias) != (op.weight.shape[0],):
                problems.append(f"{op.label}: bias of shape {np.shape(op.bias)}, expected ({op.weight.shape[0]},)")
            else:
                state[f"{layer['name']}.bias"] = _finite(op.bias, f"{op.label} bias", problems)
        # informational, but checked like any net.json text: escaped when not printable
        layer["source"] = (op.source if op.source.isprintable() else op.source.encode("unicode_escape").decode())[:200]
        layers.append(layer)
        tensors[previous] = (layer["name"], (c, h, w), flat)
    fail_unsupported(origin, problems)
    weighted = [layer for layer in layers if layer["type"] in ("conv", "fc")]
    if not weighted:
        raise ModelImportError(f"{origin}: the model has no convolution or linear layer")
    net: dict[str, Any] = {"name": name, "input": {"channels": input_shape[0], "height": input_shape[1],
                                                   "width": input_shape[2]}}
    c, h, w = tensors[previous][1] if previous in tensors else (0, 0, 0)
    if previous in tensors and tensors[previous][0] != layers[-1]["name"]:
        raise ModelImportError(f"{origin}: the model's result is not its last layer's output")
    if loss:
        if weighted[-1]["type"] != "fc" or (c, h, w) != (weighted[-1]["out_features"], 1, 1):
            raise ModelImportError(f"{origin}: the model must end with a linear layer (the logits the loss "
                                   "reads), optionally followed by an activation, dropout or softmax")
        net["classes"] = weighted[-1]["out_features"]
        layers.append({"name": layer_name("loss", taken), "type": "softmax_cross_entropy"})
    net["layers"] = layers
    try:
        parse_netspec(net, origin)  # what the front end made is a valid description, or one clear error
    except NetSpecError as e:  # name the model's node, not the layer index of a file the user never saw
        raise ModelImportError(re.sub(r"layers\[(\d+)\]", lambda m: _node_of(layers, int(m.group(1))), str(e))) from None
    return net, state


def _node_of(layers: list[dict], index: int) -> str:
    source = layers[index].get("source") if 0 <= index < len(layers) else None
    return f"layers[{index}] (node {source})" if source else f"layers[{index}]"


def model_name(name: str | None, fallback: str) -> str:
    """The net's name: the one given (checked), else the model's own, made a valid name."""
    if name is not None:
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]{0,63}", name):
            raise ModelImportError(f"name must match [A-Za-z_][A-Za-z0-9_]{{0,63}}, got {name!r}")
        return name
    return layer_name(fallback or "model", set())


def source_state(net: dict, state: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A state dict keyed by the framework's names (each layer's `source`): what the original
    model's load_state_dict takes back (`features_0.weight` -> `features.0.weight`)."""
    sources = {layer["name"]: layer.get("source") for layer in net.get("layers", [])}
    out = {}
    for key, value in state.items():
        name, part = key.rsplit(".", 1)
        if not sources.get(name):
            raise ModelImportError(f"source_state: layer {name!r} has no source name in the net description")
        out[f"{sources[name]}.{part}"] = value
    return out
