"""net.json validation (one test per error class, each naming the JSON path) and shape inference."""
from __future__ import annotations

import copy
import json

import pytest
from helpers import NETS

from pcldnn_gen.errors import NetSpecError
from pcldnn_gen.netspec import load_netspec, parse_netspec
from pcldnn_runtime.layer_types import ConvKind, conv_kind

BASE = {
    "name": "n", "input": {"channels": 3, "height": 16, "width": 16}, "classes": 10,
    "layers": [
        {"name": "conv1", "type": "conv", "out_channels": 8, "kernel": 3, "pad": 1, "activation": "relu"},
        {"name": "pool1", "type": "maxpool", "kernel": 2, "stride": 2},
        {"name": "fc1", "type": "fc", "out_features": 10},
        {"name": "loss", "type": "softmax_cross_entropy"},
    ],
}


def _with(path_edit):
    net = copy.deepcopy(BASE)
    path_edit(net)
    return net


@pytest.mark.parametrize("edit,message", [
    (lambda n: n["layers"][1].update(type="avgpool3d"), r"layers\[1\]\.type: unknown layer type \"avgpool3d\""),
    (lambda n: n["layers"][0].pop("out_channels"), r"layers\[0\]\.out_channels: missing required field"),
    (lambda n: n["layers"][0].update(dilation=2), r"layers\[0\]\.dilation: unknown field"),
    (lambda n: n.update(extra=1), r": extra: unknown field \(allowed"),
    # another framework's vocabulary or a typo: the field meant, reported before "missing kernel"
    (lambda n: n["layers"][0].update(kernel_size=n["layers"][0].pop("kernel")),
     r"layers\[0\]\.kernel_size: unknown field; did you mean 'kernel'\?"),
    (lambda n: n["layers"][0].update(padding=1), r"layers\[0\]\.padding: unknown field; did you mean 'pad'\?"),
    (lambda n: n["layers"][0].update(out_chanels=8), r"out_chanels: unknown field; did you mean 'out_channels'\?"),
    (lambda n: n.update(num_classes=10), r": num_classes: unknown field; did you mean 'classes'\?"),
    (lambda n: n["layers"][0].update(source="features.0\nrm -rf"), r"layers\[0\]\.source: must be one line of printable"),
    (lambda n: n["layers"][0].update(bias="no"), r"layers\[0\]\.bias: must be true or false"),
    (lambda n: n["layers"][0].update(groups=0), r"layers\[0\]\.groups: must be a positive int"),
    (lambda n: n["layers"][0].update(init="kaiming"), r"layers\[0\]\.init: must be one of pytorch, he, xavier"),
    (lambda n: n["layers"][1].update(init="he"), r"layers\[1\]\.init: unknown field"),
    (lambda n: n["layers"][0].update(groups="3"), r"layers\[0\]\.groups: must be a positive int"),
    (lambda n: n["layers"][0].update(groups=3), r"layers\[0\]\.groups: 3 groups must divide the 3 input and 8 output"),
    (lambda n: n["layers"].insert(1, {"name": "g", "type": "conv", "out_channels": 8, "kernel": 3, "groups": 2}),
     r"layers\[1\]\.groups: 2 groups with 4 input channels a group is not supported: groups must be 1, or equal"),
    (lambda n: n["layers"].insert(1, {"name": "g", "type": "conv", "out_channels": 16, "kernel": 3, "groups": 8}),
     r"layers\[1\]\.groups: 8 groups with a channel multiplier of 2 is not supported"),
    (lambda n: n["layers"][1].update(groups=8), r"layers\[1\]\.groups: unknown field"),
    (lambda n: n["layers"].insert(1, {"name": "b", "type": "batchnorm", "eps": 0}),
     r"layers\[1\]\.eps: must be a number in \[1e-12, 1\], got 0"),
    (lambda n: n["layers"].insert(1, {"name": "b", "type": "batchnorm", "momentum": 1.5}),
     r"layers\[1\]\.momentum: must be a number in \[0, 1\]"),
    (lambda n: n["layers"].insert(1, {"name": "b", "type": "batchnorm", "bias": False}), r"layers\[1\]\.bias: unknown field"),
    (lambda n: n["layers"].insert(3, {"name": "b", "type": "batchnorm"}),
     r"layers\[3\]: batchnorm normalizes the channels of an image \(BatchNorm2d\); it cannot follow an fc layer"),
    (lambda n: n["layers"][1].update(bias=False), r"layers\[1\]\.bias: unknown field"),
    (lambda n: n["layers"][0].update(kernel=-1),
     r"layers\[0\]\.kernel: must be a positive int or \[h, w\] \(each at most 64\), got -1"),
    (lambda n: n["layers"][0].update(kernel=[3, 0]),
     r"layers\[0\]\.kernel: must be a positive int or \[h, w\] \(each at most 64\), got \[3, 0\]"),
    (lambda n: n["layers"][0].update(stride=True), r"layers\[0\]\.stride: must be a positive int"),
    (lambda n: n["layers"][0].update(pad=-1), r"layers\[0\]\.pad: must be a non-negative int"),
    (lambda n: n["layers"][0].update(out_channels=0),
     r"layers\[0\]\.out_channels: must be a positive int \(at most 65536\), got 0"),
    (lambda n: n["input"].update(height=0), r"input\.height: must be a positive int \(at most 16384\), got 0"),
    (lambda n: n["input"].pop("width"), r"input\.width: missing required field"),
    (lambda n: n["layers"][0].update(kernel=19), r"layers\[0\]\.kernel: kernel \[19, 19\] is larger than the padded input 18x18"),
    (lambda n: n["layers"][1].update(name="conv1"), r"layers\[1\]\.name: duplicate layer name 'conv1'"),
    (lambda n: n["layers"][1].update(name="1pool"), r"layers\[1\]\.name: must match"),
    (lambda n: n["layers"][1].update(name="p" * 65), r"layers\[1\]\.name: must match"),
    (lambda n: n.update(name="../x"), r": name: must match"),
    (lambda n: n.update(classes=7), r"classes: is 7 but the last fc layer 'fc1' has out_features 10"),
    (lambda n: n["layers"][0].update(activation="tanh"), r"layers\[0\]\.activation: must be one of relu, relu6"),
    (lambda n: n["layers"][0].update(activation="relu6"),
     r"layers\[0\]\.activation: relu6 is fused into batchnorm layers only; after a conv put a relu6 layer"),
    (lambda n: n["layers"].insert(0, {"name": "l0", "type": "softmax_cross_entropy"}),
     r"layers\[0\]: softmax_cross_entropy must be the last"),
    (lambda n: n["layers"].insert(3, {"name": "c9", "type": "conv", "out_channels": 2, "kernel": 1}),
     r"layers\[3\]: conv cannot follow an fc layer"),
    (lambda n: n.update(layers=[]), r"layers: must be a non-empty list"),
    (lambda n: n["layers"].__setitem__(2, 5), r"layers\[2\]: must be an object, got 5"),
    (lambda n: n["layers"][1].update(pad=2), r"layers\[1\]\.pad: pooling pad \[2, 2\] must be smaller than the kernel"),
    (lambda n: n["layers"].insert(2, {"name": "d", "type": "dropout", "rate": 1.0}),
     r"layers\[2\]\.rate: must be a number in \[0, 1\), got 1\.0"),
    (lambda n: n["layers"].insert(2, {"name": "a", "type": "avgpool"}), r"layers\[2\]\.kernel: missing required field"),
    (lambda n: n.update(classes=None) or n["layers"].__delitem__(2),
     r"layers\[2\]: softmax_cross_entropy needs a vector of logits"),
])
def test_errors_name_the_file_and_json_path(tmp_path, edit, message):
    path = tmp_path / "net.json"
    path.write_text(json.dumps(_with(edit)))
    with pytest.raises(NetSpecError, match=message) as info:
        load_netspec(path)
    assert str(info.value).startswith(f"{path}: ")
    assert "\n" not in str(info.value)


