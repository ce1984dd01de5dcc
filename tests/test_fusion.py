"""The fusions (runtime/families/fusion.py): where the planner makes them, and each fused kernel
against the unfused composition, the same net built with `compile --no-fusion`. The residual
fusion computes exactly what the batchnorm and add kernels compute (the same fp32 operations),
so its results are compared bit for bit; the statistics fusion sums in another order, so its
statistics are compared with float64 sums of the same convolution output."""
from __future__ import annotations

import json

import numpy as np
import pytest
from helpers import ISA_PARAMS, NETS, RUNNABLE_ISAS

import pcldnn_runtime as pr
from pcldnn_gen.arch import get_arch
from pcldnn_gen.build import build
from pcldnn_gen.netspec import load_netspec, parse_netspec
from pcldnn_runtime.errors import BuildDirError
from pcldnn_runtime.families.fusion import plan_fusions

ISA = RUNNABLE_ISAS[-1]  # the widest vectors this CPU runs


def _spec(layers, shape=(3, 12, 10), name="f"):
    c, h, w = shape
    return parse_netspec({"name": name, "input": {"channels": c, "height": h, "width": w}, "layers": layers})


def _conv(name, oc, k=3, stride=1, relu=False, inputs=None, bias=False):
    return {"name": name, "type": "conv", "out_channels": oc, "kernel": k, "stride": stride, "pad": k // 2,
            "bias": bias, **({"activation": "relu"} if relu else {}), **({"inputs": inputs} if inputs else {})}


def _bn(name, relu=False):
    return {"name": name, "type": "batchnorm", **({"activation": "relu"} if relu else {})}


HEAD = [{"name": "gap", "type": "global_avgpool"}, {"name": "fc", "type": "fc", "out_features": 10},
        {"name": "loss", "type": "softmax_cross_entropy"}]

# Residual fusions only: every convolution has its own ReLU, so none computes statistics. b1 joins
# an add with a ReLU, b2 one without (its add's other input is the first add).
RESIDUAL = [_conv("stem", 16, relu=True), _conv("c1", 16, relu=True), _bn("b1"),
            {"name": "s1", "type": "add", "inputs": ["b1", "stem"], "activation": "relu"},
            _conv("c2", 16, relu=True), _bn("b2"), {"name": "s2", "type": "add", "inputs": ["s1", "b2"]}, *HEAD]

# Statistics fusions: a 3x3 convolution on 12x10 (rows in blocks that need not divide it), a
# strided 1x1 one, a wide one (several output-channel vectors per work item) and a strided
# depthwise one (a row per work item), each read by its batchnorm only.
STATISTICS = [_conv("c1", 24, bias=True), _bn("b1", relu=True), _conv("c2", 40, k=1, stride=2, bias=True),
              _bn("b2", relu=True), _conv("c3", 64, bias=True), _bn("b3", relu=True),
              dict(_conv("c4", 64, stride=2, bias=True), groups=64), _bn("b4", relu=True), *HEAD]
PAIRS = (("c1", "b1"), ("c2", "b2"), ("c3", "b3"), ("c4", "b4"))


def _layer_index(spec, name):
    return next(i for i, l in enumerate(spec.layers) if l.name == name)


def test_fusions_are_planned_where_a_layer_has_one_reader():
    """A convolution without an activation read by a batchnorm only; a batchnorm without one
    read by a two-input add only (b1 into s: c1 is its shortcut); a depthwise convolution too.
    Not: a second reader, a ReLU between, three inputs, or a bf16 convolution (only the fp32
    direct and depthwise kernels compute statistics)."""
    layers = [_conv("c1", 16), _bn("b1"), {"name": "s", "type": "add", "inputs": ["b1", "c1"]},  # c1 read twice
              _conv("c2", 16), _bn("b2", relu=True),                 # b2 has its own ReLU: no residual
              {"name": "s2", "type": "add", "inputs": ["b2", "s"]},
              _conv("c3", 16, relu=True), _bn("b3"),                  # c3's ReLU: no statistics
              _conv("c4", 16, inputs=["s2"]), _bn("b4"),
              {"name": "s3", "type": "add", "inputs": ["b3", "b4", "s2"]},  # three inputs: no residual
              _conv("c5", 16), _bn("b5"), {"name": "s4", "type": "add", "inputs": ["s3", "b5"]},
              dict(_conv("dw", 16), groups=16), _bn("b6"), *HEAD]
    spec = _spec(layers)
    at = {l.name: i for i, l in enumerate(spec.layers)}
    fusions = plan_fusions(spec.layers, get_arch("avx512").target("fp32"))
    assert fusions.statistics == {at["c2"]: at["b2"], at["c4"]: at["b4"], at["c5"]: at["b5"], at["dw"]: at["b6"]}
    assert fusions.residual == {at["b1"]: at["s"], at["b5"]: at["s4"]}
    amx = plan_fusions(spec.layers, get_arch("sapphirerapids").target("bf16"))  # depthwise stays fp32 there
    assert amx.statistics == {at["dw"]: at["b6"]} and amx.residual == fusions.residual


