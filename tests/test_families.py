"""The kernel-family registry (pcldnn_runtime.families): one ordered list decides which kernel
computes every (layer, pass) of a build, for the generator, the manifest reader and the runtime
alike; each family that declines says why; the planner's half of the registry writes the kind
the registry chose."""
from __future__ import annotations

import itertools

import pytest
from helpers import NETS

from pcldnn_gen.arch import PRESETS
from pcldnn_gen.build import plan_net
from pcldnn_gen.netspec import load_netspec, parse_netspec
from pcldnn_runtime import families
from pcldnn_runtime.families import FAMILIES, Engine, Shape, Target, choose, declined, kind_named
from pcldnn_runtime.layer_types import ConvKind
from pcldnn_runtime.manifest import LAYER_PASSES, kernel_kinds

FP32 = Target("fp32", False, 16)
VDPBF16 = Target("bf16", False, 16)
AMX = Target("bf16", True, 16)


def _conv(channels: int, kernel: int = 3, index: int = 1) -> Shape:
    return Shape(index, "conv", (channels, 32, 32), (kernel, kernel))


def _chosen(layer: Shape, target: Target) -> dict[str, str]:
    return {p: choose(layer, p, target)[0].name for p in LAYER_PASSES[layer.type]}


def test_an_fp32_build_runs_the_fp32_families_and_says_why_not_the_others():
    assert _chosen(_conv(64), FP32) == dict.fromkeys(LAYER_PASSES["conv"], "conv_direct")
    assert _chosen(Shape(2, "fc", (64, 1, 1), (1, 1)), FP32) == dict.fromkeys(LAYER_PASSES["fc"], "fc_gemm")
    for ltype, family in (("maxpool", "pool"), ("relu", "eltwise"), ("dropout", "eltwise"),
                          ("softmax_cross_entropy", "loss")):
        assert set(_chosen(Shape(1, ltype, (16, 8, 8), (2, 2)), AMX).values()) == {family}
    reasons = dict(declined(_conv(64), "fwd", FP32))
    assert set(reasons) == {"conv_amx", "conv_vdpbf16"} and reasons["conv_amx"] == "a fp32 build"


def test_amx_takes_convolutions_and_fc_layers_and_the_packed_first_layer_by_window():
    assert set(_chosen(_conv(64), AMX).values()) == {"conv_amx"}
    assert set(_chosen(_conv(8), AMX).values()) == {"conv_amx"}  # few channels, not the first layer: tiles
    assert set(_chosen(Shape(3, "fc", (4096, 1, 1), (1, 1)), AMX).values()) == {"fc_tiles_amx"}
    rgb3 = _conv(3, 3, index=0)  # 27 values a window
    assert _chosen(rgb3, AMX) == {"fwd": "conv_packed_amx", "bwd_data": "conv_packed_amx", "bwd_weights": "conv_direct"}
    assert "27 values (< 64)" in dict(declined(rgb3, "bwd_weights", AMX))["conv_packed_amx"]
    assert _chosen(_conv(3, 7, index=0), AMX)["bwd_weights"] == "conv_packed_amx"  # 147 values
    assert dict(declined(_conv(64), "fwd", AMX)) == {}  # the first family takes it


def test_vdpbf16_without_amx_needs_channel_pairs_and_a_wide_enough_window():
    assert set(_chosen(_conv(64), VDPBF16).values()) == {"conv_vdpbf16"}
    few = _conv(8)
    assert _chosen(few, VDPBF16) == {"fwd": "conv_vdpbf16", "bwd_data": "conv_direct", "bwd_weights": "conv_vdpbf16"}
    assert "fewer than a vector" in dict(declined(few, "bwd_data", VDPBF16))["conv_vdpbf16"]
    rgb3 = _conv(3, 3, index=0)
    assert _chosen(rgb3, VDPBF16) == {"fwd": "conv_packed_vdpbf16", "bwd_data": "conv_direct",
                                      "bwd_weights": "conv_direct"}
    assert dict(declined(rgb3, "bwd_data", VDPBF16))["conv_packed_vdpbf16"] == "has no bwd_data kernel"
    assert _chosen(_conv(3, 11, index=0), VDPBF16)["bwd_weights"] == "conv_packed_vdpbf16"  # 363 values
    assert dict(declined(_conv(64), "fwd", VDPBF16))["conv_amx"] == "the CPU has no AMX"


