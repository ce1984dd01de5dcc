"""pcldnn_gen.from_torch: PyTorch models traced into net descriptions whose compiled nets give
PyTorch's logits and gradients; everything unsupported reported at once. Skipped without torch
(an optional extra; CI installs it)."""
from __future__ import annotations

import numpy as np
import pytest
from helpers import RUNNABLE_ISAS, one_sgd_step

import pcldnn_gen
import pcldnn_runtime as pr
from pcldnn_gen.arch import get_arch
from pcldnn_gen.build import build
from pcldnn_gen.errors import ModelImportError
from pcldnn_gen.netspec import parse_netspec

torch = pytest.importorskip("torch")
nn, F = torch.nn, torch.nn.functional


class LeNetStyle(nn.Module):
    """Functional calls in forward, a bias-free conv, view(N, -1), dropout as a call."""

    def __init__(self, p=0.3):
        super().__init__()
        self.p = p
        self.conv1 = nn.Conv2d(3, 6, 5)
        self.conv2 = nn.Conv2d(6, 16, 3, padding=1, bias=False)
        self.fc1 = nn.Linear(16 * 6 * 6, 32)
        self.fc2 = nn.Linear(32, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.relu(self.conv2(x))
        x = x.view(x.size(0), -1)
        return self.fc2(F.dropout(F.relu(self.fc1(x)), self.p, self.training))


def _sequential(p=0.1):
    """Nested Sequentials, stride and asymmetric kernel, padding='same', average pools."""
    return nn.Sequential(
        nn.Sequential(nn.Conv2d(3, 8, (3, 5), stride=(1, 2), padding=(1, 2)), nn.ReLU(inplace=True)),
        nn.MaxPool2d(3, stride=2, padding=1),
        nn.Conv2d(8, 12, 3, padding="same"), nn.ReLU(),
        nn.AvgPool2d(2), nn.Identity(),
        nn.Conv2d(12, 20, 1), nn.ReLU(), nn.AdaptiveAvgPool2d((1, 1)),
        nn.Flatten(), nn.Dropout(p), nn.Linear(20, 7))


@pytest.mark.parametrize("make,shape", [(LeNetStyle, (3, 16, 16)), (_sequential, (3, 12, 20))])
def test_logits_and_gradients_match_pytorch(tmp_path, make, shape):
    torch.manual_seed(0)
    model = make(p=0.0).eval()  # no dropout: the training step's gradients are comparable
    net_dict, state = pcldnn_gen.from_torch(model, shape)
    spec = parse_netspec(net_dict)
    assert spec.layers[-1].type == "softmax_cross_entropy" and spec.classes == net_dict["layers"][-2]["out_features"]
    build(spec, get_arch(RUNNABLE_ISAS[-1]), tmp_path / "b")
    net = pr.load(tmp_path / "b", threads=1)
    net.load_state_dict(state)
    x = np.random.default_rng(0).standard_normal((4, *shape)).astype(np.float32)
    want = model(torch.from_numpy(x)).detach().numpy()
    got = net.forward(x)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    # one SGD step (lr 1, no momentum) moves every weight by minus its mean cross-entropy
    # gradient: compared with autograd's, layer by layer
    labels = np.array([0, 1, 2, 3])
    before = net.state_dict()
    pr.Trainer(net, pr.SGD(lr=1.0)).step(x, labels)
    model.zero_grad()
    F.cross_entropy(model(torch.from_numpy(x)), torch.from_numpy(labels)).backward()
    grads = {n: p.grad.numpy() for n, p in model.named_parameters()}
    after = net.state_dict()
    for layer in (l for l in net_dict["layers"] if l["type"] in ("conv", "fc")):
        key = f"{layer['name']}.weight"
        want_w = grads[f"{layer['source']}.weight"]
        np.testing.assert_allclose(before[key] - after[key], want_w, rtol=1e-3, atol=2e-4 * np.abs(want_w).max())
    # a dropout module's rate carries over
    rates = [l["rate"] for l in pcldnn_gen.from_torch(make(p=0.4), shape)[0]["layers"] if l["type"] == "dropout"]
    assert rates == [0.4]


def _strided():
    """Padding 0 and stride 2 throughout."""
    return nn.Sequential(nn.Conv2d(3, 8, 3, stride=2), nn.ReLU(), nn.Conv2d(8, 16, 3, stride=2, bias=False),
                         nn.ReLU(), nn.Flatten(), nn.Linear(16 * 3 * 3, 10))


def _mlp():
    """An fc-only net."""
    return nn.Sequential(nn.Flatten(), nn.Linear(3 * 8 * 8, 40), nn.ReLU(), nn.Linear(40, 24), nn.ReLU(),
                         nn.Linear(24, 10))


def _separable():
    """Depthwise-separable blocks as MobileNet's (depthwise 3x3, stride 1 and 2, one bias-free;
    pointwise 1x1), without their BatchNorm."""
    return nn.Sequential(nn.Conv2d(3, 16, 3, stride=2, padding=1), nn.ReLU(),
                         nn.Conv2d(16, 16, 3, padding=1, groups=16), nn.ReLU(), nn.Conv2d(16, 24, 1), nn.ReLU(),
                         nn.Conv2d(24, 24, 3, stride=2, padding=1, groups=24, bias=False), nn.ReLU(),
                         nn.Conv2d(24, 32, 1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10))


@pytest.mark.parametrize("make,shape", [(_strided, (3, 15, 15)), (_mlp, (3, 8, 8)), (LeNetStyle, (3, 16, 16)),
                                        (_separable, (3, 18, 14))])
def test_five_sgd_steps_match_torch_optim_sgd(tmp_path, make, shape):
    """Momentum and weight decay as torch.optim.SGD: the same weights after five steps."""
    torch.manual_seed(1)
    model = make() if make is not LeNetStyle else make(p=0.0)
    net_dict, state = pcldnn_gen.from_torch(model, shape)
    build(parse_netspec(net_dict), get_arch(RUNNABLE_ISAS[-1]), tmp_path / "b")
    net = pr.load(tmp_path / "b", threads=1)
    net.load_state_dict(state)
    x0 = np.random.default_rng(2).standard_normal((8, *shape)).astype(np.float32)
    np.testing.assert_allclose(net.forward(x0), model(torch.from_numpy(x0)).detach().numpy(), rtol=1e-4,
                               atol=1e-4 * np.abs(net.forward(x0)).max())
    trainer = pr.Trainer(net, pr.SGD(0.05, momentum=0.9, weight_decay=1e-3))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-3)
    rng = np.random.default_rng(3)
    for _ in range(5):
        x = rng.standard_normal((8, *shape)).astype(np.float32)
        y = rng.integers(0, 10, 8)
        trainer.step(x, y)
        opt.zero_grad()
        F.cross_entropy(model(torch.from_numpy(x)), torch.from_numpy(y)).backward()
        opt.step()
    ours, theirs = pcldnn_gen.source_state(net_dict, net.state_dict()), model.state_dict()
    assert set(ours) == set(theirs)  # bias-free layers have no bias entry on either side
    for key, got in ours.items():
        scale = np.abs(theirs[key.rsplit(".", 1)[0] + ".weight"].numpy()).max()
        np.testing.assert_allclose(got, theirs[key].numpy(), rtol=1e-4, atol=1e-4 * scale)
    # and back: the trained weights load into the PyTorch model under its own names
    model.load_state_dict({k: torch.from_numpy(v) for k, v in ours.items()})
    np.testing.assert_array_equal(model.state_dict()[next(iter(ours))].numpy(), next(iter(ours.values())))


