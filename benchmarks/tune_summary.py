"""Summarise `pcldnn-gen tune --json` files as markdown for RESULTS.md: how often the model's
first choice was the fastest of its candidates, what tuning gained (median, largest, per pass),
and every kernel where a measured tile replaced the model's.

    python benchmarks/tune_summary.py benchmarks/results/zoo_tune_native_b16_1t.json
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from pcldnn_gen.tuner import NOISE
from pcldnn_runtime.manifest import PASSES


def _tile(t: list[int]) -> str:
    return f"{t[0]}x{t[1]}"


def summary(d: dict, name: str) -> list[str]:
    rows = d["rows"]
    precision = d.get("precision", "fp32")  # files written before `tune --precision` are fp32
    lines = [f"### Tuning: {name} ({d['arch']}, {precision}, minibatch {d['batch']}, {d['threads']} thread(s))", "",
             f"{len(rows)} kernels with 2 or more candidate tiles timed in {d['seconds'] / 60:.0f} min "
             f"(FMA peak {d['peak_gflops']:.1f} GFLOP/s); {d['single']} with a single candidate; "
             f"{d['unmeasured']} left by the budget.", "",
             "| pass | kernels | model's tile fastest | within 3% of fastest | median gain | largest gain |",
             "|---|---:|---:|---:|---:|---:|"]
    for p in (*PASSES, "all"):
        mine = [r for r in rows if p in (r["pass"], "all")]
        if not mine:
            continue
        hits = sum(r["best"] == r["model"] for r in mine)
        near = sum(r["gain"] <= 1 + NOISE for r in mine)
        top = max(mine, key=lambda r: r["gain"])
        lines.append(f"| {p} | {len(mine)} | {hits} ({hits / len(mine):.0%}) | {near} ({near / len(mine):.0%}) | "
                     f"{statistics.median(r['gain'] for r in mine):.3f}x | {top['gain']:.2f}x ({top['layer']}) |")
    changed = sorted((r for r in rows if r["choice"] != r["model"]), key=lambda r: -r["gain"])
    lines += ["", f"Kernels whose tile the database now sets ({len(changed)}; a candidate must be more than "
              f"{NOISE:.0%} faster than the model's):", "",
              "| shape | pass | model | ms | measured best | ms | gain |", "|---|---|---|---:|---|---:|---:|"]
    lines += [f"| {r['layer']} | {r['pass']} | {_tile(r['model'])} | {r['model_ms']:.2f} | {_tile(r['best'])} | "
              f"{r['best_ms']:.2f} | {r['gain']:.2f}x |" for r in changed]
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    ap.add_argument("files", nargs="+", type=Path)
    args = ap.parse_args()
    for path in args.files:
        print("\n".join(summary(json.loads(path.read_text()), path.name)) + "\n")


if __name__ == "__main__":
    main()
