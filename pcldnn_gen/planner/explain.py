"""The `reason` text of each plan: the figures behind a choice in one sentence, for the C
header and `pcldnn-gen inspect`. Arithmetic stays in the family modules; this only words it."""
from __future__ import annotations

from typing import Any

from ..arch import Arch
from ..netspec import LayerSpec
from .tiles import LATENCY_SLACK, RegisterTile, RowCover


def tile_sentence(tile: RegisterTile, arch: Arch, rows: str, vectors: str) -> str:
    return (f"register tile {tile.width} {rows} x {tile.vectors} {vectors}: {tile.width * tile.vectors} "
            f"accumulators + {min(tile.width, tile.vectors)} held + 1 streamed = "
            f"{tile.registers}/{arch.vector_registers} registers, "
            f"{tile.loads_per_fma:.2f} loads/FMA")


def conv_fwd(tile: RegisterTile, arch: Arch, ow: int, cover: RowCover, row_eff: float, icb: int, ifb: int,
             rows: int, weight_bytes: int, input_bytes: int, partial_bytes: int, fits: bool, l2_bpf: float,
             eff: float, streamed: bool, weights_streamed: bool = False, from_l3: bool = False) -> str:
    working_set = weight_bytes + input_bytes + partial_bytes
    blocking = (
        f"; the whole reduction ({icb} channel blocks) in the registers, each tile streaming its "
        f"{weight_bytes // 1024} KiB of weights from L2 ({l2_bpf:.3f} B/FLOP against L2's "
        f"{arch.l2_bytes_per_cycle} B/cycle), no partial sums between chunks" if weights_streamed else
        f"; ifm block {ifb}/{icb} channel blocks x {rows} output row{'s' if rows > 1 else ''}: "
        f"{weight_bytes // 1024} KiB weight slice + {input_bytes // 1024} KiB input rows "
        f"+ {partial_bytes // 1024} KiB partial sums = {working_set // 1024} KiB"
        + (" within" if fits else " (does not fit) against")
        + f" 3/4 of L1 ({arch.l1d_bytes // 1024} KiB), the weights read from L2 once per {rows} row"
        + f"{'s' if rows > 1 else ''} ({l2_bpf:.3f} B/FLOP at {arch.l1_refill_cycles:g} cycles per 64 B refill, "
        + f"the weight slice's sequential lines at {arch.slice_refill_cycles:g})"
        + ("; the group's slices of every chunk are beyond L2: L3's bandwidth bounds the rows" if from_l3 else ""))
    return (
        f"register tile {tile.width} px x {tile.vectors} oc-vectors: {tile.width * tile.vectors} accumulators "
        f"+ {min(tile.width, tile.vectors)} held + 1 streamed = {tile.registers}/{arch.vector_registers} registers, "
        f"{tile.loads_per_fma:.2f} loads/FMA, {tile.width * tile.vectors} independent chains "
        f"((latency {arch.fma_latency} + slack {LATENCY_SLACK}) x {arch.fma_units} units needs "
        f"{(arch.fma_latency + LATENCY_SLACK) * arch.fma_units}); "
        f"row of {ow} px = " + " + ".join(
            ([f"one edge tile of {cover.left.width} (the whole row)"] if cover.left and cover.mid_lo == ow else
             [f"left edge tile of {tile.width}"] if cover.left else [])
            + [f"{cover.full_tiles} full tiles"]
            + ([f"1 of {cover.rem}"] if cover.rem else [])
            + ([f"right edge tile of {tile.width}"] if cover.right else [])
            + ([f"{cover.border} border px"] if cover.border else []))
        + f" ({row_eff:.0%} of the tile's peak)"
        + blocking + f" -> {eff:.0%} of peak predicted"
        + ("; 1x1: each input pixel is read once per group, the next tile's prefetched into L2" if streamed else "")
    )


