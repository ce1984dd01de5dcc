"""Compile a net (cifar_small by default) and time a forward pass (`make demo` trains instead:
examples/train.py).

Prints the logits' shape and the median time and GFLOP/s of each layer's kernel, e.g.
    python examples/demo.py --net examples/nets/vgg_a.json --arch avx2 --batch 8 --threads 1
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np

import pcldnn_runtime as pr
from pcldnn_gen.arch import get_arch
from pcldnn_gen.build import build
from pcldnn_gen.netspec import load_netspec

NET = Path(__file__).parent / "nets" / "cifar_small.json"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    ap.add_argument("--net", default=str(NET))
    ap.add_argument("--arch", default="native")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--threads", type=int, default=None, help="default: every usable core")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    batch = args.batch
    spec = load_netspec(args.net)
    arch = get_arch(args.arch)
    t0 = time.perf_counter()
    result = build(spec, arch)
    print(f"compiled {spec.name} for {arch.name} into {result.directory} in {time.perf_counter() - t0:.2f} s "
          f"({result.compiled} kernels compiled, {result.cached} from cache)")

    net = pr.load(result.directory, threads=args.threads)
    x = np.random.default_rng(0).standard_normal((batch, *spec.input)).astype(np.float32)
    net.forward(x)  # warm-up: allocates this minibatch's buffers, wakes the OpenMP threads
    runs = []
    for _ in range(args.repeats):
        timings: dict[str, float] = {}
        logits = net.forward(x, timings=timings)
        runs.append(timings)
    print(f"forward pass, minibatch {batch}, {net.threads} threads: input {x.shape} -> logits {logits.shape}")
    print(f"  {'layer':<8} {'type':<8} {'output (C x H x W)':<20} {'median ms':>10} {'GFLOP/s':>9}")
    total = 0.0
    for layer in spec.layers:
        if layer.name not in runs[0]:
            continue
        t = float(np.median([r[layer.name] for r in runs]))
        total += t
        flops = layer.flops(batch)
        rate = f"{flops / t / 1e9:9.1f}" if flops else f"{'':9}"
        print(f"  {layer.name:<8} {layer.type:<8} {'x'.join(map(str, layer.out_shape)):<20} {t * 1e3:10.3f} {rate}")
    print(f"  {'total':<38} {total * 1e3:10.3f}   ({batch / total:.0f} images/s forward)")
    probs = np.exp(logits - logits.max(axis=1, keepdims=True))
    probs /= probs.sum(axis=1, keepdims=True)
    print(f"predicted classes of the first 8 images: {probs.argmax(axis=1)[:8].tolist()}")


if __name__ == "__main__":
    main()
