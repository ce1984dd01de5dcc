"""Nets that are graphs (net.json `inputs`, `add`, `concat`): residual blocks with BatchNorm and
a concatenation, run in file order with each activation's gradient summed over its readers,
against the same graph written in PyTorch; and the description's checks of a graph."""
from __future__ import annotations

import json

import numpy as np
import pytest
from bf16_emulation import BF16_BUILDS
from helpers import RUNNABLE_ISAS, build_and_load

import pcldnn_runtime as pr
from pcldnn_gen.arch import get_arch
from pcldnn_gen.build import build
from pcldnn_gen.errors import NetSpecError
from pcldnn_gen.netspec import parse_netspec

torch = pytest.importorskip("torch")
nn, F = torch.nn, torch.nn.functional

SHAPE = (3, 12, 10)


def _conv(name, oc, k=3, stride=1, inputs=None):
    return {"name": name, "type": "conv", "out_channels": oc, "kernel": k, "stride": stride, "pad": k // 2,
            "bias": False, **({"inputs": inputs} if inputs else {})}


def _bn(name, relu=False):
    return {"name": name, "type": "batchnorm", **({"activation": "relu"} if relu else {})}


# A ResNet stem and two basic blocks (an identity shortcut; a strided one through a 1x1
# projection), then the channels of the second block's sum and of its first branch concatenated
# (24 + 24: a block boundary on AVX2, inside a block on AVX-512), a global average and the logits.
LAYERS = [
    _conv("stem", 16), _bn("bn0", relu=True),
    _conv("c1", 16), _bn("bn1", relu=True), _conv("c2", 16), _bn("bn2"),
    {"name": "add1", "type": "add", "inputs": ["bn2", "bn0"], "activation": "relu"},
    _conv("down", 24, k=1, stride=2), _bn("bnd"),
    _conv("c3", 24, stride=2, inputs=["add1"]), _bn("bn3", relu=True), _conv("c4", 24), _bn("bn4"),
    {"name": "add2", "type": "add", "inputs": ["bn4", "bnd"], "activation": "relu"},
    {"name": "cat", "type": "concat", "inputs": ["add2", "bn3"]},
    {"name": "gap", "type": "global_avgpool"},
    {"name": "fc", "type": "fc", "out_features": 10},
    {"name": "loss", "type": "softmax_cross_entropy"},
]


class Torch(nn.Module):
    """The same graph in PyTorch, its modules under our layer names."""

    def __init__(self):
        super().__init__()
        m: dict[str, nn.Module] = {}
        channels = {"stem": (3, 16), "c1": (16, 16), "c2": (16, 16), "down": (16, 24), "c3": (16, 24), "c4": (24, 24)}
        for layer in LAYERS:
            if layer["type"] == "conv":
                ic, oc = channels[layer["name"]]
                m[layer["name"]] = nn.Conv2d(ic, oc, layer["kernel"], layer["stride"], layer["pad"], bias=False)
            elif layer["type"] == "batchnorm":
                m[layer["name"]] = nn.BatchNorm2d(24 if layer["name"] in ("bnd", "bn3", "bn4") else 16)
        m["fc"] = nn.Linear(48, 10)
        self.m = nn.ModuleDict(m)

    def forward(self, x):
        m = self.m
        a0 = F.relu(m["bn0"](m["stem"](x)))
        b = m["bn2"](m["c2"](F.relu(m["bn1"](m["c1"](a0)))))
        a1 = F.relu(b + a0)
        d = m["bnd"](m["down"](a1))
        b3 = F.relu(m["bn3"](m["c3"](a1)))
        a2 = F.relu(m["bn4"](m["c4"](b3)) + d)
        cat = torch.cat([a2, b3], dim=1)
        return m["fc"](torch.flatten(F.adaptive_avg_pool2d(cat, 1), 1))


def close(got, want, what):
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * max(float(np.abs(want).max()), 1e-6), err_msg=what)


def _ours_to_torch(state):
    return {f"m.{k}": torch.from_numpy(np.asarray(v)) for k, v in state.items()}


