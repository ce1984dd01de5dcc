"""Register tiles alone, from L1: what fraction of the FMA peak each tile shape sustains.

    python benchmarks/tile_microbench.py [--isa avx2|avx512] [--repeats 9] [--tiles 14x1,4x3,...]
    python benchmarks/tile_microbench.py --isa avx512 --latency      # fma_latency, dot_latency

Checks the planner's register-level model (pcldnn_gen/planner/tiles.py, RegisterTile) without any
cache effect: every tile runs the kernels' inner step (the shorter side of the tile held in
registers, the longer side streamed through one register, weights as aligned vector loads,
inputs as broadcasts) over operands that stay in L1, four steps unrolled per loop trip. Each
tile is timed right after the pure-FMA loop `pcldnn-gen peak` uses (12 independent chains, no
loads), and the ratio of the two is reported as the median over repeats, so that a slow moment
of a shared machine moves both sides. AVX2 (ymm, the `avx2` preset's model) or AVX-512 (zmm, the
`avx512` preset's; a vdpbf16ps tile has the same loads and broadcasts per dot product, so the
same figures judge the bf16 tiles at a dot rate equal to the FMA rate).

`--latency` measures what the model's accumulator count rests on instead: k independent chains
of FMAs (and of vdpbf16ps where the CPU has AVX512_BF16) against the best k, and the latency
that implies, k / (fma_units x rate): the preset's `fma_latency` and `dot_latency`.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from pcldnn_gen.arch import PRESETS
from pcldnn_gen.planner import RegisterTile
from pcldnn_runtime import cpu

STEPS_PER_TRIP = 4


# Every timing program's head: a clock and the comparison its medians sort with.
PRELUDE = (
    "#include <immintrin.h>", "#include <stdio.h>", "#include <stdlib.h>", "#include <time.h>",
    "static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + 1e-9 * t.tv_nsec; }",
    "static int cmp(const void *a, const void *b) "
    "{ double x = *(const double *)a, y = *(const double *)b; return (x > y) - (x < y); }",
)


def run_program(text: str, flags: list[str] | tuple[str, ...]) -> str:
    """Compile a timing program with the ISA's flags ($CC, default cc) and return what it prints."""
    with tempfile.TemporaryDirectory() as tmp:
        src, exe = Path(tmp) / "timing.c", Path(tmp) / "timing"
        src.write_text(text)
        subprocess.run([os.environ.get("CC", "cc"), "-O2", *flags, "-o", str(exe), str(src)], check=True)
        return subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout


# Per ISA: vector type, intrinsic prefix, floats per vector.
ISAS = {"avx2": ("__m256", "_mm256", 8), "avx512": ("__m512", "_mm512", 16)}


def tile_function(width: int, vectors: int, isa: str = "avx2") -> str:
    """One tile's timing loop: accumulators a<i>_<j>, the held side loaded once per step."""
    vt, pre, vf = ISAS[isa]
    acc = [[f"a{i}_{j}" for j in range(vectors)] for i in range(width)]
    lines = [f"__attribute__((noinline)) static double tile_{width}x{vectors}(long trips) {{"]
    lines += [f"    {vt} {a} = {pre}_setzero_ps();" for row in acc for a in row]
    lines.append("    double t = now();")
    lines.append("    for (long s = 0; s < trips; s++) {")
    lines.append(f"        const float *x = in + (s & 31), *w = wt + (s & 31) * {vf};")
    for step in range(STEPS_PER_TRIP):
        # weights: vector j of step at w + (step * vectors + j) * vf; inputs: x + step * 64 + i
        def wload(j: int) -> str:
            return f"{pre}_load_ps(w + {(step * vectors + j) * vf})"

        def xcast(i: int) -> str:
            return f"{pre}_broadcast_ss(x + {step * 64 + i})" if isa == "avx2" else f"{pre}_set1_ps(x[{step * 64 + i}])"

        lines.append("        {")
        if width <= vectors:   # hold the broadcasts, stream the weight vectors
            lines += [f"            {vt} b{i} = {xcast(i)};" for i in range(width)]
            for j in range(vectors):
                lines.append(f"            {{ {vt} wv = {wload(j)};")
                lines += [f"              {acc[i][j]} = {pre}_fmadd_ps(b{i}, wv, {acc[i][j]});" for i in range(width)]
                lines.append("            }")
        else:                  # hold the weight vectors, stream the broadcasts
            lines += [f"            {vt} w{j} = {wload(j)};" for j in range(vectors)]
            for i in range(width):
                lines.append(f"            {{ {vt} bx = {xcast(i)};")
                lines += [f"              {acc[i][j]} = {pre}_fmadd_ps(bx, w{j}, {acc[i][j]});" for j in range(vectors)]
                lines.append("            }")
        lines.append("        }")
    lines.append("    }")
    lines.append("    t = now() - t;")
    lines.append(f"    {vt} z = {pre}_setzero_ps();")
    lines += [f"    z = {pre}_add_ps(z, {a});" for row in acc for a in row]
    lines.append("    sink = z[0];")
    lines.append(f"    return {width * vectors * STEPS_PER_TRIP}.0 * trips / t;")
    lines.append("}")
    return "\n".join(lines)


