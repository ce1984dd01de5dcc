"""A sweep over random nets: what the held-out checks do to a build, on shapes nobody chose.

Each seed draws a chain of convolutions (windows 1-11, strides 1-4, any padding up to the
window, odd channel counts), poolings, ReLUs and dropouts, then fc layers, and a minibatch of
1-16. Every net is built and trained one step in each configuration below; a configuration
fails on an exception, a crash (the sweep runs each net in a child process), non-finite
values, or a disagreement past its bound:

    fp32    scalar, avx2 and avx512 builds: gradients within 1e-3 of avx512 (relative, fp32
            summation orders; nets with dropout are skipped: masks hash the blocked index), eval
            logits within 1e-4, and one and two threads give the same bits
    bf16    AMX (`sapphirerapids`) and vdpbf16ps (`avx512`) bf16 builds against the fp32 build:
            finite, gradients within 0.5 (relative; bf16 rounding and ReLU masks it flips make a
            few percent on small nets, see docs/precision.md), the figure printed per net. On a
            CPU without AMX the AMX builds are left out; without AVX512_BF16 the vdpbf16ps builds
            run with the instructions emulated in AVX-512F (tests/bf16_emulation.py)

    python benchmarks/random_nets.py --seeds 0:40 --mode bf16
    python benchmarks/random_nets.py --seeds 100:160 --mode fp32

Found so far (fixed): a net starting with a dropout or pooling crashed in backward; a bf16 build
with a few-channel conv inside the net was refused by its own loader; kernels next to bf16
activations were planned without them when a tuning database was present.
"""
from __future__ import annotations

import argparse
import multiprocessing
import random
import shutil
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np

MODES = {"fp32": (("avx512", "fp32"), ("scalar", "fp32"), ("avx2", "fp32")),  # the first: the reference
         "bf16": (("avx512", "fp32"), ("sapphirerapids", "bf16"), ("avx512", "bf16"))}


