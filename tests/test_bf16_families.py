"""The bf16 and AMX kernel families beyond their float64 bounds (test_conformance.py): thread
counts and work splits that must not change a bit, an image of NaN and Inf kept to itself,
copies made per span of units, fc slices, bf16 weight copies that follow every change of the
weights, the kinds a tuning database cannot change, and the packed first layer's kernels by CPU."""
from __future__ import annotations

import dataclasses
import json
import re

import numpy as np
import pytest
from bf16_emulation import BF16_BUILDS, bf16_kernels, needs_amx
from cases import AMX_ARCH, AMX_CASES, AMX_STRIDED_CASES, CONV_CASES, PACKED_BF16_GRADIENT_CASES, SMALL_L2, SMALL_L2_AVX512
from helpers import U32
from helpers import conv_net as _conv_net
from reference import as_float, bf16_reference, conv2d, conv2d_bwd_data, conv2d_bwd_weights

import pcldnn_runtime as pr
from pcldnn_gen.arch import get_arch
from pcldnn_gen.build import build
from pcldnn_gen.netspec import parse_netspec
from pcldnn_gen.planner import Measured, TileTiming, plan_layer
from pcldnn_runtime.geometry import amx_conv_geometry


def _check_conv_forward(conv, source, layer, pairs_per_row, seed=3, n=None):
    """y = b + sum of bf16(x) bf16(w), each product exact in fp32 and n of them summed in fp32:
    |y - float64 reference on the rounded inputs| <= (n + 2) u (|b| + sum |x w|), the bound of
    recursive summation (u = 2^-24, n the terms: taps of a padded window times the input
    channels padded to a whole `pairs_per_row` x 2). And the kernel really reads bf16: against
    the unrounded inputs it is off by more than that bound."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((3, *conv.in_shape)).astype(np.float32)
    conv.bias = rng.standard_normal(conv.out_shape[0]).astype(np.float32)
    y = conv.forward(x)
    xr, wr = as_float(bf16_reference(x)), as_float(bf16_reference(conv.weights))
    stride, pad = (layer["stride"],) * 2, (layer["pad"],) * 2
    relu = layer.get("activation") == "relu"
    ref = conv2d(xr, wr, conv.bias, stride, pad, relu)
    magnitude = conv2d(np.abs(xr), np.abs(wr), np.abs(conv.bias), stride, pad)
    if n is None:
        n = -(-source["channels"] // (2 * pairs_per_row)) * 2 * pairs_per_row * layer["kernel"] ** 2
    bound = (n + 2) * U32 * magnitude
    assert np.all(np.abs(y - ref) <= bound)
    unrounded = conv2d(x, conv.weights, conv.bias, stride, pad, relu)
    assert np.any(np.abs(y - unrounded) > bound)


def _pair(value) -> tuple[int, int]:
    """A net.json size (one number, or [rows, columns]) as a pair."""
    return (value[0], value[1]) if isinstance(value, list) else (value, value)


def _check_backward_data(conv, layer, x, dy, dx, channel_block):
    """dx = sum of bf16(dy, masked by the ReLU) bf16(w) over oc, kh, kw: the same bound, n the
    output channels padded to `channel_block` times the taps; off by more against unrounded
    inputs. dy: the masked gradient. Where dx is stored as bf16 (families.bf16_gradients) that sum
    is rounded once more, to nearest even: within 2^-8 of itself, relative."""
    stride, pad, kernel = _pair(layer["stride"]), _pair(layer["pad"]), _pair(layer["kernel"])
    dyr, wr = as_float(bf16_reference(dy)), as_float(bf16_reference(conv.weights))
    ref = conv2d_bwd_data(dyr, wr, stride, pad, x.shape)
    magnitude = conv2d_bwd_data(np.abs(dyr), np.abs(wr), stride, pad, x.shape)
    n = -(-layer["out_channels"] // channel_block) * channel_block * kernel[0] * kernel[1]
    bound = (n + 2) * U32 * magnitude
    if conv.in_grad_bf16:
        np.testing.assert_array_equal(dx, as_float(bf16_reference(dx)))  # bf16 values
        assert np.all(np.abs(dx - ref) <= bound + 2.0 ** -8 * (np.abs(ref) + bound))
        return
    assert np.all(np.abs(dx - ref) <= bound)
    assert np.any(np.abs(dx - conv2d_bwd_data(dy, conv.weights, stride, pad, x.shape)) > bound)


def _check_backward_weights(layer, x, dy, dw, db, n):
    """dw = sum over images and output pixels of bf16(x) bf16(dy, masked): the bound with n
    terms; off by more against unrounded inputs; db sums the fp32 dy (fp32 bound)."""
    kernel, stride, pad = (layer["kernel"],) * 2, (layer["stride"],) * 2, (layer["pad"],) * 2
    xr, dyr = as_float(bf16_reference(x)), as_float(bf16_reference(dy))
    ref, _ = conv2d_bwd_weights(xr, dyr, kernel, stride, pad)
    magnitude, _ = conv2d_bwd_weights(np.abs(xr), np.abs(dyr), kernel, stride, pad)
    bound = (n + 2) * U32 * magnitude
    assert np.all(np.abs(dw - ref) <= bound)
    unrounded, exact_db = conv2d_bwd_weights(x, dy, kernel, stride, pad)
    assert np.any(np.abs(dw - unrounded) > bound)
    _, db_scale = conv2d_bwd_weights(np.abs(x), np.abs(dy), kernel, stride, pad)
    assert np.all(np.abs(db - exact_db) <= (n + 2) * U32 * db_scale)


@needs_amx
def test_amx_conv_backward_data_where_no_window_reaches_the_input(tmp_path):
    """A 1x1 stride-2 convolution padded by 1 over a 1-wide input reads columns -1 and 1 only:
    no window reaches an input pixel, dx is zero and the per-phase geometry has no pixel block
    (the planner divided by their count: found by benchmarks/random_nets.py, seed 94)."""
    out = _conv_net(tmp_path, {"channels": 16, "height": 9, "width": 1},
                    {"out_channels": 16, "kernel": 1, "stride": 2, "pad": 1}, "bf16", name="amx", arch=AMX_ARCH)
    conv = pr.load(out, threads=2).layers["conv"]
    assert conv.kernel_kind("bwd_data") == "conv_bwd_data_amx"
    rng = np.random.default_rng(6)
    y = conv.forward(rng.standard_normal((3, *conv.in_shape)).astype(np.float32))
    np.testing.assert_array_equal(y, np.broadcast_to(conv.bias[None, :, None, None], y.shape))  # the bias only
    dx = conv.backward_data(rng.standard_normal(y.shape).astype(np.float32))
    assert dx.shape == (3, 16, 9, 1) and not np.any(dx)


def _weights_gradient(conv, layer, images, seed):
    """(x, y, dy masked by the ReLU, dw, db) of `layer.backward_weights` on random x and dy; the
    caller's dy is left as it was (the kernels mask a copy, or the layer's own buffer)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((images, *conv.in_shape)).astype(np.float32)
    y = conv.forward(x)
    dy = rng.standard_normal(y.shape).astype(np.float32)
    dy_before = dy.copy()
    dw, db = conv.backward_weights(x, dy)
    np.testing.assert_array_equal(dy, dy_before)
    if layer.get("activation") == "relu":
        dy = np.where(y > 0, dy, np.float32(0))
    return x, y, dy, dw, db


