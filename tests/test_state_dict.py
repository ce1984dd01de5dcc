"""Weights in and out in canonical layouts (Net.state_dict / load_state_dict): the same state on
every ISA, checked before anything is written, torch tensors accepted without importing torch."""
from __future__ import annotations

import numpy as np
import pytest
from helpers import RUNNABLE_ISAS, TRAIN_LAYERS, TRAIN_SHAPE, build_and_load

from pcldnn_runtime import PcldnnError


def _net(tmp_path, isa):
    return build_and_load(tmp_path, TRAIN_LAYERS, TRAIN_SHAPE, isa, name="io")


def _random_state(net, seed=0):
    rng = np.random.default_rng(seed)
    return {k: rng.standard_normal(v.shape).astype(np.float32) for k, v in net.state_dict().items()}


def test_state_dict_keys_shapes_and_roundtrip(tmp_path, isa):
    net = _net(tmp_path, isa)
    state = net.state_dict()
    assert list(state) == ["conv1.weight", "conv1.bias", "fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]
    assert state["conv1.weight"].shape == (6, 3, 3, 3) and state["fc1.weight"].shape == (12, 6 * 4 * 4)
    new = _random_state(net)
    assert net.load_state_dict(new) == ((), ())
    for k, v in net.state_dict().items():
        np.testing.assert_array_equal(v, new[k])
    # the canonical layout is the layers' own: conv weights as layer.weights, fc2 as (OC, IC)
    np.testing.assert_array_equal(net.layers["conv1"].weights, new["conv1.weight"])
    np.testing.assert_array_equal(net.layers["fc2"].bias, new["fc2.bias"])


@pytest.mark.needs_isa("avx2")  # two ISAs: scalar and a vector one
def test_a_state_moves_between_isas_with_the_same_logits(tmp_path):
    nets = [_net(tmp_path, isa) for isa in (RUNNABLE_ISAS[0], RUNNABLE_ISAS[-1])]
    nets[1].load_state_dict(nets[0].state_dict())
    x = np.random.default_rng(1).standard_normal((4, *TRAIN_SHAPE)).astype(np.float32)
    a, b = (n.forward(x) for n in nets)
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4 * np.abs(a).max())


def test_refused_loads_list_every_problem_and_change_nothing(tmp_path):
    net = _net(tmp_path, RUNNABLE_ISAS[-1])
    before = net.state_dict()
    state = _random_state(net)
    del state["fc1.bias"], state["conv1.weight"]
    state["fc9.weight"] = np.zeros((2, 2), np.float32)
    with pytest.raises(PcldnnError, match=r"missing conv1\.weight, fc1\.bias; unexpected fc9\.weight"):
        net.load_state_dict(state)
    result = net.load_state_dict(state, strict=False)  # the rest loads
    assert result.missing == ("conv1.weight", "fc1.bias") and result.unexpected == ("fc9.weight",)
    np.testing.assert_array_equal(net.layers["fc2"].weights, state["fc2.weight"])
    np.testing.assert_array_equal(net.layers["conv1"].weights, before["conv1.weight"])

    bad_entries = (("fc1.weight", np.zeros((12, 95), np.float32), r"fc1\.weight: shape \(12, 95\), expected \(12, 96\)"),
                   ("fc2.bias", np.full(5, np.nan, np.float32), r"fc2\.bias: holds NaN"),
                   ("fc2.bias", np.array(["a"] * 5), r"fc2\.bias: must be an array of numbers"))
    for key, bad, message in bad_entries:
        state = _random_state(net, seed=2)
        state[key] = bad
        current = net.state_dict()
        with pytest.raises(PcldnnError, match=message):
            net.load_state_dict(state)
        for k, v in net.state_dict().items():  # entries before and after the bad one: untouched
            np.testing.assert_array_equal(v, current[k])
    with pytest.raises(PcldnnError, match="expected a mapping"):
        net.load_state_dict([1, 2])


class _FakeTensor:
    """What load_state_dict relies on in a torch tensor: detach().cpu() then float().numpy()."""

    def __init__(self, array):
        self.array = array

    def detach(self):
        return self

    def cpu(self):
        return self

    def float(self):
        return _FakeTensor(self.array.astype(np.float32))

    def numpy(self):
        return self.array


def test_tensor_like_and_float64_values_load(tmp_path):
    net = _net(tmp_path, RUNNABLE_ISAS[-1])
    state = {k: _FakeTensor(v.astype(np.float64)) for k, v in _random_state(net, 3).items()}
    net.load_state_dict(state)
    for k, v in net.state_dict().items():
        np.testing.assert_array_equal(v, state[k].array.astype(np.float32))


