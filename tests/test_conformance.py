"""One conformance harness for every kernel family that computes dot products
(pcldnn_runtime.families): each family's case list, every pass the family computes, through the
per-layer API, against the float64 references of reference.py, with the bound stated once.

The bound. Each output is a sum of n products (a bias first, forward); whatever the order and
the fused multiply-adds, recursive summation in fp32 stays within (n + 2) u sum |terms| of the
exact sum (Higham, Accuracy and Stability, §3.1; u = 2^-24). fp32 families: the exact sum of the
fp32 inputs. bf16 families: of the inputs rounded to bf16 (each product of two bf16 values is
exact in fp32), and somewhere off by more than that bound from the unrounded inputs' sum (the
kernel really reads bf16). n is each family's own count of the terms it adds (`TERMS`: the
padding it reduces over included), so a family's bound is as tight as its kernel allows; an
indexing error is off by the size of the output, far above it.

A new family adds its case list and its term counts here (and its module in runtime/families/); the
harness checks that the registry chose that family for each case's passes.
"""
from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
from cases import (
    AMX_ARCH,
    AMX_CASES,
    AMX_PHASED_CASES,
    AMX_STRIDED_CASES,
    BF16_IMAGE_BAND_CASES,
    BF16_ROW_BAND_CASES,
    CONV_CASES,
    DEPTHWISE_CASES,
    FC_CASES,
    PACKED_AMX_DATA_CASES,
    PACKED_AMX_FORWARD_CASES,
    PACKED_AMX_GRADIENT_CASES,
    PACKED_BF16_CASES,
    PACKED_BF16_GRADIENT_CASES,
    SMALL_CACHES,
    SMALL_L2,
    SMALL_L2_AVX512,
)
from helpers import ISA_PARAMS, ISAS, U32, build_and_load
from reference import (
    as_float,
    bf16_reference,
    conv2d,
    conv2d_bwd_data,
    conv2d_bwd_weights,
    depthwise_dense,
    depthwise_diagonal,
    fc,
    fc_bwd_data,
    fc_bwd_weights,
)

import pcldnn_runtime as pr
from pcldnn_gen.arch import get_arch
from pcldnn_gen.build import build
from pcldnn_gen.netspec import parse_netspec


@dataclass(frozen=True)
class Case:
    """One layer (the first of its net, so a convolution of fewer channels than a vector reads
    the packed image), the threads and images it runs with, and the CPU it is planned for where
    not the family's own (smaller caches: the blocked paths of large layers)."""
    source: dict
    layer: dict
    threads: int = 2
    images: int = 3
    arch: Any = field(default=None, compare=False)


def _conv(cases, threads: int = 2, images: int = 3, arch: Any = None) -> list[Case]:
    return [Case(s, {"type": "conv", **l}, threads, images, arch) for s, l in _unique(cases)]


def _unique(cases: list) -> list:
    return [c for i, c in enumerate(cases) if c not in cases[:i]]


def _fc(images: int) -> list[Case]:
    return [Case({"channels": c, "height": h, "width": w},
                 {"type": "fc", "out_features": f, **({"activation": a} if a else {})}, 2, images)
            for (c, h, w), f, a in FC_CASES]