def test_names_come_from_the_modules_and_sources_are_kept():
    net, state = pcldnn_gen.from_torch(_sequential(), (3, 12, 20), name="mine")
    assert net["name"] == "mine"
    convs = [l for l in net["layers"] if l["type"] == "conv"]
    assert [(l["name"], l["source"]) for l in convs] == [("layer_0_0", "0.0"), ("layer_2", "2"), ("layer_6", "6")]
    assert all(l.get("activation") == "relu" for l in convs)  # each ReLU fused into its conv
    assert not any(l["type"] == "relu" for l in net["layers"])
    assert set(state) == {f"{l['name']}.{p}" for l in net["layers"] if l["type"] in ("conv", "fc")
                          for p in ("weight", "bias")}
    assert state["layer_0_0.weight"].shape == (8, 3, 3, 5) and state["layer_0_0.weight"].dtype == np.float32


def test_every_unsupported_node_is_listed_in_one_error():
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8, momentum=None), nn.GELU(approximate="tanh"),
                          nn.Conv2d(8, 8, 3, groups=2), nn.MaxPool2d(2, ceil_mode=True), nn.Flatten(), nn.Linear(8, 5))
    with pytest.raises(ModelImportError) as e:
        pcldnn_gen.from_torch(model, (3, 12, 12))
    msg = str(e.value)
    assert "4 unsupported node(s)" in msg
    for part in ("1 (BatchNorm2d): momentum=None", "2 (GELU): approximate='tanh' (only 'none'",
                 "3 (Conv2d): groups=2 (1, or depthwise",
                 "4 (MaxPool2d): ceil_mode=True"):
        assert part in msg, part


