"""Where a training step's time goes: kernel time per layer type and pass (PCLDNN_VERBOSE),
against the whole SGD step timed without it, so what is not convolution (batchnorm, adds,
pooling, the optimizer, layouts, Python) is visible (issue 50 item 2).

    pcldnn-gen compile examples/nets/resnet50.json --arch native --precision bf16 -o build/r50
    python benchmarks/step_breakdown.py build/r50 --batch 16 --threads 1

Steps: `--steps` Trainer.step calls timed one by one (median, after two warm-up steps), then one
loss_and_grad with PCLDNN_VERBOSE=1 in a child process whose kernel lines are summed by the
manifest's layer type. "other" in the table is the step's time outside every kernel: the
optimizer, the runtime's Python and its layout calls.
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
from pathlib import Path

CHILD = """
import sys, numpy as np, pcldnn_runtime as pr
net = pr.load(sys.argv[1], threads=int(sys.argv[2]))
batch = int(sys.argv[3])
rng = np.random.default_rng(0)
x = rng.standard_normal((batch, *net.chain[0].in_shape)).astype(np.float32)
y = rng.integers(0, net.loss_layer.out_shape[0], batch)
net.loss_and_grad(x, y)
print("pcldnn_step_marker", file=sys.stderr, flush=True)
net.loss_and_grad(x, y)
"""


def step_time(build: Path, batch: int, threads: int, steps: int) -> float:
    """Median wall seconds of one Trainer.step (SGD with momentum) at this minibatch."""
    import numpy as np

    import pcldnn_runtime as pr
    net = pr.load(build, threads=threads)
    trainer = pr.Trainer(net, pr.SGD(0.01, momentum=0.9))
    rng = np.random.default_rng(0)
    x = rng.standard_normal((batch, *net.chain[0].in_shape)).astype(np.float32)
    y = rng.integers(0, net.loss_layer.out_shape[0], batch)
    times = []
    for i in range(steps + 2):
        start = time.perf_counter()
        trainer.step(x, y)
        if i >= 2:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def kernel_times(build: Path, batch: int, threads: int) -> dict[tuple[str, str], float]:
    """Milliseconds per (layer type, pass) of one loss_and_grad, from its verbose lines."""
    types = {layer["name"]: layer["type"] for layer in json.loads((build / "manifest.json").read_text())["layers"]}
    env = dict(os.environ, PCLDNN_VERBOSE="1")
    run = subprocess.run([sys.executable, "-c", CHILD, str(build), str(threads), str(batch)], env=env,
                         capture_output=True, text=True, check=True)
    lines = run.stderr.split("pcldnn_step_marker", 1)[1].splitlines()
    out: dict[tuple[str, str], float] = defaultdict(float)
    for line in lines:
        fields = line.split(",")
        if len(fields) >= 9 and fields[0] == "pcldnn_verbose" and fields[2] == "exec":
            layer, role = fields[3], fields[4]
            if role in ("fwd", "bwd_data", "bwd_weights"):
                out[(types.get(layer, layer), role)] += float(fields[8])
            else:  # the net's input into its blocked layout, the logits out of it
                out[("layout", "fwd")] += float(fields[8])
    return dict(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("build", type=Path)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args()
    step_ms = 1e3 * step_time(args.build, args.batch, args.threads, args.steps)
    kernels = kernel_times(args.build, args.batch, args.threads)
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


if __name__ == "__main__":
    main()
