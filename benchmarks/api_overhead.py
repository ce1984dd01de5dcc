"""What the canonical per-layer API costs beyond the blocked kernels (issue 15, part 5).

    python benchmarks/api_overhead.py --arch avx512 [--threads 1] [--batch 16]

1. Fixed cost per call: a 16 -> 16 fc layer at minibatch 1 (almost no arithmetic), mean of
   many calls after a warm-up: the blocked kernel (`forward_blocked`: cffi and OpenMP) and the
   canonical `layer.forward` (checks, two conversions, the output array), for 1 and 2 threads.
2. VGG-A conv4 forward (256 -> 256 channels, 56 x 56; or --layer): the blocked kernel against
   `layer.forward(x)` on an NCHW array, timed alternately (`--rounds`, median of per-round
   ratios), and the two conversions alone. The target: forward on canonical arrays at most
   1.10x the blocked kernel.
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

import pcldnn_runtime as pr
from pcldnn_gen.arch import get_arch
from pcldnn_gen.build import build
from pcldnn_gen.netspec import load_netspec, parse_netspec
from pcldnn_runtime.kernels import empty_aligned, ptr

REPO = Path(__file__).resolve().parent.parent


def mean_us(fn, calls: int) -> float:
    for _ in range(calls // 20):
        fn()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


def seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def fixed_cost(arch, tmp: Path, calls: int) -> None:
    net = parse_netspec({"name": "tiny", "input": {"channels": 16, "height": 1, "width": 1},
                         "layers": [{"name": "fc", "type": "fc", "out_features": 16}]})
    build(net, arch, tmp / "tiny")
    for threads in (1, 2):
        layer = pr.load(tmp / "tiny", threads=threads).layers["fc"]
        x = np.random.default_rng(0).standard_normal((1, 16)).astype(np.float32)
        xb, yb = empty_aligned(layer.input_shape(1)), empty_aligned(layer.blocked_shape(layer.out_shape, 1))
        layer.input_into_blocked(x.reshape(1, 16, 1, 1), xb)
        print(f"fixed cost, 16 -> 16 fc, minibatch 1, {threads} thread(s): "
              f"blocked kernel {mean_us(lambda: layer.forward_blocked(xb, yb), calls):.1f} us, "
              f"layer.forward {mean_us(lambda: layer.forward(x), calls):.1f} us, "
              f"one pointer {mean_us(lambda: ptr(xb), calls):.2f} us (mean of {calls} calls)")


def conversion_cost(arch, tmp: Path, net_file: Path, layer_name: str, batch: int, threads: int, rounds: int) -> None:
    spec = load_netspec(net_file)
    build(spec, arch, tmp / "net")
    layer = pr.load(tmp / "net", threads=threads).layers[layer_name]
    x = np.random.default_rng(0).standard_normal((batch, *layer.in_shape)).astype(np.float32)
    xb, yb = empty_aligned(layer.input_shape(batch)), empty_aligned(layer.blocked_shape(layer.out_shape, batch))
    y = np.empty((batch, *layer.out_shape), dtype=np.float32)
    k = layer._k  # the layout kernels alone
    calls = {
        "blocked kernel": lambda: layer.forward_blocked(xb, yb),
        "layer.forward": lambda: layer.forward(x),
        "input to blocked": lambda: k["in_to_blocked"](ptr(x), ptr(xb), batch, threads),
        "output from blocked": lambda: k["out_from_blocked"](ptr(yb), ptr(y), batch, threads),
    }
    for fn in calls.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(rounds):
        for name, fn in calls.items():
            times[name].append(seconds(fn))
    kernel = times["blocked kernel"]
    ratio = statistics.median(a / b for a, b in zip(times["layer.forward"], kernel))
    in_mb, out_mb = x.nbytes / 1e6, y.nbytes / 1e6
    print(f"{spec.name} {layer_name} forward, minibatch {batch}, {threads} thread(s), {arch.name}, "
          f"median of {rounds} interleaved rounds:")
    for name, t in times.items():
        mb = {"input to blocked": in_mb, "output from blocked": out_mb}.get(name)
        rate = f"  ({2 * mb / 1e3 / statistics.median(t):.1f} GB/s read + written)" if mb else ""
        print(f"  {name:<20} {1e3 * statistics.median(t):9.2f} ms{rate}")
    print(f"  layer.forward / blocked kernel: {ratio:.3f} (target <= 1.10)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", default="native")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--net", type=Path, default=REPO / "examples" / "nets" / "vgg_a.json")
    ap.add_argument("--layer", default="conv4")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--calls", type=int, default=20000)
    args = ap.parse_args()
    arch = get_arch(args.arch)
    with tempfile.TemporaryDirectory() as tmp:
        fixed_cost(arch, Path(tmp), args.calls)
        conversion_cost(arch, Path(tmp), args.net, args.layer, args.batch, args.threads, args.rounds)


if __name__ == "__main__":
    main()
