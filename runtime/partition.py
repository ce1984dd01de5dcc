"""How work and buffers are split over ranks: contiguous, cache-line aligned pieces of a flat
buffer, shards of a minibatch, and the displacements MPI's vector collectives take."""
from __future__ import annotations

import numpy as np

from .kernels import CACHE_LINE_FLOATS


def part_counts(n: int, parts: int, align: int = CACHE_LINE_FLOATS) -> np.ndarray:
    """Split n elements into `parts` contiguous pieces as even as cache-line granularity
    allows (piece sizes multiples of `align`, except for the end); pieces may be empty."""
    lines = -(-n // align)
    base, extra = divmod(lines, parts)
    counts = np.array([(base + (r < extra)) * align for r in range(parts)], dtype=np.int64)
    over = counts.sum() - n  # the last non-empty piece absorbs the rounding
    for r in range(parts - 1, -1, -1):
        take = min(over, counts[r])
        counts[r] -= take
        over -= take
    return counts


def shard_bounds(batch: int, parts: int, rank: int) -> tuple[int, int]:
    """[start, stop) of rank's shard of a global minibatch: sizes differ by at most one."""
    base, extra = divmod(batch, parts)
    start = rank * base + min(rank, extra)
    return start, start + base + (rank < extra)


def displacements(counts: list[int]) -> list[int]:
    """Start of each piece when pieces of `counts` lie back to back."""
    return [int(sum(counts[:r])) for r in range(len(counts))]
