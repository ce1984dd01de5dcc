"""LayerSpec × pass × Arch → KernelPlan: register and cache blocks from a balance model.

The model (DESIGN §6): an accumulator tile of `width` outputs (pixels, or minibatch rows
for fc) × `vectors` output-channel vectors lives in registers across the whole reduction.
Per inner step the kernel loads `vectors` weight vectors and broadcasts `width` inputs, then
issues width×vectors FMAs. A step takes at least
    max(FMAs / fma_units, vector loads / load_ports + broadcasts / broadcasts_per_cycle, fma_latency)
cycles (the last term: every accumulator carries one dependent FMA per step, and the
chains need LATENCY_HEADROOM times the bare latency × units to also hide the broadcast
loads and loop overhead), so the fraction of the FMA peak a tile can reach is (FMAs / fma_units) / that. Candidates must fit
the register file (width×vectors accumulators + the shorter side of the tile held in
registers + 1 register the longer side streams through). Cache
blocks then keep the weights a tile streams within L1 (conv forward: the weight slice, input
rows and partial sums of a block of output rows within 3/4 of it, L2 -> L1 refills priced in
cycles).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pcldnn_runtime.abi import DROPOUT_HASH_STEP
from pcldnn_runtime.limits import blocks

# Passes each layer type has (the loss's bwd_data is the gradient of the mean loss w.r.t. the
# logits): one table, in the manifest schema the runtime validates builds against.
from pcldnn_runtime.manifest import LAYER_PASSES, PASSES  # noqa: F401

from .arch import Arch
from .errors import PlanError
from .netspec import LayerSpec

# Independent accumulator chains needed, as a multiple of fma_latency × fma_units. Measured
# on VGG-A conv3 (AVX2, one thread): a 2x4 tile with exactly 8 chains ran at 75 GFLOP/s, a
# 6x2 tile with 12 chains at 80, and on the 28- and 14-wide layers the gap was 54 vs 74.
LATENCY_HEADROOM = 1.5

# In conv forward and backward-data tiles, each weight vector comes from another channel
# block (tens of KiB apart): a separate stream. More than 4 ran far below the model's
# prediction: OverFeat-FAST conv2 backward-data (AVX2, one thread) at 43% of peak with a
# 1 x 12 tile against 56% with 4 x 3, both predicted above 90%.
WEIGHT_STREAMS = 4

# A backward-weights tile loads and stores its accumulators once per pixel block: column
# blocks narrower than this spend over 6% of the tile on that (OverFeat-FAST conv1, 10-column
# blocks: 45% of peak).
MIN_BLOCK_COLUMNS = 32

# Concurrent sequential streams the hardware prefetchers follow (Intel's L2 streamer tracks
# 32). Kernels whose reduction walks across rows of a large matrix chunk the reduction so that
# no more rows than this are live. Measured on VGG-A fc6 backward-data (AVX2, minibatch 64,
# one thread, interleaved runs, the kernel's earlier dot-product form): 589 ms unchunked (512
# rows), 602 ms with chunks of 4, 366 with 16, 317 with 32, 322 with 64.
PREFETCH_STREAMS = 32

# The minibatch is a run-time argument of the fc kernels; cache blocks along K are sized for
# this many rows (the targets' largest), and smaller minibatches only use less of the cache.
FC_PLAN_BATCH = 256


@dataclass(frozen=True)
class RegisterTile:
    width: int          # outputs along the broadcast dimension (pixels, or minibatch rows)
    vectors: int        # output-channel vectors
    registers: int      # accumulators + the shorter side held in registers + 1 streaming register
    loads_per_fma: float
    efficiency: float   # fraction of FMA peak this tile alone can reach

    @staticmethod
    def evaluate(width: int, vectors: int, arch: Arch) -> "RegisterTile":
        fmas = width * vectors
        loads = width + vectors
        load_cycles = vectors / arch.load_ports + width / arch.broadcasts_per_cycle
        cycles = max(fmas / arch.fma_units, load_cycles, LATENCY_HEADROOM * arch.fma_latency)
        return RegisterTile(width, vectors, fmas + min(width, vectors) + 1, loads / fmas,
                            (fmas / arch.fma_units) / cycles)

    def describe(self) -> str:
        return (f"{self.width}x{self.vectors} ({self.registers} regs, "
                f"{self.loads_per_fma:.2f} loads/FMA, {self.efficiency:.0%} of peak)")


@dataclass(frozen=True)
class KernelPlan:
    layer: str
    pass_name: str
    kind: str                       # <layer type>_<pass>, e.g. conv_fwd, fc_bwd_weights, maxpool_bwd_data
    isa: str
    vector_floats: int
    tile: RegisterTile | None = None
    remainders: tuple[int, ...] = ()  # narrower tiles emitted for edges
    chunk: int = 0                  # reduction chunk that keeps the streamed operand in cache ...
    chunk_unit: str = ""            # ... counted in these units
    ow_lo: int = 0                  # conv fwd: first output column whose window needs no left padding
    ow_hi: int = 0                  # conv fwd: one past the last column whose window needs no right padding
    predicted_efficiency: float = 0.0  # register-level model, averaged over full, remainder and border tiles
    l1_working_set: int = 0         # bytes of the operand a tile streams per reduction chunk
    l2_bytes_per_flop: float = 0.0  # bytes brought into L1 per FLOP
    reason: str = ""
    geometry: dict = field(default_factory=dict, compare=False)  # edge tables the template emits as constants
    scratch_floats: int = 0         # scratch the runtime passes in (conv bwd_data: transposed weights)
    rows: int = 1                   # conv fwd: output rows that share one chunk's weight slice in L1
    rejected: tuple[RegisterTile, ...] = field(default=(), compare=False)

    def to_json(self) -> dict:
        d = {k: getattr(self, k) for k in (
            "layer", "pass_name", "kind", "isa", "vector_floats", "chunk", "chunk_unit", "rows",
            "ow_lo", "ow_hi", "l1_working_set", "scratch_floats", "reason")}
        d["remainders"] = list(self.remainders)
        d["tile"] = None if self.tile is None else {
            "width": self.tile.width, "vectors": self.tile.vectors, "registers": self.tile.registers,
            "loads_per_fma": round(self.tile.loads_per_fma, 4), "efficiency": round(self.tile.efficiency, 4)}
        d["predicted_efficiency"] = round(self.predicted_efficiency, 4)
        d["l2_bytes_per_flop"] = round(self.l2_bytes_per_flop, 5)
        return d


_MEMORY_BOUND = {
    "maxpool_fwd": "one vector of channels per output pixel, max over the clipped window; the argmax "
                   "(index in the input plane, per lane) is kept for the backward pass",
    "maxpool_bwd_data": "scatter-add of each output gradient to its argmax; overlapping windows "
                        "accumulate, threads own whole (image, channel block) planes so no races",
    "avgpool_fwd": "one vector per output pixel, mean over the window (divisor: kernel area, padding counts as 0)",
    "avgpool_bwd_data": "each output gradient / kernel area added to its window; threads own whole planes",
    "relu_fwd": "elementwise max(x, 0) on the blocked buffer",
    "relu_bwd_data": "elementwise dy * (y > 0), using the forward output as the mask",
    "dropout_fwd": "elementwise keep/drop from a counter-based hash of (seed, element index): "
                   "deterministic for any thread count, nothing stored; kept values scaled by 1/(1-rate)",
    "dropout_bwd_data": "the forward mask recomputed from the same seed, applied to dy",
    "softmax_cross_entropy_fwd": "per row: max-shifted softmax, loss = log-sum-exp - logit[label], "
                                 "accumulated in double; mean over the minibatch",
    "softmax_cross_entropy_bwd_data": "(softmax - onehot(label)) / minibatch, padded lanes zero",
}


def plan_layer(layer: LayerSpec, pass_name: str, arch: Arch) -> KernelPlan:
    passes = LAYER_PASSES.get(layer.type, ())
    if pass_name not in passes:
        raise PlanError(f"{layer.name}: a {layer.type} layer has no {pass_name!r} pass "
                        f"(it has: {', '.join(passes) or 'none'})")
    planner = _PLANNERS.get((layer.type, pass_name))
    if planner is not None:
        return planner(layer, arch)
    kind = f"{layer.type}_{pass_name}"
    geometry = {}
    if layer.type == "dropout":
        # the scale in exponent form is a float literal in C even when it is whole (rate 0.5 -> 2)
        geometry = {"threshold": round(layer.rate * 2 ** 32), "scale": f"{1.0 / (1.0 - layer.rate):.9e}",
                    "hash_step": f"0x{DROPOUT_HASH_STEP:X}ULL"}  # the runtime shifts seeds by multiples of it
    return KernelPlan(layer.name, pass_name, kind, arch.isa, arch.vector_floats, geometry=geometry,
                      reason=_MEMORY_BOUND[kind] + "; memory-bound, no register tile to choose")


def _candidates(width_choices, vector_choices: list[int], arch: Arch) -> list[RegisterTile]:
    if isinstance(width_choices, int):
        width_choices = range(1, width_choices + 1)
    tiles = []
    for vectors in vector_choices:
        for width in width_choices:
            if width * vectors + min(width, vectors) + 1 <= arch.vector_registers:
                tiles.append(RegisterTile.evaluate(width, vectors, arch))
    if not tiles:
        raise PlanError(f"{arch.name}: {arch.vector_registers} vector registers cannot hold any register tile")
    return tiles


def _divisors(n: int, limit: int | None = None) -> list[int]:
    return [d for d in range(1, min(n, limit or n) + 1) if n % d == 0]


def _best(tiles: list[RegisterTile]) -> list[RegisterTile]:
    """Sorted best first: predicted efficiency, then bigger tiles (fewer loop trips), then fewer registers."""
    return sorted(tiles, key=lambda t: (t.efficiency, t.width * t.vectors, -t.registers), reverse=True)


def _tile_sentence(tile: RegisterTile, arch: Arch, rows: str, vectors: str) -> str:
    return (f"register tile {tile.width} {rows} x {tile.vectors} {vectors}: {tile.width * tile.vectors} "
            f"accumulators + {min(tile.width, tile.vectors)} held + 1 streamed = "
            f"{tile.registers}/{arch.vector_registers} registers, "
            f"{tile.loads_per_fma:.2f} loads/FMA")


def _edge_tile(layer: LayerSpec, start: int, width: int) -> dict:
    """A tile of output columns [start, start + width) at the edge of the row: for each kernel
    column, the (pixel, input column) pairs that read inside the input. The table is static, so
    the emitted tile issues FMAs for exactly those pairs and never tests a bound."""
    iw, kw, sw, pw = layer.in_shape[2], layer.kernel[1], layer.stride[1], layer.pad[1]
    taps = []
    for k in range(kw):
        pixels = [(p, (start + p) * sw - pw + k) for p in range(width) if 0 <= (start + p) * sw - pw + k < iw]
        if pixels:
            taps.append({"kw": k, "pixels": pixels})
    return {"start": start, "width": width, "taps": taps}


def _conv_row_plan(layer: LayerSpec, tile: RegisterTile, ow_lo: int, ow_hi: int, arch: Arch) -> tuple[float, dict]:
    """How one output row is covered with `tile`: an edge tile at each padded end when the row
    is wide enough (else 1-px border tiles), full tiles and one remainder in between. Returns
    the predicted fraction of peak over the row, and the geometry the template emits."""
    ow, kw, w = layer.out_shape[2], layer.kernel[1], tile.width
    left = ow_lo > 0 and ow_lo <= w and 2 * w <= ow
    right = ow_hi < ow and ow - ow_hi <= w and 2 * w <= ow
    mid_lo = w if left else ow_lo
    mid_hi = ow - w if right else ow_hi
    if mid_hi < mid_lo:
        left = right = False
        mid_lo, mid_hi = ow_lo, ow_hi
    full, rem = divmod(mid_hi - mid_lo, w)
    geometry: dict[str, Any] = {"left": _edge_tile(layer, 0, w) if left else None,
                "right": _edge_tile(layer, ow - w, w) if right else None,
                "mid_lo": mid_lo, "mid_hi": mid_hi, "rem": rem,
                "border_px": (0 if left else ow_lo) + (0 if right else ow - ow_hi)}
    work = cycles = 0.0

    def add(pixels: int, count: int = 1) -> None:
        nonlocal work, cycles
        if pixels and count:
            t = RegisterTile.evaluate(pixels, tile.vectors, arch)
            work += pixels * tile.vectors * count
            cycles += pixels * tile.vectors * count / t.efficiency

    add(w, full * kw)
    add(rem, kw)
    add(1, geometry["border_px"] * kw)
    for edge in (geometry["left"], geometry["right"]):
        for tap in edge["taps"] if edge else ():
            add(len(tap["pixels"]))
    return (work / cycles if work else 1.0), geometry  # a row of pure padding has nothing to compute


# Share of L1 a conv forward block (weight slice, input rows, partial sums) may fill; the rest
# absorbs conflict misses between its streams.
L1_BUDGET = 0.75


@dataclass(frozen=True)
class ConvFwdBlocking:
    chunk: int                  # input-channel blocks per reduction chunk
    rows: int                   # output rows per pass over a chunk
    weight_bytes: int           # the chunk's weight slice for one oc-vector group
    input_bytes: int            # the input rows those output rows read, chunk's channels
    partial_bytes: int          # the rows' partial sums
    l2_bytes_per_flop: float    # L2 -> L1 traffic of a row block, all chunks
    overhead: float             # instructions beyond the FMA stream: accumulators in and out per chunk
    refill_cycles_per_flop: float

    @property
    def working_set(self) -> int:
        return self.weight_bytes + self.input_bytes + self.partial_bytes


def _conv_fwd_blocking(layer: LayerSpec, tile: RegisterTile, slice_bytes: int, lanes: int,
                       arch: Arch) -> ConvFwdBlocking:
    """Reduction chunk and output-row block for conv forward: the pair whose working set fits
    L1_BUDGET of L1 and costs the fewest cycles per FLOP, counting the L2 -> L1 refills
    (the weight slice once per row block, each input row once per row block, the partial sums
    once) and the accumulator loads and stores every chunk adds to every tile."""
    v = arch.vector_floats
    ic, ih, iw = layer.in_shape
    oc, oh, ow = layer.out_shape
    kh, kw = layer.kernel
    icb = blocks(ic, v)
    row_flops = 2 * ow * tile.vectors * v * icb * lanes * kh * kw
    best = None
    for chunk in range(1, icb + 1):
        for rows in range(1, oh + 1):
            rows_in = min(ih, (rows - 1) * layer.stride[0] + kh)
            weights, inputs = chunk * slice_bytes, chunk * rows_in * iw * v * 4
            partials = rows * ow * tile.vectors * v * 4
            if weights + inputs + partials > L1_BUDGET * arch.l1d_bytes and (chunk, rows) != (1, 1):
                break  # more rows only grow the working set
            traffic = icb * slice_bytes + icb * rows_in * iw * v * 4 + 2 * partials
            bpf = traffic / (rows * row_flops)
            overhead = 1 + 2 / (chunk * lanes * kh * kw)
            refill = bpf / 64 * arch.l1_refill_cycles
            cost = overhead / (2 * v * arch.fma_units) + refill
            if best is None or cost < best[0] - 1e-12:
                best = (cost, ConvFwdBlocking(chunk, rows, weights, inputs, partials, bpf, overhead, refill))
    if best is None:
        raise PlanError(f"layer {layer.name}: no reduction chunk fits the caches")
    return best[1]


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

    # Weights of one input-channel block for one oc-vector group; with a single, partly filled
    # block (3-channel images) the kernel reads only the real lanes.
    lanes = ic if icb == 1 else v
    peak_flops_per_cycle = 2 * v * arch.fma_units
    scored = []
    for tile in _candidates(max(1, min(ow, arch.vector_registers)), _divisors(ocb, WEIGHT_STREAMS), arch):
        row_eff, geometry = _conv_row_plan(layer, tile, ow_lo, ow_hi, arch)
        slice_bytes = tile.vectors * v * lanes * kh * kw * 4
        blocking = _conv_fwd_blocking(layer, tile, slice_bytes, lanes, arch)
        eff = row_eff / (blocking.overhead + row_eff * blocking.refill_cycles_per_flop * peak_flops_per_cycle)
        # Roofline: the rows cannot run faster than L2 delivers their bytes.
        eff = min(eff, arch.l2_bytes_per_cycle / (blocking.l2_bytes_per_flop * peak_flops_per_cycle))
        scored.append((eff, tile.width * tile.vectors, -tile.registers, tile, geometry, slice_bytes, blocking, row_eff))
    scored.sort(key=lambda s: s[:3], reverse=True)
    eff, _, _, tile, geometry, slice_bytes, blocking, row_eff = scored[0]
    ifb, rows, l2_bpf = blocking.chunk, blocking.rows, blocking.l2_bytes_per_flop
    rem = geometry["rem"]

    reason = (
        f"register tile {tile.width} px x {tile.vectors} oc-vectors: {tile.width * tile.vectors} accumulators "
        f"+ {min(tile.width, tile.vectors)} held + 1 streamed = {tile.registers}/{arch.vector_registers} registers, "
        f"{tile.loads_per_fma:.2f} loads/FMA, {tile.width * tile.vectors} independent chains "
        f"(latency {arch.fma_latency} x {arch.fma_units} FMA units x headroom {LATENCY_HEADROOM} needs "
        f"{LATENCY_HEADROOM * arch.fma_latency * arch.fma_units:g}); "
        f"row of {ow} px = " + " + ".join(
            ([f"left edge tile of {tile.width}"] if geometry["left"] else [])
            + [f"{(geometry['mid_hi'] - geometry['mid_lo']) // tile.width} full tiles"]
            + ([f"1 of {rem}"] if rem else [])
            + ([f"right edge tile of {tile.width}"] if geometry["right"] else [])
            + ([f"{geometry['border_px']} border px"] if geometry["border_px"] else []))
        + f" ({row_eff:.0%} of the tile's peak)"
        + f"; ifm block {ifb}/{icb} channel blocks x {rows} output row{'s' if rows > 1 else ''}: "
        f"{ifb * slice_bytes // 1024} KiB weight slice + {blocking.input_bytes // 1024} KiB input rows "
        f"+ {blocking.partial_bytes // 1024} KiB partial sums = {blocking.working_set // 1024} KiB"
        + (" within" if blocking.working_set <= L1_BUDGET * arch.l1d_bytes else " (does not fit) against")
        + f" 3/4 of L1 ({arch.l1d_bytes // 1024} KiB), the weights read from L2 once per {rows} row"
        + f"{'s' if rows > 1 else ''} ({l2_bpf:.3f} B/FLOP at {arch.l1_refill_cycles:g} cycles per 64 B refill) "
        f"-> {eff:.0%} of peak predicted"
    )
    return KernelPlan(layer.name, "fwd", "conv_fwd", arch.isa, v, tile, (rem,) if rem else (), ifb,
                      "input-channel blocks", ow_lo, ow_hi, eff, blocking.working_set, l2_bpf, reason, rows=rows,
                      geometry=geometry, rejected=tuple(s[3] for s in scored[1:6]))


def _plan_fc_fwd(layer: LayerSpec, arch: Arch) -> KernelPlan:
    v = arch.vector_floats
    c, h, w = layer.in_shape
    k = blocks(c, v) * v * h * w
    ocb = blocks(layer.out_shape[0], v)
    # The minibatch (tile width) is only known at run time: score the full tile. Output
    # vectors need not divide OCB (the last group gets a narrower tile): fc8's 125 blocks
    # would otherwise allow only 1 or 5 vectors.
    scored = _best(_candidates(arch.vector_registers, list(range(1, ocb + 1)), arch))
    tile = scored[0]
    rem_n = ocb % tile.vectors
    per_k = (tile.vectors * v + tile.width) * 4  # weight panel + input rows, bytes per k
    # K chunk: every chunk reads and writes the output's partial sums once (4 MB for VGG-A fc7
    # at minibatch 256, beyond L2), so chunks are as long as the group's weight panel allows
    # while it stays within an eighth of L2 for all row tiles. Interleaved A/B at minibatch 256
    # (one thread) against chunks sized for half of L1: VGG-A fc6/fc7/fc8 1.05/1.22/1.18x,
    # OverFeat-FAST 1.05/1.32/1.25x; unchanged at minibatch 64.
    panel_per_k = tile.vectors * v * 4
    kc = max(v, min(k, (arch.l2_bytes // 8) // panel_per_k // v * v))
    flops_per_k = 2 * tile.width * tile.vectors * v
    l2_bpf = per_k / flops_per_k
    reason = (
        f"GEMM register tile {tile.width} minibatch rows x {tile.vectors} out-vectors: "
        f"{tile.width * tile.vectors} accumulators + {min(tile.width, tile.vectors)} held + 1 streamed = "
        f"{tile.registers}/{arch.vector_registers} registers, {tile.loads_per_fma:.2f} loads/FMA -> "
        f"{tile.efficiency:.0%} of peak predicted"
        + (f" (the last group of {rem_n} vector(s) with narrower tiles)" if rem_n else "")
        + f"; K chunk {kc} of {k}: the group's {kc * panel_per_k // 1024} KiB weight panel stays within an eighth "
        f"of L2 ({arch.l2_bytes // 1024} KiB) across the row tiles, and the output's partial sums pass through "
        f"the cache {-(-k // kc)} time(s)"
    )
    return KernelPlan(layer.name, "fwd", "fc_fwd", arch.isa, v, tile,
                      tuple(range(tile.width - 1, 0, -1)), kc, "K elements", 0, 0, tile.efficiency,
                      kc * panel_per_k, l2_bpf, reason, geometry={"rem_n": rem_n}, rejected=tuple(scored[1:6]))


def _valid_range(out_size: int, in_size: int, k: int, stride: int, pad: int) -> tuple[int, int]:
    """Outputs [lo, hi) whose tap `k` reads an input inside [0, in_size) (not padding)."""
    lo = 0
    while lo < out_size and lo * stride - pad + k < 0:
        lo += 1
    hi = out_size
    while hi > lo and (hi - 1) * stride - pad + k >= in_size:
        hi -= 1
    return lo, hi


def _bwd_data_phases(layer: LayerSpec) -> list[dict]:
    """Input columns iw = r + q*SW of one phase r all receive gradient from the same kernel
    columns kw = kw_first, kw_first+SW, ..., from output column ow = q + d, where d starts at
    d_first for kw_first and drops by one per step. Columns q in [q_lo, q_hi) see every such
    kw inside the output; the others need a bounds check."""
    iw, ow = layer.in_shape[2], layer.out_shape[2]
    kw, sw, pw = layer.kernel[1], layer.stride[1], layer.pad[1]
    phases = []
    for r in range(min(sw, iw)):
        q_count = -(-(iw - r) // sw)
        kw_first = (r + pw) % sw
        if kw_first >= kw:  # no kernel column lands on these input columns: their gradient is zero
            phases.append(dict(r=r, q_count=q_count, kw_first=kw_first, d_first=0, q_lo=0, q_hi=q_count))
            continue
        kw_last = kw_first + (kw - 1 - kw_first) // sw * sw
        d_first, d_last = (r + pw - kw_first) // sw, (r + pw - kw_last) // sw
        q_lo = min(q_count, max(0, -d_last))
        q_hi = max(q_lo, min(q_count, ow - d_first))
        phases.append(dict(r=r, q_count=q_count, kw_first=kw_first, d_first=d_first, q_lo=q_lo, q_hi=q_hi))
    return phases


def _bwd_data_row_plan(layer: LayerSpec, phase: dict, w: int) -> None:
    """Cover one phase's input columns q in [0, q_count): an edge tile of width w at each end
    whose columns need bounds, when the phase is wide enough (else 1-px border tiles), full
    tiles and one remainder between. Edge tiles list, per kernel column kw (output column
    q + d), the pixels whose output column exists: a static table, no bound is tested."""
    q_count, q_lo, q_hi = phase["q_count"], phase["q_lo"], phase["q_hi"]
    left = 0 < q_lo <= w and 2 * w <= q_count
    right = q_hi < q_count and q_count - q_hi <= w and 2 * w <= q_count
    mid_lo, mid_hi = (w if left else q_lo), (q_count - w if right else q_hi)
    if mid_hi < mid_lo:
        left = right = False
        mid_lo, mid_hi = q_lo, q_hi
    ow, kw_all, sw = layer.out_shape[2], layer.kernel[1], layer.stride[1]

    def edge(start: int) -> dict:
        taps = []
        for i, kw in enumerate(range(phase["kw_first"], kw_all, sw)):
            d = phase["d_first"] - i
            pixels = [(p, start + p + d) for p in range(w) if 0 <= start + p + d < ow]
            if pixels:
                taps.append({"kw": kw, "pixels": pixels})
        return {"start": start, "width": w, "taps": taps}

    phase.update(left=edge(0) if left else None, right=edge(q_count - w) if right else None,
                 mid_lo=mid_lo, mid_hi=mid_hi, rem=(mid_hi - mid_lo) % w)


def _plan_conv_bwd_data(layer: LayerSpec, arch: Arch) -> KernelPlan:
    v = arch.vector_floats
    icb, ocb = blocks(layer.in_shape[0], v), blocks(layer.out_shape[0], v)
    kh, kw = layer.kernel
    phases = _bwd_data_phases(layer)
    if icb == 1 and layer.in_shape[0] < v:
        return _plan_conv_bwd_data_few_channels(layer, arch, phases)
    widest = max(p["q_hi"] - p["q_lo"] for p in phases)
    scored = []
    for tile in _candidates(max(1, min(widest, arch.vector_registers)), _divisors(icb, WEIGHT_STREAMS), arch):
        work = cycles = 0.0
        planned = [dict(p) for p in phases]
        for p in planned:
            _bwd_data_row_plan(layer, p, tile.width)
            taps = len(range(p["kw_first"], kw, layer.stride[1]))
            border = (p["mid_lo"] if p["left"] is None else 0) + (p["q_count"] - p["mid_hi"] if p["right"] is None else 0)
            pieces = [(tile.width, (p["mid_hi"] - p["mid_lo"]) // tile.width * taps), (p["rem"], taps), (1, border * taps)]
            pieces += [(len(tap["pixels"]), 1) for e in (p["left"], p["right"]) if e for tap in e["taps"]]
            for width, count in pieces:
                if width and count:
                    fmas = width * tile.vectors * count
                    work += fmas
                    cycles += fmas / RegisterTile.evaluate(width, tile.vectors, arch).efficiency
        scored.append((work / cycles if work else 1.0, tile.width * tile.vectors, -tile.loads_per_fma, tile, planned))
    scored.sort(key=lambda s: s[:3], reverse=True)  # ties: more chains, then fewer loads per FMA
    eff, _, _, tile, phases = scored[0]
    slice_bytes = tile.vectors * v * v * kh * kw * 4  # transposed weights of one output-channel block
    ofb = max(1, min(ocb, (arch.l1d_bytes // 2) // slice_bytes))
    flops_row = 2 * layer.in_shape[2] * tile.vectors * v * ocb * v * kh * kw / (layer.stride[0] * layer.stride[1])
    l2_bpf = (ocb * slice_bytes + ocb * layer.out_shape[2] * v * 4 * kh / layer.stride[0]) / flops_row
    reason = (
        f"input-gradient {_tile_sentence(tile, arch, 'same-phase input px', 'ic-vectors')}; broadcasts of the "
        f"output gradient times transposed weights (IC/V, OC/V, KH, KW, V oc, V ic), written by this kernel's "
        f"prologue; stride {layer.stride[1]} splits each row into {len(phases)} phase(s) with their own kernel "
        f"columns -> {eff:.0%} of peak predicted; reduction chunk {ofb}/{ocb} output-channel blocks keeps the "
        f"{ofb * slice_bytes // 1024} KiB weight slice within half of L1"
    )
    return KernelPlan(layer.name, "bwd_data", "conv_bwd_data", arch.isa, v, tile,
                      tuple(sorted({p["rem"] for p in phases if p["rem"]}, reverse=True)), ofb,
                      "output-channel blocks", 0, 0, eff,
                      ofb * slice_bytes, l2_bpf, reason, geometry={"phases": phases},
                      scratch_floats=icb * ocb * kh * kw * v * v, rejected=tuple(s[3] for s in scored[1:6]))


def _plan_conv_bwd_data_few_channels(layer: LayerSpec, arch: Arch, phases: list[dict]) -> KernelPlan:
    """Fewer input channels than a vector (an RGB first layer): the general kernel's ic vectors
    would be mostly padding (3 of 8 lanes: kernel_profile counted 2.65x the ideal FMAs on VGG-A
    conv1), so this variant vectorises over the output channels, one accumulator per (input
    pixel, input channel), and sums each across lanes at the end. The tile holds the weights of
    all input channels for one tap and streams one dy vector per pixel."""
    v = arch.vector_floats
    lanes = layer.in_shape[0]
    widest = max(1, max(p["q_hi"] - p["q_lo"] for p in phases))
    width = max(1, min(widest, (arch.vector_registers - lanes - 1) // lanes))
    tile = RegisterTile.evaluate(width, lanes, arch)
    ocb = blocks(layer.out_shape[0], v)
    kh, kw = layer.kernel
    # Per input row: the kh/SH dy rows it reads, once from L2 (neighbouring pixels share them in L1).
    flops_row = 2 * layer.in_shape[2] * lanes * ocb * v * kh * kw / (layer.stride[0] * layer.stride[1])
    l2_bpf = (kh / layer.stride[0]) * layer.out_shape[2] * ocb * v * 4 / flops_row
    reason = (
        f"few-channel input gradient: {lanes} input channel(s) < {v} lanes, so vectors run over output "
        f"channels: {_tile_sentence(tile, arch, 'same-phase input px', 'input channels')} (a dy vector per "
        f"pixel times the weights' oc vector of each input channel, lanes summed once per pixel) -> "
        f"{tile.efficiency:.0%} of peak predicted with no padded lanes; stride {layer.stride[1]} splits each "
        f"row into {len(phases)} phase(s)"
    )
    # The one narrower tile each phase ends with (its column count modulo the width): only those
    # are emitted.
    remainders = tuple(sorted({max(0, p["q_hi"] - p["q_lo"]) % width for p in phases} - {0}, reverse=True))
    return KernelPlan(layer.name, "bwd_data", "conv_bwd_data", arch.isa, v, tile, remainders,
                      ocb, "output-channel blocks", 0, 0, tile.efficiency, ocb * lanes * kh * kw * v * 4, l2_bpf,
                      reason, geometry={"phases": phases, "few_channels": True}, scratch_floats=0)


def _plan_conv_bwd_weights(layer: LayerSpec, arch: Arch) -> KernelPlan:
    v = arch.vector_floats
    ic, ih, iw = layer.in_shape
    oc, oh, ow = layer.out_shape
    icb, ocb = blocks(ic, v), blocks(oc, v)
    kh, kw = layer.kernel
    sh, sw = layer.stride
    ph, pw = layer.pad
    # Input-channel lanes that carry data: with fewer channels than a vector (a first layer on
    # RGB images) the tiles cover only the real lanes and the padded ones are written as zeros.
    lanes = ic if icb == 1 else v
    # Output vectors need not divide OCB: the last group gets a narrower tile, so 4 lanes x 3
    # vectors (12 chains) is open to power-of-two channel counts. Score = work-weighted
    # efficiency of the full and the remainder group.
    scored = []
    for t in _candidates(_divisors(lanes, arch.vector_registers), list(range(1, ocb + 1)), arch):
        full, rest = divmod(ocb, t.vectors)
        cycles = full * t.vectors / t.efficiency
        if rest:
            cycles += rest / RegisterTile.evaluate(t.width, rest, arch).efficiency
        scored.append((ocb / cycles, t.width * t.vectors, -t.registers, t))
    scored.sort(key=lambda s: s[:3], reverse=True)
    eff, _, _, tile = scored[0]
    rem_n = ocb % tile.vectors
    # Output rows per pixel block: the block's output gradients and inputs stay in half of L2
    # while every weight tile (spread over the threads) reduces over them, and the slice one
    # tile streams (its oc vectors of dy, one input channel block) stays in half of L1, where
    # the next tiles (other kernel taps and lanes of the same oc vectors) find it again.
    per_row = (ocb * ow + icb * sh * iw) * v * 4
    per_row_tile = (tile.vectors * ow + sh * iw) * v * 4
    rows = max(1, min(oh, (arch.l2_bytes // 2) // per_row, (arch.l1d_bytes // 2) // per_row_tile))
    # A single row still too big for L1 (wide early layers) is cut into column blocks; the
    # tile then reads the input rows of all its kernel taps (kh) from L1 as well.
    cols = ow
    if rows == 1 and per_row_tile > arch.l1d_bytes // 2:
        per_col = (tile.vectors + kh * sw) * v * 4
        widest = max(MIN_BLOCK_COLUMNS, min(ow, (arch.l1d_bytes // 2) // per_col))
        cols = -(-ow // max(1, ow // widest))  # equal blocks, none narrower than `widest`
    flops_px = 2 * tile.width * tile.vectors * v
    l2_bpf = (tile.vectors * v + tile.width) * 4 / flops_px
    geometry = {"oh_range": [_valid_range(oh, ih, k, sh, ph) for k in range(kh)],
                "ow_range": [_valid_range(ow, iw, k, sw, pw) for k in range(kw)], "lanes": lanes, "rem_n": rem_n,
                "cols": cols}
    reason = (
        f"weight-gradient {_tile_sentence(tile, arch, 'ic lanes', 'oc-vectors')}: broadcast inputs times "
        f"output-gradient vectors, reduced over minibatch and output pixels"
        + (f" (the last group of {rem_n} vector(s) with a {tile.width}x{rem_n} tile)" if rem_n else "")
        + f" -> {eff:.0%} of peak predicted" + (f" on the {lanes} real input lanes" if lanes < v else "")
        + "; threads split the weight tiles (each weight has one owner and a fixed summation order, "
        f"so results do not depend on the thread count); pixel block of {rows}/{oh} output rows: "
        f"{rows * per_row // 1024} KiB of gradients and inputs within half of L2, "
        f"{rows * per_row_tile // 1024} KiB streamed per tile within half of L1"
        + (f" (cut into blocks of {cols}/{ow} columns)" if cols < ow else "")
    )
    return KernelPlan(layer.name, "bwd_weights", "conv_bwd_weights", arch.isa, v, tile, (), rows,
                      "output rows", 0, 0, eff, rows * per_row, l2_bpf, reason,
                      geometry=geometry, rejected=tuple(s[3] for s in scored[1:6]))


def _fc_k(layer: LayerSpec, v: int) -> int:
    c, h, w = layer.in_shape
    return blocks(c, v) * v * h * w


def _plan_fc_bwd_data(layer: LayerSpec, arch: Arch) -> KernelPlan:
    v = arch.vector_floats
    k, ocb = _fc_k(layer, v), blocks(layer.out_shape[0], v)
    # Tile: minibatch rows (broadcasts of dy) x vectors of consecutive input features; the
    # vector count divides K / V so that K blocks hold whole tiles.
    scored = _best(_candidates(arch.vector_registers, _divisors(k // v, arch.vector_registers), arch))
    tile = scored[0]
    chunk = min(ocb, PREFETCH_STREAMS)
    tile_k = tile.vectors * v
    # K block: the transposed slice of W one chunk covers (chunk x V features x kb) stays in a
    # quarter of L2 while every minibatch row tile passes over it; within the block a row
    # tile's dy (rows x chunk x V floats) stays in L1 across the k tiles.
    kb = max(tile_k, min(k, (arch.l2_bytes // 4) // (chunk * v * 4) // tile_k * tile_k))
    reason = (
        f"GEMM dX = dY . W: {_tile_sentence(tile, arch, 'minibatch rows', 'input-feature vectors')}; "
        f"broadcasts of dY times W transposed, reduced over chunks of {chunk}/{ocb} output-feature blocks -> "
        f"{tile.efficiency:.0%} of peak predicted; per K block of {kb} features a thread transposes the chunk's "
        f"W slice into a contiguous panel ({chunk * v * kb * 4 // 1024} KiB, within a quarter of L2) that "
        f"every row tile reuses"
    )
    return KernelPlan(layer.name, "bwd_data", "fc_bwd_data", arch.isa, v, tile,
                      remainders=tuple(range(tile.width - 1, 0, -1)), chunk=chunk, chunk_unit="output-feature blocks",
                      predicted_efficiency=tile.efficiency, l1_working_set=tile.width * v * chunk * 4,
                      l2_bytes_per_flop=(tile.width + tile.vectors * v) * 4 / (2 * tile.width * tile.vectors * v),
                      reason=reason, geometry={"k_block": kb}, rejected=tuple(scored[1:6]))


def _plan_fc_bwd_weights(layer: LayerSpec, arch: Arch) -> KernelPlan:
    v = arch.vector_floats
    k, ocb = _fc_k(layer, v), blocks(layer.out_shape[0], v)
    # Neither side of the tile needs to divide its dimension: the last K panel and the last
    # output-vector group get narrower tiles. A tile reduces over the whole minibatch, so the
    # output-gradient slice it loads (minibatch x vectors) must stay in half of L1 to be reused
    # by the next panel's tile; sized for FC_PLAN_BATCH rows.
    max_vectors = max(1, min(ocb, (arch.l1d_bytes // 2) // (FC_PLAN_BATCH * v * 4)))
    scored = _best(_candidates(arch.vector_registers, list(range(1, max_vectors + 1)), arch))
    tile = scored[0]
    rem_k, rem_n = k % tile.width, ocb % tile.vectors
    # K chunk: the packed input panels (minibatch x chunk) fill at most half of L2 at the
    # planning minibatch; every output-vector group sweeps them from L2.
    kc = max(tile.width, min(k, (arch.l2_bytes // 2) // (4 * FC_PLAN_BATCH) // tile.width * tile.width))
    reason = (
        f"packed-panel GEMM dW = dY^T . X into W's packed layout: "
        f"{_tile_sentence(tile, arch, 'input features', 'out-vectors')}"
        + (f"; the last panel has {rem_k} feature(s)" if rem_k else "")
        + (f"; the last group {rem_n} vector(s)" if rem_n else "")
        + f"; broadcast inputs times output-gradient vectors, reduced over the minibatch -> "
        f"{tile.efficiency:.0%} of peak predicted; the tile's dy slice ({FC_PLAN_BATCH} rows x {tile.vectors} "
        f"vectors = {FC_PLAN_BATCH * tile.vectors * v * 4 // 1024} KiB at minibatch {FC_PLAN_BATCH}) stays within half of L1; "
        f"K chunk {kc}/{k}: the input chunk is packed into contiguous {tile.width}-wide panels "
        f"({FC_PLAN_BATCH * kc * 4 // 1024} KiB, within half of L2) that every output-vector group reuses"
    )
    return KernelPlan(layer.name, "bwd_weights", "fc_bwd_weights", arch.isa, v, tile, (), kc,
                      "K elements", 0, 0, tile.efficiency, FC_PLAN_BATCH * tile.vectors * v * 4,
                      (tile.width + tile.vectors * v) * 4 / (2 * tile.width * tile.vectors * v),
                      reason, geometry={"rem_k": rem_k, "rem_n": rem_n}, rejected=tuple(scored[1:6]))


_PLANNERS = {
    ("conv", "fwd"): _plan_conv_fwd, ("conv", "bwd_data"): _plan_conv_bwd_data,
    ("conv", "bwd_weights"): _plan_conv_bwd_weights,
    ("fc", "fwd"): _plan_fc_fwd, ("fc", "bwd_data"): _plan_fc_bwd_data, ("fc", "bwd_weights"): _plan_fc_bwd_weights,
}
