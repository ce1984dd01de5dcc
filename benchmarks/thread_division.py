"""The scaling model's thread division against this machine: each weighted pass of a net at
small minibatches on 1 and on 2 threads, and the 2-thread efficiency the model predicts from
the 1-thread one and the kernel's parallel loop (pcldnn_gen.planner.parallel).

    python benchmarks/thread_division.py [--net benchmarks/nets/vgg_a_64.json] [--batch 1,2,4,8]
        [--arch native] [--json out.json]

Predicted 2-thread efficiency (of the 2-thread FMA peak measured in the same run) = 1-thread
efficiency x division_efficiency(items at that minibatch, 2 threads). On a machine whose two
vCPUs share one core's FMA units, the 2-thread peak is about the 1-thread one and the
comparison still holds against it; say which machine a figure comes from.
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from pcldnn_gen.arch import get_arch
from pcldnn_gen.bench import bench_curve
from pcldnn_gen.netspec import load_netspec
from pcldnn_gen.planner import plan_layer
from pcldnn_gen.planner.parallel import parallel_loop
from pcldnn_runtime import scaling

REPO = Path(__file__).resolve().parent.parent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--net", default=str(REPO / "benchmarks" / "nets" / "vgg_a_64.json"))
    ap.add_argument("--batch", default="1,2,4,8")
    ap.add_argument("--arch", default="native")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    spec, arch = load_netspec(args.net), get_arch(args.arch)
    batches = [int(b) for b in args.batch.split(",")]
    layers = {l.name: l for l in spec.layers}
    peaks, curves = {}, {}
    for threads in (1, 2):
        peaks[threads], curves[threads] = bench_curve(spec, arch, batches, threads, repeats=args.repeats)
    rows = []
    for batch in batches:
        for one, two in zip(curves[1][batch], curves[2][batch]):
            layer = layers[one.layer]
            items = parallel_loop(layer, plan_layer(layer, one.pass_name, arch)).items(batch)
            share = scaling.division_efficiency(items, 2)
            predicted = one.peak_fraction * share
            rows.append({"layer": one.layer, "pass": one.pass_name, "batch": batch, "items": items,
                         "eff_1t": one.peak_fraction, "division_2t": share, "predicted_2t": predicted,
                         "measured_2t": two.peak_fraction, "error": predicted / two.peak_fraction - 1})
    print(f"{spec.name} on {arch.name}: FMA peak {peaks[1]:.1f} GFLOP/s (1 thread), {peaks[2]:.1f} (2 threads)")
    print(f"{'layer':<8} {'pass':<12} {'mb':>3} {'items':>6} {'1t':>5} {'share':>6} {'pred 2t':>8} {'meas 2t':>8} "
          f"{'error':>6}")
    for r in rows:
        print(f"{r['layer']:<8} {r['pass']:<12} {r['batch']:>3} {r['items']:>6} {r['eff_1t']:5.0%} "
              f"{r['division_2t']:6.0%} {r['predicted_2t']:8.0%} {r['measured_2t']:8.0%} {r['error']:+6.0%}")
    uneven = [r for r in rows if r["division_2t"] < 0.999]
    errors = [abs(r["error"]) for r in rows]
    summary = f"median |error| {statistics.median(errors):.0%} over {len(rows)} rows; rows with an idle thread in " \
              f"the model: {len(uneven)}"
    if uneven:
        with_term = statistics.median(abs(r["error"]) for r in uneven)
        without = statistics.median(abs(r["eff_1t"] / r["measured_2t"] - 1) for r in uneven)
        summary += f", median |error| {with_term:.0%} (without the division term: {without:.0%})"
    print(summary)
    if args.json:
        Path(args.json).write_text(json.dumps({"net": spec.name, "arch": arch.name, "peaks": peaks, "rows": rows},
                                              indent=1))


if __name__ == "__main__":
    main()
