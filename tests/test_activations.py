"""The activations' table (pcldnn_runtime/activations.py): every row has all its parts; SiLU and
GELU, computed by polynomials in the generated C, against float64 on every ISA, fused into a
batchnorm and standalone as PyTorch computes them, through ONNX out and in (their several-node
forms folded into one layer); manifests written before the `activation` field still load."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
from helpers import ISA_PARAMS, RUNNABLE_ISAS, build_and_load, one_sgd_step

import pcldnn_gen
import pcldnn_runtime as pr
from pcldnn_gen.arch import get_arch
from pcldnn_gen.build import build
from pcldnn_gen.codegen import VECTOR_ISAS, template_env
from pcldnn_gen.errors import NetSpecError
from pcldnn_gen.netspec import LAYER_FIELDS, parse_netspec
from pcldnn_gen.planner.memory import ELTWISE
from pcldnn_runtime.abi import SIGNATURES
from pcldnn_runtime.activations import ACTIVATIONS
from pcldnn_runtime.errors import BuildDirError
from pcldnn_runtime.layer_types import LAYER_PASSES

torch = pytest.importorskip("torch")
nn, F = torch.nn, torch.nn.functional


@pytest.mark.parametrize("name", ACTIVATIONS)
def test_every_activation_has_all_its_parts(name):
    """A row of the table is a layer type with its passes, kernels, templates and explanations;
    its PyTorch names are PyTorch's; one computed from its input has C functions for every
    vector ISA (so adding a row without them fails here, not in a user's build)."""
    act = ACTIVATIONS[name]
    assert name in LAYER_FIELDS and LAYER_PASSES[name] == ("fwd", "bwd_data")
    for kernel in (f"{name}_fwd", f"{name}_bwd_data"):
        assert kernel in SIGNATURES and kernel in ELTWISE.templates and kernel in ELTWISE.reasons
    assert ("const void *in" if act.from_input else "const void *out") in SIGNATURES[f"{name}_bwd_data"]
    assert act.backward in ("output", "input") and act.fuses_into <= {"conv", "fc", "batchnorm", "add"}
    assert all(isinstance(getattr(nn, m), type) for m in act.torch_modules)
    assert all(callable(getattr(F, f, None) or getattr(torch, f, None)) for f in act.torch_functions)
    if act.from_input:
        for isa, vec in VECTOR_ISAS.items():
            module = template_env().get_template("_activation.c.j2").make_module({"vec": vec})
            text = str(module.functions(act))
            for function in (act.forward_c("x"), act.backward_c("x")):
                assert f"{function.split('(')[0]}({vec.type} x)" in text, (isa, function)


def _float64(name, x):
    """(f(x), f'(x)) in float64, from math's erfc (no cancellation in GELU's tail)."""
    x = x.astype(np.float64)
    s = 1 / (1 + np.exp(-x))
    if name == "sigmoid":
        return s, s * (1 - s)
    if name == "silu":
        return x * s, s * (1 + x * (1 - s))
    cdf = 0.5 * np.vectorize(math.erfc)(-x / math.sqrt(2))
    return x * cdf, cdf + x * np.exp(-x * x / 2) / math.sqrt(2 * math.pi)


# The bounds beyond 1e-5 of the value (forward, backward): e^x is clamped at e^-87.3 (the far
# negative tails: 1e-36); a derivative crossing zero (SiLU's near -1.28, GELU's near -0.75) has no
# relative bound (1e-6: 8 ulps at its scale, 1); GELU's erf is Abramowitz and Stegun's 7.1.26, as
# oneDNN's gelu_erf, 1.5e-7 from erf's (5e-7 after the x and the derivative's terms).
FLOORS = {"sigmoid": (1e-36, 1e-6), "silu": (1e-36, 1e-6), "gelu": (5e-7, 1e-6)}


@pytest.mark.parametrize("isa", ISA_PARAMS)
def test_smooth_activations_against_float64(tmp_path, isa):
    """Forward and backward over [-100, 100] (and densely over [-10, 10]), each ISA's vector
    polynomials, within 1e-5 of the float64 value plus FLOORS."""
    layers = [{"name": "c", "type": "conv", "out_channels": 16, "kernel": 1},
              {"name": "silu", "type": "silu"}, {"name": "gelu", "type": "gelu", "inputs": ["c"]},
              {"name": "sigmoid", "type": "sigmoid", "inputs": ["c"]},
              {"name": "sum", "type": "add", "inputs": ["silu", "gelu", "sigmoid"]}]
    net = build_and_load(tmp_path, layers, (16, 32, 32), isa, threads=2)
    x = np.concatenate([np.linspace(-100, 100, 8192), np.linspace(-10, 10, 8192)]).astype(np.float32)
    x = x.reshape(1, 16, 32, 32)
    for name, floors in FLOORS.items():
        layer = net.layers[name]
        y = layer.forward(x)
        dx = layer.backward_data(np.ones_like(x))
        for got, want, floor, what in zip((y, dx), _float64(name, x), floors, ("forward", "backward")):
            error = np.abs(got - want) - 1e-5 * np.abs(want)
            assert np.all(error <= floor), (name, what, x.reshape(-1)[np.argmax(error)])


class SmoothBlocks(nn.Module):
    """An EfficientNet-like stem and blocks: SiLU and GELU after a BatchNorm2d (fused), as modules
    and as F.silu / F.gelu calls after convolutions (standalone)."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 20, 3, padding=1, bias=False), nn.BatchNorm2d(20), nn.SiLU())
        self.block = nn.Sequential(nn.Conv2d(20, 24, 3, padding=1), nn.BatchNorm2d(24), nn.GELU())
        self.project = nn.Conv2d(24, 16, 1)
        self.down = nn.Conv2d(16, 8, 3, stride=2, padding=1)
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(8 * 4 * 4, 5))

    def forward(self, x):
        return self.head(F.gelu(self.down(F.silu(self.project(self.block(self.stem(x)))))))


@pytest.mark.parametrize("isa", ISA_PARAMS)
def test_silu_and_gelu_nets_match_pytorch(tmp_path, isa):
    """from_torch fuses the activations after batchnorms and keeps the others as layers; logits in
    both modes and one SGD step's parameter gradients as PyTorch's."""
    torch.manual_seed(0)
    model = SmoothBlocks()
    with torch.no_grad():  # scales and shifts that reach both activations' curved parts
        model.stem[1].weight.fill_(3.0)
        model.block[1].bias.fill_(-0.5)
    net_dict, state = pcldnn_gen.from_torch(model, (3, 8, 8))
    assert [(l["type"], l.get("activation")) for l in net_dict["layers"]] == [
        ("conv", None), ("batchnorm", "silu"), ("conv", None), ("batchnorm", "gelu"), ("conv", None), ("silu", None),
        ("conv", None), ("gelu", None), ("fc", None), ("softmax_cross_entropy", None)]
    build(parse_netspec(net_dict), get_arch(isa), tmp_path / "b")
    net = pr.load(tmp_path / "b", threads=2)
    net.load_state_dict(state)
    x = (np.random.default_rng(1).standard_normal((4, 3, 8, 8)) * 3).astype(np.float32)
    for training in (False, True):
        model.train(training)
        want = model(torch.from_numpy(x)).detach().numpy()
        np.testing.assert_allclose(net.forward(x, training=training), want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    moves, grads = one_sgd_step(net, model, x, np.arange(4))
    scale = max(np.abs(g).max() for g in grads.values())
    for layer in (l for l in net_dict["layers"] if l["type"] in ("conv", "fc", "batchnorm")):
        for part in ("weight", "bias"):
            key, g = f"{layer['name']}.{part}", grads.get(f"{layer['source']}.{part}")
            if g is not None:  # (a convolution's bias before a batchnorm has a zero gradient: scale's atol)
                np.testing.assert_allclose(moves[key], g, rtol=1e-3, atol=1e-5 * scale, err_msg=key)


def test_where_an_activation_fuses_is_the_tables_word():
    base = {"name": "n", "input": {"channels": 3, "height": 4, "width": 4},
            "layers": [{"name": "c", "type": "conv", "out_channels": 4, "kernel": 1, "activation": "silu"}]}
    with pytest.raises(NetSpecError, match=r"layers\[0\]\.activation: silu is fused into batchnorm layers only; "
                                           r"after a conv put a silu layer"):
        parse_netspec(base)
    base["layers"] = [{"name": "c", "type": "conv", "out_channels": 4, "kernel": 1},
                      {"name": "g", "type": "gelu", "activation": "relu"}]
    with pytest.raises(NetSpecError, match=r"layers\[1\]: unknown field 'activation'|layers\[1\].*activation"):
        parse_netspec(base)


def test_manifests_from_before_the_activation_field_load(tmp_path):
    """A build whose manifest says `relu` / `relu6` (as every one did before `activation`) loads
    as the same net; a manifest that says both, or an activation where the layer has none, is
    refused by name."""
    layers = [{"name": "c", "type": "conv", "out_channels": 8, "kernel": 3, "pad": 1, "activation": "relu"},
              {"name": "n", "type": "batchnorm", "activation": "relu6"}, {"name": "r", "type": "relu6"},
              {"name": "f", "type": "fc", "out_features": 3}, {"name": "loss", "type": "softmax_cross_entropy"}]
    net = build_and_load(tmp_path, layers, (3, 6, 6), RUNNABLE_ISAS[-1], name="old", threads=1)
    path = tmp_path / f"old-{RUNNABLE_ISAS[-1]}" / "manifest.json"
    manifest = json.loads(path.read_text())
    for entry in manifest["layers"]:
        act = entry.pop("activation", None)
        entry["relu"] = act is not None
        if act == "relu6":
            entry["relu6"] = True
    path.write_text(json.dumps(manifest))
    old = pr.load(path.parent, threads=1)
    assert [l.spec.activation for l in old.chain] == [l.spec.activation for l in net.chain] == \
        ["relu", "relu6", "relu6", None]
    manifest["layers"][0]["activation"] = "relu"
    path.write_text(json.dumps(manifest))
    with pytest.raises(BuildDirError, match=r"layers\[0\]\.relu: comes with `activation`"):
        pr.load(path.parent, threads=1)
    del manifest["layers"][0]["relu"]
    manifest["layers"][3] |= {"activation": "silu"}
    del manifest["layers"][3]["relu"]
    path.write_text(json.dumps(manifest))
    with pytest.raises(BuildDirError, match=r"layers\[3\]\.activation: silu is not fused into a fc layer"):
        pr.load(path.parent, threads=1)


onnx = pytest.importorskip("onnx")


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # torch.onnx.export(dynamo=False): torch 2.9+ warns
def test_onnx_export_and_import_of_silu_and_gelu(tmp_path):
    """The export writes SiLU as Sigmoid and Mul and GELU in its Erf form (opset 17 has neither
    operator); onnxruntime computes our logits from it; the import folds both patterns back into
    the layers they were (and reads torch.onnx's own export, and opset 20's Gelu node)."""
    ort = pytest.importorskip("onnxruntime")
    isa = RUNNABLE_ISAS[-1]
    torch.manual_seed(3)
    model = SmoothBlocks().eval()
    net_dict, state = pcldnn_gen.from_torch(model, (3, 8, 8))
    build(parse_netspec(net_dict), get_arch(isa), tmp_path / "b")
    net = pr.load(tmp_path / "b", threads=1)
    net.load_state_dict(state)
    x = np.random.default_rng(2).standard_normal((3, 3, 8, 8)).astype(np.float32)
    ours = net.export_onnx(tmp_path / "ours.onnx")
    runner = ort.InferenceSession(str(ours), providers=["CPUExecutionProvider"])
    want = net.forward(x)
    np.testing.assert_allclose(runner.run(None, {"input": x})[0], want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    kinds = [(l["type"], l.get("activation")) for l in net_dict["layers"]]
    from pcldnn_gen.onnx_frontend import import_onnx
    again, _ = import_onnx(ours)
    assert [(l["type"], l.get("activation")) for l in again["layers"]] == kinds
    theirs = tmp_path / "torch.onnx"
    torch.onnx.export(model, torch.from_numpy(x), str(theirs), opset_version=17, dynamo=False,
                      input_names=["x"], output_names=["y"], dynamic_axes={"x": {0: "N"}, "y": {0: "N"}})
    imported, weights = import_onnx(theirs)  # (its evaluation export folds the batchnorms into the convolutions)
    assert [l.get("activation") or l["type"] for l in imported["layers"] if l["type"] != "batchnorm"
            and (l.get("activation") or l["type"] in ACTIVATIONS)] == ["silu", "gelu", "silu", "gelu"]
    build(parse_netspec(imported), get_arch(isa), tmp_path / "theirs")
    again = pr.load(tmp_path / "theirs", threads=1)
    again.load_state_dict(weights)
    want = model(torch.from_numpy(x)).detach().numpy()
    np.testing.assert_allclose(again.forward(x), want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


def test_onnx_gelu_operator_and_patterns_that_are_not_an_activation(tmp_path):
    """Opset 20's Gelu node imports as a GELU (its tanh form is refused by name); a Sigmoid whose
    output another node reads too is no SiLU: a sigmoid layer and a mul, not folded."""
    from onnx import TensorProto, helper, numpy_helper

    from pcldnn_gen.errors import ModelImportError
    from pcldnn_gen.onnx_frontend import import_onnx
    rng = np.random.default_rng(4)
    w, fc = rng.standard_normal((4, 3, 3, 3)).astype(np.float32), rng.standard_normal((2, 64)).astype(np.float32)

    def model(nodes, name):
        graph = helper.make_graph(
            [helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]), *nodes,
             helper.make_node("Flatten", ["a"], ["f"]), helper.make_node("Gemm", ["f", "fc"], ["y"], transB=1)],
            name, [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, 4, 4])],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 2])],
            [numpy_helper.from_array(w, "w"), numpy_helper.from_array(fc, "fc")])
        path = tmp_path / f"{name}.onnx"
        onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)]), path)
        return path

    net, _ = import_onnx(model([helper.make_node("Gelu", ["c"], ["a"])], "gelu"))
    assert [l["type"] for l in net["layers"]] == ["conv", "gelu", "fc", "softmax_cross_entropy"]
    halved_first = [  # (x / 2) (1 + erf(x / sqrt 2)), the 1 / sqrt 2 a Mul whose constant comes first
        helper.make_node("Constant", [], ["r"], value=numpy_helper.from_array(np.array(0.70710678, np.float32))),
        helper.make_node("Constant", [], ["one"], value=numpy_helper.from_array(np.array(1.0, np.float32))),
        helper.make_node("Constant", [], ["half"], value=numpy_helper.from_array(np.array(0.5, np.float32))),
        helper.make_node("Mul", ["r", "c"], ["z"]), helper.make_node("Erf", ["z"], ["e"]),
        helper.make_node("Add", ["one", "e"], ["p"]), helper.make_node("Mul", ["c", "half"], ["h"]),
        helper.make_node("Mul", ["h", "p"], ["a"])]
    path = model(halved_first, "halved")
    net, weights = import_onnx(path)
    assert [l["type"] for l in net["layers"]] == ["conv", "gelu", "fc", "softmax_cross_entropy"]
    ours = build_and_load(tmp_path, net["layers"], (3, 4, 4), RUNNABLE_ISAS[-1], threads=1)
    ours.load_state_dict(weights)
    x = rng.standard_normal((2, 3, 4, 4)).astype(np.float32)
    runner = pytest.importorskip("onnxruntime").InferenceSession(str(path), providers=["CPUExecutionProvider"])
    want = runner.run(None, {"x": x})[0]
    np.testing.assert_allclose(ours.forward(x), want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    with pytest.raises(ModelImportError, match=r"approximate 'tanh' \(only 'none'"):
        import_onnx(model([helper.make_node("Gelu", ["c"], ["a"], approximate="tanh")], "tanh"))
    shared = [helper.make_node("Sigmoid", ["c"], ["s"]), helper.make_node("Mul", ["c", "s"], ["m"]),
              helper.make_node("Add", ["m", "s"], ["a"])]
    net, _ = import_onnx(model(shared, "shared"))
    assert [l["type"] for l in net["layers"]] == ["conv", "sigmoid", "mul", "add", "fc", "softmax_cross_entropy"]
    with pytest.raises(ModelImportError, match=r"Mul_1 \(Mul\): operator not supported"):  # a Mul of a constant
        import_onnx(model([helper.make_node("Constant", [], ["k"], value=numpy_helper.from_array(np.float32(2.0))),
                           helper.make_node("Mul", ["c", "k"], ["a"])], "constant"))
