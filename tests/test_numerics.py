"""Generated kernels against the plain numpy references, for every runnable ISA."""
from __future__ import annotations

import numpy as np
import pytest
import reference as ref
from helpers import ISA_PARAMS, NETS, assert_dot_close, build_and_load

from pcldnn_gen.arch import PRESETS

# (batch, C, H, W, OC, kernel, stride, pad, relu): kernel 1/2/3/5/11, stride 1/2/4,
# pad 0/1/2 (also pad > kernel/2), asymmetric, channels 1/3/8/17/64, non-square, batch 1 and 7.
CONV_SHAPES = [
    (1, 1, 5, 5, 1, 1, 1, 0, False),
    (7, 3, 13, 11, 8, 3, 1, 1, True),
    (1, 8, 16, 16, 16, 3, 1, 1, False),
    (7, 17, 9, 12, 19, 3, 2, 1, True),
    (2, 64, 14, 14, 64, 3, 1, 1, True),
    (1, 3, 31, 29, 12, 11, 4, 0, False),
    (2, 3, 23, 23, 96, 11, 4, 2, True),
    (1, 16, 10, 10, 24, 5, 1, 2, False),
    (7, 8, 12, 9, 8, 5, 2, 0, True),
    (1, 17, 8, 8, 17, 1, 1, 0, False),
    (2, 32, 7, 9, 40, 1, 2, 0, True),
    (1, 3, 10, 14, 5, [3, 5], [1, 2], [1, 2], False),
    (3, 9, 11, 7, 16, [5, 3], [2, 1], [0, 1], True),
    (1, 1, 6, 6, 3, 3, 1, 2, False),
    (2, 4, 5, 17, 8, [1, 3], 1, [0, 1], False),
    (1, 64, 6, 6, 128, 3, 1, 1, True),
    (7, 1, 20, 20, 1, 5, 1, 2, False),
    (1, 24, 15, 15, 33, 3, 2, 1, True),
    (2, 3, 32, 32, 32, 3, 1, 1, True),
    (1, 8, 3, 3, 8, 3, 1, 0, False),
    (1, 5, 4, 30, 6, [1, 11], [1, 4], 0, False),
    (7, 12, 6, 6, 20, 3, 4, 1, True),
    (1, 2, 9, 9, 70, 3, 1, 0, False),
    (1, 64, 9, 9, 64, 2, 2, 0, True),
    (2, 3, 1, 1, 8, 1, 2, 1, False),  # every output reads only padding: the bias alone
    (3, 24, 22, 18, 40, 1, 2, 1, True),  # 1x1, plane >= 64 px: backward-weights prefetches the next
                                          # pixel block, across images, through the padding
    (1, 16, 5, 40, 16, 3, 1, 1, True),  # wide enough for an edge tile at both ends
    # few channels: backward-weights tiles over several kernel columns, with a narrower last
    # tap group and a narrower last oc-vector group together (AVX-512 / AVX2 respectively)
    (2, 2, 9, 20, 72, 7, 1, 3, True),
    (1, 3, 13, 17, 40, 5, [1, 2], 2, False),
    # 1x1 on planes of rows shorter than 8 pixels: forward and backward-data run the plane as one
    # row (planner.conv.plane_as_row), backward-weights on the plane
    (3, 40, 7, 7, 70, 1, 1, 0, True),
    (2, 17, 4, 5, 33, 1, 1, 0, False),
    (2, 16, 3, 1, 24, 1, 1, 0, True),
    # a 4x4 plane: backward-weights pixel blocks of 8 whole images (geometry.band_images), 19 images
    # as 8 + 8 + 3
    (19, 16, 4, 4, 24, 3, 1, 1, True),
]


def _pair(v):
    return tuple(v) if isinstance(v, list) else (v, v)


def _conv_layer(i, oc, k, s, p, relu):
    layer = {"name": f"c{i}", "type": "conv", "out_channels": oc, "kernel": k, "stride": s, "pad": p}
    if relu:
        layer["activation"] = "relu"
    return layer


@pytest.mark.parametrize("case", range(len(CONV_SHAPES)))
def test_conv_passes_match_numpy(tmp_path, isa, case):
    """Forward, backward-data and backward-weights of one conv layer, through the canonical API."""
    _check_conv(tmp_path, isa, case)


