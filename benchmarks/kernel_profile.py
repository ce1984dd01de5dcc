"""Instruction and simulated-cache profile of each kernel, for machines without hardware counters.

    python benchmarks/kernel_profile.py examples/nets/vgg_a.json --layers conv5,fc7 \
        [--passes fwd,bwd_data,bwd_weights] [--batch 1] [--fc-batch 64] [--mcpu sapphirerapids]
        [--json out.json]

This project's VM exposes no PMU (`perf stat` counts nothing), so the question "is a kernel
bound by its instructions or by the memory hierarchy?" is answered with two simulators:

- **callgrind** (valgrind) runs one call of the kernel on one thread under a simulated L1d and L2
  of the arch's sizes and counts, per instruction address: executions, loads, stores, L1 and L2
  misses. Executed FMA instructions are counted exactly (padding waste shows up here).
- **llvm-mca** predicts the cycles per iteration of every innermost loop of the compiled kernel
  on a CPU model, from its ports and latencies, with every load hitting L1.

Predicted core cycles = sum over innermost loops (iterations x llvm-mca cycles) + the other
executed instructions at `--issue` per cycle. `core-bound %` = FMA instructions / (FMA units x
those cycles): the efficiency the kernel would reach if no load ever missed L1. The measured
efficiency (native run of the same call, median of `--repeats`, against the FMA peak measured
right before; nominal FLOPs as `bench` counts them, so a kernel that skips padding taps, FMA/ideal
under 1, can pass 100%: compare measured x FMA/ideal with core-bound) below it is time lost in
the memory hierarchy or to the machine's other tenants;
the simulated misses say how much traffic each level carried. The simulated caches are
inclusive LRU, with no prefetcher: misses are traffic, not stalls.

Needs `valgrind` and `llvm-mca` on PATH; one kernel call under callgrind runs ~100x slower than
natively, so conv layers are profiled at a small batch (the per-image loop nest is the same at
any batch) and fc layers at their training batch (the GEMM shape depends on it).
"""
from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from pcldnn_gen.arch import get_arch, native_arch
from pcldnn_gen.bench import measure_peak
from pcldnn_gen.build import build
from pcldnn_gen.netspec import load_netspec
from pcldnn_runtime import cpu
from pcldnn_runtime.errors import ArchError
from pcldnn_runtime.layers import WeightedLayer
from pcldnn_runtime.limits import blocks
from pcldnn_runtime.manifest import PASSES, LayerEntry, read_manifest

KIND_CODE = {"fwd": 0, "bwd_data": 1, "bwd_weights": 2}

# Kernel calls from a shared library, buffers filled with values in [-1, 1): argv = library,
# symbol, pass (0 fwd, 1 bwd_data, 2 bwd_weights), fc (0/1), batch, OC blocks, then the float
# counts of in, weights, bias, out and scratch, then the number of calls. With more than one
# call it prints the median seconds of the calls after the first (the warm-up).
HARNESS = r"""
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
static int by_value(const void *a, const void *b)
{
    const double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}
typedef void (*fwd_t)(const float *, const float *, const float *, float *, int, int, ...);
/* a convolution's forward also takes a statistics fusion's mean and var (NULL: none) */
typedef void (*conv_fwd_t)(const float *, const float *, const float *, float *, float *, float *, int, int);
typedef void (*bwd_data_t)(float *, const float *, const float *, float *, float *, int, int, ...);
typedef void (*bwd_w_t)(const float *, float *, const float *, float *, float *, int, int, ...);
static float *buffer(long n)
{
    float *p = aligned_alloc(64, ((size_t)(n > 0 ? n : 1) * 4 + 63) / 64 * 64);
    unsigned s = 12345;
    for (long i = 0; i < n; ++i) { s = s * 1664525u + 1013904223u; p[i] = (float)(s >> 8) / 8388608.0f - 1.0f; }
    return p;
}
int main(int argc, char **argv)
{
    if (argc != 13) { fprintf(stderr, "usage: lib symbol pass fc batch ocb in wt bias out scratch calls\n"); return 2; }
    void *lib = dlopen(argv[1], RTLD_NOW);
    if (!lib) { fprintf(stderr, "%s\n", dlerror()); return 2; }
    void *fn = dlsym(lib, argv[2]);
    if (!fn) { fprintf(stderr, "%s\n", dlerror()); return 2; }
    int pass = atoi(argv[3]), fc = atoi(argv[4]), batch = atoi(argv[5]), ocb = atoi(argv[6]);
    float *in = buffer(atol(argv[7])), *wt = buffer(atol(argv[8])), *bias = buffer(atol(argv[9]));
    float *out = buffer(atol(argv[10])), *scratch = buffer(atol(argv[11]));
    const int calls = atoi(argv[12]);
    double *seconds = calloc(calls > 0 ? calls : 1, sizeof(double));
    for (int c = 0; c < calls; ++c) {
        struct timespec t0, t1;
        clock_gettime(CLOCK_MONOTONIC, &t0);
        if (pass == 0 && fc) ((fwd_t)fn)(in, wt, bias, out, batch, 1, 0, ocb);
        else if (pass == 0) ((conv_fwd_t)fn)(in, wt, bias, out, NULL, NULL, batch, 1);
        else if (pass == 1 && fc) ((bwd_data_t)fn)(out, out, wt, scratch, in, batch, 1, 0, ocb);
        else if (pass == 1) ((bwd_data_t)fn)(out, out, wt, scratch, in, batch, 1);
        else if (fc) ((bwd_w_t)fn)(in, out, out, wt, bias, batch, 1, 0, ocb);
        else ((bwd_w_t)fn)(in, out, out, wt, bias, batch, 1);
        clock_gettime(CLOCK_MONOTONIC, &t1);
        seconds[c] = (t1.tv_sec - t0.tv_sec) + 1e-9 * (t1.tv_nsec - t0.tv_nsec);
    }
    if (calls > 1) {
        qsort(seconds + 1, calls - 1, sizeof(double), by_value);
        printf("%.9f\n", seconds[1 + (calls - 1) / 2]);
    }
    return 0;
}
"""

