"""A trained net as an ONNX model (`Net.export_onnx`): the inference graph from the image input
to the logits (dropout is the identity there, the loss is left out), weights from
`Net.state_dict()`. The `onnx` package is an optional extra, imported on call."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from .activations import ACTIVATIONS
from .errors import PcldnnError
from .onnx_conventions import OPSET, activation_nodes, momentum_to_onnx, pads_to_onnx
from .validate import write_atomic


def _weights(state: dict, name: str, inits: list, numpy_helper: Any) -> list[str]:
    """The layer's weight (and bias, unless it has none) as initializers; their names."""
    keys = [k for k in (f"{name}.weight", f"{name}.bias") if k in state]
    inits += [numpy_helper.from_array(state[k], k) for k in keys]
    return keys


def export_onnx(net: Any, path: str | Path) -> Path:
    """Write `net` to `path` (atomically: a temporary file renamed over it)."""
    try:
        import onnx
        from onnx import TensorProto, helper, numpy_helper
    except ImportError:
        raise PcldnnError("export_onnx needs the onnx package (pip install 'pcldnn-gen[onnx]')") from None
    path = Path(path)
    state = net.state_dict()
    nodes: list = []
    inits: list = []
    tensors = {"input": ("input", True)}  # each layer's output: its ONNX tensor, and whether it is an image
    x, spatial = "input", True
    for layer in net.chain:
        spec = layer.spec
        name = layer.name
        out = name
        x, spatial = tensors[spec.inputs[0]]
        if spec.type == "conv":
            (kh, kw), (sh, sw) = spec.kernel, spec.stride
            inputs = _weights(state, name, inits, numpy_helper)
            nodes.append(helper.make_node("Conv", [x, *inputs], [out], name=name, kernel_shape=[kh, kw],
                                          strides=[sh, sw], pads=pads_to_onnx(spec.pad), group=spec.groups))
        elif spec.type == "fc":
            if spatial:
                nodes.append(helper.make_node("Flatten", [x], [f"{name}.flat"], name=f"{name}.flatten", axis=1))
                x, spatial = f"{name}.flat", False
            inputs = _weights(state, name, inits, numpy_helper)
            nodes.append(helper.make_node("Gemm", [x, *inputs], [out], name=name, transB=1))
        elif spec.type in ("maxpool", "avgpool"):
            (kh, kw), (sh, sw) = spec.kernel, spec.stride
            node = helper.make_node("MaxPool" if spec.type == "maxpool" else "AveragePool", [x], [out],
                                    name=name, kernel_shape=[kh, kw], strides=[sh, sw], pads=pads_to_onnx(spec.pad))
            if spec.type == "avgpool":  # our average divides by the window's area, padding included
                node.attribute.append(helper.make_attribute("count_include_pad", 1))
            nodes.append(node)
        elif spec.type == "batchnorm":  # its running statistics: ONNX's inference form
            inputs = _weights(state, name, inits, numpy_helper)
            stats = [f"{name}.running_mean", f"{name}.running_var"]
            inits += [numpy_helper.from_array(state[k], k) for k in stats]
            nodes.append(helper.make_node("BatchNormalization", [x, *inputs, *stats], [out], name=name,
                                          epsilon=spec.eps, momentum=momentum_to_onnx(spec.momentum)))
        elif spec.type in ACTIVATIONS:
            nodes += activation_nodes(spec.act, helper, numpy_helper, inits, x, out, name)
        elif spec.type == "add":
            nodes.append(helper.make_node("Sum", [tensors[n][0] for n in spec.inputs], [out], name=name))
        elif spec.type == "mul":  # (ONNX broadcasts a N x C x 1 x 1 input over the other's pixels)
            nodes.append(helper.make_node("Mul", [tensors[n][0] for n in spec.inputs], [out], name=name))
        elif spec.type == "concat":
            nodes.append(helper.make_node("Concat", [tensors[n][0] for n in spec.inputs], [out], name=name, axis=1))
        elif spec.type == "drop_path":  # stochastic depth: the identity at inference (ONNX has no such operator)
            nodes.append(helper.make_node("Identity", [x], [out], name=name))
        elif spec.type == "dropout":  # the identity at inference; the rate kept for re-import
            inits.append(numpy_helper.from_array(np.array(spec.rate, np.float32), f"{name}.ratio"))
            nodes.append(helper.make_node("Dropout", [x, f"{name}.ratio"], [out], name=name))
        else:
            raise AssertionError(spec.type)
        if spec.activation and spec.type not in ACTIVATIONS:  # a fused activation
            fused = f"{name}.{'relu' if spec.activation in ('relu', 'relu6') else spec.activation}"
            nodes += activation_nodes(spec.act, helper, numpy_helper, inits, out, fused, fused)
            out = fused
        x = out
        tensors[name] = (out, spatial)
    nodes.append(helper.make_node("Identity", [x], ["logits"], name="logits"))
    c, h, w = net.manifest.net_input
    last = net.chain[-1].out_shape
    graph = helper.make_graph(
        nodes, net.name, [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", c, h, w])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT,
                                       ["batch", int(np.prod(last))] if not spatial else ["batch", *last])],
        inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)],
                              producer_name="pcldnn-gen")
    onnx.checker.check_model(model)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, model.SerializeToString())
    return path
