"""LayerSpec × pass × Arch → KernelPlan: register and cache blocks from a balance model.

The model (DESIGN §6): an accumulator tile of `width` outputs (pixels, or minibatch rows
for fc) × `vectors` output-channel vectors lives in registers across the whole reduction.
Per inner step the kernel loads `vectors` weight vectors and broadcasts `width` inputs, then
issues width×vectors FMAs. A step takes at least
    max(FMAs / fma_units, loads / load_ports, fma_latency)
cycles (the last term: every accumulator carries one dependent FMA per step, and the
chains need LATENCY_HEADROOM times the bare latency × units to also hide the broadcast
loads and loop overhead), so the fraction of the FMA peak a tile can reach is (FMAs / fma_units) / that. Candidates must fit
the register file (width×vectors accumulators + vectors weights + 1 broadcast). Cache
blocks then keep the weights a tile streams within half of L1.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from .arch import Arch
from .errors import PlanError
from .netspec import LayerSpec

PASSES = ("fwd",)

# Independent accumulator chains needed, as a multiple of fma_latency × fma_units. Measured
# on VGG-A conv3 (AVX2, one thread): a 2x4 tile with exactly 8 chains ran at 75 GFLOP/s, a
# 6x2 tile with 12 chains at 80, and on the 28- and 14-wide layers the gap was 54 vs 74.
LATENCY_HEADROOM = 1.5


@dataclass(frozen=True)
class RegisterTile:
    width: int          # outputs along the broadcast dimension (pixels, or minibatch rows)
    vectors: int        # output-channel vectors
    registers: int      # accumulators + weight vectors + 1 broadcast
    loads_per_fma: float
    efficiency: float   # fraction of FMA peak this tile alone can reach

    @staticmethod
    def evaluate(width: int, vectors: int, arch: Arch) -> "RegisterTile":
        fmas = width * vectors
        loads = width + vectors
        cycles = max(fmas / arch.fma_units, loads / arch.load_ports, LATENCY_HEADROOM * arch.fma_latency)
        return RegisterTile(width, vectors, fmas + vectors + 1, loads / fmas,
                            (fmas / arch.fma_units) / cycles)

    def describe(self) -> str:
        return (f"{self.width}x{self.vectors} ({self.registers} regs, "
                f"{self.loads_per_fma:.2f} loads/FMA, {self.efficiency:.0%} of peak)")


@dataclass(frozen=True)
class KernelPlan:
    layer: str
    pass_name: str
    kind: str                       # conv_fwd | fc_fwd | maxpool_fwd
    isa: str
    vector_floats: int
    tile: RegisterTile | None = None
    remainders: tuple[int, ...] = ()  # narrower tiles emitted for edges (conv: the one interior remainder; fc: every batch remainder)
    ifm_block: int = 0              # conv: input-channel blocks per reduction chunk; fc: K elements per chunk
    ow_lo: int = 0                  # conv: first output column whose window needs no left padding
    ow_hi: int = 0                  # conv: one past the last column whose window needs no right padding
    predicted_efficiency: float = 0.0  # register-level model, averaged over full, remainder and border tiles
    l1_working_set: int = 0         # bytes of weights a tile streams per reduction chunk
    l2_bytes_per_flop: float = 0.0  # bytes brought into L1 per FLOP (weights + inputs + partial outputs)
    reason: str = ""
    rejected: tuple[RegisterTile, ...] = field(default=(), compare=False)

    def to_json(self) -> dict:
        d = {k: getattr(self, k) for k in (
            "layer", "pass_name", "kind", "isa", "vector_floats", "remainders", "ifm_block",
            "ow_lo", "ow_hi", "predicted_efficiency", "l1_working_set", "l2_bytes_per_flop", "reason")}
        d["remainders"] = list(self.remainders)
        d["tile"] = None if self.tile is None else {
            "width": self.tile.width, "vectors": self.tile.vectors, "registers": self.tile.registers,
            "loads_per_fma": round(self.tile.loads_per_fma, 4), "efficiency": round(self.tile.efficiency, 4)}
        d["predicted_efficiency"] = round(self.predicted_efficiency, 4)
        d["l2_bytes_per_flop"] = round(self.l2_bytes_per_flop, 5)
        return d


def blocks(channels: int, v: int) -> int:
    """Channel blocks of V (the last one zero-padded)."""
    return -(-channels // v)


def plan_layer(layer: LayerSpec, pass_name: str, arch: Arch) -> KernelPlan:
    if pass_name not in PASSES:
        raise PlanError(f"{layer.name}: pass {pass_name!r} is not generated yet (have: {', '.join(PASSES)})")
    if layer.type == "conv":
        return _plan_conv_fwd(layer, arch)
    if layer.type == "fc":
        return _plan_fc_fwd(layer, arch)
    if layer.type == "maxpool":
        return KernelPlan(layer.name, pass_name, "maxpool_fwd", arch.isa, arch.vector_floats,
                          reason="one vector of channels per output pixel, max over the window; "
                                 "memory-bound, no register tile to choose")
    raise PlanError(f"{layer.name}: layer type {layer.type} has no generated kernel")


def _candidates(max_width: int, vector_choices: list[int], arch: Arch) -> list[RegisterTile]:
    tiles = []
    for vectors in vector_choices:
        for width in range(1, max_width + 1):
            if width * vectors + vectors + 1 <= arch.vector_registers:
                tiles.append(RegisterTile.evaluate(width, vectors, arch))
    if not tiles:
        raise PlanError(f"{arch.name}: {arch.vector_registers} vector registers cannot hold any register tile")
    return tiles


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _row_efficiency(tile: RegisterTile, interior: int, border: int, arch: Arch) -> tuple[float, int]:
    """Peak fraction over one output row: full tiles, one remainder tile, 1-wide border tiles.
    Returns (efficiency, remainder width)."""
    full, rem = divmod(interior, tile.width)
    work = cycles = 0.0
    for count, width in ((full, tile.width), (1 if rem else 0, rem), (border, 1)):
        if count:
            t = RegisterTile.evaluate(width, tile.vectors, arch)
            fmas = width * tile.vectors * count
            work += fmas
            cycles += fmas / t.efficiency
    return work / cycles, rem


def _plan_conv_fwd(layer: LayerSpec, arch: Arch) -> KernelPlan:
    v = arch.vector_floats
    ic, ih, iw = layer.in_shape
    oc, oh, ow = layer.out_shape
    kh, kw = layer.kernel
    sh, sw = layer.stride
    ph, pw = layer.pad
    icb, ocb = blocks(ic, v), blocks(oc, v)
    # Columns whose whole window lies inside the input need no bounds: [ow_lo, ow_hi).
    ow_lo = min(ow, -(-pw // sw))
    ow_hi = max(ow_lo, min(ow, (iw + pw - kw) // sw + 1))
    interior, border = ow_hi - ow_lo, ow - (ow_hi - ow_lo)

    scored = []
    for tile in _candidates(max(1, min(interior, arch.vector_registers)), _divisors(ocb), arch):
        eff, rem = _row_efficiency(tile, interior, border, arch)
        scored.append((eff, tile.width * tile.vectors, -tile.registers, tile, rem))
    scored.sort(key=lambda s: s[:3], reverse=True)
    eff, _, _, tile, rem = scored[0]

    slice_bytes = tile.vectors * v * v * kh * kw * 4  # weights of one input-channel block
    ifb = max(1, min(icb, (arch.l1d_bytes // 2) // slice_bytes))
    # L2 → L1 traffic per output row of one oc-vector group, against its FLOPs.
    flops_row = 2 * ow * tile.vectors * v * icb * v * kh * kw
    weights_row = icb * slice_bytes
    inputs_row = icb * kh * iw * v * 4
    partials_row = 2 * math.ceil(icb / ifb) * ow * tile.vectors * v * 4
    l2_bpf = (weights_row + inputs_row + partials_row) / flops_row

    reason = (
        f"register tile {tile.width} px x {tile.vectors} oc-vectors: {tile.width * tile.vectors} accumulators "
        f"+ {tile.vectors} weights + 1 broadcast = {tile.registers}/{arch.vector_registers} registers, "
        f"{tile.loads_per_fma:.2f} loads/FMA, {tile.width * tile.vectors} independent chains "
        f"(latency {arch.fma_latency} x {arch.fma_units} FMA units x headroom {LATENCY_HEADROOM} needs "
        f"{LATENCY_HEADROOM * arch.fma_latency * arch.fma_units:g}); "
        f"row of {ow} px = {interior // tile.width} full tiles"
        + (f" + 1 of {rem}" if rem else "") + (f" + {border} border px" if border else "")
        + f" -> {eff:.0%} of peak predicted; ifm block {ifb}/{icb} channel blocks keeps the "
        f"{ifb * slice_bytes // 1024} KiB weight slice within half of L1 ({arch.l1d_bytes // 1024} KiB)"
    )
    return KernelPlan(layer.name, "fwd", "conv_fwd", arch.isa, v, tile, (rem,) if rem else (), ifb,
                      ow_lo, ow_hi, eff, ifb * slice_bytes, l2_bpf, reason,
                      tuple(s[3] for s in scored[1:6]))


def _plan_fc_fwd(layer: LayerSpec, arch: Arch) -> KernelPlan:
    v = arch.vector_floats
    c, h, w = layer.in_shape
    k = blocks(c, v) * v * h * w
    ocb = blocks(layer.out_shape[0], v)
    # The minibatch (tile width) is only known at run time: score the full tile.
    scored = sorted(_candidates(arch.vector_registers, _divisors(ocb), arch),
                    key=lambda t: (t.efficiency, t.width * t.vectors, -t.registers), reverse=True)
    tile = scored[0]
    per_k = (tile.vectors * v + tile.width) * 4  # weight panel + input rows, bytes per k
    kc = max(v, min(k, (arch.l1d_bytes // 2) // per_k // v * v))
    flops_per_k = 2 * tile.width * tile.vectors * v
    l2_bpf = per_k / flops_per_k
    reason = (
        f"GEMM register tile {tile.width} minibatch rows x {tile.vectors} out-vectors: "
        f"{tile.width * tile.vectors} accumulators + {tile.vectors} weights + 1 broadcast = "
        f"{tile.registers}/{arch.vector_registers} registers, {tile.loads_per_fma:.2f} loads/FMA -> "
        f"{tile.efficiency:.0%} of peak predicted; K chunk {kc} of {k} keeps the "
        f"{kc * per_k // 1024} KiB panel within half of L1"
    )
    return KernelPlan(layer.name, "fwd", "fc_fwd", arch.isa, v, tile,
                      tuple(range(tile.width - 1, 0, -1)), kc, 0, 0, tile.efficiency,
                      kc * per_k, l2_bpf, reason, tuple(scored[1:6]))