def test_a_residual_graph_matches_pytorch(tmp_path, isa):
    """Logits in evaluation and training, the running statistics, and five SGD steps (momentum
    0.9, weight decay 5e-4) within 1e-4 of the same graph in PyTorch: the shortcut's gradient
    is the sum of both branches', the concat's gradient split back to its inputs."""
    net = build_and_load(tmp_path, LAYERS, SHAPE, isa, name="res", threads=2)
    torch.manual_seed(0)
    model = Torch()
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, nn.BatchNorm2d):
                mod.weight.uniform_(0.5, 1.5)
                mod.bias.uniform_(-0.3, 0.3)
    net.load_state_dict({k[2:]: v.numpy() for k, v in model.state_dict().items()})
    rng = np.random.default_rng(1)
    x = rng.standard_normal((4, *SHAPE)).astype(np.float32)

    model.eval()
    close(net.forward(x), model(torch.from_numpy(x)).detach().numpy(), "eval logits")
    model.train()
    trainer = pr.Trainer(net, pr.SGD(0.05, momentum=0.9, weight_decay=5e-4))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)
    for step in range(5):
        xs = rng.standard_normal((4, *SHAPE)).astype(np.float32)
        ys = rng.integers(0, 10, 4)
        if step == 0:
            close(net.forward(xs, training=True), model(torch.from_numpy(xs)).detach().numpy(), "train logits")
        trainer.step(xs, ys)
        opt.zero_grad()
        F.cross_entropy(model(torch.from_numpy(xs)), torch.from_numpy(ys)).backward()
        opt.step()
    ours, theirs = net.state_dict(), {k[2:]: v.numpy() for k, v in model.state_dict().items()}
    assert set(ours) == set(theirs)
    for key, value in ours.items():
        close(value, theirs[key], key)
    model.eval()
    close(net.eval().forward(x), model(torch.from_numpy(x)).detach().numpy(), "eval logits after training")


def test_an_evaluation_forward_frees_each_activation_after_its_last_reader(tmp_path):
    """No backward pass follows an evaluation forward: an activation's buffer returns to a pool
    once its last reader has run. On LAYERS (two residual blocks, a concat) at most four are
    live at once against the training workspace's 18, and the logits equal a training-mode
    workspace's evaluation of the same batch (the running statistics, no buffer reused early)."""
    net = build_and_load(tmp_path, LAYERS, SHAPE, RUNNABLE_ISAS[-1], name="res", threads=2)
    x = np.random.default_rng(4).standard_normal((5, *SHAPE)).astype(np.float32)
    logits = net.eval().forward(x)
    assert net.evaluation_buffers(5).pooled <= 4 < len(net.workspace(5).acts)
    net.forward(x, training=True)  # the running statistics move: evaluate from them, both ways
    want = net.forward(x)
    assert net.evaluation_buffers(5).pooled <= 4
    np.testing.assert_array_equal(net.predict(x, batch_size=2)[:2], net.forward(x[:2]))
    assert np.abs(want - logits).max() > 0  # the statistics did move
    np.testing.assert_array_equal(net.forward(x), want)


def _net(layers):
    return {"name": "g", "input": {"channels": 3, "height": 8, "width": 8}, "layers": layers}


BLOCK = [_conv("a", 8), _conv("b", 8), {"name": "s", "type": "add", "inputs": ["b", "a"]},
         {"name": "gap", "type": "global_avgpool"}, {"name": "fc", "type": "fc", "out_features": 4},
         {"name": "loss", "type": "softmax_cross_entropy"}]


def _edit(index, **fields):
    layers = [dict(layer) for layer in BLOCK]
    layers[index].update(fields)
    return layers


