"""CPU descriptions: presets, a JSON file, or `native` (read from the running CPU).

The planner sizes register and cache blocks from these numbers, so they are explicit
fields rather than guesses buried in templates.
"""
from __future__ import annotations

from dataclasses import MISSING, asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

from pcldnn_runtime import cpu
from pcldnn_runtime.families import Target
from pcldnn_runtime.validate import LABEL_RE, Fields, read_json, show

from .errors import ArchError

# ISAs whose kernels the code generator emits.
GENERATED_ISAS = ("scalar", "avx2", "avx512")
# Arch fields that are measured rates (fractional); every other numeric field is a count.
RATE_FIELDS = ("broadcasts_per_cycle", "l1_refill_cycles", "slice_refill_cycles", "dot_rate")


@dataclass(frozen=True)
class Arch:
    name: str
    isa: str                  # scalar | avx2 | avx512
    vector_bits: int          # SIMD width; 32 for scalar (one float)
    vector_registers: int     # architectural vector (or FP) registers
    fma_units: int            # FMA pipes per core
    l1d_bytes: int
    l2_bytes: int
    l3_bytes: int
    cores: int
    cflags: tuple[str, ...]   # ISA flags for the C compiler (never -march=native)
    fma_latency: int = 4      # cycles; with fma_units it sets how many accumulators hide latency
    # Cycles of vdpbf16ps (a bf16 build's dot product, issued at the FMA rate): the latency its
    # register tiles must hide in place of fma_latency. Zen 5: 6 against the FMA's 4
    # (`benchmarks/tile_microbench.py --latency` on the project's EPYC VM: 16 vdpbf16ps chains
    # reach the peak, 8 FMA chains 90% of it); bf16 plans with 14 accumulators (7x2) ran 0.95x
    # the 20 of 5x4 there.
    dot_latency: int = 4
    # FLOP rate of the vdpbf16ps kernels over the fp32 FMA kernels' on this CPU (a bf16 build's
    # dot products without AMX tiles): 2 where vdpbf16ps issues at the FMA's rate with a bf16
    # pair per lane (Zen 4, Zen 5: 1.98x measured on the project's EPYC VM, benchmarks/RESULTS.md);
    # 0.5 on Sapphire Rapids as issue 50 reports it for the project's Xeon (VGG-A conv4: ~115
    # GFLOP/s against the fp32 kernels' ~230: there AMX tiles are the bf16 engine). 1: not known.
    dot_rate: float = 1.0
    load_ports: int = 2       # vector loads per cycle from L1
    # Broadcast loads (one float to every lane) sustained per cycle alongside FMAs. They use
    # the load ports too but ran slower than vector loads: `benchmarks/tile_microbench.py`
    # here (AVX2, one thread, operands in L1) holds every Nx1 tile (N broadcasts + 1 vector
    # load per step) at 77-79% of the FMA peak for N = 8..14, while 1xN tiles (N vector loads
    # + 1 broadcast) reach 87-94%: 14x1 takes 9 cycles per step, i.e. ~1.6 broadcasts/cycle.
    broadcasts_per_cycle: float = 1.6
    # Sustained read bandwidth into L1 from L2, bytes per core cycle: the roofline term of the
    # planner's cache model (a block whose L1 working set overflows streams from L2). Measured
    # here (Sapphire-Rapids-class VM): 100 GB/s reading a 1 MiB buffer at ~3 GHz = 34 B/cycle;
    # Haswell through Ice Lake sustain 25-40.
    l2_bytes_per_cycle: int = 32
    # Core cycles one 64-byte L1 refill from L2 costs a kernel beyond its instructions: the
    # L2 latency the out-of-order window and the prefetchers do not hide. Calibrated on VGG-A
    # conv5 forward (AVX2, one thread): llvm-mca puts its instruction stream at 93% of the FMA
    # peak, it ran at 76% with 29 simulated L1 misses per 1000 FMAs (`benchmarks/kernel_profile.py`),
    # i.e. ~4 cycles per refill. It prices L2 -> L1 traffic where bandwidth alone would not.
    l1_refill_cycles: float = 4.0
    # The same for the lines of a conv forward kernel's weight slice, which it re-reads every row
    # block as one sequential stream that the prefetchers run ahead of. AVX-512 presets: 1
    # (Ice Lake VM: at 4 the planner held 3x3 and 5x5 layers to tiles of fewer oc vectors whose
    # slice fits L1 across two rows, AlexNet conv3-5 5x3 / 6x2 instead of 5x4 ran 1.21-1.42x
    # slower; benchmarks/RESULTS.md "Forward weight slices as a stream"). AVX2 and scalar keep 4:
    # there the lower price moved OverFeat-FAST conv3-5 to plans that ran 0.88-0.98x (3x4 tiles,
    # or 6x2 in two row blocks instead of one).
    slice_refill_cycles: float = 4.0
    # AMX bf16 tiles (Sapphire Rapids and later): a bf16 build's stride-1 convolutions (and fc forward passes) run on
    # tdpbf16ps (1024 FLOP per cycle and core, 16x the AVX-512 fp32 FMA rate: 3.4-3.6 TFLOP/s
    # measured on one core of the project's Xeon VM); `native` sets it where the CPU has the flags
    # and Linux grants the tile state. fp32 builds ignore it.
    amx: bool = False

    def target(self, precision: str) -> Target:
        """What the kernel families' choice needs of a build for this arch (families.choose)."""
        return Target(precision, self.amx, self.vector_floats)

    def for_dot_products(self) -> Arch:
        """This arch as the vdpbf16ps kernels' planner sees it: their dot product's latency in
        the place of the FMA's (the tile model's accumulator count follows it)."""
        return replace(self, fma_latency=self.dot_latency)

    @property
    def vector_floats(self) -> int:
        """Floats per vector register: the V of every blocked layout."""
        return self.vector_bits // 32

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["cflags"] = list(self.cflags)
        return d


