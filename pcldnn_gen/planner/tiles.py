"""The register-tile model and the row cover shared by the conv kernels.

A register tile of `width` outputs (pixels, or minibatch rows for fc) x `vectors`
output-channel vectors lives in registers across a whole reduction. Per inner step the kernel
loads `vectors` weight vectors and broadcasts `width` inputs, then issues width x vectors FMAs;
a step takes at least
    max(FMAs / fma_units, vector loads / load_ports + broadcasts / broadcasts_per_cycle,
        fma_latency + LATENCY_SLACK)
cycles, so the fraction of the FMA peak a tile can reach is (FMAs / fma_units) / that.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from ..arch import Arch
from ..errors import PlanError

# Cycles beyond the multiply-add's latency that the independent accumulator chains must cover
# (each needs fma_units x (fma_latency + LATENCY_SLACK) of them): a chain's next operands, a
# broadcast and a weight load, arrive late now and then. Measured on VGG-A conv3 (AVX2, one
# thread, latency 4): a 2x4 tile with exactly 8 chains ran at 75 GFLOP/s, a 6x2 tile with 12 at
# 80, and on the 28- and 14-wide layers the gap was 54 vs 74. The slack does not grow with the
# latency: with vdpbf16ps on Zen 5 (latency 6, Arch.dot_latency) 16 chains ran as fast as 20 or
# 24 (4x4 against 8x3 backward-weights, VGG-A conv3-4: 1.02) while 14 lost (7x2 forward on
# 14x14: 0.95 of 5x4); a 1.5x multiple of the latency would ask 18.
LATENCY_SLACK = 2


@dataclass(frozen=True)
class RegisterTile:
    width: int          # outputs along the broadcast dimension (pixels, or minibatch rows)
    vectors: int        # output-channel vectors
    registers: int      # accumulators + the shorter side held in registers + 1 streaming register
    loads_per_fma: float
    efficiency: float   # fraction of FMA peak this tile alone can reach

    @staticmethod
    def evaluate(width: int, vectors: int, arch: Arch) -> RegisterTile:
        fmas = width * vectors
        loads = width + vectors
        load_cycles = vectors / arch.load_ports + width / arch.broadcasts_per_cycle
        cycles = max(fmas / arch.fma_units, load_cycles, arch.fma_latency + LATENCY_SLACK)
        return RegisterTile(width, vectors, fmas + min(width, vectors) + 1, loads / fmas,
                            (fmas / arch.fma_units) / cycles)

    def describe(self) -> str:
        return (f"{self.width}x{self.vectors} ({self.registers} regs, "
                f"{self.loads_per_fma:.2f} loads/FMA, {self.efficiency:.0%} of peak)")


def candidates(width_choices: int | Iterable[int], vector_choices: Iterable[int], arch: Arch) -> list[RegisterTile]:
    """Every tile that fits the register file; an int `width_choices` means 1..that."""
    widths = list(range(1, width_choices + 1) if isinstance(width_choices, int) else width_choices)
    tiles = [RegisterTile.evaluate(width, vectors, arch) for vectors in vector_choices for width in widths
             if width * vectors + min(width, vectors) + 1 <= arch.vector_registers]
    if not tiles:
        raise PlanError(f"{arch.name}: {arch.vector_registers} vector registers cannot hold any register tile")
    return tiles


def put_first(scored: list, choice: tuple[int, int] | None, tile_of: Callable[[Any], RegisterTile] = lambda s: s) -> list:
    """`scored` (best first) with the entry whose tile is `choice` = (width, vectors) moved to
    the front: how a measured choice from the tuning database is applied, only ever among the
    planner's own candidates. PlanError when they hold no such tile."""
    if choice is None:
        return scored
    for i, entry in enumerate(scored):
        tile = tile_of(entry)
        if (tile.width, tile.vectors) == tuple(choice):
            return [entry, *scored[:i], *scored[i + 1:]]
    raise PlanError(f"no candidate register tile {choice[0]}x{choice[1]}")


def divisors(n: int, limit: int | None = None) -> list[int]:
    return [d for d in range(1, min(n, limit or n) + 1) if n % d == 0]


def best_first(tiles: list[RegisterTile]) -> list[RegisterTile]:
    """Sorted best first: predicted efficiency, then bigger tiles (fewer loop trips), then fewer registers."""
    return sorted(tiles, key=lambda t: (t.efficiency, t.width * t.vectors, -t.registers), reverse=True)


