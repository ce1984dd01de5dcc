"""bf16 as a precision (docs/precision.md): the rounding and the bf16 copies bit for bit on every
machine, which activations and gradients a bf16 build stores as bf16 and that doing so changes no
bit it should not, the manifest's promises and the refusals on CPUs without the instructions,
fp32 master weights, checkpoints shared with fp32 builds, and training to fp32's accuracy. The
bf16 kernels against float64 are test_conformance.py's; their other behaviour test_bf16_families.py's."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import cffi
import numpy as np
import pytest
from bf16_emulation import BF16_BUILDS, HAS_BF16, bf16_kernels, needs_amx
from cases import AMX_ARCH, CONV_CASES
from helpers import U32, build_and_load, check_relu_pool_masks
from helpers import conv_net as _conv_net
from reference import as_float, bf16_reference

import pcldnn_runtime as pr
from pcldnn_gen.arch import get_arch
from pcldnn_gen.build import build
from pcldnn_gen.codegen import template_env
from pcldnn_gen.compiler import Source, compile_source
from pcldnn_gen.netspec import parse_netspec
from pcldnn_gen.spelling import AVX512_BF16
from pcldnn_runtime import cpu
from pcldnn_runtime.abi import SIGNATURES
from pcldnn_runtime.errors import ArchError, BuildDirError
from pcldnn_runtime.families import bf16_gradients, bf16_outputs
from pcldnn_runtime.manifest import ACT16_LAYOUTS, parse_manifest

# these tests run the kernels in a process of their own, where nothing emulates AVX512_BF16
needs_real_bf16 = pytest.mark.needs_isa("avx512_bf16")


SPECIAL = np.array([0x3F808000, 0x3F818000, 0x3F80FFFF, 0x7F7FFFFF, 0x7F7F7FFF, 0x7F7F8000, 0x00000001, 0x80000001,
                    0x007FFFFF, 0x00800000, 0x7F800000, 0xFF800000, 0x7F800001, 0xFFC00000, 0x7FBFFFFF, 0x80000000,
                    0x00000000, 0xBF7FFFFF], dtype=np.uint32)


def test_the_reference_rounds_the_documented_cases():
    """Ties go to even, the largest floats overflow to inf, subnormals flush, NaN stays NaN."""
    got = bf16_reference(SPECIAL.view(np.float32))
    want = [0x3F80, 0x3F82, 0x3F81, 0x7F80, 0x7F7F, 0x7F80, 0x0000, 0x8000, 0x0000, 0x0080, 0x7F80, 0xFF80, 0x7FC0,
            0xFFC0, 0x7FFF, 0x8000, 0x0000, 0xBF80]
    assert [hex(v) for v in got] == [hex(v) for v in want]


_CONVERT = """{% import "_bf16.c.j2" as b with context %}#define V {{ V }}
{{ b.round_fn() }}
void round_all(const float *src, unsigned short *dst, long n)
{
    for (long i = 0; i < n; ++i)
        dst[i] = bf16_round(src[i]);
}
{{ b.act_to_bf16("act_to_bf16", params.act_to_bf16, c, h, w) }}
{{ b.wt_to_bf16("wt_to_bf16", params.conv_weight_tiles, rows) }}
"""
C, H, W, ROWS = 21, 3, 5, 7  # 21 channels: two blocks of 16, the second with 5 real lanes


def _conversions(flags: str):
    """The templates' conversions (V = 16) compiled with `flags`: "scalar" (no ISA flags: the
    portable C path every machine checks) or "bf16" (AVX-512 + AVX512_BF16: the vector path)."""
    text = template_env().from_string(_CONVERT).render(V=16, params=SIGNATURES, c=C, h=H, w=W, rows=ROWS, bf=AVX512_BF16)
    source = Source(f"bf16_convert_{flags}.c", text, {}, cpu.PRECISION_CFLAGS["bf16"] if flags == "bf16" else ())
    library = compile_source(source, get_arch("avx512" if flags == "bf16" else "scalar")).library
    ffi = cffi.FFI()
    ffi.cdef(f"void round_all(const float *src, unsigned short *dst, long n);"
             f"void act_to_bf16({SIGNATURES['act_to_bf16']}); void wt_to_bf16({SIGNATURES['conv_weight_tiles']});")
    return ffi, ffi.dlopen(str(library))


def _buffers(ffi, *arrays):
    return [ffi.from_buffer("float[]" if a.dtype == np.float32 else "unsigned short[]", a) for a in arrays]


@pytest.mark.parametrize("flags", ["scalar", pytest.param("bf16", marks=bf16_kernels)])
def test_rounding_matches_the_reference_bit_for_bit(flags):
    ffi, lib = _conversions(flags)
    rng = np.random.default_rng(1)
    bits = np.concatenate([SPECIAL, rng.integers(0, 2 ** 32, 200_000, dtype=np.uint64).astype(np.uint32),
                           (rng.integers(0, 2 ** 16, 20_000, dtype=np.uint32) << 16) | 0x8000])  # exact ties
    x = bits.view(np.float32)
    out = np.zeros(x.size, dtype=np.uint16)
    lib.round_all(*_buffers(ffi, x, out), x.size)
    np.testing.assert_array_equal(out, bf16_reference(x))
    # the activation conversion, whose vector path (bf16 flags) must round the same way
    blocked = x[: 2 * 2 * H * W * 16].reshape(2, 2, H, W, 16).copy()
    act = np.full(blocked.shape, 0xFFFF, dtype=np.uint16)
    lib.act_to_bf16(*_buffers(ffi, blocked, act), 2, 1)
    want = bf16_reference(blocked.ravel()).reshape(blocked.shape)
    want[:, 1, :, :, C - 16:] = 0  # lanes past the 21 real channels: zero, whatever the fp32 buffer holds
    np.testing.assert_array_equal(act, want)


@pytest.mark.parametrize("flags", ["scalar", pytest.param("bf16", marks=bf16_kernels)])
def test_weight_copy_pairs_input_channels(flags):
    """(rows, V ic, V oc) -> (rows, V/2, V oc, 2): lane oc of pair k holds ic 2k and 2k + 1."""
    ffi, lib = _conversions(flags)
    w = np.random.default_rng(2).standard_normal((ROWS, 16, 16)).astype(np.float32)
    out = np.zeros(w.size, dtype=np.uint16)
    lib.wt_to_bf16(*_buffers(ffi, w, out), 2)
    want = bf16_reference(w.ravel()).reshape(ROWS, 8, 2, 16).transpose(0, 1, 3, 2)
    np.testing.assert_array_equal(out.reshape(ROWS, 8, 16, 2), want)



_PAIRS = """{% import "_bf16.c.j2" as b with context %}#define V 16
{{ b.round_fn() }}
{{ b.interleave_fn() }}
{{ b.dy_pairs_fn() }}
void interleave(unsigned short live, const unsigned short *a, const unsigned short *b, unsigned short *dst)
{
    bf16_interleave(live, a, b, dst);
}
void dy_pairs(const unsigned short *dy, const unsigned short *y, int count, unsigned short *dst, float *sums)
{
    __m512 s0 = _mm512_loadu_ps(sums), s1 = _mm512_loadu_ps(sums + 16);
    bf16_dy_pairs(dy, y, count, dst, &s0, &s1);
    _mm512_storeu_ps(sums, s0);
    _mm512_storeu_ps(sums + 16, s1);
}
"""


_DOT = """#include <immintrin.h>
void dot(const float *acc, const unsigned short *a, const unsigned short *b, float *out, const float *wide,
         unsigned short *narrow, long n)
{
    for (long i = 0; i < n; i += 16) {
        __m512bh va = (__m512bh)_mm512_loadu_si512(a + 2 * i), vb = (__m512bh)_mm512_loadu_si512(b + 2 * i);
        _mm512_storeu_ps(out + i, _mm512_dpbf16_ps(_mm512_loadu_ps(acc + i), va, vb));
        _mm256_storeu_si256((__m256i *)(narrow + i), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(wide + i)));
    }
}
"""


@pytest.mark.needs_isa("avx512")
def test_emulated_bf16_instructions(tmp_path):
    """bf16_emulation.py's vdpbf16ps is acc + a_odd * b_odd + a_even * b_even within the two fp32
    roundings the instruction makes (bf16 products are exact in fp32; each add rounds once:
    |error| <= 2 u (|acc| + |p_odd| + |p_even|)), bf16 subnormals read as zero; its vcvtneps2bf16
    is the reference rounding bit for bit. Where AVX512_BF16 exists, the real instructions are
    held to the same, but for reading subnormals as zero, which the SDM specifies and a CPU
    might not (either reading passes there: the kernels' tests never feed subnormals), and a
    result below fp32's normal range may come out as zero (the SDM's FTZ for vdpbf16ps: Zen 5
    flushes, where the acc lanes near 2^-100 sum to an fp32 subnormal)."""
    from bf16_emulation import HEADER
    ffi = cffi.FFI()
    ffi.cdef("void dot(const float *acc, const unsigned short *a, const unsigned short *b, float *out, "
             "const float *wide, unsigned short *narrow, long n);")
    rng = np.random.default_rng(11)
    n = 4096
    # bf16 of either sign and magnitudes 2^-47 .. 2^48: no product overflows or leaves the normal
    # range (neither has a bound); in the first 64 lanes a subnormal (or zero) times 2^33 .. 2^48
    # added to about 2^-100, where reading it as anything but zero is far outside the bound
    exponent = rng.integers(0x50, 0xAF, (2, n, 2))
    exponent[0, :64], exponent[1, :64] = 0, rng.integers(0xA0, 0xAF, (64, 2))
    words = (rng.integers(0, 2, (2, n, 2)) << 15 | exponent << 7 | rng.integers(0, 0x80, (2, n, 2))).astype(np.uint16)
    a, b = words
    acc = (rng.standard_normal(n) * 2.0 ** rng.integers(-60, 60, n)).astype(np.float32)
    acc[:64] *= np.float32(2.0 ** -100)
    wide = np.concatenate([SPECIAL, rng.integers(0, 2 ** 32, n - SPECIAL.size, dtype=np.uint64).astype(np.uint32)]
                          ).view(np.float32)
    def exact_and_bound(values):
        products = values[0] * values[1]  # (n, 2): exact
        return acc.astype(np.float64) + products.sum(axis=1), 2 * U32 * (np.abs(acc) + np.abs(products).sum(axis=1))

    as_read = as_float(words).astype(np.float64)
    exact_raw, bound_raw = exact_and_bound(as_read)
    exact, bound = exact_and_bound(np.where((words & 0x7F80) == 0, 0.0, as_read))  # subnormals read as zero
    for kind in ("emulated", "real") if HAS_BF16 else ("emulated",):
        text = (HEADER if kind == "emulated" else "") + _DOT
        source = Source(f"bf16_dot_{kind}.c", text, {}, cpu.PRECISION_CFLAGS["bf16"])
        lib = ffi.dlopen(str(compile_source(source, get_arch("avx512")).library))
        out, narrow = np.zeros(n, dtype=np.float32), np.zeros(n, dtype=np.uint16)
        lib.dot(*_buffers(ffi, acc, a, b, out, wide, narrow), n)
        got = out.astype(np.float64)
        ok = np.abs(got - exact) <= bound
        if kind == "real":
            ok |= np.abs(got - exact_raw) <= bound_raw
            ok |= (got == 0) & (np.abs(exact) < np.finfo(np.float32).tiny)
        assert np.all(ok), (kind, np.flatnonzero(~ok)[:8])
        np.testing.assert_array_equal(narrow, bf16_reference(wide), err_msg=kind)


@bf16_kernels
def test_pair_copies_on_bf16_words_match_the_widened_fp32_forms():
    """The backward-weights pair copies permute bf16 words instead of widening them to fp32:
    the x pairs (dst[2v] = a[v], dst[2v + 1] = b[v], lanes outside `live` zero) and the dy pairs
    masked where the ReLU's bf16 output is not > 0 as an fp32 compare says, over every one of
    the 65536 bf16 patterns of y (NaNs, infinities, signed zeros, subnormals), with the two
    pixels' masked dy summed in fp32 for the bias."""
    text = template_env().from_string(_PAIRS).render(V=16, bf=AVX512_BF16)
    source = Source("bf16_pairs.c", text, {}, cpu.PRECISION_CFLAGS["bf16"])
    ffi = cffi.FFI()
    ffi.cdef("void interleave(unsigned short live, const unsigned short *a, const unsigned short *b, unsigned short *dst);"
             "void dy_pairs(const unsigned short *dy, const unsigned short *y, int count, unsigned short *dst, float *sums);")
    lib = ffi.dlopen(str(compile_source(source, get_arch("avx512")).library))
    rng = np.random.default_rng(5)
    u16 = "unsigned short[]"
    for live in (0xFFFF, 0x001F, 0x8001):
        a, b = (rng.integers(0, 2 ** 16, 16, dtype=np.uint16) for _ in range(2))
        out = np.full(32, 0xAAAA, dtype=np.uint16)
        lib.interleave(live, ffi.from_buffer(u16, a), ffi.from_buffer(u16, b), ffi.from_buffer(u16, out))
        on = (live >> np.arange(16)) & 1 == 1
        np.testing.assert_array_equal(out.reshape(16, 2), np.where(on[:, None], np.stack([a, b], 1), 0))
    y_all = np.arange(2 ** 16, dtype=np.uint32).astype(np.uint16).reshape(-1, 2, 16)  # (pixel, channel)
    dy_all = rng.integers(0, 2 ** 16, y_all.shape, dtype=np.uint16)
    for count in (2, 1):  # 1: the last pixel of an odd row, its partner neither read nor summed
        for masked in (True, False):
            for dy, y in zip(dy_all, y_all):
                dst = np.full(32, 0xAAAA, dtype=np.uint16)
                sums = np.zeros(32, dtype=np.float32)
                lib.dy_pairs(ffi.from_buffer(u16, dy), ffi.from_buffer(u16, y) if masked else ffi.NULL, count,
                             ffi.from_buffer(u16, dst), ffi.from_buffer("float[]", sums))
                keep = as_float(y) > 0 if masked else np.ones(y.shape, dtype=bool)
                keep[count:] = False
                want = np.where(keep, dy, 0).astype(np.uint16)
                np.testing.assert_array_equal(dst.reshape(16, 2), want.T)
                np.testing.assert_array_equal(sums.reshape(2, 16), as_float(want))
