def conv_bwd_data(tile: RegisterTile, arch: Arch, stride: int, phases: int, row_eff: float, eff: float, ocb: int,
                  blocking: Any, rem_n: int = 0) -> str:
    b = blocking
    return (
        f"input-gradient {tile_sentence(tile, arch, 'same-phase input px', 'ic-vectors')}"
        + (f" (the last group of {rem_n} vector(s) with {tile.width}x{rem_n} tiles)" if rem_n else "")
        + "; broadcasts of the "
        f"output gradient times transposed weights (IC/V, OC/V, KH, KW, V oc, V ic), written by this kernel's "
        f"prologue; stride {stride} splits each row into {phases} phase(s) with their own kernel "
        f"columns ({row_eff:.0%} of the tile's peak); reduction chunk {b.chunk}/{ocb} output-channel blocks x "
        f"{b.rows} input row{'s' if b.rows > 1 else ''}: the {b.weight_bytes // 1024} KiB weight slice "
        + ("stays in L1 over the rows" if b.slice_kept else "is read from L2 once per row")
        + f", their {b.partial_bytes // 1024} KiB of partial sums "
        + ("stay in L1 beside it" if b.partials_stay else "pass through L2 once per chunk")
        + f" ({b.l2_bytes_per_flop:.3f} B/FLOP from L2 at {arch.l1_refill_cycles:g} cycles per 64 B refill)"
        + (f"; an ic-vector group's {b.beyond_l2_bytes // 1024} KiB of weights, beyond half of L2, "
           "once per row block" if b.beyond_l2_bytes else "")
        + f" -> {eff:.0%} of peak predicted"
    )


def conv_bwd_data_few(tile: RegisterTile, arch: Arch, lanes: int, stride: int, phases: int) -> str:
    v = arch.vector_floats
    return (
        f"few-channel input gradient: {lanes} input channel(s) < {v} lanes, so vectors run over output "
        f"channels: {tile_sentence(tile, arch, 'same-phase input px', 'input channels')} (a dy vector per "
        f"pixel times the weights' oc vector of each input channel, lanes summed once per pixel) -> "
        f"{tile.efficiency:.0%} of peak predicted with no padded lanes; stride {stride} splits each "
        f"row into {phases} phase(s)"
    )


def conv_bwd_weights(tile: RegisterTile, arch: Arch, eff: float, lanes: int, rem_n: int, taps: int, kw: int,
                     oh: int, ow: int, per_row: int, per_row_tile: int, rows: int, cols: int, streams: bool,
                     images: int = 1) -> str:
    v = arch.vector_floats
    unit = "ic lanes" if taps == 1 else f"(ic lanes x {taps} kernel columns)"
    return (
        f"weight-gradient {tile_sentence(tile, arch, unit, 'oc-vectors')}: broadcast inputs times "
        f"output-gradient vectors, reduced over minibatch and output pixels"
        + (f" (the last group of {rem_n} vector(s) with a {tile.width}x{rem_n} tile)" if rem_n else "")
        + (f" (the last {kw % taps} of {kw} kernel columns with a narrower tile)" if kw % taps else "")
        + f" -> {eff:.0%} of peak predicted" + (f" on the {lanes} real input lanes" if lanes < v else "")
        + "; threads split the weight tiles (each weight has one owner and a fixed summation order, "
        f"so results do not depend on the thread count); pixel block of {rows}/{oh} output rows"
        + (f" x {cols}/{ow} columns" if cols < ow else "")
        + (f" of {images} images (bands of whole images: {images * oh * ow} pixels)" if images > 1 else "")
        + f": {images * rows * per_row // 1024} KiB of gradients and inputs within half of L2, each tile loading and "
        f"storing its accumulators once a block and reading a {images * rows * per_row_tile * cols // ow // 1024} KiB slice "
        + (f"streamed from L2 ({tile.vectors} oc vectors: few enough streams)" if streams else
           "that stays in L1 for the next tiles")
    )