def random_net(rng: random.Random) -> dict:
    """A net description drawn from `rng` (it may be invalid: the caller skips those)."""
    layers: list[dict] = []
    for i in range(1, rng.randint(1, 5) + 1):
        draw = rng.random()
        if draw < 0.6:
            k = rng.choice([1, 1, 2, 3, 3, 3, 5, 7, 11])
            layer = {"name": f"c{i}", "type": "conv", "kernel": k,
                     "out_channels": rng.choice([1, 5, 16, 17, 31, 32, 48, 64, 96, 130]),
                     "stride": rng.choice([1, 1, 1, 2, 2, 3, 4]), "pad": rng.choice([0, 0, k // 2, k // 2, k - 1, k])}
            if rng.random() < 0.7:
                layer["activation"] = "relu"
            if rng.random() < 0.15:
                layer["bias"] = False
        elif draw < 0.75:
            layer = {"name": f"p{i}", "type": rng.choice(["maxpool", "avgpool"]), "kernel": rng.choice([2, 3]),
                     "stride": rng.choice([1, 2, 3])}
        elif draw < 0.85:
            layer = {"name": f"r{i}", "type": "relu"}
        else:
            layer = {"name": f"d{i}", "type": "dropout", "rate": 0.3}
        layers.append(layer)
    for j in range(rng.randint(0, 2)):
        layers.append({"name": f"f{j}", "type": "fc", "out_features": rng.choice([1, 7, 16, 33, 100, 257]),
                       **({"activation": "relu"} if rng.random() < 0.5 else {})})
    layers += [{"name": "logits", "type": "fc", "out_features": rng.choice([2, 10, 17])},
               {"name": "loss", "type": "softmax_cross_entropy"}]
    return {"name": "rnd", "input": {"channels": rng.choice([1, 2, 3, 4, 8, 16, 17, 32, 33, 48, 64]),
                                     "height": rng.randint(4, 40), "width": rng.randint(4, 40)}, "layers": layers}


def _train_step(desc: dict, arch: str, precision: str, out: Path, x, labels) -> tuple:
    """(loss, canonical gradients, eval logits, gradients on one thread) of one build."""
    import pcldnn_runtime as pr
    from pcldnn_gen.arch import get_arch
    from pcldnn_gen.build import build
    from pcldnn_gen.netspec import parse_netspec
    from pcldnn_gen.tuning import TuningDB
    build(parse_netspec(desc), get_arch(arch), out, precision=precision, tuning=TuningDB.load())  # the CLI's path
    net = pr.load(out, threads=2)
    loss = net.loss_and_grad(x, labels)
    grads = net.to_canonical(net.grads).copy()
    net.threads, net.dropout_draws = 1, 0
    net.loss_and_grad(x, labels)
    return loss, grads, net.forward(x), net.to_canonical(net.grads).copy()


def runnable(mode: str) -> tuple[tuple[str, str], ...]:
    """In the child process: the configurations of `mode` this CPU runs (after PCLDNN_MAX_ISA;
    fp32: the first one left is the reference). AMX builds only where Linux grants the tiles;
    vdpbf16ps builds on AVX512_BF16 or, without it, on any AVX-512 CPU with the instructions
    emulated (applied here, for the child's lifetime)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    import bf16_emulation

    from pcldnn_gen.arch import get_arch
    from pcldnn_runtime import cpu
    if mode == "fp32":
        return tuple(c for c in MODES[mode] if cpu.supports(get_arch(c[0]).isa))
    if mode == "bf16" and not bf16_emulation.HAS_BF16:
        if not bf16_emulation.CAN_EMULATE:
            raise SystemExit(f"{cpu.capped('this CPU')} lacks AVX-512: bf16 kernels can neither run nor be emulated here")
        import pytest
        bf16_emulation.emulate(pytest.MonkeyPatch())
    amx = bf16_emulation.HAS_BF16 and cpu.request_amx() is None
    return tuple(c for c in MODES[mode] if amx or c != ("sapphirerapids", "bf16"))


def check_net(seed: int, mode: str, folder: str) -> str:
    """One seed's verdict line (runs in a child process: a crash fails only this net)."""
    configurations = runnable(mode)
    rng = random.Random(seed)
    desc = random_net(rng)
    from pcldnn_gen.netspec import parse_netspec
    try:
        parse_netspec(desc)
    except Exception:  # an invalid draw (a window past its input): not a case
        return f"{seed} skip"
    batch = rng.choice([1, 2, 3, 5, 16])
    data = np.random.default_rng(seed)
    c, h, w = (desc["input"][k] for k in ("channels", "height", "width"))
    x = data.standard_normal((batch, c, h, w)).astype(np.float32)
    labels = data.integers(0, desc["layers"][-2]["out_features"], batch)
    runs = {}
    for arch, precision in configurations:
        runs[arch, precision] = _train_step(desc, arch, precision, Path(folder) / f"{seed}-{arch}-{precision}", x, labels)
    ref = runs[configurations[0]]
    dropout = any(layer["type"] == "dropout" for layer in desc["layers"])
    words = []
    for key, (loss, grads, logits, one_thread) in runs.items():
        err = float(np.linalg.norm(grads - ref[1]) / (np.linalg.norm(ref[1]) + 1e-30))
        finite = bool(np.isfinite(grads).all() and np.isfinite(logits).all() and np.isfinite(loss))
        if mode == "fp32":
            logit_err = float(np.abs(logits - ref[2]).max() / (np.abs(ref[2]).max() + 1e-30))
            ok = finite and (dropout or err < 1e-3) and logit_err < 1e-4 and np.array_equal(grads, one_thread)
        else:
            ok = finite and err < 0.5
        words.append(f"{'-'.join(key)} {'ok' if ok else 'FAIL'} {err:.1e}")
    return f"{seed} {'; '.join(words)}" + ("" if all(" ok " in w for w in words) else f"  net {desc} batch {batch}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    ap.add_argument("--seeds", default="0:20", help="first:last (exclusive)")
    ap.add_argument("--mode", choices=sorted(MODES), default="bf16")
    args = ap.parse_args()
    first, last = (int(v) for v in args.seeds.split(":"))
    folder = tempfile.mkdtemp(prefix="pcldnn-random-nets-")
    failed = 0
    try:
        for seed in range(first, last):
            with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
                try:
                    line = pool.submit(check_net, seed, args.mode, folder).result()
                except Exception as e:  # an exception in the child, or the child died (BrokenProcessPool)
                    line = f"{seed} FAIL {type(e).__name__}: {str(e)[:200]}"
            failed += "FAIL" in line
            print(line, flush=True)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    print(f"{failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