class Residual(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(4, 4, 3, padding=1)
        self.fc = nn.Linear(4 * 6 * 6, 3)

    def forward(self, x):
        return self.fc(torch.flatten(self.conv(x) + x, 1))


@pytest.mark.parametrize("model,shape,message", [
    (Residual(), (4, 6, 6), r"only the first layer reads 'input'"),  # the add reads the image too
    (nn.Sequential(nn.Conv2d(3, 4, 3), nn.Linear(4, 2)), (3, 5, 5), r"without a flatten before it"),
    (nn.Sequential(nn.Flatten(), nn.Linear(10, 2)), (3, 5, 5), r"takes 10 input features, the tensor before it has 75"),
    (nn.Sequential(nn.Flatten(), nn.Linear(75, 2), nn.Softmax(dim=1), nn.Linear(2, 2)), (3, 5, 5),
     r"softmax is supported only as the last node"),
    (nn.Sequential(nn.Conv2d(3, 4, 3)), (3, 5, 5), r"must end with a linear layer"),
    (nn.Sequential(nn.Flatten(), nn.Linear(75, 2)), (3, 5), r"input_shape must be \(C, H, W\)"),
    (nn.Sequential(nn.Flatten(), nn.Linear(75, 2)), (3, 5, 0), r"input_shape must be"),
    ("not a module", (3, 5, 5), r"expected a torch.nn.Module"),
])
def test_models_the_net_description_cannot_express(model, shape, message):
    with pytest.raises(ModelImportError, match=message):
        pcldnn_gen.from_torch(model, shape)


def test_nan_weights_are_refused():
    model = nn.Sequential(nn.Flatten(), nn.Linear(12, 2))
    with torch.no_grad():
        model[1].weight[0, 0] = float("nan")
    with pytest.raises(ModelImportError, match=r"1 \(Linear\) weight: holds NaN"):
        pcldnn_gen.from_torch(model, (3, 2, 2))


def _mobilenet_v1_style():
    """MobileNet's conv-BN-ReLU blocks: a strided stem, a depthwise and a pointwise convolution,
    each bias-free and followed by a BatchNorm2d (one with its own eps and momentum)."""
    return nn.Sequential(nn.Conv2d(3, 16, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU(),
                         nn.Conv2d(16, 16, 3, padding=1, groups=16, bias=False), nn.BatchNorm2d(16, eps=1e-3, momentum=0.3),
                         nn.ReLU(), nn.Conv2d(16, 24, 1, bias=False), nn.BatchNorm2d(24), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(24, 10))


def test_batchnorm_nets_match_pytorch_in_both_modes_and_over_five_sgd_steps(tmp_path):
    """BatchNorm2d as PyTorch computes it: evaluation by the running statistics, training by the
    batch's (biased variance), the running ones updated with the unbiased variance and the
    layer's momentum, num_batches_tracked counted; five SGD steps (momentum 0.9, weight decay
    5e-4) leave every parameter and running statistic within 1e-4 of torch.optim.SGD's, and the
    two nets agree in evaluation after them. The ReLU after each BN is fused into it."""
    torch.manual_seed(3)
    model = _mobilenet_v1_style()
    with torch.no_grad():  # statistics and affine parameters away from their defaults
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.3, 0.3)
                m.running_mean.uniform_(-0.2, 0.2)
                m.running_var.uniform_(0.5, 2.0)
                m.num_batches_tracked.fill_(7)
    shape = (3, 20, 18)
    net_dict, state = pcldnn_gen.from_torch(model, shape)
    assert [(l["type"], l.get("activation")) for l in net_dict["layers"][:3]] == [
        ("conv", None), ("batchnorm", "relu"), ("conv", None)]
    assert net_dict["layers"][3]["eps"] == 1e-3 and net_dict["layers"][3]["momentum"] == 0.3
    build(parse_netspec(net_dict), get_arch(RUNNABLE_ISAS[-1]), tmp_path / "b")
    net = pr.load(tmp_path / "b", threads=2)
    net.load_state_dict(state)
    rng = np.random.default_rng(4)
    x = (rng.standard_normal((6, *shape)) * 2 + 0.5).astype(np.float32)

    def close(got, want, what):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * max(np.abs(want).max(), 1e-6), err_msg=what)

    model.eval()
    close(net.forward(x), model(torch.from_numpy(x)).detach().numpy(), "eval logits")
    model.train()
    close(net.forward(x, training=True), model(torch.from_numpy(x)).detach().numpy(), "train logits")
    ours, theirs = pcldnn_gen.source_state(net_dict, net.state_dict()), model.state_dict()
    for key in (k for k in theirs if "running" in k or "num_batches" in k):
        close(ours[key], theirs[key].numpy(), key)
    assert int(ours["1.num_batches_tracked"]) == 8

    trainer = pr.Trainer(net, pr.SGD(0.05, momentum=0.9, weight_decay=5e-4))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)
    for _ in range(5):
        xs = (rng.standard_normal((6, *shape)) * 2 + 0.5).astype(np.float32)
        ys = rng.integers(0, 10, 6)
        trainer.step(xs, ys)
        opt.zero_grad()
        F.cross_entropy(model(torch.from_numpy(xs)), torch.from_numpy(ys)).backward()
        opt.step()
    ours, theirs = pcldnn_gen.source_state(net_dict, net.state_dict()), model.state_dict()
    assert set(ours) == set(theirs)
    for key, got in ours.items():
        close(got, theirs[key].numpy(), key)
    model.eval()
    close(net.eval().forward(x), model(torch.from_numpy(x)).detach().numpy(), "eval logits after training")