@needs_amx
@pytest.mark.parametrize("source,layer", AMX_CASES + AMX_STRIDED_CASES)
def test_amx_conv_backward_weights_in_copy_spans(tmp_path, source, layer):
    """The copies made per span of units (plan_conv_bwd_weights_amx, where MIN_COPY_SPAN units of
    every channel block's copies fit half of L2): an L2 sized for spans of 9 units, which start
    and end inside the 7 images (1-6 blocks each), so a span's copy of an image starts mid-row,
    the rows at its edges are copied by two spans and their bias summed by one. The bound, the
    bias, and the same bits on 1, 2 and 3 threads."""
    spec = parse_netspec({"name": "spans", "input": source, "layers": [{"name": "conv", "type": "conv", **layer}]})
    shape = spec.layers[0]
    geo = amx_conv_geometry("bwd_weights", shape.in_shape, shape.out_shape, shape.kernel, shape.pad, shape.stride)
    copy_kib = -(-shape.out_shape[0] // 16) + (1 + geo.odd_gradient_pairs(shape.kernel)) * -(
        -shape.in_shape[0] // 16) * shape.stride[0] * shape.stride[1]
    arch = dataclasses.replace(AMX_ARCH, l2_bytes=2 * 9 * copy_kib * 1024)
    out = tmp_path / "spans"
    build(spec, arch, out, precision="bf16")
    c_text = (out / "src" / "conv_bwd_weights.c").read_text()
    assert geo.pixel_blocks < 64  # spans of half of L2's 9 units (IMAGE_SPAN raises them in larger images)
    assert int(re.search(r"^#define COPY_UNITS (\d+) ", c_text, re.M)[1]) == 9
    net = pr.load(out, threads=2)
    conv = net.layers["conv"]
    rng = np.random.default_rng(8)
    x = rng.standard_normal((7, *conv.in_shape)).astype(np.float32)
    y = conv.forward(x)
    dy = rng.standard_normal(y.shape).astype(np.float32)
    masked = np.where(y > 0, dy, np.float32(0)) if layer.get("activation") == "relu" else dy
    _check_backward_weights_any_threads(conv, net, layer, x, y, dy, masked, (1, 3))


# fc kernels of a bf16 build: AMX where the arch has it, vdpbf16ps without (the same copies and
# work items); both archs with a 64 KiB L2, so the small test layers take several chunks
FC_ARCHS = [pytest.param(AMX_ARCH, marks=needs_amx, id="amx"),
            pytest.param(SMALL_L2_AVX512, marks=bf16_kernels, id="vdpbf16ps")]


def _fc_net(tmp_path, in_shape, features, activation, threads=2, loss=False, arch=AMX_ARCH):
    c, h, w = in_shape
    layers = [{"name": "fc", "type": "fc", "out_features": features, **({"activation": activation} if activation else {})}]
    layers += [{"name": "loss", "type": "softmax_cross_entropy"}] if loss else []
    spec = parse_netspec({"name": "f", "input": {"channels": c, "height": h, "width": w}, "layers": layers})
    build(spec, arch, tmp_path / "f", precision="bf16")
    return pr.load(tmp_path / "f", threads=threads)


@pytest.mark.parametrize("arch", FC_ARCHS)
def test_bf16_fc_slices_compute_their_blocks_only(tmp_path, arch):
    """A model-parallel slice of output blocks (pcldnn_runtime.distributed): forward and
    backward-weights give the slice's blocks bit for bit as the whole layer does and leave the
    others untouched; backward-data sums the slice's features only (a slice starting inside a
    32-feature tile), and two slices add up to the whole within the fp32 bound of one more add;
    an empty slice computes nothing and gives a zero input gradient."""
    fc = _fc_net(tmp_path, (20, 3, 3), 40, None, arch=arch).layers["fc"]
    rng = np.random.default_rng(4)
    batch = 9
    xb = rng.standard_normal(fc.input_shape(batch)).astype(np.float32)
    dyb = rng.standard_normal(fc.blocked_shape(fc.out_shape, batch)).astype(np.float32)
    whole, part = np.full_like(dyb, 7.0), np.full_like(dyb, 7.0)
    fc.run_forward(xb, whole, (0, 3))
    fc.run_forward(xb, part, (1, 3))
    flat = lambda a: a.reshape(batch, 3, 16)  # noqa: E731
    assert np.array_equal(flat(part)[:, 1:], flat(whole)[:, 1:]) and np.all(flat(part)[:, 0] == 7.0)

    grads = [tuple(np.full_like(g, 7.0) for g in fc.grad_buffers) for _ in range(2)]
    dx = [np.empty_like(xb) for _ in range(3)]
    fc.run_backward(xb, None, dyb.copy(), dx[0], grads[0], (0, 3))
    fc.run_backward(xb, None, dyb.copy(), dx[1], grads[1], (1, 3))
    fc.run_backward(xb, None, dyb.copy(), dx[2], None, (0, 1))
    (dw_all, db_all), (dw_part, db_part) = grads
    assert np.array_equal(dw_part[1:], dw_all[1:]) and np.all(dw_part[:1] == 7.0)  # (OCB, ...) blocked
    assert np.array_equal(db_part[16:], db_all[16:]) and np.all(db_part[:16] == 7.0)
    # the blocked weights as the (features, K) matrix the blocked input rows multiply
    wm = np.asarray(fc._wt).transpose(0, 5, 1, 2, 3, 4).reshape(48, -1)
    terms = np.abs(as_float(bf16_reference(dyb.reshape(batch, 48)))) @ np.abs(as_float(bf16_reference(wm)))
    bound = 2 * (64 + 3) * U32 * terms.reshape(dx[0].shape)  # each within (n + 2) u of exact, one add more
    assert np.all(np.abs(dx[1] + dx[2] - dx[0]) <= bound)
    assert not np.allclose(dx[1], dx[0])  # the slice really drops the first block's features
    # an empty slice (more ranks than blocks): no output, a zero input gradient, no weight gradient
    empty, none = np.full_like(dyb, 7.0), np.full_like(xb, 7.0)
    fc.run_forward(xb, empty, (3, 3))
    fc.run_backward(xb, None, dyb.copy(), none, grads[1], (3, 3))
    assert np.all(empty == 7.0) and np.all(none == 0.0)
    assert np.array_equal(grads[1][0][1:], dw_all[1:]) and np.all(grads[1][0][:1] == 7.0)


def _every_change_of_the_weights_is_seen(net, layer, check, made, per_change, x, labels):
    """check() twice, then after each route that changes `layer`'s weights: its setter, a write
    through net.params, an optimizer step, loading a state dict. `made` (the conversions to bf16
    tiles so far) grows by `per_change` once a change, not once a call."""
    check()
    check()
    assert len(made) == per_change  # two calls, one conversion
    layer.weights = layer.weights * -2.0
    check()
    net.params[:] *= 0.5
    check()
    assert len(made) == 3 * per_change
    trainer = pr.Trainer(net, pr.SGD(0.5))
    before = layer.weights
    trainer.step(x, labels)
    assert not np.array_equal(layer.weights, before)
    check()
    state = net.state_dict()
    layer.weights = np.zeros_like(before)
    net.load_state_dict(state)
    check()


@pytest.mark.parametrize("arch", FC_ARCHS)
def test_bf16_fc_weight_tiles_follow_every_change_of_the_weights(tmp_path, arch):
    """The bf16 weight tiles are made once after each change, not once a call, and every route
    that changes the weights is seen by the next forward: the weights setter, a write through
    net.params, an optimizer step, loading a state dict."""
    net = _fc_net(tmp_path, (16, 3, 3), 24, None, threads=1, loss=True, arch=arch)
    fc = net.layers["fc"]
    made = []
    real = fc._k["wt_to_tiles"]
    fc._k["wt_to_tiles"] = lambda *args: (made.append(args[3:5]), real(*args))
    rng = np.random.default_rng(5)
    x = rng.standard_normal((6, 16, 3, 3)).astype(np.float32)

    def check():  # y against the fp32 weights of now (bf16 rounding: a loose relative bound)
        ref = x.reshape(6, -1).astype(np.float64) @ fc.weights.T + fc.bias
        np.testing.assert_allclose(fc.forward(x), ref, rtol=0, atol=0.05 * np.abs(ref).max())

    _every_change_of_the_weights_is_seen(net, fc, check, made, 1, x, rng.integers(0, 24, 6))
    assert made[0] == (0, 2)  # the whole layer's output blocks


@pytest.mark.parametrize("arch,channels,roles", [pytest.param(p.values[0], 16, ["fwd_tiles", "bwd_data_tiles"],
                                                              marks=p.marks, id=p.id) for p in BF16_BUILDS] +
                         [pytest.param(AMX_ARCH, 3, ["fwd_tiles", "bwd_data_tiles"], marks=needs_amx, id="amx-packed"),
                          pytest.param(get_arch("avx512"), 3, ["fwd_tiles"], marks=bf16_kernels, id="vdpbf16ps-packed")])
def test_conv_weight_copies_follow_every_change_of_the_weights(tmp_path, arch, channels, roles):
    """A bf16 convolution's forward and backward-data weight copies (AMX B tiles, the packed
    first layer's tiles of both passes, or the vdpbf16ps pair layouts, the packed first layer's
    forward's of a kernel row's values) are made once after each change of the weights, not once
    a call, and the next call sees every route that changes them: the weights setter, a write
    through net.params, an optimizer step, loading a state dict."""
    layers = [{"name": "conv", "type": "conv", "out_channels": 24, "kernel": 3, "pad": 1},
              {"name": "fc", "type": "fc", "out_features": 5}, {"name": "loss", "type": "softmax_cross_entropy"}]
    spec = parse_netspec({"name": "t", "input": {"channels": channels, "height": 6, "width": 7}, "layers": layers})
    build(spec, arch, tmp_path / "t", precision="bf16")
    net = pr.load(tmp_path / "t", threads=2)
    conv = net.layers["conv"]
    made = []
    assert [r for r in ("fwd_tiles", "bwd_data_tiles") if r in conv._k] == roles
    for role in roles:
        real = conv._k[role]
        conv._k[role] = lambda *args, role=role, real=real: (made.append(role), real(*args))
    rng = np.random.default_rng(5)
    x = rng.standard_normal((3, channels, 6, 7)).astype(np.float32)
    dy = rng.standard_normal((3, 24, 6, 7)).astype(np.float32)

    def check():  # both passes against the fp32 weights of now (bf16 rounding: a loose bound)
        w = conv.weights
        y, ref = conv.forward(x), conv2d(x, w, conv.bias, (1, 1), (1, 1))
        np.testing.assert_allclose(y, ref, rtol=0, atol=0.03 * np.abs(ref).max())
        dx, ref = conv.backward_data(dy), conv2d_bwd_data(dy, w, (1, 1), (1, 1), x.shape)
        np.testing.assert_allclose(dx, ref, rtol=0, atol=0.03 * np.abs(ref).max())

    _every_change_of_the_weights_is_seen(net, conv, check, made, len(roles), x, rng.integers(0, 5, 3))
    assert made[:len(roles)] == roles


def test_amx_and_bf16_kernels_keep_their_kinds_with_a_tuning_database(tmp_path):
    """With a tuning database holding an fp32 measurement of the same layer, a bf16 build's AMX
    and vdpbf16ps kernels still get plans of their own kinds, not the fp32 entry's tile (an fp32
    plan would give a kernel of the wrong kind, which the manifest check refuses at load)."""
    from pcldnn_gen.build import plan_kernel
    from pcldnn_gen.tuning import Entry, TuningDB, plan_key

    spec = parse_netspec({"name": "t", "input": {"channels": 16, "height": 6, "width": 6}, "layers": [
        {"name": "c", "type": "conv", "out_channels": 16, "kernel": 3, "pad": 1},
        {"name": "f", "type": "fc", "out_features": 10}]})
    conv, fc = spec.layers
    vdp = get_arch("avx512")
    fp32_plan = plan_layer(conv, "fwd", vdp)
    other = fp32_plan.rejected[0]
    timing = TileTiming(width=other.width, vectors=other.vectors, predicted_efficiency=0.5, ms=1.0)
    measured = Measured(model=(fp32_plan.tile.width, fp32_plan.tile.vectors), batch=2, threads=1, peak_gflops=1.0,
                        flops=1, timings=(timing,))
    db = TuningDB(tmp_path / "tuning.json")
    db.merge_into([Entry(plan_key(conv, fp32_plan, vdp), vdp.name, (other.width, other.vectors), measured)])
    assert plan_kernel(conv, "fwd", vdp, db).measured is not None  # the fp32 build takes it
    assert plan_kernel(fc, "fwd", AMX_ARCH, db, precision="bf16").kind == "fc_fwd_amx"
    assert plan_kernel(fc, "bwd_weights", AMX_ARCH, db, precision="bf16").kind == "fc_bwd_weights_amx"
    assert plan_kernel(fc, "bwd_data", vdp, db, precision="bf16").kind == "fc_bwd_data_bf16"
    assert plan_kernel(conv, "bwd_weights", AMX_ARCH, db, precision="bf16").kind == "conv_bwd_weights_amx"
    bf16_plan = plan_kernel(conv, "fwd", vdp, db, precision="bf16")
    assert bf16_plan.kind == "conv_fwd_bf16" and bf16_plan.measured is None
    assert bf16_plan == plan_layer(conv, "fwd", vdp, bf16=True)


def test_amx_builds_put_every_convolution_pass_on_tiles(tmp_path):
    """An arch with AMX: a convolution's three passes are AMX kernels that convert their own
    operands (no bf16 copies in the layout library), headers say the tile blocking; strided
    forward and backward-weights passes on phase planes of x, backward-data of a strided layer
    or one padded past the window - 1 per phase of dx (their headers say so)."""
    spec = parse_netspec({"name": "t", "input": {"channels": 16, "height": 8, "width": 8}, "layers": [
        {"name": "c1", "type": "conv", "out_channels": 32, "kernel": 3, "pad": 1},
        {"name": "c2", "type": "conv", "out_channels": 16, "kernel": 3, "stride": 2, "pad": 1},
        {"name": "c3", "type": "conv", "out_channels": 16, "kernel": 1, "pad": 1}]})
    build(spec, AMX_ARCH, tmp_path / "t", precision="bf16")
    doc = json.loads((tmp_path / "t" / "manifest.json").read_text())
    assert doc["arch"]["amx"] is True
    kinds = {layer["name"]: [next(iter(layer["kernels"][p]["symbols"].values())) for p in ("fwd", "bwd_data", "bwd_weights")]
             for layer in doc["layers"]}
    assert kinds == {name: ["conv_fwd_amx", "conv_bwd_data_amx", "conv_bwd_weights_amx"] for name in ("c1", "c2", "c3")}
    c1, c2, c3 = doc["layers"]
    for layer, phases in ((c2, "dx in 4 phases of stride 2x2"), (c3, "dx in 1 phase of stride 1x1")):
        assert phases in (tmp_path / "t" / layer["kernels"]["bwd_data"]["source"]).read_text().split("*/")[0]
    assert not any("to_bf16" in s for layer in (c1, c2) for s in layer["kernels"]["layout"]["symbols"])
    header = (tmp_path / "t" / c1["kernels"]["fwd"]["source"]).read_text().split("*/")[0]
    assert "blocks  : AMX tiles: 32 result pixels x 16 result channels" in header
    assert "reduction chunk 1 x 32 source channels" in header  # 16 channels: one 32-channel block
    header = " ".join((tmp_path / "t" / c1["kernels"]["bwd_data"]["source"]).read_text().split("*/")[0]
                      .replace(" * ", " ").split())
    assert "backward-data pass on AMX tiles" in header and "32 padded source channels for 32" in header
    # without AMX the same net is all vdpbf16ps
    build(spec, get_arch("avx512"), tmp_path / "u", precision="bf16")
    doc = json.loads((tmp_path / "u" / "manifest.json").read_text())
    assert doc["layers"][0]["kernels"]["fwd"]["symbols"] == {"pcldnn_c1_fwd": "conv_fwd_bf16",
                                                               "pcldnn_c1_fwd_tiles": "conv_weight_tiles"}
    assert doc["layers"][1]["kernels"]["bwd_data"]["symbols"] == {"pcldnn_c2_bwd_data": "conv_bwd_data_bf16",
                                                                    "pcldnn_c2_bwd_data_tiles": "conv_weight_tiles"}


def test_bf16_backward_data_with_a_narrower_last_group_builds(tmp_path):
    """Compiled on every CPU (warning-free, the suite's CompilerWarning filter): the vdpbf16ps
    backward-data of 13 ic blocks emits the last group's own tiles; its numbers are checked
    with CONV_CASES where the CPU has AVX512_BF16."""
    source, layer = CONV_CASES[-1]
    spec = parse_netspec({"name": "b", "input": source, "layers": [{"name": "conv", "type": "conv", **layer}]})
    plan = build(spec, get_arch("avx512"), tmp_path / "b", precision="bf16").plans[("conv", "bwd_data")]
    assert plan.kind == "conv_bwd_data_bf16" and plan.rem_vectors == 13 % plan.tile.vectors > 0
    text = (tmp_path / "b" / "src" / "conv_bwd_data.c").read_text()
    assert f"static inline void tile_{plan.tile.width}_v{plan.rem_vectors}(" in text


@pytest.mark.parametrize("arch", [pytest.param(get_arch("avx512"), marks=bf16_kernels, id="vdpbf16ps"),
                                  pytest.param(AMX_ARCH, marks=needs_amx, id="amx")])
def test_few_channel_conv_inside_a_net_builds_and_matches_fp32(tmp_path, arch):
    """A convolution of fewer input channels than a vector that is not the first layer: its
    input is blocked (not packed), its forward and backward-weights passes bf16; without AMX its
    backward-data is the fp32 few-channel kernel (no channel pairs to take; such a build was
    once refused by its own loader). Its dx then equals the fp32 build's bit for bit."""
    layers = [{"name": "conv1", "type": "conv", "out_channels": 5, "kernel": 3, "pad": 1, "activation": "relu"},
              {"name": "conv2", "type": "conv", "out_channels": 32, "kernel": 3, "pad": 1}]
    spec = parse_netspec({"name": "few", "input": {"channels": 16, "height": 7, "width": 6}, "layers": layers})
    nets = {}
    for precision, a in (("bf16", arch), ("fp32", get_arch("avx512"))):
        build(spec, a, tmp_path / precision, precision=precision)
        nets[precision] = pr.load(tmp_path / precision, threads=2)
    conv = nets["bf16"].layers["conv2"]
    kinds = [conv.kernel_kind(p) for p in ("fwd", "bwd_data", "bwd_weights")]
    suffix = "_amx" if arch.amx else "_bf16"
    assert kinds == ["conv_fwd" + suffix, "conv_bwd_data" + suffix if arch.amx else "conv_bwd_data",
                     "conv_bwd_weights" + suffix]
    rng = np.random.default_rng(4)
    x = rng.standard_normal((2, 5, 7, 6)).astype(np.float32)
    dy = rng.standard_normal((2, 32, 7, 6)).astype(np.float32)
    fp32 = nets["fp32"].layers["conv2"]
    fp32.weights = conv.weights
    for layer in (conv, fp32):
        layer.forward(x)
    dx = conv.backward_data(dy)
    if not arch.amx:
        np.testing.assert_array_equal(dx, fp32.backward_data(dy))
    else:
        _check_backward_data(conv, {"stride": 1, "pad": 1, "kernel": 3, "out_channels": 32}, x, dy, dx,
                             channel_block=32)
    _check_conv_forward(conv, {"channels": 5}, {"stride": 1, "pad": 1, "kernel": 3}, pairs_per_row=16 if arch.amx else 8)


def _broken_image_stays_its_own(conv) -> np.ndarray:
    """An image of NaN and Inf before a clean one in one forward call leaves the clean image's
    outputs as that image alone gives them, bit for bit (and finite); returns the clean image."""
    rng = np.random.default_rng(4)
    clean = rng.standard_normal((1, *conv.in_shape)).astype(np.float32)
    broken = np.where(rng.random(clean.shape) < 0.5, np.float32(np.nan), np.float32(np.inf))
    alone = conv.forward(clean)
    assert np.all(np.isfinite(alone))
    np.testing.assert_array_equal(conv.forward(np.concatenate([broken, clean]))[1:], alone)
    return clean


@needs_amx
def test_amx_packed_first_layer_keeps_a_broken_image_to_itself(tmp_path):
    """The in-place forward's runs read up to 31 values past a window (against zero weights) from
    one thread's buffer of padded rows, reused image after image: an image of NaN and Inf leaves
    the next image's outputs as that image alone gives them, bit for bit."""
    source, layer = {"channels": 3, "height": 12, "width": 21}, {"out_channels": 16, "kernel": 7, "stride": 2, "pad": 3}
    out = _conv_net(tmp_path, source, layer, "bf16", name="amx", arch=AMX_ARCH)
    assert "read in place" in (out / "src" / "conv_fwd.c").read_text()
    conv = pr.load(out, threads=1).layers["conv"]
    _broken_image_stays_its_own(conv)


@bf16_kernels
@pytest.mark.parametrize("threads", [1, 2])
def test_bf16_packed_first_layer_keeps_a_broken_image_to_itself(tmp_path, threads):
    """An odd run's last pair reads the value after the window (against a zero weight) from a
    thread's buffer of padded rows, reused image after image; a row's last window ends at the
    row's end (no padding), so that value is the next row's first: an image of NaN and Inf
    leaves the next image's outputs as that image alone gives them, bit for bit; and in an image
    one Inf reaches (as NaN or Inf) only the pixels whose windows hold it and the one whose run
    ends just before it."""
    source, layer = {"channels": 3, "height": 12, "width": 21}, {"out_channels": 16, "kernel": 7, "stride": 2, "pad": 0}
    out = _conv_net(tmp_path, source, layer, "bf16")
    conv = pr.load(out, threads=threads).layers["conv"]
    assert conv.kernel_kind("fwd") == "conv_fwd_packed_bf16"
    clean = _broken_image_stays_its_own(conv)
    one = clean.copy()
    one[0, 0, 6, 11] = np.inf  # channel 0 of pixel (6, 11)
    hit = ~np.isfinite(conv.forward(one)[0, 0])
    oh, ow = np.arange(hit.shape[0])[:, None], np.arange(hit.shape[1])[None, :]
    # output pixel (oh, ow) reads rows 2 oh .. + 6, columns 2 ow .. + 6, and channel 0 of column
    # 2 ow + 7 (value 21 of a 21-value run: the last pair's second half)
    expected = (2 * oh <= 6) & (6 < 2 * oh + 7) & (((2 * ow <= 11) & (11 < 2 * ow + 7)) | (2 * ow + 7 == 11))
    assert expected.sum() == 3 * 4
    np.testing.assert_array_equal(hit, expected)


@bf16_kernels
def test_bf16_packed_first_layer_backward_weights_bits_do_not_depend_on_threads(tmp_path):
    """Each weight tile belongs to one thread and sums the bands in order, the bias sums its rows
    in a fixed order: one, two and three threads give the same dw and db bits (bands of a few
    rows, 16 KiB of L2, so several bands an image)."""
    source, layer = PACKED_BF16_GRADIENT_CASES[2]
    out = _conv_net(tmp_path, source, layer, "bf16", arch=SMALL_L2)
    results = []
    for threads in (1, 2, 3):
        conv = pr.load(out, threads=threads).layers["conv"]
        assert conv.kernel_kind("bwd_weights") == "conv_bwd_weights_packed_bf16"
        results.append(_weights_gradient(conv, layer, images=4, seed=2)[3:])
    for dw, db in results[1:]:
        np.testing.assert_array_equal(dw, results[0][0])
        np.testing.assert_array_equal(db, results[0][1])


@bf16_kernels
def test_bf16_packed_first_layer_backward_weights_ignores_columns_no_window_reads(tmp_path):
    """Rows of 9 output pixels (7x7 windows at stride 2 over 24 columns: column 23 is in no
    window): the last pair's missing pixel has zero dy, and the pair copy holds zeros where no
    window reads, so an Inf in column 23 leaves dw and db as the image without it gives them,
    bit for bit (0 x Inf would be NaN)."""
    source, layer = {"channels": 3, "height": 9, "width": 24}, {"out_channels": 16, "kernel": 7, "stride": 2, "pad": 0}
    conv = pr.load(_conv_net(tmp_path, source, layer, "bf16"), threads=2).layers["conv"]
    assert conv.out_shape[2] == 9
    rng = np.random.default_rng(6)
    x = rng.standard_normal((2, 3, 9, 24)).astype(np.float32)
    dy = rng.standard_normal((2, 16, 2, 9)).astype(np.float32)
    clean = conv.backward_weights(x, dy)
    x[:, :, :, 23] = np.inf
    for got, want in zip(conv.backward_weights(x, dy), clean):
        assert np.all(np.isfinite(got))
        np.testing.assert_array_equal(got, want)


@needs_amx
def test_amx_packed_first_layer_backward_data_reads_a_bf16_relu_mask_and_keeps_inf_to_its_window(tmp_path):
    """Followed by a convolution on tiles, the packed layer's output is stored as bf16 and its
    backward-data masks dy by it; its dy stays fp32. An infinite dy value makes exactly the dx
    values its window reaches non-finite: a run's 16-value blocks pass its end, where zero
    weights would make NaN of it, and those lanes must not be added."""
    layers = [{"name": "conv1", "type": "conv", "out_channels": 20, "kernel": 7, "stride": 2, "pad": 3,
               "activation": "relu"},
              {"name": "conv2", "type": "conv", "out_channels": 16, "kernel": 3, "pad": 1}]
    spec = parse_netspec({"name": "m", "input": {"channels": 3, "height": 15, "width": 19}, "layers": layers})
    build(spec, AMX_ARCH, tmp_path / "m", precision="bf16")
    conv = pr.load(tmp_path / "m", threads=1).layers["conv1"]
    assert conv.kernel_kind("bwd_data") == "conv_bwd_data_packed_amx" and conv.out_bf16 and not conv.out_grad_bf16
    rng = np.random.default_rng(12)
    x = rng.standard_normal((2, *conv.in_shape)).astype(np.float32)
    y = conv.forward(x)
    dy = rng.standard_normal(y.shape).astype(np.float32)
    masked = np.where(y > 0, dy, np.float32(0))
    assert 0.2 < np.mean(masked == 0) < 0.8
    layer = {"out_channels": 20, "kernel": 7, "stride": 2, "pad": 3}
    _check_backward_data(conv, layer, x, masked, conv.backward_data(dy), channel_block=32)
    c, oh, ow = np.argwhere(y[1] > 0)[len(np.argwhere(y[1] > 0)) // 2]
    dy[1, c, oh, ow] = np.inf
    dx = conv.backward_data(dy)
    reach = np.zeros(x.shape[1:], dtype=bool)
    reach[:, max(0, 2 * oh - 3):2 * oh + 4, max(0, 2 * ow - 3):2 * ow + 4] = True
    np.testing.assert_array_equal(np.isfinite(dx[1]), ~reach)
    assert np.all(np.isfinite(dx[0]))


@needs_amx
def test_amx_packed_first_layer_backward_passes_share_one_unmasked_dy(tmp_path):
    """Both backward passes of the packed layer on one blocked dy, as `backward_blocked` runs
    them (backward-weights first): each masks its own copy by the ReLU's output and leaves dy as
    it was (masking it in place had cost a pass over dy and y), so backward-data still gets the
    mask: both results against float64."""
    source, layer = {"channels": 3, "height": 13, "width": 12}, {"out_channels": 24, "kernel": 7, "stride": 2,
                                                                 "pad": 3, "activation": "relu"}
    conv = pr.load(_conv_net(tmp_path, source, layer, "bf16", name="amx", arch=AMX_ARCH), threads=2).layers["conv"]
    assert [conv.kernel_kind(p) for p in ("bwd_data", "bwd_weights")] == ["conv_bwd_data_packed_amx",
                                                                          "conv_bwd_weights_packed_amx"]
    rng = np.random.default_rng(10)
    x = rng.standard_normal((3, *conv.in_shape)).astype(np.float32)
    y = conv.forward(x)
    dy = rng.standard_normal(y.shape).astype(np.float32)
    xb, yb, aux = conv._saved
    dyb = conv.output_gradient_blocked(dy, "dy")
    before = dyb.copy()
    dxb = np.zeros(xb.shape, dtype=np.float32)
    conv.backward_blocked(xb, yb, aux, dyb, dxb, conv.grad_buffers)
    np.testing.assert_array_equal(dyb, before)
    masked = np.where(y > 0, dy, np.float32(0))
    assert 0.2 < np.mean(masked == 0) < 0.8
    dx = conv._from_blocked("in", dxb, conv.in_shape, False).reshape(x.shape)
    _check_backward_data(conv, layer, x, masked, dx, channel_block=32)
    _check_backward_weights(layer, x, masked, conv.grad_weights, conv.grad_bias,
                            n=x.shape[0] * -(-y.shape[2] * y.shape[3] // 32) * 32)


def _check_backward_weights_any_threads(conv, net, layer, x, y, dy, masked, thread_counts):
    """The bf16 backward-weights bound on the net's thread count, then the same bits on each of
    `thread_counts`."""
    dw, db = conv.backward_weights(x, dy)
    _check_backward_weights(layer, x, masked, dw, db, n=x.shape[0] * y.shape[2] * (y.shape[3] + 1))
    for threads in thread_counts:
        net.threads = threads
        for got, want in zip(conv.backward_weights(x, dy), (dw, db)):
            np.testing.assert_array_equal(got, want)
