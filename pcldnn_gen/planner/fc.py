"""Fully-connected kernels: GEMMs over packed panels, the minibatch a run-time argument."""
from __future__ import annotations

import statistics
from collections.abc import Callable

from pcldnn_runtime.limits import blocks

from ..arch import Arch
from ..netspec import LayerSpec
from . import explain
from .plans import FcBwdDataPlan, FcBwdWeightsPlan, FcFwdPlan
from .tiles import RegisterTile, candidates, pieces_efficiency, put_first

# Concurrent sequential streams the hardware prefetchers follow (Intel's L2 streamer tracks
# 32). Kernels whose reduction walks across rows of a large matrix chunk the reduction so that
# no more rows than this are live. Measured on VGG-A fc6 backward-data (AVX2, minibatch 64,
# one thread, interleaved runs, the kernel's earlier dot-product form): 589 ms unchunked (512
# rows), 602 ms with chunks of 4, 366 with 16, 317 with 32, 322 with 64.
PREFETCH_STREAMS = 32

# The minibatch is a run-time argument of the fc kernels; cache blocks along K are sized for
# this many rows (the targets' largest), and smaller minibatches only use less of the cache.
FC_PLAN_BATCH = 256

# ... and register tiles are scored over these minibatches: each splits into full row tiles and
# one narrower remainder, which can be latency-bound (a 14x2 tile leaves a 2x2 one, 4 chains, at
# minibatch 16). Against scoring the full tile alone (VGG-A fc6-8 forward and backward-data,
# benchmarks/ab.py, EPYC VM, one thread, minibatch 16 / 64 / 256): AVX-512 8x3 and 8x2 instead
# of 14x2, 0.98-1.62x (median 1.31x); AVX2 4x3 and 3x4 instead of 6x2, 0.93-1.20x (median 1.05x;
# the losses, 0.93-0.99, on fc6 / fc8 forward at minibatch 64-256 and fc8 backward-data).
SCORE_BATCHES = (16, 32, 64, 128, 256)


def _l2_roof(t: RegisterTile, arch: Arch) -> float:
    """The fraction of the FMA peak a tile reaches when both its streams (vectors and
    broadcasts) come from L2 at every step: arch.l2_bytes_per_cycle over the bytes it needs."""
    v = arch.vector_floats
    bytes_per_flop = (t.vectors * v + t.width) * 4 / (2 * t.width * t.vectors * v)
    return arch.l2_bytes_per_cycle / (bytes_per_flop * 2 * v * arch.fma_units)