KIB, MIB = 1024, 1024 * 1024

PRESETS: dict[str, Arch] = {
    # Generic: a Haswell-to-Sapphire-Rapids class core running 256-bit code: 16 ymm registers,
    # 2 FMA pipes of latency 4, 2 load ports; 32 KiB L1d, 1 MiB L2, 32 MiB L3.
    "avx2": Arch("avx2", "avx2", 256, 16, 2, 32 * KIB, 1 * MIB, 32 * MIB, 2, cpu.ISA_CFLAGS["avx2"]),
    # Generic: Skylake-SP and later with AVX-512: 32 zmm registers, 2 FMA pipes (1 on some SKUs).
    "avx512": Arch("avx512", "avx512", 512, 32, 2, 32 * KIB, 1 * MIB, 32 * MIB, 2, cpu.ISA_CFLAGS["avx512"],
                     slice_refill_cycles=1.0),
    # Portable C: one float per "vector", 16 FP registers, no FMA instruction assumed.
    "scalar": Arch("scalar", "scalar", 32, 16, 1, 32 * KIB, 1 * MIB, 32 * MIB, 2,
                   cpu.ISA_CFLAGS["scalar"], fma_latency=4, load_ports=2, broadcasts_per_cycle=2.0),
    # The families users have (vendors' optimization manuals; cache sizes per core, L3 per
    # socket or CCD as a typical part has it; `native` replaces the caches with what sysfs says).
    # Haswell / Broadwell: 2 FMA-256, latency 5, 256 KiB L2.
    "haswell": Arch("haswell", "avx2", 256, 16, 2, 32 * KIB, 256 * KIB, 20 * MIB, 2, cpu.ISA_CFLAGS["avx2"],
                    fma_latency=5),
    # Skylake-SP / Cascade Lake (Xeon Gold 6xxx, Platinum: two 512-bit FMA units), 1 MiB L2.
    "skylake-x": Arch("skylake-x", "avx512", 512, 32, 2, 32 * KIB, 1 * MIB, 22 * MIB, 2, cpu.ISA_CFLAGS["avx512"],
                        slice_refill_cycles=1.0),
    # Ice Lake-SP: 48 KiB L1d, 1.25 MiB L2.
    "icelake": Arch("icelake", "avx512", 512, 32, 2, 48 * KIB, 1280 * KIB, 48 * MIB, 2, cpu.ISA_CFLAGS["avx512"],
                      slice_refill_cycles=1.0),
    # Sapphire Rapids / Emerald Rapids: 48 KiB L1d, 2 MiB L2, AMX tiles.
    "sapphirerapids": Arch("sapphirerapids", "avx512", 512, 32, 2, 48 * KIB, 2 * MIB, 96 * MIB, 2,
                           cpu.ISA_CFLAGS["avx512"], amx=True, slice_refill_cycles=1.0, dot_rate=0.5),
    # Zen 3: AVX2 only, 2 FMA-256 of latency 4, 512 KiB L2, 32 MiB L3 per CCD.
    "zen3": Arch("zen3", "avx2", 256, 16, 2, 32 * KIB, 512 * KIB, 32 * MIB, 2, cpu.ISA_CFLAGS["avx2"]),
    # Zen 4: AVX-512 on two 256-bit pipes: a 512-bit FMA takes both, one per cycle (the AVX2
    # peak: 114-115 GFLOP/s for both ISAs on one thread of the project's EPYC VM). Planned as
    # two units all the same: with one, the model rates most tiles at 100% and stops telling them
    # apart, and its plans ran 0.89-1.05x the two-unit ones on VGG-A conv2-8 backward-weights
    # (0.96-1.04 on the other passes; benchmarks/ab.py, interleaved, 3 rounds); the extra
    # independent accumulators also cover the double-pumped latency. 32 KiB L1d, 1 MiB L2.
    "zen4": Arch("zen4", "avx512", 512, 32, 2, 32 * KIB, 1 * MIB, 32 * MIB, 2, cpu.ISA_CFLAGS["avx512"],
                   slice_refill_cycles=1.0, dot_rate=2.0),
    # Zen 5 (server, desktop): full 512-bit datapath, 2 FMA-512, 48 KiB L1d, 1 MiB L2.
    "zen5": Arch("zen5", "avx512", 512, 32, 2, 48 * KIB, 1 * MIB, 32 * MIB, 2, cpu.ISA_CFLAGS["avx512"],
                   slice_refill_cycles=1.0, dot_latency=6, dot_rate=2.0),
}

