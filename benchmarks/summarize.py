"""Summarise `pcldnn-gen bench --json` files against the targets of issue 4.

    python benchmarks/summarize.py benchmarks/results/vgg_a_1t.json [more.json ...]
    python benchmarks/summarize.py --markdown benchmarks/results/vgg_a_1t.json   # the table for RESULTS.md

Per file and pass: median and worst % of peak and x oneDNN over the mid/deep conv layers
(every conv layer but the first), the first layer's x oneDNN, and for fc layers % of peak and
x numpy. With a 1-thread and a 2-thread file of the same net: the 2t/1t time ratios.
"""
from __future__ import annotations

import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path


def summarize(path: Path) -> dict:
    d = json.loads(path.read_text())
    rows = d["results"]
    conv = [r for r in rows if r["layer"].startswith("conv")]
    first = min((r["layer"] for r in conv), key=lambda n: int(n[4:]), default=None)
    out = {"net": d["net"], "threads": d["threads"], "batch": d["batch"], "peak": d["peak_gflops"], "passes": {}}
    for p in ("fwd", "bwd_data", "bwd_weights"):
        mid = [r for r in conv if r["pass_name"] == p and r["layer"] != first]
        fc = [r for r in rows if r["pass_name"] == p and r["layer"].startswith("fc")]
        s = {}
        if mid:
            eff = [r["peak_fraction"] for r in mid]
            s["conv_peak"] = (statistics.median(eff), min(eff))
            one = [r["vs_onednn"] for r in mid if r.get("vs_onednn")]
            if one:
                s["conv_onednn"] = (statistics.median(one), min(one))
            firsts = [r for r in conv if r["pass_name"] == p and r["layer"] == first and r.get("vs_onednn")]
            if firsts:
                s["first_onednn"] = firsts[0]["vs_onednn"]
        if fc:
            s["fc"] = [(r["layer"], r["peak_fraction"], r.get("vs_numpy")) for r in fc]
        out["passes"][p] = s
    return out


def markdown(path: Path) -> str:
    d = json.loads(path.read_text())
    fmt = lambda x, spec: "-" if x is None else format(x, spec)  # noqa: E731
    lines = [f"Measured FMA peak in this run: **{d['peak_gflops']:.1f} GFLOP/s** ({d['threads']} thread(s), "
             f"minibatch {d['batch']}).", "",
             "| layer | pass | ms | GFLOP/s | % peak | × numpy | × oneDNN (kernel) | × oneDNN (PyTorch wall) |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in d["results"]:
        lines.append(f"| {r['layer']} | {r['pass_name']} | {r['ms']:.1f} | {r['gflops']:.1f} | {r['peak_fraction']:.0%} | "
                     f"{fmt(r.get('vs_numpy'), '.2f')} | {fmt(r.get('vs_onednn'), '.2f')} | "
                     f"{fmt(r.get('vs_onednn_wall'), '.2f')} |")
    return "\n".join(lines)


def main(paths: list[str]) -> None:
    if paths and paths[0] == "--markdown":
        for path in paths[1:]:
            print(markdown(Path(path)) + "\n")
        return
    by_net = defaultdict(dict)
    for path in paths:
        s = summarize(Path(path))
        by_net[(s["net"], s["batch"])][s["threads"]] = (Path(path), s)
        print(f"{path}: {s['net']}, {s['threads']} thread(s), minibatch {s['batch']}, peak {s['peak']:.1f} GFLOP/s")
        for p, v in s["passes"].items():
            parts = []
            if "conv_peak" in v:
                parts.append("conv2+ %% peak median %.0f%% worst %.0f%%" % tuple(100 * x for x in v["conv_peak"]))
            if "conv_onednn" in v:
                parts.append("x oneDNN median %.2f worst %.2f" % v["conv_onednn"])
            if "first_onednn" in v:
                parts.append("first layer x oneDNN %.2f" % v["first_onednn"])
            for layer, eff, vs in v.get("fc", []):
                parts.append(f"{layer} {eff:.0%}" + (f" x numpy {vs:.2f}" if vs else ""))
            print(f"  {p:12s} " + "; ".join(parts))
    for (net, _), runs in by_net.items():
        if 1 in runs and 2 in runs:
            one = {(r["layer"], r["pass_name"]): r["ms"] for r in json.loads(runs[1][0].read_text())["results"]}
            two = {(r["layer"], r["pass_name"]): r["ms"] for r in json.loads(runs[2][0].read_text())["results"]}
            ratios = sorted(one[k] / two[k] for k in one if k in two and k[0].startswith("conv"))
            if ratios:
                print(f"{net}: 2 threads / 1 thread over conv layers and passes: median {statistics.median(ratios):.2f}, "
                      f"range {ratios[0]:.2f}-{ratios[-1]:.2f}")


if __name__ == "__main__":
    main(sys.argv[1:])