JUMP = re.compile(r"^j[a-z]+$")
ADDR = re.compile(r"^\s*([0-9a-f]+):\s+(\S+)\s*(.*)$")


@dataclass
class Instr:
    offset: int
    mnemonic: str
    text: str            # AT&T text for llvm-mca, branch target replaced by a label


@dataclass
class LoopProfile:
    start: int           # offset of the loop's first instruction in the library
    instructions: int    # per iteration
    fmas: int            # FMA instructions per iteration
    iterations: int      # executions of the loop's branch in the profiled call
    mca_cycles: float    # llvm-mca cycles per iteration
    l1_misses: int       # simulated L1d misses (reads + writes) inside the loop, whole call
    core_efficiency: float  # FMA-unit occupancy llvm-mca predicts for the loop


@dataclass
class KernelProfile:
    layer: str
    pass_name: str
    batch: int
    flops: float
    fma_flops: int               # FLOPs of one FMA instruction (2 x vector lanes)
    fma_instructions: int        # executed
    instructions: int            # executed
    loads: int
    stores: int
    l1_misses: int               # reads + writes
    l2_misses: int
    loop_cycles: float           # sum over innermost loops of iterations x llvm-mca cycles
    other_instructions: int      # executed outside innermost loops
    core_bound: float            # FMA-unit efficiency the instruction stream allows
    measured: float | None       # native efficiency against the measured peak (None: not timed)
    hot_loops: list[LoopProfile]

    def row(self) -> str:
        f = self.fma_instructions or 1
        measured = f"{self.measured:6.0%}" if self.measured is not None else "     -"
        fma_ratio = self.fma_instructions * self.fma_flops / self.flops
        return (f"{self.layer:<8} {self.pass_name:<12} {self.batch:>5} {fma_ratio:6.2f} "
                f"{self.instructions / f:6.2f} {self.loads / f:6.2f} {1000 * self.l1_misses / f:7.1f} "
                f"{64 * self.l1_misses / self.flops:7.3f} {64 * self.l2_misses / self.flops:7.3f} "
                f"{self.other_instructions / max(self.instructions, 1):6.1%} {self.core_bound:6.0%} {measured}")


HEADER = (f"{'layer':<8} {'pass':<12} {'batch':>5} {'FMA/ideal':>6} {'ins/FMA':>6} {'ld/FMA':>6} "
          f"{'L1m/kFMA':>7} {'L2 B/F':>7} {'mem B/F':>7} {'outside':>6} {'core%':>6} {'meas%':>6}")


