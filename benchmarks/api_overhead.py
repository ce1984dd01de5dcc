"""What the canonical per-layer API costs beyond the blocked kernels (issue 15, part 5).

    python benchmarks/api_overhead.py --arch avx512 [--threads 1] [--batch 16]

1. Fixed cost per call: a 16 -> 16 fc layer at minibatch 1 (almost no arithmetic), mean of
   many calls after a warm-up: the blocked kernel (`forward_blocked`: cffi and OpenMP) and the
   canonical `layer.forward` (checks, two conversions, the output array), for 1 and 2 threads.
2. VGG-A conv4 (256 -> 256 channels, 56 x 56; or --layer), each pass: the blocked kernel
   against the canonical call (`layer.forward(x)`, `backward_data(dy)`, `backward_weights(x,
   dy)` on NCHW arrays), timed alternately (`--rounds`, median of per-round ratios), in fp32 or
   a bf16 build (`--precision bf16`). The targets: the canonical call at most 1.10x (fp32) and
   1.15x (bf16, issue 50) its kernel.
3. `--torch`: the same passes through PyTorch on the same float32 arrays, NCHW and channels_last
   (its better time each round), timed in the same rounds (`torch.set_num_threads` as ours): a
   bf16 build against oneDNN's bf16 convolution (x, dy and the weights cast to bf16, the
   results cast back to float32, as our calls take and give float32), an fp32 build against its
   fp32 one; forward with the layer's ReLU, the backward passes as aten.convolution_backward
   computes them (the ReLU's mask left out of PyTorch's side). The issue 50 target: our call at
   least 1.0x PyTorch's per pass.
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
from pcldnn_runtime.layer_types import ConvKind

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


def torch_calls(layer, x: np.ndarray, dy: np.ndarray, threads: int, precision: str) -> dict:
    """PyTorch's forward, input-gradient and weight-gradient calls of the layer's convolution
    (its weights and bias) on float32 arrays in and out, in NCHW and in channels_last (its
    inputs already in that layout, as a channels_last model's are)."""
    import torch
    if layer.spec.conv_kind is not ConvKind.DENSE:
        raise SystemExit(f"--torch compares dense convolutions; {layer.name} is a {layer.type} with {layer.groups} group(s)")
    torch.set_num_threads(threads)
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    stride, pad = tuple(layer.spec.stride), tuple(layer.spec.pad)
    calls = {}
    for fmt, name in ((torch.contiguous_format, "nchw"), (torch.channels_last, "channels_last")):
        w = torch.from_numpy(np.ascontiguousarray(layer.weights)).to(dtype).contiguous(memory_format=fmt)
        b = torch.from_numpy(np.ascontiguousarray(layer.bias)).to(dtype)
        tx = torch.from_numpy(x).contiguous(memory_format=fmt)
        tdy = torch.from_numpy(dy).contiguous(memory_format=fmt)
        x16 = tx.to(dtype)

        def forward(tx=tx, w=w, b=b):
            with torch.no_grad():
                out = torch.nn.functional.conv2d(tx.to(dtype), w, b, stride, pad)
                return (torch.relu(out) if layer.relu else out).float()

        def backward(mask, tdy=tdy, x16=x16, w=w):
            with torch.no_grad():
                grads = torch.ops.aten.convolution_backward(tdy.to(dtype), x16, w, [w.shape[0]], stride, pad, (1, 1),
                                                            False, (0, 0), 1, mask)
                return [g.float() for g in grads if g is not None]

        calls.update({f"torch {name} fwd": forward,
                      f"torch {name} bwd_data": lambda backward=backward: backward([True, False, False]),
                      f"torch {name} bwd_weights": lambda backward=backward: backward([False, True, True])})
    return calls


def conversion_cost(arch, tmp: Path, net_file: Path, layer_name: str, batch: int, threads: int, rounds: int,
                    precision: str, with_torch: bool = False) -> None:
    spec = load_netspec(net_file)
    build(spec, arch, tmp / "net", precision=precision)
    layer = pr.load(tmp / "net", threads=threads).layers[layer_name]
    rng = np.random.default_rng(0)
    x = rng.standard_normal((batch, *layer.in_shape)).astype(np.float32)
    dy = rng.standard_normal((batch, *layer.out_shape)).astype(np.float32)
    def aligned(a: np.ndarray) -> np.ndarray:  # the kernels read whole aligned vectors
        out = empty_aligned(a.shape, dtype=a.dtype)
        np.copyto(out, a)
        return out

    # the kernels' own operands, as the layer API makes them (bf16 where the layer stores bf16)
    xb = aligned(layer.input_blocked(x, "bench.x"))
    yb = aligned(layer.output_buffer("bench.y", batch))
    layer.forward_blocked(xb, yb)
    dyb = aligned(layer.output_gradient_blocked(dy, "bench.dy"))
    dxb = empty_aligned(xb.shape, dtype=np.uint16 if layer.in_grad_bf16 else np.float32)
    dw, db = (aligned(g) for g in layer.grad_buffers)
    calls = {
        "fwd kernel": lambda: layer.forward_blocked(xb, yb),
        "layer.forward": lambda: layer.forward(x),
        "bwd_data kernel": lambda: layer.backward_blocked(xb, yb, None, dyb, dxb),
        "layer.backward_data": lambda: layer.backward_data(dy),
        "bwd_weights kernel": lambda: layer.backward_blocked(xb, yb, None, dyb, None, grads=(dw, db)),
        "layer.backward_weights": lambda: layer.backward_weights(x, dy),
    }
    if with_torch:
        calls.update(torch_calls(layer, x, dy, threads, precision))
    for fn in calls.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(rounds):
        for name, fn in calls.items():
            times[name].append(seconds(fn))
    print(f"{spec.name} {layer_name}, minibatch {batch}, {threads} thread(s), {arch.name}, {precision}, "
          f"median of {rounds} interleaved rounds:")
    for p, k in (("forward", "fwd"), ("backward_data", "bwd_data"), ("backward_weights", "bwd_weights")):
        kernel, api = times[f"{k} kernel"], times[f"layer.{p}"]
        ratio = statistics.median(a / b for a, b in zip(api, kernel))
        line = (f"  {p:<17} kernel {1e3 * statistics.median(kernel):8.2f} ms   layer.{p} "
                f"{1e3 * statistics.median(api):8.2f} ms   ratio {ratio:.3f}")
        if with_torch:  # PyTorch's better layout, round by round
            theirs = [min(pair) for pair in zip(times[f"torch nchw {k}"], times[f"torch channels_last {k}"])]
            line += (f"   PyTorch {1e3 * statistics.median(theirs):8.2f} ms (NCHW "
                     f"{1e3 * statistics.median(times[f'torch nchw {k}']):.1f})   x PyTorch "
                     f"{statistics.median(t / a for t, a in zip(theirs, api)):.2f}")
        print(line)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    ap.add_argument("--arch", default="native")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--net", type=Path, default=REPO / "examples" / "nets" / "vgg_a.json")
    ap.add_argument("--layer", default="conv4")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--calls", type=int, default=20000)
    ap.add_argument("--precision", default="fp32", choices=("fp32", "bf16"))
    ap.add_argument("--skip-fixed", action="store_true", help="only the layer's three passes")
    ap.add_argument("--torch", action="store_true", help="PyTorch's call of each pass beside ours (same rounds)")
    args = ap.parse_args()
    arch = get_arch(args.arch)
    with tempfile.TemporaryDirectory() as tmp:
        if not args.skip_fixed:
            fixed_cost(arch, Path(tmp), args.calls)
        conversion_cost(arch, Path(tmp), args.net, args.layer, args.batch, args.threads, args.rounds, args.precision,
                        args.torch)


if __name__ == "__main__":
    main()