CASES: dict[str, list[Case]] = {
    "conv_direct": _conv([
        ({"channels": 5, "height": 9, "width": 11}, {"out_channels": 20, "kernel": 3, "pad": 1, "activation": "relu"}),
        ({"channels": 3, "height": 12, "width": 10}, {"out_channels": 17, "kernel": [5, 3], "stride": [2, 1],
                                                      "pad": [2, 1]})]),
    "fc_gemm": [Case({"channels": 20, "height": 3, "width": 2}, {"type": "fc", "out_features": 35,
                                                               "activation": "relu"})],
    "conv_depthwise": [Case(s, {"type": "conv", "out_channels": s["channels"], "groups": s["channels"], **l}, 2, 3)
                       for s, l in DEPTHWISE_CASES],
    # stride-1 and strided (phase planes of x, per phase of dx) convolutions; one thread and two
    # (a thread's share ends inside a band); a layer of 32 channels, one work item of 2 x 2
    # channel blocks whose taps the threads share
    "conv_amx": _conv(AMX_CASES + AMX_STRIDED_CASES + AMX_PHASED_CASES, images=2)
    + _conv(AMX_STRIDED_CASES[:2] + AMX_PHASED_CASES[-3:], threads=1, images=2)
    + _conv([({"channels": 32, "height": 9, "width": 10}, {"out_channels": 32, "kernel": 3, "stride": 1, "pad": 1})],
            threads=3),
    # 7 images: backward-weights in groups of fewer units than the minibatch has (AMX_ARCH's L2),
    # the accumulators reloaded between them
    "conv_packed_amx": _conv([(s, l) for s, l, _ in PACKED_AMX_FORWARD_CASES] + PACKED_AMX_GRADIENT_CASES
                             + PACKED_AMX_DATA_CASES, images=7),
    # several images: partial 16- and 32-image tiles (37), a minibatch under one tile (5)
    "fc_tiles_amx": _fc(37) + _fc(5),
    # and stride 2 without padding, 4 output columns from 9 (a pair copy column past the input
    # on the right); a 1x1 layer whose weights do not fit L1 with its inputs (16 channel blocks:
    # the whole reduction in registers, the weights streamed from L2); backward-weights in bands
    # of a few rows and of several images (cases.py); a single image under an 11-row padding
    # (the first band starts more rows before it than the ring holds: random_nets.py seed 733)
    "conv_vdpbf16": _conv(CONV_CASES + [
        ({"channels": 22, "height": 5, "width": 9}, {"out_channels": 20, "kernel": 3, "stride": 2, "pad": 0}),
        ({"channels": 256, "height": 3, "width": 20}, {"out_channels": 40, "kernel": 1, "activation": "relu"})])
    + _conv(BF16_ROW_BAND_CASES, arch=SMALL_CACHES)
    + [Case(s, {"type": "conv", **l}, 2, images) for s, l, images in BF16_IMAGE_BAND_CASES]
    + _conv([({"channels": 33, "height": 8, "width": 20}, {"out_channels": 16, "kernel": 11, "stride": 3, "pad": 11})],
            images=1),
    # three threads split (image, output row) items inside images; backward-weights in bands of
    # a whole image's rows, or of a few (SMALL_L2)
    "conv_packed_vdpbf16": _conv(PACKED_BF16_CASES, threads=3)
    + _conv(PACKED_BF16_GRADIENT_CASES, threads=3, images=5)
    + _conv(PACKED_BF16_GRADIENT_CASES, threads=3, images=5, arch=SMALL_L2),
    "fc_tiles_vdpbf16": _fc(37) + _fc(5),
}
BF16 = {"conv_amx", "conv_packed_amx", "fc_tiles_amx", "conv_vdpbf16", "conv_packed_vdpbf16", "fc_tiles_vdpbf16"}


def _same(a):
    return a


