"""Summarise `pcldnn-gen bench --json` files against the kernel targets (issue 4).

    python benchmarks/summarize.py benchmarks/results/vgg_a_1t.json benchmarks/results/vgg_a_2t.json
    python benchmarks/summarize.py --markdown benchmarks/results/vgg_a_1t.json ...   # RESULTS.md's tables
    python benchmarks/summarize.py vgg_a_bf16.json vgg_a_fp32.json overfeat_fast_bf16.json ...  # issue 18's figures

Files are grouped by (net, minibatch, threads); within a group every (layer, pass) row comes from
exactly one file, so a run of a few layers can sit beside the full run of other layers, and two
files timing the same layer are refused (name the one you mean) instead of one silently
replacing the other. Per group and pass: median and worst % of peak and x oneDNN over the
mid/deep conv layers (every conv layer but the first), the first conv layer's x oneDNN, and for
fc layers % of peak and x numpy; with 1- and 2-thread groups of the same net and minibatch, the
2t/1t time ratios over matching conv rows. --markdown prints each group's figures against the
targets and its per-layer table. bf16 runs (`bench --precision bf16`) are groups of their own;
beside fp32 runs of the same layers they add the bf16 figures: fp32 time / bf16 time and x oneDNN
bf16 over every conv row benched, pooled over the nets, and the fc rows x oneDNN.
"""
from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from pcldnn_runtime.manifest import PASSES

# Targets of the kernels' issue: (median at least, none below) for conv % of peak per pass.
CONV_PEAK_TARGET = {"fwd": (0.90, 0.80), "bwd_data": (0.90, 0.80), "bwd_weights": (0.85, 0.80)}
ONEDNN_TARGET = (1.0, 0.9)       # x oneDNN over mid/deep conv layers: median at least, none below
ZOO_ONEDNN_TARGET = (1.0, 0.8)   # x oneDNN over a zoo's shapes (conv and fc), every pass
FIRST_LAYER_TARGET = 2.0         # first conv layer x oneDNN, every pass
THREADS_TARGET = 1.85            # 2 threads / 1 thread, median over conv rows
FC_PEAK_TARGET = 0.80            # every fc row
FC_NUMPY_TARGET = 1.0            # every fc row, x numpy (OpenBLAS)
# bf16 builds (issue 18), over the conv rows benched (the issue names VGG-A conv2-8 and
# OverFeat-FAST conv2-5: `bench --layers`), pooled over the nets of a (ISA, minibatch,
# threads): median fp32 time / bf16 time, median x oneDNN's bf16 kernel; fc rows each x
# oneDNN's bf16 matmul.
BF16_SPEEDUP_TARGET = 1.7
BF16_ONEDNN_TARGET = 1.0
BF16_FC_ONEDNN_TARGET = 1.0


@dataclass
class Group:
    """The rows of one (net, ISA, minibatch, threads, precision), possibly from several files."""
    net: str
    isa: str
    batch: int
    threads: int
    precision: str = "fp32"
    rows: dict[tuple[str, str], dict] = field(default_factory=dict)   # (layer, pass) -> row, in file order
    source: dict[tuple[str, str], Path] = field(default_factory=dict)
    peaks: dict[Path, float] = field(default_factory=dict)
    zoo: bool = False           # independent shapes (bench --zoo): no first layer to set apart

    @property
    def title(self) -> str:
        bf16 = "" if self.precision == "fp32" else f", {self.precision} build"
        return f"{self.net}, {self.isa}{bf16}, minibatch {self.batch}, {self.threads} thread(s)"


def _layer_type(row: dict) -> str:
    """The row's layer type: recorded by newer bench files, else read from the name."""
    name = row["layer"]
    return row.get("layer_type") or ("conv" if name.startswith("conv") else "fc" if name.startswith("fc") else "?")


BF16_TITLE = " (bf16 build"  # how bench files before the "precision" key marked a bf16 run, in the net's title


def load(paths: list[Path]) -> list[Group]:
    groups: dict[tuple[str, str, int, int, str], Group] = {}
    for path in paths:
        d = json.loads(path.read_text())
        isa, net = d["arch"]["isa"], d["net"]
        precision = d.get("precision") or ("bf16" if BF16_TITLE in net else "fp32")
        net = net.split(BF16_TITLE)[0]
        g = groups.setdefault((net, isa, d["batch"], d["threads"], precision),
                              Group(net, isa, d["batch"], d["threads"], precision, zoo=bool(d.get("zoo"))))
        g.peaks[path] = d["peak_gflops"]
        for row in d["results"]:
            key = (row["layer"], row["pass_name"])
            if key in g.rows:
                raise SystemExit(f"{path}: {g.title}: {key[0]} {key[1]} is also in {g.source[key]}; "
                                 "pass one run per layer and pass")
            g.rows[key], g.source[key] = row, path
    return list(groups.values())