def _check_conv(tmp_path, isa, case, candidate=0):
    n, c, h, w, oc, k, s, p, relu = CONV_SHAPES[case]
    net = build_and_load(tmp_path, [_conv_layer(case, oc, k, s, p, relu)], (c, h, w), isa, candidate=candidate)
    layer = net.layers[f"c{case}"]
    rng = np.random.default_rng(case)
    layer.bias = rng.standard_normal(oc).astype(np.float32)
    x = rng.standard_normal((n, c, h, w)).astype(np.float32)
    wts, b = layer.weights, layer.bias
    stride, pad, (kh, kw) = _pair(s), _pair(p), _pair(k)

    y = layer.forward(x)
    want = ref.conv2d(x, wts, b, stride, pad, relu)
    assert_dot_close(y, want, ref.conv2d(np.abs(x), np.abs(wts), np.abs(b), stride, pad), c * kh * kw)

    dy = rng.standard_normal(y.shape).astype(np.float32)
    dy_eff = dy * (y > 0) if relu else dy  # the gradient through the fused ReLU, masked by our output
    dx = layer.backward_data(dy)
    want = ref.conv2d_bwd_data(dy_eff, wts, stride, pad, x.shape)
    assert_dot_close(dx, want, ref.conv2d_bwd_data(np.abs(dy_eff), np.abs(wts), stride, pad, x.shape), oc * kh * kw)

    dw, db = layer.backward_weights(x, dy)
    want_w, want_b = ref.conv2d_bwd_weights(x, dy_eff, (kh, kw), stride, pad)
    abs_w, abs_b = ref.conv2d_bwd_weights(np.abs(x), np.abs(dy_eff), (kh, kw), stride, pad)
    terms = n * y.shape[2] * y.shape[3]
    assert_dot_close(dw, want_w, abs_w, terms)
    assert_dot_close(db, want_b, abs_b, terms)


FAMILIES = [name for name, arch in PRESETS.items() if name != arch.isa]


@pytest.mark.parametrize("preset", [
    pytest.param(name, marks=pytest.mark.needs_isa(PRESETS[name].isa)) for name in FAMILIES])
def test_family_presets_match_numpy(tmp_path, preset):
    """A CPU family's figures (one FMA unit on Zen 4, latency 5 on Haswell, 48 KiB L1 ...) choose
    other tiles and chunks than the generic preset: the kernels they give are checked too, on a
    first layer with edge tiles, a strided layer, an edge-tiled one and two GEMMs."""
    for case in (0, 3, 6):
        _check_conv(tmp_path / f"c{case}", preset, case)
    for case in (4, 8):
        _check_fc(tmp_path / f"f{case}", preset, case)


@pytest.mark.parametrize("candidate", [1, 3])
def test_tuner_candidates_match_numpy(tmp_path, isa, candidate):
    """The tiles `pcldnn-gen tune` may choose instead of the model's (its next-best candidates,
    each with its own remainder, edge and blocking), on a first layer, a strided layer with
    channel remainders, an edge-tiled layer and two GEMMs."""
    for case in (1, 3, 25):
        _check_conv(tmp_path, isa, case, candidate)
    for case in (4, 8):
        _check_fc(tmp_path, isa, case, candidate)


# (batch, input C, H, W, out features, relu): features not multiples of the vector width,
# input from a spatial tensor (flatten) and from a vector, batch sizes hitting every remainder tile.
FC_SHAPES = [
    (1, 10, 1, 1, 3, False),
    (7, 13, 1, 1, 17, True),
    (5, 100, 1, 1, 9, False),
    (8, 3, 5, 5, 12, True),
    (13, 37, 1, 1, 70, False),
    (6, 64, 2, 2, 8, True),
    (2, 1, 1, 1, 1, False),
    (11, 256, 1, 1, 40, True),
    (3, 20, 1, 1, 300, False),  # more than 32 output blocks on AVX2: backward-data reduces in chunks
    (9, 1072, 1, 1, 20, True),  # 67 input blocks (prime) on AVX-512: backward-data's last k tile is narrower
]


@pytest.mark.parametrize("case", range(len(FC_SHAPES)))
def test_fc_passes_match_numpy(tmp_path, isa, case):
    _check_fc(tmp_path, isa, case)


