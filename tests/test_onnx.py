"""ONNX in and out: Net.export_onnx runs in onnxruntime with the net's logits; `pcldnn-gen
import` turns ONNX graphs (exported by us or built node by node) into a net description and
weights that `compile --weights` records, with the same logits; what does not fit is listed in
one error and nothing is written. Skipped without onnx / onnxruntime (CI installs them)."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
from helpers import RUNNABLE_ISAS, build_and_load

import pcldnn_runtime as pr
from pcldnn_gen.cli import main
from pcldnn_gen.errors import ModelImportError
from pcldnn_gen.onnx_frontend import import_onnx

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

ISA = RUNNABLE_ISAS[-1]
LAYERS = [
    {"name": "conv1", "type": "conv", "out_channels": 6, "kernel": [3, 5], "stride": [1, 2], "pad": [1, 2],
     "activation": "relu"},
    {"name": "pool1", "type": "maxpool", "kernel": 3, "stride": 2, "pad": 1},
    {"name": "r6", "type": "relu6"},
    {"name": "dw", "type": "conv", "out_channels": 6, "groups": 6, "kernel": 3, "stride": [2, 1], "pad": 1,
     "activation": "relu"},
    {"name": "conv2", "type": "conv", "out_channels": 10, "kernel": 3, "pad": 1, "bias": False},
    {"name": "bn2", "type": "batchnorm", "eps": 1e-3, "momentum": 0.2},
    {"name": "relu2", "type": "relu"},
    {"name": "pool2", "type": "avgpool", "kernel": 2, "stride": 1, "pad": 1},
    {"name": "fc1", "type": "fc", "out_features": 16, "activation": "relu"},
    {"name": "drop", "type": "dropout", "rate": 0.3},
    {"name": "fc2", "type": "fc", "out_features": 7},
    {"name": "loss", "type": "softmax_cross_entropy"},
]
SHAPE = (3, 10, 14)


def _run_onnx(path, x):
    model = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return model.run(None, {model.get_inputs()[0].name: x})[0]


def _close(got, want):
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("onnx")
    net = build_and_load(tmp, LAYERS, SHAPE, ISA, name="roundtrip", threads=1)
    rng = np.random.default_rng(0)
    state = {k: rng.standard_normal(v.shape).astype(np.float32) * 0.3 for k, v in net.state_dict().items()}
    state["bn2.running_var"] = np.abs(state["bn2.running_var"]) + 0.5
    state["bn2.num_batches_tracked"] = np.array(0)  # (ONNX does not carry the count)
    net.load_state_dict(state)
    x = rng.standard_normal((5, *SHAPE)).astype(np.float32)
    return net, net.export_onnx(tmp / "model.onnx"), x


def test_export_runs_in_onnxruntime_with_our_logits(exported):
    net, path, x = exported
    _close(_run_onnx(path, x), net.forward(x))


def test_import_compile_with_weights_and_load_give_the_same_logits(exported, tmp_path, capsys):
    net, path, x = exported
    out = tmp_path / "net.json"
    assert main(["import", str(path), "-o", str(out)]) == 0
    described = json.loads(out.read_text())
    # the fused ReLUs found again; the standalone one after the batchnorm fused into it; the
    # dropout's rate kept; the depthwise layer's groups (ONNX's group attribute); the batchnorm's
    # eps and momentum (ONNX's 1 - momentum)
    assert [(l["type"], l.get("activation")) for l in described["layers"]] == [
        ("conv", "relu"), ("maxpool", None), ("relu6", None), ("conv", "relu"), ("conv", None), ("batchnorm", "relu"),
        ("avgpool", None), ("fc", "relu"), ("dropout", None), ("fc", None), ("softmax_cross_entropy", None)]
    assert described["layers"][8]["rate"] == pytest.approx(0.3)
    assert described["layers"][3]["groups"] == 6 and "groups" not in described["layers"][4]
    assert (described["layers"][5]["eps"], described["layers"][5]["momentum"]) == (1e-3, 0.2)
    assert described["classes"] == 7 and described["layers"][4]["source"] == "conv2"
    assert main(["compile", str(out), "--arch", ISA, "--weights", str(tmp_path / "net.npz"), "-o",
                 str(tmp_path / "b")]) == 0
    loaded = pr.load(tmp_path / "b", threads=1)  # starts from the recorded weights
    _close(loaded.forward(x), _run_onnx(path, x))
    for k, v in net.state_dict().items():
        np.testing.assert_array_equal(loaded.state_dict()[k], v)


def _model(nodes, inits, out_shape, in_shape=(1, 4, 6, 6), opset=17):
    graph = helper.make_graph(
        nodes, "handmade", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", *in_shape[1:]])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", *out_shape])],
        [numpy_helper.from_array(a, n) for n, a in inits.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def test_handmade_graphs_of_the_other_spellings(tmp_path):
    """Conv without bias from a Constant node, GlobalAveragePool, Reshape(0, -1), MatMul + Add,
    Gemm with transB 0 and alpha / beta, LogSoftmax at the end: onnxruntime's logits."""
    rng = np.random.default_rng(1)
    f32 = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    nodes = [
        helper.make_node("Constant", [], ["w0"], value=numpy_helper.from_array(f32(8, 4, 3, 3))),
        helper.make_node("Conv", ["x", "w0"], ["c0"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c0"], ["r0"]),
        helper.make_node("MaxPool", ["r0"], ["p0"], kernel_shape=[2, 2], strides=[2, 2]),
        helper.make_node("Reshape", ["p0", "shape"], ["flat"]),
        helper.make_node("MatMul", ["flat", "m1"], ["mm"]),
        helper.make_node("Add", ["mm", "b1"], ["a1"]),
        helper.make_node("Relu", ["a1"], ["r1"]),
        helper.make_node("Gemm", ["r1", "g2", "c2"], ["g"], alpha=0.5, beta=2.0),
        helper.make_node("LogSoftmax", ["g"], ["y"], axis=1),
    ]
    inits = {"shape": np.array([0, -1], np.int64), "m1": f32(72, 12), "b1": f32(12), "g2": f32(12, 5), "c2": f32(5)}
    path = tmp_path / "hand.onnx"
    onnx.save(_model(nodes, inits, (5,)), path)
    net_dict, _ = import_onnx(path)
    assert [l["type"] for l in net_dict["layers"]] == ["conv", "maxpool", "fc", "fc", "softmax_cross_entropy"]
    out = tmp_path / "hand.json"
    assert main(["import", str(path), "-o", str(out)]) == 0
    assert main(["compile", str(out), "--arch", ISA, "--weights", str(out.with_suffix(".npz")), "-o",
                 str(tmp_path / "b")]) == 0
    net = pr.load(tmp_path / "b", threads=1)
    x = f32(3, 4, 6, 6)
    logp = _run_onnx(path, x)  # log-probabilities: the logits up to a constant per row
    ours = net.forward(x)
    _close(ours - ours.max(axis=1, keepdims=True), logp - logp.max(axis=1, keepdims=True))

    gap = [helper.make_node("Conv", ["x", "w"], ["c"], kernel_shape=[1, 1]),
           helper.make_node("GlobalAveragePool", ["c"], ["g"]), helper.make_node("Flatten", ["g"], ["f"]),
           helper.make_node("Gemm", ["f", "wf", "bf"], ["y"], transB=1)]
    onnx.save(_model(gap, {"w": f32(6, 4, 1, 1), "wf": f32(3, 6), "bf": f32(3)}, (3,)), path)
    net_dict, _ = import_onnx(path, name="gap")
    assert net_dict["name"] == "gap" and net_dict["layers"][1]["kernel"] == [6, 6]


def test_every_unsupported_node_is_listed_and_nothing_is_written(tmp_path, capsys):
    rng = np.random.default_rng(2)
    f32 = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    nodes = [
        helper.make_node("Conv", ["x", "w0"], ["c0"], pads=[0, 0, 1, 1]),
        helper.make_node("LeakyRelu", ["c0"], ["lr"]),
        helper.make_node("Conv", ["lr", "w1"], ["c1"], group=2, pads=[1, 1, 1, 1]),
        helper.make_node("Tanh", ["c1"], ["y"]),
    ]
    inits = {"w0": f32(4, 4, 2, 2), "w1": f32(4, 2, 3, 3)}
    path = tmp_path / "bad.onnx"
    onnx.save(_model(nodes, inits, (4, 6, 6)), path)
    assert main(["import", str(path), "-o", str(tmp_path / "bad.json")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "4 unsupported node(s)" in err
    for part in ("Conv_0 (Conv): pads [0, 0, 1, 1]", "LeakyRelu_1 (LeakyRelu): operator not supported",
                 "Conv_2 (Conv): group 2", "Tanh_3 (Tanh)"):
        assert part in err, part
    assert not list(tmp_path.glob("bad.json*")) and not list(tmp_path.glob("*.npz"))


def test_a_shortcut_from_the_image_itself_is_refused_by_name(tmp_path):
    """Residual sums import (tests/test_graphs.py); one that adds the model's input itself does not:
    only the first layer reads the image (its packed layout is that layer's)."""
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("Add", ["c", "x"], ["s"]), helper.make_node("GlobalAveragePool", ["s"], ["g"]),
             helper.make_node("Flatten", ["g"], ["f"]), helper.make_node("Gemm", ["f", "fw", "fb"], ["y"], transB=1)]
    inits = {"w": np.ones((4, 4, 3, 3), np.float32), "fw": np.ones((3, 4), np.float32), "fb": np.zeros(3, np.float32)}
    onnx.save(_model(nodes, inits, (3,)), tmp_path / "res.onnx")
    with pytest.raises(ModelImportError, match=r"Add_1\)?.*inputs\[1\]: only the first layer reads 'input'"):
        import_onnx(tmp_path / "res.onnx")


def test_hostile_and_broken_files(tmp_path, capsys):
    junk = tmp_path / "junk.onnx"
    junk.write_bytes(os.urandom(3000))
    with pytest.raises(ModelImportError, match="not an ONNX model"):
        import_onnx(junk)
    with pytest.raises(ModelImportError, match=r"cannot read|no such file|No such file"):
        import_onnx(tmp_path / "missing.onnx")
    # weights in an external file: refused before anything reads it
    model = _model([helper.make_node("Flatten", ["x"], ["f"]), helper.make_node("Gemm", ["f", "w"], ["y"], transB=1)],
                   {"w": np.ones((3, 144), np.float32)}, (3,))
    tensor = model.graph.initializer[0]
    tensor.data_location = TensorProto.EXTERNAL
    tensor.ClearField("raw_data")
    entry = tensor.external_data.add()
    entry.key, entry.value = "location", "../../../etc/passwd"
    (tmp_path / "ext.onnx").write_bytes(model.SerializeToString())
    with pytest.raises(ModelImportError, match="stored in an external file"):
        import_onnx(tmp_path / "ext.onnx")
    # a hostile graph name cannot become a C identifier or a path: the net is renamed
    model = _model([helper.make_node("Flatten", ["x"], ["f"]), helper.make_node("Gemm", ["f", "w"], ["y"], transB=1)],
                   {"w": np.ones((3, 144), np.float32)}, (3,))
    model.graph.name = "../x; rm -rf /"
    model.graph.node[1].name = "gemm\n\x1b[2Jsneaky"  # a node name with a newline and an escape sequence
    onnx.save(model, tmp_path / "name.onnx")
    net_dict, _ = import_onnx(tmp_path / "name.onnx")
    assert net_dict["name"] == "x__rm__rf"
    fc = net_dict["layers"][0]
    assert fc["name"] == "gemm___2Jsneaky" and fc["source"] == "gemm\\n\\x1b[2Jsneaky" and fc["source"].isprintable()


def test_compile_refuses_weights_that_do_not_fit(tmp_path, capsys):
    net_json = tmp_path / "n.json"
    net_json.write_text(json.dumps({"name": "n", "input": {"channels": 3, "height": 4, "width": 4}, "layers": [
        {"name": "fc", "type": "fc", "out_features": 2}, {"name": "loss", "type": "softmax_cross_entropy"}]}))
    np.savez(tmp_path / "w.npz", **{"fc.weight": np.zeros((2, 47), np.float32), "fc.bias": np.zeros(2, np.float32)})
    assert main(["compile", str(net_json), "--arch", ISA, "--weights", str(tmp_path / "w.npz"), "-o",
                 str(tmp_path / "b")]) == 2
    assert "fc.weight: shape (2, 47), expected (2, 48)" in capsys.readouterr().err
    assert not (tmp_path / "b").exists()
    np.save(tmp_path / "one.npy", np.zeros(3))
    (tmp_path / "one.npz").write_bytes((tmp_path / "one.npy").read_bytes())
    assert main(["compile", str(net_json), "--arch", ISA, "--weights", str(tmp_path / "one.npz")]) == 2
    assert "not an .npz file of named arrays" in capsys.readouterr().err
