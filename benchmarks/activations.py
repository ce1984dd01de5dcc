"""Batchnorm with a fused activation (none, ReLU, SiLU, GELU) and the standalone SiLU and GELU
layers against PyTorch: one training step's kernels (forward, then backward: weights and data)
on activation shapes of EfficientNet-B0 and ResNet-50, fp32, the same threads.

    python benchmarks/activations.py [--threads 2] [--batch 16] [--rounds 5] [--arch native] [--shapes 64x28x28]

Ours: the layer's kernels on their blocked buffers as a training step runs them (forward, then
backward-weights, which scales dy in place by the fused activation's derivative, then
backward-data), the output gradient restored from a copy outside the timed span before each
step; the Python calls around the kernels (a few microseconds) included. PyTorch: BatchNorm2d in
training mode then the activation (F.relu, F.silu, F.gelu), forward and autograd's backward on
NCHW tensors (its eager CPU kernels). Rounds interleave the two sides; each ratio is the
median of the per-round ratios. GB/s: the batchnorm's compulsory bytes (bench.pass_bytes) over
our time, against the copy rate measured first. The standalone GELU's forward is also timed
against oneDNN's (PyTorch's F.gelu on a to_mkldnn() tensor: ONEDNN_VERBOSE shows the eltwise
primitive, jit:<isa> eltwise_gelu_erf; oneDNN has no SiLU on that path).
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

import pcldnn_runtime as pr
from pcldnn_gen.arch import get_arch
from pcldnn_gen.bench import measure_copy_rate, pass_bytes
from pcldnn_gen.build import build
from pcldnn_gen.netspec import parse_netspec
from pcldnn_runtime.kernels import empty_aligned

# (name, channels, height, width): EfficientNet-B0's expanded activations at 224 and ResNet-50's
SHAPES = [("effnet_b1", 96, 112, 112), ("effnet_b3", 240, 28, 28), ("effnet_b6", 1152, 7, 7),
          ("resnet_l1", 256, 56, 56)]
FUSED = (None, "relu", "silu", "gelu")
STANDALONE = ("silu", "gelu")


def _net(c: int, h: int, w: int) -> dict:
    layers: list[dict] = [{"name": "c", "type": "conv", "out_channels": c, "kernel": 1}]
    for act in FUSED:
        layers.append({"name": f"bn_{act or 'none'}", "type": "batchnorm", "inputs": ["c"],
                       **({"activation": act} if act else {})})
    layers += [{"name": f"only_{act}", "type": act, "inputs": ["c"]} for act in STANDALONE]
    layers.append({"name": "sum", "type": "add", "inputs": [l["name"] for l in layers[1:]]})
    return {"name": "acts", "input": {"channels": 8, "height": h, "width": w}, "layers": layers}


def _our_seconds(layer, batch: int, repeats: int) -> float:
    """Median seconds of one training step's kernels of `layer` on random blocked buffers."""
    rng = np.random.default_rng(0)
    xb = empty_aligned(layer.input_shape(batch))
    xb[...] = rng.standard_normal(xb.shape)
    shape = layer.blocked_shape(layer.out_shape, batch)
    yb, dyb, dxb, pristine = (empty_aligned(shape) for _ in range(4))
    pristine[...] = rng.standard_normal(shape)
    norm = layer.type == "batchnorm"
    grads = tuple(empty_aligned(g.shape) for g in layer.grad_buffers) if norm else None
    aux = layer.aux_buffer(batch)
    times = []
    for _ in range(repeats + 1):
        np.copyto(dyb, pristine)
        start = time.perf_counter()
        layer.forward_blocked(xb, yb, aux, training=True)
        layer.backward_blocked(xb, yb, aux, dyb, dxb, grads)
        times.append(time.perf_counter() - start)
    return float(np.median(times[1:]))


