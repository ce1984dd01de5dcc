"""Which generated kernels keep vector values on the stack: gcc's register allocation, per kernel.

    python benchmarks/spill_scan.py --zoo benchmarks/zoo/zoo.json --arch avx512 [--precision bf16]
        [--layers a,b] [--min 9] [--json out.json]

A register tile only runs at the FMA rate while its accumulators stay in registers. gcc decides
that, and has spilled them where the template gave it room to hold other values: broadcasts and
dy vectors that overlapping kernel columns read again (the packed first layer's forward and
backward-data: 56-67 stack accesses a kernel, 1.3-1.5x slower; the bf16 packed forward). This
compiles every kernel of every zoo shape (a bf16 build's shapes between ReLUs, as `bench` times
them) through the kernel cache and counts, in each library's
disassembly (`objdump`), the instructions that move a vector register (zmm, or ymm for AVX2) to
or from the stack, beside its vector FMAs and dot products. Where that count is a sizeable share
of the FMAs, read the kernel's loop (`pcldnn-gen inspect`, `objdump -d`). Nothing runs, so any
arch can be scanned on any x86 machine with the compiler.
"""
from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from pcldnn_gen.arch import get_arch
from pcldnn_gen.build import build
from pcldnn_gen.zoo import load_zoo

STACK = re.compile(r"\((%rsp|%rbp)\)")
FMA = re.compile(r"\s(vfn?madd\w*|vfn?msub\w*|vdpbf16ps|tdpbf16ps)\s")


@dataclass(frozen=True)
class KernelSpills:
    shape: str
    kernel: str         # the library: <layer>_<pass>
    stack: int          # vector register moves to or from the stack
    fmas: int           # vector FMA and dot-product instructions (static count, not executed)


def count(library: Path, register: str) -> tuple[int, int]:
    """(vector stack accesses, FMA instructions) in `library`'s disassembly."""
    listing = subprocess.run(["objdump", "-d", "--no-show-raw-insn", str(library)], capture_output=True, text=True,
                             check=True).stdout.splitlines()
    return (sum(1 for line in listing if register in line and STACK.search(line)),
            sum(1 for line in listing if FMA.search(line)))


def scan(zoo: Path, arch_name: str, precision: str, layers: set[str] | None, out: Path) -> list[KernelSpills]:
    arch = get_arch(arch_name)
    register = "%zmm" if arch.vector_floats == 16 else "%ymm"
    rows = []
    for shape in load_zoo(zoo):
        if layers and shape.name not in layers:
            continue
        net = shape.inner if precision == "bf16" else shape.net
        directory = build(net, arch, out / shape.name, precision=precision).directory
        for library in sorted((directory / "lib").glob(f"{shape.name}_*.so")):
            if library.stem.endswith("_layout"):
                continue
            rows.append(KernelSpills(shape.name, library.stem, *count(library, register)))
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    ap.add_argument("--zoo", type=Path, default=Path(__file__).resolve().parent / "zoo" / "zoo.json")
    ap.add_argument("--arch", default="avx512")
    ap.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    ap.add_argument("--layers", help="comma-separated zoo shapes (default all)")
    ap.add_argument("--min", type=int, default=9, help="list kernels with at least this many stack accesses")
    ap.add_argument("--json", type=Path, help="write every kernel's counts as JSON")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="pcldnn-spills-") as tmp:
        rows = scan(args.zoo, args.arch, args.precision, set(args.layers.split(",")) if args.layers else None,
                    Path(tmp))
    shown = sorted((r for r in rows if r.stack >= args.min), key=lambda r: -r.stack / max(1, r.fmas))
    print(f"{len(rows)} kernels ({args.arch}, {args.precision}); {len(shown)} with {args.min} or more vector "
          f"stack accesses:")
    for r in shown:
        print(f"  {r.kernel:<36} stack {r.stack:5d}   FMA instructions {r.fmas:6d}")
    if args.json:
        args.json.write_text(json.dumps({"arch": args.arch, "precision": args.precision,
                                         "kernels": [asdict(r) for r in rows]}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