@pytest.mark.parametrize("layers,message", [
    (_edit(2, inputs=["b", "later"]), r"layers\[2\]\.inputs\[1\]: \"later\" is not an earlier layer"),
    (_edit(1, inputs=["s"]), r"layers\[1\]\.inputs\[0\]: \"s\" is not an earlier layer"),
    (_edit(1, inputs=["b"]), r"layers\[1\]\.inputs\[0\]: \"b\" is not an earlier layer"),
    (_edit(2, inputs=["b", "b"]), r"layers\[2\]\.inputs\[1\]: 'b' is named twice"),
    (_edit(2, inputs=["b"]), r"layers\[2\]\.inputs: must be a list of two or more layer names"),
    ([*BLOCK[:2], {"name": "s", "type": "add"}, *BLOCK[3:]],
     r"layers\[2\]\.inputs: an add layer needs its inputs"),
    (_edit(1, inputs=["a", "input"]), r"layers\[1\]\.inputs: must be a list of one layer name"),
    (_edit(1, inputs=["input"]), r"layers\[1\]\.inputs\[0\]: only the first layer reads 'input'"),
    (_edit(1, out_channels=6), r"layers\[2\]\.inputs\[1\]: 'a' has shape 8x8x8, 'b' 6x8x8: add needs the same shape"),
    (_edit(1, stride=2), r"layers\[2\]\.inputs\[1\]: 'a' has shape 8x8x8, 'b' 8x4x4"),
    ([*BLOCK[:2], {"name": "s", "type": "concat", "inputs": ["b", "a"], "activation": "relu"}, *BLOCK[3:]],
     r"layers\[2\]\.activation: unknown field"),
    ([*BLOCK[:3], {"name": "x", "type": "relu", "inputs": ["a"]}, *BLOCK[3:]],
     r"layers\[2\]: the output of layer 's' is not read by any layer"),
    ([*BLOCK[:5], {"name": "loss", "type": "softmax_cross_entropy", "inputs": ["gap"]}],
     r"layers\[5\]\.inputs: the loss reads the layer before it \('fc'\)"),
    (_edit(2, inputs=["b", 3]), r"layers\[2\]\.inputs\[1\]: 3 is not an earlier layer"),
])
def test_graph_descriptions_are_checked(layers, message):
    with pytest.raises(NetSpecError, match=message):
        parse_netspec(_net(layers))


def test_concat_lays_channels_one_after_another_and_add_keeps_the_shape():
    layers = [_conv("a", 5), _conv("b", 7, inputs=["a"]), {"name": "cat", "type": "concat", "inputs": ["a", "b"]},
              {"name": "gap", "type": "global_avgpool"}, {"name": "fc", "type": "fc", "out_features": 3}]
    spec = parse_netspec(_net(layers))
    cat = spec.layer("cat")
    assert cat.in_shapes == ((5, 8, 8), (7, 8, 8)) and cat.out_shape == (12, 8, 8) and cat.inputs == ("a", "b")
    assert spec.layer("b").inputs == ("a",) and spec.layer("a").inputs == ("input",)


def test_a_graph_exports_to_onnx_with_its_logits(tmp_path):
    """Sum and Concat nodes read the tensors their layer's inputs name: onnxruntime gives the
    net's evaluation logits."""
    onnx = pytest.importorskip("onnx")
    ort = pytest.importorskip("onnxruntime")
    net = build_and_load(tmp_path, LAYERS, SHAPE, RUNNABLE_ISAS[-1], name="resx", threads=1)
    rng = np.random.default_rng(3)
    x = rng.standard_normal((3, *SHAPE)).astype(np.float32)
    net.forward(x, training=True)  # running statistics away from (0, 1)
    path = net.export_onnx(tmp_path / "res.onnx")
    assert {n.op_type for n in onnx.load(path).graph.node} >= {"Sum", "Concat", "BatchNormalization"}
    runner = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    want = net.forward(x)
    got = runner.run(None, {"input": x})[0]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