@dataclass(frozen=True)
class Spread:
    median: float
    worst: float
    worst_layer: str


def _spread(rows: list[dict], key: str, lowest: bool = True) -> Spread | None:
    values = [(r[key], r["layer"]) for r in rows if r.get(key)]
    if not values:
        return None
    worst = min(values) if lowest else max(values)
    return Spread(statistics.median(v for v, _ in values), worst[0], worst[1])


def pass_figures(g: Group, p: str) -> dict:
    """The figures of one pass: mid/deep conv spreads, the first conv layer's x oneDNN, fc rows."""
    rows = [r for (_, q), r in g.rows.items() if q == p]
    conv = [r for r in rows if _layer_type(r) == "conv"]
    first = None if g.zoo else next((r["layer"] for r in g.rows.values() if _layer_type(r) == "conv"), None)
    mid = [r for r in conv if r["layer"] != first]
    first_row = next((r for r in conv if r["layer"] == first), None)
    return {"conv_peak": _spread(mid, "peak_fraction"), "conv_onednn": _spread(mid, "vs_onednn"),
            "first_layer": first, "first_onednn": first_row.get("vs_onednn") if first_row else None,
            "fc": [r for r in rows if _layer_type(r) == "fc"]}


@dataclass(frozen=True)
class Bf16Figures:
    """One pass of the bf16 builds of a (ISA, minibatch, threads), against their fp32 builds:
    every conv row the files hold (the layers benched), fc rows apart."""
    speedup: Spread | None          # fp32 ms / bf16 ms
    onednn: Spread | None           # the bf16 rows' x oneDNN
    fc_onednn: Spread | None
    impls: tuple[str, ...]          # oneDNN's implementations on the bf16 rows


def bf16_figures(groups: list[Group]) -> dict[tuple[str, int, int], dict[str, Bf16Figures]]:
    """{(isa, batch, threads): {pass: figures}} over every bf16 group, its conv rows matched to
    the fp32 group of the same net, ISA, minibatch and threads (rows without a match count for
    x oneDNN only), pooled over nets. Zoo groups stay out: their shapes (first layers among them)
    are judged by the zoo's own target, and pooled with the nets they would move the medians the
    issue's layers are judged by."""
    fp32 = {(g.net, g.isa, g.batch, g.threads): g for g in groups if g.precision == "fp32"}
    pooled: dict[tuple[str, int, int], dict[str, tuple[list, list, list]]] = {}
    for g in (g for g in groups if g.precision == "bf16" and not g.zoo):
        other = fp32.get((g.net, g.isa, g.batch, g.threads))
        for p in PASSES:
            conv = [r for r in g.rows.values() if r["pass_name"] == p and _layer_type(r) == "conv"]
            fc = [r for r in g.rows.values() if r["pass_name"] == p and _layer_type(r) == "fc"]
            speed, vs, fcs = pooled.setdefault((g.isa, g.batch, g.threads), {}).setdefault(p, ([], [], []))
            speed += [{"layer": f"{g.net} {r['layer']}", "x": other.rows[(r["layer"], p)]["ms"] / r["ms"]}
                      for r in conv if other and (r["layer"], p) in other.rows]
            vs += [{**r, "layer": f"{g.net} {r['layer']}"} for r in conv]
            fcs += [{**r, "layer": f"{g.net} {r['layer']}"} for r in fc]
    return {key: {p: Bf16Figures(_spread(speed, "x"), _spread(vs, "vs_onednn"), _spread(fc, "vs_onednn"),
                                 tuple(sorted({i for r in vs + fc for i in (r.get("onednn_impl") or "").split()})))
                  for p, (speed, vs, fc) in passes.items()}
            for key, passes in pooled.items()}