def _torch_seconds(torch, act: str | None, bn: bool, shape: tuple[int, ...], repeats: int) -> float:
    """Median seconds of forward + backward of (BatchNorm2d in training mode then) the activation."""
    F = torch.nn.functional
    x = torch.randn(shape, requires_grad=True)
    dy = torch.randn(shape)
    norm = torch.nn.BatchNorm2d(shape[1]) if bn else None
    fn = {None: lambda t: t, "relu": F.relu, "silu": F.silu, "gelu": F.gelu}[act]
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        y = fn(norm(x) if norm is not None else x)
        y.backward(dy)
        times.append(time.perf_counter() - start)
    return float(np.median(times[1:]))


def _forward_seconds(layer, batch: int, repeats: int) -> float:
    xb = empty_aligned(layer.input_shape(batch))
    xb[...] = np.random.default_rng(1).standard_normal(xb.shape)
    yb = empty_aligned(layer.blocked_shape(layer.out_shape, batch))
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        layer.forward_blocked(xb, yb)
        times.append(time.perf_counter() - start)
    return float(np.median(times[1:]))


def _onednn_gelu_seconds(torch, shape: tuple[int, ...], repeats: int) -> float:
    x = torch.randn(shape).to_mkldnn()
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        torch.nn.functional.gelu(x)
        times.append(time.perf_counter() - start)
    return float(np.median(times[1:]))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--arch", default="native")
    p.add_argument("--shapes", default=",".join(s[0] for s in SHAPES),
                   help="comma-separated names of SHAPES, or CxHxW (default: all of SHAPES)")
    args = p.parse_args(argv)
    import torch
    torch.set_num_threads(args.threads)
    arch = get_arch(args.arch)
    copy = measure_copy_rate(arch, args.threads)
    print(f"arch {arch.name} ({arch.isa}), {args.threads} threads, minibatch {args.batch}, fp32; "
          f"copy rate {copy:.1f} GB/s; torch {torch.__version__}")
    print(f"{'shape':<11} {'layer':<12} {'ours ms':>8} {'GB/s':>6} {'torch ms':>9} {'speedup':>8}")
    known = {s[0]: s for s in SHAPES}
    shapes = [known.get(n) or (n, *map(int, n.split("x"))) for n in args.shapes.split(",")]
    for name, c, h, w in shapes:
        with tempfile.TemporaryDirectory() as tmp:
            build(parse_netspec(_net(c, h, w)), arch, Path(tmp) / "b")
            net = pr.load(Path(tmp) / "b", threads=args.threads)
            rows = [(f"bn_{a or 'none'}", a, True) for a in FUSED] + [(f"only_{a}", a, False) for a in STANDALONE]
            for layer_name, act, bn in rows:
                layer = net.layers[layer_name]
                nbytes = sum(pass_bytes(layer, q, args.batch) for q in ("fwd", "bwd_weights", "bwd_data")) if bn \
                    else None
                ours, ratios = [], []
                for _ in range(args.rounds):
                    mine = _our_seconds(layer, args.batch, args.repeats)
                    theirs = _torch_seconds(torch, act, bn, (args.batch, c, h, w), args.repeats)
                    ours.append(mine)
                    ratios.append(theirs / mine)
                t = float(np.median(ours))
                gbs = f"{nbytes / t / 1e9:6.1f}" if nbytes else f"{'':>6}"
                print(f"{name:<11} {layer_name:<12} {t * 1e3:8.2f} {gbs} {t * float(np.median(ratios)) * 1e3:9.2f} "
                      f"{float(np.median(ratios)):7.2f}x", flush=True)
                if layer_name == "only_gelu":  # its forward against oneDNN's eltwise_gelu_erf
                    pairs = [(_forward_seconds(layer, args.batch, args.repeats),
                              _onednn_gelu_seconds(torch, (args.batch, c, h, w), args.repeats))
                             for _ in range(args.rounds)]
                    print(f"{name:<11} {'gelu fwd':<12} {np.median([p[0] for p in pairs]) * 1e3:8.2f} {'':>6} "
                          f"{'oneDNN':>5} {np.median([p[1] for p in pairs]) * 1e3:.2f} "
                          f"{np.median([p[1] / p[0] for p in pairs]):7.2f}x", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