@pytest.mark.parametrize("arch", BF16_BUILDS)
def test_a_residual_graph_trains_in_bf16_like_fp32(tmp_path, arch):
    """A bf16 build of the graph (AMX tiles, or vdpbf16ps) from the same weights: three SGD steps'
    losses within 1% and the logits after them within 2% of the fp32 build's (bf16 operands:
    2^-8 relative each, the activations inside a block bf16 as well; add and concat stay fp32)."""
    spec = parse_netspec({"name": "rb", "input": dict(zip(("channels", "height", "width"), SHAPE, strict=True)),
                          "layers": LAYERS})
    x = np.random.default_rng(0).standard_normal((4, *SHAPE)).astype(np.float32)
    results = []
    for target, precision in ((get_arch(RUNNABLE_ISAS[-1]), "fp32"), (arch, "bf16")):
        build(spec, target, tmp_path / precision, precision=precision)
        net = pr.load(tmp_path / precision, threads=2)
        if results:
            net.load_state_dict(results[0][2])
        state = net.state_dict()
        trainer = pr.Trainer(net, pr.SGD(0.05, momentum=0.9))
        losses = [trainer.step(x, np.arange(4)) for _ in range(3)]
        results.append((np.array(losses), net.forward(x), state))
    (l32, y32, _), (l16, y16, _) = results
    np.testing.assert_allclose(l16, l32, rtol=0.01)
    assert np.abs(y16 - y32).max() <= 0.02 * np.abs(y32).max()


def test_a_graph_comes_back_from_onnx(tmp_path):
    """pcldnn-gen import of the exported graph (Sum, Concat, BatchNormalization nodes naming the
    tensors they read) gives the same description's graph and, compiled with its weights, the
    logits onnxruntime gives."""
    pytest.importorskip("onnx")
    ort = pytest.importorskip("onnxruntime")
    from pcldnn_gen.cli import main
    net = build_and_load(tmp_path, LAYERS, SHAPE, RUNNABLE_ISAS[-1], name="reso", threads=1)
    x = np.random.default_rng(4).standard_normal((3, *SHAPE)).astype(np.float32)
    net.forward(x, training=True)
    path = net.export_onnx(tmp_path / "res.onnx")
    assert main(["import", str(path), "-o", str(tmp_path / "net.json")]) == 0
    described = parse_netspec(json.loads((tmp_path / "net.json").read_text()))
    assert [len(l.inputs) for l in described.layers if l.type in ("add", "concat")] == [2, 2, 2]
    assert main(["compile", str(tmp_path / "net.json"), "--arch", RUNNABLE_ISAS[-1], "--weights",
                 str(tmp_path / "net.npz"), "-o", str(tmp_path / "b")]) == 0
    got = pr.load(tmp_path / "b", threads=1).forward(x)
    want = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"input": x})[0]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


# A squeeze-and-excitation block (EfficientNet's): the pooled channels through two 1x1
# convolutions gate every pixel of the block's output (a C x 1 x 1 input of a mul, written first
# as torchvision writes `scale * x`), then an element-wise product of two images.
SE_LAYERS = [
    _conv("stem", 24), {"name": "bn0", "type": "batchnorm", "activation": "silu"},
    {"name": "pool", "type": "global_avgpool"},
    {"name": "fc1", "type": "conv", "out_channels": 6, "kernel": 1}, {"name": "act1", "type": "silu"},
    {"name": "fc2", "type": "conv", "out_channels": 24, "kernel": 1}, {"name": "gate", "type": "sigmoid"},
    {"name": "se", "type": "mul", "inputs": ["gate", "bn0"]},
    _conv("c1", 24, k=1), {"name": "both", "type": "mul", "inputs": ["c1", "se"]},
    {"name": "gap", "type": "global_avgpool"}, {"name": "fc", "type": "fc", "out_features": 10},
    {"name": "loss", "type": "softmax_cross_entropy"},
]


