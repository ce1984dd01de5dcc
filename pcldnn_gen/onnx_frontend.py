"""ONNX models -> net description + weights (`pcldnn-gen import MODEL.onnx -o NET.json`). The
`onnx` package is an optional extra, imported on call. A model is a chain from its one image
input to its logits: Conv, Gemm (or MatMul with an Add of its bias), MaxPool, AveragePool,
GlobalAveragePool, Relu, Clip to [0, 6], SiLU (Mul of Sigmoid) and GELU (its erf form, or Gelu),
Dropout, Flatten or Reshape to (N, -1), Identity, and a final Softmax or
LogSoftmax; weights come from initializers or Constant nodes. Every node that does not fit is
listed in one error."""
from __future__ import annotations

import dataclasses
import json
import math
import os
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pcldnn_runtime import limits
from pcldnn_runtime.onnx_conventions import ONNX_ACTIVATIONS, momentum_from_onnx, pads_from_onnx
from pcldnn_runtime.validate import check_writable, read_bounded, remove_stale_temporaries, show

from .errors import ModelImportError, PcldnnError
from .frontend import INPUT, Op, fail_unsupported, input_shape_of, model_name, net_from_ops, printable

MAX_MODEL_BYTES = 4 * 1024 ** 3  # a protobuf cannot exceed 2 GiB without external data anyway
MIN_OPSET = 7  # the oldest opset whose operator forms the translation below reads (opset 7 dropped is_test etc.)


def import_onnx(path: str | Path, name: str | None = None) -> tuple[dict, dict[str, np.ndarray]]:
    """(net dict, state) of the ONNX model at `path`."""
    try:
        import onnx
        import onnx.numpy_helper
    except ImportError:
        raise ModelImportError("importing ONNX needs the onnx package (pip install 'pcldnn-gen[onnx]')") from None
    path = Path(path)
    data = read_bounded(path, MAX_MODEL_BYTES, ModelImportError)
    try:
        model = onnx.load_model_from_string(data)
    except Exception as e:  # protobuf's DecodeError and friends: not an ONNX file
        raise ModelImportError(f"{path}: not an ONNX model ({type(e).__name__})") from None
    origin = str(path)
    _check_tensors(model.graph, origin, onnx)  # before the checker or anything else reads a tensor
    _check_opsets(model, origin, onnx)
    try:
        onnx.checker.check_model(model)
    except Exception as e:
        raise ModelImportError(f"{path}: invalid ONNX model: {str(e).splitlines()[0][:300]}") from None
    try:
        return _translate(model, path, name, onnx)
    except PcldnnError:
        raise
    except Exception as e:  # a defect the checks above did not foresee: still one line naming the file
        raise ModelImportError(f"{path}: cannot import ({type(e).__name__}: {str(e)[:200]})") from None


def _translate(model: Any, path: Path, name: str | None, onnx: Any) -> tuple[dict, dict[str, np.ndarray]]:
    graph, origin = model.graph, str(path)
    floats = sum(math.prod(max(d, 0) for d in t.dims) for t in graph.initializer)
    if floats * 4 > limits.max_memory():  # as float32 weights, before any is converted
        raise ModelImportError(f"{path}: initializers of {floats} values, more than the "
                               f"{limits.format_bytes(limits.max_memory())} memory bound ({limits.MEMORY_ENV})")
    constants = {t.name: load_tensor(t, f"initializer {t.name!r}", origin, onnx) for t in graph.initializer}
    for node in graph.node:
        if node.op_type == "Constant" and node.output:
            value = _constant_value(node, origin, onnx)
            if value is not None:
                constants[node.output[0]] = value
    inputs = [i for i in graph.input if i.name not in constants]
    if len(inputs) != 1:
        raise ModelImportError(f"{path}: the model must take one image input, it takes {len(inputs)}")
    kind = inputs[0].type.tensor_type.elem_type
    if kind not in (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.DOUBLE,
                    onnx.TensorProto.BFLOAT16):
        raise ModelImportError(f"{path}: input {printable(inputs[0].name)} must be a float tensor of images")
    dims = inputs[0].type.tensor_type.shape.dim
    if len(dims) != 4 or not all(d.HasField("dim_value") for d in dims[1:]):
        raise ModelImportError(f"{path}: input {inputs[0].name!r} must be (N, C, H, W) with C, H, W known")
    shape = input_shape_of([d.dim_value for d in dims[1:]], f"{origin}: input {printable(inputs[0].name)}")
    ops = _ops(graph, constants, inputs[0].name, origin, onnx)
    return net_from_ops(ops, shape, model_name(name, graph.name or path.stem), origin)