# Intel family-6 models of each preset (Intel's model table), newest parts of a family included
# where the core is the same (Cascade/Cooper Lake are Skylake-SP; Emerald Rapids is Sapphire Rapids).
_INTEL_MODELS = {
    "haswell": {0x3C, 0x3F, 0x45, 0x46, 0x3D, 0x47, 0x4F, 0x56},
    "skylake-x": {0x55},
    "icelake": {0x6A, 0x6C, 0x7D, 0x7E},
    "sapphirerapids": {0x8F, 0xCF},
}


def family_preset(identity: cpu.CpuIdentity, isa: str) -> str | None:
    """The preset of this CPU's family, if it is one we describe and it runs `isa` (a VM may
    hide AVX-512 from a Sapphire Rapids guest: then the family's figures do not apply)."""
    name = None
    if identity.vendor == "GenuineIntel" and identity.family == 6:
        name = next((n for n, models in _INTEL_MODELS.items() if identity.model in models), None)
    elif identity.vendor == "AuthenticAMD":
        # family 25 (0x19) is Zen 3 and Zen 4: the AVX-512 flag tells them apart
        name = {25: "zen4" if isa == "avx512" else "zen3", 26: "zen5"}.get(identity.family)
    return name if name and PRESETS[name].isa == isa else None


def host_family(isa: str) -> str | None:
    """The preset of the compiling CPU's family: by its model (family_preset), else, where a VM
    reports another model, an Intel CPU with AMX tiles is of the Sapphire Rapids class."""
    identity = cpu.cpu_identity()
    family = family_preset(identity, isa)
    if family is None and identity.vendor == "GenuineIntel" and isa == "avx512" and not cpu.amx_flags_missing():
        family = "sapphirerapids"
    return family


def slow_bf16_reason(arch: Arch) -> str | None:
    """Why a bf16 build for `arch` would run its dot products slower than an fp32 build, or None:
    no AMX tiles, and vdpbf16ps under the fp32 FMA's rate (Arch.dot_rate). The generic avx512
    preset is judged by the compiling CPU's family where we know it."""
    if arch.amx:
        return None
    rate, where = arch.dot_rate, arch.name
    if arch.name in ("avx512", "native-avx512") and (host := host_family("avx512")) is not None:
        rate, where = PRESETS[host].dot_rate, f"this CPU ({host} class)"
    if rate >= 1:
        return None
    tiles = " (--arch native where Linux grants them, or --arch sapphirerapids)" if "sapphirerapids" in where else ""
    return (f"--precision bf16 on {where} without AMX tiles: vdpbf16ps runs at {rate:g}x the fp32 kernels' rate "
            f"there, so this bf16 build's convolutions are slower than an fp32 build's; use AMX tiles{tiles} or "
            "--precision fp32")


def get_arch(spec: str) -> Arch:
    """A preset name, `native`, or the path of a JSON file with Arch's fields."""
    if spec in PRESETS:
        return PRESETS[spec]
    if spec == "native":
        return native_arch()
    path = Path(spec)
    if spec and (path.suffix == ".json" or (path.exists() and not path.is_dir())):
        return arch_from_file(path)
    raise ArchError(f"unknown arch {spec[:80]!r}: use one of {', '.join(PRESETS)}, native, or an arch JSON file")


def native_arch() -> Arch:
    """The running CPU: the widest ISA its flags allow, the figures of its family's preset where
    we know the family (else the ISA's generic preset), cache sizes from sysfs (clamped into the
    documented ranges: some VMs report odd ones), usable cores."""
    isa = cpu.best_isa()
    family = family_preset(cpu.cpu_identity(), isa)
    base = PRESETS[family or isa]
    caches = cpu.cache_sizes()

    def clamp(name: str, value: int, floor: int = 0) -> int:
        lo, hi = ARCH_RANGES[name]
        return int(min(max(value, lo, floor), hi))

    l1 = clamp("l1d_bytes", caches.get(1, base.l1d_bytes))
    l2 = clamp("l2_bytes", caches.get(2, base.l2_bytes), l1)
    l3 = clamp("l3_bytes", caches.get(3, base.l3_bytes), l2)
    return replace(base, name=f"native-{family or isa}", l1d_bytes=l1, l2_bytes=l2, l3_bytes=l3,
                   cores=clamp("cores", cpu.usable_cores()), amx=isa == "avx512" and cpu.request_amx() is None)


