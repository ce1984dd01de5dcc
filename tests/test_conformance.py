"""One conformance harness for every kernel family that computes dot products
(pcldnn_runtime.families): each family's case list, every pass the family computes, through the
per-layer API, against the float64 references of reference.py, with the bound stated once.

The bound. Each output is a sum of n products (a bias first, forward); whatever the order and
the fused multiply-adds, recursive summation in fp32 stays within (n + 2) u sum |terms| of the
exact sum (Higham, Accuracy and Stability, §3.1; u = 2^-24). fp32 families: the exact sum of the
fp32 inputs. bf16 families: of the inputs rounded to bf16 (each product of two bf16 values is
exact in fp32), and somewhere off by more than that bound from the unrounded inputs' sum (the
kernel really reads bf16). n is counted with the padding a family may add (channels to whole
32-value rows, flat columns past a row's end), an upper bound: an indexing error is off by the
size of the output, far above it.

A new family adds a case list here (and its `Family` in families.py); the harness checks that
the registry really chose that family for each case's passes.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from bf16_emulation import HAS_BF16
from helpers import ISA_PARAMS, U32
from reference import conv2d, conv2d_bwd_data, conv2d_bwd_weights, fc, fc_bwd_data, fc_bwd_weights

import pcldnn_runtime as pr
from pcldnn_gen.arch import get_arch
from pcldnn_gen.build import build
from pcldnn_gen.netspec import parse_netspec
from pcldnn_runtime import cpu

HAS_AMX = HAS_BF16 and cpu.request_amx() is None
AMX_ARCH = dataclasses.replace(get_arch("avx512"), name="avx512-amx", amx=True)

# family -> (the input, the layer) of each case; the first layer of a net (index 0), so a
# convolution of fewer channels than a vector reads the packed image
CASES: dict[str, list[tuple[dict, dict]]] = {
    "conv_direct": [
        ({"channels": 5, "height": 9, "width": 11}, {"type": "conv", "out_channels": 20, "kernel": 3, "pad": 1,
                                                     "activation": "relu"}),
        ({"channels": 3, "height": 12, "width": 10}, {"type": "conv", "out_channels": 17, "kernel": [5, 3],
                                                      "stride": [2, 1], "pad": [2, 1]})],
    "fc_gemm": [({"channels": 20, "height": 3, "width": 2}, {"type": "fc", "out_features": 35, "activation": "relu"})],
    "conv_amx": [
        ({"channels": 20, "height": 9, "width": 9}, {"type": "conv", "out_channels": 24, "kernel": 3, "pad": 1,
                                                     "activation": "relu"}),
        ({"channels": 16, "height": 11, "width": 10}, {"type": "conv", "out_channels": 32, "kernel": 3, "stride": 2,
                                                       "pad": 1})],
    "conv_packed_amx": [({"channels": 3, "height": 16, "width": 15}, {"type": "conv", "out_channels": 24, "kernel": 7,
                                                                      "stride": 2, "pad": 3, "activation": "relu"})],
    "fc_tiles_amx": [({"channels": 48, "height": 1, "width": 1}, {"type": "fc", "out_features": 40})],
    "conv_vdpbf16": [
        ({"channels": 20, "height": 9, "width": 11}, {"type": "conv", "out_channels": 24, "kernel": 3, "pad": 1,
                                                      "activation": "relu"}),
        ({"channels": 32, "height": 8, "width": 8}, {"type": "conv", "out_channels": 16, "kernel": 3, "stride": 2})],
    "conv_packed_vdpbf16": [({"channels": 3, "height": 23, "width": 23}, {"type": "conv", "out_channels": 20,
                                                                          "kernel": 11, "stride": 4, "pad": 2})],
    "fc_tiles_vdpbf16": [({"channels": 48, "height": 1, "width": 1}, {"type": "fc", "out_features": 40,
                                                                      "activation": "relu"})],
}
BF16 = {"conv_amx", "conv_packed_amx", "fc_tiles_amx", "conv_vdpbf16", "conv_packed_vdpbf16", "fc_tiles_vdpbf16"}

# (family, arch id) -> how it runs: the fp32 families on every ISA this CPU runs, the vdpbf16ps
# ones on AVX512_BF16 (emulated elsewhere: the bf16_kernels marker), the AMX ones where Linux grants tiles
TARGETS = ([pytest.param(f, isa, id=f"{f}-{isa.values[0]}") for f in ("conv_direct", "fc_gemm") for isa in ISA_PARAMS]
           + [pytest.param(f, "amx", marks=pytest.mark.skipif(not HAS_AMX, reason="no AMX tiles here"), id=f)
              for f in ("conv_amx", "conv_packed_amx", "fc_tiles_amx")]
           + [pytest.param(f, "vdpbf16ps", marks=pytest.mark.bf16_kernels, id=f)
              for f in ("conv_vdpbf16", "conv_packed_vdpbf16", "fc_tiles_vdpbf16")])


def _arch(target):
    return AMX_ARCH if target == "amx" else get_arch("avx512") if target == "vdpbf16ps" else get_arch(target.values[0])


def _bf16(x: np.ndarray) -> np.ndarray:
    from test_bf16 import as_float, bf16_reference
    return as_float(bf16_reference(np.ascontiguousarray(x, np.float32)))


def _pair(v) -> tuple[int, int]:
    return (v[0], v[1]) if isinstance(v, list) else (v, v)


def _round32(n: int) -> int:
    return -(-n // 32) * 32


def _check(got: np.ndarray, exact, rounded_inputs, unrounded_inputs, n: int, bf16: bool) -> None:
    """|got - exact(rounded)| <= (n + 2) u exact(|rounded|); bf16: off from exact(unrounded) somewhere."""
    ref = exact(*rounded_inputs)
    bound = (n + 2) * U32 * exact(*(np.abs(a) for a in rounded_inputs)) + 1e-30
    err = np.abs(got.astype(np.float64) - ref)
    worst = np.unravel_index(np.argmax(err / bound), err.shape)
    assert np.all(err <= bound), f"error {err[worst]:.3g} > bound {bound[worst]:.3g} at {worst}"
    if bf16:
        assert np.any(np.abs(got - exact(*unrounded_inputs)) > bound), "the kernel did not read bf16 operands"


@pytest.mark.parametrize("family,target", TARGETS)
def test_every_family_against_float64(tmp_path, family, target):
    arch, bf16 = _arch(target), family in BF16
    for k, (source, layer) in enumerate(CASES[family]):
        spec = parse_netspec({"name": f"c{k}", "input": source, "layers": [{"name": "l", **layer}]})
        out = tmp_path / f"{family}-{k}"
        build(spec, arch, out, precision="bf16" if bf16 else "fp32")
        net = pr.load(out, threads=2)
        lay = net.layers["l"]
        assert set(lay.family.values()) >= {family}, (family, lay.family)  # the registry chose it
        rng = np.random.default_rng(k)
        lay.bias = rng.standard_normal(lay.out_shape[0]).astype(np.float32)
        x = rng.standard_normal((3, *lay.in_shape)).astype(np.float32)
        w, b = lay.weights, lay.bias
        rx, rw = (_bf16(x), _bf16(w)) if bf16 else (x, w)
        relu = layer.get("activation") == "relu"
        y = lay.forward(x)
        dy = rng.standard_normal(y.shape).astype(np.float32)
        dym = np.where(y > 0, dy, np.float32(0)) if relu else dy
        rdy = _bf16(dym) if bf16 else dym
        if layer["type"] == "conv":
            kernel, stride, pad = _pair(layer["kernel"]), _pair(layer.get("stride", 1)), _pair(layer.get("pad", 0))
            c, oc = lay.in_shape[0], lay.out_shape[0]
            oh, ow = y.shape[2:]
            fwd = (lambda xx, ww, bb: conv2d(xx, ww, bb, stride, pad, relu), (rx, rw, b), (x, w, b),
                   _round32(c * kernel[1]) * kernel[0] + _round32(c) * kernel[0] * kernel[1])
            data = (lambda d, ww: conv2d_bwd_data(d, ww, stride, pad, x.shape), (rdy, rw), (dym, w),
                    _round32(oc) * kernel[0] * kernel[1])
            weights = (lambda xx, d: conv2d_bwd_weights(xx, d, kernel, stride, pad)[0], (rx, rdy), (x, dym),
                       x.shape[0] * (oh + kernel[0]) * (ow + kernel[1] + 32))
            bias_terms = x.shape[0] * oh * ow
        else:
            fwd = (lambda xx, ww, bb: fc(xx, ww, bb, relu), (rx, rw, b), (x, w, b), _round32(int(np.prod(lay.in_shape))))
            data = (lambda d, ww: fc_bwd_data(d, ww, x.shape), (rdy, rw), (dym, w), _round32(lay.out_shape[0]))
            weights = (lambda xx, d: fc_bwd_weights(xx, d)[0], (rx, rdy), (x, dym), _round32(x.shape[0]))
            bias_terms = x.shape[0]
        if lay.family["fwd"] == family:
            _check(y, fwd[0], fwd[1], fwd[2], fwd[3], bf16)
        if lay.family["bwd_data"] == family:
            _check(lay.backward_data(dy), data[0], data[1], data[2], data[3], bf16)
        if lay.family["bwd_weights"] == family:
            dw, db = lay.backward_weights(x, dy)
            _check(dw, weights[0], weights[1], weights[2], weights[3], bf16)
            axes = (0, 2, 3) if dym.ndim == 4 else (0,)
            db_bound = (bias_terms + 2) * U32 * np.abs(dym).astype(np.float64).sum(axis=axes)
            assert np.all(np.abs(db - dym.astype(np.float64).sum(axis=axes)) <= db_bound)