# Every TensorProto of a model, wherever it sits: the initializers, sparse initializers, and the
# tensor-valued attributes of every node, subgraphs (If / Loop / Scan bodies) included.
def _all_tensors(graph: Any, where: str, onnx: Any) -> Iterator[tuple[Any, str]]:
    for t in graph.initializer:
        yield t, f"{where}initializer {t.name!r}"
    for st in graph.sparse_initializer:
        yield st, f"{where}sparse initializer {st.values.name!r}"
    A = onnx.AttributeProto
    for k, node in enumerate(graph.node):
        label = f"{where}node {node.name or node.op_type + '_' + str(k)!r}"
        for a in node.attribute:
            at = f"{label} attribute {a.name!r}"
            if a.type == A.TENSOR:
                yield a.t, at
            elif a.type == A.TENSORS:
                yield from ((t, at) for t in a.tensors)
            elif a.type == A.SPARSE_TENSOR:
                yield a.sparse_tensor, at
            elif a.type == A.SPARSE_TENSORS:
                yield from ((t, at) for t in a.sparse_tensors)
            elif a.type == A.GRAPH:
                yield from _all_tensors(a.g, f"{at}: ", onnx)
            elif a.type == A.GRAPHS:
                for g in a.graphs:
                    yield from _all_tensors(g, f"{at}: ", onnx)


def _check_tensors(graph: Any, origin: str, onnx: Any) -> None:
    """The one policy for every tensor of the model: its data is inside the file. An external
    location ("secret.bin") would be read relative to the working directory or the model's
    folder: a model file must not make the importer read other files."""
    for tensor, what in _all_tensors(graph, "", onnx):
        parts = (tensor.values, tensor.indices) if isinstance(tensor, onnx.SparseTensorProto) else (tensor,)
        for t in parts:
            if t.data_location == onnx.TensorProto.EXTERNAL or len(t.external_data):
                raise ModelImportError(f"{origin}: {what} is stored in an external file; save the model with its "
                                       "weights inside (onnx.save(model, path, save_as_external_data=False))")


def _check_opsets(model: Any, origin: str, onnx: Any) -> None:
    """The default domain's opset in the range this onnx package defines; no other domain."""
    newest = onnx.defs.onnx_opset_version()
    for opset in model.opset_import:
        if opset.domain in ("", "ai.onnx"):
            if not MIN_OPSET <= opset.version <= newest:
                raise ModelImportError(f"{origin}: opset_import: ai.onnx version {opset.version} is outside "
                                       f"[{MIN_OPSET}, {newest}] (the versions this onnx package defines)")
        elif any(n.domain == opset.domain for n in model.graph.node):
            raise ModelImportError(f"{origin}: operators of domain {show(opset.domain)} are not supported")


# ONNX element types that hold plain numbers (TensorProto.DataType values by name).
NUMERIC_TYPES = ("FLOAT", "DOUBLE", "FLOAT16", "BFLOAT16", "INT8", "INT16", "INT32", "INT64", "UINT8", "UINT16",
                 "UINT32", "UINT64", "BOOL")


def load_tensor(tensor: Any, what: str, origin: str, onnx: Any) -> np.ndarray:
    """A dense tensor of plain numbers as an array: its type, dims and the element count checked
    before numpy_helper allocates anything (the data must be inside the file: _check_tensors)."""
    names = {getattr(onnx.TensorProto, n) for n in NUMERIC_TYPES}
    if tensor.data_type not in names:
        kind = onnx.TensorProto.DataType.Name(tensor.data_type) if tensor.data_type in \
            onnx.TensorProto.DataType.values() else str(tensor.data_type)
        raise ModelImportError(f"{origin}: {what}: element type {kind}, expected numbers")
    dims = list(tensor.dims)
    if any(d < 0 for d in dims) or len(dims) > 8:
        raise ModelImportError(f"{origin}: {what}: dims {dims[:9]} (at most 8 non-negative sizes)")
    count = math.prod(dims)
    if count > limits.MAX_TENSOR_FLOATS:
        raise ModelImportError(f"{origin}: {what}: {count} elements, more than the {limits.MAX_TENSOR_FLOATS} allowed")
    try:
        array = onnx.numpy_helper.to_array(tensor)
    except Exception as e:  # data shorter or longer than the dims claim, a corrupt encoding
        raise ModelImportError(f"{origin}: {what}: unreadable data ({type(e).__name__}: {str(e)[:120]})") from None
    if array.size != count:
        raise ModelImportError(f"{origin}: {what}: holds {array.size} values, its dims {dims} claim {count}")
    return array