def disassemble(lib: Path, prefix: str) -> tuple[dict[int, Instr], dict[str, int]]:
    """Instructions of the library's functions named `prefix*`, and every function's offset."""
    text = subprocess.run(["objdump", "-d", "--no-show-raw-insn", str(lib)], check=True,
                          capture_output=True, text=True).stdout
    instrs: dict[int, Instr] = {}
    functions: dict[str, int] = {}
    current = None
    for line in text.splitlines():
        m = re.match(r"^([0-9a-f]+) <(.+)>:$", line)
        if m:
            current = m.group(2)
            functions[current] = int(m.group(1), 16)
            continue
        m = ADDR.match(line)
        if not m or current is None or not current.startswith(prefix):
            continue
        offset, mnemonic, operands = int(m.group(1), 16), m.group(2), m.group(3)
        operands = re.sub(r"\s*<.*>", "", operands.split("#")[0]).strip()
        instrs[offset] = Instr(offset, mnemonic, f"{mnemonic} {operands}".strip())
    return instrs, functions


def innermost_loops(instrs: dict[int, Instr]) -> list[tuple[int, int]]:
    """(first, branch) offsets of backward jumps that contain no other backward jump."""
    loops = []
    for off, ins in instrs.items():
        if JUMP.match(ins.mnemonic):
            target = ins.text.split()[-1]
            if re.fullmatch(r"[0-9a-f]+", target) and int(target, 16) < off and int(target, 16) in instrs:
                loops.append((int(target, 16), off))
    return [(a, b) for a, b in loops if not any(a <= c < d <= b and (c, d) != (a, b) for c, d in loops)]


def mca_cycles(body: list[Instr], mcpu: str, iterations: int = 100) -> float:
    lines = ["loop_top:"] + [("    " + re.sub(r"\s[0-9a-f]+$", " loop_top", i.text)) if JUMP.match(i.mnemonic)
                             else "    " + i.text for i in body]
    res = subprocess.run(["llvm-mca", f"-mcpu={mcpu}", f"-iterations={iterations}"], input="\n".join(lines) + "\n",
                         capture_output=True, text=True)
    m = re.search(r"Total Cycles:\s+(\d+)", res.stdout)
    if res.returncode or not m:
        raise RuntimeError(f"llvm-mca failed on the loop at {body[0].offset:#x}: {res.stderr.strip()[:300]}")
    return int(m.group(1)) / iterations


