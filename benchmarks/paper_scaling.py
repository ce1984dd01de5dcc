"""The communication model against the paper's published multi-node speedups.

    python benchmarks/paper_scaling.py [--markdown]

For each published point (Das et al. 2016): the speedup `pcldnn-gen plan` predicts with the
machine preset (closed form, and the event simulation, which adds link contention), and the
error against the published figure. The presets are not fitted to these figures: their
numbers and sources are in pcldnn_runtime/scaling.py.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from pcldnn_gen.netspec import load_netspec
from pcldnn_gen.scaling_report import layer_loads
from pcldnn_runtime import scaling

NETS = Path(__file__).resolve().parent.parent / "examples" / "nets"

# (net, machine, nodes, global minibatch, published speedup, where)
PUBLISHED = [
    ("vgg_a", "cori-haswell", 128, 512, 90.0, "abstract, section 5"),
    ("vgg_a", "cori-haswell", 64, 256, 53.0, "abstract, section 5"),
    ("overfeat_fast", "cori-haswell", 64, 256, 42.0, "abstract, section 5"),
    ("vgg_a", "aws-c4", 16, 256, 14.0, "abstract, section 6 (about 14x; minibatch assumed 256)"),
    # The 7-layer speech DNN (examples/nets/dnn7.json: CD-DNN-HMM, Seide et al. 2011, 7 hidden
    # layers of 2,048, 9,304 senones): cluster and minibatch are not given here, so the paper's
    # own cluster (Cori) and the 1,024-frame minibatch of CD-DNN-HMM SGD training are assumed.
    ("dnn7", "cori-haswell", 16, 1024, 6.5, "abstract (minibatch 1024 frames and Cori assumed)"),
]


def compare() -> list[dict]:
    rows = []
    for net, machine_name, nodes, batch, published, where in PUBLISHED:
        machine = scaling.PRESETS[machine_name]
        loads = layer_loads(load_netspec(NETS / f"{net}.json"), machine)
        plan = scaling.best_strategy(loads, nodes, batch, machine)
        simulated = plan.single / scaling.simulate_stragglers(plan.costs, nodes, machine)
        rows.append({"net": net, "machine": machine_name, "nodes": nodes, "batch": batch, "published": published,
                     "predicted": plan.speedup, "simulated": simulated,
                     "error": plan.speedup / published - 1, "simulated_error": simulated / published - 1,
                     "modes": ", ".join(f"{c.layer} {c.mode}" for c in plan.costs if c.group > 1), "where": where})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    ap.add_argument("--markdown", action="store_true")
    args = ap.parse_args()
    rows = compare()
    if args.markdown:
        print("| net | machine | nodes | minibatch | published | predicted (error) | simulated (error) | fc layers |")
        print("|---|---|---:|---:|---:|---:|---:|---|")
        for r in rows:
            print(f"| {r['net']} | {r['machine']} | {r['nodes']} | {r['batch']} | {r['published']:g}x | "
                  f"{r['predicted']:.1f}x ({r['error']:+.0%}) | {r['simulated']:.1f}x ({r['simulated_error']:+.0%}) | "
                  f"{r['modes']} |")
        return
    for r in rows:
        print(f"{r['net']:14s} {r['machine']:13s} {r['nodes']:4d} nodes, minibatch {r['batch']:4d}: published "
              f"{r['published']:5.1f}x, predicted {r['predicted']:6.1f}x ({r['error']:+.0%}), simulated "
              f"{r['simulated']:6.1f}x ({r['simulated_error']:+.0%}); {r['modes']}")


if __name__ == "__main__":
    main()