def _constant_value(node: Any, origin: str, onnx: Any) -> np.ndarray | None:
    """A Constant node's value as an array (its numbers go through load_tensor); None for a
    form that holds no numbers (strings: nothing of ours can use them)."""
    what = f"Constant node {node.name or node.output[0]!r}"
    for a in node.attribute:
        if a.name == "value":
            return load_tensor(a.t, what, origin, onnx)
        if a.name == "value_float":
            return np.array(a.f, np.float32)
        if a.name == "value_floats":
            return np.array(list(a.floats), np.float32)
        if a.name == "value_int":
            return np.array(a.i, np.int64)
        if a.name == "value_ints":
            return np.array(list(a.ints), np.int64)
        if a.name == "sparse_value":
            raise ModelImportError(f"{origin}: {what}: sparse tensors are not supported (store it dense)")
    return None


def _attrs(node: Any, onnx: Any) -> dict[str, Any]:
    return {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}


def _ints(a: dict, name: str, default: list[int]) -> list[int]:
    """An INTS attribute (or its default): a list of ints, else the node is refused."""
    value = a.get(name, default)
    if not isinstance(value, list) or not all(isinstance(v, int) for v in value):
        raise _Unsupported(f"{name} {show(value)} (a list of ints)")
    return value


def _int(a: dict, name: str, default: int) -> int:
    value = a.get(name, default)
    if type(value) is not int:
        raise _Unsupported(f"{name} {show(value)} (an int)")
    return value


def _float(a: dict, name: str, default: float) -> np.float32:
    value = a.get(name, default)
    if type(value) not in (int, float) or not math.isfinite(value) or abs(value) > 1e30:
        raise _Unsupported(f"{name} {show(value)} (a finite number)")
    return np.float32(value)


def _symmetric(pads: list[int]) -> list[int]:
    ours = pads_from_onnx(pads)
    if ours is None:
        raise _Unsupported(f"pads {pads} (only symmetric: [top, left, top, left])")
    return list(ours)


def _window(a: dict, kernel_from: Any = None) -> dict[str, Any]:
    """kernel / stride / pad as read: the shared front end checks their ranges, naming the node."""
    kernel = _ints(a, "kernel_shape", [int(k) for k in kernel_from] if kernel_from is not None else [])
    if len(kernel) != 2:
        raise _Unsupported(f"kernel_shape {kernel} (only 2-D)")
    if a.get("auto_pad", b"NOTSET") not in (b"NOTSET", "NOTSET", b"VALID", "VALID"):
        raise _Unsupported(f"auto_pad {a['auto_pad']!r} (only NOTSET or VALID)")
    if any(d != 1 for d in _ints(a, "dilations", [1, 1])):
        raise _Unsupported(f"dilations {a['dilations']} (only 1)")
    strides = _ints(a, "strides", [1, 1])
    if len(strides) != 2:
        raise _Unsupported(f"strides {strides} (two: [h, w])")
    return {"kernel": kernel, "stride": strides, "pad": _symmetric(_ints(a, "pads", []))}


class _Unsupported(Exception):
    """Why a node does not fit the net description."""


