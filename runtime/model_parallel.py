"""An fc layer split by output features over a group of ranks (model parallel; hybrid when the
group is smaller than the job)."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from .kernels import zeros_aligned
from .partition import displacements, part_counts


@dataclass(frozen=True)
class GroupBuffers:
    """The group's rows of one fc layer at one group minibatch (blocked layouts)."""
    x: np.ndarray               # inputs, gathered from the members
    y: np.ndarray               # outputs of the owned columns
    dy: np.ndarray              # output gradients of the owned columns
    dx: np.ndarray              # partial input gradients over the owned features


class ModelParallelFC:
    """One fc layer split by output features over a group of ranks (`gcomm`): each member owns
    output-feature blocks [lo, hi) of the weights, bias and optimizer state.

    Forward: the group's input rows are gathered (Allgatherv), the owned columns computed for
    all of them, and each member's rows sent back with every column (Alltoallv). Backward: the
    output gradient goes the reverse way, the owned weight gradient is complete over the
    group's rows, and the input gradients, partial sums over the owned features, are added
    and returned to their rows' owners (Reduce_scatter)."""

    def __init__(self, layer: Any, gcomm: Any, blocking: Callable[[Callable[[], Any], str], Any]) -> None:
        """`blocking(call, what)`: runs a blocking collective under the job's watchdog."""
        from mpi4py import MPI
        self.MPI, self.layer, self.comm, self.blocking = MPI, layer, gcomm, blocking
        v = layer.vector_floats
        self.v, self.ocb = v, layer.ocb_range[1]
        counts = part_counts(self.ocb, gcomm.size, align=1)
        self.parts = [(int(counts[:r].sum()), int(counts[:r + 1].sum())) for r in range(gcomm.size)]
        self.lo, self.hi = self.parts[gcomm.rank]
        self.k = int(np.prod(layer.blocked_shape(layer.in_shape, 1)))
        # (start in the flat buffers, floats per output block) of the weights and of the bias
        w0, b0 = layer.param_offsets
        self.spans = ((w0, int(np.prod(layer.blocked_weight_shape[1:]))), (b0, v))
        self.rows: list[int] = []      # this step's shard sizes of the group's members
        self.bufs: dict[int, GroupBuffers] = {}  # by group minibatch

    def begin_step(self, sizes: list[int]) -> None:
        self.rows = sizes

    def _buffers(self, total: int) -> GroupBuffers:
        if total not in self.bufs:
            n = self.ocb * self.v
            self.bufs[total] = GroupBuffers(zeros_aligned((total, self.k)), zeros_aligned((total, n)),
                                            zeros_aligned((total, n)), zeros_aligned((total, self.k)))
        return self.bufs[total]

    def _exchange(self, src: np.ndarray, dst: np.ndarray, forward: bool, what: str) -> None:
        """Forward: src = the group's rows x the owned columns (group minibatch, N), dst = this
        rank's rows x all columns. Backward: the reverse."""
        v, q = self.v, self.comm.rank
        widths = [(hi - lo) * v for lo, hi in self.parts]
        mine = self.rows[q]
        lo, hi = self.parts[q]
        if forward:
            send = np.ascontiguousarray(src[:, lo * v:hi * v])
            scounts = [r * widths[q] for r in self.rows]
            rcounts = [mine * w for w in widths]
        else:
            send = np.concatenate([src[:, a * v:b * v].ravel() for a, b in self.parts])
            scounts = [mine * w for w in widths]
            rcounts = [r * widths[q] for r in self.rows]
        recv = np.empty(sum(rcounts), np.float32)
        self.blocking(lambda: self.comm.Alltoallv([send, (scounts, displacements(scounts))],
                                                       [recv, (rcounts, displacements(rcounts))]), what)
        if forward:
            for (a, b), off, count in zip(self.parts, displacements(rcounts), rcounts):
                dst[:, a * v:b * v] = recv[off:off + count].reshape(mine, (b - a) * v)
        else:
            dst[:, lo * v:hi * v] = recv.reshape(sum(self.rows), (hi - lo) * v)

    def forward(self, xb: np.ndarray, yb: np.ndarray) -> None:
        name, total = self.layer.name, sum(self.rows)
        buf = self._buffers(total)
        counts = [r * self.k for r in self.rows]
        self.blocking(lambda: self.comm.Allgatherv(xb, [buf.x, (counts, displacements(counts))]),
                           f"model-parallel {name}: gather of the input")
        self.layer.run_forward(buf.x, buf.y, (self.lo, self.hi))
        self._exchange(buf.y, yb.reshape(len(xb), -1), True, f"model-parallel {name}: all-to-all of the output")

    def backward(self, dyb: np.ndarray, dxb: np.ndarray | None) -> None:
        name, total = self.layer.name, sum(self.rows)
        buf = self.bufs[total]
        self._exchange(dyb.reshape(len(dyb), -1), buf.dy, False,
                       f"model-parallel {name}: all-to-all of the output gradient")
        self.layer.run_backward(buf.x, buf.y, buf.dy, buf.dx if dxb is not None else None,
                                self.layer.grad_buffers, (self.lo, self.hi))
        if dxb is not None:
            counts = [r * self.k for r in self.rows]
            self.blocking(lambda: self.comm.Reduce_scatter(buf.dx, dxb.reshape(-1), recvcounts=counts,
                                                                op=self.MPI.SUM),
                               f"model-parallel {name}: reduce-scatter of the input gradient")

    def owned_ranges(self) -> list[tuple[int, int]]:
        """[start, stop) in the flat parameter buffer of the owned weight rows and bias."""
        return [(base + self.lo * unit, base + self.hi * unit) for base, unit in self.spans]

    def complete(self, buf: np.ndarray) -> None:
        """Gather every member's owned rows of `buf` (params or velocity): the layer is then
        whole on every rank of the group."""
        for base, unit in self.spans:
            counts = [(hi - lo) * unit for lo, hi in self.parts]
            whole = buf[base:base + self.ocb * unit]
            self.comm.Allgatherv(self.MPI.IN_PLACE, [whole, (counts, displacements(counts)), self.MPI.FLOAT])
