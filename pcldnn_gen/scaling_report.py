"""`pcldnn-gen plan`: the communication model (pcldnn_runtime.scaling) over a range of node
counts, as a table, JSON and plots; and the `local` machine, measured on the spot."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from pcldnn_runtime import launcher, scaling
from pcldnn_runtime.validate import read_json

from .arch import get_arch
from .errors import PcldnnError
from .netspec import NetSpec
from .planner import PASSES, plan_layer
from .planner.parallel import parallel_loop

MAX_NODES = 16384  # the event simulation replays every node


def parse_nodes(text: str) -> list[int]:
    try:
        nodes = [int(n) for n in text.split(",") if n.strip() and len(n.strip()) <= 12]
    except ValueError:
        raise PcldnnError(f"--nodes: {text[:60]!r}: use comma-separated node counts like 1,2,4,8") from None
    if not nodes or len(nodes) > 64 or any(not 1 <= n <= MAX_NODES for n in nodes):
        raise PcldnnError(f"--nodes: {text[:60]!r}: node counts must be positive, at most {MAX_NODES}, "
                           "and at most 64 of them")
    return sorted(set(nodes))


def local_machine(spec: NetSpec, arch_name: str, batches: list[int], bench_json: str | None = None,
                  threads: int = 1) -> scaling.Machine:
    """This machine as nodes of one MPI rank with `threads` threads each: the FMA peak of that
    many threads (generated kernel); the kernels' efficiency against the per-node minibatch,
    measured now on this net at `batches` (or read from a `pcldnn-gen bench NET --batch ...
    --json` file of it); alpha / beta / gamma / memory bandwidth from an MPI probe between two
    ranks. The measured curve holds the thread division already: no loop model on top."""
    from pcldnn_runtime import cpu

    from .bench import bench_curve, measure_peak
    arch = get_arch(arch_name)
    cores = cpu.usable_cores()
    if threads > cores:
        raise PcldnnError(f"--threads {threads}: this machine has {cores} usable core(s)")
    if bench_json:
        curve = _bench_curve(Path(bench_json), spec)
        peak = measure_peak(arch, threads)
        where = f"efficiencies from {bench_json}"
    else:
        peak, rows = bench_curve(spec, arch, batches, threads, repeats=3)
        curve = efficiency_curve([r for batch_rows in rows.values() for r in batch_rows], spec, peak)
        where = f"efficiencies measured now at minibatch {', '.join(map(str, batches))}"
    mpiexec = launcher.mpiexec()
    if mpiexec is None:
        raise PcldnnError("--machine local needs mpiexec (the mpich wheel provides one) for the network probe")
    proc = subprocess.run([mpiexec, "-n", "2", sys.executable, "-m", "pcldnn_gen.network_probe"],
                          capture_output=True, text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    if proc.returncode:
        raise PcldnnError(f"network probe failed (mpiexec -n 2 python -m pcldnn_gen.network_probe): {proc.stderr.strip()}")
    net = json.loads(proc.stdout.strip().splitlines()[-1])
    # The constant figure per kind (outside the curve: its largest minibatch); kinds the net has
    # no layer of are never used, any value in range will do.
    flat = {kind: points[-1][1] for kind, points in curve.items()}
    return scaling.Machine(
        "local", f"one rank x {threads} thread(s) of this {cores}-core machine ({arch.name}), ranks over shared memory",
        peak, {kind: flat.get(kind, 0.5) for kind in scaling.KINDS},
        net["memory_gbs"], net["latency_us"], net["bandwidth_gbs"], net["reduce_gbs"], "rhd", True,
        f"measured: pcldnn-gen peak, MPI ping-pong and array sums, {where}",
        cores=threads, arch="", step_cv=scaling.STEP_CV, efficiency_curve=curve)


def efficiency_curve(rows: Any, spec: NetSpec, peak: float) -> dict[str, tuple[tuple[int, float], ...]]:
    """Per kernel kind, ((minibatch, efficiency), ...): the net's FLOPs of that kind over the
    time its kernels took, against `peak` (FLOP-weighted, so the model's per-kind figure
    reproduces the net's measured time of that kind)."""
    types = {layer.name: layer.type for layer in spec.layers}
    flops: dict[tuple[str, int], float] = {}
    seconds: dict[tuple[str, int], float] = {}
    for r in rows:
        key = (f"{types[r.layer]}_{r.pass_name}", r.batch)
        flops[key] = flops.get(key, 0.0) + r.gflops * r.ms * 1e6
        seconds[key] = seconds.get(key, 0.0) + r.ms * 1e-3
    curve: dict[str, list[tuple[int, float]]] = {}
    for (kind, batch), f in sorted(flops.items(), key=lambda kv: (kv[0][0], kv[0][1])):
        if kind in scaling.KINDS:
            curve.setdefault(kind, []).append((batch, min(1.0, f / seconds[(kind, batch)] / (peak * 1e9))))
    return {kind: tuple(points) for kind, points in curve.items()}


def _bench_curve(path: Path, spec: NetSpec) -> dict[str, tuple[tuple[int, float], ...]]:
    """efficiency_curve of a `pcldnn-gen bench --json` file of the net being planned (one
    minibatch or several)."""
    from .bench import PassResult
    data = read_json(path)
    try:
        if data["net"] != spec.name:
            raise PcldnnError(f"{path}: bench results of net {data['net']!r}, not {spec.name!r}")
        batch = data["batch"] if isinstance(data["batch"], int) else 0
        known = {layer.name for layer in spec.layers}
        rows = [PassResult(r["layer"], r["pass_name"], float(r["ms"]), float(r["gflops"]), float(r["peak_fraction"]),
                           batch=int(r.get("batch") or batch)) for r in data["results"]]
        if not rows or any(r.layer not in known or r.ms <= 0 or r.gflops <= 0 or r.batch < 1 for r in rows):
            raise ValueError("rows of other layers, or without times or minibatch")
        peak = float(data["peak_gflops"])
        if not peak > 0:
            raise ValueError("peak_gflops must be positive")
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise PcldnnError(f"{path}: not a `pcldnn-gen bench --json` file of {spec.name} "
                          f"({type(e).__name__}: {e})") from None
    return efficiency_curve(rows, spec, peak)


def layer_loads(spec: NetSpec, machine: scaling.Machine, gradient_exchange: str = "fp32",
                sync_batchnorm: bool = False) -> list[scaling.LayerLoad]:
    """The net's conv, fc and batchnorm layers as the model sees them (activations in the
    machine's precision; the training options of scaling.loads_of), with each conv and fc pass's
    parallel loop from the plans for the machine's CPU preset (how a node's cores share the
    work: the thread division at small per-node minibatches)."""
    loads = scaling.loads_of(spec.layers, machine.precision, gradient_exchange, sync_batchnorm)
    if not machine.arch:
        return loads
    arch = get_arch(machine.arch)
    layers = {layer.name: layer for layer in spec.layers}
    return [replace(load, loops={p: parallel_loop(layers[load.name], plan_layer(layers[load.name], p, arch))
                                 for p in PASSES}) if load.type in ("conv", "fc") else load
            for load in loads]


def epochs_label(epochs: int) -> str:
    return "epoch" if epochs == 1 else f"{epochs} epochs"


def epoch_text(seconds: float) -> str:
    """An epoch's duration as h:mm:ss (d h:mm:ss past a day)."""
    whole = round(seconds)
    days, rest = divmod(whole, 86400)
    hours, rest = divmod(rest, 3600)
    text = f"{hours:d}:{rest // 60:02d}:{rest % 60:02d}"
    return f"{days}d {text}" if days else text


def format_table(spec: NetSpec, machine: scaling.Machine, strategies: list[scaling.Strategy], simulated: list[float],
                 min_batches: list[int | None], threshold: float, epoch_images: int | None = None,
                 epochs: int = 1) -> str:
    m = machine
    lines = [f"{spec.name} on {m.name} ({m.nodes_note}): {m.precision} peak {m.peak_gflops:.0f} GFLOP/s per node, "
             f"link {m.bandwidth_gbs:.3g} GB/s, latency {m.latency_us:.3g} us, {m.algorithm} collectives, "
             f"{'overlapped' if m.overlap else 'no overlap'}; global minibatch {strategies[0].batch}",
             "",
             f"{'nodes':>6} {'img/node':>8} {'iter ms':>9} {'simulated':>9} {'images/s':>9} {'speedup':>8} "
             f"{'eff':>5} {'min img/node':>12}" + (f" {epochs_label(epochs):>11}" if epoch_images else "")
             + "  model/hybrid layers (others data parallel)"]
    for pl, sim, mb in zip(strategies, simulated, min_batches):
        split = ", ".join(f"{c.layer} {c.mode}" for c in pl.costs if c.group > 1) or "-"
        epoch = f" {epoch_text(epochs * epoch_images / pl.images_per_s):>11}" if epoch_images else ""
        lines.append(f"{pl.nodes:>6} {pl.batch / pl.nodes:>8.1f} {pl.time * 1e3:>9.1f} {sim * 1e3:>9.1f} "
                     f"{pl.images_per_s:>9.1f} {pl.speedup:>8.1f} {pl.efficiency:>5.0%} "
                     f"{(str(mb) if mb else 'none'):>12}{epoch}  {split}")
    lines.append("")
    lines.append(f"min img/node: the smallest per-node minibatch at which that many nodes still reach "
                 f"{threshold:.0%} parallel efficiency (against one node with the same global minibatch)")
    if epoch_images:
        lines.append(f"{epochs_label(epochs)}: {epochs} x {epoch_images} images at the closed form's images/s (h:mm:ss)")
    if machine.step_cv:
        lines.append(f"stragglers: per-node compute time varies by {machine.step_cv:.1%} (coefficient of variation); "
                     "an iteration waits for the slowest node")
    last = strategies[-1]
    lines.append(f"per layer at {last.nodes} nodes (ms: forward, backward, model-parallel and sync_batchnorm exchanges, "
                 f"part-reduce + part-broadcast):")
    width = max([10] + [len(c.layer) for c in last.costs])
    for c in last.costs:
        lines.append(f"  {c.layer:<{width}} {c.mode:<9} fwd {c.fwd * 1e3:8.2f}  bwd {c.bwd * 1e3:8.2f}  "
                     f"exchange {(c.mp_fwd + c.mp_bwd + 2 * c.sync) * 1e3:8.2f}  weights {c.dp * 1e3:8.2f}")
    return "\n".join(lines)


def report_json(spec: NetSpec, machine: scaling.Machine, strategies: Any, simulated: Any, min_batches: Any, threshold: Any,
                epoch_images: int | None = None) -> dict:
    return {"net": spec.name, "machine": machine.to_json(), "threshold": threshold, "epoch_images": epoch_images,
            "plans": [pl.to_json() | {"simulated_time_s": sim, "min_batch_per_node": mb}
                      | ({"epoch_s": epoch_images / pl.images_per_s} if epoch_images else {})
                      for pl, sim, mb in zip(strategies, simulated, min_batches)]}


def _pyplot() -> Any:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise PcldnnError("plots need matplotlib: pip install 'pcldnn-gen[demo]'") from None
    return plt


def plot_speedup(path: Path, spec: NetSpec, machine: scaling.Machine, strategies: list[scaling.Strategy],
                 simulated: list[float]) -> None:
    plt = _pyplot()
    nodes = [pl.nodes for pl in strategies]
    fig, ax = plt.subplots(figsize=(5.5, 4))
    ax.plot(nodes, nodes, "k:", label="linear")
    ax.plot(nodes, [pl.speedup for pl in strategies], "o-", label=f"closed form, minibatch {strategies[0].batch}")
    ax.plot(nodes, [pl.single / t for pl, t in zip(strategies, simulated)], "x--", label="simulated (link contention)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.set_xlabel("nodes")
    ax.set_ylabel("speedup over one node")
    ax.set_title(f"{spec.name} on {machine.name}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_timeline(path: Path, spec: NetSpec, machine: scaling.Machine, pl: scaling.Strategy, sim: dict) -> None:
    """Node 0's iteration: compute per layer on one row, communication on the other."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(10, 3))
    rows = {"compute": 1, "comm": 0}
    for name, kind, start, end in sim["events"]:
        colour = "tab:blue" if name.startswith("fwd") else "tab:orange" if name.startswith("bwd") else (
            "tab:red" if name.startswith("model") else "tab:green")
        ax.broken_barh([(start * 1e3, (end - start) * 1e3)], (rows[kind] - 0.4, 0.8), facecolors=colour,
                       edgecolor="white", linewidth=0.5)
        if (end - start) > 0.03 * sim["time"]:
            ax.text((start + end) / 2 * 1e3, rows[kind], name.split()[-1], ha="center", va="center", fontsize=6)
    ax.set_yticks([0, 1], ["network", "compute"])
    ax.set_xlabel("ms")
    ax.set_title(f"{spec.name} on {pl.nodes} {machine.name} nodes, minibatch {pl.batch}: one iteration, node 0 "
                 "(blue forward, orange backward, red model-parallel exchanges, green part-reduce/broadcast)",
                 fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(spec: NetSpec, machine: scaling.Machine, nodes: list[int], batch: int, threshold: float = 0.8,
        gradient_exchange: str = "fp32", sync_batchnorm: bool = False) -> Any:
    """(strategies, simulated times, per-node minibatch minima, simulation of the largest count)."""
    if batch < 1:
        raise PcldnnError(f"--batch must be positive, got {batch}")
    if batch < max(nodes):
        raise PcldnnError(f"--batch {batch} is smaller than {max(nodes)} nodes: a node would get no images")
    if not 0 < threshold <= 1:
        raise PcldnnError(f"--threshold must be in (0, 1], got {threshold}")
    loads = layer_loads(spec, machine, gradient_exchange, sync_batchnorm)
    if not loads:
        raise PcldnnError(f"net {spec.name} has no conv or fc layer to plan")
    strategies = [scaling.best_strategy(loads, p, batch, machine) for p in nodes]
    sims = [scaling.simulate(pl.costs, pl.nodes, machine.overlap) for pl in strategies]  # node 0's events
    times = [scaling.simulate_stragglers(pl.costs, pl.nodes, machine, draws=16 if pl.nodes <= 1024 else 4)
             for pl in strategies]
    minima = [scaling.min_batch_per_node(loads, p, machine, threshold) for p in nodes]
    return strategies, times, minima, sims


