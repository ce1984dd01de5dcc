"""CPU descriptions: presets, a JSON file, or `native` (read from the running CPU).

The planner sizes register and cache blocks from these numbers, so they are explicit
fields rather than guesses buried in templates.
"""
from __future__ import annotations

from dataclasses import MISSING, asdict, dataclass
from pathlib import Path
from typing import Any

from pcldnn_runtime import cpu
from pcldnn_runtime.manifest import checked_fields, read_json

from .errors import ArchError

# ISAs whose kernels the code generator emits.
GENERATED_ISAS = ("scalar", "avx2", "avx512")
# Arch fields that are measured rates (fractional); every other numeric field is a count.
RATE_FIELDS = ("broadcasts_per_cycle", "l1_refill_cycles")


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

    @property
    def vector_floats(self) -> int:
        """Floats per vector register: the V of every blocked layout."""
        return self.vector_bits // 32

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["cflags"] = list(self.cflags)
        return d


PRESETS: dict[str, Arch] = {
    # Haswell-to-Sapphire-Rapids class core running 256-bit code: 16 ymm registers, 2 FMA
    # pipes of latency 4, 2 load ports; 32 KiB L1d, 1 MiB L2, 32 MiB L3.
    "avx2": Arch("avx2", "avx2", 256, 16, 2, 32 * 1024, 1024 * 1024, 32 * 1024 * 1024, 2,
                 ("-mavx2", "-mfma")),
    # Skylake-SP and later with AVX-512: 32 zmm registers, 2 FMA pipes (1 on some SKUs).
    "avx512": Arch("avx512", "avx512", 512, 32, 2, 32 * 1024, 1024 * 1024, 32 * 1024 * 1024, 2,
                   ("-mavx512f", "-mavx2", "-mfma")),
    # Portable C: one float per "vector", 16 FP registers, no FMA instruction assumed.
    "scalar": Arch("scalar", "scalar", 32, 16, 1, 32 * 1024, 1024 * 1024, 32 * 1024 * 1024, 2,
                   (), fma_latency=4, load_ports=2, broadcasts_per_cycle=2.0),
}


def get_arch(spec: str) -> Arch:
    """A preset name, `native`, or the path of a JSON file with Arch's fields."""
    if spec in PRESETS:
        return PRESETS[spec]
    if spec == "native":
        return native_arch()
    path = Path(spec)
    if path.suffix == ".json" or path.exists():
        return arch_from_file(path)
    raise ArchError(f"unknown arch {spec!r}: use one of {', '.join(PRESETS)}, native, or an arch JSON file")


def native_arch() -> Arch:
    """The running CPU: best ISA from its flags, cache sizes from sysfs, usable cores."""
    isa = cpu.best_isa()
    base = PRESETS[isa]
    caches = cpu.cache_sizes()
    return Arch(
        name=f"native-{isa}", isa=isa, vector_bits=base.vector_bits,
        vector_registers=base.vector_registers, fma_units=base.fma_units,
        l1d_bytes=caches.get(1, base.l1d_bytes), l2_bytes=caches.get(2, base.l2_bytes),
        l3_bytes=caches.get(3, base.l3_bytes), cores=cpu.usable_cores(), cflags=base.cflags,
        fma_latency=base.fma_latency, load_ports=base.load_ports,
        broadcasts_per_cycle=base.broadcasts_per_cycle, l2_bytes_per_cycle=base.l2_bytes_per_cycle,
        l1_refill_cycles=base.l1_refill_cycles,
    )


def arch_from_file(path: Path) -> Arch:
    return arch_from_dict(read_json(path, ArchError), str(path))


def arch_from_dict(data: Any, origin: str) -> Arch:
    known = checked_fields(data, Arch, origin, ArchError)
    values: dict[str, Any] = {}
    for name, f in known.items():
        if name not in data:
            if f.default is not MISSING:  # optional field with a default
                continue
            raise ArchError(f"{origin}: {name}: missing required field")
        v = data[name]
        if name in ("name", "isa"):
            if not isinstance(v, str) or not v:
                raise ArchError(f"{origin}: {name}: must be a non-empty string, got {v!r}")
        elif name == "cflags":
            if not isinstance(v, list) or not all(isinstance(x, str) and x.startswith("-m") and
                                                  x.replace("-", "").replace("=", "").isalnum() for x in v):
                raise ArchError(f"{origin}: cflags: must be a list of -m ISA flags like \"-mavx2\", got {v!r}")
            if any("native" in x for x in v):
                raise ArchError(f"{origin}: cflags: -march/-mtune=native is not allowed: name the ISA")
            v = tuple(v)
        elif name in RATE_FIELDS:
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < 1e6:
                raise ArchError(f"{origin}: {name}: must be a positive number, got {v!r}")
            v = float(v)
        elif isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ArchError(f"{origin}: {name}: must be a positive int, got {v!r}")
        values[name] = v
    arch = Arch(**values)
    if arch.isa not in GENERATED_ISAS:
        raise ArchError(f"{origin}: isa: unknown ISA {arch.isa!r}; known: {', '.join(GENERATED_ISAS)}")
    if arch.vector_bits != PRESETS[arch.isa].vector_bits:
        raise ArchError(f"{origin}: vector_bits: {arch.isa} vectors are {PRESETS[arch.isa].vector_bits} bits, "
                        f"got {arch.vector_bits}")
    return arch
