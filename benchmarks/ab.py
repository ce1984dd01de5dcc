"""Interleaved A/B of two builds of the same net: each (layer, pass) kernel of build A and of
build B timed alternately, `rounds` times, so a slow moment of the machine hits both sides.
How a kernel change is judged (never one bench run against another).

    git stash; pcldnn-gen compile NET --arch ISA -o /tmp/a; git stash pop
    pcldnn-gen compile NET --arch ISA -o /tmp/b
    python benchmarks/ab.py /tmp/a /tmp/b --batch 16 --threads 1 [--layers conv2,conv5] [--passes bwd_weights]

Prints, per kernel, the median time of each side and the median of the per-round ratios A/B
(above 1: B is faster), and the header lines of both kernels where their blocks differ.
"""
from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import pcldnn_runtime as pr
from pcldnn_gen.bench import kernel_timers, median_kernel_seconds
from pcldnn_runtime.manifest import PASSES


def blocks_line(build: Path, layer: str, pass_name: str) -> str:
    """The `blocks  :` line of a kernel's C header."""
    text = (build / "src" / f"{layer}_{pass_name}.c").read_text()
    return next((line.split(":", 1)[1].strip() for line in text.splitlines() if "blocks  :" in line), "-")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    ap.add_argument("a", type=Path)
    ap.add_argument("b", type=Path)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=3, help="calls per side and round (median)")
    ap.add_argument("--layers", default="", help="comma-separated; default: every conv and fc layer")
    ap.add_argument("--passes", default=",".join(PASSES))
    args = ap.parse_args()
    nets = [pr.load(args.a, threads=args.threads), pr.load(args.b, threads=args.threads)]
    if nets[0].net_hash != nets[1].net_hash:
        raise SystemExit("the two builds are of different nets")
    names = args.layers.split(",") if args.layers else [n for n, l in nets[0].layers.items() if l.type in ("conv", "fc")]
    print(f"{'layer':<8} {'pass':<12} {'A ms':>9} {'B ms':>9} {'A/B':>6}  blocks (A -> B where they differ)")
    for name in names:
        runs = [kernel_timers(net.layers[name], args.batch) for net in nets]
        for p in args.passes.split(","):
            times: list[list[float]] = [[], []]
            for _ in range(args.rounds):
                for side in (0, 1):
                    times[side].append(median_kernel_seconds(runs[side][p], args.repeats))
            ratio = statistics.median(a / b for a, b in zip(*times))
            blocks = [blocks_line(build, name, p) for build in (args.a, args.b)]
            shown = blocks[0] if blocks[0] == blocks[1] else f"{blocks[0]} -> {blocks[1]}"
            print(f"{name:<8} {p:<12} {1e3 * statistics.median(times[0]):9.2f} {1e3 * statistics.median(times[1]):9.2f} "
                  f"{ratio:6.2f}  {shown}")


if __name__ == "__main__":
    main()
