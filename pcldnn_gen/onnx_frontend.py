"""ONNX models -> net description + weights (`pcldnn-gen import MODEL.onnx -o NET.json`). The
`onnx` package is an optional extra, imported on call. A model is a chain from its one image
input to its logits: Conv, Gemm (or MatMul with an Add of its bias), MaxPool, AveragePool,
GlobalAveragePool, Relu, Dropout, Flatten or Reshape to (N, -1), Identity, and a final Softmax or
LogSoftmax; weights come from initializers or Constant nodes. Every node that does not fit is
listed in one error."""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from pcldnn_runtime.validate import read_bounded

from .errors import ModelImportError
from .frontend import Op, fail_unsupported, input_shape_of, model_name, net_from_ops

SUPPORTED = ("Conv (group 1, dilation 1, symmetric pads), Gemm (transA 0), MatMul (+ Add), MaxPool / AveragePool "
             "(floor, symmetric pads; AveragePool counting pads), GlobalAveragePool, Relu, Dropout, Flatten "
             "(axis 1), Reshape to (N, -1), Identity, a final Softmax / LogSoftmax")
MAX_MODEL_BYTES = 4 * 1024 ** 3  # a protobuf cannot exceed 2 GiB without external data anyway


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
    graph = model.graph
    for tensor in graph.initializer:
        if tensor.data_location == onnx.TensorProto.EXTERNAL:
            raise ModelImportError(f"{path}: initializer {tensor.name!r} is stored in an external file; save the "
                                   "model with its weights inside (onnx.save(model, path, save_as_external_data=False))")
    try:
        onnx.checker.check_model(model)
    except Exception as e:
        raise ModelImportError(f"{path}: invalid ONNX model: {str(e).splitlines()[0][:300]}") from None
    constants = {t.name: onnx.numpy_helper.to_array(t) for t in graph.initializer}
    for node in graph.node:
        if node.op_type == "Constant" and node.output:
            attr = {a.name: a for a in node.attribute}
            if "value" in attr:
                constants[node.output[0]] = onnx.numpy_helper.to_array(attr["value"].t)
    inputs = [i for i in graph.input if i.name not in constants]
    if len(inputs) != 1:
        raise ModelImportError(f"{path}: the model must take one image input, it takes {len(inputs)}")
    dims = inputs[0].type.tensor_type.shape.dim
    if len(dims) != 4 or not all(d.HasField("dim_value") for d in dims[1:]):
        raise ModelImportError(f"{path}: input {inputs[0].name!r} must be (N, C, H, W) with C, H, W known")
    shape = input_shape_of([d.dim_value for d in dims[1:]])
    ops = _ops(graph, constants, inputs[0].name, str(path), onnx)
    return net_from_ops(ops, shape, model_name(name, graph.name or path.stem), str(path))


def _attrs(node, onnx) -> dict[str, Any]:
    return {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}


def _symmetric(pads) -> tuple[int, int]:
    pads = list(pads) or [0, 0, 0, 0]
    if len(pads) != 4 or pads[:2] != pads[2:]:
        raise _Unsupported(f"pads {pads} (only symmetric: [top, left, top, left])")
    return int(pads[0]), int(pads[1])


def _window(a: dict, kernel_from=None) -> dict[str, tuple[int, int]]:
    kernel = tuple(int(k) for k in a.get("kernel_shape", kernel_from or ()))
    if len(kernel) != 2:
        raise _Unsupported(f"kernel_shape {list(kernel)} (only 2-D)")
    if a.get("auto_pad", b"NOTSET") not in (b"NOTSET", "NOTSET", b"VALID", "VALID"):
        raise _Unsupported(f"auto_pad {a['auto_pad']!r} (only NOTSET or VALID)")
    if any(d != 1 for d in a.get("dilations", [1, 1])):
        raise _Unsupported(f"dilations {list(a['dilations'])} (only 1)")
    strides = tuple(int(s) for s in a.get("strides", [1, 1]))
    return {"kernel": (kernel[0], kernel[1]), "stride": (strides[0], strides[1]), "pad": _symmetric(a.get("pads", []))}


class _Unsupported(Exception):
    """Why a node does not fit the net description."""


def _ops(graph, constants: dict[str, np.ndarray], image: str, origin: str, onnx) -> list[Op]:
    problems: list[str] = []
    ops: list[Op] = []
    prev = image
    users: dict[str, int] = {}
    for node in graph.node:
        for i in node.input:
            users[i] = users.get(i, 0) + 1
    nodes = [n for n in graph.node if n.op_type != "Constant"]
    k = 0
    while k < len(nodes):
        node = nodes[k]
        k += 1
        label = f"{node.name or node.op_type + '_' + str(k - 1)} ({node.op_type})"
        data = [i for i in node.input if i and i not in constants]
        if data != [prev]:
            problems.append(f"{label}: does not take the previous node's output as its only tensor input "
                            "(only chains are supported)")
            prev = node.output[0] if node.output else prev
            continue
        if users.get(prev, 0) > 1:
            problems.append(f"{label}: its input also feeds another node (branches and residual connections "
                            "are not supported)")
        source = node.name or f"{node.op_type}_{k - 1}"
        try:
            op, merged = _node_op(node, nodes[k] if k < len(nodes) else None, source, constants, onnx)
        except _Unsupported as e:
            problems.append(f"{label}: {e}")
            prev = node.output[0]
            continue
        if merged:  # MatMul + Add: the Add's output continues the chain
            k += 1
            node = nodes[k - 1]
        prev = node.output[0]
        ops.append(op)
    outputs = [o.name for o in graph.output]
    if outputs != [prev] and not problems:
        problems.append(f"outputs {outputs}: the model's output must be the last node of the chain ({prev!r})")
    fail_unsupported(origin, problems, SUPPORTED)
    return ops