def _check_fc(tmp_path, isa, case, candidate=0):
    n, c, h, w, oc, relu = FC_SHAPES[case]
    layer_spec = {"name": "f", "type": "fc", "out_features": oc}
    if relu:
        layer_spec["activation"] = "relu"
    net = build_and_load(tmp_path, [layer_spec], (c, h, w), isa, candidate=candidate)
    layer = net.layers["f"]
    rng = np.random.default_rng(100 + case)
    layer.bias = rng.standard_normal(oc).astype(np.float32)
    x = rng.standard_normal((n, c, h, w)).astype(np.float32)
    wts, b, k = layer.weights, layer.bias, c * h * w
    for batch in sorted({1, n}):  # every minibatch size reuses the same kernels
        xs = x[:batch]
        y = layer.forward(xs)
        assert_dot_close(y, ref.fc(xs, wts, b, relu), ref.fc(np.abs(xs), np.abs(wts), np.abs(b)), k)
        dy = rng.standard_normal(y.shape).astype(np.float32)
        dy_eff = dy * (y > 0) if relu else dy
        dx = layer.backward_data(dy)
        assert dx.shape == xs.shape
        assert_dot_close(dx, ref.fc_bwd_data(dy_eff, wts, xs.shape),
                         ref.fc_bwd_data(np.abs(dy_eff), np.abs(wts), xs.shape), oc)
        dw, db = layer.backward_weights(xs, dy)
        want_w, want_b = ref.fc_bwd_weights(xs, dy_eff)
        abs_w, abs_b = ref.fc_bwd_weights(np.abs(xs), np.abs(dy_eff))
        assert_dot_close(dw, want_w, abs_w, batch)
        assert_dot_close(db, want_b, abs_b, batch)
    # (N, F) input is accepted as well as (N, C, H, W)
    np.testing.assert_array_equal(layer.forward(x.reshape(n, -1)), layer.forward(x))