def test_invalid_json_reports_line_and_column(tmp_path):
    path = tmp_path / "broken.json"
    path.write_text('{\n  "name": "n",\n  "input": {"channels": 3,,}\n}\n')
    with pytest.raises(NetSpecError, match=r"broken\.json: invalid JSON at line 3, column 27: Expecting property name"):
        load_netspec(path)


def test_missing_file(tmp_path):
    with pytest.raises(NetSpecError, match="cannot read"):
        load_netspec(tmp_path / "nope.json")


@pytest.mark.parametrize("evil", ['x"; system("id"); //', "../../etc", "a/b", "conv 1", "é", ""])
def test_hostile_layer_names_rejected(evil):
    net = _with(lambda n: n["layers"][0].update(name=evil))
    with pytest.raises(NetSpecError, match=r"layers\[0\]\.name: must match"):
        parse_netspec(net, "net.json")


def test_vgg_a_shapes_match_the_paper():
    net = load_netspec(NETS / "vgg_a.json")
    out = {l.name: l.out_shape for l in net.layers}
    assert out["conv1"] == (64, 224, 224) and out["pool1"] == (64, 112, 112)
    assert out["conv2"] == (128, 112, 112) and out["pool2"] == (128, 56, 56)
    assert out["conv3"] == out["conv4"] == (256, 56, 56) and out["pool4"] == (256, 28, 28)
    assert out["conv5"] == out["conv6"] == (512, 28, 28) and out["pool6"] == (512, 14, 14)
    assert out["conv7"] == out["conv8"] == (512, 14, 14) and out["pool8"] == (512, 7, 7)
    assert net.layer("fc6").weight_shape == (4096, 25088)
    assert net.layer("fc7").weight_shape == (4096, 4096)
    assert net.layer("fc8").weight_shape == (1000, 4096)
    convs = [l for l in net.layers if l.type == "conv"]
    assert [l.in_shape[0] for l in convs] == [3, 64, 128, 256, 256, 512, 512, 512]
    assert all(l.kernel == (3, 3) and l.stride == (1, 1) and l.pad == (1, 1) for l in convs)
    # ~7.6 G multiply-adds per image in the convolutions (VGG-A is the 11-layer VGG, 7.6 GMAC)
    assert 7.4e9 < sum(l.flops(1) for l in convs) / 2 < 7.8e9