# (input shape, features, activation): K = 288 with 40 features (3 output blocks: an odd last
# column group, FP = 64 with a zero half tile), K = 144 = 16 mod 32 (a half-zero last tile row),
# K = 64 with 70 features (4 input and 5 output blocks: every narrower last group of a
# vdpbf16ps work item of 2 or 3 blocks, after a whole one)


















def test_kernels_on_bf16_activations_take_the_models_plan_with_a_tuning_database():
    """A pooling between convolutions on tiles reads and writes bf16: with a tuning database
    present (the CLI's default, even an empty one) its plan must still say so; an fp32 kernel
    there wrote 64 bytes a pixel block into a 32-byte one (heap corruption in AlexNet-style nets)."""
    from pcldnn_gen.build import net_activations, pass_activations, plan_net
    from pcldnn_gen.tuning import TuningDB

    spec = _activation_spec(BETWEEN_NET, channels=16)
    plans = plan_net(spec, AMX_ARCH, TuningDB(Path("/nonexistent/tuning.json")), precision="bf16")
    assert plans[("m1", "fwd")].activations == net_activations(spec, AMX_ARCH, "bf16")["m1"] == (True, True)
    assert all(plan.activations == pass_activations(net_activations(spec, AMX_ARCH, "bf16")[layer], p,
                                                    spec.layer(layer).type)
               for (layer, p), plan in plans.items())