def bf16_markdown(groups: list[Group]) -> list[str]:
    out = []
    for (isa, batch, threads), passes in bf16_figures(groups).items():
        out += [f"### bf16 against fp32 and oneDNN bf16, {isa}, minibatch {batch}, {threads} thread(s)", "",
                "| figure | target | measured | met |", "|---|---|---|---|"]
        for p, f in passes.items():
            for what, s, target in ((f"{p} fp32 time / bf16 time, conv", f.speedup,
                                     BF16_SPEEDUP_TARGET),
                                    (f"{p} × oneDNN bf16, conv", f.onednn, BF16_ONEDNN_TARGET)):
                if s:
                    out.append(f"| {what} | median ≥ {target} | median {_x(s.median)}, worst {_x(s.worst)} "
                               f"({s.worst_layer}) | {_met(s.median >= target)} |")
            if f.fc_onednn:
                s = f.fc_onednn
                out.append(f"| {p} × oneDNN bf16 matmul, fc | each ≥ {BF16_FC_ONEDNN_TARGET} | median {_x(s.median)}, "
                           f"worst {_x(s.worst)} ({s.worst_layer}) | {_met(s.worst >= BF16_FC_ONEDNN_TARGET)} |")
        impls = sorted({i for f in passes.values() for i in f.impls})
        out += ["", f"oneDNN: {', '.join(impls) or 'not compared'}.", ""]
    return out


def thread_ratios(groups: list[Group]) -> dict[tuple[str, str, int], list[float]]:
    """{(net, isa, batch): sorted 1-thread / 2-thread time ratios over the conv rows both groups have
    (fp32 runs)}."""
    out = {}
    by_key = {(g.net, g.isa, g.batch, g.threads): g for g in groups if g.precision == "fp32"}
    for (net, isa, batch, threads), one in by_key.items():
        two = by_key.get((net, isa, batch, 2))
        if threads == 1 and two is not None:
            ratios = sorted(r["ms"] / two.rows[k]["ms"] for k, r in one.rows.items()
                            if k in two.rows and _layer_type(r) == "conv")
            if ratios:
                out[(net, isa, batch)] = ratios
    return out


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"