def fc_fwd(tile: RegisterTile, arch: Arch, rem_n: int, kc: int, k: int, panel_per_k: int) -> str:
    return (
        f"GEMM register tile {tile.width} minibatch rows x {tile.vectors} out-vectors: "
        f"{tile.width * tile.vectors} accumulators + {min(tile.width, tile.vectors)} held + 1 streamed = "
        f"{tile.registers}/{arch.vector_registers} registers, {tile.loads_per_fma:.2f} loads/FMA -> "
        f"{tile.efficiency:.0%} of peak predicted"
        + (f" (the last group of {rem_n} vector(s) with narrower tiles)" if rem_n else "")
        + f"; K chunk {kc} of {k}: the group's {kc * panel_per_k // 1024} KiB weight panel stays within an eighth "
        f"of L2 ({arch.l2_bytes // 1024} KiB) across the row tiles, and the output's partial sums pass through "
        f"the cache {-(-k // kc)} time(s)"
    )


def fc_bwd_data(tile: RegisterTile, arch: Arch, chunk: int, ocb: int, kb: int, rem_k: int) -> str:
    v = arch.vector_floats
    return (
        f"GEMM dX = dY . W: {tile_sentence(tile, arch, 'minibatch rows', 'input-feature vectors')}"
        + (f" (the last k tile {rem_k} vector{'s' if rem_k > 1 else ''})" if rem_k else "") + "; "
        f"broadcasts of dY times W transposed, reduced over chunks of {chunk}/{ocb} output-feature blocks -> "
        f"{tile.efficiency:.0%} of peak predicted; per K block of {kb} features a thread transposes the chunk's "
        f"W slice into a contiguous panel ({chunk * v * kb * 4 // 1024} KiB, within a quarter of L2) that "
        f"every row tile reuses"
    )


def fc_bwd_weights(tile: RegisterTile, arch: Arch, rem_k: int, rem_n: int, batch: int, kc: int, k: int) -> str:
    v = arch.vector_floats
    return (
        f"packed-panel GEMM dW = dY^T . X into W's packed layout: "
        f"{tile_sentence(tile, arch, 'input features', 'out-vectors')}"
        + (f"; the last panel has {rem_k} feature(s)" if rem_k else "")
        + (f"; the last group {rem_n} vector(s)" if rem_n else "")
        + f"; broadcast inputs times output-gradient vectors, reduced over the minibatch -> "
        f"{tile.efficiency:.0%} of peak predicted; the tile's dy slice ({batch} rows x {tile.vectors} "
        f"vectors = {batch * tile.vectors * v * 4 // 1024} KiB at minibatch {batch}) and its panel stream from L2 "
        f"where they outgrow L1 ({(tile.width + tile.vectors * v) * 4 / (2 * tile.width * tile.vectors * v):.2f} "
        f"bytes per FLOP); "
        f"K chunk {kc}/{k}: the input chunk is packed into contiguous {tile.width}-wide panels "
        f"({batch * kc * 4 // 1024} KiB, within half of L2) that every output-vector group reuses"
    )


def bf16_activations(pass_name: str, activations: tuple[bool, bool]) -> str:
    """What a conv kernel reads or writes of the activations stored as bf16 (families.bf16_outputs)."""
    roles = {"fwd": ("x read", "y written"), "bwd_data": (None, "the ReLU mask y read"),
             "bwd_weights": ("x read", "the ReLU mask y read")}[pass_name]
    said = [role for role, bf16 in zip(roles, activations) if bf16 and role]
    return f". bf16 activations: {', '.join(said)} as bf16, half the bytes" if said else ""


def bf16_gradients(pass_name: str, gradients: tuple[bool, bool]) -> str:
    """What a backward kernel reads or writes of the gradients stored as bf16 (families.bf16_gradients)."""
    said = [role for role, bf16 in zip(("dx written", "dy read"), gradients) if bf16]
    return f". bf16 gradients: {', '.join(said)} as bf16, half the bytes" if said else ""


def plane_as_row(layer: LayerSpec) -> str:
    """Why a 1x1 kernel's tiles run along the whole plane (conv.plane_as_row)."""
    _, h, w = layer.out_shape
    return (f". 1x1, stride 1, no padding: the {h}x{w} plane planned and generated as one row of {h * w} pixels "
            f"(a channel block's plane is contiguous: the same bytes), tiles no longer cut at {w}-pixel rows")