def test_every_block_of_the_example_resnets_is_fused():
    """ResNet-18 and ResNet-20 as the examples describe them: each convolution computes its
    batchnorm's statistics; each block's last batchnorm computes the block's add."""
    for name in ("resnet18", "resnet20_cifar"):
        spec = load_netspec(NETS / f"{name}.json")
        fusions = plan_fusions(spec.layers, get_arch("avx512").target("fp32"))
        convs = [i for i, l in enumerate(spec.layers) if l.type == "conv"]
        adds = [i for i, l in enumerate(spec.layers) if l.type == "add"]
        assert sorted(fusions.statistics) == convs
        assert sorted(fusions.residual.values()) == adds


def _scale_and_shift(net):
    """The batchnorms' scale and shift away from 1 and 0, so a slip in either shows."""
    rng = np.random.default_rng(3)
    state = net.state_dict()
    for key in state:
        if key.startswith("b") and key.endswith(".weight"):
            state[key] = rng.uniform(0.5, 1.5, state[key].shape).astype(np.float32)
        elif key.startswith("b") and key.endswith(".bias"):
            state[key] = rng.uniform(-0.5, 0.5, state[key].shape).astype(np.float32)
    net.load_state_dict(state)


def _pair(tmp_path, layers, shape, name, isa, threads=2):
    """The net built with and without fusion, the unfused one loaded with the fused one's weights."""
    spec = _spec(layers, shape, name)
    arch = get_arch(isa)
    build(spec, arch, tmp_path / f"{name}-on")
    build(spec, arch, tmp_path / f"{name}-off", fusion=False)
    fused, plain = pr.load(tmp_path / f"{name}-on", threads=threads), pr.load(tmp_path / f"{name}-off", threads=threads)
    _scale_and_shift(fused)
    plain.load_state_dict(fused.state_dict())
    return fused, plain


def _steps(net, shape, steps=3):
    """Logits of a training forward, then `steps` SGD steps; the state, gradients and eval logits."""
    rng = np.random.default_rng(5)
    trainer = pr.Trainer(net, pr.SGD(0.05, momentum=0.9, weight_decay=5e-4))
    x = rng.standard_normal((6, *shape)).astype(np.float32)
    logits = net.forward(x, training=True)
    for _ in range(steps):
        trainer.step(rng.standard_normal((6, *shape)).astype(np.float32), rng.integers(0, 10, 6))
    return logits, net.grads.copy(), net.state_dict(), net.eval().forward(x)


def test_the_residual_fusion_equals_the_batchnorm_and_add_kernels(tmp_path, isa):
    """Forward in training and evaluation, every gradient, the weights and the running statistics
    after three SGD steps: bit for bit the unfused kernels' (the fused forward adds the
    shortcut to the very value the batchnorm kernel stores; the backward masks dy where the add
    kernel masked it, and the masked dy is what the add passed to both inputs)."""
    shape = (3, 12, 10)
    fused, plain = _pair(tmp_path, RESIDUAL, shape, "res", isa)
    assert fused.fusions.residual and not fused.fusions.statistics
    assert not plain.fusions
    got, want = _steps(fused, shape), _steps(plain, shape)
    for what, a, b in zip(("training logits", "gradients", "state", "eval logits"), got, want, strict=True):
        if isinstance(a, dict):
            for key in b:
                np.testing.assert_array_equal(a[key], b[key], err_msg=key)
        else:
            np.testing.assert_array_equal(a, b, err_msg=what)


STATS_SHAPE = (5, 12, 10)


@pytest.fixture(scope="module", params=ISA_PARAMS)
def statistics_builds(request, tmp_path_factory):
    """STATISTICS built with and without fusion for each ISA, once for the tests below."""
    path = tmp_path_factory.mktemp("fusion")
    spec, arch = _spec(STATISTICS, STATS_SHAPE, "stats"), get_arch(request.param)
    build(spec, arch, path / "stats-on")
    build(spec, arch, path / "stats-off", fusion=False)
    return path


