"""Whole-net backward: finite-difference gradient checks, VGG-A against numpy, memory use."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import reference as ref
from helpers import ISA_PARAMS, NETS, REPO, RUNNABLE_ISAS, VECTOR_ISA, check_relu_pool_masks

import pcldnn_runtime as pr
from pcldnn_gen.arch import get_arch
from pcldnn_gen.build import build
from pcldnn_gen.netspec import load_netspec, parse_netspec

SMALL_NETS = {
    # the chain: conv+relu, pool, conv, fc+relu, fc, loss
    "maxpool": [
        {"name": "conv1", "type": "conv", "out_channels": 10, "kernel": 3, "pad": 1, "activation": "relu"},
        {"name": "pool1", "type": "maxpool", "kernel": 2},
        {"name": "conv2", "type": "conv", "out_channels": 12, "kernel": 3, "stride": 2, "pad": 1},
        {"name": "fc1", "type": "fc", "out_features": 20, "activation": "relu"},
        {"name": "fc2", "type": "fc", "out_features": 7},
        {"name": "loss", "type": "softmax_cross_entropy"}],
    # overlapping average pooling, a standalone relu, an asymmetric strided conv
    "avgpool": [
        {"name": "conv1", "type": "conv", "out_channels": 9, "kernel": [3, 5], "stride": [1, 2], "pad": [1, 2]},
        {"name": "relu1", "type": "relu"},
        {"name": "pool1", "type": "avgpool", "kernel": 3, "stride": 2, "pad": 1},
        {"name": "conv2", "type": "conv", "out_channels": 16, "kernel": 1, "activation": "relu"},
        {"name": "fc1", "type": "fc", "out_features": 5},
        {"name": "loss", "type": "softmax_cross_entropy"}],
    # a pooling on the input before the first weighted layer (nothing below it needs a
    # gradient: the pooling's backward pass is skipped), then a 3-channel conv that is not the
    # net's first layer (its input is blocked, not packed: the few-channel kernels)
    "pool_first": [
        {"name": "pool0", "type": "maxpool", "kernel": 2, "stride": 1},
        {"name": "conv1", "type": "conv", "out_channels": 6, "kernel": 3, "pad": 1, "activation": "relu"},
        {"name": "fc1", "type": "fc", "out_features": 5},
        {"name": "loss", "type": "softmax_cross_entropy"}],
}


def _small_net(tmp_path, which, isa):
    spec = parse_netspec({"name": f"g{which}", "input": {"channels": 3, "height": 10, "width": 9},
                          "layers": SMALL_NETS[which]})
    build(spec, get_arch(isa), tmp_path / "net")
    net = pr.load(tmp_path / "net", threads=2, seed=3)
    rng = np.random.default_rng(8)
    for layer in net.layers.values():
        if hasattr(layer, "bias"):
            layer.bias = 0.1 * rng.standard_normal(layer.out_shape[0]).astype(np.float32)
    return net


@pytest.mark.parametrize("which", sorted(SMALL_NETS))
@pytest.mark.parametrize("isa", ISA_PARAMS[:2])
def test_gradients_agree_with_finite_differences(tmp_path, which, isa):
    """Directional derivatives of the mean loss, per layer and all layers at once, against
    central differences. Step h = 1e-3 of a direction scaled to each layer's weight spread:
    the truncation error is O(h^2); the float32 forward perturbs the loss by ~1e-6, i.e.
    ~5e-4 in the quotient, hence the tolerance 2% + 2e-3."""
    net = _small_net(tmp_path, which, isa)
    rng = np.random.default_rng(1)
    x = rng.standard_normal((4, 3, 10, 9)).astype(np.float32)
    labels = rng.integers(0, net.layers["loss"].in_shape[0], 4)
    net.loss_and_grad(x, labels)
    weighted = [l for l in net.layers.values() if hasattr(l, "grad_weights")]
    grads = {l.name: (l.grad_weights.astype(np.float64), l.grad_bias.astype(np.float64)) for l in weighted}
    base = {l.name: (l.weights, l.bias) for l in weighted}
    directions = {l.name: (rng.standard_normal(l.weight_shape) * base[l.name][0].std(),
                           rng.standard_normal(l.out_shape[0]) * 0.1) for l in weighted}

    def loss_at(step, names):
        for l in weighted:
            w, b = base[l.name]
            dw, db = directions[l.name]
            on = l.name in names
            l.weights = (w + step * dw * on).astype(np.float32)
            l.bias = (b + step * db * on).astype(np.float32)
        return net.loss(x, labels)

    h = 1e-3
    for names in [[l.name] for l in weighted] + [[l.name for l in weighted]]:
        analytic = sum(np.vdot(grads[n][0], directions[n][0]) + np.vdot(grads[n][1], directions[n][1]) for n in names)
        numeric = (loss_at(h, names) - loss_at(-h, names)) / (2 * h)
        assert abs(numeric - analytic) <= 0.02 * abs(analytic) + 2e-3, (names, numeric, analytic)
    loss_at(0.0, [])


def test_gradient_buffer_holds_every_layer_and_is_deterministic(tmp_path):
    net = _small_net(tmp_path, "maxpool", RUNNABLE_ISAS[-1])
    rng = np.random.default_rng(5)
    x = rng.standard_normal((6, 3, 10, 9)).astype(np.float32)
    labels = rng.integers(0, 7, 6)
    loss1 = net.loss_and_grad(x, labels)
    g1 = net.grads.copy()
    net.threads = 1
    loss2 = net.loss_and_grad(x, labels)
    assert loss1 == loss2
    np.testing.assert_array_equal(g1, net.grads)  # each weight has one owner: thread count does not matter
    for layer in ("conv1", "conv2", "fc1", "fc2"):
        assert np.any(net.layers[layer].grad_weights != 0)
    with pytest.raises(pr.PcldnnError, match="backward needs a forward"):
        net.backward(labels)


@pytest.mark.slow
def test_vgg_a_forward_backward_matches_numpy(tmp_path):
    """VGG-A at minibatch 2 (224x224): loss of a fixed seed against a float64 numpy forward.
    The loss is 1-Lipschitz in each logit, and float32 logits after 11 layers carry a relative
    error of ~1e-5 (dot products of ~4,600 terms), so 1e-4 relative is a safe bound."""
    isa = VECTOR_ISA
    spec = load_netspec(NETS / "vgg_a.json")
    build(spec, get_arch(isa), tmp_path / "vgg")
    net = pr.load(tmp_path / "vgg", threads=2, seed=0)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 3, 224, 224)).astype(np.float32)
    labels = np.array([3, 997])
    loss = net.loss_and_grad(x, labels)
    want_loss, _ = ref.softmax_cross_entropy(ref.net_forward(spec, net, x), labels)
    assert np.isfinite(loss) and loss == pytest.approx(want_loss, rel=1e-4)
    assert np.all(np.isfinite(net.grads))
    for name in ("conv1", "conv8", "fc6", "fc8"):
        g = net.layers[name].grad_weights
        assert np.all(np.isfinite(g)) and np.any(g != 0), name

    # Every layer's weight and bias gradients, elementwise, for one image, against the largest
    # gradient element of that layer: rounding (float32 sums of up to 50,176 terms, errors
    # carried down 11 layers) stayed within 3.3e-6 of it (AVX2, this test's seed); a wrong
    # buffer, a ReLU mask not applied, a layout slip between layers or a lost contribution
    # makes some element wrong by O(1) of it. 1e-4 keeps a 30x margin.
    x1, label1 = x[:1], labels[:1]
    net.loss_and_grad(x1, label1)
    want = ref.net_gradients(spec, net, x1, label1)
    for layer in spec.layers:
        if layer.weighted:
            for got, ref_grad in zip((net.layers[layer.name].grad_weights, net.layers[layer.name].grad_bias),
                                     want[layer.name]):
                scale = max(ref_grad.max(), -ref_grad.min())
                assert scale > 0, layer.name
                err = np.abs(np.subtract(ref_grad, got, out=ref_grad), out=ref_grad).max()  # in place: fc6's is 820 MB
                assert err <= 1e-4 * scale, f"{layer.name}: error {err:.3g} against largest gradient {scale:.3g}"


MEMORY_SCRIPT = """
import json, sys
import numpy as np
import pcldnn_runtime as pr
net = pr.load(sys.argv[1], threads=2)
batch = 8
x = np.random.default_rng(0).standard_normal((batch, 3, 224, 224)).astype(np.float32)
net.loss_and_grad(x, np.arange(batch))
# VmHWM, not ru_maxrss: the latter carries over the parent's peak across fork + exec
peak = int(open("/proc/self/status").read().split("VmHWM:")[1].split()[0]) * 1024
weights = sum(int(np.prod(l.weight_shape)) + l.out_shape[0] for l in net.layers.values() if hasattr(l, "weight_shape"))
acts = batch * (3 * 224 * 224 + sum(int(np.prod(l.out_shape)) for l in net.chain))
print(json.dumps({"peak": peak, "weights": 4 * weights, "grads": 4 * weights, "activations": 4 * acts}))
"""


@pytest.mark.slow
def test_vgg_a_training_memory_stays_under_1_5x_the_tensors(tmp_path):
    """Peak resident memory of a VGG-A forward+backward at minibatch 8 against the sum of
    weights, weight gradients and activations (the only tensors training must keep)."""
    isa = VECTOR_ISA
    build(load_netspec(NETS / "vgg_a.json"), get_arch(isa), tmp_path / "vgg")
    out = subprocess.run([sys.executable, "-c", MEMORY_SCRIPT, str(tmp_path / "vgg")], capture_output=True,
                         text=True, timeout=600, cwd=REPO)
    assert out.returncode == 0, out.stderr
    m = json.loads(out.stdout)
    tensors = m["weights"] + m["grads"] + m["activations"]
    print(f"VGG-A minibatch 8: peak RSS {m['peak'] / 2**20:.0f} MiB, weights+grads+activations "
          f"{tensors / 2**20:.0f} MiB, ratio {m['peak'] / tensors:.2f}")
    assert m["peak"] < 1.5 * tensors


@pytest.mark.parametrize("below", [[{"name": "relu0", "type": "relu"}],
                                   [{"name": "drop0", "type": "dropout", "rate": 0.5}, {"name": "relu0", "type": "relu"}]])
def test_layers_below_the_first_weighted_layer_are_skipped_backward(tmp_path, below):
    """Nothing below the first weighted layer needs a gradient: those layers' backward passes
    are skipped (they had no buffer to write: a net starting with a dropout crashed), and the
    weighted layers' gradients are exactly those of the net without them fed what they output."""
    tail = [{"name": "conv1", "type": "conv", "out_channels": 8, "kernel": 3, "pad": 1, "activation": "relu"},
            {"name": "fc1", "type": "fc", "out_features": 5},
            {"name": "loss", "type": "softmax_cross_entropy"}]
    source = {"channels": 16, "height": 6, "width": 5}  # blocked in both nets: the same kernels
    nets = {}
    for name, layers in (("with", below + tail), ("without", tail)):
        build(parse_netspec({"name": name, "input": source, "layers": layers}), get_arch(RUNNABLE_ISAS[-1]),
              tmp_path / name)
        nets[name] = pr.load(tmp_path / name, threads=2, seed=3)
    rng = np.random.default_rng(2)
    x = rng.standard_normal((3, 16, 6, 5)).astype(np.float32)
    labels = np.array([0, 4, 2])
    net = nets["with"]
    nets["without"].load_state_dict(net.state_dict())
    timings: dict[str, float] = {}
    net.forward(x, training=True)
    fed = net.layers[below[-1]["name"]].output_from_blocked(net.workspace(3).acts[len(below)])  # conv1's input
    loss = net.backward(labels, timings=timings)
    assert set(timings) == {"conv1", "fc1"}
    assert nets["without"].loss_and_grad(fed, labels) == loss
    for layer in ("conv1", "fc1"):
        got = net.layers[layer].grad_weights
        assert np.any(got != 0)
        np.testing.assert_array_equal(got, nets["without"].layers[layer].grad_weights)


@pytest.mark.parametrize("isa", ISA_PARAMS)
def test_max_pooling_applies_the_relu_mask_of_the_convolution_below(tmp_path, monkeypatch, isa):
    check_relu_pool_masks(tmp_path, monkeypatch, get_arch(isa))