def test_kinds_are_typed_and_their_names_unique_and_round_trip():
    kinds = set(families.all_kinds())
    assert kinds == {f.kind(t, p) for f in FAMILIES for t in f.layer_types for p in LAYER_PASSES[t] if f.has_pass(t, p)}
    names = [k.name for k in kinds]
    assert len(names) == len(set(names))
    assert all(kind_named(k.name) == k for k in kinds)
    assert kind_named("conv_fwd_packed_amx") == families.Kind("conv", "fwd", Engine.AMX, True)
    assert kind_named("act_layout") is None and families.isa_suffix("act_to_bf16") == "_bf16"
    assert kind_named("conv_bwd_data_packed_bf16") is None  # no family has that kernel
    assert {k.name for k in kinds if k.weight_copy} == {"conv_fwd_bf16", "conv_bwd_data_bf16", "conv_fwd_packed_bf16",
                                                        "conv_fwd_amx", "conv_bwd_data_amx", "conv_fwd_packed_amx",
                                                        "conv_bwd_data_packed_amx"}


@pytest.mark.parametrize("target", [FP32, VDPBF16, AMX], ids=["fp32", "vdpbf16ps", "amx"])
def test_the_manifest_kinds_are_the_registrys_choice(target):
    for channels, kernel, index in itertools.product((1, 3, 8, 16, 64), (1, 3, 7, 11), (0, 2)):
        layer = _conv(channels, kernel, index)
        kinds = kernel_kinds(layer, target)
        for p in LAYER_PASSES["conv"]:
            _, kind = choose(layer, p, target)
            assert kinds[p][p] == kind.name
            assert ("fwd_tiles" in kinds["fwd"]) == (choose(layer, "fwd", target)[1].engine is not Engine.FP32)
        assert ("in_to_bf16" in kinds["layout"]) == (choose(layer, "fwd", target)[0].name == "conv_vdpbf16")


NET_FILES = ["vgg_a", "overfeat_fast", "cifar_small", "digits", "dnn7", "resnet18", "resnet50", "mobilenet_v2",
             "resnet20_cifar"]


@pytest.mark.parametrize("preset,precision", [("avx2", "fp32"), ("avx512", "fp32"), ("zen5", "bf16"),
                                              ("sapphirerapids", "bf16")])
