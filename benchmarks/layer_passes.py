"""Time the three training passes of chosen layers on blocked buffers (kernel time only).

    python benchmarks/layer_passes.py examples/nets/vgg_a.json --layers conv3 --arch avx2 --batch 8 --threads 1

Prints the median over --repeats runs (after one warm-up) and GFLOP/s per pass.
"""
from __future__ import annotations

import argparse
import tempfile
import time

import numpy as np

import pcldnn_runtime as pr
from pcldnn_gen.arch import get_arch
from pcldnn_gen.build import build
from pcldnn_gen.netspec import load_netspec
from pcldnn_runtime.kernels import empty_aligned


def median_seconds(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("net")
    ap.add_argument("--layers", required=True, help="comma-separated conv/fc layer names")
    ap.add_argument("--arch", default="native")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    spec = load_netspec(args.net)
    with tempfile.TemporaryDirectory() as tmp:
        build(spec, get_arch(args.arch), f"{tmp}/build")
        net = pr.load(f"{tmp}/build", threads=args.threads)
        print(f"{spec.name} on {net.isa}, minibatch {args.batch}, {args.threads} thread(s), median of {args.repeats}")
        for name in args.layers.split(","):
            layer, ls = net.layers[name], spec.layer(name)
            rng = np.random.default_rng(0)
            xb = empty_aligned(layer.blocked_shape(layer.in_shape, args.batch))
            xb[...] = rng.standard_normal(xb.shape)
            yb, dyb, dxb = (empty_aligned(layer.blocked_shape(s, args.batch))
                            for s in (layer.out_shape, layer.out_shape, layer.in_shape))
            dyb[...] = rng.standard_normal(dyb.shape)
            grads = (empty_aligned(layer._dwt.shape), empty_aligned(layer._dbias.shape))
            passes = {
                "fwd": lambda: layer.forward_blocked(xb, yb),
                "bwd_data": lambda: layer.backward_blocked(xb, None, None, dyb, dxb),
                "bwd_weights": lambda: layer.backward_blocked(xb, None, None, dyb, None, grads),
            }
            flops = ls.flops(args.batch)
            for pass_name, fn in passes.items():
                t = median_seconds(fn, args.repeats)
                print(f"  {name:<8} {pass_name:<12} {t * 1e3:9.2f} ms {flops / t / 1e9:8.1f} GFLOP/s")


if __name__ == "__main__":
    main()