def test_amx_build_is_refused_where_tiles_are_unavailable(tmp_path, monkeypatch):
    out = _conv_net(tmp_path, *CONV_CASES[0], "bf16", name="amx", arch=AMX_ARCH)
    monkeypatch.delenv(cpu.MAX_ISA_VARIABLE, raising=False)  # the CPU is faked whole: no cap to name
    monkeypatch.setattr(cpu, "cpu_flags", lambda: frozenset({"avx512f", "avx2", "fma", "avx512_bf16"}))
    with pytest.raises(ArchError, match=r"runs AMX tile kernels but this CPU lacks amx_tile, amx_bf16; compile it "
                                        r"for an arch without AMX \(e\.g\. --arch avx512\) instead$"):
        pr.load(out)
    doc = json.loads((out / "manifest.json").read_text())
    doc["arch"]["amx"] = "yes"
    with pytest.raises(BuildDirError, match=r"arch\.amx: must be true or false"):
        parse_manifest(doc, "manifest.json")
    doc["arch"]["amx"] = False  # the kinds must then be the vdpbf16ps ones
    with pytest.raises(BuildDirError, match=r"kernels\.fwd\.symbols\.pcldnn_conv_fwd: must be 'conv_fwd_bf16', "
                                            r"got 'conv_fwd_amx'"):
        parse_manifest(doc, "manifest.json")




