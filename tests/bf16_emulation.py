"""AVX512_BF16 spelled in AVX-512F, exactly: the vdpbf16ps kernels' tests run on AVX-512 CPUs
without it (Ice Lake, Skylake-X), as oneDNN's avx512_core bf16 emulation lets it run there.

The kernels use two bf16 instructions, each through one intrinsic (pcldnn_gen.spelling: BF16_ISA's
dot product, AVX512_BF16's conversions): vdpbf16ps and vcvtneps2bf16. `emulate` compiles every
non-AMX bf16 source with both defined as AVX-512F functions that follow the Intel SDM's pseudo-code bit for bit
(vdpbf16ps: the odd pair's product then the even pair's, each a fused multiply-add, subnormal
inputs read as zero; vcvtneps2bf16: round to nearest even, subnormals to a signed zero, a NaN
quiet), lets the runtime load such builds, and refuses any library that still holds an AVX512_BF16
or AMX instruction (it would die by SIGILL). Not emulated: vdpbf16ps flushing a subnormal result
to zero (its FTZ); the tests' operands stay far from the subnormal range. The numbers are the
kernels' own; their speed is not (`benchmarks/dot_emulation.py` is the timing tool).
"""
from __future__ import annotations

import dataclasses
import functools
import re
import subprocess
from pathlib import Path

import pytest
from cases import AMX_ARCH
from helpers import runs

from pcldnn_gen import compiler
from pcldnn_gen.arch import get_arch
from pcldnn_runtime import cpu

HEADER = r"""#include <immintrin.h>
/* tests/bf16_emulation.py: AVX512_BF16 spelled in AVX-512F (a test build: slow, exact) */
static inline __m512i pcldnn_emulated_daz(__m512i v)  /* subnormal fp32 -> signed zero */
{
    return _mm512_mask_and_epi32(v, _mm512_testn_epi32_mask(v, _mm512_set1_epi32(0x7F800000)), v,
                                 _mm512_set1_epi32((int)0x80000000u));
}
static inline __m512 pcldnn_emulated_dpbf16_ps(__m512 acc, __m512bh a, __m512bh b)
{
    const __m512i high = _mm512_set1_epi32((int)0xFFFF0000u);
    const __m512i ai = (__m512i)a, bi = (__m512i)b;
    acc = _mm512_fmadd_ps(_mm512_castsi512_ps(pcldnn_emulated_daz(_mm512_and_si512(ai, high))),
                          _mm512_castsi512_ps(pcldnn_emulated_daz(_mm512_and_si512(bi, high))), acc);
    return _mm512_fmadd_ps(_mm512_castsi512_ps(pcldnn_emulated_daz(_mm512_slli_epi32(ai, 16))),
                           _mm512_castsi512_ps(pcldnn_emulated_daz(_mm512_slli_epi32(bi, 16))), acc);
}
static inline __m256bh pcldnn_emulated_cvtneps_pbh(__m512 a)
{
    const __m512i x = _mm512_castps_si512(a);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(x, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_add_epi32(x, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
    r = _mm512_mask_or_epi32(r, _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q), x, _mm512_set1_epi32(0x00400000));
    r = _mm512_mask_and_epi32(r, _mm512_testn_epi32_mask(x, _mm512_set1_epi32(0x7F800000)), x,
                              _mm512_set1_epi32((int)0x80000000u));
    return (__m256bh)_mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16));
}
#define _mm512_dpbf16_ps pcldnn_emulated_dpbf16_ps
#define _mm512_cvtneps_pbh pcldnn_emulated_cvtneps_pbh
"""
BF16_FLAG = cpu.PRECISION_CFLAGS["bf16"][0]
# what must not be left in an emulated library: AVX512_BF16's instructions and AMX's
UNAVAILABLE = re.compile(r"\s(vdpbf16ps|vcvtne2?ps2bf16[xy]?|tdpbf16ps|tileloadd\w*|ldtilecfg)\s")

HAS_BF16 = runs("avx512_bf16")
CAN_EMULATE = not HAS_BF16 and runs("avx512")
# vdpbf16ps kernels run on AVX512_BF16, and on other AVX-512 CPUs with its two instructions
# emulated exactly in AVX-512F (the `_bf16_kernels` fixture in conftest.py); AMX kernels only
# where the CPU has tiles and Linux grants their state
bf16_kernels = pytest.mark.bf16_kernels
HAS_AMX = runs("amx")
needs_amx = pytest.mark.needs_isa("amx")  # the tiles, and Linux's grant of their state
# bf16 builds of either kind: AMX tiles, and vdpbf16ps (no AMX: an AVX512_BF16 CPU such as Zen 4/5)
BF16_BUILDS = [pytest.param(AMX_ARCH, marks=needs_amx, id="amx"),
               pytest.param(get_arch("avx512"), marks=bf16_kernels, id="vdpbf16ps")]


@functools.cache
def unavailable_instructions(library: Path) -> tuple[str, ...]:
    """The AVX512_BF16 and AMX instructions in `library`'s code (objdump)."""
    listing = subprocess.run(["objdump", "-d", "--no-show-raw-insn", str(library)], capture_output=True, text=True,
                             check=True).stdout
    return tuple(sorted(set(UNAVAILABLE.findall(listing))))


def emulate(monkeypatch: pytest.MonkeyPatch) -> None:
    """For one test: bf16 sources compiled with the emulated instructions, their builds loaded."""
    real = compiler._compile_cached

    def compile_emulated(source: compiler.Source, arch, cache: Path) -> compiler.CompileResult:
        if BF16_FLAG in source.cflags:
            source = dataclasses.replace(source, text=HEADER + source.text)
            result = real(source, arch, cache)
            left = unavailable_instructions(result.library)
            if left:
                raise RuntimeError(f"{source.filename}: {', '.join(left)} left in an emulated bf16 build "
                                   "(an AMX kernel, or an instruction tests/bf16_emulation.py does not spell)")
            return result
        return real(source, arch, cache)

    monkeypatch.setattr(compiler, "_compile_cached", compile_emulated)
    monkeypatch.setattr(cpu, "require_precision", lambda precision, what, instead=None: None)