def test_every_plan_is_of_the_family_the_registry_chose(preset, precision):
    """The planner's half of the registry writes its family's kind (what build.py asserted at
    run time before the registry), over the example nets and first layers of 1-16 channels."""
    arch = PRESETS[preset]
    nets = [load_netspec(NETS / f"{n}.json") for n in NET_FILES]
    for c, k in itertools.product((1, 3, 4, 16), (3, 5, 11)):
        nets.append(parse_netspec({"name": "first", "input": {"channels": c, "height": 24, "width": 24}, "layers": [
            {"name": "c1", "type": "conv", "out_channels": 20, "kernel": k, "pad": k // 2, "activation": "relu"},
            {"name": "c2", "type": "conv", "out_channels": 8, "kernel": 3, "stride": 2},
            {"name": "f", "type": "fc", "out_features": 5}, {"name": "loss", "type": "softmax_cross_entropy"}]}))
    for net in nets:
        plans = plan_net(net, arch, precision=precision)
        for layer in net.layers:
            for p in LAYER_PASSES[layer.type]:
                assert plans[(layer.name, p)].kind == choose(layer, p, arch.target(precision))[1].name, (net.name, layer.name, p)


def test_a_convolutions_kind_picks_its_family():
    """Depthwise kernels for depthwise convolutions only, the dense families for dense ones; a
    grouped convolution has no family yet, and each family says so in words."""
    dw = Shape(1, "conv", (64, 32, 32), (3, 3), groups=64)
    grouped = Shape(1, "conv", (64, 32, 32), (3, 3), groups=4)
    assert (dw.conv_kind, grouped.conv_kind, _conv(64).conv_kind) == (
        ConvKind.DEPTHWISE, ConvKind.GROUPED, ConvKind.DENSE)
    for target in (FP32, VDPBF16, AMX):
        assert set(_chosen(dw, target).values()) == {"conv_depthwise"}
    by_name = {f.name: f for f in FAMILIES}
    assert by_name["conv_direct"].declines(dw, "fwd", FP32) == "computes dense convolutions only, not depthwise ones"
    assert by_name["conv_depthwise"].declines(_conv(64), "fwd", FP32) == (
        "computes depthwise convolutions only, not dense ones")
    assert not any(f.handles(grouped, 16) for f in FAMILIES)
    assert by_name["conv_depthwise"].kind("conv", "bwd_data").name == "conv_bwd_data_depthwise"


def test_every_family_has_its_generator_parts():
    """What the generator needs of each family, checked in one place, so that a family added
    without one of them fails here and not at the first net that reaches it (depthwise's
    thread-division model was once missed, and `plan` crashed on the first depthwise net): a
    planner record; a memory-bound family planned without register tiles, its every kind's
    template (that exists) and explanation, in the record; for the fp32 conv and fc kinds, the
    scaling model's parallel loop."""
    from pcldnn_gen.codegen import template_env
    from pcldnn_gen.planner import _FAMILY_PLANNERS, plan_layer
    from pcldnn_gen.planner.parallel import LOOPS, parallel_loop
    assert set(_FAMILY_PLANNERS) == {f.name for f in FAMILIES}
    templates = set(template_env().list_templates())
    planned_by_bytes = [f for f in FAMILIES if _FAMILY_PLANNERS[f.name].memory is not None]
    assert {f.name for f in planned_by_bytes} == {"pool", "eltwise", "batchnorm", "join", "loss"}
    for family in planned_by_bytes:
        kernels = _FAMILY_PLANNERS[family.name].memory
        assert family.memory_bound and set(kernels.templates) == {k.name for k in family.kinds}, family.name
        assert set(kernels.templates.values()) <= templates, family.name
    spec = parse_netspec({"name": "t", "input": {"channels": 16, "height": 12, "width": 12}, "layers": [
        {"name": "c", "type": "conv", "out_channels": 32, "kernel": 3, "pad": 1},
        {"name": "dw", "type": "conv", "out_channels": 32, "kernel": 3, "pad": 1, "groups": 32},
        {"name": "f", "type": "fc", "out_features": 10}]})
    fp32 = [f for f in FAMILIES if f.engine is Engine.FP32 and set(f.layer_types) <= {"conv", "fc"}]
    assert {f.name for f in fp32} == {"conv_direct", "conv_depthwise", "fc_gemm"} == set(LOOPS)
    for family in fp32:
        layer = next(l for l in spec.layers if family.handles(l, 16))
        for kind in family.kinds:
            loop = parallel_loop(layer, plan_layer(layer, kind.pass_name, PRESETS["avx512"]))
            assert (loop.per_rows > 0) != (loop.fixed > 0), (kind.name, loop)  # work that scales, or fixed work


def test_every_layer_type_is_defined_once_and_read_everywhere():
    """Each layer_types.LayerType is what netspec accepts (its fields, required and defaulted),
    has a runtime layer class, a family for each of its passes (fp32), and state entries of a known
    kind: a type added to the table without one of them fails here."""
    from pcldnn_gen.netspec import LAYER_FIELDS
    from pcldnn_runtime.layer_types import LAYER_TYPES, REQUIRED
    from pcldnn_runtime.net import _LAYER_CLASSES
    assert set(LAYER_TYPES) == set(LAYER_FIELDS) - {"global_avgpool"} == set(_LAYER_CLASSES)
    for name, layer_type in LAYER_TYPES.items():
        required, optional = LAYER_FIELDS[name]
        assert required | set(optional) == set(layer_type.fields), name
        assert all(layer_type.fields[k] is REQUIRED for k in required), name
        assert {kind for _, kind in layer_type.state} <= {"weight", "channels", "scalar"}, name
        assert all(any(f.has_pass(name, p) and f.engine is Engine.FP32 for f in FAMILIES)
                   for p in layer_type.passes), name