def arch_from_file(path: Path) -> Arch:
    return arch_from_dict(read_json(path, ArchError), str(path))


# Physical range of every numeric field: [lo, hi]. Register counts are capped by the ISA
# (ARCH_REGISTERS); cache sizes must also grow with the level.
ARCH_RANGES: dict[str, tuple[float, float]] = {
    "fma_units": (1, 4), "l1d_bytes": (4 << 10, 4 << 20), "l2_bytes": (64 << 10, 1 << 30),
    "l3_bytes": (64 << 10, 16 << 30), "cores": (1, 4096), "fma_latency": (1, 32), "dot_latency": (1, 32),
    "dot_rate": (0.1, 4),
    "load_ports": (1, 8),
    "broadcasts_per_cycle": (0.1, 16), "l2_bytes_per_cycle": (1, 1024), "l1_refill_cycles": (0.1, 1000),
    "slice_refill_cycles": (0.1, 1000),
}
ARCH_REGISTERS = {"scalar": 64, "avx2": 16, "avx512": 32}
MIN_REGISTERS = 4  # the smallest register tile: one accumulator, one weight vector, one broadcast


def arch_from_dict(data: Any, origin: str) -> Arch:
    """Validate an arch description: every field typed and within its range; `cflags`, when
    given, must be exactly the ISA's flags (they are derived from `isa` otherwise)."""
    f = Fields(origin, ArchError)
    names = {fld.name: fld for fld in fields(Arch)}
    required = {n for n, fld in names.items() if fld.default is MISSING} - {"cflags"}
    f.obj(data, "", required, set(names) - required)
    isa = f.choice(data["isa"], "isa", GENERATED_ISAS)
    values: dict[str, Any] = {
        "name": f.string(data["name"], "name", LABEL_RE, "letters, digits, '_', '.', '+', '-'; at most 64"),
        "isa": isa,
        "vector_registers": f.int_in(data["vector_registers"], "vector_registers", MIN_REGISTERS,
                                     ARCH_REGISTERS[isa]),
        "cflags": _cflags(f, data.get("cflags"), isa),
    }
    if data["vector_bits"] != cpu.ISA_VECTOR_BITS[isa] or isinstance(data["vector_bits"], bool):
        f.fail("vector_bits", f"{isa} vectors are {cpu.ISA_VECTOR_BITS[isa]} bits, got {show(data['vector_bits'])}")
    values["vector_bits"] = cpu.ISA_VECTOR_BITS[isa]
    for name, (lo, hi) in ARCH_RANGES.items():
        if name not in data:
            continue
        if name in RATE_FIELDS:
            values[name] = f.number_in(data[name], name, lo, hi)
        else:
            values[name] = f.int_in(data[name], name, int(lo), int(hi))
    if "amx" in data:
        values["amx"] = f.boolean(data["amx"], "amx")
        if values["amx"] and isa != "avx512":
            f.fail("amx", f"AMX tiles come with AVX-512 cores; this arch's isa is {isa}")
    if not values["l1d_bytes"] <= values["l2_bytes"] <= values["l3_bytes"]:
        f.fail("l2_bytes", f"cache sizes must grow with the level: L1d {values['l1d_bytes']}, "
               f"L2 {values['l2_bytes']}, L3 {values['l3_bytes']}")
    return Arch(**values)


def _cflags(f: Fields, given: Any, isa: str) -> tuple[str, ...]:
    """The ISA's compiler flags (cpu.ISA_CFLAGS). A description may list them, in any order,
    but no other flag: the flags decide which instructions the libraries contain."""
    want = cpu.ISA_CFLAGS[isa]
    if given is None:
        return want
    if not isinstance(given, list) or not all(isinstance(x, str) for x in given):
        f.fail("cflags", f"must be a list of compiler flags, got {show(given)}")
    for flag in given:
        if flag not in want:
            f.fail("cflags", f"flag {show(flag)} is not allowed for isa {isa} (the flags follow from the ISA: "
                   f"{' '.join(want) or 'none'}; omit cflags to use them)")
    if sorted(set(given)) != sorted(want) or len(given) != len(want):
        f.fail("cflags", f"isa {isa} is compiled with exactly {' '.join(want) or 'no ISA flags'}, got {show(given)}")
    return want
