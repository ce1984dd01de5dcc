"""What the fusions (runtime/families/fusion.py) save: a net built with and without them
(`compile --no-fusion`), whole training steps timed alternately (interleaved A/B, medians), the
time of the kernels each fusion touches from the same steps' per-layer timings, and the bytes
each fusion no longer moves (nominal: activation passes counted from the shapes, as a
bandwidth-bound kernel moves them; the statistics' reads from cache are not counted).

    python benchmarks/fusion.py examples/nets/resnet18.json --batch 16 --threads 2 --arch native

Passes over an activation of the fused layers, training step, per fused pair:
- statistics (conv -> batchnorm): the batchnorm's forward reads x three times unfused (sum,
  squares, apply), once fused: 2 reads saved.
- residual (batchnorm -> add) forward: unfused the batchnorm writes y, the add reads y and the
  shortcut and writes the sum; fused one pass reads x and the shortcut and writes the sum:
  1 write and 1 read saved. Backward: unfused the add masks dy by its ReLU (reads dy and its
  output, writes dy) and its gradient goes to the batchnorm as a copy (1 read, 1 write), then
  the batchnorm's sums read x and dy; fused the sums pass masks each row of dy as it reads it
  (reads dy, the add's output and x, writes dy) and the masked dy is the shortcut's gradient
  itself: 3 saved. And the batchnorm's output buffer is not allocated (memory)."""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

import pcldnn_runtime as pr
from pcldnn_gen.arch import get_arch
from pcldnn_gen.build import build
from pcldnn_gen.netspec import load_netspec


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    ap.add_argument("net", type=Path)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--arch", default="native")
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    spec = load_netspec(args.net)
    arch = get_arch(args.arch)
    work = Path(tempfile.mkdtemp(prefix="fusion-"))
    build(spec, arch, work / "on")
    build(spec, arch, work / "off", fusion=False)
    nets = {"fused": pr.load(work / "on", threads=args.threads), "unfused": pr.load(work / "off", threads=args.threads)}
    nets["unfused"].load_state_dict(nets["fused"].state_dict())
    fusions = nets["fused"].fusions
    chain = nets["fused"].chain
    rng = np.random.default_rng(0)
    x = rng.standard_normal((args.batch, *spec.input)).astype(np.float32)
    y = rng.integers(0, spec.classes or 1, args.batch)

    # the layers whose kernels a fusion touches: statistics (conv, batchnorm), residual (batchnorm, add)
    groups = {"statistics: the convs": sorted(fusions.statistics),
              "statistics: batchnorms": sorted(fusions.statistics.values()),
              "residual: batchnorm+add": sorted({n for pair in fusions.residual.items() for n in pair})}
    totals: dict[str, list[float]] = {k: [] for k in nets}
    parts: dict[tuple[str, str, str], list[float]] = {}
    for net in nets.values():  # warm up: workspaces, first-touch of the buffers
        net.forward(x, training=True)
        net.backward(y)
    for _ in range(args.rounds):
        for side, net in nets.items():
            fwd: dict[str, float] = {}
            bwd: dict[str, float] = {}
            start = time.perf_counter()
            net.forward(x, training=True, timings=fwd)
            net.backward(y, timings=bwd)
            totals[side].append(time.perf_counter() - start)
            for group, members in groups.items():
                for pass_name, table in (("fwd", fwd), ("bwd", bwd)):
                    parts.setdefault((side, group, pass_name), []).append(sum(table[chain[i].name] for i in members))

    act_bytes = {i: 4 * args.batch * int(np.prod(chain[i].blocked_shape(chain[i].out_shape, 1))) for i in range(len(chain))}
    saved = {"statistics": sum(2 * act_bytes[norm] for norm in fusions.statistics.values()),
             "residual fwd": sum(2 * act_bytes[norm] for norm in fusions.residual),
             "residual bwd": sum(3 * act_bytes[norm] for norm in fusions.residual)}
    print(f"{spec.name}, minibatch {args.batch}, {args.threads} thread(s), {arch.name} ({arch.isa}); "
          f"{len(fusions.statistics)} statistics and {len(fusions.residual)} residual fusions; "
          f"medians of {args.rounds} interleaved rounds")
    med = {k: statistics.median(v) * 1e3 for k, v in totals.items()}
    print(f"training step (forward + backward): unfused {med['unfused']:.1f} ms, fused {med['fused']:.1f} ms, "
          f"saving {med['unfused'] - med['fused']:.1f} ms ({1 - med['fused'] / med['unfused']:.1%})")
    print(f"{'kernels of':<25} {'pass':<5} {'unfused ms':>11} {'fused ms':>9} {'saved ms':>9}")
    for group in groups:
        for pass_name in ("fwd", "bwd"):
            a = statistics.median(parts[("unfused", group, pass_name)]) * 1e3
            b = statistics.median(parts[("fused", group, pass_name)]) * 1e3
            print(f"{group:<25} {pass_name:<5} {a:11.2f} {b:9.2f} {a - b:9.2f}")
    print("(a batchnorm in both fusions counts in both of its rows)")
    print("bytes not moved per step (nominal): " + ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in saved.items())
          + f"; total {sum(saved.values()) / 2**20:.1f} MiB; activation memory not allocated: "
          f"{sum(act_bytes[n] for n in fusions.residual) / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
