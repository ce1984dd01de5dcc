"""What the non-finite checks of a training step cost (issue 47): the input batch, the gradients
before the update and the weights after it, each one summing pass (validate.non_finite_at).

    python benchmarks/finite_checks.py [--nets cifar_small,vgg_a] [--batch 64] [--rounds 20]

Per net: Trainer.step on a fixed batch, with the checks and with them replaced by a no-op,
alternated round by round (interleaved A/B, medians), and the time the three checks take inside
a step. Synthetic inputs; the learning rate is small enough that nothing diverges.
"""
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
from pcldnn_runtime import net as net_module
from pcldnn_runtime import optim

REPO = Path(__file__).resolve().parent.parent


def _use(check) -> None:
    net_module.non_finite_at = optim.non_finite_at = check


def measure(name: str, batch: int, rounds: int, threads: int, arch: str) -> str:
    spec = load_netspec(REPO / "examples" / "nets" / f"{name}.json")
    out = Path(tempfile.mkdtemp(prefix="finite-")) / name
    build(spec, get_arch(arch), out)
    net = pr.load(out, threads=threads)
    trainer = pr.Trainer(net, pr.SGD(1e-4, momentum=0.9))
    rng = np.random.default_rng(0)
    x = rng.standard_normal((batch, *spec.input)).astype(np.float32)
    labels = rng.integers(0, spec.layers[-1].in_shape[0], batch)
    real = net_module.non_finite_at
    for _ in range(2):
        trainer.step(x, labels)
    times: dict[str, list[float]] = {"checks": [], "none": []}
    for r in range(rounds):
        for mode in ("checks", "none") if r % 2 == 0 else ("none", "checks"):
            _use(real if mode == "checks" else (lambda a: None))
            start = time.perf_counter()
            trainer.step(x, labels)
            times[mode].append(time.perf_counter() - start)
    spent: list[float] = []

    def timed(a):
        start = time.perf_counter()
        result = real(a)
        spent.append(time.perf_counter() - start)
        return result
    _use(timed)
    for _ in range(rounds // 2):
        trainer.step(x, labels)
    _use(real)
    with_checks, without = statistics.median(times["checks"]), statistics.median(times["none"])
    per_step = sum(spent) / (rounds // 2)
    return (f"{name:12s} minibatch {batch:4d}  {net.params.size / 1e6:7.2f} M params  step {with_checks * 1e3:9.2f} ms "
            f"with checks, {without * 1e3:9.2f} ms without (ratio {with_checks / without:.3f}); the checks "
            f"{per_step * 1e3:.2f} ms a step ({per_step / with_checks:.1%})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    ap.add_argument("--nets", default="digits,cifar_small")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--arch", default="native")
    args = ap.parse_args()
    for name in args.nets.split(","):
        print(measure(name, args.batch, args.rounds, args.threads, args.arch), flush=True)


if __name__ == "__main__":
    main()
