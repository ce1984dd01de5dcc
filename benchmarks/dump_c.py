"""Render every kernel and layout file of the example nets for every ISA into a folder, without
compiling: the before/after check of a change that must leave the generated C unchanged.

    python benchmarks/dump_c.py /tmp/before        # on the old tree
    python benchmarks/dump_c.py /tmp/after         # on the new tree
    diff -r /tmp/before /tmp/after
"""
from __future__ import annotations

import argparse
from pathlib import Path

from pcldnn_gen.arch import PRESETS
from pcldnn_gen.build import plan_net
from pcldnn_gen.codegen import render_kernel, render_layout
from pcldnn_gen.netspec import load_netspec

NETS = Path(__file__).resolve().parent.parent / "examples" / "nets"


def dump(out: Path, nets: list[str], isas: list[str]) -> int:
    """Write out/<net>-<isa>/<layer>_<pass>.c; returns the number of files."""
    count = 0
    for net_name in nets:
        net = load_netspec(NETS / f"{net_name}.json")
        for isa in isas:
            arch = PRESETS[isa]
            folder = out / f"{net_name}-{isa}"
            folder.mkdir(parents=True, exist_ok=True)
            plans = plan_net(net, arch)
            for layer in net.layers:
                sources = [render_kernel(layer, plan, arch) for (name, _), plan in plans.items() if name == layer.name]
                for source in [*sources, render_layout(layer, arch)]:
                    (folder / source.filename).write_text(source.text)
                    count += 1
    return count


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--nets", default="vgg_a,overfeat_fast,cifar_small,digits")
    ap.add_argument("--isas", default="scalar,avx2,avx512")
    args = ap.parse_args()
    print(f"{dump(args.out, args.nets.split(','), args.isas.split(','))} files in {args.out}")


if __name__ == "__main__":
    main()
