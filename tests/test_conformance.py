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

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import pytest
from bf16_emulation import HAS_BF16
from cases import AMX_ARCH, AMX_CASES, AMX_PHASED_CASES, AMX_STRIDED_CASES, CONV_CASES, FC_CASES, SMALL_L2_AVX512
from helpers import ISA_PARAMS, U32
from reference import (
    as_float,
    bf16_reference,
    conv2d,
    conv2d_bwd_data,
    conv2d_bwd_weights,
    fc,
    fc_bwd_data,
    fc_bwd_weights,
)

import pcldnn_runtime as pr
from pcldnn_gen.arch import get_arch
from pcldnn_gen.build import build
from pcldnn_gen.netspec import parse_netspec
from pcldnn_runtime import cpu

HAS_AMX = HAS_BF16 and cpu.request_amx() is None


@dataclass(frozen=True)
class Case:
    """One layer (the first of its net, so a convolution of fewer channels than a vector reads
    the packed image), the threads and images it runs with."""
    source: dict
    layer: dict
    threads: int = 2
    images: int = 3
    id: str = field(default="", compare=False)


def _conv(cases, threads: int = 2, images: int = 3) -> list[Case]:
    return [Case(s, {"type": "conv", **l}, threads, images) for s, l in cases]


def _fc(images: int) -> list[Case]:
    return [Case({"channels": c, "height": h, "width": w},
                 {"type": "fc", "out_features": f, **({"activation": a} if a else {})}, 2, images)
            for (c, h, w), f, a in FC_CASES]


_AMX_CONV = AMX_CASES + [c for c in AMX_STRIDED_CASES + AMX_PHASED_CASES if c not in AMX_CASES]
CASES: dict[str, list[Case]] = {
    "conv_direct": _conv([
        ({"channels": 5, "height": 9, "width": 11}, {"out_channels": 20, "kernel": 3, "pad": 1, "activation": "relu"}),
        ({"channels": 3, "height": 12, "width": 10}, {"out_channels": 17, "kernel": [5, 3], "stride": [2, 1],
                                                      "pad": [2, 1]})]),
    "fc_gemm": [Case({"channels": 20, "height": 3, "width": 2}, {"type": "fc", "out_features": 35,
                                                               "activation": "relu"})],
    # stride-1 and strided (phase planes of x, per phase of dx) convolutions; one thread and two
    # (a thread's share ends inside a band)
    "conv_amx": _conv(_AMX_CONV, images=2) + _conv(AMX_STRIDED_CASES[:2] + AMX_PHASED_CASES[-3:], threads=1,
                                                    images=2),
    "conv_packed_amx": _conv([({"channels": 3, "height": 16, "width": 15},
                               {"out_channels": 24, "kernel": 7, "stride": 2, "pad": 3, "activation": "relu"})]),
    # several images: partial 16- and 32-image tiles (37), a minibatch under one tile (5)
    "fc_tiles_amx": _fc(37) + _fc(5),
    "conv_vdpbf16": _conv(CONV_CASES),
    "conv_packed_vdpbf16": _conv([({"channels": 3, "height": 23, "width": 23},
                                   {"out_channels": 20, "kernel": 11, "stride": 4, "pad": 2})]),
    "fc_tiles_vdpbf16": _fc(37) + _fc(5),
}
BF16 = {"conv_amx", "conv_packed_amx", "fc_tiles_amx", "conv_vdpbf16", "conv_packed_vdpbf16", "fc_tiles_vdpbf16"}


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
TARGETS = ([pytest.param(f, isa, id=f"{f}-{isa.values[0]}") for f in ("conv_direct", "fc_gemm") for isa in ISA_PARAMS]
           + [pytest.param(f, "amx", marks=pytest.mark.skipif(not HAS_AMX, reason="no AMX tiles here"), id=f)
              for f in ("conv_amx", "conv_packed_amx", "fc_tiles_amx")]
           + [pytest.param(f, "vdpbf16ps", marks=pytest.mark.bf16_kernels, id=f)
              for f in ("conv_vdpbf16", "conv_packed_vdpbf16", "fc_tiles_vdpbf16")])