def _ops(graph: Any, constants: dict[str, np.ndarray], image: str, origin: str, onnx: Any) -> list[Op]:
    """The graph's nodes as Ops in its (topological) order, each naming the tensors it reads;
    every unsupported node collected, then one error."""
    problems: list[str] = []
    ops: list[Op] = []
    last = image
    nodes = fold_activations([n for n in graph.node if n.op_type != "Constant"], constants, graph, onnx)
    k = 0
    while k < len(nodes):
        node = nodes[k]
        k += 1
        label = f"{printable(node.name or node.op_type + '_' + str(k - 1))} ({printable(node.op_type)})"
        data = [i for i in node.input if i and i not in constants]
        source = node.name or f"{node.op_type}_{k - 1}"
        last = node.output[0] if node.output else last
        try:
            if node.op_type in ("Add", "Sum") and len(data) >= 2:  # a residual sum (an Add of a constant: a bias)
                if len(data) != len(node.input):
                    raise _Unsupported("a sum of tensors and constants (only of tensors)")
                op, merged = Op("add", source, node.op_type), False
            elif node.op_type == "Mul" and len(data) == 2 == len(node.input):  # (a Mul of a constant: refused)
                op, merged = Op("mul", source, node.op_type), False
            elif node.op_type == "Concat":
                if _int(_attrs(node, onnx), "axis", 0) not in (1, -3) or len(data) < 2 or len(data) != len(node.input):
                    raise _Unsupported("only two or more tensors along the channels (axis 1)")
                op, merged = Op("concat", source, node.op_type), False
            elif len(data) != 1:
                raise _Unsupported(f"reads {len(data)} tensors (one, or an Add / Sum / Concat of several)")
            else:
                op, merged = _node_op(node, nodes[k] if k < len(nodes) else None, source, constants, onnx)
        except _Unsupported as e:
            problems.append(f"{label}: {e}")
            continue
        if merged:  # MatMul + Add: the Add's output is the op's
            k += 1
            last = nodes[k - 1].output[0]
        ops.append(dataclasses.replace(op, tensor=last, inputs=tuple(INPUT if d == image else d for d in data)))
    outputs = [o.name for o in graph.output]
    if outputs != [last] and not problems:
        problems.append(f"outputs {outputs}: the model's output must be the last node's ({last!r})")
    fail_unsupported(origin, problems, SUPPORTED)
    return ops


def _const(constants: dict[str, np.ndarray], node: Any, index: int, what: str) -> np.ndarray | None:
    if len(node.input) <= index or not node.input[index]:
        return None
    if node.input[index] not in constants:
        raise _Unsupported(f"{what} {node.input[index]!r} is computed, not an initializer or Constant")
    return np.asarray(constants[node.input[index]])


def _node_op(node: Any, following: Any, source: str, constants: Any, onnx: Any) -> tuple[Op, bool]:
    """The Op of one node, and whether it consumed `following` (the Add after a MatMul)."""
    row = READERS.get(node.op_type)
    if row is None or row.read is None:
        raise _Unsupported("operator not supported")
    return row.read(node, _attrs(node, onnx), following, source, constants)


def _conv(node: Any, a: dict, following: Any, source: str, constants: Any) -> tuple[Op, bool]:
    w = _const(constants, node, 1, "weight")
    if w is None or w.ndim != 4:
        raise _Unsupported("needs a 4-D weight initializer")
    group = _int(a, "group", 1)
    if group != 1 and not (group == w.shape[0] and w.shape[1] == 1):
        raise _Unsupported(f"group {group} (1, or depthwise: group = input channels = output channels)")
    return Op("conv", source, node.op_type, _window(a, w.shape[2:]) | {"groups": group}, w,
              _const(constants, node, 2, "bias")), False


def _gemm(node: Any, a: dict, following: Any, source: str, constants: Any) -> tuple[Op, bool]:
    if _int(a, "transA", 0):
        raise _Unsupported("transA 1 (only 0)")
    b = _const(constants, node, 1, "B")
    if b is None or b.ndim != 2:
        raise _Unsupported("needs a 2-D B initializer")
    w = (b if _int(a, "transB", 0) else b.T) * _float(a, "alpha", 1.0)
    c = _const(constants, node, 2, "C")
    bias = None
    if c is not None:
        if c.size not in (1, w.shape[0]) or c.ndim > 2:
            raise _Unsupported(f"C of shape {c.shape} (only a bias of the {w.shape[0]} outputs)")
        bias = np.broadcast_to(c.reshape(-1), (w.shape[0],)) * _float(a, "beta", 1.0)
    return Op("fc", source, node.op_type, {}, w, bias), False