def test_few_channel_first_layer_kernels_by_arch(tmp_path):
    """Without AMX the packed few-channel first layer's forward is a vdpbf16ps kernel that
    converts the image itself (no bf16 copy by the layout library), its backward-weights one from
    windows of 100 values (families.BF16_PACKED_GRADIENT_WINDOW), its backward-data the fp32
    kernel; with AMX its forward and backward-data passes are on tiles, and its
    backward-weights pass from windows of 64 values (families.AMX_PACKED_GRADIENT_WINDOW); its
    output gradient stays fp32 (those backward-weights kernels read it so)."""
    source, layer = {"channels": 3, "height": 8, "width": 8}, {"out_channels": 16, "kernel": 3, "stride": 1, "pad": 1}
    out = _conv_net(tmp_path, source, layer, "bf16")
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["precision"] == "bf16"
    entry = manifest["layers"][0]
    assert entry["kernels"]["fwd"]["symbols"] == {"pcldnn_conv_fwd": "conv_fwd_packed_bf16",
                                                  "pcldnn_conv_fwd_tiles": "conv_weight_tiles"}
    assert [next(iter(entry["kernels"][p]["symbols"].values())) for p in ("bwd_data", "bwd_weights")] == \
        ["conv_bwd_data", "conv_bwd_weights"]  # 27 window values
    assert "pcldnn_conv_in_to_bf16" not in entry["kernels"]["layout"]["symbols"]
    for kernel, kind in ((5, "conv_bwd_weights"), (7, "conv_bwd_weights_packed_bf16")):  # 75 and 147 values
        out = _conv_net(tmp_path, source, dict(layer, kernel=kernel, pad=kernel // 2), "bf16", name=f"b{kernel}")
        entry = json.loads((out / "manifest.json").read_text())["layers"][0]
        assert [next(iter(entry["kernels"][p]["symbols"].values())) for p in ("bwd_data", "bwd_weights")] == \
            ["conv_bwd_data", kind]
    out = _conv_net(tmp_path, source, layer, "bf16", name="amx", arch=AMX_ARCH)
    entry = json.loads((out / "manifest.json").read_text())["layers"][0]
    assert [next(iter(entry["kernels"][p]["symbols"].values())) for p in ("fwd", "bwd_data", "bwd_weights")] == \
        ["conv_fwd_packed_amx", "conv_bwd_data_packed_amx", "conv_bwd_weights"]  # 27 window values
    out = _conv_net(tmp_path, source, dict(layer, kernel=5), "bf16", name="amx5", arch=AMX_ARCH)
    entry = json.loads((out / "manifest.json").read_text())["layers"][0]
    assert next(iter(entry["kernels"]["bwd_weights"]["symbols"].values())) == "conv_bwd_weights_packed_amx"
    spec = _activation_spec([dict(ACTIVATION_NET[0], kernel=5, pad=2)] + ACTIVATION_NET[1:]).layers
    assert bf16_outputs("bf16", True, 16, spec)[0] and not bf16_gradients("bf16", True, 16, spec)[0]






































def test_bf16_build_is_refused_on_a_cpu_without_the_instructions(tmp_path, monkeypatch):
    out = _conv_net(tmp_path, *CONV_CASES[0], "bf16")
    flags = cpu.cpu_flags() | {"avx512f", "avx2", "fma"}
    monkeypatch.setattr(cpu, "cpu_flags", lambda: flags - {"avx512_bf16"})
    monkeypatch.delenv(cpu.MAX_ISA_VARIABLE, raising=False)  # the CPU is faked whole: no cap to name
    with pytest.raises(ArchError, match=r"is a bf16 build but this CPU lacks avx512_bf16; compile it with "
                                        r"--precision fp32 instead$"):
        pr.load(out)


def test_manifest_precision_is_validated(tmp_path):
    out = _conv_net(tmp_path, *CONV_CASES[0], "bf16")
    doc = json.loads((out / "manifest.json").read_text())
    for change, message in ((lambda m: m.update(precision="fp8"), "precision: must be one of fp32, bf16"),
                            (lambda m: m.update(precision="fp32"), r"kernels\.fwd\.symbols\.pcldnn_conv_fwd_tiles: "
                                                                    "unknown field"),
                            (lambda m: m.pop("precision"), r"kernels\.fwd\.symbols")):
        bad = json.loads(json.dumps(doc))
        change(bad)
        with pytest.raises(BuildDirError, match=message):
            parse_manifest(bad, "manifest.json")
    bad = json.loads(json.dumps(doc))
    bad["arch"] |= {"isa": "avx2", "vector_bits": 256, "cflags": list(cpu.ISA_CFLAGS["avx2"])}
    with pytest.raises(BuildDirError, match="precision: bf16 kernels exist for avx512 builds, not avx2"):
        parse_manifest(bad, "manifest.json")


# bf16 activations in an AMX build: an RGB first layer (packed: its backward passes are fp32),
# a 3x3 pair, a strided layer, a standalone ReLU, a 1x1 pair, an fc
ACTIVATION_NET = [
    {"name": "c0", "type": "conv", "out_channels": 16, "kernel": 3, "pad": 1, "activation": "relu"},
    {"name": "c1", "type": "conv", "out_channels": 24, "kernel": 3, "pad": 1, "activation": "relu"},
    {"name": "c2", "type": "conv", "out_channels": 40, "kernel": 3, "stride": 2, "pad": 1, "activation": "relu"},
    {"name": "c3", "type": "conv", "out_channels": 32, "kernel": 1},
    {"name": "r4", "type": "relu"},
    {"name": "c5", "type": "conv", "out_channels": 16, "kernel": 1, "activation": "relu"},
    {"name": "c6", "type": "conv", "out_channels": 16, "kernel": 3, "pad": 1},
    {"name": "f7", "type": "fc", "out_features": 5},
    {"name": "loss", "type": "softmax_cross_entropy"},
]


def _activation_spec(layers=None, channels=3):
    return parse_netspec({"name": "acts", "input": {"channels": channels, "height": 12, "width": 11},
                          "layers": layers or ACTIVATION_NET})


def test_bf16_outputs_where_every_kernel_takes_bf16():
    """An activation is stored as bf16 where its writer (any convolution, a pooling, ReLU or
    dropout layer) and its reader (a convolution reading it in bf16 kernels, or one of those
    layers) all take bf16: after the packed first layer too, not into an fc layer; with AMX
    tiles or vdpbf16ps alike; nowhere in fp32."""
    layers = _activation_spec().layers
    pooled = _activation_spec([{"name": "p0", "type": "maxpool", "kernel": 2}] + ACTIVATION_NET[1:]).layers
    for amx in (True, False):
        assert bf16_outputs("bf16", amx, 16, layers) == (True,) * 6 + (False,) * 3
        assert bf16_outputs("bf16", amx, 16, pooled) == (True,) * 6 + (False,) * 3
    assert not any(bf16_outputs("fp32", True, 16, layers)) and not any(bf16_outputs("fp32", False, 16, layers))
    # the few-channel first layer's input is packed: no later layer reads that layout
    few_first = _activation_spec([ACTIVATION_NET[0], {"name": "f", "type": "fc", "out_features": 3}]).layers
    assert bf16_outputs("bf16", True, 16, few_first) == (False, False)


def test_bf16_gradients_where_every_kernel_takes_bf16():
    """An activation's gradient is stored as bf16 where the activation is, its writer (the next
    layer's backward-data: a bf16 convolution kernel, or a pooling, ReLU or dropout layer) and
    its readers (this layer's backward passes: a convolution's bf16 backward-data and
    backward-weights, or one of those layers) all take bf16. Not into the packed first layer
    (its backward-weights reads fp32), not from a few-channel convolution's fp32 backward-data
    (vdpbf16ps builds), nowhere in fp32."""
    layers = _activation_spec().layers
    for amx in (True, False):
        assert bf16_gradients("bf16", amx, 16, layers) == (False,) + (True,) * 5 + (False,) * 3
    assert not any(bf16_gradients("fp32", True, 16, layers)) and not any(bf16_gradients("fp32", False, 16, layers))
    few = _activation_spec([{"name": "c0", "type": "conv", "out_channels": 16, "kernel": 1},
                            {"name": "c1", "type": "conv", "out_channels": 5, "kernel": 1},
                            {"name": "c2", "type": "conv", "out_channels": 16, "kernel": 1},
                            {"name": "c3", "type": "conv", "out_channels": 16, "kernel": 1},
                            {"name": "f", "type": "fc", "out_features": 3}], channels=16).layers
    # c2 reads 5 channels: without AMX its backward-data is the fp32 few-channel kernel, which
    # neither writes c1's output gradient nor lets c2 read its own as bf16
    assert bf16_gradients("bf16", False, 16, few) == (True, False, False, False, False)
    assert bf16_gradients("bf16", True, 16, few) == (True, True, True, False, False)


def test_manifest_must_agree_on_bf16_activations(tmp_path):
    """A build says which activations its kernels read and write as bf16; a manifest that
    disagrees with the runtime's rule (another generator version, an edit) is refused."""
    build(_activation_spec(), AMX_ARCH, tmp_path / "acts", precision="bf16")
    doc = json.loads((tmp_path / "acts" / "manifest.json").read_text())
    assert [layer.get("output", "fp32") for layer in doc["layers"]] == ["bf16"] * 6 + ["fp32"] * 3
    parse_manifest(doc, "manifest.json")
    assert [layer.get("gradient", "fp32") for layer in doc["layers"]] == ["fp32"] + ["bf16"] * 5 + ["fp32"] * 3
    for key, index, value, message in (
            ("output", 1, None, "layers\\[1\\].output: is fp32 but this runtime stores that activation as bf16"),
            ("output", 6, "bf16", "layers\\[6\\].output: is bf16 but this runtime stores that activation as fp32"),
            ("output", 2, "fp16", "layers\\[2\\].output: must be one of fp32, bf16"),
            ("gradient", 3, None, "layers\\[3\\].gradient: is fp32 but this runtime stores that activation's gradient "
                                  "as bf16"),
            ("gradient", 0, "bf16", "layers\\[0\\].gradient: is bf16 but this runtime stores that activation's "
                                    "gradient as fp32")):
        bad = json.loads(json.dumps(doc))
        if value is None:
            del bad["layers"][index][key]
        else:
            bad["layers"][index][key] = value
        with pytest.raises(BuildDirError, match=message):
            parse_manifest(bad, "manifest.json")
    # the per-layer API's one-pass bf16 conversions exist for the bf16 sides of a layer only
    # (layer 0: output; 1-5: both; 6: input; 7-8: neither), and the reader checks them against the edges
    sides = [{r.split("_")[0] for r in ACT16_LAYOUTS if f"pcldnn_{layer['name']}_{r}" in layer["kernels"]["layout"]["symbols"]}
             for layer in doc["layers"]]
    assert sides == [{"out"}] + [{"in", "out"}] * 5 + [{"in"}, set(), set()]
    for index, symbol in ((6, "in_from_blocked16"), (0, "out_to_blocked16")):
        bad = json.loads(json.dumps(doc))
        del bad["layers"][index]["kernels"]["layout"]["symbols"][f"pcldnn_{doc['layers'][index]['name']}_{symbol}"]
        with pytest.raises(BuildDirError, match=f"layers\\[{index}\\].kernels.layout.symbols.pcldnn_\\w+_{symbol}: missing"):
            parse_manifest(bad, "manifest.json")
    bad = json.loads(json.dumps(doc))
    bad["layers"][7]["kernels"]["layout"]["symbols"][f"pcldnn_{doc['layers'][7]['name']}_in_to_blocked16"] = \
        "act_layout_to_bf16"
    with pytest.raises(BuildDirError, match=r"layers\[7\].kernels.layout.symbols"):
        parse_manifest(bad, "manifest.json")


def _bf16_storage_builds(tmp_path, spec, arch=AMX_ARCH, modes=("fp32", "bf16")):
    """The same bf16 build for `arch` made once per mode, the rules switched off in generator and
    runtime as the mode says: "fp32", every activation and gradient fp32; "activations", the
    activations as families.bf16_outputs says and every gradient fp32; "bf16", both rules on."""
    import pcldnn_gen.build as generator
    import pcldnn_runtime.families as families
    import pcldnn_runtime.net as runtime_net
    nets = {}
    for mode in modes:
        with pytest.MonkeyPatch.context() as rules:
            for module in (generator, families, runtime_net):
                for rule in {"fp32": ("bf16_outputs", "bf16_gradients"), "activations": ("bf16_gradients",)}.get(mode, ()):
                    rules.setattr(module, rule, lambda precision, amx, v, layers: (False,) * len(layers))
            build(spec, arch, tmp_path / mode, precision="bf16")
            nets[mode] = pr.load(tmp_path / mode, threads=2, seed=4)
    return nets


@pytest.mark.parametrize("arch", BF16_BUILDS)
@pytest.mark.parametrize("first", [None, {"name": "c0", "type": "conv", "out_channels": 16, "kernel": 5, "pad": 2,
                                           "activation": "relu"},
                                   {"name": "p0", "type": "maxpool", "kernel": 2}],
                         ids=["conv", "conv5x5", "pool"])  # 5x5: the packed AMX backward-weights kernel (75 values)
def test_bf16_activations_between_convolutions_change_no_bit(tmp_path, monkeypatch, first, arch):
    """Between convolutions (directly or through a ReLU) a bf16 activation moves no value: its
    writer rounds what the reader's kernels would have rounded, and rounding keeps the sign (the
    ReLU masks); so does a max pooling of the fp32 input written as bf16 (its maxima are found
    in fp32). So the net gives the loss and gradients, bit for bit, of the same build with every
    activation fp32, while those buffers are half the size; and the layer API of a layer reading
    and writing bf16 matches too (its output rounded)."""
    layers = ACTIVATION_NET if first is None else [first] + ACTIVATION_NET[1:]
    nets = _bf16_storage_builds(tmp_path, _activation_spec(layers), arch, ("fp32", "activations"))
    nets["bf16"] = nets.pop("activations")  # activations bf16, gradients fp32 (the next test's subject)
    rng = np.random.default_rng(3)
    x = rng.standard_normal((5, 3, 12, 11)).astype(np.float32)
    labels = rng.integers(0, 5, 5)
    losses = {mode: net.loss_and_grad(x, labels) for mode, net in nets.items()}
    assert losses["fp32"] == losses["bf16"]
    np.testing.assert_array_equal(nets["fp32"].grads, nets["bf16"].grads)
    dtypes = [a.dtype for a in nets["bf16"].workspace(5).acts]
    # the input, then c0 / p0 .. c6 (fp32 kernels among them: the packed first layer's, and with a
    # pool first the 3-channel c1's backward-data in a vdpbf16ps build), f7, loss
    assert dtypes == [np.float32] + [np.uint16] * 6 + [np.float32] * 2
    assert all(a.dtype == np.float32 for a in nets["fp32"].workspace(5).acts)
    assert np.any(nets["bf16"].grads != 0)
    # writing bf16, and reading it but for the first layer (its fp32 kernels: packed RGB input)
    for name in (["c0"] if first is None or first["name"] == "c0" else []) + ["c1", "c2", "c5"]:
        assert (nets["bf16"].layers[name].in_bf16, nets["bf16"].layers[name].out_bf16) == (name != "c0", True)
        conv = {mode: net.layers[name] for mode, net in nets.items()}
        xin = rng.standard_normal((2, *conv["bf16"].in_shape)).astype(np.float32)
        y = {mode: layer.forward(xin) for mode, layer in conv.items()}
        np.testing.assert_array_equal(y["bf16"], as_float(bf16_reference(y["fp32"])))
        dy = rng.standard_normal(y["fp32"].shape).astype(np.float32)
        np.testing.assert_array_equal(conv["bf16"].backward_data(dy), conv["fp32"].backward_data(dy))
        for got, want in zip(conv["bf16"].backward_weights(xin, dy), conv["fp32"].backward_weights(xin, dy)):
            np.testing.assert_array_equal(got, want)


# 1x1 convolutions on bf16 sources read in place by the AMX kernels (reads_source_in_place), on
# 5x71 images (355 pixels: a last pixel block past the plane): c1 forward (16 channels; its
# backward-data masks dy by its ReLU: copied), c2 forward (48) and backward-data (dy: 32), c5
# backward-data into 40 channels (its forward's 40-channel source: copied), c7 forward and
# backward-data into one result block, c8 forward at stride 2 (3x36
# results: rows of two units, the second 4 results and 28 dropped rows, a last unit whose rows
# run past the plane)
IN_PLACE_NET = [
    {"name": "r0", "type": "relu"},
    {"name": "c1", "type": "conv", "out_channels": 48, "kernel": 1, "activation": "relu"},
    {"name": "c2", "type": "conv", "out_channels": 32, "kernel": 1},
    {"name": "r3", "type": "relu"},
    {"name": "c4", "type": "conv", "out_channels": 40, "kernel": 3, "pad": 1, "activation": "relu"},
    {"name": "c5", "type": "conv", "out_channels": 16, "kernel": 1},
    {"name": "r6", "type": "relu"},
    {"name": "c7", "type": "conv", "out_channels": 16, "kernel": 1},
    {"name": "c8", "type": "conv", "out_channels": 32, "kernel": 1, "stride": 2},
    {"name": "f9", "type": "fc", "out_features": 5},
    {"name": "loss", "type": "softmax_cross_entropy"},
]


@needs_amx
def test_amx_1x1_layers_read_bf16_sources_in_place(tmp_path, monkeypatch):
    """A tdpbf16ps of 16 channels (a 16-channel block read in place) then the next adds the
    same products in the same order as one of 32 from the copy: against the same build with
    every activation and gradient fp32 (every kernel copying), the net's loss is the same, each
    layer's output its output rounded, and its backward-data on bf16 dy its result rounded
    where dx is bf16, bit for bit."""
    spec = parse_netspec({"name": "inplace", "input": {"channels": 16, "height": 5, "width": 71},
                          "layers": IN_PLACE_NET})
    nets = _bf16_storage_builds(tmp_path, spec, AMX_ARCH, ("fp32", "bf16"))
    in_place = {(name, p) for name in ("c1", "c2", "c4", "c5", "c7", "c8") for p in ("fwd", "bwd_data")
                if "read in place" in (tmp_path / "bf16" / "src" / f"{name}_{p}.c").read_text()}
    assert in_place == {("c1", "fwd"), ("c2", "fwd"), ("c2", "bwd_data"), ("c5", "bwd_data"), ("c7", "fwd"),
                        ("c7", "bwd_data"), ("c8", "fwd")}
    assert not any("read in place" in f.read_text() for f in (tmp_path / "fp32" / "src").glob("*.c"))
    rng = np.random.default_rng(5)
    x = rng.standard_normal((6, 16, 5, 71)).astype(np.float32)
    labels = rng.integers(0, 5, 6)
    assert nets["fp32"].loss_and_grad(x, labels) == nets["bf16"].loss_and_grad(x, labels)
    for name in ("c1", "c2", "c5", "c7", "c8"):
        conv = {mode: n.layers[name] for mode, n in nets.items()}
        xin = rng.standard_normal((3, *conv["bf16"].in_shape)).astype(np.float32)
        y = {mode: layer.forward(xin) for mode, layer in conv.items()}
        np.testing.assert_array_equal(y["bf16"], as_float(bf16_reference(y["fp32"])) if conv["bf16"].out_bf16
                                      else y["fp32"])
        dy = as_float(bf16_reference(rng.standard_normal(y["bf16"].shape).astype(np.float32)))
        dx = conv["fp32"].backward_data(dy)
        assert np.any(dx != 0)
        np.testing.assert_array_equal(conv["bf16"].backward_data(dy),
                                      as_float(bf16_reference(dx)) if conv["bf16"].in_grad_bf16 else dx)


@pytest.mark.parametrize("arch", BF16_BUILDS)
def test_bf16_gradients_round_once_where_written(tmp_path, monkeypatch, arch):
    """An activation gradient stored as bf16 (families.bf16_gradients) is its fp32 value rounded
    once, where written: each convolution's backward-data fed bf16 values of dy gives exactly
    the rounded dx of the same kernel writing fp32 (which rounds those dy values to the same
    bf16 itself), and its backward-weights the same dw and bias gradient, bit for bit. In the
    net the gradients of the weights then move by the roundings of the activation gradients
    only: the loss is the same, and each layer's weight gradient is within D 2^-8 of the fp32
    one in norm, D the bf16 gradients on its path from the loss (each rounding perturbs a
    gradient by at most 2^-8 relative; the backward layers are linear in it)."""
    # c3 1x1 with stride 2: dx pixels no tap reaches (the AMX backward-data zeroes those phases)
    layers = ACTIVATION_NET[:3] + [{**ACTIVATION_NET[3], "stride": 2}] + ACTIVATION_NET[4:]
    nets = _bf16_storage_builds(tmp_path, _activation_spec(layers), arch, ("activations", "bf16"))
    net, ref = nets["bf16"], nets["activations"]
    flags = [(layer.in_grad_bf16, layer.out_grad_bf16) for layer in net.chain]
    assert flags == [(False, False), (False, True)] + [(True, True)] * 4 + [(True, False), (False, False)]
    assert not any(layer.in_grad_bf16 or layer.out_grad_bf16 for layer in ref.chain)
    rng = np.random.default_rng(6)
    x = rng.standard_normal((5, 3, 12, 11)).astype(np.float32)
    labels = rng.integers(0, 5, 5)
    assert net.loss_and_grad(x, labels) == ref.loss_and_grad(x, labels)
    assert np.any(net.grads != ref.grads) and np.all(np.isfinite(net.grads))
    for depth, name in enumerate(["c6", "c5", "c3", "c2", "c1", "c0"]):
        got, want = (np.concatenate([n.layers[name].grad_weights.ravel(), n.layers[name].grad_bias]) for n in (net, ref))
        assert np.linalg.norm(got - want) <= depth * 2.0 ** -8 * np.linalg.norm(want), name
    for name in ("c1", "c2", "c3", "c5", "c6"):
        conv = {mode: n.layers[name] for mode, n in nets.items()}
        xin = rng.standard_normal((2, *conv["bf16"].in_shape)).astype(np.float32)
        y = {mode: layer.forward(xin) for mode, layer in conv.items()}
        dy = as_float(bf16_reference(rng.standard_normal(y["bf16"].shape).astype(np.float32)))
        dx = conv["activations"].backward_data(dy)
        np.testing.assert_array_equal(conv["bf16"].backward_data(dy),
                                      as_float(bf16_reference(dx)) if conv["bf16"].in_grad_bf16 else dx)
        for got, want in zip(conv["bf16"].backward_weights(xin, dy), conv["activations"].backward_weights(xin, dy)):
            np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("arch", BF16_BUILDS)
def test_max_pooling_applies_the_relu_mask_in_bf16_builds(tmp_path, monkeypatch, arch):
    """As in fp32 builds (test_backward_net.py), with the poolings' outputs (the masks) and the
    gradients bf16, and the convolutions' AMX or vdpbf16ps kernels skipping their mask."""
    check_relu_pool_masks(tmp_path, monkeypatch, arch, "bf16")


# pooling, ReLU and dropout between convolutions on tiles: each reads and writes bf16
BETWEEN_NET = [
    {"name": "c0", "type": "conv", "out_channels": 20, "kernel": 3, "pad": 1},
    {"name": "m1", "type": "maxpool", "kernel": 2, "stride": 1},
    {"name": "c2", "type": "conv", "out_channels": 16, "kernel": 3, "pad": 1},
    {"name": "a3", "type": "avgpool", "kernel": 3, "stride": 2, "pad": 1},
    {"name": "c4", "type": "conv", "out_channels": 16, "kernel": 1},
    {"name": "r5", "type": "relu"},
    {"name": "d6", "type": "dropout", "rate": 0.25},
    {"name": "c7", "type": "conv", "out_channels": 16, "kernel": 1},
    {"name": "f8", "type": "fc", "out_features": 3},
    {"name": "loss", "type": "softmax_cross_entropy"},
]


@pytest.mark.parametrize("arch", BF16_BUILDS)
def test_pooling_relu_dropout_on_bf16_activations(tmp_path, monkeypatch, arch):
    """Each layer's kernels on bf16 activations against the same layer with fp32 ones fed the
    bf16 values: max pooling and ReLU give the same values (the max and the positive part of
    bf16 values are bf16 values) and route dy to the same inputs (the first of tied maxima);
    average pooling and dropout compute in fp32 on the bf16 input, then round once to nearest
    even. In a net, the forward pass (max, ReLU: exact) and training run on bf16 buffers."""
    spec = _activation_spec(BETWEEN_NET, channels=16)
    assert bf16_outputs("bf16", arch.amx, 16, spec.layers) == (True,) * 7 + (False,) * 3
    nets = _bf16_storage_builds(tmp_path, spec, arch)
    rng = np.random.default_rng(5)
    for name in ("m1", "a3", "r5", "d6"):
        got, ref = nets["bf16"].layers[name], nets["fp32"].layers[name]
        assert (got.in_bf16, got.out_bf16, got.in_grad_bf16, got.out_grad_bf16) == (True,) * 4
        x = as_float(bf16_reference(rng.standard_normal((3, *got.in_shape)).astype(np.float32)))
        x[0, 0, 0, :2] = x[0, 0, 0, 2]  # ties
        for net in nets.values():
            net.dropout_draws = 7  # the same mask on both sides
        y = got.forward(x)
        np.testing.assert_array_equal(y, as_float(bf16_reference(ref.forward(x))))
        # dy and dx bf16: dy's values (bf16) summed or scaled in fp32, rounded once
        dy = as_float(bf16_reference(rng.standard_normal(y.shape).astype(np.float32)))
        np.testing.assert_array_equal(got.backward_data(dy), as_float(bf16_reference(ref.backward_data(dy))))
    x = rng.standard_normal((4, 16, 12, 11)).astype(np.float32)
    labels = rng.integers(0, 3, 4)
    net = nets["bf16"]
    assert [a.dtype for a in net.workspace(4).acts] == [np.float32] + [np.uint16] * 7 + [np.float32] * 2
    loss = net.loss_and_grad(x, labels)
    assert np.isfinite(loss) and np.all(np.isfinite(net.grads)) and np.any(net.grads != 0)
    logits = net.forward(x)  # evaluation: dropout is the identity between bf16 buffers
    reference = nets["fp32"].forward(x)
    assert np.max(np.abs(logits - reference)) <= 0.02 * np.max(np.abs(reference))


NORM_NET = [
    {"name": "c0", "type": "conv", "out_channels": 20, "kernel": 3, "pad": 1},
    {"name": "n1", "type": "batchnorm", "activation": "relu"},
    {"name": "c2", "type": "conv", "out_channels": 16, "kernel": 1},
    {"name": "n3", "type": "batchnorm", "activation": "relu6"},
    {"name": "c4", "type": "conv", "out_channels": 16, "kernel": 3, "pad": 1},
    {"name": "n5", "type": "batchnorm"},
    {"name": "c6", "type": "conv", "out_channels": 16, "kernel": 1},
    {"name": "f7", "type": "fc", "out_features": 3},
    {"name": "loss", "type": "softmax_cross_entropy"},
]


@pytest.mark.parametrize("arch", BF16_BUILDS)
def test_batchnorm_on_bf16_activations_and_gradients(tmp_path, arch):
    """Batchnorms between bf16 convolutions read and write bf16 (x, y, dy, dx), computing in fp32
    as on fp32 buffers: fed the same bf16 values, each pass gives the fp32 kernel's result
    rounded once to nearest even (training forward with the ReLU, the ReLU6 or none; backward-
    data through the fused activation's mask, in place; the scale and shift gradients exactly;
    the mask is the stored output's, so a ReLU6 output rounded up to 6 passes no gradient),
    and the net trains on bf16 buffers within bf16's rounding of the fp32-storage build."""
    spec = _activation_spec(NORM_NET, channels=16)
    assert bf16_outputs("bf16", arch.amx, 16, spec.layers) == (True,) * 6 + (False,) * 3
    nets = _bf16_storage_builds(tmp_path, spec, arch)
    rng = np.random.default_rng(8)
    for name in ("n1", "n3", "n5"):
        got, ref = nets["bf16"].layers[name], nets["fp32"].layers[name]
        assert (got.in_bf16, got.out_bf16, got.in_grad_bf16, got.out_grad_bf16) == (True,) * 4
        for layer in (got, ref):
            layer.weights = np.linspace(0.5, 4.0, got.out_shape[0], dtype=np.float32)  # (past 6: ReLU6)
            layer.bias = np.linspace(-0.3, 0.3, got.out_shape[0], dtype=np.float32)
        x = as_float(bf16_reference((rng.standard_normal((3, *got.in_shape)) * 2 + 1).astype(np.float32)))
        y = got.forward(x)
        want = ref.forward(x)
        np.testing.assert_array_equal(y, as_float(bf16_reference(want)))
        assert name == "n5" or np.any(want == 0)  # the masks have work to do
        dy = as_float(bf16_reference(rng.standard_normal(y.shape).astype(np.float32)))
        # the ReLU6's mask reads the output as stored: an fp32 value just below 6 rounded to 6.0
        # passes no gradient (the next layer did read 6.0)
        rounded_to_6 = (y == 6) & (want < 6) & (name == "n3")
        assert name != "n3" or np.any(rounded_to_6)
        dy_ref = np.where(rounded_to_6, 0, dy).astype(np.float32)
        np.testing.assert_array_equal(got.backward_data(dy), as_float(bf16_reference(ref.backward_data(dy_ref))))
        for g, w in zip(got.backward_weights(x, dy), ref.backward_weights(x, dy_ref)):
            np.testing.assert_array_equal(g, w)
    x = rng.standard_normal((4, 16, 12, 11)).astype(np.float32)
    labels = rng.integers(0, 3, 4)
    net = nets["bf16"]
    assert [a.dtype for a in net.workspace(4).acts] == [np.float32] + [np.uint16] * 6 + [np.float32] * 2
    losses = [net.loss_and_grad(x, labels), nets["fp32"].loss_and_grad(x, labels)]
    assert np.all(np.isfinite(net.grads)) and abs(losses[0] - losses[1]) <= 0.01 * abs(losses[1])
    logits, reference = net.forward(x), nets["fp32"].forward(x)
    assert np.max(np.abs(logits - reference)) <= 0.02 * np.max(np.abs(reference))


@pytest.mark.parametrize("arch", BF16_BUILDS)
def test_the_layer_api_converts_bf16_activations_in_one_pass(tmp_path, arch):
    """A layer with bf16 activations (m1: 20 channels, a block partly filled, of 12x11 pixels,
    past the last whole vector): its input and output gradient go into blocked bf16 and its
    output and input gradient come back in one pass of the layout library each (layout with
    vcvtneps2bf16's rounding, or with the widening), bit for bit a numpy blocking and
    bf16_bits' rounding, on ties, subnormals, the largest finite values, infinities and NaN."""
    from pcldnn_runtime.kernels import bf16_bits, bf16_values
    net = _bf16_storage_builds(tmp_path, _activation_spec(BETWEEN_NET, channels=16), arch, modes=("bf16",))["bf16"]
    layer = net.layers["m1"]
    assert (layer.in_bf16, layer.out_bf16, layer.in_grad_bf16, layer.out_grad_bf16) == (True,) * 4
    rng = np.random.default_rng(11)
    x = rng.standard_normal((3, *layer.in_shape)).astype(np.float32)
    special = np.array([1 + 2 ** -8, 1 + 3 * 2 ** -8, -(1 + 2 ** -8), 1e-40, -1e-39, 3.4e38, np.inf, -np.inf, np.nan,
                        0.0, -0.0], np.float32)
    x.reshape(-1)[rng.choice(x.size, (8, special.size), replace=False)] = special
    c, v = layer.in_shape[0], 16
    blocks = -(-c // v)

    def blocked(a):
        out = np.zeros((a.shape[0], blocks * v, *a.shape[2:]), np.float32)
        out[:, :c] = a
        return np.ascontiguousarray(out.reshape(a.shape[0], blocks, v, *a.shape[2:]).transpose(0, 1, 3, 4, 2))

    def unblocked(b):
        return b.transpose(0, 1, 4, 2, 3).reshape(b.shape[0], blocks * v, *b.shape[2:4])[:, :c]

    want = np.empty(blocked(x).shape, np.uint16)
    bf16_bits(blocked(x), want, flush_subnormals=True)
    got = layer.input_blocked(x, "t.x")
    assert got.dtype == np.uint16
    np.testing.assert_array_equal(got, want)
    y = x[:, :, :layer.out_shape[1], :layer.out_shape[2]].copy()
    want_dy = np.empty(blocked(y).shape, np.uint16)
    bf16_bits(blocked(y), want_dy, flush_subnormals=True)
    np.testing.assert_array_equal(layer.output_gradient_blocked(y, "t.dy"), want_dy)
    np.testing.assert_array_equal(layer.output_from_blocked(want_dy), unblocked(bf16_values(want_dy)))


@pytest.mark.parametrize("arch", ["avx2", "scalar"])
def test_compile_refuses_bf16_without_avx512(tmp_path, arch):
    net = tmp_path / "n.json"
    net.write_text(json.dumps({"name": "n", "input": {"channels": 16, "height": 4, "width": 4},
                               "layers": [{"name": "c", "type": "conv", "out_channels": 16, "kernel": 3, "pad": 1}]}))
    proc = subprocess.run([sys.executable, "-m", "pcldnn_gen.cli", "compile", str(net), "--arch", arch,
                           "--precision", "bf16", "-o", str(tmp_path / "out")], capture_output=True, text=True)
    assert proc.returncode == 2 and not (tmp_path / "out").exists()
    assert proc.stderr.strip().count("\n") == 0
    assert f"--precision bf16 needs an AVX-512 arch (bf16 kernels use AVX512_BF16), got {arch} ({arch})" in proc.stderr


# A net whose second convolution runs bf16 (the first reads the packed 3-channel image: fp32).
TRAIN_NET = [
    {"name": "conv1", "type": "conv", "out_channels": 16, "kernel": 3, "pad": 1, "activation": "relu"},
    {"name": "conv2", "type": "conv", "out_channels": 20, "kernel": 3, "pad": 1, "activation": "relu"},
    {"name": "pool", "type": "maxpool", "kernel": 2, "stride": 2},
    {"name": "fc", "type": "fc", "out_features": 5},
    {"name": "loss", "type": "softmax_cross_entropy"},
]


@bf16_kernels
def test_bf16_build_trains_like_fp32_and_shares_checkpoints(tmp_path):
    """Same start, same data: the bf16 build's losses follow the fp32 build's (bf16 rounding of
    conv2's inputs: well under 1% of the first loss at any step), both fall, and a bf16 build's
    checkpoint resumes in an fp32 build with the same fp32 weights and momentum."""
    spec = parse_netspec({"name": "mix", "input": {"channels": 3, "height": 8, "width": 8}, "layers": TRAIN_NET})
    nets = {}
    for precision in ("fp32", "bf16"):
        build(spec, get_arch("avx512"), tmp_path / precision, precision=precision)
        nets[precision] = pr.load(tmp_path / precision, threads=2, seed=4)
    rng = np.random.default_rng(5)
    x = rng.standard_normal((32, 3, 8, 8)).astype(np.float32)
    labels = (x[:, 0, :4].mean(axis=(1, 2)) > 0).astype(np.int32) + 2 * (x[:, 1, 4:].mean(axis=(1, 2)) > 0)
    losses = {}
    for precision, net in nets.items():
        trainer = pr.Trainer(net, optimizer=pr.SGD(lr=0.05, momentum=0.9))
        losses[precision] = [trainer.step(x, labels) for _ in range(30)]
        trainer.save(tmp_path / f"{precision}.ckpt")
    fp32, bf16 = np.array(losses["fp32"]), np.array(losses["bf16"])
    assert bf16[-1] < 0.5 * bf16[0] and fp32[-1] < 0.5 * fp32[0]
    assert np.max(np.abs(bf16 - fp32)) < 0.01 * fp32[0]
    assert not np.array_equal(bf16, fp32)  # the bf16 kernel did run
    resumed = pr.Trainer.resume(tmp_path / "bf16.ckpt", nets["fp32"])
    assert resumed.step_count == 30
    for name in ("conv1", "conv2", "fc"):
        np.testing.assert_array_equal(nets["fp32"].layers[name].weights, nets["bf16"].layers[name].weights)


def test_builds_without_precision_say_fp32(tmp_path):
    net = build_and_load(tmp_path, TRAIN_NET, (3, 8, 8), cpu.best_isa())
    assert net.precision == "fp32"
    assert json.loads((net.build_dir / "manifest.json").read_text())["precision"] == "fp32"












@bf16_kernels
def test_digits_demo_in_bf16_matches_its_fp32_accuracy(tmp_path, monkeypatch, capsys):
    """The issue's bar: the digits demo net trained in bf16 (its conv2 runs bf16 kernels) ends
    within 0.5 points of the fp32 build's test accuracy, with the same defaults and seed."""
    import importlib.util

    from helpers import REPO
    spec = importlib.util.spec_from_file_location("train_script", REPO / "examples" / "train.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    monkeypatch.chdir(tmp_path)
    accuracy = {}
    for precision in ("fp32", "bf16"):
        assert script.main(["--precision", precision, "--no-progress", "--threads", "2"]) == 0
        last = capsys.readouterr().out.strip().splitlines()[-1]
        accuracy[precision] = float(last.split("test accuracy ")[1].split()[0])
    assert accuracy["fp32"] > 0.95
    assert abs(accuracy["bf16"] - accuracy["fp32"]) <= 0.005


@bf16_kernels
def test_small_gradients_need_no_loss_scaling(tmp_path):
    """bf16 keeps fp32's exponent range: an output gradient scaled by 2^-100 (far below fp16's
    smallest value, 6e-8, where fp16 training needs loss scaling) gives exactly the scaled
    gradients, bit for bit, in both backward passes (power-of-two scaling is exact in bf16 and
    fp32 while nothing reaches the subnormal range)."""
    net = pr.load(_conv_net(tmp_path, *CONV_CASES[1], "bf16"), threads=2)
    conv = net.layers["conv"]
    rng = np.random.default_rng(8)
    x = rng.standard_normal((2, *conv.in_shape)).astype(np.float32)
    dy = rng.standard_normal((2, *conv.out_shape)).astype(np.float32)
    scale = np.float32(2.0 ** -100)
    conv.forward(x)
    dx, dx_small = conv.backward_data(dy), conv.backward_data(dy * scale)
    (dw, db), (dw_small, db_small) = conv.backward_weights(x, dy), conv.backward_weights(x, dy * scale)
    assert np.all(dx_small[dx != 0] != 0) and np.all(dw_small[dw != 0] != 0)
    np.testing.assert_array_equal(dx_small, dx * scale)
    np.testing.assert_array_equal(dw_small, dw * scale)
    np.testing.assert_array_equal(db_small, db * scale)


def test_inspect_shows_the_bf16_kernel(capsys):
    """Any machine: the C of a bf16 build's kernel, with its header saying what the operands are."""
    from helpers import NETS

    from pcldnn_gen.cli import main
    assert main(["inspect", str(NETS / "vgg_a.json"), "--layer", "conv3", "--pass", "bwd_data", "--arch", "avx512",
                 "--precision", "bf16"]) == 0
    text = capsys.readouterr().out
    assert "precision: bf16 operands, a pair of output channels per 32-bit lane" in text
    assert "_mm512_dpbf16_ps(" in text and "_mm512_fmadd_ps(" not in text


@needs_real_bf16
def test_verbose_lines_of_a_bf16_build(tmp_path):
    """PCLDNN_VERBOSE names the ISA of the bf16 kernels and copies (avx512_bf16) and leaves out weight copies."""
    out = _conv_net(tmp_path, *CONV_CASES[0], "bf16")
    script = (f"import numpy as np, pcldnn_runtime as pr; net = pr.load({str(out)!r}, threads=1); "
              "net.layers['conv'].forward(np.ones((2, 20, 9, 11), np.float32))")
    proc = subprocess.run([sys.executable, "-c", script], env={**os.environ, "PCLDNN_VERBOSE": "1"},
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = [line.split(",") for line in proc.stderr.splitlines() if line.startswith("pcldnn_verbose,0,exec,")]
    assert [(fields[3], fields[4], fields[5]) for fields in lines] == [
        ("conv", "in_to_blocked", "avx512"), ("conv", "in_to_bf16", "avx512_bf16"), ("conv", "fwd", "avx512_bf16"),
        ("conv", "out_from_blocked", "avx512")]


SMOOTH_NORM_NET = [
    {"name": "c0", "type": "conv", "out_channels": 20, "kernel": 3, "pad": 1},
    {"name": "n1", "type": "batchnorm", "activation": "silu"},
    {"name": "c2", "type": "conv", "out_channels": 16, "kernel": 1},
    {"name": "n3", "type": "batchnorm", "activation": "gelu"},
    {"name": "c4", "type": "conv", "out_channels": 16, "kernel": 1},
    {"name": "f5", "type": "fc", "out_features": 3},
    {"name": "loss", "type": "softmax_cross_entropy"},
]


@pytest.mark.parametrize("arch", BF16_BUILDS)
def test_batchnorm_with_silu_or_gelu_on_bf16_activations_and_gradients(tmp_path, arch):
    """A fused SiLU or GELU on bf16 buffers: the forward is the fp32 kernel's result rounded once
    (the activation computed in fp32 from the widened input); the backward scales the bf16 dy in
    place by the derivative recomputed from x, gamma and beta, so dy * f'(z) is rounded to bf16
    once before dx and the scale and shift gradients are made from it: within that rounding
    (2^-8 of the largest value) of the fp32-storage build's, which scales an fp32 dy."""
    spec = _activation_spec(SMOOTH_NORM_NET, channels=16)
    assert bf16_outputs("bf16", arch.amx, 16, spec.layers)[:4] == (True,) * 4
    nets = _bf16_storage_builds(tmp_path, spec, arch)
    rng = np.random.default_rng(9)
    for name in ("n1", "n3"):
        got, ref = nets["bf16"].layers[name], nets["fp32"].layers[name]
        assert (got.in_bf16, got.out_bf16, got.in_grad_bf16, got.out_grad_bf16) == (True,) * 4
        for layer in (got, ref):
            layer.weights = np.linspace(0.5, 4.0, got.out_shape[0], dtype=np.float32)
            layer.bias = np.linspace(-0.5, 0.5, got.out_shape[0], dtype=np.float32)
        x = as_float(bf16_reference((rng.standard_normal((3, *got.in_shape)) * 2 + 1).astype(np.float32)))
        y, want = got.forward(x), ref.forward(x)
        np.testing.assert_array_equal(y, as_float(bf16_reference(want)))
        assert np.any(want < 0)  # the negative lobe: neither activation is a mask here
        dy = as_float(bf16_reference(rng.standard_normal(y.shape).astype(np.float32)))
        dx, dx_ref = got.backward_data(dy), ref.backward_data(dy)
        np.testing.assert_allclose(dx, dx_ref, rtol=0, atol=2 ** -8 * np.abs(dx_ref).max(), err_msg=name)
        for g, w in zip(got.backward_weights(x, dy), ref.backward_weights(x, dy)):
            np.testing.assert_allclose(g, w, rtol=0, atol=2 ** -8 * np.abs(w).max(), err_msg=name)
    x = rng.standard_normal((4, 16, 12, 11)).astype(np.float32)
    labels = rng.integers(0, 3, 4)
    losses = [nets["bf16"].loss_and_grad(x, labels), nets["fp32"].loss_and_grad(x, labels)]
    assert np.all(np.isfinite(nets["bf16"].grads)) and abs(losses[0] - losses[1]) <= 0.01 * abs(losses[1])