class TorchSE(nn.Module):
    def __init__(self):
        super().__init__()
        self.m = nn.ModuleDict({"stem": nn.Conv2d(3, 24, 3, 1, 1, bias=False), "bn0": nn.BatchNorm2d(24),
                                "fc1": nn.Conv2d(24, 6, 1), "fc2": nn.Conv2d(6, 24, 1),
                                "c1": nn.Conv2d(24, 24, 1, bias=False), "fc": nn.Linear(24, 10)})

    def forward(self, x):
        m = self.m
        a = F.silu(m["bn0"](m["stem"](x)))
        se = torch.sigmoid(m["fc2"](F.silu(m["fc1"](F.adaptive_avg_pool2d(a, 1))))) * a
        return m["fc"](torch.flatten(F.adaptive_avg_pool2d(m["c1"](se) * se, 1), 1))


def test_squeeze_and_excitation_matches_pytorch(tmp_path, isa):
    """mul, broadcast (a per-channel gate) and element-wise: logits in both modes and the
    parameters after three SGD steps within 1e-4 of PyTorch's, each input's gradient the other
    input times dy (the gate's summed over the pixels)."""
    net = build_and_load(tmp_path, SE_LAYERS, SHAPE, isa, name="se", threads=2)
    torch.manual_seed(2)
    model = TorchSE()
    net.load_state_dict({k[2:]: v.numpy() for k, v in model.state_dict().items()})
    rng = np.random.default_rng(5)
    x = rng.standard_normal((3, *SHAPE)).astype(np.float32)

    model.eval()
    close(net.forward(x), model(torch.from_numpy(x)).detach().numpy(), "eval logits")
    model.train()
    close(net.forward(x, training=True), model(torch.from_numpy(x)).detach().numpy(), "train logits")
    trainer = pr.Trainer(net, pr.SGD(0.1, momentum=0.9))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for _ in range(3):
        ys = rng.integers(0, 10, 3)
        trainer.step(x, ys)
        opt.zero_grad()
        F.cross_entropy(model(torch.from_numpy(x)), torch.from_numpy(ys)).backward()
        opt.step()
    theirs = {k[2:]: v.numpy() for k, v in model.state_dict().items()}
    for key, value in net.state_dict().items():
        close(value, theirs[key], key)


@pytest.mark.parametrize("inputs,shapes", [
    (["a", "p"], r"8x8x8 and 5x1x1: mul takes two inputs of one shape, or a C x H x W and a C x 1 x 1"),
    (["p", "q"], None),  # two C x 1 x 1: one shape
])
def test_mul_needs_one_shape_or_a_per_channel_scale(inputs, shapes):
    layers = [_conv("a", 8), {"name": "pool", "type": "global_avgpool"},
              {"name": "p", "type": "conv", "out_channels": 5, "kernel": 1},
              {"name": "q", "type": "conv", "out_channels": 5, "kernel": 1, "inputs": ["p"]},
              {"name": "m", "type": "mul", "inputs": inputs}, {"name": "fc", "type": "fc", "out_features": 2,
                                                               "inputs": ["m"]}]
    if shapes is None:
        assert parse_netspec(_net(layers)).layer("m").out_shape == (5, 1, 1)
    else:
        with pytest.raises(NetSpecError, match=r"layers\[\d\]\.inputs: inputs of shapes " + shapes):
            parse_netspec(_net(layers))


def test_squeeze_and_excitation_goes_to_onnx_and_back(tmp_path):
    """Mul and Sigmoid nodes: onnxruntime's logits are ours, and the import gives the graph back."""
    pytest.importorskip("onnx")
    ort = pytest.importorskip("onnxruntime")
    from pcldnn_gen.onnx_frontend import import_onnx
    net = build_and_load(tmp_path, SE_LAYERS, SHAPE, RUNNABLE_ISAS[-1], name="se", threads=1)
    x = np.random.default_rng(6).standard_normal((2, *SHAPE)).astype(np.float32)
    net.forward(x, training=True)  # running statistics away from (0, 1)
    path = net.export_onnx(tmp_path / "se.onnx")
    want = net.forward(x)
    got = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"input": x})[0]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    back, _ = import_onnx(path)
    assert [(l["type"], l.get("activation")) for l in back["layers"]] == [
        (l["type"] if l["type"] != "global_avgpool" else "avgpool", l.get("activation")) for l in SE_LAYERS]