@pytest.mark.parametrize("case", [4, 7, 8])
def test_fc_slices_match_numpy(tmp_path, isa, case):
    """A model-parallel rank's slice: each pass over output-feature blocks [lo, hi) only, for
    slices that start and end inside a register tile's group, a single block, the ragged last
    block, and an empty slice (backward-data then returns zeros)."""
    n, c, h, w, oc, relu = FC_SHAPES[case]
    layer_spec = {"name": "f", "type": "fc", "out_features": oc, **({"activation": "relu"} if relu else {})}
    net = build_and_load(tmp_path, [layer_spec], (c, h, w), isa)
    layer, v = net.layers["f"], net.vector_floats
    ocb = -(-oc // v)
    rng = np.random.default_rng(200 + case)
    layer.bias = rng.standard_normal(oc).astype(np.float32)
    x = rng.standard_normal((n, c, h, w)).astype(np.float32)
    wts, b = layer.weights, layer.bias
    full_y = ref.fc(x, wts, b, relu)
    dy = rng.standard_normal(full_y.shape).astype(np.float32)
    dy_eff = dy * (full_y > 0) if relu else dy
    for lo, hi in sorted({(1, ocb), (0, 1), (ocb - 1, ocb), (ocb // 3, ocb - ocb // 3), (ocb // 2, ocb // 2)}):
        layer.ocb_range = (lo, hi)
        if lo == hi:
            layer.forward(x)
            assert not layer.backward_data(dy).any()
            continue
        cols = slice(lo * v, min(hi * v, oc))
        y = layer.forward(x)
        assert_dot_close(y[:, cols], full_y[:, cols], ref.fc(np.abs(x), np.abs(wts), np.abs(b))[:, cols], c * h * w)
        dx = layer.backward_data(dy)
        part = np.zeros_like(dy_eff)
        part[:, cols] = dy_eff[:, cols]
        assert_dot_close(dx, ref.fc_bwd_data(part, wts, x.shape), ref.fc_bwd_data(np.abs(part), np.abs(wts), x.shape),
                         (hi - lo) * v)
        dw, db = layer.backward_weights(x, dy)
        want_w, want_b = ref.fc_bwd_weights(x, dy_eff)
        abs_w, abs_b = ref.fc_bwd_weights(np.abs(x), np.abs(dy_eff))
        assert_dot_close(dw[cols], want_w[cols], abs_w[cols], n)
        assert_dot_close(db[cols], want_b[cols], abs_b[cols], n)


POOL_SHAPES = [  # overlapping windows (3/2), padding, asymmetric, channels not multiples of V
    (2, 17, 9, 9, 3, 2, 0), (1, 8, 8, 8, 2, 2, 0), (3, 5, 10, 7, 3, 2, 1), (7, 9, 6, 11, [2, 3], [1, 2], [1, 1]),
    (2, 3, 13, 13, 3, 1, 1),
]


@pytest.mark.parametrize("kind", ["maxpool", "avgpool"])
@pytest.mark.parametrize("n,c,h,w,k,s,p", POOL_SHAPES)
def test_pooling_passes_match_numpy(tmp_path, isa, kind, n, c, h, w, k, s, p):
    net = build_and_load(tmp_path, [{"name": "p", "type": kind, "kernel": k, "stride": s, "pad": p},
                                    {"name": "f", "type": "fc", "out_features": 2}], (c, h, w), isa)
    layer = net.layers["p"]
    rng = np.random.default_rng(7)
    # distinct values: the maximum of a window is unique, so the argmax is well defined
    x = rng.permutation(n * c * h * w).reshape(n, c, h, w).astype(np.float32) / 10
    kernel, stride, pad = _pair(k), _pair(s), _pair(p)
    y = layer.forward(x)
    dy = rng.standard_normal(y.shape).astype(np.float32)
    dx = layer.backward_data(dy)
    if kind == "maxpool":
        np.testing.assert_array_equal(y, ref.maxpool(x, kernel, stride, pad).astype(np.float32))
        # each dx element adds at most one dy per window covering it: error of a short float32 sum
        np.testing.assert_allclose(dx, ref.maxpool_bwd(x, dy, kernel, stride, pad), rtol=1e-6, atol=1e-6)
    else:
        area = kernel[0] * kernel[1]
        assert_dot_close(y, ref.avgpool(x, kernel, stride, pad), ref.avgpool(np.abs(x), kernel, stride, pad), area + 1)
        assert_dot_close(dx, ref.avgpool_bwd(dy, x.shape, kernel, stride, pad),
                         ref.avgpool_bwd(np.abs(dy), x.shape, kernel, stride, pad), area + 1)


def test_maxpool_ties_send_the_gradient_to_one_element(tmp_path, isa):
    net = build_and_load(tmp_path, [{"name": "p", "type": "maxpool", "kernel": 3, "stride": 2},
                                    {"name": "f", "type": "fc", "out_features": 2}], (4, 7, 7), isa)
    x = np.ones((2, 4, 7, 7), np.float32)  # every window is a tie
    layer = net.layers["p"]
    y = layer.forward(x)
    dx = layer.backward_data(np.ones_like(y))
    np.testing.assert_array_equal(dx, ref.maxpool_bwd(x, np.ones(y.shape), (3, 3), (2, 2), (0, 0)))
    assert dx.sum() == y.size


@pytest.mark.parametrize("rate", [0.25, 0.5])  # 0.5: the scale 2 must still be emitted as a float literal
def test_relu_and_dropout_layers(tmp_path, isa, rate):
    net = build_and_load(tmp_path, [{"name": "r", "type": "relu"}, {"name": "d", "type": "dropout", "rate": rate},
                                    {"name": "f", "type": "fc", "out_features": 3}], (5, 6, 7), isa)
    rng = np.random.default_rng(2)
    x = rng.standard_normal((4, 5, 6, 7)).astype(np.float32)
    relu, drop = net.layers["r"], net.layers["d"]
    y = relu.forward(x)
    np.testing.assert_array_equal(y, np.maximum(x, 0))
    dy = rng.standard_normal(x.shape).astype(np.float32)
    np.testing.assert_array_equal(relu.backward_data(dy), np.where(x > 0, dy, 0))

    keep = 1.0 - rate
    xd = np.abs(x) + 1  # nonzero, so a zero output means "dropped"
    yd = drop.forward(xd)
    kept = yd != 0
    np.testing.assert_allclose(yd[kept], xd[kept] / keep, rtol=1e-6)
    # 840 Bernoulli(keep) draws: the kept fraction is within 5 standard deviations of keep
    assert abs(kept.mean() - keep) < 5 * np.sqrt(keep * rate / kept.size)
    np.testing.assert_allclose(drop.backward_data(dy), np.where(kept, dy / keep, 0), rtol=1e-6)
    assert not np.array_equal(drop.forward(xd) != 0, kept)  # a new step draws a new mask
    # A shard starting at row 1 of the global minibatch (net.row_offset) draws the rows' own
    # masks, as one process does for the whole minibatch (same seed and draw count)
    draws = net.dropout_draws
    whole = drop.forward(xd) != 0
    net.dropout_draws, net.row_offset = draws, 1
    np.testing.assert_array_equal(drop.forward(xd[1:]) != 0, whole[1:])
    net.dropout_draws, net.row_offset = draws, 0
    assert not np.array_equal(drop.forward(xd[1:]) != 0, whole[1:])  # without the offset: row 0's mask
    net.row_offset = 0
    # evaluation mode: dropout is the identity
    fc = net.layers["f"]
    h = np.maximum(x, 0)
    assert_dot_close(net.forward(x), ref.fc(h, fc.weights, fc.bias), ref.fc(h, np.abs(fc.weights), np.abs(fc.bias)),
                     5 * 6 * 7)


def test_softmax_cross_entropy_layer(tmp_path, isa):
    net = build_and_load(tmp_path, [{"name": "f", "type": "fc", "out_features": 13},
                                    {"name": "loss", "type": "softmax_cross_entropy"}], (6, 1, 1), isa)
    rng = np.random.default_rng(4)
    logits = (rng.standard_normal((9, 13)) * 30).astype(np.float32)  # large: tests the max shift
    labels = rng.integers(0, 13, 9)
    loss_layer = net.layers["loss"]
    loss = loss_layer.forward(logits, labels)
    want_loss, want_grad = ref.softmax_cross_entropy(logits, labels)
    assert np.isfinite(loss) and loss == pytest.approx(want_loss, rel=1e-5)
    np.testing.assert_allclose(loss_layer.backward_data(), want_grad, rtol=1e-4, atol=1e-7)
    import pcldnn_runtime as pr
    with pytest.raises(pr.PcldnnError, match=r"labels must lie in \[0, 13\)"):
        loss_layer.forward(logits, labels + 13)


def test_small_caches_force_several_reduction_chunks(tmp_path, isa):
    """A 512-byte L1 and 64 KiB L2 make the planner split every reduction into several chunks:
    partial-sum reloads and the epilogue on the last chunk only (forward), several packed K
    chunks with narrower last panels and vector groups (fc backward-weights), pixel blocks cut
    into column blocks (conv backward-weights)."""
    import dataclasses

    from pcldnn_gen.arch import PRESETS
    # below the physical range an arch file may give (4 KiB L1): built directly, for the planner
    arch = dataclasses.replace(PRESETS[isa], name=f"tiny-{isa}", l1d_bytes=512, l2_bytes=64 * 1024)
    import pcldnn_runtime as pr
    from pcldnn_gen.build import build
    from pcldnn_gen.netspec import parse_netspec
    spec = parse_netspec({"name": "chunks", "input": {"channels": 40, "height": 6, "width": 70}, "layers": [
        {"name": "c", "type": "conv", "out_channels": 16, "kernel": 3, "pad": 1, "activation": "relu"},
        {"name": "f", "type": "fc", "out_features": 20, "activation": "relu"}]})
    result = build(spec, arch, tmp_path / "b")
    conv_plan, fc_plan = result.plans[("c", "fwd")], result.plans[("f", "fwd")]
    v = PRESETS[isa].vector_floats
    assert conv_plan.ifm_chunk < -(-40 // v), conv_plan
    assert fc_plan.k_chunk < 16 * 6 * 70, fc_plan
    fc_dw_plan, conv_dw_plan = result.plans[("f", "bwd_weights")], result.plans[("c", "bwd_weights")]
    k = -(-16 // v) * v * 6 * 70
    assert fc_dw_plan.k_chunk < k, fc_dw_plan  # several packed K chunks
    # a single output row whose tile slice (dy vectors + input row) overflows half of L1 is cut
    # into column blocks (here two of 35)
    assert conv_dw_plan.block_rows == 1 and conv_dw_plan.block_cols == 35, conv_dw_plan
    net = pr.load(tmp_path / "b")
    rng = np.random.default_rng(3)
    for layer in net.layers.values():
        layer.bias = rng.standard_normal(layer.out_shape[0]).astype(np.float32)
    x = rng.standard_normal((3, 40, 6, 70)).astype(np.float32)
    c, f = net.layers["c"], net.layers["f"]
    h = ref.conv2d(x, c.weights, c.bias, (1, 1), (1, 1), relu=True)
    habs = ref.conv2d(np.abs(x), np.abs(c.weights), np.abs(c.bias), (1, 1), (1, 1))
    assert_dot_close(c.forward(x), h, habs, 40 * 9)
    y = net.forward(x)
    want = ref.fc(h, f.weights, f.bias, relu=True)
    # Two stacked dot products: bound the second by the float32 error of its input as well.
    abs_want = ref.fc(habs, np.abs(f.weights), np.abs(f.bias))
    assert_dot_close(y, want, abs_want, 40 * 9 + 16 * 6 * 70)
    # Backward weights of both layers, on the kernels' own forward outputs (relu masks).
    dy = rng.standard_normal(y.shape).astype(np.float32)
    dy_eff = dy * (y > 0)
    hk = c.forward(x)
    assert result.plans[("f", "bwd_data")].k_block < k  # several K blocks
    np.testing.assert_array_equal(f.forward(hk), y)  # the layer-level call remembers its input
    dx = f.backward_data(dy)
    assert_dot_close(dx, ref.fc_bwd_data(dy_eff, f.weights, hk.shape),
                     ref.fc_bwd_data(np.abs(dy_eff), np.abs(f.weights), hk.shape), 20)
    dw, db = f.backward_weights(hk, dy)
    for got, want, bound in zip((dw, db), ref.fc_bwd_weights(hk, dy_eff), ref.fc_bwd_weights(np.abs(hk), np.abs(dy_eff))):
        assert_dot_close(got, want, bound, 3)
    gy = rng.standard_normal(hk.shape).astype(np.float32) * (hk > 0)
    dw, db = c.backward_weights(x, gy)
    want_w, want_b = ref.conv2d_bwd_weights(x, gy, (3, 3), (1, 1), (1, 1))
    abs_w, abs_b = ref.conv2d_bwd_weights(np.abs(x), np.abs(gy), (3, 3), (1, 1), (1, 1))
    assert_dot_close(dw, want_w, abs_w, 3 * 6 * 70)
    assert_dot_close(db, want_b, abs_b, 3 * 6 * 70)


def _build_3x3_relu_conv(tmp_path, arch, c, h, w, oc, choices=None):
    """A one-layer net, conv "c" (3x3, pad 1, ReLU), built for `arch` (small caches, for the planner)."""
    from pcldnn_gen.build import build
    from pcldnn_gen.netspec import parse_netspec
    spec = parse_netspec({"name": "conv", "input": {"channels": c, "height": h, "width": w}, "layers": [
        {"name": "c", "type": "conv", "out_channels": oc, "kernel": 3, "pad": 1, "activation": "relu"}]})
    return build(spec, arch, tmp_path / "b", choices=choices)


def _check_3x3_relu_conv(tmp_path, seed):
    """Forward and backward-data of that net on 3 images with 2 threads, against numpy."""
    import pcldnn_runtime as pr
    layer = pr.load(tmp_path / "b", threads=2).layers["c"]
    c, h, w = layer.in_shape
    oc = layer.out_shape[0]
    rng = np.random.default_rng(seed)
    layer.bias = rng.standard_normal(oc).astype(np.float32)
    x = rng.standard_normal((3, c, h, w)).astype(np.float32)
    y = layer.forward(x)
    wts, b = layer.weights, layer.bias
    assert_dot_close(y, ref.conv2d(x, wts, b, (1, 1), (1, 1), relu=True),
                     ref.conv2d(np.abs(x), np.abs(wts), np.abs(b), (1, 1), (1, 1)), c * 9)
    dy = rng.standard_normal(y.shape).astype(np.float32) * (y > 0)
    assert_dot_close(layer.backward_data(dy), ref.conv2d_bwd_data(dy, wts, (1, 1), (1, 1), x.shape),
                     ref.conv2d_bwd_data(np.abs(dy), np.abs(wts), (1, 1), (1, 1), x.shape), oc * 9)


def test_groups_outside_images_match_numpy(tmp_path, isa):
    """Weights far beyond L2 on a small plane: forward and backward-data loop over channel
    groups outside the images (images_inner), with 2 threads splitting the groups."""
    import dataclasses
    # 128 -> 128 3x3 weights are 576 KiB, above 4 x this L2; a one-vector group's slice (V output
    # channels, 4.5 V KiB) fits 3/4 of it beside an image's 2 KiB input and outweighs that input
    arch = dataclasses.replace(PRESETS[isa], name=f"small-l2-{isa}", l2_bytes=128 * 1024)
    result = _build_3x3_relu_conv(tmp_path, arch, 128, 2, 2, 128, choices={("c", "fwd"): (2, 1), ("c", "bwd_data"): (2, 1)})
    assert result.plans[("c", "fwd")].images_inner and result.plans[("c", "bwd_data")].images_inner
    _check_3x3_relu_conv(tmp_path, seed=5)


@pytest.mark.parametrize("isa", [p for p in ISA_PARAMS if p.values[0] != "scalar"])  # a scalar slice always fits L1
def test_bwd_data_row_blocks_past_l1_match_numpy(tmp_path, isa):
    """Weights beyond half of L2 and a weight slice that L1 cannot keep: backward-data's row
    blocks take every input row (the slice read from L2 once per row), over several images
    and 2 threads."""
    import dataclasses
    arch = dataclasses.replace(PRESETS[isa], name=f"small-caches-{isa}", l1d_bytes=4096, l2_bytes=128 * 1024)
    plan = _build_3x3_relu_conv(tmp_path, arch, 24, 7, 10, 128).plans[("c", "bwd_data")]
    assert plan.rows == 7 and "read from L2 once per row" in plan.reason and "once per row block" in plan.reason
    _check_3x3_relu_conv(tmp_path, seed=8)


@pytest.mark.parametrize("stride,tile", [(1, (4, 3)), (2, (3, 4)), (1, (1, 2))])
def test_bwd_data_narrower_last_ic_group_matches_numpy(tmp_path, isa, stride, tile):
    """13 input-channel blocks (208 channels on AVX-512): backward-data tiles of 2-4 ic vectors
    and a last group of 1 (its own tiles, edges and border pixels), stride 1 and 2 (phases),
    over 3 images and 2 threads; ReLU'd like a mid-net layer."""
    import pcldnn_runtime as pr
    from pcldnn_gen.build import build
    from pcldnn_gen.netspec import parse_netspec
    arch = PRESETS[isa]
    c = 13 * arch.vector_floats
    spec = parse_netspec({"name": "rem", "input": {"channels": c, "height": 7, "width": 11}, "layers": [
        {"name": "c", "type": "conv", "out_channels": 24, "kernel": 3, "stride": stride, "pad": 1, "activation": "relu"}]})
    plan = build(spec, arch, tmp_path / "b", choices={("c", "bwd_data"): tile}).plans[("c", "bwd_data")]
    assert (plan.tile.width, plan.tile.vectors, plan.rem_vectors) == (*tile, 13 % tile[1])
    layer = pr.load(tmp_path / "b", threads=2).layers["c"]
    rng = np.random.default_rng(13 + stride)
    x = rng.standard_normal((3, c, 7, 11)).astype(np.float32)
    y = layer.forward(x)
    wts = layer.weights
    dy = rng.standard_normal(y.shape).astype(np.float32)
    dy_eff = dy * (y > 0)
    assert_dot_close(layer.backward_data(dy), ref.conv2d_bwd_data(dy_eff, wts, (stride, stride), (1, 1), x.shape),
                     ref.conv2d_bwd_data(np.abs(dy_eff), np.abs(wts), (stride, stride), (1, 1), x.shape), 24 * 9)


def test_whole_net_forward_matches_layer_by_layer_reference(tmp_path, isa):
    import pcldnn_runtime as pr
    from pcldnn_gen.arch import get_arch
    from pcldnn_gen.build import build
    from pcldnn_gen.netspec import load_netspec
    spec = load_netspec(NETS / "cifar_small.json")
    build(spec, get_arch(isa), tmp_path / "cifar")
    net = pr.load(tmp_path / "cifar", threads=2)
    rng = np.random.default_rng(11)
    for batch in (5, 1, 5):  # buffers per minibatch size are created once and reused
        x = rng.standard_normal((batch, 3, 32, 32)).astype(np.float32)
        h, habs, terms = x.astype(np.float64), np.abs(x).astype(np.float64), 0
        for layer in spec.layers:
            L = net.layers[layer.name]
            if layer.type == "conv":
                h = ref.conv2d(h, L.weights, L.bias, layer.stride, layer.pad, layer.activation == "relu")
                habs = ref.conv2d(habs, np.abs(L.weights), np.abs(L.bias), layer.stride, layer.pad)
                terms += layer.in_shape[0] * 9
            elif layer.type == "maxpool":
                h = ref.maxpool(h, layer.kernel, layer.stride, layer.pad)
                habs = ref.maxpool(habs, layer.kernel, layer.stride, layer.pad)
            elif layer.type == "fc":
                h = ref.fc(h, L.weights, L.bias, layer.activation == "relu")
                habs = ref.fc(habs, np.abs(L.weights), np.abs(L.bias))
                terms += int(np.prod(layer.in_shape))
        logits = net.forward(x)
        assert logits.shape == (batch, 10)
        assert_dot_close(logits, h, habs, terms)


def test_weights_roundtrip_and_validation(tmp_path, isa):
    import pcldnn_runtime as pr
    net = build_and_load(tmp_path, [_conv_layer(0, 19, 3, 1, 1, False),
                                    {"name": "f", "type": "fc", "out_features": 11}], (5, 4, 4), isa)
    rng = np.random.default_rng(5)
    for name, shape in (("c0", (19, 5, 3, 3)), ("f", (11, 19 * 16))):
        layer = net.layers[name]
        assert layer.weights.shape == shape
        w = rng.standard_normal(shape).astype(np.float32)
        layer.weights = w
        np.testing.assert_array_equal(layer.weights, w)
        with pytest.raises(pr.PcldnnError, match="weights shape"):
            layer.weights = w[:1]
        with pytest.raises(pr.PcldnnError, match="bias shape"):
            layer.bias = np.zeros(3)
    with pytest.raises(pr.PcldnnError, match="input shape"):
        net.layers["c0"].forward(np.zeros((1, 4, 4, 4), np.float32))


def test_initialisation_is_seeded_as_pytorch_starts(tmp_path):
    """The default init is PyTorch's for Conv2d and Linear: weights and bias uniform in
    +-1/sqrt(fan_in), drawn from the net's seed and the layer's position."""
    import pcldnn_runtime as pr
    from pcldnn_gen.arch import get_arch
    from pcldnn_gen.build import build
    from pcldnn_gen.netspec import load_netspec
    build(load_netspec(NETS / "cifar_small.json"), get_arch("scalar"), tmp_path / "b")
    a, b, c = pr.load(tmp_path / "b", seed=0), pr.load(tmp_path / "b", seed=0), pr.load(tmp_path / "b", seed=1)
    wa, wb, wc = a.layers["conv2"].weights, b.layers["conv2"].weights, c.layers["conv2"].weights
    np.testing.assert_array_equal(wa, wb)
    assert not np.array_equal(wa, wc)
    bound = 1 / np.sqrt(288)  # fan_in = 32 * 3 * 3
    assert 0 < np.abs(a.layers["conv2"].bias).max() <= bound
    # uniform in +-bound: std bound / sqrt(3); 64*288 samples -> ~0.5% sampling error
    assert np.abs(wa).max() <= bound and abs(wa.std() / (bound / np.sqrt(3)) - 1) < 0.03
    assert abs(a.layers["fc1"].weights.std() / (1 / np.sqrt(2048) / np.sqrt(3)) - 1) < 0.03


@pytest.mark.parametrize("c,h,w", [(1, 1, 1), (3, 5, 7), (15, 4, 4), (16, 4, 4), (17, 3, 11), (35, 7, 9), (32, 8, 8)])
def test_layout_conversions_match_numpy(tmp_path, isa, c, h, w):
    """Canonical <-> blocked activations: whole channel blocks go through V x V register
    transposes, the pixels after the last whole V and a partly filled last block element by
    element; padded lanes must come out zero. Checked against numpy's pad + transpose. The
    first conv layer's input with fewer channels than V is packed, (N, H, W, C), both ways."""
    net = build_and_load(tmp_path, [{"name": "c", "type": "conv", "out_channels": c, "kernel": 1}], (c, h, w), isa)
    layer, v = net.layers["c"], net.vector_floats
    cb = -(-c // v)
    x = np.random.default_rng(c * h * w).standard_normal((3, c, h, w)).astype(np.float32)
    want = np.zeros((3, cb * v, h, w), np.float32)
    want[:, :c] = x
    want = want.reshape(3, cb, v, h, w).transpose(0, 1, 3, 4, 2)
    packed = c < v
    assert layer.input_shape(3) == ((3, 1, h, w, c) if packed else want.shape)
    xb = np.full(layer.input_shape(3), np.nan, dtype=np.float32)
    layer.input_into_blocked(x, xb)
    np.testing.assert_array_equal(xb, x.transpose(0, 2, 3, 1)[:, None] if packed else want)
    dxb = np.ascontiguousarray(xb)
    np.testing.assert_array_equal(layer._from_blocked("in", dxb, layer.in_shape, False), x)
    yb = np.ascontiguousarray(want)
    padded = (np.arange(cb * v) >= c).reshape(cb, v)[None, :, None, None, :]
    yb[np.broadcast_to(padded, yb.shape)] = np.nan  # padded lanes are never read back
    np.testing.assert_array_equal(layer.output_from_blocked(yb), x)
