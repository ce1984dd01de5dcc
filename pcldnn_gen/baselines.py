"""Baseline timings, run as `python -m pcldnn_gen.baselines REQUEST.json RESULT.json` in a
subprocess whose environment pins the ISA and threads (see bench.run_baselines).

numpy: im2col + BLAS for conv, plain GEMMs for fc (whole pass, Python included).
onednn: PyTorch's CPU convolution, which calls oneDNN; ONEDNN_VERBOSE=profile_exec makes
oneDNN print each primitive's execution time, which we read back per pass, so the ratio
compares kernels with kernels; the PyTorch call's wall time (with layout reorders) is kept too.
An fc layer runs through oneDNN's inner-product primitives (brgemm matmul kernels), reached by
PyTorch's mkldnn ops on oneDNN tensors: PyTorch's own fp32 `linear` calls MKL's sgemm, which
prints nothing to time, and as a 1x1 convolution of a 1x1 image oneDNN picks kernels not meant
for a GEMM (on AlexNet fc6 at minibatch 16, 1.6-2.3x slower than its inner product per pass).
"""
from __future__ import annotations

import json
import os
import re
import sys
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from .bench import median_seconds

MARK = "@@pcldnn-baseline"


def _numpy_depthwise(p: Any, batch: Any, rng: Any) -> Any:
    """A depthwise convolution in numpy: a window's taps as strided views, each a broadcast
    multiply-add over the whole minibatch."""
    c, h, w = p["in_shape"]
    (kh, kw), (sh, sw), (ph, pw) = p["kernel"], p["stride"], p["pad"]
    oh, ow = (h + 2 * ph - kh) // sh + 1, (w + 2 * pw - kw) // sw + 1
    x = np.pad(rng.standard_normal((batch, c, h, w), dtype=np.float32), ((0, 0), (0, 0), (ph, ph), (pw, pw)))
    wt = rng.standard_normal((c, kh, kw), dtype=np.float32)
    dy = rng.standard_normal((batch, c, oh, ow), dtype=np.float32)
    taps = [(i, j, np.s_[:, :, i:i + sh * (oh - 1) + 1:sh, j:j + sw * (ow - 1) + 1:sw]) for i in range(kh) for j in range(kw)]

    def fwd() -> Any:
        return sum(x[t] * wt[None, :, i, j, None, None] for i, j, t in taps)

    def bwd_data() -> Any:
        dx = np.zeros_like(x)
        for i, j, t in taps:
            dx[t] += dy * wt[None, :, i, j, None, None]
        return dx

    return {"fwd": fwd, "bwd_data": bwd_data,
            "bwd_weights": lambda: [np.einsum("nchw,nchw->c", x[t], dy) for _, _, t in taps]}


def _numpy_conv(p: Any, batch: Any, rng: Any) -> Any:
    """im2col and BLAS."""
    if p.get("groups", 1) > 1:
        return _numpy_depthwise(p, batch, rng)
    c, h, w = p["in_shape"]
    oc, (kh, kw), (sh, sw), (ph, pw) = p["out_channels"], p["kernel"], p["stride"], p["pad"]
    oh, ow = (h + 2 * ph - kh) // sh + 1, (w + 2 * pw - kw) // sw + 1
    x = rng.standard_normal((batch, c, h, w), dtype=np.float32)
    wt = rng.standard_normal((oc, c * kh * kw), dtype=np.float32)
    dy = rng.standard_normal((batch * oh * ow, oc), dtype=np.float32)

    def im2col() -> Any:
        xp = np.pad(x, ((0, 0), (0, 0), (ph, ph), (pw, pw)))
        s = xp.strides
        view = np.lib.stride_tricks.as_strided(
            xp, (batch, oh, ow, c, kh, kw), (s[0], s[2] * sh, s[3] * sw, s[1], s[2], s[3]))
        return view.reshape(batch * oh * ow, c * kh * kw)

    def col2im(cols: Any) -> Any:
        dxp = np.zeros((batch, c, h + 2 * ph, w + 2 * pw), np.float32)
        cols = cols.reshape(batch, oh, ow, c, kh, kw)
        for i in range(kh):
            for j in range(kw):
                dxp[:, :, i:i + sh * (oh - 1) + 1:sh, j:j + sw * (ow - 1) + 1:sw] += cols[:, :, :, :, i, j].transpose(0, 3, 1, 2)
        return dxp

    return {"fwd": lambda: im2col() @ wt.T,
            "bwd_data": lambda: col2im(dy @ wt),
            "bwd_weights": lambda: dy.T @ im2col()}