def _mobilenet_v2_blocks():
    """MobileNetV2's ReLU6: fused into the BatchNorm2d before it, standalone after a convolution
    (as nn.ReLU6 and as F.relu6 in a forward)."""
    class Blocks(nn.Module):
        def __init__(self):
            super().__init__()
            self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(16),
                                      nn.ReLU6(inplace=True))
            self.dw = nn.Conv2d(16, 16, 3, padding=1, groups=16)
            self.project = nn.Sequential(nn.Conv2d(16, 24, 1, bias=False), nn.BatchNorm2d(24))
            self.head = nn.Sequential(nn.ReLU6(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(24, 10))

        def forward(self, x):
            return self.head(self.project(F.relu6(self.dw(self.stem(x)))))
    return Blocks()


def test_relu6_fused_into_batchnorm_and_standalone_matches_pytorch(tmp_path):
    """ReLU6 clips at 0 and 6 in both places: logits in both modes and one SGD step's weight
    gradients as PyTorch's; inputs and scales such that some activations pass 6."""
    torch.manual_seed(5)
    model = _mobilenet_v2_blocks()
    with torch.no_grad():  # scales that take some normalized values past 6
        model.stem[1].weight.fill_(4.0)
        model.project[1].weight.fill_(4.0)
    shape = (3, 16, 14)
    net_dict, state = pcldnn_gen.from_torch(model, shape)
    assert [(l["type"], l.get("activation")) for l in net_dict["layers"][:6]] == [
        ("conv", None), ("batchnorm", "relu6"), ("conv", None), ("relu6", None), ("conv", None), ("batchnorm", "relu6")]
    build(parse_netspec(net_dict), get_arch(RUNNABLE_ISAS[-1]), tmp_path / "b")
    net = pr.load(tmp_path / "b", threads=2)
    net.load_state_dict(state)
    x = (np.random.default_rng(6).standard_normal((4, *shape)) * 8).astype(np.float32)
    model.eval()
    want = model(torch.from_numpy(x)).detach().numpy()
    np.testing.assert_allclose(net.forward(x), want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    model.train()
    want = model(torch.from_numpy(x)).detach().numpy()
    bn = model.stem[1]  # the clip is reached (computed without moving the running statistics)
    stem = F.batch_norm(model.stem[0](torch.from_numpy(x)), None, None, bn.weight, bn.bias, training=True)
    assert (stem > 6).any()
    np.testing.assert_allclose(net.forward(x, training=True), want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    moves, grads = one_sgd_step(net, model, x, np.arange(4))
    for layer in (l for l in net_dict["layers"] if l["type"] in ("conv", "fc", "batchnorm")):
        g, key = grads[f"{layer['source']}.weight"], f"{layer['name']}.weight"
        np.testing.assert_allclose(moves[key], g, rtol=1e-3, atol=2e-4 * np.abs(g).max(), err_msg=key)


def test_the_table_builds_the_modules_it_reads():
    """torch_module makes each layer's PyTorch module from the row from_torch reads it by: a chain
    built so (fused activations as modules after their layer) imports as the same layers."""
    from dataclasses import replace

    from pcldnn_gen.netspec import parse_netspec
    from pcldnn_gen.torch_frontend import torch_module
    spec = parse_netspec({"name": "t", "input": {"channels": 3, "height": 10, "width": 10}, "layers": [
        {"name": "c", "type": "conv", "out_channels": 8, "kernel": 3, "pad": 1, "activation": "relu"},
        {"name": "n", "type": "batchnorm", "activation": "silu", "eps": 1e-3, "momentum": 0.2},
        {"name": "p", "type": "maxpool", "kernel": 2}, {"name": "g", "type": "gelu"},
        {"name": "a", "type": "avgpool", "kernel": 3, "stride": 1, "pad": 1}, {"name": "s", "type": "sigmoid"},
        {"name": "d", "type": "dropout", "rate": 0.25}, {"name": "f", "type": "fc", "out_features": 4, "bias": False},
        {"name": "loss", "type": "softmax_cross_entropy"}]})
    modules = []
    for layer in spec.layers[:-1]:
        if layer.type == "fc":
            modules.append(nn.Flatten())
        modules.append(torch_module(layer))
        if layer.act is not None and layer.type != layer.activation:
            modules.append(torch_module(replace(layer, type=layer.activation)))
    back, _ = pcldnn_gen.from_torch(nn.Sequential(*modules), (3, 10, 10))

    def fields(layer):
        return (layer.type, layer.activation, layer.kernel, layer.stride, layer.pad, layer.rate, layer.eps,
                layer.momentum, layer.bias, layer.out_shape)
    assert [fields(l) for l in parse_netspec(back).layers] == [fields(l) for l in spec.layers]


# torchvision.ops.stochastic_depth as torchvision writes it (torchvision is not installed here):
# its module is built from this source, so torch.fx.wrap keeps the function a call in a trace
TORCHVISION_STOCHASTIC_DEPTH = '''
import torch
from torch import Tensor, nn


def stochastic_depth(input: Tensor, p: float, mode: str, training: bool = True) -> Tensor:
    if p < 0.0 or p > 1.0:
        raise ValueError(f"drop probability has to be between 0 and 1, but got {p}")
    if mode not in ["batch", "row"]:
        raise ValueError(f"mode has to be either 'batch' or 'row', but got {mode}")
    if not training or p == 0.0:
        return input
    survival_rate = 1.0 - p
    size = [input.shape[0]] + [1] * (input.ndim - 1) if mode == "row" else [1] * input.ndim
    noise = torch.empty(size, dtype=input.dtype, device=input.device)
    noise = noise.bernoulli_(survival_rate)
    if survival_rate > 0.0:
        noise.div_(survival_rate)
    return input * noise


torch.fx.wrap("stochastic_depth")


class StochasticDepth(nn.Module):
    def __init__(self, p: float, mode: str) -> None:
        super().__init__()
        self.p = p
        self.mode = mode

    def forward(self, input: Tensor) -> Tensor:
        return stochastic_depth(input, self.p, self.mode, self.training)
'''


def _torchvision_stochastic_depth():
    import types
    module = types.ModuleType("torchvision.ops.stochastic_depth")
    exec(compile(TORCHVISION_STOCHASTIC_DEPTH, module.__name__, "exec"), module.__dict__)
    return module.StochasticDepth


@pytest.mark.parametrize("p,mode,want", [(0.2, "row", ("drop_path", 0.2)), (0.0, "row", None),
                                         (0.2, "batch", "mode='batch' \\(only 'row'")])
def test_torchvisions_stochastic_depth_is_drop_path(tmp_path, p, mode, want):
    """A residual branch behind torchvision's StochasticDepth: a drop_path layer of its
    probability (row mode), nothing at probability 0, refused by name in batch mode; evaluation
    logits as PyTorch's; in training each image's branch is kept (scaled by 1/(1-p)) or dropped."""
    depth = _torchvision_stochastic_depth()

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.stem, self.branch = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 8, 3, padding=1)
            self.depth, self.head = depth(p, mode), nn.Linear(8 * 6 * 6, 4)

        def forward(self, x):
            x = self.stem(x)
            return self.head(torch.flatten(x + self.depth(self.branch(x)), 1))

    torch.manual_seed(0)
    model = Block()
    if isinstance(want, str):
        with pytest.raises(ModelImportError, match=want):
            pcldnn_gen.from_torch(model, (3, 6, 6))
        return
    net_dict, state = pcldnn_gen.from_torch(model, (3, 6, 6))
    dropping = [(l["type"], l["rate"]) for l in net_dict["layers"] if l["type"] == "drop_path"]
    assert dropping == ([want] if want else [])
    build(parse_netspec(net_dict), get_arch(RUNNABLE_ISAS[-1]), tmp_path / "b")
    net = pr.load(tmp_path / "b", threads=2)
    net.load_state_dict(state)
    x = np.random.default_rng(3).standard_normal((64, 3, 6, 6)).astype(np.float32)
    want_logits = model.eval()(torch.from_numpy(x)).detach().numpy()
    np.testing.assert_allclose(net.forward(x), want_logits, rtol=1e-4, atol=1e-4 * np.abs(want_logits).max())
    if want:
        layer = net.layers[next(l["name"] for l in net_dict["layers"] if l["type"] == "drop_path")]
        branch = net.layers[layer.spec.inputs[0]].forward(net.layers["stem"].forward(x))
        xb, yb, aux = layer.input_blocked(branch, "t.x"), layer.output_buffer("t.y", 64), layer.aux_buffer(64)
        layer.forward_blocked(xb, yb, aux, training=True)
        out = layer.output_from_blocked(yb)
        kept = [np.allclose(out[n], branch[n] / (1 - p), rtol=1e-6) for n in range(64)]
        dropped = [not out[n].any() for n in range(64)]
        assert all(k or d for k, d in zip(kept, dropped)) and 0 < sum(dropped) < 64
