"""Issue 18's measurements on one machine, in one command: the runs its targets name, then
`summarize.py` on them. For a CPU with AVX512_BF16 (Zen 4/5 without AMX, where the vdpbf16ps
kernels have only been measured at an emulated rate; or a Xeon with AMX, `--arch native`
choosing the tiles).

    python benchmarks/bf16_targets.py --out benchmarks/results/bf16_zen5      # runs everything (~1 h)
    python benchmarks/bf16_targets.py --out /tmp/x --dry-run                 # prints the commands

In order: the AVX-512 register-tile microbenchmark (the model's tile efficiencies against this
CPU's, for the planner's presets); VGG-A conv2-8 and OverFeat-FAST conv2-5 in bf16 and fp32
against oneDNN (one thread, minibatch 16, 2 rounds); VGG-A fc6-8 at minibatch 64 and 256, the
same; the bf16 zoo's first layers against oneDNN's bf16 kernels; whole-net training of
cifar_small and vgg_a_64 in bf16 against PyTorch (minibatch 16 and 64, one and two threads); the
bf16 zoo tuned (`pcldnn-gen tune --precision bf16`: where the model's register tiles miss on this
CPU, the input a calibration of its preset needs); then `summarize.py` on the bench files (the
issue's targets, line by line). The benches and training runs time the model's plans
(`--no-tuning`); the tuning run writes `tuning.json` in the output folder, not the user's
database. Each step's output goes to a log beside its JSON; a failed step is reported and the
rest still run.
"""
from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
CONV_LAYERS = {"vgg_a": "conv2,conv3,conv4,conv5,conv6,conv7,conv8", "overfeat_fast": "conv2,conv3,conv4,conv5"}
FIRST_LAYERS = "alexnet_conv1,vgg16_conv1_1,googlenet_conv1,resnet_conv1,mobilenet_conv1,cifar_conv1_24,cifar_stride2_3ch"


def steps(out: Path, arch: str) -> list[tuple[str, list[str], Path | None]]:
    """(name, argv, JSON it writes or None) of every run, in order."""
    py, cli = sys.executable, [sys.executable, "-m", "pcldnn_gen"]
    bench = [*cli, "bench"]
    runs: list[tuple[str, list[str], Path | None]] = [
        ("tile_microbench", [py, str(HERE / "tile_microbench.py"), "--isa", "avx512"], None)]
    for net, layers in CONV_LAYERS.items():
        for precision in ("bf16", "fp32"):
            json_path = out / f"{net}_{precision}_b16_1t.json"
            runs.append((f"{net}_{precision}", [*bench, str(REPO / "examples" / "nets" / f"{net}.json"), "--layers", layers,
                                                 "--arch", arch, "--threads", "1", "--precision", precision,
                                                 "--compare", "onednn", "--rounds", "2", "--no-tuning",
                                                 "--json", str(json_path)],
                         json_path))
    for batch in (64, 256):
        for precision in ("bf16", "fp32"):
            json_path = out / f"vgg_a_fc_{precision}_b{batch}_1t.json"
            runs.append((f"vgg_a_fc_{precision}_{batch}",
                         [*bench, str(REPO / "examples" / "nets" / "vgg_a.json"), "--layers", "fc6,fc7,fc8", "--arch", arch,
                          "--threads", "1", "--batch", str(batch), "--precision", precision, "--compare", "onednn",
                          "--rounds", "2", "--no-tuning", "--json", str(json_path)], json_path))
    json_path = out / "zoo_first_layers_bf16_b16_1t.json"
    runs.append(("zoo_first_layers_bf16", [*bench, "--zoo", str(HERE / "zoo" / "zoo.json"), "--layers", FIRST_LAYERS,
                                           "--arch", arch, "--threads", "1", "--precision", "bf16", "--compare", "onednn",
                                           "--rounds", "2", "--no-tuning", "--json", str(json_path)], json_path))
    for net in (REPO / "examples" / "nets" / "cifar_small.json", HERE / "nets" / "vgg_a_64.json"):
        for batch in (16, 64):
            json_path = out / f"train_throughput_bf16_{net.stem}_{batch}.json"
            runs.append((f"train_{net.stem}_{batch}", [py, str(HERE / "train_throughput.py"), "--net", str(net), "--arch", arch,
                                                   "--batch", str(batch), "--threads", "1,2", "--precision", "bf16",
                                                   "--no-tuning", "--json", str(json_path)], json_path))
    json_path = out / "tune_zoo_bf16_b16_1t.json"
    runs.append(("tune_zoo_bf16", [*cli, "tune", "--zoo", str(HERE / "zoo" / "zoo.json"), "--arch", arch, "--threads", "1",
                                   "--batch", "16", "--precision", "bf16", "--json", str(json_path)], json_path))
    return runs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    ap.add_argument("--out", type=Path, required=True, help="folder for the JSON files and logs")
    ap.add_argument("--arch", default="native")
    ap.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    args = ap.parse_args()
    runs = steps(args.out, args.arch)
    bench_files = [str(j) for name, _, j in runs if j is not None and not name.startswith(("train_", "tune_"))]
    summary = [sys.executable, str(HERE / "summarize.py"), *bench_files]
    tuning_db = args.out.resolve() / "tuning.json"  # the tuning run's, not the user's database
    if args.dry_run:
        for _, argv, _ in runs:
            print(("PCLDNN_TUNING_DB=" + shlex.quote(str(tuning_db)) + " " if argv[3:4] == ["tune"] else "")
                  + shlex.join(argv))
        print(shlex.join(summary))
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    failed = []
    for name, argv, _ in runs:
        print(f"== {name}: {shlex.join(argv)}", flush=True)
        with open(args.out / f"{name}.log", "w") as log:
            env = os.environ | {"PCLDNN_TUNING_DB": str(tuning_db)}
            if subprocess.run(argv, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=env).returncode != 0:
                failed.append(name)
                print(f"   failed: see {args.out / (name + '.log')}", flush=True)
    present = [f for f in bench_files if Path(f).exists()]
    result = subprocess.run([*summary[:2], *present], cwd=REPO)
    if failed:
        print(f"failed steps: {', '.join(failed)}")
    return 1 if failed or result.returncode else 0


if __name__ == "__main__":
    sys.exit(main())