@dataclass(frozen=True, kw_only=True)
class Tap:
    """One kernel column of an edge tile: the (tile pixel, input or output column) pairs that
    read inside the plane. The emitted tile issues FMAs for exactly these and tests no bound."""
    kw: int
    pixels: tuple[tuple[int, int], ...]


@dataclass(frozen=True, kw_only=True)
class EdgeTile:
    start: int                  # first column of the tile
    width: int
    taps: tuple[Tap, ...]


# Rows of at most this many columns with padding are covered by one edge tile when the tile is
# as wide. Against the edge / remainder / border cover (benchmarks/ab.py-style interleaved runs
# on the zoo's planes up to 16 wide, EPYC VM, AVX-512, one thread, minibatch 16): 4-, 7- and
# 8-column rows forward 1.12-1.31x, backward-data 1.01-1.45x; 13- and 14-column rows measured
# 0.94-1.03x with it, so wider rows keep the edges and middle.
WHOLE_ROW_MAX = 8


@dataclass(frozen=True, kw_only=True)
class RowCover:
    """How a row of `count` columns is covered by tiles of one width: an edge tile at each end
    that needs bounds when the row is wide enough, full tiles over [mid_lo, mid_hi) and one
    remainder tile of `rem` columns after them, 1-column border tiles over [0, border_lo) and
    [border_hi, count). A short row (WHOLE_ROW_MAX) no wider than the tile, with padding on a
    side, is one edge tile (`left`, covering the whole row: a 7-column plane in one tile instead
    of two edges and a 1-column remainder, or 1-column border tiles)."""
    left: EdgeTile | None
    right: EdgeTile | None
    mid_lo: int
    mid_hi: int
    rem: int
    border_lo: int
    border_hi: int
    count: int
    width: int                  # columns per full tile

    @property
    def full_tiles(self) -> int:
        return (self.mid_hi - self.mid_lo) // self.width

    @property
    def border(self) -> int:
        """Columns covered by 1-column border tiles."""
        return self.border_lo + self.count - self.border_hi


def cover_row(count: int, lo: int, hi: int, width: int, edge: Callable[[int, int], EdgeTile]) -> RowCover:
    """Cover columns [0, count) whose [lo, hi) need no bounds: an edge tile (built by `edge`
    from its start column and width) at each end when its bounded columns fit in one tile and
    the row holds two tiles, or one edge tile for a short row no wider than a tile; full tiles
    and one remainder in between, 1-column border tiles for the bounded columns no edge tile
    takes. The one routine behind conv forward and backward-data."""
    if count <= min(width, WHOLE_ROW_MAX) and (lo > 0 or hi < count):
        return RowCover(left=edge(0, count), right=None, mid_lo=count, mid_hi=count, rem=0, border_lo=0,
                        border_hi=count, count=count, width=width)
    left = 0 < lo <= width and 2 * width <= count
    right = hi < count and count - hi <= width and 2 * width <= count
    mid_lo, mid_hi = (width if left else lo), (count - width if right else hi)
    if mid_hi < mid_lo:
        left = right = False
        mid_lo, mid_hi = lo, hi
    return RowCover(left=edge(0, width) if left else None, right=edge(count - width, width) if right else None,
                    mid_lo=mid_lo, mid_hi=mid_hi, rem=(mid_hi - mid_lo) % width,
                    border_lo=0 if left else lo, border_hi=count if right else hi, count=count, width=width)


def cover_pieces(cover: RowCover, taps: int) -> list[tuple[int, int]]:
    """(tile width, calls) of one covered row: full and remainder tiles and border columns once
    per each of `taps` kernel columns, an edge tile once per tap with that tap's pixel count."""
    pieces = [(cover.width, cover.full_tiles * taps), (cover.rem, taps), (1, cover.border * taps)]
    return pieces + [(len(tap.pixels), 1) for e in (cover.left, cover.right) if e for tap in e.taps]


def pieces_efficiency(pieces: Iterable[tuple[int, int]], vectors: int, arch: Arch) -> float:
    """Predicted fraction of peak over tile pieces, each at its own tile's efficiency (work-weighted);
    1.0 for no work (a row of pure padding)."""
    work = cycles = 0.0
    for pixels, count in pieces:
        if pixels and count:
            fmas = pixels * vectors * count
            work += fmas
            cycles += fmas / RegisterTile.evaluate(pixels, vectors, arch).efficiency
    return work / cycles if work else 1.0