def _matmul(node: Any, a: dict, following: Any, source: str, constants: Any) -> tuple[Op, bool]:
    b = _const(constants, node, 1, "B")
    if b is None or b.ndim != 2:
        raise _Unsupported("needs a 2-D weight initializer as its second input")
    bias, merged = None, False
    if following is not None and following.op_type == "Add" and node.output[0] in following.input:
        other = [i for i in following.input if i != node.output[0]]
        if len(other) == 1 and other[0] in constants and np.asarray(constants[other[0]]).size == b.shape[1]:
            bias, merged = np.asarray(constants[other[0]]).reshape(-1), True
    return Op("fc", source, "MatMul" + ("+Add" if merged else ""), {}, b.T, bias), merged


def _pool(node: Any, a: dict, following: Any, source: str, constants: Any) -> tuple[Op, bool]:
    t = node.op_type
    if _int(a, "ceil_mode", 0):
        raise _Unsupported("ceil_mode 1 (only floor)")
    if t == "MaxPool" and (_int(a, "storage_order", 0) or len([o for o in node.output if o]) > 1):
        raise _Unsupported("an Indices output or storage_order")
    window = _window(a)
    if t == "AveragePool" and window["pad"] != [0, 0] and not _int(a, "count_include_pad", 0):
        raise _Unsupported("count_include_pad 0 with pads (only pads counted as zeros)")
    return Op("maxpool" if t == "MaxPool" else "avgpool", source, t, window), False


def _batchnorm(node: Any, a: dict, following: Any, source: str, constants: Any) -> tuple[Op, bool]:
    """The inference form: the running statistics are inputs 3 and 4."""
    if _int(a, "training_mode", 0):
        raise _Unsupported("training_mode 1 (only the inference form)")
    scale, shift, mean, var = (_const(constants, node, i, what) for i, what in
                               ((1, "scale"), (2, "B"), (3, "input_mean"), (4, "input_var")))
    if scale is None or shift is None or mean is None or var is None:
        raise _Unsupported("needs scale, B, input_mean and input_var initializers")
    eps = float(f"{float(_float(a, 'epsilon', 1e-5)):.7g}")  # (a float32 attribute: its decimal)
    momentum = momentum_from_onnx(_float(a, "momentum", 0.9))
    return Op("batchnorm", source, node.op_type, {"eps": eps, "momentum": momentum}, scale, shift, (mean, var, 0)), False


def _activation(node: Any, a: dict, following: Any, source: str, constants: Any) -> tuple[Op, bool]:
    """One operator, or a pattern fold_activations made one (ONNX_ACTIVATIONS)."""
    approximate = a.get("approximate", b"none")  # (Gelu's: a string attribute, bytes here)
    if approximate not in ("none", b"none"):
        raise _Unsupported(f"approximate {printable(repr(bytes(approximate).decode(errors='replace')))} "
                           "(only 'none', the erf form)")
    return Op(ONNX_ACTIVATIONS[node.op_type], source, node.op_type), False


def _clip(node: Any, a: dict, following: Any, source: str, constants: Any) -> tuple[Op, bool]:
    """ReLU6 when it clips to [0, 6] (attributes before opset 11, inputs since)."""
    lo = _const(constants, node, 1, "min") if len(node.input) > 1 and node.input[1] else None
    hi = _const(constants, node, 2, "max") if len(node.input) > 2 and node.input[2] else None
    bounds = (float(lo.reshape(-1)[0]) if lo is not None and lo.size == 1 else a.get("min"),
              float(hi.reshape(-1)[0]) if hi is not None and hi.size == 1 else a.get("max"))
    if bounds != (0.0, 6.0):
        raise _Unsupported(f"bounds {bounds} (only [0, 6]: ReLU6)")
    return Op("relu6", source, node.op_type), False


def _dropout(node: Any, a: dict, following: Any, source: str, constants: Any) -> tuple[Op, bool]:
    ratio = _const(constants, node, 1, "ratio")
    if ratio is not None and ratio.size != 1:
        raise _Unsupported(f"ratio of shape {ratio.shape} (a scalar)")
    rate = ratio.reshape(-1)[0].item() if ratio is not None else a.get("ratio", 0.5)
    return Op("dropout", source, node.op_type, {"rate": rate}), False


def _flatten(node: Any, a: dict, following: Any, source: str, constants: Any) -> tuple[Op, bool]:
    if _int(a, "axis", 1) != 1:
        raise _Unsupported(f"axis {a['axis']} (only 1)")
    return Op("flatten", source, node.op_type), False


