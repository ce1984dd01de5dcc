"""What the running CPU can do: ISA flags, cache sizes, core count.

Read from /proc/cpuinfo and sysfs (Linux). Kept in the runtime so a node that only has a
build directory can still refuse kernels its CPU cannot execute, instead of dying by SIGILL.
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from pathlib import Path

from .errors import ArchError

# CPU flags (as /proc/cpuinfo spells them) that kernels of each ISA need.
ISA_FLAGS: dict[str, tuple[str, ...]] = {
    "scalar": (),
    "avx2": ("avx2", "fma"),
    "avx512": ("avx512f", "avx2", "fma"),
}


# The C compiler flags of each ISA: the only ones a build may use, so a build's ISA label and the
# instructions in its libraries cannot disagree (an arch file cannot slip -mavx512f into a
# "scalar" build that `pr.load` would then run on a CPU without AVX-512).
ISA_CFLAGS: dict[str, tuple[str, ...]] = {
    "scalar": (),
    "avx2": ("-mavx2", "-mfma"),
    "avx512": ("-mavx512f", "-mavx2", "-mfma"),
}
# Number formats of a build's kernels (`compile --precision`). bf16: bf16 activations and weight
# copy, fp32 accumulation (AVX512_BF16's vdpbf16ps: two bf16 products per fp32 lane, twice the
# fp32 FMA rate), on AVX-512 builds only; each adds its CPU flags and compiler flags to the ISA's.
PRECISIONS = ("fp32", "bf16")
PRECISION_ISAS: dict[str, tuple[str, ...]] = {"fp32": ("scalar", "avx2", "avx512"), "bf16": ("avx512",)}
PRECISION_FLAGS: dict[str, tuple[str, ...]] = {"fp32": (), "bf16": ("avx512_bf16",)}
PRECISION_CFLAGS: dict[str, tuple[str, ...]] = {"fp32": (), "bf16": ("-mavx512bf16",)}
# SIMD width of each ISA's kernels.
ISA_VECTOR_BITS: dict[str, int] = {"scalar": 32, "avx2": 256, "avx512": 512}


@functools.lru_cache(maxsize=1)
def _first_processor() -> dict[str, str]:
    """The fields of the first processor in /proc/cpuinfo (empty where unreadable)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return {}
    fields: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            if fields:
                break
            continue
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    return fields


def cpu_flags() -> frozenset[str]:
    """The ISA flags of the first processor (empty where unreadable)."""
    fields = _first_processor()
    return frozenset((fields.get("flags") or fields.get("Features") or "").split())


@dataclass(frozen=True)
class CpuIdentity:
    vendor: str       # GenuineIntel, AuthenticAMD, ... ("" where unknown)
    family: int       # cpuid family (6 for Intel cores since the Pentium Pro; 25 Zen 3/4, 26 Zen 5)
    model: int
    name: str         # the marketing name, as reported (a VM may shorten it)


def cpu_identity() -> CpuIdentity:
    fields = _first_processor()

    def number(key: str) -> int:
        text = fields.get(key, "")
        return int(text) if text.isdigit() else -1

    return CpuIdentity(fields.get("vendor_id", ""), number("cpu family"), number("model"), fields.get("model name", ""))


def supports(isa: str) -> bool:
    """True if this CPU has every flag that kernels of `isa` use."""
    if isa not in ISA_FLAGS:
        raise ArchError(f"unknown ISA {isa!r}; known: {', '.join(ISA_FLAGS)}")
    flags = cpu_flags()
    return all(f in flags for f in ISA_FLAGS[isa])


def require(isa: str, what: str) -> None:
    """Raise ArchError, before anything is executed, if this CPU cannot run `isa` code."""
    if not supports(isa):
        missing = [f for f in ISA_FLAGS[isa] if f not in cpu_flags()]
        raise ArchError(
            f"{what} needs ISA {isa!r} but this CPU lacks {', '.join(missing)}; "
            f"compile with --arch scalar or --arch native instead"
        )


def require_precision(precision: str, what: str) -> None:
    """Raise ArchError, before anything is executed, if this CPU lacks the instructions of
    `precision` kernels (bf16 without AVX512_BF16 would die by SIGILL)."""
    missing = [f for f in PRECISION_FLAGS[precision] if f not in cpu_flags()]
    if missing:
        raise ArchError(f"{what} is a {precision} build but this CPU lacks {', '.join(missing)}; "
                        f"compile it with --precision fp32 instead")


def best_isa() -> str:
    """The widest ISA whose kernels this CPU runs: the one `native` builds for."""
    for isa in ("avx512", "avx2"):
        if supports(isa):
            return isa
    return "scalar"


def usable_cores() -> int:
    """Cores this process may run on (affinity mask), the default OpenMP thread count."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def cache_sizes() -> dict[int, int]:
    """Data/unified cache size in bytes per level (1, 2, 3) of cpu0, from sysfs."""
    sizes: dict[int, int] = {}
    base = Path("/sys/devices/system/cpu/cpu0/cache")
    for index in sorted(base.glob("index*")):
        try:
            level = int((index / "level").read_text())
            kind = (index / "type").read_text().strip()
            size = (index / "size").read_text().strip()
        except (OSError, ValueError):
            continue
        if kind == "Instruction":
            continue
        mult = {"K": 1024, "M": 1024 * 1024}.get(size[-1:], 1)
        try:
            sizes[level] = int(size.rstrip("KM")) * mult
        except ValueError:
            continue
    return sizes
