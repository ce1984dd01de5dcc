"""Training throughput (images/s) of a whole SGD step: ours against PyTorch CPU, one run.

    python benchmarks/train_throughput.py [--net examples/nets/cifar_small.json] [--batch 64]
        [--threads 1,2] [--steps 20] [--arch native] [--precision bf16] [--no-tuning] [--json out.json]

Ours: Trainer-equivalent steps (forward, loss, backward, SGD with momentum on the flat
buffers), median step time after warm-up, and where the step's time goes (the kernels of
every layer forward and backward, the optimizer, the rest: input layout, loss, Python).
PyTorch: the same net (graph_module: chains and graphs) with the same SGD, run in a subprocess per setting so
that ONEDNN_MAX_CPU_ISA and the thread count are fixed before torch loads: AVX2 and the
default ISA (AVX-512 here), NCHW and channels_last. With --precision bf16, ours is a bf16 build
and PyTorch runs at its default ISA in bf16 two ways, autocast (fp32 model) and a bf16 model,
each NCHW and channels_last; the ratio is against the best of the four. Needs torch 2.13.0 CPU.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent


def ours(net_file: str, arch_name: str, batch: int, threads: int, steps: int, tuned: bool,
         precision: str = "fp32") -> dict:
    import pcldnn_runtime as pr
    from pcldnn_gen.arch import get_arch
    from pcldnn_gen.build import build
    from pcldnn_gen.netspec import load_netspec
    from pcldnn_gen.tuning import TuningDB

    spec = load_netspec(net_file)
    with tempfile.TemporaryDirectory() as tmp:
        # as `pcldnn-gen compile` builds it: through the tuning database unless --no-tuning
        result = build(spec, get_arch(arch_name), Path(tmp) / "b", tuning=TuningDB.load() if tuned else None,
                       precision=precision)
        tuned_kernels = sum(plan.measured is not None for plan in result.plans.values())
        net = pr.load(Path(tmp) / "b", threads=threads)
        classes = net.loss_layer.out_shape[0]
        data = pr.synthetic(batch * 4, tuple(spec.input), classes, seed=0)
        opt = pr.SGD(0.01, momentum=0.9, weight_decay=5e-4)
        opt.bind(net)
        batches = list(data.batches(batch))
        totals, kernels, optim = [], [], []
        for i in range(steps + 3):
            x, y = batches[i % len(batches)]
            ft, bt = {}, {}
            t0 = time.perf_counter()
            net.forward(x, training=True, timings=ft)
            net.backward(y, timings=bt)
            t1 = time.perf_counter()
            opt.apply(net.params, net.grads, i)
            t2 = time.perf_counter()
            if i >= 3:  # warm-up: buffers, OpenMP threads, caches
                totals.append(t2 - t0)
                kernels.append(sum(ft.values()) + sum(bt.values()))
                optim.append(t2 - t1)
    step = float(np.median(totals))
    return {"images_per_s": batch / step, "step_ms": step * 1e3, "arch": arch_name, "tuned_kernels": tuned_kernels,
            "kernels_ms": float(np.median(kernels)) * 1e3, "optimizer_ms": float(np.median(optim)) * 1e3}


def graph_module(spec, nn):
    """The net description as a PyTorch module: each layer's module (pcldnn_gen.torch_frontend's
    table, the rows from_torch reads, then its fused activation) under its name, run in file order
    on the outputs of the layers it reads (chains and graphs alike: residual adds, products,
    concats, batchnorm, depthwise convolutions, global average pooling)."""
    import dataclasses

    import torch

    from pcldnn_gen.torch_frontend import torch_module

    class Graph(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = spec.layers
            self.m = nn.ModuleDict()
            for l in spec.layers:
                parts = [torch_module(l)]
                if l.act is not None and l.type != l.activation:  # a fused activation, applied after the layer
                    parts.append(torch_module(dataclasses.replace(l, type=l.activation)))
                parts = [p for p in parts if p is not None]
                if parts:
                    self.m[l.name] = parts[0] if len(parts) == 1 else nn.Sequential(*parts)

        def forward(self, x):
            out = {"input": x}
            for l in self.layers:
                if l.type == "softmax_cross_entropy":
                    break
                ins = [out[n] for n in l.inputs]
                if l.type == "add":
                    y = ins[0]
                    for t in ins[1:]:
                        y = y + t
                elif l.type == "mul":
                    y = ins[0] * ins[1]
                elif l.type == "concat":
                    y = torch.cat(ins, dim=1)
                else:
                    y = torch.flatten(ins[0], 1) if l.type == "fc" else ins[0]
                if l.name in self.m:
                    y = self.m[l.name](y)
                out[l.name] = y
            return y

    return Graph()


def torch_child(req: dict) -> dict:
    import torch
    from torch import nn

    from pcldnn_gen.netspec import load_netspec
    torch.set_num_threads(req["threads"])
    spec = load_netspec(req["net"])
    model = graph_module(spec, nn)
    fmt = torch.channels_last if req["layout"] == "channels_last" else torch.contiguous_format
    dtype = torch.bfloat16 if req.get("dtype") == "bf16" else torch.float32  # "autocast": fp32 model
    model = model.to(memory_format=fmt, dtype=dtype)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=5e-4)
    loss_fn = nn.CrossEntropyLoss()
    b = req["batch"]
    x = torch.randn(b, *spec.input, dtype=dtype).contiguous(memory_format=fmt)
    y = torch.randint(0, spec.layers[-2].out_shape[0], (b,))
    times = []
    for i in range(req["steps"] + 3):
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=req.get("dtype") == "autocast"):
            loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        if i >= 3:
            times.append(time.perf_counter() - t0)
    step = float(np.median(times))
    return {"images_per_s": b / step, "step_ms": step * 1e3}


def pytorch(net_file: str, batch: int, threads: int, steps: int, isa: str | None, layout: str,
            dtype: str = "fp32") -> dict | None:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    env.pop("ONEDNN_MAX_CPU_ISA", None)
    if isa:
        env["ONEDNN_MAX_CPU_ISA"] = isa
    req = {"net": net_file, "batch": batch, "threads": threads, "steps": steps, "layout": layout, "dtype": dtype}
    proc = subprocess.run([sys.executable, __file__, "--child", json.dumps(req)], env=env,
                          capture_output=True, text=True)
    if proc.returncode:
        print(f"pytorch ({isa or 'default'}, {layout}, {dtype}) failed: {proc.stderr.strip().splitlines()[-1:]}", file=sys.stderr)
        return None
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    ap.add_argument("--net", default=str(REPO / "examples" / "nets" / "cifar_small.json"))
    ap.add_argument("--arch", default="native")
    ap.add_argument("--no-tuning", action="store_true", help="the model's tiles only (ignore the tuning database)")
    ap.add_argument("--precision", default="fp32", choices=("fp32", "bf16"))
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--json", default=None)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(torch_child(json.loads(args.child))))
        return
    rows = []
    for threads in [int(t) for t in args.threads.split(",")]:
        mine = ours(args.net, args.arch, args.batch, threads, args.steps, not args.no_tuning, args.precision)
        row = {"threads": threads, "ours": mine}
        settings = ([("AVX2", "avx2", "fp32"), (None, "default", "fp32")] if args.precision == "fp32" else
                    [(None, "default", "autocast"), (None, "default", "bf16")])
        best: dict[str, float] = {}  # by label: the fastest PyTorch setting
        for isa, label, dtype in settings:
            for layout in ("nchw", "channels_last"):
                r = pytorch(args.net, args.batch, threads, args.steps, isa, layout, dtype)
                if r:
                    row[f"torch_{label}_{dtype}_{layout}" if args.precision == "bf16" else f"torch_{label}_{layout}"] = r
                    best[label] = max(best.get(label, 0.0), r["images_per_s"])
        labels = sorted({label for _, label, _ in settings})
        for label in labels:
            row[f"ratio_vs_torch_{label}"] = mine["images_per_s"] / best[label] if label in best else None
        rows.append(row)
        rest = mine["step_ms"] - mine["kernels_ms"] - mine["optimizer_ms"]
        print(f"{threads} thread(s): ours ({args.arch}, {mine['tuned_kernels']} tuned kernels) "
              f"{mine['images_per_s']:.0f} images/s (step {mine['step_ms']:.1f} ms = "
              f"kernels {mine['kernels_ms']:.1f} + optimizer {mine['optimizer_ms']:.1f} + rest {rest:.1f})")
        for key in sorted(k for k in row if k.startswith("torch_")):
            print(f"    {key:28s} {row[key]['images_per_s']:7.0f} images/s")
        for label in labels:
            ratio = row[f"ratio_vs_torch_{label}"]
            print(f"    x PyTorch {label:8s} (better layout): {ratio:.2f}" if ratio else f"    x PyTorch {label}: n/a")
    if args.json:
        net = os.path.relpath(args.net, REPO)
        Path(args.json).write_text(json.dumps({"net": net, "batch": args.batch, "precision": args.precision,
                                               "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