def _x(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def _met(ok: bool | None) -> str:
    return "-" if ok is None else ("yes" if ok else "**no**")


def _conv_rows(g: Group) -> str:
    return "conv shapes" if g.zoo else "conv after the first"


def targets_markdown(g: Group, ratios: list[float] | None) -> list[str]:
    lines = ["| figure | target | measured | met |", "|---|---|---|---|"]
    conv_rows = _conv_rows(g)
    one_med, one_floor = ZOO_ONEDNN_TARGET if g.zoo else ONEDNN_TARGET
    for p in PASSES:
        f = pass_figures(g, p)
        s, (med, floor) = f["conv_peak"], CONV_PEAK_TARGET[p]
        if s and not g.zoo:  # the % of peak targets are the paper nets'; a zoo is judged against oneDNN
            lines.append(f"| {p} % peak, {conv_rows} | median ≥ {med:.0%}, none < {floor:.0%} | "
                         f"median {_pct(s.median)}, worst {_pct(s.worst)} ({s.worst_layer}) | "
                         f"{_met(s.median >= med and s.worst >= floor)} |")
        s = f["conv_onednn"]
        if s:
            lines.append(f"| {p} × oneDNN, {conv_rows} | median ≥ {one_med:.1f}, none < "
                         f"{one_floor} | median {_x(s.median)}, worst {_x(s.worst)} ({s.worst_layer}) | "
                         f"{_met(s.median >= one_med and s.worst >= one_floor)} |")
        if f["first_onednn"] is not None:
            lines.append(f"| {p} × oneDNN, first layer ({f['first_layer']}) | ≥ {FIRST_LAYER_TARGET:.0f} | "
                         f"{_x(f['first_onednn'])} | {_met(f['first_onednn'] >= FIRST_LAYER_TARGET)} |")
        fc = f["fc"]
        fc_onednn = _spread(fc, "vs_onednn")
        if fc_onednn and g.zoo:  # oneDNN's inner product (brgemm matmul)
            lines.append(f"| {p} × oneDNN, fc shapes | median ≥ {one_med:.1f}, none < {one_floor} | median "
                         f"{_x(fc_onednn.median)}, worst {_x(fc_onednn.worst)} ({fc_onednn.worst_layer}) | "
                         f"{_met(fc_onednn.median >= one_med and fc_onednn.worst >= one_floor)} |")
        if fc and not g.zoo:  # the fc targets are for the paper nets' fc6-fc8 at minibatch 64 and 256
            peaks = [r["peak_fraction"] for r in fc]
            lines.append(f"| {p} % peak, fc | each ≥ {FC_PEAK_TARGET:.0%} | {_pct(min(peaks))}-{_pct(max(peaks))} | "
                         f"{_met(min(peaks) >= FC_PEAK_TARGET)} |")
            vs = [r["vs_numpy"] for r in fc if r.get("vs_numpy")]
            if vs:
                lines.append(f"| {p} × numpy (OpenBLAS), fc | each ≥ {FC_NUMPY_TARGET:.1f} | {_x(min(vs))}-{_x(max(vs))} | "
                             f"{_met(min(vs) >= FC_NUMPY_TARGET)} |")
    if ratios:
        lines.append(f"| 2 threads / 1 thread, conv rows | median ≥ {THREADS_TARGET} | median "
                     f"{_x(statistics.median(ratios))} ({_x(ratios[0])}-{_x(ratios[-1])}) | "
                     f"{_met(statistics.median(ratios) >= THREADS_TARGET)} |")
    return lines


def table_markdown(g: Group) -> list[str]:
    lines = ["| layer | pass | ms | GFLOP/s | % peak | × numpy | × oneDNN (kernel) | × oneDNN (PyTorch wall) | oneDNN impl |",
             "|---|---|---:|---:|---:|---:|---:|---:|---|"]
    for r in g.rows.values():
        lines.append(f"| {r['layer']} | {r['pass_name']} | {r['ms']:.2f} | {r['gflops']:.1f} | {_pct(r['peak_fraction'])} | "
                     f"{_x(r.get('vs_numpy'))} | {_x(r.get('vs_onednn'))} | {_x(r.get('vs_onednn_wall'))} | "
                     f"{r.get('onednn_impl') or '-'} |")
    return lines


def markdown(groups: list[Group]) -> str:
    ratios = thread_ratios(groups)
    out = []
    for g in groups:
        files = ", ".join(f"`{p.name}` (peak {peak:.1f} GFLOP/s)" for p, peak in g.peaks.items())
        out += [f"### {g.title}", "", f"From {files}.", ""]
        if g.precision == "fp32":  # a bf16 group is judged by bf16_markdown, against its fp32 runs
            out += targets_markdown(g, ratios.get((g.net, g.isa, g.batch)) if g.threads == 1 else None) + [""]
        out += table_markdown(g) + [""]
    return "\n".join(out + bf16_markdown(groups))


def text(groups: list[Group]) -> str:
    out = []
    for g in groups:
        peaks = ", ".join(f"{peak:.1f}" for peak in g.peaks.values())
        out.append(f"{g.title} ({len(g.peaks)} file(s), peak {peaks} GFLOP/s)")
        conv_rows = _conv_rows(g)
        for p in PASSES:
            f, parts = pass_figures(g, p), []
            if f["conv_peak"]:
                parts.append(f"{conv_rows} % peak median {_pct(f['conv_peak'].median)} worst "
                             f"{_pct(f['conv_peak'].worst)} ({f['conv_peak'].worst_layer})")
            if f["conv_onednn"]:
                parts.append(f"x oneDNN median {_x(f['conv_onednn'].median)} worst {_x(f['conv_onednn'].worst)}")
            if f["first_onednn"] is not None:
                parts.append(f"{f['first_layer']} x oneDNN {_x(f['first_onednn'])}")
            for r in f["fc"]:
                parts.append(f"{r['layer']} {_pct(r['peak_fraction'])}" +
                             (f" x numpy {_x(r['vs_numpy'])}" if r.get("vs_numpy") else ""))
            if parts:
                out.append(f"  {p:12s} " + "; ".join(parts))
    for (isa, batch, threads), passes in bf16_figures(groups).items():
        out.append(f"bf16 builds, {isa}, minibatch {batch}, {threads} thread(s), the conv rows benched, pooled over nets:")
        for p, f in passes.items():
            parts = [f"{what} median {_x(s.median)} worst {_x(s.worst)} ({s.worst_layer})"
                     for what, s in (("fp32/bf16 time", f.speedup), ("x oneDNN bf16", f.onednn),
                                     ("fc x oneDNN bf16", f.fc_onednn)) if s]
            out.append(f"  {p:12s} " + "; ".join(parts))
    for (net, isa, batch), r in thread_ratios(groups).items():
        out.append(f"{net}, {isa}, minibatch {batch}: 2 threads / 1 thread over conv rows: median {statistics.median(r):.2f}, "
                   f"range {r[0]:.2f}-{r[-1]:.2f}")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--markdown", action="store_true", help="targets and per-layer tables for RESULTS.md")
    parser.add_argument("files", nargs="+", type=Path)
    args = parser.parse_args(argv)
    groups = load(args.files)
    print(markdown(groups) if args.markdown else text(groups))


if __name__ == "__main__":
    main()