def program(tiles: list[tuple[int, int]], repeats: int, isa: str = "avx2") -> str:
    vt, pre, vf = ISAS[isa]
    chains = 12
    peak = ["__attribute__((noinline)) static double peak(long trips) {"]
    peak += [f"    {vt} p{i} = {pre}_set1_ps({i}.0f);" for i in range(chains)]
    peak.append(f"    const {vt} m = {pre}_set1_ps(0.9999f), c = {pre}_set1_ps(1e-4f);")
    peak.append("    double t = now();")
    peak.append("    for (long s = 0; s < trips; s++) {")
    peak += [f"        p{i} = {pre}_fmadd_ps(p{i}, m, c);" for i in range(chains)]
    peak.append("    }")
    peak.append("    t = now() - t;")
    peak.append(f"    {vt} z = p0;")
    peak += [f"    z = {pre}_add_ps(z, p{i});" for i in range(1, chains)]
    peak.append(f"    sink = z[0];\n    return {chains}.0 * trips / t;\n}}")
    body = [f"    {{ double p = peak(FMAS / {chains}); r[{k}][rep] = tile_{w}x{v}(FMAS / {w * v * STEPS_PER_TRIP}) / p; }}"
            for k, (w, v) in enumerate(tiles)]
    report = [f'    qsort(r[{k}], R, sizeof(double), cmp); printf("{w}x{v} %.3f %.3f %.3f\\n", '
              f"r[{k}][R / 2], r[{k}][0], r[{k}][R - 1]);" for k, (w, v) in enumerate(tiles)]
    return "\n".join([
        *PRELUDE,
        "static float in[32 + 64 * 4] __attribute__((aligned(64)));",
        f"static float wt[32 * {vf} + {vf} * 16 * 4] __attribute__((aligned(64)));",
        "static volatile float sink;",
        "\n".join(peak), *(tile_function(w, v, isa) for w, v in tiles),
        "int main(void) {",
        f"    enum {{ R = {repeats} }}; const long FMAS = 400000000L;",
        f"    static double r[{len(tiles)}][R];",
        "    for (unsigned i = 0; i < sizeof in / sizeof *in; i++) in[i] = 1e-3f * i;",
        "    for (unsigned i = 0; i < sizeof wt / sizeof *wt; i++) wt[i] = 1e-4f;",
        "    for (int rep = 0; rep < R; rep++) {", *body, "    }", *report, "    return 0;", "}"])


LATENCY_CHAINS = (2, 4, 6, 8, 10, 12, 14, 16, 20, 24)


def latency_chains(isa: str) -> list[int]:
    """The chain counts whose accumulators and two operands fit the ISA's register file."""
    return [k for k in LATENCY_CHAINS if k + 2 <= PRESETS[isa].vector_registers]


