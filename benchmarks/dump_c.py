"""Render every kernel and layout file of the example nets, with the build's own kernels (peak,
SGD), for every target into a folder, without compiling: the before/after check of a change that
must leave the generated C unchanged.

    python benchmarks/dump_c.py /tmp/before        # on the old tree
    python benchmarks/dump_c.py /tmp/after         # on the new tree
    diff -r /tmp/before /tmp/after

Targets (`--targets`, preset:precision): fp32 on scalar, AVX2 and AVX-512; bf16 on vdpbf16ps
(zen5: AVX512_BF16, no AMX) and on AMX (sapphirerapids). Plans are the model's (no tuning
database), so the output depends on the tree only.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from pcldnn_gen.arch import PRESETS
from pcldnn_gen.build import net_activations, plan_net
from pcldnn_gen.codegen import render_kernel, render_layout, render_peak, render_sgd
from pcldnn_gen.netspec import load_netspec

NETS = Path(__file__).resolve().parent.parent / "examples" / "nets"


def dump(out: Path, nets: list[str], targets: list[str]) -> int:
    """Write out/<net>-<preset>-<precision>/<file>.c; returns the number of files."""
    count = 0
    for net_name in nets:
        path = Path(net_name) if net_name.endswith(".json") else NETS / f"{net_name}.json"
        net = load_netspec(path)
        net_name = path.stem
        for target in targets:
            preset, precision = target.split(":")
            arch = PRESETS[preset]
            folder = out / f"{net_name}-{preset}-{precision}"
            folder.mkdir(parents=True, exist_ok=True)
            plans = plan_net(net, arch, tuning=None, precision=precision)
            sources = [render_peak(arch), render_sgd()]
            activations = net_activations(net, arch, precision)
            for layer in net.layers:
                sources += [render_kernel(layer, plan, arch) for (name, _), plan in plans.items() if name == layer.name]
                sources.append(render_layout(layer, arch, precision, activations[layer.name]))
            for source in sources:
                (folder / source.filename).write_text(source.text)
                count += 1
    return count


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    ap.add_argument("out", type=Path)
    ap.add_argument("--nets", default="vgg_a,overfeat_fast,cifar_small,digits",
                    help="example net names, or paths of net.json files")
    ap.add_argument("--targets", default="scalar:fp32,avx2:fp32,avx512:fp32,zen5:bf16,sapphirerapids:bf16")
    args = ap.parse_args()
    print(f"{dump(args.out, args.nets.split(','), args.targets.split(','))} files in {args.out}")


if __name__ == "__main__":
    main()