def callgrind_counts(cmd: list[str], l1: int, l2: int, out: Path) -> tuple[list[str], dict[str, dict[int, list[int]]]]:
    """Per-function, per-address self costs of one run under callgrind with the cache simulator."""
    def cache(size: int) -> str:
        lines = size // 64
        sets = 1 << max(0, (lines // 8).bit_length() - 1)
        return f"{size},{lines // sets},64"
    subprocess.run(["valgrind", "--tool=callgrind", "--cache-sim=yes", f"--D1={cache(l1)}", f"--LL={cache(l2)}",
                    "--I1=32768,8,64", "--dump-instr=yes", "--dump-line=no", "--compress-strings=no",
                    "--compress-pos=no", f"--callgrind-out-file={out}", *cmd], check=True, capture_output=True)
    return parse_callgrind(out.read_text())


def parse_callgrind(text: str) -> tuple[list[str], dict[str, dict[int, list[int]]]]:
    """Self cost per function and instruction address from callgrind's uncompressed output
    (--dump-instr=yes --dump-line=no --compress-strings=no --compress-pos=no). A `calls=` line
    is followed by the callee's inclusive cost at the call site: not the caller's own."""
    events: list[str] = []
    costs: dict[str, dict[int, list[int]]] = {}
    fn = None
    skip_next = False
    for line in text.splitlines():
        if line.startswith("events:"):
            events = line.split()[1:]
        elif line.startswith("fn="):
            fn = line[3:]
            costs.setdefault(fn, {})
        elif line.startswith("calls="):
            skip_next = True
        elif line[:2] == "0x" and fn is not None:
            if skip_next:
                skip_next = False
                continue
            parts = line.split()
            vals = [int(v) for v in parts[1:]] + [0] * (len(events) - len(parts) + 1)
            acc = costs[fn].setdefault(int(parts[0], 16), [0] * len(events))
            for i, v in enumerate(vals):
                acc[i] += v
    return events, costs


def profile_kernel(build_dir: Path, layer: LayerEntry, pass_name: str, batch: int, v: int,
                   flops: float, harness: Path, workdir: Path, mcpu: str, issue: float, fma_units: int,
                   l1: int, l2: int, peak: float | None, repeats: int) -> KernelProfile:
    kernel = layer.kernels[pass_name]
    lib = build_dir / kernel.library
    symbol = next(iter(kernel.symbols))
    fc = layer.type == "fc"
    (wshape, bias_len) = WeightedLayer.blocked_sizes(layer, v)
    weights = 1
    for d in wshape:
        weights *= d
    c, h, w = layer.in_shape
    oc, oh, ow = layer.out_shape
    args = [str(lib), symbol, str(KIND_CODE[pass_name]), str(int(fc)), str(batch), str(blocks(oc, v)),
            str(batch * blocks(c, v) * v * h * w), str(weights), str(bias_len), str(batch * blocks(oc, v) * v * oh * ow),
            str((kernel.plan or {}).get("scratch_floats", 0))]
    measured = None
    if peak:
        timed = subprocess.run([str(harness), *args, str(repeats + 1)], check=True, capture_output=True, text=True)
        measured = flops / float(timed.stdout) / 1e9 / peak
    events, costs = callgrind_counts([str(harness), *args, "1"], l1, l2, workdir / f"{layer.name}_{pass_name}.cg")
    instrs, functions = disassemble(lib, symbol)
    ev = {name: i for i, name in enumerate(events)}
    # Runtime address -> library offset: the kernel's entry point runs first, so its lowest
    # executed address is its symbol's offset; the library's other functions share the base.
    base = min(costs[symbol]) - functions[symbol]
    per_offset: dict[int, list[int]] = {}
    for fn, by_addr in costs.items():
        if fn.startswith(symbol):
            for addr, vals in by_addr.items():
                per_offset[addr - base] = vals

    def total(name: str, offsets=None) -> int:
        keys = per_offset if offsets is None else offsets
        return sum(per_offset.get(o, [0] * len(events))[ev[name]] for o in keys)

    fma_instructions = sum(per_offset[o][ev["Ir"]] for o in per_offset
                           if o in instrs and instrs[o].mnemonic.startswith("vfmadd"))
    loops = []
    in_loops: set[int] = set()
    for first, branch in innermost_loops(instrs):
        iterations = per_offset.get(branch, [0])[0]
        body = [instrs[o] for o in sorted(instrs) if first <= o <= branch]
        fmas = sum(i.mnemonic.startswith("vfmadd") for i in body)
        if not iterations:
            continue
        offsets = [i.offset for i in body]
        in_loops.update(offsets)
        cycles = mca_cycles(body, mcpu)
        loops.append(LoopProfile(first, len(body), fmas, iterations, cycles,
                                 total("D1mr", offsets) + total("D1mw", offsets), fmas / (fma_units * cycles)))
    instructions = total("Ir")
    other = instructions - total("Ir", in_loops)
    loop_cycles = sum(lp.iterations * lp.mca_cycles for lp in loops)
    cycles = loop_cycles + other / issue
    loops.sort(key=lambda lp: -lp.iterations * lp.mca_cycles)
    return KernelProfile(layer.name, pass_name, batch, flops, 2 * v, fma_instructions, instructions,
                         total("Dr"), total("Dw"), total("D1mr") + total("D1mw"), total("DLmr") + total("DLmw"),
                         loop_cycles, other, fma_instructions / (fma_units * cycles) if cycles else 0.0, measured, loops[:4])


def markdown(data: dict) -> str:
    """Per kernel, the FMA count against the ideal, the simulated
    traffic, the share of cycles outside innermost loops and the core-bound efficiency."""
    lines = ["| layer | pass | batch | FMAs / ideal | instr. / FMA | L1 misses / 1000 FMA | L2->L1 B/FLOP "
             "| beyond-L2 B/FLOP | cycles outside loops | core-bound | measured |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for k in data["kernels"]:
        f = max(k["fma_instructions"], 1)
        cycles = k["loop_cycles"] + k["other_instructions"] / data.get("issue", 4.0)
        measured = f"{k['measured']:.0%}" if k["measured"] is not None else "-"
        lines.append(f"| {k['layer']} | {k['pass_name']} | {k['batch']} | {k['fma_flops'] * f / k['flops']:.2f} | "
                     f"{k['instructions'] / f:.2f} | {1000 * k['l1_misses'] / f:.1f} | "
                     f"{64 * k['l1_misses'] / k['flops']:.3f} | {64 * k['l2_misses'] / k['flops']:.3f} | "
                     f"{k['other_instructions'] / data.get('issue', 4.0) / cycles:.0%} | {k['core_bound']:.0%} | {measured} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    ap.add_argument("net", type=Path, nargs="?", help="net JSON (omit with --table)")
    ap.add_argument("--table", type=Path, default=None, help="print a --json file as a markdown table and exit")
    ap.add_argument("--arch", default="avx2")
    ap.add_argument("--layers", default=None, help="comma-separated layer names (default: every conv and fc)")
    ap.add_argument("--passes", default=",".join(PASSES))
    ap.add_argument("--batch", type=int, default=1, help="minibatch of conv kernels (default 1)")
    ap.add_argument("--fc-batch", type=int, default=64, help="minibatch of fc kernels (default 64)")
    ap.add_argument("--mcpu", default="sapphirerapids", help="llvm-mca CPU model (default: this VM's host)")
    ap.add_argument("--issue", type=float, default=4.0, help="instructions per cycle outside the loops")
    ap.add_argument("--repeats", type=int, default=5, help="native timings per kernel (0: do not time)")
    ap.add_argument("--build-dir", type=Path, default=None)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    if args.table:
        print(markdown(json.loads(args.table.read_text())))
        return 0
    if args.net is None:
        ap.error("a net JSON is needed unless --table is given")
    for tool in ("valgrind", "llvm-mca", "objdump", "gcc"):
        if not shutil.which(tool):
            print(f"kernel_profile: {tool} is not on PATH", file=sys.stderr)
            return 2
    arch = get_arch(args.arch)
    if arch.isa == "avx512":  # it stops at the first such instruction with SIGILL
        print("kernel_profile: valgrind does not execute AVX-512 instructions; profile an AVX2 or scalar "
              "build (--arch avx2)", file=sys.stderr)
        return 2
    try:
        cpu.require(arch.isa, "kernel_profile")  # the harness runs the kernels here, outside pr.load
    except ArchError as e:
        print(f"kernel_profile: {e}", file=sys.stderr)
        return 2
    caches = native_arch()   # simulate the caches of the machine the kernels run on
    net = load_netspec(args.net)
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        build_dir = args.build_dir or workdir / "build"
        build(net, arch, build_dir)
        manifest = read_manifest(build_dir)
        harness = workdir / "harness"
        (workdir / "harness.c").write_text(HARNESS)
        subprocess.run(["gcc", "-O2", "-o", str(harness), str(workdir / "harness.c"), "-ldl"], check=True)
        wanted = set(args.layers.split(",")) if args.layers else None
        specs = {ls.name: ls for ls in net.layers}
        peak = measure_peak(arch, 1) if args.repeats else None
        if peak:
            print(f"FMA peak, 1 thread: {peak:.1f} GFLOP/s")
        print(HEADER)
        results = []
        for layer in manifest.layers:
            if layer.type not in ("conv", "fc") or (wanted and layer.name not in wanted):
                continue
            batch = args.fc_batch if layer.type == "fc" else args.batch
            for p in args.passes.split(","):
                prof = profile_kernel(build_dir, layer, p, batch, arch.vector_floats,
                                      specs[layer.name].flops(batch), harness, workdir, args.mcpu, args.issue,
                                      arch.fma_units, caches.l1d_bytes, caches.l2_bytes, peak, args.repeats)
                results.append(prof)
                print(prof.row(), flush=True)
                cycles = prof.loop_cycles + prof.other_instructions / args.issue
                for lp in prof.hot_loops[:3]:
                    print(f"    loop @{lp.start:#x}: {lp.iterations * lp.mca_cycles / cycles:4.0%} of cycles, {lp.fmas} FMA / "
                          f"{lp.instructions} ins, {lp.mca_cycles:.1f} cycles (core {lp.core_efficiency:.0%}), "
                          f"{lp.iterations} iterations, {lp.l1_misses / max(lp.iterations, 1):.2f} L1 misses/iteration",
                          flush=True)
                print(f"    outside innermost loops: {prof.other_instructions / args.issue / cycles:4.0%} of cycles", flush=True)
        if args.json:
            args.json.write_text(json.dumps({"net": net.name, "arch": arch.to_json(), "mcpu": args.mcpu, "issue": args.issue,
                                             "peak_gflops": peak,
                                             "kernels": [asdict(r) for r in results]}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