def test_the_statistics_fusion_matches_float64_statistics_of_the_convolution(statistics_builds):
    """Each fused convolution's batch statistics (the batchnorm's after a training forward)
    against float64 sums of that convolution's own output (its layer's forward on the very input
    it had in the net), which a bias of 30 puts far from zero (a sum of squares would cancel
    there; the per-block means and squared deviations do not): the mean within 1e-6 of its size
    plus the spread, the biased variance within 1e-5 relative; the same bits on one thread and
    two. Convolutions: 3x3 on 12x10 (row blocks that need not divide it), 1x1 stride 2, 64
    channels (several vectors a work item), depthwise stride 2 (a row a work item)."""
    net = pr.load(statistics_builds / "stats-on", threads=2)
    assert len(net.fusions.statistics) == len(PAIRS) and not net.fusions.residual
    state = net.state_dict()
    for conv, _ in PAIRS:
        state[f"{conv}.bias"] = np.full_like(state[f"{conv}.bias"], 30.0)
    state["c4.weight"] *= 8  # a 3x3 window per channel: its output's spread near the others' (~1)
    net.load_state_dict(state)
    x = np.random.default_rng(7).standard_normal((7, *STATS_SHAPE)).astype(np.float32)
    net.forward(x, training=True)
    ws = net.workspace(7)  # the batch statistics and each convolution's input, as the net had them
    position = {l.name: i for i, l in enumerate(net.chain)}
    batch = {}
    for conv, norm in PAIRS:
        i, j = position[conv], position[norm]
        c = net.chain[j].out_shape[0]
        mean, var = ws.aux[j][0][:c].copy(), ws.aux[j][1][:c].copy()
        batch[norm] = mean, var
        source = net.sources[i][0]
        xin = x if source == 0 else net.chain[source - 1].output_from_blocked(ws.acts[source])
        y = net.layers[conv].forward(xin).astype(np.float64)
        ref_mean, biased = y.mean(axis=(0, 2, 3)), y.var(axis=(0, 2, 3))
        assert np.all(np.abs(ref_mean - 30.0) < 10), "the bias puts the output far from zero"
        assert np.all(np.abs(mean - ref_mean) <= 1e-6 * (np.abs(ref_mean) + np.sqrt(biased))), conv
        np.testing.assert_allclose(var, biased, rtol=1e-5, err_msg=conv)
    one = pr.load(statistics_builds / "stats-on", threads=1)
    one.load_state_dict(state)
    one.forward(x, training=True)
    for norm, (mean, var) in batch.items():
        j = position[norm]
        c = one.chain[j].out_shape[0]
        np.testing.assert_array_equal(one.workspace(7).aux[j][0][:c], mean, err_msg=f"{norm}: 1 vs 2 threads")
        np.testing.assert_array_equal(one.workspace(7).aux[j][1][:c], var, err_msg=f"{norm}: 1 vs 2 threads")


def test_the_statistics_fusion_trains_like_the_unfused_kernels(statistics_builds):
    """STATISTICS built with and without fusion: training logits, gradients and state after three
    steps, and evaluation logits, within 2e-5 relative (the statistics' last bits differ,
    nothing else; from biases of zero: with them at 30 a change of 1e-6 in one weight moves the
    unfused net's own gradients by percents within two steps)."""
    fused, plain = (pr.load(statistics_builds / f"stats-{side}", threads=2) for side in ("on", "off"))
    _scale_and_shift(fused)
    plain.load_state_dict(fused.state_dict())
    assert not plain.fusions
    got, want = _steps(fused, STATS_SHAPE), _steps(plain, STATS_SHAPE)
    for what, a, b in zip(("training logits", "gradients", "state", "eval logits"), got, want, strict=True):
        for key in (b if isinstance(b, dict) else [None]):
            u, v = (a[key], b[key]) if key else (a, b)
            np.testing.assert_allclose(u, v, rtol=2e-5, atol=2e-5 * max(float(np.abs(v).max()), 1e-6),
                                       err_msg=f"{what} {key or ''}")


def test_a_fused_build_whose_plans_lack_the_fusion_is_refused(tmp_path):
    """The runtime calls the kernels as fused where its rule says so: a manifest claiming a
    fused build whose batchnorm kernel was planned without it is refused, by its JSON path."""
    spec = _spec(RESIDUAL, name="lie")
    build(spec, get_arch(ISA), tmp_path / "lie")
    path = tmp_path / "lie" / "manifest.json"
    manifest = json.loads(path.read_text())
    b1 = _layer_index(spec, "b1")
    del manifest["layers"][b1]["kernels"]["fwd"]["plan"]["fusion"]
    path.write_text(json.dumps(manifest))
    with pytest.raises(BuildDirError, match=rf"layers\[{b1}\]\.kernels\.fwd\.plan\.fusion"):
        pr.load(tmp_path / "lie")