def _reshape(node: Any, a: dict, following: Any, source: str, constants: Any) -> tuple[Op, bool]:
    shape = _const(constants, node, 1, "shape")
    if shape is None or shape.ndim != 1 or len(shape) != 2 or not (shape[0] in (0, -1) or shape[1] == -1):
        raise _Unsupported(f"shape {None if shape is None else shape.tolist()} (only (N, -1), a flatten)")
    return Op("flatten", source, node.op_type), False


def _softmax(node: Any, a: dict, following: Any, source: str, constants: Any) -> tuple[Op, bool]:
    if _int(a, "axis", -1) not in (1, -1):
        raise _Unsupported(f"axis {a['axis']} (only over the classes)")
    return Op("softmax", source, node.op_type), False


@dataclass(frozen=True)
class OnnxRow:
    """How the import reads one operator (None: a join, read by _ops from its several inputs), and
    how SUPPORTED names it. The export's side is runtime/onnx_export.py, the conventions both
    share runtime/onnx_conventions.py."""
    read: Callable[[Any, dict, Any, str, Any], tuple[Op, bool]] | None
    supported: str


READERS: dict[str, OnnxRow] = {
    "Conv": OnnxRow(_conv, "Conv (group 1 or depthwise, dilation 1, symmetric pads)"),
    "Gemm": OnnxRow(_gemm, "Gemm (transA 0)"),
    "MatMul": OnnxRow(_matmul, "MatMul (+ Add)"),
    "MaxPool": OnnxRow(_pool, "MaxPool / AveragePool (floor, symmetric pads; AveragePool counting pads)"),
    "AveragePool": OnnxRow(_pool, ""),
    "GlobalAveragePool": OnnxRow(lambda node, a, following, source, constants: (
        Op("avgpool", source, node.op_type, {"adaptive": (1, 1)}), False), "GlobalAveragePool"),
    "BatchNormalization": OnnxRow(_batchnorm, "BatchNormalization (inference form)"),
    **{t: OnnxRow(_activation, {"Sigmoid*Mul": "SiLU (x Sigmoid(x))", "Erf-GELU": "GELU (Gelu, or its Erf form)",
                                "Gelu": ""}.get(t, t)) for t in ONNX_ACTIVATIONS},
    "Clip": OnnxRow(_clip, "Clip to [0, 6]"),
    "Add": OnnxRow(None, "Add / Sum of tensors"), "Sum": OnnxRow(None, ""),
    "Mul": OnnxRow(None, "Mul of two tensors"),
    "Concat": OnnxRow(None, "Concat (axis 1)"),
    "Dropout": OnnxRow(_dropout, "Dropout"),
    "Flatten": OnnxRow(_flatten, "Flatten (axis 1)"),
    "Reshape": OnnxRow(_reshape, "Reshape to (N, -1)"),
    "Identity": OnnxRow(lambda node, a, following, source, constants: (Op("identity", source, node.op_type), False),
                        "Identity"),
    "Softmax": OnnxRow(_softmax, "a final Softmax / LogSoftmax"), "LogSoftmax": OnnxRow(_softmax, ""),
}
SUPPORTED = ", ".join(row.supported for row in READERS.values() if row.supported)


_SQRT2 = math.sqrt(2.0)