def test_overfeat_fast_shapes_match_the_paper():
    net = load_netspec(NETS / "overfeat_fast.json")
    out = {l.name: l.out_shape for l in net.layers}
    assert out["conv1"] == (96, 56, 56) and out["pool1"] == (96, 28, 28)
    assert out["conv2"] == (256, 24, 24) and out["pool2"] == (256, 12, 12)
    assert out["conv3"] == (512, 12, 12) and out["conv4"] == (1024, 12, 12) and out["conv5"] == (1024, 12, 12)
    assert out["pool5"] == (1024, 6, 6)
    assert net.layer("fc6").weight_shape == (3072, 36864)
    assert net.layer("fc7").weight_shape == (4096, 3072)
    assert net.layer("fc8").weight_shape == (1000, 4096)


def test_cifar_small_shapes():
    net = load_netspec(NETS / "cifar_small.json")
    assert net.layer("pool3").out_shape == (128, 4, 4)
    assert net.layer("fc1").weight_shape == (256, 2048)
    assert net.layer("fc2").out_shape == (10, 1, 1)


def test_defaults_and_asymmetric_parameters():
    net = parse_netspec({"name": "a", "input": {"channels": 2, "height": 10, "width": 20}, "layers": [
        {"name": "c", "type": "conv", "out_channels": 4, "kernel": [3, 5], "stride": [1, 2], "pad": [1, 0]},
        {"name": "p", "type": "maxpool", "kernel": 2},
        {"name": "f", "type": "fc", "out_features": 3}]})
    c, p, f = net.layers
    assert c.out_shape == (4, 10, 8) and not c.activation
    assert p.stride == (2, 2) and p.out_shape == (4, 5, 4)  # pool stride defaults to its kernel
    assert f.kernel == (5, 4) and f.weight_shape == (3, 80)