BN_LAYERS = [{"name": "c", "type": "conv", "out_channels": 20, "kernel": 3, "pad": 1, "bias": False},
             {"name": "bn", "type": "batchnorm", "activation": "relu"},
             {"name": "fc", "type": "fc", "out_features": 4}, {"name": "loss", "type": "softmax_cross_entropy"}]


def test_batchnorm_state_carries_its_running_statistics(tmp_path, isa):
    """BatchNorm2d's keys and values: scale 1 and shift 0, running mean 0 and variance 1, no
    batches at first; a training-mode forward moves the statistics (padding lanes kept out of
    the state) and an evaluation one does not; a negative variance, a fractional or negative
    batch count and a single value per channel in training are refused, leaving the net as it
    was."""
    net = build_and_load(tmp_path, BN_LAYERS, (3, 5, 4), isa, name="bn")
    state = net.state_dict()
    assert [k for k in state if k.startswith("bn.")] == ["bn.weight", "bn.bias", "bn.running_mean", "bn.running_var",
                                                          "bn.num_batches_tracked"]
    assert state["bn.num_batches_tracked"].dtype == np.int64 and state["bn.num_batches_tracked"].shape == ()
    np.testing.assert_array_equal(state["bn.weight"], np.ones(20, np.float32))
    np.testing.assert_array_equal(state["bn.running_var"], np.ones(20, np.float32))
    x = np.random.default_rng(2).standard_normal((3, 3, 5, 4)).astype(np.float32) + 2
    net.forward(x)
    assert int(net.state_dict()["bn.num_batches_tracked"]) == 0
    net.forward(x, training=True)
    moved = net.state_dict()
    assert int(moved["bn.num_batches_tracked"]) == 1 and moved["bn.running_mean"].shape == (20,)
    assert np.abs(moved["bn.running_mean"]).max() > 0.01 and not np.array_equal(moved["bn.running_var"], np.ones(20))
    for key, bad, message in (("bn.running_var", -np.ones(20), "negative variance"),
                              ("bn.num_batches_tracked", np.array(2.5), "whole number"),
                              ("bn.num_batches_tracked", np.array(-1), "whole number")):
        with pytest.raises(PcldnnError, match=message):
            net.load_state_dict({**moved, key: bad})
    for key, value in net.state_dict().items():
        np.testing.assert_array_equal(value, moved[key])
    one = build_and_load(tmp_path, BN_LAYERS, (3, 1, 1), isa, name="bn1")
    with pytest.raises(PcldnnError, match="more than one value per channel"):
        one.forward(np.ones((1, 3, 1, 1), np.float32), training=True)
    one.forward(np.ones((2, 3, 1, 1), np.float32), training=True)  # two values a channel: PyTorch's bound


@pytest.mark.parametrize("init", ["pytorch", "he", "xavier"])
def test_initial_weights_follow_the_layers_init(tmp_path, init):
    """PyTorch's default (weights and bias uniform in +-1/sqrt(fan_in), as Conv2d and Linear
    start), He-normal (std sqrt(2/fan_in), bias 0) or Xavier-uniform (+-sqrt(6/(fan_in +
    fan_out)), bias 0); fan_in of a depthwise layer is its window. Checked on the bounds and the
    standard deviation of 6400- to 36864-value tensors (a spread of about 1%: 5% allowed)."""
    layers = [{"name": "c", "type": "conv", "out_channels": 64, "kernel": 3, "pad": 1, "init": init},
              {"name": "d", "type": "conv", "out_channels": 64, "kernel": 5, "pad": 2, "groups": 64, "init": init},
              {"name": "fc", "type": "fc", "out_features": 100, "init": init}]
    net = build_and_load(tmp_path, layers, (64, 1, 1), "scalar", name=f"init_{init}")
    for name, fan_in, fan_out in (("c", 64 * 9, 64 * 9), ("d", 25, 64 * 25), ("fc", 64, 100)):
        w, b = net.layers[name].weights, net.layers[name].bias
        if init == "he":
            assert abs(w.std() / np.sqrt(2 / fan_in) - 1) < 0.05 and not b.any()
            continue
        bound = 1 / np.sqrt(fan_in) if init == "pytorch" else np.sqrt(6 / (fan_in + fan_out))
        assert np.abs(w).max() <= bound and np.abs(w).max() > 0.99 * bound, name
        assert abs(w.std() / (bound / np.sqrt(3)) - 1) < 0.05, name
        if init == "pytorch":
            assert np.abs(b).max() <= bound and b.std() > 0.3 * bound, name
        else:
            assert not b.any()