def _numpy_fc(p: Any, batch: Any, rng: Any) -> Any:
    k = int(np.prod(p["in_shape"]))
    x = rng.standard_normal((batch, k), dtype=np.float32)
    wt = rng.standard_normal((p["out_channels"], k), dtype=np.float32)
    dy = rng.standard_normal((batch, p["out_channels"]), dtype=np.float32)
    return {"fwd": lambda: x @ wt.T, "bwd_data": lambda: dy @ wt, "bwd_weights": lambda: dy.T @ x}


def numpy_times(req: Any) -> dict:
    rng = np.random.default_rng(0)
    out = {}
    for p in req["problems"]:
        runs = (_numpy_conv if p["type"] == "conv" else _numpy_fc)(p, req["batch"], rng)
        for pass_name in req["passes"]:
            out[f"{p['name']}/{pass_name}"] = median_seconds(runs[pass_name], req["repeats"])
    return out


def onednn_runs(req: Any) -> dict:
    """Run every conv and fc problem through PyTorch, printing a marker line before each timed call
    so the parent can attribute oneDNN's verbose lines. Returns PyTorch wall times."""
    import torch
    torch.set_num_threads(req["threads"])
    batch, wall = req["batch"], {}
    for p in req["problems"]:
        dtype = torch.bfloat16 if req.get("precision") == "bf16" else torch.float32
        runs = (_conv_runs if p["type"] == "conv" else _inner_product_runs)(torch, p, batch, dtype)
        for label, fn in runs.items():
            fn()  # warm-up: primitive creation
            times = []
            for _ in range(req["repeats"]):
                print(f"{MARK} {p['name']} {label}", flush=True)
                start = time.perf_counter()
                fn()
                times.append(time.perf_counter() - start)
            print(f"{MARK} end", flush=True)
            wall[f"{p['name']}/{label}"] = float(np.median(times))
    return wall