def _rows_scored(tiles: list[RegisterTile], arch: Arch) -> list[RegisterTile]:
    """Tiles whose width is minibatch rows, best first: mean over SCORE_BATCHES of the
    work-weighted efficiency of full and remainder row tiles, capped by the L2 roofline of the
    panel a tile streams (every row tile reads its vectors' weights again: few rows, many
    bytes per FLOP), then more accumulators."""
    def score(t: RegisterTile) -> float:
        return statistics.fmean(min(_l2_roof(t, arch), pieces_efficiency([(t.width, b // t.width), (b % t.width, 1)],
                                                                          t.vectors, arch)) for b in SCORE_BATCHES)
    return _ranked(tiles, score)


def _ranked(tiles: list[RegisterTile], score: Callable[[RegisterTile], float]) -> list[RegisterTile]:
    """Best score first; ties: more accumulators, then fewer registers."""
    return sorted(tiles, key=lambda t: (round(score(t), 6), t.width * t.vectors, -t.registers), reverse=True)


def _k(layer: LayerSpec, v: int) -> int:
    c, h, w = layer.in_shape
    return blocks(c, v) * v * h * w


def plan_fc_fwd(layer: LayerSpec, arch: Arch, choice: tuple[int, int] | None = None) -> FcFwdPlan:
    v = arch.vector_floats
    k, ocb = _k(layer, v), blocks(layer.out_shape[0], v)
    # The minibatch (tile width) is only known at run time: score the full tile. Output
    # vectors need not divide OCB (the last group gets a narrower tile): fc8's 125 blocks
    # would otherwise allow only 1 or 5 vectors.
    scored = put_first(_rows_scored(candidates(arch.vector_registers, range(1, ocb + 1), arch), arch), choice)
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
    # The minibatch is a run-time argument: every narrower row count can occur (and every
    # vector count: FcFwdPlan.vector_counts).
    return FcFwdPlan(
        layer=layer.name, pass_name="fwd", kind="fc_fwd", template="fc_fwd.c.j2", isa=arch.isa, vector_floats=v,
        reason=explain.fc_fwd(tile, arch, rem_n, kc, k, panel_per_k), tile=tile,
        tile_widths=tuple(range(tile.width, 0, -1)), remainders=tuple(range(tile.width - 1, 0, -1)),
        predicted_efficiency=tile.efficiency, l1_working_set=kc * panel_per_k,
        l2_bytes_per_flop=per_k / (2 * tile.width * tile.vectors * v), rejected=tuple(scored[1:6]),
        k_chunk=kc, rem_vectors=rem_n)


def plan_fc_bwd_data(layer: LayerSpec, arch: Arch, choice: tuple[int, int] | None = None) -> FcBwdDataPlan:
    v = arch.vector_floats
    k, ocb = _k(layer, v), blocks(layer.out_shape[0], v)
    # Tile: minibatch rows (broadcasts of dy) x vectors of consecutive input features; the
    # vector count need not divide K / V (the layer's last k tile is narrower): a K of 257
    # blocks (4112 inputs) otherwise allowed only one vector, 28x1 tiles, 0.36x the speed of
    # the 4096 inputs next to it (AVX-512, minibatch 256, Ice Lake VM).
    scored = put_first(_rows_scored(candidates(arch.vector_registers, range(1, k // v + 1), arch), arch), choice)
    tile = scored[0]
    rem_k = (k // v) % tile.vectors
    chunk = min(ocb, PREFETCH_STREAMS)
    tile_k = tile.vectors * v
    # K block: the transposed slice of W one chunk covers (chunk x V features x kb) stays in a
    # quarter of L2 while every minibatch row tile passes over it; within the block a row
    # tile's dy (rows x chunk x V floats) stays in L1 across the k tiles. A multiple of the
    # tile's features, as the panel is laid out (the last K block may end inside its tile).
    kb = max(tile_k, min(-(-k // tile_k) * tile_k, (arch.l2_bytes // 4) // (chunk * v * 4) // tile_k * tile_k))
    return FcBwdDataPlan(
        layer=layer.name, pass_name="bwd_data", kind="fc_bwd_data", template="fc_bwd_data.c.j2", isa=arch.isa,
        vector_floats=v, reason=explain.fc_bwd_data(tile, arch, chunk, ocb, kb, rem_k), tile=tile,
        tile_widths=tuple(range(tile.width, 0, -1)), remainders=tuple(range(tile.width - 1, 0, -1)),
        predicted_efficiency=tile.efficiency, l1_working_set=tile.width * v * chunk * 4,
        l2_bytes_per_flop=(tile.width + tile.vectors * v) * 4 / (2 * tile.width * tile.vectors * v),
        rejected=tuple(scored[1:6]), ofm_chunk=chunk, k_block=kb, rem_vectors=rem_k)


def plan_fc_bwd_weights(layer: LayerSpec, arch: Arch, choice: tuple[int, int] | None = None) -> FcBwdWeightsPlan:
    v = arch.vector_floats
    k, ocb = _k(layer, v), blocks(layer.out_shape[0], v)
    # Neither side of the tile needs to divide its dimension: the last K panel and the last
    # output-vector group get narrower tiles. A tile reduces over the whole minibatch; its dy
    # slice (minibatch x vectors) and its panel stream from L2 where they outgrow L1, so tiles
    # rank by the register model capped by that L2 roofline. Keeping the dy slice within half of
    # L1 instead (one vector at minibatch 256 on a 32-48 KiB L1: 30x1 tiles, a broadcast per FMA)
    # measured 1.3-1.7x slower than 14x2 on VGG-A fc6-fc8 at minibatch 16-256 (Ice Lake VM,
    # interleaved A/B; RESULTS.md "fc backward-weights tiles").
    scored = put_first(_ranked(candidates(arch.vector_registers, range(1, ocb + 1), arch),
                               lambda t: min(t.efficiency, _l2_roof(t, arch))), choice)
    tile = scored[0]
    rem_k, rem_n = k % tile.width, ocb % tile.vectors
    # K chunk: the packed input panels (minibatch x chunk) fill at most half of L2 at the
    # planning minibatch; every output-vector group sweeps them from L2.
    kc = max(tile.width, min(k, (arch.l2_bytes // 2) // (4 * FC_PLAN_BATCH) // tile.width * tile.width))
    # Only the last K panel is narrower along features (vector counts: FcBwdWeightsPlan.vector_counts).
    return FcBwdWeightsPlan(
        layer=layer.name, pass_name="bwd_weights", kind="fc_bwd_weights", template="fc_bwd_weights.c.j2",
        isa=arch.isa, vector_floats=v, reason=explain.fc_bwd_weights(tile, arch, rem_k, rem_n, FC_PLAN_BATCH, kc, k),
        tile=tile, tile_widths=(tile.width, *((rem_k,) if rem_k else ())), predicted_efficiency=tile.efficiency,
        l1_working_set=FC_PLAN_BATCH * tile.vectors * v * 4,
        l2_bytes_per_flop=(tile.width + tile.vectors * v) * 4 / (2 * tile.width * tile.vectors * v),
        rejected=tuple(scored[1:6]), k_chunk=kc, rem_features=rem_k, rem_vectors=rem_n)
