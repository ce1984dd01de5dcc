"""benchmarks/kernel_profile.py's own logic: callgrind parsing and loop finding (the simulators
themselves, valgrind and llvm-mca, are not needed here)."""
from __future__ import annotations

import subprocess
import sys

from helpers import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
import kernel_profile as kp

CALLGRIND = """version: 1
creator: callgrind-3.19.0
positions: instr
events: Ir Dr Dw D1mr
fl=???
fn=kernel
0x1000 3 1
0x1004 5 2 0 1
cfl=???
cfn=helper
calls=2 0x2000
0x1008 40 10 10 4
0x1008 1
fn=helper
0x2000 20 5 5 2
0x1000 2 1 0 0
"""


def test_parse_callgrind_keeps_self_costs_and_pads_missing_events():
    events, costs = kp.parse_callgrind(CALLGRIND)
    assert events == ["Ir", "Dr", "Dw", "D1mr"]
    # the call line's inclusive cost (40 ...) is the callee's, not the caller's
    assert costs["kernel"] == {0x1000: [3, 1, 0, 0], 0x1004: [5, 2, 0, 1], 0x1008: [1, 0, 0, 0]}
    assert costs["helper"] == {0x2000: [20, 5, 5, 2], 0x1000: [2, 1, 0, 0]}


def test_innermost_loops_of_a_compiled_nest(tmp_path):
    """A two-level nest whose inner loop holds the only FMA: exactly one innermost loop, the one
    with the FMA, and the outer loop's back edge is not reported."""
    src = tmp_path / "nest.c"
    src.write_text("""
#include <immintrin.h>
void nest(float *restrict out, const float *restrict a, const float *restrict b, int n, int m) {
    for (int i = 0; i < n; ++i) {
        __m256 acc = _mm256_loadu_ps(out + 8 * i);
        for (int j = 0; j < m; ++j) {
            acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + 8 * j), _mm256_broadcast_ss(b + i * m + j), acc);
            __asm__ volatile("" ::: "memory");
        }
        _mm256_storeu_ps(out + 8 * i, acc);
    }
}
""")
    lib = tmp_path / "nest.so"
    subprocess.run(["gcc", "-O2", "-mavx2", "-mfma", "-fPIC", "-shared", "-o", str(lib), str(src)], check=True)
    instrs, functions = kp.disassemble(lib, "nest")
    assert "nest" in functions and all(i.offset >= functions["nest"] for i in instrs.values())
    loops = kp.innermost_loops(instrs)
    assert len(loops) == 1
    first, branch = loops[0]
    body = [instrs[o] for o in sorted(instrs) if first <= o <= branch]
    assert sum(i.mnemonic.startswith("vfmadd") for i in body) == 1
    assert kp.JUMP.match(body[-1].mnemonic)


def test_markdown_table_figures():
    """One kernel: 1000 FMA instructions of 16 FLOPs against 20000 ideal FLOPs is 0.80 of the
    ideal count; 50 L1 misses are 50 per 1000 FMAs and 64 * 50 / 20000 = 0.160 B/FLOP."""
    k = {"layer": "c1", "pass_name": "fwd", "batch": 1, "flops": 20000.0, "fma_flops": 16, "fma_instructions": 1000,
         "instructions": 2000, "loads": 800, "stores": 10, "l1_misses": 50, "l2_misses": 5, "loop_cycles": 540.0,
         "other_instructions": 240, "core_bound": 0.83, "measured": None, "hot_loops": []}
    row = kp.markdown({"issue": 4.0, "kernels": [k]}).splitlines()[2]
    assert row == "| c1 | fwd | 1 | 0.80 | 2.00 | 50.0 | 0.160 | 0.016 | 10% | 83% | - |"