def _conv_runs(torch: Any, p: Any, batch: Any, dtype: Any) -> Any:
    """(fwd, bwd) calls of PyTorch's convolution (oneDNN) for a conv problem; bwd is autograd's.
    bf16 tensors are channels_last, the layout oneDNN's bf16 brgemm and AMX kernels are written
    for (VGG-A conv3 forward on AMX, one thread: 17-18 ms channels_last, 26 ms NCHW)."""
    c, h, w = p["in_shape"]
    groups = p.get("groups", 1)  # depthwise: oneDNN's depthwise kernels
    x = torch.randn(batch, c, h, w, dtype=dtype)
    wt = torch.randn(p["out_channels"], c // groups, *p["kernel"], dtype=dtype)
    if dtype == torch.bfloat16:
        x, wt = x.to(memory_format=torch.channels_last), wt.to(memory_format=torch.channels_last)
    conv = lambda inp, wgt: torch.nn.functional.conv2d(inp, wgt, stride=p["stride"], padding=p["pad"],  # noqa: E731
                                                       groups=groups)
    dy = torch.randn_like(conv(x, wt))
    xg, wg = x.clone().requires_grad_(), wt.clone().requires_grad_()

    def fwd() -> None:
        with torch.no_grad():
            conv(x, wt)

    def bwd() -> None:
        xg.grad = wg.grad = None
        conv(xg, wg).backward(dy)

    return {"fwd": fwd, "bwd": bwd}


def _inner_product_runs(torch: Any, p: Any, batch: Any, dtype: Any) -> Any:
    """(fwd, bwd) calls of oneDNN's inner product for an fc problem, on oneDNN tensors; bf16:
    the three matmuls of PyTorch's bf16 `linear` and its autograd (oneDNN's brgemm matmul;
    PyTorch's oneDNN fc backward refuses bf16 weights), one region each."""
    k = int(np.prod(p["in_shape"]))
    x, wt, dy = (torch.randn(batch, k, dtype=dtype), torch.randn(p["out_channels"], k, dtype=dtype),
                 torch.randn(batch, p["out_channels"], dtype=dtype))
    if dtype == torch.bfloat16:
        dyt = dy.t()
        return {"fwd": lambda: torch.mm(x, wt.t()), "bwd_data": lambda: torch.mm(dy, wt),
                "bwd_weights": lambda: torch.mm(dyt, x)}
    xm, wm, dym = x.to_mkldnn(), wt.to_mkldnn(), dy.to_mkldnn()
    aten = torch.ops.aten

    def fwd() -> None:
        with torch.no_grad():
            torch._C._nn.mkldnn_linear(xm, wm, None)

    def bwd() -> None:
        aten.mkldnn_linear_backward_input([batch, k], dym, wt)
        aten.mkldnn_linear_backward_weights(dym, xm, wt, True)

    return {"fwd": fwd, "bwd": bwd}


_OPS = (",convolution,", ",inner_product,", ",matmul,")
_PROP = {"forward_training": "fwd", "forward_inference": "fwd", "backward_data": "bwd_data",
         "backward_weights": "bwd_weights"}
# The passes a marker's region times: autograd's backward region also runs a forward convolution
# (the graph is rebuilt each call), which must not join the forward median.
_REGION_PASSES = {"fwd": ("fwd",), "bwd": ("bwd_data", "bwd_weights"), "bwd_data": ("bwd_data",),
                  "bwd_weights": ("bwd_weights",)}


@dataclass(frozen=True)
class OnednnPass:
    seconds: float                      # median over the region's calls of the pass's primitive time
    implementations: tuple[str, ...]    # oneDNN's implementation names for the pass (e.g. brg_conv_fwd:avx2)


def parse_verbose(text: str) -> dict[str, OnednnPass]:
    """{layer/pass: OnednnPass} from marker-delimited ONEDNN_VERBOSE=profile_exec output."""
    per_call: dict[tuple[str, str], list[dict[str, float]]] = {}
    impls: dict[str, set[str]] = {}
    region: tuple[str, str] | None = None
    calls: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(MARK):
            parts = line.split()
            region = (parts[1], parts[2]) if len(parts) == 3 and parts[2] in _REGION_PASSES else None
            calls = {}
            if region:
                per_call.setdefault(region, []).append(calls)
            continue
        op = next((o.strip(",") for o in _OPS if o in line), None)
        if region is None or ",exec," not in line or op is None:
            continue
        fields = line.split(",")
        prop = next((_PROP[f] for f in fields if f in _PROP), None)
        if op == "matmul" and len(_REGION_PASSES[region[1]]) == 1:  # no propagation kind: the region's pass
            prop = _REGION_PASSES[region[1]][0]
        if prop is None or prop not in _REGION_PASSES[region[1]]:
            continue
        calls[prop] = calls.get(prop, 0.0) + float(fields[-1]) / 1e3
        impls.setdefault(f"{region[0]}/{prop}", set()).add(fields[fields.index(op) + 1])
    out: dict[str, OnednnPass] = {}
    for (layer, label), calls_list in per_call.items():
        for prop in _REGION_PASSES[label]:
            values = [c[prop] for c in calls_list if prop in c]
            if values:
                key = f"{layer}/{prop}"
                out[key] = OnednnPass(float(np.median(values)), tuple(sorted(impls[key])))
    return out


def verbose_isa(text: str) -> str | None:
    """The ISA oneDNN reports it dispatches to (its `info,cpu,isa:` line), if printed."""
    found = re.search(r"info,cpu,isa:([^\n]*)", text)
    return found.group(1).strip() if found else None


# Implementation ISAs above each of our ISAs: oneDNN running one of these would compare its
# wider vectors with our narrower ones.
# "amx": a bf16 build for an arch with AMX, compared with oneDNN's AMX kernels.
_ABOVE = {"avx2": ("avx512", "amx", "avx10"), "avx512": ("amx",), "scalar": (), "amx": ()}


def check_isa(arch_isa: str, implementations: tuple[str, ...]) -> None:
    """Refuse a comparison in which oneDNN used a wider ISA than the one we generated for."""
    for impl in implementations:
        if any(word in impl.lower() for word in _ABOVE.get(arch_isa, ())):
            raise ValueError(f"oneDNN ran implementation {impl} under --arch {arch_isa}: not a comparison on the "
                             f"same ISA (is ONEDNN_MAX_CPU_ISA honoured by this PyTorch build?)")


def main(argv: list[str]) -> int:
    request, result = argv
    with open(request) as f:
        req = json.load(f)
    out: dict[str, dict] = {}
    if "numpy" in req["compare"]:
        for key, t in numpy_times(req).items():
            out.setdefault(key, {})["numpy"] = t
    if "onednn" in req["compare"]:
        import subprocess
        env = dict(os.environ, ONEDNN_VERBOSE="profile_exec")
        proc = subprocess.run([sys.executable, "-c", "import json, sys; from pcldnn_gen.baselines import onednn_runs; "
                               "print('@@wall ' + json.dumps(onednn_runs(json.load(open(sys.argv[1])))))", request],
                              env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            sys.stderr.write(proc.stderr)
            return 1
        marker = re.search(r"^@@wall (.*)$", proc.stdout, re.M)
        if marker is None:
            sys.stderr.write(f"oneDNN baseline printed no timings:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
            return 1
        wall = json.loads(marker.group(1))
        isa = verbose_isa(proc.stdout)
        for key, timing in parse_verbose(proc.stdout).items():
            try:
                check_isa(req["isa"], timing.implementations)
            except ValueError as e:
                sys.stderr.write(f"{key}: {e}\n")
                return 1
            out.setdefault(key, {}).update(onednn=timing.seconds, onednn_impl=" ".join(timing.implementations),
                                           onednn_isa=isa)
        for key, t in wall.items():
            _layer, label = key.split("/")
            if label == "fwd":
                out.setdefault(key, {})["onednn_wall"] = t
    with open(result, "w") as f:
        json.dump(out, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
