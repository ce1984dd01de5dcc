"""Benchmarks: the machine's FMA peak, and every layer and pass of a net against it and
against baselines (numpy im2col + BLAS, oneDNN through PyTorch), measured in one run so
that machine noise largely cancels in the ratios. Timings are medians over repeats after a
warm-up; our kernels are timed on blocked layouts, like oneDNN's primitive times."""
from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

import pcldnn_runtime as pr
from pcldnn_runtime import families
from pcldnn_runtime.abi import REPEATED_KINDS, SIGNATURES
from pcldnn_runtime.families import Target
from pcldnn_runtime.kernels import bf16_bits, empty_aligned, fma_peak_gflops, load_library, ptr
from pcldnn_runtime.manifest import PASSES, file_sha256

from . import __version__
from .arch import PRESETS, Arch
from .build import build
from .codegen import COPY_SYMBOL, PEAK_SYMBOL, peak_flops_per_iteration, render_copy, render_peak, template_env
from .compiler import Source, compile_source
from .errors import PcldnnError
from .netspec import NetSpec

BASELINES = ("numpy", "onednn")
# Timed keys of a baseline run (seconds); ratios are taken of these only.
BASELINE_TIMES = ("numpy", "onednn", "onednn_wall")


def median_seconds(fn: Any, repeats: int) -> float:
    """Median wall time of `fn` over `repeats` runs after one warm-up run."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def measure_peak(arch: Arch, threads: int, repeats: int = 5) -> float:
    """FMA peak in GFLOP/s with `threads` threads, from the generated kernel of independent
    FMA chains (no memory traffic)."""
    pr.cpu.require(arch.isa, "measuring the peak")
    source = render_peak(arch)
    lib = compile_source(source, arch).library
    library = load_library(lib, file_sha256(lib), source.symbols)  # kept while fn is called
    return fma_peak_gflops(library[PEAK_SYMBOL], peak_flops_per_iteration(arch), threads, repeats)


def measure_copy_rate(arch: Arch, threads: int, repeats: int = 5) -> float:
    """Memory copy rate in GB/s with `threads` threads (bytes read + bytes written a second, as
    STREAM's Copy counts them), from a generated copy kernel over two arrays each twice the
    last-level cache (at least 256 MiB): the bound of the memory-bound kernels' rows."""
    pr.cpu.require(arch.isa, "measuring the copy rate")
    source = render_copy(arch)
    lib = compile_source(source, arch).library
    library = load_library(lib, file_sha256(lib), source.symbols)
    n = max(2 * arch.l3_bytes, 256 << 20) // 4
    src, dst = empty_aligned((n,)), empty_aligned((n,))
    src.fill(1.0)
    dst.fill(0.0)  # (both touched: no page faults in the timed calls)
    copy = library[COPY_SYMBOL]
    seconds = median_seconds(lambda: copy(ptr(src), ptr(dst), n, threads), repeats)
    return 2 * 4 * n / seconds / 1e9


# A timing call repeats a kernel until about this long (one call at least, at most MAX_REPEATS).
TIMED_BLOCK_SECONDS = 1e-3
MAX_REPEATS = 1000


@functools.cache
def _repeat_library() -> Any:
    """The timing loops (templates/repeat.c.j2), compiled once through the cache; plain C, so
    with the scalar preset's flags whatever the kernels' ISA."""
    kinds = [(kind, SIGNATURES[kind], ", ".join(param.split()[-1].lstrip("*") for param in SIGNATURES[kind].split(",")))
             for kind in REPEATED_KINDS]
    symbols = {f"pcldnn_repeat_{kind}": f"repeat_{kind}" for kind in REPEATED_KINDS}
    text = template_env().get_template("repeat.c.j2").render(version=__version__, kinds=kinds)
    lib = compile_source(Source("repeat.c", text, symbols), PRESETS["scalar"]).library
    return load_library(lib, file_sha256(lib), symbols)


class KernelTimer:
    """One kernel call, repeated in C: each call of the timer runs the kernel `reps` times back
    to back (set on the first call so that they take about TIMED_BLOCK_SECONDS) and returns the
    seconds per kernel call. The Python call around a kernel (3-4 us, most of a small fc
    layer's time) is left out, as oneDNN's primitive time leaves out PyTorch's."""

    def __init__(self, kind: str, kernel: Any, args: tuple) -> None:
        library = _repeat_library()
        self._library = library  # kept alive while the loop is called
        self._loop = library[f"pcldnn_repeat_{kind}"]
        self._kernel = library._ffi.cast("void *", kernel)
        self._args = args
        self._seconds = np.zeros(1, dtype=np.float64)
        self.reps = 0

    def _run(self, reps: int) -> float:
        self._loop(self._kernel, reps, ptr(self._seconds), *self._args)
        return float(self._seconds[0])

    def __call__(self) -> float:
        if not self.reps:
            once = self._run(1)
            self.reps = int(min(MAX_REPEATS, max(1, TIMED_BLOCK_SECONDS // max(once, 1e-9))))
            return once
        return self._run(self.reps)


def kernel_timers(layer: Any, batch: int) -> dict[str, KernelTimer]:
    """{pass: a KernelTimer of the layer's kernel} on blocked buffers of random values (fixed
    seed): what the benchmarks time, without layout conversions; activations and gradients
    stored as bf16 in the net (families.bf16_outputs, bf16_gradients) are bf16 here too."""
    rng = np.random.default_rng(0)

    def random(shape: tuple[int, ...], bf16: bool) -> np.ndarray:
        values = empty_aligned(shape)
        values[...] = rng.standard_normal(shape)
        if not bf16:
            return values
        bits = empty_aligned(shape, dtype=np.uint16)
        bf16_bits(values, bits, flush_subnormals=True)
        return bits

    xb = random(layer.input_shape(batch), layer.in_bf16)
    dxb = empty_aligned(xb.shape, dtype=np.uint16 if layer.in_grad_bf16 else np.float32)
    shape = layer.blocked_shape(layer.out_shape, batch)
    yb = empty_aligned(shape, dtype=np.uint16 if layer.out_bf16 else np.float32)
    dyb = random(shape, layer.out_grad_bf16)
    grads = tuple(empty_aligned(g.shape) for g in layer.grad_buffers)
    if layer.type == "batchnorm":  # training passes as a net runs them: backward-data from backward-weights' sums
        aux = layer.aux_buffer(batch)
        layer.forward_blocked(xb, yb, aux, training=True)
        act = layer.spec.act
        if act is not None and act.from_input:  # dy is scaled in place by f'(z) at every call: zeros stay
            dyb[...] = 0                          # zeros, where values would decay into slow subnormals
        # (a fused activation's backward is timed with the pass that applies it, as in a step)
        runs = {"fwd": lambda: layer.forward_blocked(xb, yb, aux, training=True),
                "bwd_data": lambda: layer.backward_blocked(xb, yb, aux, dyb, dxb, grads),
                "bwd_weights": lambda: layer.backward_blocked(xb, yb, aux, dyb, None, grads)}
    else:
        runs = {"fwd": lambda: layer.forward_blocked(xb, yb),
                "bwd_data": lambda: layer.backward_blocked(xb, None, None, dyb, dxb),
                "bwd_weights": lambda: layer.backward_blocked(xb, None, None, dyb, None, grads)}
    # the traced arguments hold the buffers (ptr keeps an array alive)
    return {p: KernelTimer(layer.kernel_kind(p), *layer.traced_kernel_call(p, run)) for p, run in runs.items()}


def median_kernel_seconds(timer: KernelTimer, repeats: int) -> float:
    """Median seconds per kernel call over `repeats` timed blocks, after one warm-up block."""
    timer()
    return float(np.median([timer() for _ in range(repeats)]))


@dataclass(frozen=True)
class PassResult:
    layer: str
    pass_name: str
    ms: float
    gflops: float
    peak_fraction: float
    vs_numpy: float | None = None          # numpy time / our time (>1: we are faster)
    vs_onednn: float | None = None         # oneDNN primitive time / our kernel time
    vs_onednn_wall: float | None = None    # PyTorch wall time (reorders included) / our kernel time
    onednn_impl: str | None = None         # oneDNN's implementation name(s) for the pass, e.g. brg_conv_fwd:avx2
    onednn_isa: str | None = None          # the ISA oneDNN reported it dispatches to
    layer_type: str = ""                   # conv or fc
    family: str = ""                       # zoo rows: the architecture the shape comes from
    useful_gflops: float = 0.0             # GFLOP/s counting only taps that read inside the input (no padding)
    tuned: bool = False                    # the kernel's tile came from the tuning database
    batch: int = 0                         # the minibatch it ran at
    gbs: float | None = None               # memory-bound rows: the pass's compulsory bytes (pass_bytes) a second
    bound_fraction: float | None = None    # gbs / the measured copy rate: the share of the bandwidth bound


def memory_bound(layer: Any, target: Target) -> bool:
    """Rows judged by bytes, not FLOPs: a layer whose forward kernel is a memory-bound family's
    (Family.memory_bound: depthwise convolutions, batchnorms)."""
    return families.choose(layer, "fwd", target)[0].memory_bound


def pass_bytes(layer: Any, pass_name: str, batch: int) -> float:
    """The bytes a memory-bound pass must move (a runtime layer, its blocked buffers: padded
    channel blocks; 2 bytes a value where stored as bf16). Depthwise convolution: forward reads x
    and writes y, backward-data reads dy and writes dx, backward-weights reads x and dy (weights:
    a few KB, counted). Batchnorm: forward reads x for the statistics, then x and y for the apply
    (3 activations: the statistics are needed before any output); backward-weights reads x and
    dy; backward-data, given the sums backward-weights made, reads x and dy and writes dx."""
    def size(shape: tuple[int, ...], bf16: bool) -> float:
        return float(np.prod(shape)) * (2 if bf16 else 4)

    x = size(layer.input_shape(batch), layer.in_bf16)
    out = layer.blocked_shape(layer.out_shape, batch)
    y, dy = size(out, layer.out_bf16), size(out, layer.out_grad_bf16)
    dx = size(layer.input_shape(batch), layer.in_grad_bf16)
    weights = 4.0 * sum(g.size for g in layer.grad_buffers)
    if layer.type == "batchnorm":
        return {"fwd": 2 * x + y, "bwd_weights": x + dy, "bwd_data": x + dy + dx}[pass_name]
    return {"fwd": x + y, "bwd_data": dy + dx, "bwd_weights": x + dy}[pass_name] + weights


def bench_net(spec: NetSpec, arch: Arch, batch: int, threads: int, passes: Any = PASSES,
              layers: list[str] | None = None, repeats: int = 5, compare: Any = (), peak: float | None = None,
              build_dir: Path | None = None, rounds: int = 1, tuning: Any = None,
              precision: str = "fp32", copy_rate: float | None = None) -> tuple[float, list[PassResult]]:
    """Time every (conv, fc or batchnorm layer, pass). Returns (peak GFLOP/s, results).
    Memory-bound rows (depthwise, batchnorm) also get their bytes a second against the copy rate
    (`copy_rate` GB/s, else measured once here). `precision` bf16: a
    bf16 build (its vdpbf16ps forward kernels timed without the conversions that feed them; the
    AMX ones and the backward kernels convert their operands themselves, timed with it), against
    oneDNN on bf16 tensors; the peak stays the fp32 FMA peak.

    Layer by layer, `rounds` times: our kernels then the baselines, back to back. Our time is
    the median over rounds, and each ratio the median of the per-round ratios, so a slow
    moment that hits one side of one round does not decide a ratio. The FMA peak is measured
    again after each layer; the denominator is the highest peak seen in the run (the machine's
    demonstrated capability), so a slow moment cannot inflate the efficiencies."""
    benched = [l for l in spec.layers if l.weighted or l.type == "batchnorm"]
    chosen = [l for l in benched if layers is None or l.name in layers]
    if layers:
        unknown = set(layers) - {l.name for l in benched}
        if unknown:
            raise PcldnnError(f"{spec.name}: no conv/fc/batchnorm layer named {', '.join(sorted(unknown))}")
    peaks = [peak] if peak else [measure_peak(arch, threads)]
    target = arch.target(precision)
    if copy_rate is None and any(memory_bound(l, target) for l in chosen):
        copy_rate = measure_copy_rate(arch, threads)
    ours: dict[tuple[str, str], float] = {}
    ratios: dict[tuple[str, str], dict] = {}
    nbytes: dict[tuple[str, str], float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        out = build_dir or Path(tmp) / "build"
        plans = build(spec, arch, out, tuning=tuning, precision=precision).plans
        net = pr.load(out, threads=threads)
        for ls in chosen:
            timers = kernel_timers(net.layers[ls.name], batch)
            if memory_bound(ls, target):
                nbytes |= {(ls.name, p): pass_bytes(net.layers[ls.name], p, batch) for p in passes}
            per_round = []  # [({pass: our seconds}, {"layer/pass": {baseline: seconds}})]
            for _ in range(rounds):
                mine = {p: median_kernel_seconds(timers[p], repeats) for p in passes}
                per_round.append((mine, run_baselines([ls], arch, batch, threads, passes, repeats, compare, precision)
                                  if compare and ls.weighted else {}))
            for p in passes:
                ours[(ls.name, p)] = float(np.median([mine[p] for mine, _ in per_round]))
                seen = {k: v for _, b in per_round for k, v in b.get(f"{ls.name}/{p}", {}).items()}
                keys = {k for k in seen if k in BASELINE_TIMES}
                ratios[(ls.name, p)] = {k: seen[k] for k in ("onednn_impl", "onednn_isa") if k in seen} | {
                    k: float(np.median([b[f"{ls.name}/{p}"][k] / mine[p] for mine, b in per_round
                                        if b.get(f"{ls.name}/{p}", {}).get(k)]))
                    for k in keys if any(b.get(f"{ls.name}/{p}", {}).get(k) for _, b in per_round)}
            if not peak:
                peaks.append(measure_peak(arch, threads))
    best_peak = max(peaks)
    results = []
    for ls in chosen:
        flops, useful = ls.flops(batch), ls.useful_flops(batch)
        for p in passes:
            t, r = ours[(ls.name, p)], ratios[(ls.name, p)]
            gbs = nbytes[(ls.name, p)] / t / 1e9 if (ls.name, p) in nbytes else None
            results.append(PassResult(ls.name, p, t * 1e3, flops / t / 1e9, flops / t / 1e9 / best_peak,
                                      r.get("numpy"), r.get("onednn"), r.get("onednn_wall"), r.get("onednn_impl"),
                                      r.get("onednn_isa"), ls.type, useful_gflops=useful / t / 1e9,
                                      tuned=plans[(ls.name, p)].measured is not None, batch=batch, gbs=gbs,
                                      bound_fraction=gbs / copy_rate if gbs is not None and copy_rate else None))
    return best_peak, results


def bench_curve(spec: NetSpec, arch: Arch, batches: list[int], threads: int, passes: Any = PASSES,
                layers: list[str] | None = None, repeats: int = 5,
                tuning: Any = None) -> tuple[float, dict[int, list[PassResult]]]:
    """Every (weighted layer, pass) at each minibatch of `batches`, in one run (one build): the
    efficiency against the per-node minibatch that `plan --machine local` uses. The FMA peak
    is measured before each minibatch and after the last; all rows use the highest."""
    peaks, curve = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for batch in batches:
            peaks.append(measure_peak(arch, threads))
            _, curve[batch] = bench_net(spec, arch, batch, threads, passes, layers, repeats, peak=peaks[-1],
                                        build_dir=Path(tmp) / "build", tuning=tuning)
    peaks.append(measure_peak(arch, threads))
    best = max(peaks)
    return best, {b: [replace(r, peak_fraction=r.gflops / best) for r in rows] for b, rows in curve.items()}


def format_curve(title: str, arch: Arch, threads: int, peak: float, curve: dict[int, list[PassResult]]) -> str:
    """% of the peak per layer and pass (rows) at each minibatch (columns)."""
    batches = sorted(curve)
    lines = [f"{title} on {arch.name}, {threads} thread(s): % of the measured FMA peak ({peak:.1f} GFLOP/s, highest "
             f"of the run) against the minibatch",
             f"{'layer':<10} {'pass':<12}" + "".join(f" {'mb' + str(b):>7}" for b in batches)]
    for i, first in enumerate(curve[batches[0]]):
        cells = "".join(f" {curve[b][i].peak_fraction:7.0%}" for b in batches)
        lines.append(f"{first.layer:<10} {first.pass_name:<12}{cells}")
    return "\n".join(lines)


def bench_zoo(shapes: Any, arch: Arch, batch: int, threads: int, passes: Any = PASSES, repeats: int = 5, compare: Any = (),
              rounds: int = 1, tuning: Any = None, precision: str = "fp32") -> tuple[float, list[PassResult]]:
    """Every shape of a zoo (pcldnn_gen.zoo) as a one-layer net, like bench_net; in bf16, a
    convolution as inside a net (ZooShape.inner: bf16 activations and gradients in and out). The
    FMA peak is measured before and after the whole zoo; the efficiencies use the higher of the two."""
    peaks = [measure_peak(arch, threads)]
    target = arch.target(precision)
    copy_rate = measure_copy_rate(arch, threads) if any(memory_bound(s.net.layers[0], target) for s in shapes) else None
    rows: list[PassResult] = []
    for shape in shapes:
        _, results = bench_net(shape.inner if precision == "bf16" else shape.net, arch, batch, threads, passes, None,
                               repeats, compare, peak=peaks[0],
                               rounds=rounds, tuning=tuning, precision=precision, copy_rate=copy_rate)
        rows += [replace(r, family=shape.family) for r in results]
    peaks.append(measure_peak(arch, threads))
    best = max(peaks)
    return best, [replace(r, peak_fraction=r.gflops / best) for r in rows]


def run_baselines(layers: Any, arch: Arch, batch: int, threads: int, passes: Any, repeats: int, compare: Any,
                  precision: str = "fp32") -> dict:
    """Run pcldnn_gen.baselines in a subprocess whose environment pins the ISA and the thread
    count of the libraries (OpenBLAS, oneDNN) to what our kernels get; bf16: oneDNN on bf16
    tensors with its AVX512_BF16 kernels, or its AMX kernels for an arch with AMX (the library a
    user of that CPU would otherwise pick)."""
    unknown = set(compare) - set(BASELINES)
    if unknown:
        raise PcldnnError(f"unknown baseline {', '.join(sorted(unknown))}; known: {', '.join(BASELINES)}")
    problems = [{"name": l.name, "type": l.type, "in_shape": l.in_shape, "out_channels": l.out_shape[0],
                 "kernel": l.kernel, "stride": l.stride, "pad": l.pad, "groups": l.groups} for l in layers]
    if not problems:
        return {}
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), OPENBLAS_NUM_THREADS=str(threads))
    if arch.isa == "avx2":
        env.update(ONEDNN_MAX_CPU_ISA="AVX2", OPENBLAS_CORETYPE="Haswell")
    elif arch.isa == "avx512":  # fp32: no AMX or bf16 paths; bf16: AMX where our build has AMX kernels
        env.update(ONEDNN_MAX_CPU_ISA="AVX512_CORE" if precision == "fp32" else
                   "AVX512_CORE_AMX" if arch.amx else "AVX512_CORE_BF16")
    env.pop("OPENBLAS_L2_SIZE", None)
    with tempfile.TemporaryDirectory() as tmp:
        request = Path(tmp) / "request.json"
        result = Path(tmp) / "result.json"
        request.write_text(json.dumps({"problems": problems, "batch": batch, "threads": threads,
                                       "passes": list(passes), "repeats": repeats, "compare": list(compare),
                                       "isa": "amx" if precision == "bf16" and arch.amx else arch.isa,
                                       "precision": precision}))
        proc = subprocess.run([sys.executable, "-m", "pcldnn_gen.baselines", str(request), str(result)],
                              env=env, capture_output=True, text=True, timeout=3600)
        if proc.returncode != 0:
            raise PcldnnError(f"baseline run failed: {proc.stderr.strip().splitlines()[-1] if proc.stderr else proc.returncode}")
        return json.loads(result.read_text())


def format_table(title: str, arch: Arch, batch: int, threads: int, peak: float, results: list[PassResult]) -> str:
    copy_rate = next((r.gbs / r.bound_fraction for r in results if r.gbs and r.bound_fraction), None)
    lines = [f"{title} on {arch.name}, minibatch {batch}, {threads} thread(s); measured FMA peak {peak:.1f} GFLOP/s "
             "(highest of the run)" + (f", copy rate {copy_rate:.1f} GB/s" if copy_rate else ""),
             f"{'layer':<8} {'pass':<12} {'ms':>9} {'GFLOP/s':>8} {'%peak':>6} {'useful':>7} {'xnumpy':>7} {'xoneDNN':>8} "
             f"{'xoneDNN wall':>12}" + (f" {'GB/s':>7} {'%copy':>6}" if copy_rate else "")]

    def fmt(v: Any, width: Any) -> Any:
        return f"{v:{width}.2f}" if v is not None else f"{'-':>{width}}"

    for r in results:
        flops = (f"{r.gflops:8.1f} {r.peak_fraction:6.0%} {r.useful_gflops / r.gflops:7.0%}" if r.gflops
                 else f"{'-':>8} {'-':>6} {'-':>7}")  # (batchnorm: no dot products)
        lines.append(f"{r.layer:<8} {r.pass_name:<12} {r.ms:9.{2 if r.ms >= 1 else 4}f} {flops} "
                     f"{fmt(r.vs_numpy, 7)} {fmt(r.vs_onednn, 8)} "
                     f"{fmt(r.vs_onednn_wall, 12)}"
                     + ((f" {r.gbs:7.1f} {r.bound_fraction:6.0%}" if r.gbs and r.bound_fraction else f" {'-':>7} {'-':>6}")
                        if copy_rate else ""))
    lines.append("GFLOP/s and %peak count nominal FLOPs (2 x every multiply-add of the layer, padding taps "
                 "included); useful = the share of them that reads inside the input (the kernels skip the rest)")
    lines.append("x columns: baseline time / our time (> 1: ours is faster); oneDNN = its primitive time "
                 "(ONEDNN_VERBOSE), oneDNN wall = PyTorch call time including layout reorders")
    if copy_rate:
        lines.append("GB/s (depthwise and batchnorm rows): the bytes the pass must move (bench.pass_bytes) a second; "
                     "%copy: of the copy rate measured in the same run (read + written bytes a second)")
    tuned = sum(r.tuned for r in results)
    if tuned:
        lines.append(f"{tuned} of {len(results)} kernels use a tile from the tuning database (`pcldnn-gen tune`)")
    impls = sorted({i for r in results if r.onednn_impl for i in r.onednn_impl.split()})
    if impls:
        isa = next((r.onednn_isa for r in results if r.onednn_isa), None)
        lines.append(f"oneDNN implementations: {', '.join(impls)}" + (f"; oneDNN ISA: {isa}" if isa else ""))
    return "\n".join(lines)


def results_json(title: str, arch: Arch, batch: int | list[int], threads: int, peak: float, results: list[PassResult],
                 zoo: bool = False, precision: str = "fp32") -> dict:
    """The run as JSON; `zoo`: the rows are independent shapes, not the layers of one net;
    `precision`: the build's (a bf16 run's peak_fraction is against the fp32 FMA peak)."""
    return {"net": title, "zoo": zoo, "precision": precision, "arch": arch.to_json(), "batch": batch,
            "threads": threads, "peak_gflops": peak, "results": [asdict(r) for r in results]}


def plot(path: Path, title: str, arch: Arch, results: list[PassResult]) -> None:
    """Bar chart: per layer and pass, our fraction of peak beside oneDNN's (ours / ratio)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise PcldnnError("--plot needs matplotlib: pip install 'pcldnn-gen[demo]'") from None
    labels = [f"{r.layer}\n{r.pass_name}" for r in results]
    ours = [100 * r.peak_fraction for r in results]
    theirs = [100 * r.peak_fraction / r.vs_onednn if r.vs_onednn else 0 for r in results]
    x = np.arange(len(results))
    fig, ax = plt.subplots(figsize=(max(6, 0.55 * len(results)), 4))
    ax.bar(x - 0.2, ours, 0.4, label="pcldnn-gen")
    if any(theirs):
        ax.bar(x + 0.2, theirs, 0.4, label="oneDNN (primitive time)")
    ax.set_xticks(x, [l.replace("\n", " ") for l in labels], fontsize=7, rotation=60, ha="right")
    ax.set_ylabel("% of measured FMA peak")
    ax.set_title(f"{title}, {arch.name}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