def _up(n: int, m: int) -> int:
    return -(-n // m) * m


def _pair(v) -> tuple[int, int]:
    return (v[0], v[1]) if isinstance(v, list) else (v, v)


@dataclass(frozen=True)
class Shapes:
    """What a term count reads: channels in and out, the window, the output plane, the minibatch,
    and the generated forward's C (whether the packed AMX forward reads kernel rows in place)."""
    c: int
    oc: int
    kernel: tuple[int, int]
    out: tuple[int, int]
    images: int
    features: int  # fc: the reduction of the forward, channels padded to a block of 16 x pixels
    fwd_c: str


# Each family's terms per output: (forward, backward-data, backward-weights)
TERMS: dict[str, tuple[Callable[[Shapes], int], Callable[[Shapes], int], Callable[[Shapes], int]]] = {
    "conv_direct": (lambda s: s.c * s.kernel[0] * s.kernel[1], lambda s: s.oc * s.kernel[0] * s.kernel[1],
                    lambda s: s.images * s.out[0] * s.out[1]),
    "fc_gemm": (lambda s: s.features, lambda s: s.oc, lambda s: s.images),
    # a channel's own window: its taps (dx: the taps reaching a pixel, at most all of them)
    "conv_depthwise": (lambda s: s.kernel[0] * s.kernel[1], lambda s: s.kernel[0] * s.kernel[1],
                       lambda s: s.images * s.out[0] * s.out[1]),
    # input channels in pairs, 8 pairs a block; pixel pairs (odd rows end on a zero partner)
    "conv_vdpbf16": (lambda s: _up(s.c, 16) * s.kernel[0] * s.kernel[1], lambda s: _up(s.oc, 16) * s.kernel[0] * s.kernel[1],
                     lambda s: s.images * s.out[0] * (s.out[1] + 1)),
    # a tile row is 16 channel pairs; flat pixels 32 at a time
    "conv_amx": (lambda s: _up(s.c, 32) * s.kernel[0] * s.kernel[1], lambda s: _up(s.oc, 32) * s.kernel[0] * s.kernel[1],
                 lambda s: s.images * s.out[0] * s.out[1]),
    # a kernel row's window values padded to 32 when read in place, else the whole window's
    "conv_packed_amx": (lambda s: s.kernel[0] * _up(s.c * s.kernel[1], 32) if "read in place" in s.fwd_c
                        else _up(s.c * s.kernel[0] * s.kernel[1], 32),
                        lambda s: _up(s.oc, 32) * s.kernel[0] * s.kernel[1],
                        lambda s: s.images * _up(s.out[0] * s.out[1], 32)),
    # a kernel row's window values in pairs; neighbouring pixels of a row in pairs
    "conv_packed_vdpbf16": (lambda s: s.kernel[0] * 2 * -(-s.kernel[1] * s.c // 2), lambda s: 0,
                            lambda s: s.images * s.out[0] * _up(s.out[1], 2)),
    # the padded reduction, to whole 32-value tile rows
    "fc_tiles_amx": (lambda s: _up(s.features, 32), lambda s: _up(s.oc, 32), lambda s: _up(s.images, 32)),
    "fc_tiles_vdpbf16": (lambda s: _up(s.features, 32), lambda s: _up(s.oc, 32), lambda s: _up(s.images, 32)),
}

# (family, target) -> how it runs: the fp32 families on every ISA this CPU runs, the vdpbf16ps
# ones on AVX512_BF16 (emulated elsewhere: the bf16_kernels marker), the AMX ones where Linux
# grants tiles
TARGETS = ([pytest.param(f, isa, marks=pytest.mark.needs_isa(isa), id=f"{f}-{isa}")
             for f in ("conv_direct", "conv_depthwise", "fc_gemm") for isa in ISAS]
           + [pytest.param(f, "amx", marks=pytest.mark.needs_isa("amx"), id=f)
              for f in ("conv_amx", "conv_packed_amx", "fc_tiles_amx")]
           + [pytest.param(f, "vdpbf16ps", marks=pytest.mark.bf16_kernels, id=f)
              for f in ("conv_vdpbf16", "conv_packed_vdpbf16", "fc_tiles_vdpbf16")])


def _arch(family: str, target):
    if target == "amx":
        return AMX_ARCH
    if target == "vdpbf16ps":
        return SMALL_L2_AVX512 if family == "fc_tiles_vdpbf16" else get_arch("avx512")
    return get_arch(target)


def _bf16(x: np.ndarray) -> np.ndarray:
    return as_float(bf16_reference(np.ascontiguousarray(x, np.float32)))


def _check(got: np.ndarray, exact, rounded_inputs, unrounded_inputs, n: int, bf16: bool, what: str) -> None:
    """|got - exact(rounded)| <= (n + 2) u exact(|rounded|); bf16: off from exact(unrounded) somewhere."""
    ref = exact(*rounded_inputs)
    bound = (n + 2) * U32 * exact(*(np.abs(a) for a in rounded_inputs)) + 1e-30
    err = np.abs(got.astype(np.float64).reshape(ref.shape) - ref)
    worst = np.unravel_index(np.argmax(err / bound), err.shape)
    assert np.all(err <= bound), f"{what}: error {err[worst]:.3g} > bound {bound[worst]:.3g} at {worst}"
    if bf16:
        assert np.any(np.abs(got.reshape(ref.shape) - exact(*unrounded_inputs)) > bound), \
            f"{what}: the kernel did not read bf16 operands"


def _run_case(tmp_path, family: str, arch, case: Case, k: int) -> None:
    """Every pass the family computes against float64, then the same bits on another thread count
    (the kernels' results do not depend on it), and the caller's dy left as it was."""
    bf16 = family in BF16
    spec = parse_netspec({"name": f"c{k}", "input": case.source, "layers": [{"name": "l", **case.layer}]})
    out = tmp_path / f"{family}-{k}"
    build(spec, case.arch or arch, out, precision="bf16" if bf16 else "fp32")
    net = pr.load(out, threads=case.threads)
    lay = net.layers["l"]
    assert family in {f.name for f in lay.family.values()}, (family, lay.family)  # the registry chose it
    rng = np.random.default_rng(k)
    lay.bias = rng.standard_normal(lay.out_shape[0]).astype(np.float32)
    x = rng.standard_normal((case.images, *lay.in_shape)).astype(np.float32)
    w, b = lay.weights, lay.bias
    rx, rw = (_bf16(x), _bf16(w)) if bf16 else (x, w)
    relu = case.layer.get("activation") == "relu"
    y = lay.forward(x)
    dy = rng.standard_normal(y.shape).astype(np.float32)
    dy_given = dy.copy()
    dym = np.where(y > 0, dy, np.float32(0)) if relu else dy
    rdy = _bf16(dym) if bf16 else dym
    c, h, wd = lay.in_shape
    kernel = _pair(case.layer.get("kernel", [h, wd]))
    shapes = Shapes(c, lay.out_shape[0], kernel, tuple(y.shape[2:]) if y.ndim == 4 else (1, 1), case.images,
                    _up(c, 16) * h * wd if family.startswith("fc_tiles") else c * h * wd,
                    (out / "src" / "l_fwd.c").read_text())
    if case.layer["type"] == "conv":
        stride, pad = _pair(case.layer.get("stride", 1)), _pair(case.layer.get("pad", 0))
        # a depthwise layer's weights as an ordinary convolution's, zero off the diagonal
        dense, part = (depthwise_dense, depthwise_diagonal) if case.layer.get("groups", 1) > 1 else (_same, _same)
        passes = {"fwd": (lambda xx, ww, bb: conv2d(xx, dense(ww), bb, stride, pad, relu), (rx, rw, b), (x, w, b)),
                  "bwd_data": (lambda d, ww: conv2d_bwd_data(d, dense(ww), stride, pad, x.shape), (rdy, rw), (dym, w)),
                  "bwd_weights": (lambda xx, d: part(conv2d_bwd_weights(xx, d, kernel, stride, pad)[0]), (rx, rdy),
                                  (x, dym))}
    else:
        passes = {"fwd": (lambda xx, ww, bb: fc(xx, ww, bb, relu), (rx, rw, b), (x, w, b)),
                  "bwd_data": (lambda d, ww: fc_bwd_data(d, ww, x.shape), (rdy, rw), (dym, w)),
                  "bwd_weights": (lambda xx, d: fc_bwd_weights(xx, d)[0], (rx, rdy), (x, dym))}
    again = {"fwd": lambda: lay.forward(x), "bwd_data": lambda: lay.backward_data(dy),
             "bwd_weights": lambda: lay.backward_weights(x, dy)[0]}
    results: dict[str, np.ndarray] = {}
    for i, p in enumerate(("fwd", "bwd_data", "bwd_weights")):
        if lay.family[p].name != family:
            continue
        if p == "fwd":
            result = y
        elif p == "bwd_data":
            result = lay.backward_data(dy)
        else:
            result, db = lay.backward_weights(x, dy)
            axes = (0, 2, 3) if dym.ndim == 4 else (0,)
            db_terms = case.images * shapes.out[0] * shapes.out[1]
            assert np.all(np.abs(db - dym.astype(np.float64).sum(axis=axes))
                          <= (db_terms + 2) * U32 * np.abs(dym).astype(np.float64).sum(axis=axes)), f"case {k} db"
        exact, rounded, unrounded = passes[p]
        _check(result, exact, rounded, unrounded, TERMS[family][i](shapes), bf16, f"case {k} {p}")
        results[p] = result
    np.testing.assert_array_equal(dy, dy_given)
    net.threads = 1 if case.threads > 1 else 3
    lay.forward(x)  # the backward passes read this forward's output (the ReLU mask)
    for p, result in results.items():
        np.testing.assert_array_equal(again[p](), result, err_msg=f"case {k} {p} on {net.threads} threads")


@pytest.mark.parametrize("family,target", TARGETS)
def test_every_family_against_float64(tmp_path, family, target):
    arch = _arch(family, target)
    for k, case in enumerate(CASES[family]):
        _run_case(tmp_path, family, arch, case, k)


def _plan_and_source(source: dict, layer: dict, arch, pass_name: str):
    """The model's plan of a one-layer net's pass for `arch` in a bf16 build, its C, and the
    layer's output shape."""
    from pcldnn_gen.build import plan_net
    from pcldnn_gen.codegen import render_kernel
    spec = parse_netspec({"name": "p", "input": source, "layers": [{"name": "l", "type": "conv", **layer}]})
    plan = plan_net(spec, arch, tuning=None, precision="bf16")[("l", pass_name)]
    return plan, render_kernel(spec.layers[0], plan, arch).text, spec.layers[0].out_shape


def _define(text: str, name: str) -> int:
    return int(re.search(rf"^#define {name} +(\d+)", text, re.M)[1])


def test_the_cases_reach_the_paths_they_are_for():
    """What the case lists are chosen to exercise, checked on their plans (no kernel runs): the
    packed AMX forward reads kernel rows in place where its B tiles fit L1 and im2col rows
    elsewhere; AMX backward-weights reduces in groups of fewer pixel blocks than the minibatch
    has; the packed vdpbf16ps backward-weights pairs bands of a few rows only with SMALL_L2; the
    vdpbf16ps one three bands or more an image with SMALL_CACHES, and bands of several whole
    images (BAND_PIXELS) on small images, more images than two bands hold; a 1x1 layer of 16
    input blocks keeps its whole reduction in registers."""
    for source, layer, in_place in PACKED_AMX_FORWARD_CASES:
        plan, text, _ = _plan_and_source(source, layer, AMX_ARCH, "fwd")
        assert plan.kind == "conv_fwd_packed_amx" and ("read in place" in text) == in_place, layer
    grouped = 0
    for case in CASES["conv_amx"] + CASES["conv_packed_amx"]:
        plan, text, _ = _plan_and_source(case.source, case.layer, AMX_ARCH, "bwd_weights")
        if plan.kind == "conv_bwd_weights_amx":
            grouped += _define(text, "GROUP") < case.images * _define(text, "NPB")
    assert grouped >= 3
    for source, layer in PACKED_BF16_GRADIENT_CASES:
        for arch in (get_arch("avx512"), SMALL_L2):
            plan, text, out = _plan_and_source(source, layer, arch, "bwd_weights")
            assert plan.kind == "conv_bwd_weights_packed_bf16"
            assert (_define(text, "BAND") < out[1]) == (arch is SMALL_L2), (layer, arch.name)
    for source, layer in BF16_ROW_BAND_CASES:
        plan, _, out = _plan_and_source(source, layer, SMALL_CACHES, "bwd_weights")
        assert plan.kind == "conv_bwd_weights_bf16" and 2 * plan.block_rows < out[1], layer
    for source, layer, images in BF16_IMAGE_BAND_CASES:
        plan, _, out = _plan_and_source(source, layer, get_arch("avx512"), "bwd_weights")
        assert plan.block_rows == out[1] and plan.band_images == -(-128 // (out[1] * out[2]))
        assert images > 2 * plan.band_images and images % plan.band_images, layer
    plan, text, _ = _plan_and_source({"channels": 256, "height": 3, "width": 20},
                                     {"out_channels": 40, "kernel": 1, "activation": "relu"}, get_arch("avx512"), "fwd")
    assert plan.kind == "conv_fwd_bf16" and _define(text, "IFB") == 16


# batchnorm: a channel's statistics over (images, rows, columns); rows of W values are summed in
# fp32 vectors and the rows in double, then each output takes a few roundings
BATCHNORM_CASES = [((20, 7, 9), 3, True), ((3, 5, 37), 4, False), ((33, 2, 3), 2, True)]


@pytest.mark.parametrize("isa", ISA_PARAMS)
def test_batchnorm_against_float64(tmp_path, isa):
    """Every batchnorm pass against float64 formulas: training forward by the batch's mean and
    biased variance, the running statistics it leaves (momentum 0.1, unbiased variance), the
    evaluation forward by them, backward-data and backward-weights (through the fused ReLU's
    mask). Bound: (W + 16) u times the magnitude of each result's terms, W the row length of the
    fp32 sums; inputs off-centre (mean 3, scale 2) so a cancellation error would show."""
    for k, (shape, images, relu) in enumerate(BATCHNORM_CASES):
        layers = [{"name": "bn", "type": "batchnorm", "eps": 1e-3, **({"activation": "relu"} if relu else {})},
                  {"name": "fc", "type": "fc", "out_features": 3}]
        net = build_and_load(tmp_path, layers, shape, isa, name=f"bn{k}")
        lay = net.layers["bn"]
        rng = np.random.default_rng(k)
        gamma, beta = rng.uniform(0.5, 1.5, shape[0]).astype(np.float32), rng.standard_normal(shape[0]).astype(np.float32)
        lay.weights, lay.bias = gamma, beta
        x = (rng.standard_normal((images, *shape)) * 2 + 3).astype(np.float32)
        dy = rng.standard_normal(x.shape).astype(np.float32)
        m = images * shape[1] * shape[2]  # values a channel
        n = shape[2] + 16
        per = lambda a: a[None, :, None, None]  # noqa: E731
        xd = x.astype(np.float64)
        mean, var = xd.mean(axis=(0, 2, 3)), xd.var(axis=(0, 2, 3))
        inv = 1 / np.sqrt(var + 1e-3)
        xhat = (xd - per(mean)) * per(inv)
        y_ref = per(gamma) * xhat + per(beta)
        y_mag = per(np.abs(gamma) * inv) * (np.abs(xd) + per(np.abs(mean))) + per(np.abs(beta))
        if relu:
            y_ref = np.maximum(y_ref, 0)
        y = lay.forward(x)
        assert np.all(np.abs(y - y_ref) <= n * U32 * y_mag), f"case {k} forward"
        dym = np.where(y > 0, dy, 0).astype(np.float64) if relu else dy.astype(np.float64)
        dbeta, dgamma = dym.sum(axis=(0, 2, 3)), (dym * xhat).sum(axis=(0, 2, 3))
        dx_ref = per(gamma * inv) * (dym - per(dbeta) / m - xhat * per(dgamma) / m)
        sums = np.abs(dym).sum(axis=(0, 2, 3)), (np.abs(dym) * np.abs(xhat)).sum(axis=(0, 2, 3))
        dx_mag = per(np.abs(gamma) * inv) * (np.abs(dym) + per(sums[0]) / m + np.abs(xhat) * per(sums[1]) / m)
        assert np.all(np.abs(lay.backward_data(dy) - dx_ref) <= n * U32 * dx_mag), f"case {k} backward-data"
        dg, db = lay.backward_weights(x, dy)
        assert np.all(np.abs(db - dbeta) <= n * U32 * sums[0]), f"case {k} dbeta"
        assert np.all(np.abs(dg - dgamma) <= n * U32 * sums[1]), f"case {k} dgamma"
        # a net's backward: backward-weights, then backward-data from the sums it just made
        xb, dyb = lay.input_blocked(x, "x"), lay.output_gradient_blocked(dy, "dy")
        yb, aux, dxb = lay.output_buffer("y", images), lay.aux_buffer(images), lay.output_buffer("dx", images)
        saved = net.state_dict()
        lay.forward_blocked(xb, yb, aux, training=True)
        grads = np.zeros_like(lay._dwt), np.zeros_like(lay._dbias)
        lay.backward_blocked(xb, yb, aux, dyb, dxb, grads=grads)
        dx_net = lay._from_blocked("in", dxb, lay.in_shape, False)
        assert np.all(np.abs(dx_net - dx_ref) <= n * U32 * dx_mag), f"case {k} backward-data after backward-weights"
        net.load_state_dict(saved)  # (that forward moved the running statistics)
        # a training forward: running = 0.9 running + 0.1 (mean, unbiased var) (the layer API's
        # forward above, a training pass as PyTorch's module call, moved them once already)
        before = net.state_dict()
        net.forward(x, training=True)
        state = net.state_dict()
        want_mean = 0.9 * before["bn.running_mean"] + 0.1 * mean
        assert np.allclose(state["bn.running_mean"], want_mean, rtol=n * U32, atol=n * U32 * np.abs(mean).max())
        assert np.allclose(state["bn.running_var"], 0.9 * before["bn.running_var"] + 0.1 * var * m / (m - 1),
                           rtol=n * U32)
        assert int(state["bn.num_batches_tracked"]) == int(before["bn.num_batches_tracked"]) + 1 == 2
        run_inv = 1 / np.sqrt(state["bn.running_var"].astype(np.float64) + 1e-3)
        e_ref = per(gamma * run_inv) * (xd - per(state["bn.running_mean"].astype(np.float64))) + per(beta)
        e_mag = per(np.abs(gamma) * run_inv) * (np.abs(xd) + per(np.abs(state["bn.running_mean"]))) + per(np.abs(beta))
        # (the layer API's forward trains: the evaluation pass through the layer's blocked call)
        xb, yb = lay.input_blocked(x, "x"), lay.output_buffer("y", images)
        lay.forward_blocked(xb, yb, None, training=False)
        e = lay.output_from_blocked(yb)
        assert np.all(np.abs(e - (np.maximum(e_ref, 0) if relu else e_ref)) <= n * U32 * e_mag), f"case {k} eval"