def _arch(family: str, target):
    if target == "amx":
        return AMX_ARCH
    if target == "vdpbf16ps":
        return SMALL_L2_AVX512 if family == "fc_tiles_vdpbf16" else get_arch("avx512")
    return get_arch(target.values[0])


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
    bf16 = family in BF16
    spec = parse_netspec({"name": f"c{k}", "input": case.source, "layers": [{"name": "l", **case.layer}]})
    out = tmp_path / f"{family}-{k}"
    build(spec, arch, out, precision="bf16" if bf16 else "fp32")
    lay = pr.load(out, threads=case.threads).layers["l"]
    assert family in {f.name for f in lay.family.values()}, (family, lay.family)  # the registry chose it
    rng = np.random.default_rng(k)
    lay.bias = rng.standard_normal(lay.out_shape[0]).astype(np.float32)
    x = rng.standard_normal((case.images, *lay.in_shape)).astype(np.float32)
    w, b = lay.weights, lay.bias
    rx, rw = (_bf16(x), _bf16(w)) if bf16 else (x, w)
    relu = case.layer.get("activation") == "relu"
    y = lay.forward(x)
    dy = rng.standard_normal(y.shape).astype(np.float32)
    dym = np.where(y > 0, dy, np.float32(0)) if relu else dy
    rdy = _bf16(dym) if bf16 else dym
    c, h, wd = lay.in_shape
    kernel = _pair(case.layer.get("kernel", [h, wd]))
    shapes = Shapes(c, lay.out_shape[0], kernel, tuple(y.shape[2:]) if y.ndim == 4 else (1, 1), case.images,
                    _up(c, 16) * h * wd if family.startswith("fc_tiles") else c * h * wd,
                    (out / "src" / "l_fwd.c").read_text())
    if case.layer["type"] == "conv":
        stride, pad = _pair(case.layer.get("stride", 1)), _pair(case.layer.get("pad", 0))
        passes = {"fwd": (lambda xx, ww, bb: conv2d(xx, ww, bb, stride, pad, relu), (rx, rw, b), (x, w, b)),
                  "bwd_data": (lambda d, ww: conv2d_bwd_data(d, ww, stride, pad, x.shape), (rdy, rw), (dym, w)),
                  "bwd_weights": (lambda xx, d: conv2d_bwd_weights(xx, d, kernel, stride, pad)[0], (rx, rdy), (x, dym))}
    else:
        passes = {"fwd": (lambda xx, ww, bb: fc(xx, ww, bb, relu), (rx, rw, b), (x, w, b)),
                  "bwd_data": (lambda d, ww: fc_bwd_data(d, ww, x.shape), (rdy, rw), (dym, w)),
                  "bwd_weights": (lambda xx, d: fc_bwd_weights(xx, d)[0], (rx, rdy), (x, dym))}
    got = {"fwd": lambda: y, "bwd_data": lambda: lay.backward_data(dy), "bwd_weights": lambda: lay.backward_weights(x, dy)}
    for i, p in enumerate(("fwd", "bwd_data", "bwd_weights")):
        if lay.family[p].name != family:
            continue
        result = got[p]()
        if p == "bwd_weights":
            result, db = result
            axes = (0, 2, 3) if dym.ndim == 4 else (0,)
            db_terms = case.images * shapes.out[0] * shapes.out[1]
            assert np.all(np.abs(db - dym.astype(np.float64).sum(axis=axes))
                          <= (db_terms + 2) * U32 * np.abs(dym).astype(np.float64).sum(axis=axes)), f"case {k} db"
        exact, rounded, unrounded = passes[p]
        _check(result, exact, rounded, unrounded, TERMS[family][i](shapes), bf16, f"case {k} {p}")


@pytest.mark.parametrize("family,target", TARGETS)
def test_every_family_against_float64(tmp_path, family, target):
    arch = _arch(family, target)
    for k, case in enumerate(CASES[family]):
        _run_case(tmp_path, family, arch, case, k)