def _const(constants: dict[str, np.ndarray], node, index: int, what: str) -> np.ndarray | None:
    if len(node.input) <= index or not node.input[index]:
        return None
    if node.input[index] not in constants:
        raise _Unsupported(f"{what} {node.input[index]!r} is computed, not an initializer or Constant")
    return np.asarray(constants[node.input[index]])


def _node_op(node, following, source: str, constants, onnx) -> tuple[Op, bool]:
    """The Op of one node, and whether it consumed `following` (the Add after a MatMul)."""
    t, a = node.op_type, _attrs(node, onnx)
    if t == "Conv":
        if a.get("group", 1) != 1:
            raise _Unsupported(f"group {a['group']} (only 1)")
        w = _const(constants, node, 1, "weight")
        if w is None or w.ndim != 4:
            raise _Unsupported("needs a 4-D weight initializer")
        return Op("conv", source, t, _window(a, w.shape[2:]), w, _const(constants, node, 2, "bias")), False
    if t == "Gemm":
        if a.get("transA", 0):
            raise _Unsupported("transA 1 (only 0)")
        b = _const(constants, node, 1, "B")
        if b is None or b.ndim != 2:
            raise _Unsupported("needs a 2-D B initializer")
        w = (b if a.get("transB", 0) else b.T) * np.float32(a.get("alpha", 1.0))
        c = _const(constants, node, 2, "C")
        bias = None
        if c is not None:
            if c.size not in (1, w.shape[0]) or c.ndim > 2:
                raise _Unsupported(f"C of shape {c.shape} (only a bias of the {w.shape[0]} outputs)")
            bias = np.broadcast_to(c.reshape(-1), (w.shape[0],)) * np.float32(a.get("beta", 1.0))
        return Op("fc", source, t, {}, w, bias), False
    if t == "MatMul":
        b = _const(constants, node, 1, "B")
        if b is None or b.ndim != 2:
            raise _Unsupported("needs a 2-D weight initializer as its second input")
        bias, merged = None, False
        if following is not None and following.op_type == "Add" and node.output[0] in following.input:
            other = [i for i in following.input if i != node.output[0]]
            if len(other) == 1 and other[0] in constants and np.asarray(constants[other[0]]).size == b.shape[1]:
                bias, merged = np.asarray(constants[other[0]]).reshape(-1), True
        return Op("fc", source, "MatMul" + ("+Add" if merged else ""), {}, b.T, bias), merged
    if t in ("MaxPool", "AveragePool"):
        if a.get("ceil_mode", 0):
            raise _Unsupported("ceil_mode 1 (only floor)")
        if t == "MaxPool" and (a.get("storage_order", 0) or len([o for o in node.output if o]) > 1):
            raise _Unsupported("an Indices output or storage_order")
        window = _window(a)
        if t == "AveragePool" and window["pad"] != (0, 0) and not a.get("count_include_pad", 0):
            raise _Unsupported("count_include_pad 0 with pads (only pads counted as zeros)")
        return Op("maxpool" if t == "MaxPool" else "avgpool", source, t, window), False
    if t == "GlobalAveragePool":
        return Op("avgpool", source, t, {"adaptive": (1, 1)}), False
    if t == "Relu":
        return Op("relu", source, t), False
    if t == "Dropout":
        ratio = _const(constants, node, 1, "ratio")
        rate = float(ratio) if ratio is not None else float(a.get("ratio", 0.5))
        return Op("dropout", source, t, {"rate": rate}), False
    if t == "Flatten":
        if a.get("axis", 1) != 1:
            raise _Unsupported(f"axis {a['axis']} (only 1)")
        return Op("flatten", source, t), False
    if t == "Reshape":
        shape = _const(constants, node, 1, "shape")
        if shape is None or shape.ndim != 1 or len(shape) != 2 or not (shape[0] in (0, -1) or shape[1] == -1):
            raise _Unsupported(f"shape {None if shape is None else shape.tolist()} (only (N, -1), a flatten)")
        return Op("flatten", source, t), False
    if t == "Identity":
        return Op("identity", source, t), False
    if t in ("Softmax", "LogSoftmax"):
        if a.get("axis", -1) not in (1, -1):
            raise _Unsupported(f"axis {a['axis']} (only over the classes)")
        return Op("softmax", source, t), False
    raise _Unsupported("operator not supported")


def write_net(net: dict, state: dict[str, np.ndarray], out: Path) -> tuple[Path, Path]:
    """NET.json and NET.npz beside it, each written to a temporary file and renamed: a failure
    leaves neither half-written."""
    weights = out.with_suffix(".npz")
    out.parent.mkdir(parents=True, exist_ok=True)
    temps = []
    try:
        for target, write in ((out, lambda f: f.write(json.dumps(net, indent=1).encode() + b"\n")),
                              (weights, lambda f: np.savez(f, **state))):  # type: ignore[arg-type]
            fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=f".{target.name}.", suffix=".tmp")
            temps.append(tmp)
            with os.fdopen(fd, "wb") as f:
                write(f)
        os.replace(temps[1], weights)
        os.replace(temps[0], out)
    except OSError as e:
        raise ModelImportError(f"{out}: cannot write: {e.strerror or e}") from None
    finally:
        for tmp in temps:
            Path(tmp).unlink(missing_ok=True)
    return out, weights