def chains_program(repeats: int, isa: str, dot: bool, ops: int = 200_000_000) -> str:
    """k independent accumulator chains, each op reading only its own accumulator and two
    loop-invariant operands: instructions per second for each k (median of repeats), for the k
    that leave the two operands a register."""
    vt, pre, _ = ISAS[isa]
    chains = latency_chains(isa)
    funcs = []
    for k in chains:
        op = "_mm512_dpbf16_ps(a{i}, x, y)" if dot else f"{pre}_fmadd_ps(x, y, a{{i}})"
        operands = ("__m512bh x = (__m512bh)_mm512_set1_epi32(0x3a803a80), y = x;" if dot else
                    f"{vt} x = {pre}_set1_ps(0.9999f), y = {pre}_set1_ps(1e-4f);")
        funcs += [f"__attribute__((noinline)) static double chains{k}(long trips) {{",
                  *[f"    {vt} a{i} = {pre}_set1_ps({i}e-9f);" for i in range(k)], "    " + operands,
                  '    __asm__ volatile("" : "+v"(x), "+v"(y));', "    double t = now();",
                  "    for (long s = 0; s < trips; s++) {",
                  *[f"        a{i} = {op.format(i=i)};" for _ in range(2) for i in range(k)], "    }",
                  "    t = now() - t;", f"    {vt} z = a0;", *[f"    z = {pre}_add_ps(z, a{i});" for i in range(1, k)],
                  f"    sink = z[0];\n    return 2.0 * {k} * trips / t;\n}}"]
    body = [f"        r[{n}][rep] = chains{k}(OPS / {2 * k});" for n, k in enumerate(chains)]
    report = [f'    qsort(r[{n}], R, sizeof(double), cmp); printf("{k} %.6g\\n", r[{n}][R / 2]);'
              for n, k in enumerate(chains)]
    return "\n".join([
        *PRELUDE,
        "static volatile float sink;", *funcs, "int main(void) {",
        f"    enum {{ R = {repeats} }}; const long OPS = {ops}L;", f"    static double r[{len(chains)}][R];",
        "    for (int rep = 0; rep < R; rep++) {", *body, "    }", *report, "    return 0;", "}"])


def measure_latency(arch_name: str, repeats: int) -> None:
    """Print, for FMAs and (with AVX512_BF16) vdpbf16ps, each chain count's rate against the
    best and the latency it implies where the chains, not the units, bound the rate."""
    arch = PRESETS[arch_name]
    kinds = [("fma", False)] + ([("vdpbf16ps", True)] if arch.isa == "avx512" and "avx512_bf16" in cpu.cpu_flags() else [])
    for name, dot in kinds:
        out = run_program(chains_program(repeats, arch.isa, dot),
                          [*arch.cflags, *(cpu.PRECISION_CFLAGS["bf16"] if dot else ())])
        rates = {int(k): float(r) for k, r in (line.split() for line in out.splitlines())}
        best = max(rates.values())
        implied = [k / (arch.fma_units * rates[k] / best) for k in rates if rates[k] < 0.9 * best]
        print(f"{name}: chains -> rate / best: " + ", ".join(f"{k}: {r / best:.2f}" for k, r in rates.items()))
        print(f"{name}: latency ~{statistics.median(implied):.1f} cycles (k / ({arch.fma_units} units x rate)"
              f" over the {len(implied)} chain counts below 90%)" if implied else f"{name}: no chain count below 90%")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    ap.add_argument("--isa", choices=sorted(ISAS), default="avx2", help="the preset whose tiles and model to check")
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--tiles", default="", help="comma-separated WxV; default: every tile the planner may pick")
    ap.add_argument("--latency", action="store_true", help="measure the FMA's (and vdpbf16ps's) latency instead")
    args = ap.parse_args()
    try:
        cpu.require(args.isa, "tile_microbench")  # its programs run here: no SIGILL
    except cpu.ArchError as e:
        raise SystemExit(f"tile_microbench: {e}") from None
    if args.latency:
        measure_latency(args.isa, args.repeats)
        return
    arch = PRESETS[args.isa]
    if args.tiles:
        tiles = [tuple(int(n) for n in t.split("x")) for t in args.tiles.split(",")]
    else:
        tiles = [(w, v) for v in range(1, 13) for w in range(1, 31)
                 if w * v + min(w, v) + 1 <= arch.vector_registers and w * v >= 8]
    out = run_program(program(tiles, args.repeats, args.isa), arch.cflags)
    print(f"{'tile':>6} {'regs':>4} {'loads/FMA':>9} {'model':>6} {'measured (median, min-max)':>28}")
    for line in out.splitlines():
        name, med, lo, hi = line.split()
        w, v = (int(n) for n in name.split("x"))
        t = RegisterTile.evaluate(w, v, arch)
        print(f"{name:>6} {t.registers:>4} {t.loads_per_fma:>9.2f} {t.efficiency:>6.0%} "
              f"{float(med):>12.0%} ({float(lo):.0%}-{float(hi):.0%})")


if __name__ == "__main__":
    main()