def fold_activations(nodes: list, constants: dict[str, np.ndarray], graph: Any, onnx: Any) -> list:
    """`nodes` with each activation written as a pattern of several operators replaced by one node
    (ONNX_ACTIVATIONS) where its last node was: SiLU as Mul(x, Sigmoid(x)), GELU in its erf form
    as torch.onnx writes it (x (1 + erf(x / sqrt 2)) / 2, any operand order, the 1 / sqrt 2 as a
    Div or a Mul, the half applied first or last). A pattern's inner tensors must have no other
    reader (nor be a graph output); anything else is left as it is, to be refused node by node."""
    readers: dict[str, list[Any]] = {}
    for node in nodes:
        for name in node.input:
            readers.setdefault(name, []).append(node)
    outputs = {o.name for o in graph.output}

    def only(tensor: str, op_type: str) -> Any:
        """The one reader of `tensor`, when it is an `op_type` and the tensor is not an output."""
        found = readers.get(tensor, [])
        return found[0] if len(found) == 1 and found[0].op_type == op_type and tensor not in outputs else None

    def scalar(name: str) -> float | None:
        value = constants.get(name)
        return float(np.asarray(value).reshape(-1)[0]) if value is not None and np.asarray(value).size == 1 else None

    def other(node: Any, tensor: str) -> str | None:
        """A two-input node's input that is not `tensor` (None: it reads `tensor` twice, or not at all)."""
        rest = [i for i in node.input if i != tensor]
        return rest[0] if len(node.input) == 2 and len(rest) == 1 else None

    def close(value: float | None, want: float) -> bool:
        return value is not None and abs(value - want) <= 1e-6 * abs(want)

    def silu(node: Any) -> tuple[str, list[Any]] | None:
        if node.op_type != "Sigmoid" or len(node.input) != 1:
            return None
        x, mul = node.input[0], only(node.output[0], "Mul")
        return (x, [node, mul]) if mul is not None and other(mul, node.output[0]) == x else None

    def gelu(node: Any) -> tuple[str, list[Any]] | None:
        if node.op_type != "Erf" or len(node.input) != 1:
            return None
        scale = next((n for n in nodes if node.input[0] in n.output), None)
        if scale is None or scale.op_type not in ("Div", "Mul") or only(scale.output[0], "Erf") is not node:
            return None
        x = scale.input[0]
        if not close(scalar(scale.input[1]), _SQRT2 if scale.op_type == "Div" else 1 / _SQRT2):
            if scale.op_type != "Mul" or not close(scalar(scale.input[0]), 1 / _SQRT2):
                return None
            x = scale.input[1]
        add = only(node.output[0], "Add")
        if add is None or not close(scalar(other(add, node.output[0]) or ""), 1.0):
            return None
        mul = only(add.output[0], "Mul")
        if mul is None:
            return None
        by = other(mul, add.output[0])
        if by is None:
            return None
        if by == x:  # x (1 + erf), then halved
            half = only(mul.output[0], "Mul")
            if half is None or not close(scalar(other(half, mul.output[0]) or ""), 0.5):
                return None
            return x, [scale, node, add, mul, half]
        halving = next((n for n in nodes if by in n.output), None)  # (x / 2) (1 + erf)
        if (halving is None or halving.op_type != "Mul" or only(by, "Mul") is not mul
                or other(halving, x) is None or not close(scalar(other(halving, x) or ""), 0.5)):
            return None
        return x, [scale, node, add, halving, mul]

    folded: dict[int, Any] = {}  # id of a pattern's last node -> the node replacing it
    dropped: set[int] = set()
    position = {id(n): i for i, n in enumerate(nodes)}
    for node in nodes:
        for kind, match in (("Sigmoid*Mul", silu), ("Erf-GELU", gelu)):
            found = match(node)
            if found is None or any(id(n) in dropped for n in found[1]):
                continue
            x, group = found
            last = max(group, key=lambda n: position[id(n)])
            dropped.update(id(n) for n in group)
            folded[id(last)] = onnx.helper.make_node(kind, [x], [last.output[0]], name=last.name or group[0].name)
    return [folded.get(id(n), n) for n in nodes if id(n) not in dropped or id(n) in folded]


def write_net(net: dict, state: dict[str, np.ndarray], out: Path) -> tuple[Path, Path]:
    """NET.json and NET.npz beside it, each written to a temporary file and renamed: a failure
    leaves neither half-written."""
    weights = out.with_suffix(".npz")
    for target, what in ((out, "net description"), (weights, "weights")):  # both writable, or neither written
        check_writable(target, what, ModelImportError, make_parents=True)
    temps = []
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        for target, write in ((out, lambda f: f.write(json.dumps(net, indent=1).encode() + b"\n")),
                              (weights, lambda f: np.savez(f, **state))):  # type: ignore[arg-type]
            remove_stale_temporaries(target)  # what an import killed mid-write left
            fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=f".{target.name}.{os.getpid()}.", suffix=".tmp")
            temps.append(tmp)
            with os.fdopen(fd, "wb") as f:
                write(f)
        os.replace(temps[1], weights)
        try:
            os.replace(temps[0], out)
        except OSError:
            weights.unlink(missing_ok=True)  # no weights without their description
            raise
    except OSError as e:
        raise ModelImportError(f"{out}: cannot write: {e.strerror or e}") from None
    finally:
        for tmp in temps:
            Path(tmp).unlink(missing_ok=True)
    return out, weights
