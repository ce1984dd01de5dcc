"""Where a training step's time goes: kernel time per layer type and pass (PCLDNN_VERBOSE),
against the whole SGD step timed without it, so what is not convolution (batchnorm, adds,
pooling, the optimizer, layouts, Python) is visible (issue 50 item 2).

    pcldnn-gen compile examples/nets/resnet50.json --arch native --precision bf16 -o build/r50
    python benchmarks/step_breakdown.py build/r50 --batch 16 --threads 1

Steps: `--steps` Trainer.step calls timed one by one (median), then one loss_and_grad with
PCLDNN_VERBOSE=1 in a child process whose kernel lines are summed by the manifest's layer type.
"other" in the table is the step's time outside every kernel: the optimizer, the runtime's
Python and its layout calls. Both time only steps that fault no page in: the workspace lends
its gradient buffers in turn, so a buffer's first use as the largest gradient (the max
pooling's dx) maps its pages (ResNet-18, fp32, Xeon VM: that kernel 103-106 ms with 237-492
minor faults in the first two steps, 8 ms from the third).

`--per-layer` adds each convolution's time per pass and its share of the FMA peak (the verbose
lines' nominal GFLOP/s over the peak the build's own peak kernel measured in the child), and
the convolutions' aggregate share: what the step's kernels reach, against what `bench`
measures for a layer alone.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

CHILD = """
import sys, numpy as np, pcldnn_runtime as pr
sys.path.insert(0, sys.argv[4])
from step_breakdown import settle
net = pr.load(sys.argv[1], threads=int(sys.argv[2]))
batch = int(sys.argv[3])
rng = np.random.default_rng(0)
x = rng.standard_normal((batch, *net.chain[0].in_shape)).astype(np.float32)
y = rng.integers(0, net.loss_layer.out_shape[0], batch)
settle(lambda: net.loss_and_grad(x, y))
print("pcldnn_step_marker", file=sys.stderr, flush=True)
net.loss_and_grad(x, y)
"""


def settle(step: Callable[[], object]) -> None:
    """step() until a call maps no new page, at most 8 calls (see the module's docstring)."""
    import resource
    for _ in range(8):
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        step()
        if resource.getrusage(resource.RUSAGE_SELF).ru_minflt == faults:
            return


def step_time(build: Path, batch: int, threads: int, steps: int) -> float:
    """Median wall seconds of one Trainer.step (SGD with momentum) at this minibatch, once a
    step maps no new page."""
    import numpy as np

    import pcldnn_runtime as pr
    net = pr.load(build, threads=threads)
    trainer = pr.Trainer(net, pr.SGD(0.01, momentum=0.9))
    rng = np.random.default_rng(0)
    x = rng.standard_normal((batch, *net.chain[0].in_shape)).astype(np.float32)
    y = rng.integers(0, net.loss_layer.out_shape[0], batch)
    settle(lambda: trainer.step(x, y))
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        trainer.step(x, y)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


PASSES = ("fwd", "bwd_data", "bwd_weights")


def verbose_step(build: Path, batch: int, threads: int) -> tuple[list[list[str]], float | None]:
    """The verbose exec lines (split at commas) of one loss_and_grad, and the FMA peak (GFLOP/s)
    the child measured for this thread count (None: a build without a peak kernel)."""
    env = dict(os.environ, PCLDNN_VERBOSE="1")
    run = subprocess.run([sys.executable, "-c", CHILD, str(build), str(threads), str(batch), str(Path(__file__).parent)],
                         env=env, capture_output=True, text=True, check=True)
    before, after = run.stderr.split("pcldnn_step_marker", 1)
    peak = None
    for line in before.splitlines():  # pcldnn_verbose,<rank>,info,peak,<threads>,<GFLOP/s or "- (why)">
        fields = line.split(",")
        if len(fields) >= 6 and fields[0] == "pcldnn_verbose" and fields[2:5] == ["info", "peak", str(threads)]:
            peak = None if fields[5].startswith("-") else float(fields[5])
    lines = [f for f in (line.split(",") for line in after.splitlines())
             if len(f) >= 11 and f[0] == "pcldnn_verbose" and f[2] == "exec"]
    return lines, peak


def kernel_times(lines: list[list[str]], types: dict[str, str]) -> dict[tuple[str, str], float]:
    """Milliseconds per (layer type, pass) of the step's verbose lines."""
    out: dict[tuple[str, str], float] = defaultdict(float)
    for fields in lines:
        layer, role = fields[3], fields[4]
        if role in PASSES:
            out[(types.get(layer, layer), role)] += float(fields[8])
        else:  # the net's input into its blocked layout, the logits out of it
            out[("layout", "fwd")] += float(fields[8])
    return dict(out)


def conv_table(lines: list[list[str]], types: dict[str, str], peak: float | None) -> None:
    """Each convolution's milliseconds and share of the peak per pass, slowest first, and all
    of them together (nominal FLOPs: the verbose lines' GFLOP/s times their time)."""
    ms: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    gflop: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for fields in lines:
        if types.get(fields[3]) == "conv" and fields[4] in PASSES and fields[9] != "-":
            ms[fields[3]][fields[4]] += float(fields[8])
            gflop[fields[3]][fields[4]] += float(fields[9]) * float(fields[8]) / 1e3
    print(f"\n{'convolution':<24}" + "".join(f"{p:>17}" for p in PASSES) + f"   (ms, % of the {peak or '?'} GFLOP/s peak)")
    for name in sorted(ms, key=lambda n: -sum(ms[n].values())):
        cells = ""
        for p in PASSES:
            t = ms[name].get(p)
            share = f"{100 * gflop[name][p] / (t / 1e3) / peak:3.0f}%" if t and peak else "  - "
            cells += f"{t:11.1f} {share}" if t else f"{'-':>11} {'':>5}"
        print(f"{name:<24}{cells}")
    total_ms = sum(sum(r.values()) for r in ms.values())
    total_gflop = sum(sum(r.values()) for r in gflop.values())
    if total_ms and peak:
        print(f"convolutions together: {total_ms:.1f} ms, {total_gflop:.1f} nominal GFLOP, "
              f"{100 * total_gflop / (total_ms / 1e3) / peak:.0f}% of the peak")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    ap.add_argument("build", type=Path)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--per-layer", action="store_true", help="each convolution's time and share of the FMA peak")
    args = ap.parse_args()
    step_ms = 1e3 * step_time(args.build, args.batch, args.threads, args.steps)
    types = {layer["name"]: layer["type"] for layer in json.loads((args.build / "manifest.json").read_text())["layers"]}
    lines, peak = verbose_step(args.build, args.batch, args.threads)
    kernels = kernel_times(lines, types)
    by_type: dict[str, dict[str, float]] = defaultdict(dict)
    for (kind, role), ms in kernels.items():
        by_type[kind][role] = ms
    print(f"{args.build}: minibatch {args.batch}, {args.threads} thread(s): step {step_ms:.1f} ms "
          f"({1e3 * args.batch / step_ms:.1f} images/s), kernels {sum(kernels.values()):.1f} ms")
    print(f"{'layer type':<14} {'fwd':>9} {'bwd_data':>9} {'bwd_wts':>9} {'total ms':>9} {'of step':>8}")
    rows = sorted(by_type.items(), key=lambda kv: -sum(kv[1].values()))
    for kind, roles in rows:
        total = sum(roles.values())
        cells = " ".join(f"{roles.get(r, 0.0):9.1f}" for r in ("fwd", "bwd_data", "bwd_weights"))
        print(f"{kind:<14} {cells} {total:9.1f} {100 * total / step_ms:7.1f}%")
    other = step_ms - sum(kernels.values())
    print(f"{'other':<14} {'':>29} {other:9.1f} {100 * other / step_ms:7.1f}%")
    conv = sum(by_type.get("conv", {}).values())
    print(f"not convolution: {100 * (step_ms - conv) / step_ms:.1f}% of the step")
    if args.per_layer:
        conv_table(lines, types, peak)


if __name__ == "__main__":
    main()