def test_depthwise_convolutions_have_a_window_per_channel():
    """groups = channels: weights (C, 1, KH, KW), a window's FLOPs per output value, and a
    stride and padding of their own; groups 1 stays the ordinary convolution."""
    spec = parse_netspec(_with(lambda n: n["layers"].insert(
        1, {"name": "dw", "type": "conv", "out_channels": 8, "kernel": [3, 5], "stride": 2, "pad": [1, 2],
            "groups": 8})))
    dw, conv = spec.layer("dw"), spec.layer("conv1")
    assert (dw.conv_kind, conv.conv_kind) == (ConvKind.DEPTHWISE, ConvKind.DENSE) and conv.groups == 1
    assert dw.weight_shape == (8, 1, 3, 5) and dw.out_shape == (8, 8, 8)
    assert dw.flops(2) == 2 * 2 * 8 * 8 * 8 * 3 * 5
    assert spec.layer("pool1").conv_kind is None
    # the kind follows from the groups and the input channels alone (grouped: no kernels yet)
    assert [conv_kind("conv", g, 64) for g in (1, 2, 32, 64)] == [ConvKind.DENSE, ConvKind.GROUPED, ConvKind.GROUPED,
                                                          ConvKind.DEPTHWISE]


def test_global_avgpool_is_an_average_over_the_whole_input():
    spec = parse_netspec(_with(lambda n: n["layers"].insert(2, {"name": "gap", "type": "global_avgpool"})))
    gap = spec.layer("gap")
    assert (gap.type, gap.in_shape, gap.out_shape, gap.kernel, gap.stride) == (
        "avgpool", (8, 8, 8), (8, 1, 1), (8, 8), (8, 8))
    assert spec.layer("fc1").in_shape == (8, 1, 1)


def test_hash_identifies_the_description():
    a = parse_netspec(BASE)
    b = parse_netspec(json.loads(json.dumps(BASE)))
    c = parse_netspec(_with(lambda n: n["layers"][0].update(out_channels=9)) | {"classes": 10})
    assert a.source_hash == b.source_hash != c.source_hash


@pytest.mark.parametrize("size, k, s, p", [(8, 3, 1, 1), (7, 5, 2, 2), (19, 11, 4, 0), (12, 11, 4, 2), (5, 3, 2, 3),
                                          (6, 1, 1, 0)])
def test_useful_flops_count_only_taps_inside_the_input(size, k, s, p):
    """Against a brute-force count over every (output pixel, tap) of a padded input."""
    import numpy as np
    net = parse_netspec({"name": "u", "input": {"channels": 3, "height": size, "width": size + 1}, "layers": [
        {"name": "c", "type": "conv", "out_channels": 5, "kernel": k, "stride": s, "pad": p}]})
    layer = net.layers[0]
    _, oh, ow = layer.out_shape
    inside = np.zeros((size + 2 * p, size + 1 + 2 * p), bool)
    inside[p:p + size, p:p + size + 1] = True
    taps = sum(int(inside[y * s:y * s + k, x * s:x * s + k].sum()) for y in range(oh) for x in range(ow))
    assert layer.useful_flops(2) == 2 * 2 * 5 * 3 * taps
    assert layer.useful_flops(2) <= layer.flops(2) and (p > 0 or layer.useful_flops(2) == layer.flops(2))
