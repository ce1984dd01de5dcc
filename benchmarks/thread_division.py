"""The scaling model's thread division against this machine: each weighted kernel of a net at
small minibatches on 1 and on 2 threads, timed interleaved, against the model's prediction
from the kernel's parallel loop (pcldnn_gen.planner.parallel).

    python benchmarks/thread_division.py [--net benchmarks/nets/vgg_a_64.json] [--batch 1,2,4,8]
        [--arch native] [--rounds 5] [--json out.json]

Measured: the 1-thread time over the 2-thread time of the same kernel call (median over rounds
of the ratio, the two timed back to back in each round, so a slow spell of this shared VM hits
both). Predicted: the 2-thread FMA peak over the 1-thread one (measured alternately in the same
run) x division_efficiency(the loop's items at that minibatch, 2). A call small enough to run
on one thread anyway (Layer.team) is predicted at 1. On a machine whose two vCPUs share one
core's FMA units the peak ratio is about 1 and the prediction with it; say which machine a
figure comes from.
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import pcldnn_runtime as pr
from pcldnn_gen.arch import get_arch
from pcldnn_gen.bench import kernel_timers, measure_peak, median_kernel_seconds
from pcldnn_gen.build import build
from pcldnn_gen.netspec import load_netspec
from pcldnn_gen.planner import plan_layer
from pcldnn_gen.planner.parallel import parallel_loop
from pcldnn_runtime import scaling

REPO = Path(__file__).resolve().parent.parent
PASSES = ("fwd", "bwd_data", "bwd_weights")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    ap.add_argument("--net", default=str(REPO / "benchmarks" / "nets" / "vgg_a_64.json"))
    ap.add_argument("--batch", default="1,2,4,8")
    ap.add_argument("--arch", default="native")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    spec, arch = load_netspec(args.net), get_arch(args.arch)
    batches = [int(b) for b in args.batch.split(",")]
    peaks: dict[int, list[float]] = {1: [], 2: []}
    for _ in range(3):
        for threads in (1, 2):
            peaks[threads].append(measure_peak(arch, threads))
    peak_ratio = max(peaks[2]) / max(peaks[1])
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        build(spec, arch, Path(tmp) / "b")
        nets = {t: pr.load(Path(tmp) / "b", threads=t) for t in (1, 2)}
        for layer in [l for l in spec.layers if l.weighted]:
            for batch in batches:
                timers = {t: kernel_timers(nets[t].layers[layer.name], batch) for t in (1, 2)}
                team = nets[2].layers[layer.name].team(batch)
                for p in PASSES:
                    ratios = []
                    for _ in range(args.rounds):
                        one = median_kernel_seconds(timers[1][p], 3)
                        two = median_kernel_seconds(timers[2][p], 3)
                        ratios.append(one / two)
                    items = parallel_loop(layer, plan_layer(layer, p, arch)).items(batch)
                    share = scaling.division_efficiency(items, team)
                    predicted = peak_ratio * share if team == 2 else 1.0
                    measured = statistics.median(ratios)
                    rows.append({"layer": layer.name, "pass": p, "batch": batch, "items": items, "threads": team,
                                 "share": share, "predicted": predicted, "measured": measured,
                                 "error": predicted / measured - 1})
    print(f"{spec.name} on {arch.name}: FMA peak {max(peaks[1]):.1f} GFLOP/s (1 thread), {max(peaks[2]):.1f} "
          f"(2 threads): ratio {peak_ratio:.2f}")
    print(f"{'layer':<8} {'pass':<12} {'mb':>3} {'items':>6} {'thr':>3} {'share':>6} {'pred 1t/2t':>10} "
          f"{'meas 1t/2t':>10} {'error':>6}")
    for r in rows:
        print(f"{r['layer']:<8} {r['pass']:<12} {r['batch']:>3} {r['items']:>6} {r['threads']:>3} {r['share']:6.0%} "
              f"{r['predicted']:10.2f} {r['measured']:10.2f} {r['error']:+6.0%}")
    errors = [abs(r["error"]) for r in rows]
    uneven = [r for r in rows if r["share"] < 0.999 and r["threads"] == 2]
    summary = f"median |error| {statistics.median(errors):.0%} over {len(rows)} kernels; rows where the model " \
              f"leaves a thread idle part of the time: {len(uneven)}"
    if uneven:
        with_term = statistics.median(abs(r["error"]) for r in uneven)
        without = statistics.median(abs(peak_ratio / r["measured"] - 1) for r in uneven)
        summary += f", median |error| {with_term:.0%} (without the division term: {without:.0%})"
    print(summary)
    if args.json:
        Path(args.json).write_text(json.dumps({"net": spec.name, "arch": arch.name, "peaks": peaks,
                                               "peak_ratio": peak_ratio, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
