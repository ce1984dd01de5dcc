"""What the running CPU can do: ISA flags, cache sizes, core count.

Read from /proc/cpuinfo and sysfs (Linux). Kept in the runtime so a node that only has a
build directory can still refuse kernels its CPU cannot execute, instead of dying by SIGILL.
"""
from __future__ import annotations

import ctypes
import functools
import os
import platform
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
# AMX (Sapphire Rapids on): bf16 builds for an arch with `amx` run their stride-1 convolution
# forward on tile registers (tdpbf16ps: a 16x32 by 32x16 bf16 product into 16x16 fp32 per
# instruction). Linux hands a process the 8 KiB tile state only after it asks (arch_prctl
# ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA); without that the first tile instruction faults.
AMX_FLAGS = ("amx_tile", "amx_bf16")
AMX_CFLAGS = ("-mamx-tile", "-mamx-bf16")
_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA = 158, 0x1023, 18
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


# ISA levels, each running everything below it: what `PCLDNN_MAX_ISA` caps (docs/design.md,
# "Capping the ISA"), as oneDNN's ONEDNN_MAX_CPU_ISA. Each level adds these cpuinfo flags
# (a trailing * stands for a family: every AVX-512 extension, every AMX one).
ISA_LEVELS = ("scalar", "avx2", "avx512", "avx512_bf16", "amx")
_LEVEL_FLAGS: dict[str, tuple[str, ...]] = {
    "scalar": (), "avx2": ("avx2", "fma"), "avx512": ("avx512*",), "avx512_bf16": ("avx512_bf16",), "amx": ("amx*",)}
MAX_ISA_VARIABLE = "PCLDNN_MAX_ISA"


def max_isa() -> str | None:
    """The cap `PCLDNN_MAX_ISA` sets (None when unset or empty); an unknown value is an error."""
    value = os.environ.get(MAX_ISA_VARIABLE, "").strip().lower()
    if not value:
        return None
    if value not in ISA_LEVELS:
        raise ArchError(f"{MAX_ISA_VARIABLE}={value[:40]!r} is not an ISA level; use one of {', '.join(ISA_LEVELS)}")
    return value


def _flag_level(flag: str) -> int:
    """The index in ISA_LEVELS of the level `flag` belongs to, -1 for none (an exact name wins
    over a family: avx512_bf16 is the bf16 level's, not avx512's)."""
    exact = [i for i, level in enumerate(ISA_LEVELS) if flag in _LEVEL_FLAGS[level]]
    family = [i for i, level in enumerate(ISA_LEVELS)
              if any(p.endswith("*") and flag.startswith(p[:-1]) for p in _LEVEL_FLAGS[level])]
    return (exact or family or [-1])[0]


def raw_cpu_flags() -> frozenset[str]:
    """The ISA flags of the first processor as the kernel reports them (empty where unreadable)."""
    fields = _first_processor()
    return frozenset((fields.get("flags") or fields.get("Features") or "").split())


def cpu_flags() -> frozenset[str]:
    """The ISA flags this process believes the CPU has: the real ones, less those of the levels
    above `PCLDNN_MAX_ISA`. Every ISA decision (native, the runtime's checks, the tests' skips)
    reads this."""
    flags = raw_cpu_flags()
    cap = max_isa()
    return flags if cap is None else frozenset(f for f in flags if _flag_level(f) <= ISA_LEVELS.index(cap))


def isa_level() -> str:
    """The highest ISA level this process runs (after the cap): amx only where Linux grants the
    tile state too."""
    flags = cpu_flags()
    needs = {"avx2": ISA_FLAGS["avx2"], "avx512": ISA_FLAGS["avx512"], "avx512_bf16": PRECISION_FLAGS["bf16"],
             "amx": AMX_FLAGS}
    level = "scalar"
    for name in ISA_LEVELS[1:]:
        if not all(f in flags for f in needs[name]) or (name == "amx" and request_amx() is not None):
            break
        level = name
    return level


def capped(text: str) -> str:
    """`text` ("this CPU") with the cap named where one is set: an error then says why."""
    cap = max_isa()
    return f"{text} (capped by {MAX_ISA_VARIABLE}={cap})" if cap else text


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
            f"{what} needs ISA {isa!r} but {capped('this CPU')} lacks {', '.join(missing)}; "
            f"compile with --arch scalar or --arch native instead"
        )


def require_precision(precision: str, what: str, instead: str = "compile it with --precision fp32 instead") -> None:
    """Raise ArchError, before anything is executed, if this CPU lacks the instructions of
    `precision` kernels (bf16 without AVX512_BF16 would die by SIGILL)."""
    missing = [f for f in PRECISION_FLAGS[precision] if f not in cpu_flags()]
    if missing:
        raise ArchError(f"{what} is a {precision} build but {capped('this CPU')} lacks {', '.join(missing)}; {instead}")


def amx_flags_missing() -> list[str]:
    """The AMX flags this CPU lacks (a VM may hide them from a Sapphire Rapids guest)."""
    return [f for f in AMX_FLAGS if f not in cpu_flags()]


def request_amx() -> str | None:
    """Ask Linux for the AMX tile state (once per process; every thread then may use it).
    None when granted, else why not (what `require_amx` reports)."""
    missing = amx_flags_missing()
    if missing:
        return f"{capped('this CPU')} lacks {', '.join(missing)}"
    return _request_tile_state()


@functools.lru_cache(maxsize=1)
def _request_tile_state() -> str | None:
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return "AMX tiles are requested through Linux's arch_prctl on x86-64 only"
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.syscall(_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA) != 0:
        err = ctypes.get_errno()
        return f"Linux refused the AMX tile state (arch_prctl ARCH_REQ_XCOMP_PERM: {os.strerror(err)})"
    return None


def require_amx(what: str) -> None:
    """Raise ArchError, before anything is executed, if `what` (a build with AMX kernels) cannot
    use AMX tiles here: the CPU lacks them or the kernel does not grant their state."""
    reason = request_amx()
    if reason is not None:
        raise ArchError(f"{what} runs AMX tile kernels but {reason}; compile it for an arch without AMX "
                        f"(e.g. --arch avx512) instead")


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
