"""vdpbf16ps kernels at the FMA rate: judging them on a CPU whose vdpbf16ps is slower.

On the Xeon VM vdpbf16ps issues at half the fp32 FMA rate, so every vdpbf16ps kernel there, ours
and oneDNN's alike, is bound by that rate and its loads, ramps and memory traffic cannot be
judged. Zen 4 runs a 512-bit vdpbf16ps at its FMA rate next to one 512-bit load per cycle: the
ratios of a Xeon's two FMAs and two loads per cycle (and of their L2 bandwidth per FMA). So
`compile` makes a bf16 build whose every vdpbf16ps is a vfmadd231ps on the same registers (the
numbers are garbage; the instructions, registers and memory traffic are the kernel's), and `ab`
times two builds as `benchmarks/ab.py` does with denormals flushed to zero (a bf16 pair read as
fp32 is denormal where its high half is zero, and the assists would dominate). Such a build's
efficiency is its nominal FLOPs over twice the fp32 FMA peak. The conv and fc kernels alike (every
vdpbf16ps the templates spell through `codegen.BF16_ISA`); AMX kernels are left as they are.

    python benchmarks/dot_emulation.py compile examples/nets/vgg_a.json --arch zen4 -o /tmp/b
    python benchmarks/dot_emulation.py ab /tmp/a /tmp/b --batch 16 --threads 1 --passes bwd_weights
    python benchmarks/dot_emulation.py bench --zoo benchmarks/zoo/zoo.json --arch zen4 --threads 1
    python benchmarks/dot_emulation.py tune --zoo benchmarks/zoo/zoo.json --arch zen5 --threads 1

(`compile`, `bench` and `tune` take `pcldnn-gen compile`'s, `bench`'s and `tune`'s arguments
and add `--precision bf16`; bench's %peak is then against the fp32 peak, so 200% is the
emulated peak. `ab` takes ab.py's. `tune` writes its emulated measurements to
`emulated-tuning.json` in the working directory unless PCLDNN_TUNING_DB names a file: they are
estimates, kept out of the database a real bf16 compile on this machine would read.)

On an AVX-512 CPU without AVX512_BF16 (Ice Lake, Skylake-X: two FMAs and two 512-bit loads per
cycle, the same ratios) `compile` and `bench` also spell the kernels' other bf16 instruction,
vcvtneps2bf16, as a shift and a narrowing move (vpsrld + vpmovdw: truncation, 3 uops where
vcvtneps2bf16 is 2 on Sapphire Rapids; the copies that convert cost a little more than on a bf16
CPU), and `ab` and `bench` then load such builds, checking first that no bf16 instruction is
left in them. Checked against Zen 4: VGG-A conv3-6 backward-weights ran at 70-83% of the bf16 peak
there (RESULTS.md, bf16) and at 72-85% of the emulated peak here with the same plans.
"""
from __future__ import annotations

import ctypes
import dataclasses
import os
import sys
from pathlib import Path

FMA_FOR_DOT = "_mm512_fmadd_ps((__m512)({a}), (__m512)({b}), {c})"
CONVERSION = "_mm512_cvtneps_pbh("
# Before a kernel's own text (immintrin.h's include guard keeps its later includes from
# declaring the intrinsic again under the macro).
CONVERSION_WITHOUT_BF16 = """#include <immintrin.h>
/* dot_emulation.py on a CPU without AVX512_BF16: vcvtneps2bf16 as a truncating shift + narrow */
#define _mm512_cvtneps_pbh(a) ((__m256bh)_mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(a), 16)))
"""
DAZ_FTZ = """#include <immintrin.h>
void pcldnn_flush_denormals(void) { _mm_setcsr(_mm_getcsr() | 0x8040); }
"""


def cpu_has_bf16() -> bool:
    from pcldnn_runtime import cpu
    return "avx512_bf16" in cpu.cpu_flags()


def emulated(command: str, argv: list[str]) -> int:
    """`pcldnn-gen command argv --precision bf16` with the dot products spelled as FMAs (and,
    on a CPU without AVX512_BF16, the conversions as AVX-512F)."""
    from pcldnn_gen import cli, codegen, compiler
    codegen.BF16_ISA = dataclasses.replace(codegen.BF16_ISA, _fma=FMA_FOR_DOT)
    if not cpu_has_bf16():
        def source(filename: str, text: str, symbols: dict[str, str], cflags: tuple[str, ...] = ()) -> compiler.Source:
            return compiler.Source(filename, CONVERSION_WITHOUT_BF16 + text if CONVERSION in text else text, symbols, cflags)
        codegen.Source = source  # type: ignore[assignment,misc]
        if command in ("bench", "tune"):  # they load the builds they have just made
            load_without_bf16()
    return cli.main([command, *argv, "--precision", "bf16"])


def load_without_bf16(*builds: Path) -> None:
    """Let this process load bf16 builds on a CPU without AVX512_BF16, once each of `builds` is
    known to hold no bf16 instruction (a build `bench` makes in this process is one)."""
    for build in builds:
        for c_file in sorted((build / "src").glob("*.c")):
            text = c_file.read_text()
            if "_mm512_dpbf16_ps(" in text or (CONVERSION in text and not text.startswith(CONVERSION_WITHOUT_BF16)):
                raise SystemExit(f"{c_file}: bf16 instructions this CPU lacks; compile the build with "
                                 f"dot_emulation.py compile on this CPU")
    from pcldnn_runtime import cpu
    cpu.require_precision = lambda precision, what, instead=None: None


def flush_denormals() -> None:
    """DAZ and FTZ in this thread before any OpenMP region: the runtime's worker threads,
    created at the first one, inherit the MXCSR."""
    from pcldnn_gen.arch import get_arch
    from pcldnn_gen.compiler import Source, compile_source
    lib = compile_source(Source("flush_denormals.c", DAZ_FTZ, {"pcldnn_flush_denormals": "helper"}), get_arch("avx2"))
    ctypes.CDLL(str(lib.library)).pcldnn_flush_denormals()


def main() -> int:
    if sys.argv[1:2] in (["-h"], ["--help"]):
        print(__doc__)
        return 0
    if len(sys.argv) < 2 or sys.argv[1] not in ("compile", "ab", "bench", "tune"):
        raise SystemExit(__doc__)
    command, rest = sys.argv[1], sys.argv[2:]
    if command == "compile":
        return emulated(command, rest)
    flush_denormals()
    if command == "tune":
        os.environ.setdefault("PCLDNN_TUNING_DB", str(Path("emulated-tuning.json").resolve()))
    if command in ("bench", "tune"):
        return emulated(command, rest)
    sys.path.insert(0, str(Path(__file__).parent))
    import ab
    if not cpu_has_bf16():
        load_without_bf16(*(Path(arg) for arg in rest[:2]))
    sys.argv = ["ab.py", *rest]
    ab.main()
    return 0


if __name__ == "__main__":
    sys.exit(main())
