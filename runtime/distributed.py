"""Synchronous SGD over MPI (mpi4py): data parallelism with part-reduce / part-broadcast.

Each rank runs forward and backward on its shard of the global minibatch. As soon as a
layer's gradients exist, its *part-reduce* starts: a nonblocking reduce-scatter over that
layer's block of the flat gradient buffer, after which rank r holds the global sum for its
1/p of the block. Rank r applies SGD (momentum, weight decay) to that part only — the
optimizer state it touches is its own shard — and a nonblocking *part-broadcast*
(all-gather, in place) rebuilds the full block; the next forward pass waits for a layer's
block just before that layer runs. So the reduction of layer L overlaps the backward passes
of the layers below it, and the broadcast overlaps the next forward pass of the layers above.

MPI may not progress nonblocking collectives on its own: the runtime tests every pending
request between layer kernels (explicit progress). With PCLDNN_PROGRESS_THREAD=1 and an MPI
library that provides MPI_THREAD_MULTIPLE, a helper thread also tests them every 0.2 ms while
the kernels run (they release the GIL), for networks where a reduction needs many progress
calls; on one machine (shared-memory transport) both measured the same.

Each rank's gradient is that of (b_r / B) x its mean loss (b_r its shard, B the global
minibatch), so the sum over ranks is the gradient of the global mean loss, also for unequal
shards: one step on p ranks equals one step on one rank with the concatenated minibatch.
"""
from __future__ import annotations

import atexit
import os
import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import observe
from .errors import PcldnnError
from .kernels import bf16_bits, bf16_values
from .layer_modes import layer_modes
from .layers import NormLayer
from .model_parallel import ModelParallelFC
from .mpi_safety import Watchdog, abort_on_exception, agree, check_same_net, comm_timeout, exit_agreement, guard_world
from .partition import displacements, part_counts

GRADIENT_EXCHANGES = ("fp32", "bf16")


@dataclass
class CommBlock:
    """One contiguous range of the flat parameter buffer exchanged as a unit: a data-parallel
    layer's weights and bias, or a model-parallel layer's owned rows across its group's replicas.
    The requests are the in-flight part-reduce and part-broadcast (None: none pending)."""
    name: str                   # the layer
    range: tuple[int, int]      # [start, stop) in the flat buffers
    comm: Any                   # the ranks that share the range
    counts: list[int]           # each rank's part of the range
    displs: list[int]
    own: slice                  # this rank's part, in the flat buffers
    recv: np.ndarray            # the summed gradient of the own part (bf16 exchange: every rank's part, bf16 bits)
    send: np.ndarray | None = None  # bf16 exchange: the range's gradient as bf16 bits
    reduce: Any = None
    gather: Any = None
    reduce_started: float | None = None  # when the part-reduce was posted, for the trace
    gather_started: float = 0.0          # when the part-broadcast was posted
    reduce_done: float | None = None     # when a progress test first found it complete
    gather_done: float | None = None


class SyncSGD:
    """Synchronous SGD over `comm` for every weighted layer of `net`: data parallel
    (part-reduce / SGD on the owned part / part-broadcast) or, for fc layers, model parallel
    within groups of ranks (hybrid when the groups are smaller than the job), per `parallel`
    (see `layer_modes`; decided at the first step, when the global minibatch is known).

    `step(x_local, labels_local, step_index)` runs one synchronous step and returns the global
    mean loss and accuracy. `trace` (a list) collects Chrome-trace events when given.

    gradient_exchange "bf16": each rank rounds its gradient to bf16 (to nearest even) and the
    part-reduce becomes an all-to-all of those halves (each rank receives every rank's bf16
    copy of its part) summed in fp32 in rank order: half the bytes of the fp32 reduce-scatter,
    each gradient rounded once (relative 2^-9), the sum exact to fp32. The part-broadcast of
    the updated weights stays fp32, so the ranks' weights stay identical."""

    def __init__(self, net: Any, optimizer: Any, comm: Any, *, parallel: Any = "auto", timeout: float | None = None,
                 trace: list | None = None, gradient_exchange: str = "fp32", sync_batchnorm: bool = False) -> None:
        from mpi4py import MPI
        if not isinstance(comm, MPI.Intracomm):
            raise PcldnnError(f"comm must be an MPI intracommunicator (e.g. MPI.COMM_WORLD), got {type(comm).__name__}")
        if gradient_exchange not in GRADIENT_EXCHANGES:
            raise PcldnnError(f"gradient_exchange must be one of {', '.join(GRADIENT_EXCHANGES)}, "
                              f"got {gradient_exchange!r}")
        self.bf16_exchange = gradient_exchange == "bf16"
        self.MPI, self.net, self.opt, self.comm = MPI, net, optimizer, comm
        self.p, self.rank = comm.size, comm.rank
        self.parallel = parallel
        guard_world()
        if comm.size > 1:
            abort_on_exception(comm)
        timeout = comm_timeout() if timeout is None else timeout
        self.watchdog = Watchdog(comm, timeout)
        self.trace = trace
        self.watch = observe.observer()  # PCLDNN_TIMELINE / PCLDNN_VERBOSE
        self._t0 = time.perf_counter()
        self._lock = threading.Lock()
        self.comm_wait = 0.0  # seconds blocked in MPI this step (exposed communication and rank skew)
        # Every start-up exchange runs under the watchdog: a rank that never arrives ends the job.
        # The agreements travel on a duplicate of comm, so they can never match a collective
        # the program itself runs on comm; at exit this rank announces that it leaves.
        self.ctl = self.blocking(comm.Dup, "start-up: duplicating the communicator")
        atexit.register(exit_agreement, self.ctl)
        self.agree("start-up (Trainer with comm)", {"PCLDNN_TIMELINE set": self.watch is not None
                                                    and self.watch.timeline is not None,
                                                    "sync_batchnorm": bool(sync_batchnorm)})
        if self.watch is not None and self.watch.timeline is not None:
            self.blocking(lambda: self.watch.join(self.ctl, self.MPI.Is_finalized),
                          "start-up: aligning the ranks' timeline clocks")
        self.blocking(lambda: check_same_net(net, comm), "start-up: comparing the ranks' builds")
        layer_modes(net, parallel, self.p, self.p)  # refuse a bad mapping or machine before the first step
        if sync_batchnorm:
            self._sync_batchnorm()
        self.blocking(lambda: comm.Bcast(net.params, root=0), "start-up: broadcast of rank 0's initial weights")
        net.seed = self.blocking(lambda: comm.bcast(net.seed, root=0), "start-up: broadcast of the dropout seed")
        self._stale = False  # other ranks' slices of model-parallel layers are a step old
        self.modes: dict[str, int] | None = None
        self.blocks: list[CommBlock] = []
        self.by_name: dict[str, list[CommBlock]] = {}
        self.model: dict[str, ModelParallelFC] = {}
        # Progress: requests are tested between layer kernels; with PCLDNN_PROGRESS_THREAD=1
        # (and MPI_THREAD_MULTIPLE) a helper thread also tests them while kernels run (they
        # release the GIL). Every MPI call on a request holds _lock: MPI does not allow two
        # threads to complete the same request.
        self._threaded = (self.p > 1 and os.environ.get("PCLDNN_PROGRESS_THREAD", "0") == "1"
                          and MPI.Query_thread() == MPI.THREAD_MULTIPLE)
        if self._threaded:
            threading.Thread(target=self._progress_loop, daemon=True, name="pcldnn-progress").start()

    def _sync_batchnorm(self) -> None:
        """Each batchnorm layer's statistics, and their gradient, over every rank's shard: an
        allgather of one float64 row per rank (on a communicator of its own, so it never
        matches the part-reduces in flight), which every rank then combines in rank order."""
        norms = [layer for layer in self.net.layers.values() if isinstance(layer, NormLayer)]
        if not norms:  # every rank has the same net (checked): all skip the collective alike
            return
        comm = self.blocking(self.comm.Dup, "start-up: duplicating the communicator for sync_batchnorm")
        for layer in norms:
            def across_ranks(row: np.ndarray, name: str = layer.name) -> np.ndarray:
                rows = np.empty((self.p, row.size), np.float64)
                self.blocking(lambda: comm.Allgather(np.ascontiguousarray(row, np.float64), rows),
                              f"sync_batchnorm {name}: allgather of the statistics")
                return rows
            layer.across_ranks = across_ranks

    def _setup(self, batch: int) -> None:
        """Per-layer choice and communication blocks, once the global minibatch is known."""
        self.modes = layer_modes(self.net, self.parallel, self.p, batch)
        splits: dict[int, tuple] = {}
        for name, (start, stop) in self.net.param_ranges.items():
            group = self.modes[name]
            ranges, comm = [(start, stop)], self.comm
            if group > 1:
                if group not in splits:  # groups of consecutive ranks; across them, the same part
                    splits[group] = self.blocking(
                        lambda: (self.comm.Split(self.rank // group, self.rank),
                                 self.comm.Split(self.rank % group, self.rank)),
                        f"first step: splitting the ranks into groups of {group}")
                gcomm, comm = splits[group]
                runner = ModelParallelFC(self.net.layers[name], gcomm, self.blocking)
                self.net.layers[name].runner = self.model[name] = runner
                ranges = runner.owned_ranges()
            self.by_name[name] = []
            for lo, hi in ranges:
                counts = [int(c) for c in part_counts(hi - lo, comm.size)]
                displs = displacements(counts)
                own = slice(lo + displs[comm.rank], lo + displs[comm.rank] + counts[comm.rank])
                if self.bf16_exchange:  # every rank's bf16 copy of the own part, side by side
                    block = CommBlock(name, (lo, hi), comm, counts, displs, own,
                                      np.empty(comm.size * counts[comm.rank], np.uint16), np.empty(hi - lo, np.uint16))
                else:
                    block = CommBlock(name, (lo, hi), comm, counts, displs, own, np.empty(counts[comm.rank], np.float32))
                self.blocks.append(block)
                self.by_name[name].append(block)

    # -- events --------------------------------------------------------------------------
    def _event(self, name: str, cat: str, start: float, end: float) -> None:
        """A step's span into `trace` (examples/train.py --trace) and PCLDNN_TIMELINE's timeline:
        communication in flight as an async slice, waits and compute on their tracks."""
        if self.trace is not None:
            self.trace.append({"name": name, "cat": cat, "ph": "X", "pid": self.rank, "tid": cat,
                               "ts": (start - self._t0) * 1e6, "dur": (end - start) * 1e6})
        if self.watch is not None:
            if cat == "comm":
                self.watch.overlapping(name, start, end)
            else:
                self.watch.span(name, "MPI waits" if cat == "wait" else "steps", start, end)

    def blocking(self, call: Any, what: str) -> Any:
        """A blocking collective under the watchdog, counted as communication wait."""
        start = time.perf_counter()
        self.watchdog.waiting(what)
        with self._lock:
            out = call()
        self.watchdog.waiting(None)
        end = time.perf_counter()
        self.comm_wait += end - start
        self._event(what, "wait", start, end)
        return out

    def agree(self, op: str, values: dict, own: Any = None) -> list:
        """`agree` on this job's control communicator, under the watchdog."""
        return agree(self.ctl, op, values, own, self.watchdog)

    def _wait(self, req: Any, what: str) -> None:
        if req is None:
            return
        start = time.perf_counter()
        self.watchdog.waiting(what)
        if self._threaded:
            while True:
                with self._lock:
                    if req.Test():
                        break
                time.sleep(20e-6)
        else:
            req.Wait()
        self.watchdog.waiting(None)
        end = time.perf_counter()
        self.comm_wait += end - start
        self._event(f"wait {what}", "wait", start, end)

    def _progress(self) -> None:
        """Explicit progress: test every pending request (cheap when nothing is pending)."""
        with self._lock:
            for b in self.blocks:  # a finished request becomes REQUEST_NULL: waiting on it is free
                if b.reduce is not None and b.reduce_done is None and b.reduce.Test():
                    b.reduce_done = time.perf_counter()
                if b.gather is not None and b.gather_done is None and b.gather.Test():
                    b.gather_done = time.perf_counter()

    def _progress_loop(self) -> None:
        while True:
            self._progress()
            time.sleep(200e-6)

    # -- hooks called by Net between layers ---------------------------------------------------
    def _before_forward(self, layer: Any) -> None:
        for b in self.by_name.get(layer.name, ()):
            self._await_broadcast(b)
        self._progress()

    def _await_broadcast(self, b: CommBlock) -> None:
        """Wait for a block's part-broadcast, if one is pending (its span into the timeline)."""
        if b.gather is not None:
            self._wait(b.gather, f"part-broadcast {b.name}")
            b.gather = None
            self.net.weights_changed()  # other ranks' parts arrived: derived weight copies are stale
            done, b.gather_done = b.gather_done or time.perf_counter(), None
            self._event(f"part-broadcast {b.name}", "comm", b.gather_started, done)

    def _after_backward(self, layer: Any) -> None:
        for b in self.by_name.get(layer.name, ()):
            start, stop = b.range
            with self._lock:
                if b.send is not None:
                    bf16_bits(self.net.grads[start:stop], b.send)
                    own = b.counts[b.comm.rank]
                    b.reduce = b.comm.Ialltoallv([b.send, (b.counts, b.displs), self.MPI.UINT16_T],
                                                 [b.recv, ([own] * b.comm.size, [own * r for r in range(b.comm.size)]),
                                                  self.MPI.UINT16_T])
                else:
                    b.reduce = b.comm.Ireduce_scatter(self.net.grads[start:stop], b.recv, recvcounts=b.counts,
                                                      op=self.MPI.SUM)
            b.reduce_started = time.perf_counter()
        self._progress()

    # -- one step --------------------------------------------------------------------------
    def step(self, x: np.ndarray, labels: np.ndarray, step_index: int, shared: dict | None = None) -> tuple[float, float]:
        """One synchronous step on this rank's shard. `shared`: values every rank must pass
        alike (the trainer's seed, the global minibatch fit uses), checked with the step index."""
        self.comm_wait = 0.0
        self.net.complete_on_access(None)  # the pending part-broadcasts are waited for layer by layer below
        t = time.perf_counter()
        sizes = self.agree(f"step {step_index}: allgather of the shard sizes", {"step": step_index, **(shared or {})},
                            len(labels))  # also where early ranks wait
        self.comm_wait += time.perf_counter() - t
        if shared and shared.get("global_batch") not in (None, sum(sizes)):
            raise PcldnnError(f"step {step_index}: the shards add up to {sum(sizes)} rows, not the global minibatch "
                              f"{shared['global_batch']}")
        b_local, b_global = len(labels), sum(sizes)
        self.net.row_offset = sum(sizes[:self.rank])
        if self.modes is None:
            self._setup(b_global)
        for runner in self.model.values():
            members = runner.comm.size
            first = self.rank // members * members
            runner.begin_step(sizes[first:first + members])
        t1 = time.perf_counter()
        logits = self.net.forward(x, training=True, before_layer=self._before_forward)
        t2 = time.perf_counter()
        self._event("forward", "compute", t1, t2)
        loss = self.net.backward(labels, grad_scale=b_local / b_global, after_layer=self._after_backward)
        t3 = time.perf_counter()
        self._event("backward", "compute", t2, t3)
        correct = float((logits.argmax(axis=1) == np.asarray(labels)).sum())
        sums = np.array([loss * b_local, correct], np.float64)
        self.blocking(lambda: self.comm.Allreduce(self.MPI.IN_PLACE, sums), f"step {step_index}: allreduce of the loss")
        for b in reversed(self.blocks):  # the order their reductions started: the top layer first
            self._wait(b.reduce, f"step {step_index}: part-reduce of layer {b.name}")
            b.reduce = None
            started = b.reduce_started if b.reduce_started is not None else t3
            done = b.reduce_done or time.perf_counter()
            b.reduce_started = b.reduce_done = None
            self._event(f"part-reduce {b.name}", "comm", started, done)
            s = time.perf_counter()
            if b.send is not None:  # every rank's bf16 part, summed in fp32 in rank order
                parts = bf16_values(b.recv.reshape(b.comm.size, -1))
                np.sum(parts, axis=0, dtype=np.float32, out=self.net.grads[b.own])
            else:
                np.copyto(self.net.grads[b.own], b.recv)
            self.opt.apply(self.net.params, self.net.grads, step_index, b.own)
            start, stop = b.range
            with self._lock:
                b.gather = b.comm.Iallgatherv(
                    self.MPI.IN_PLACE, [self.net.params[start:stop], (b.counts, b.displs), self.MPI.FLOAT])
            b.gather_started = time.perf_counter()
            self._event(f"sgd {b.name}", "compute", s, time.perf_counter())
        self._event("step", "step", t, time.perf_counter())
        self._stale = True
        self.net.complete_on_access(self.sync)  # whoever reads weights next gets the current ones
        return float(sums[0] / b_global), float(sums[1] / b_global)

    def sync(self) -> None:
        """Wait for every pending part-broadcast and gather the model-parallel layers' parts:
        the full weights are then current on this rank. Called by any read of the weights after
        a step. With model-parallel layers it is collective (each rank holds only its slice):
        every rank must then read, save or evaluate alike."""
        self.net.complete_on_access(None)
        for b in self.blocks:
            self._await_broadcast(b)
        if self.model and self._stale:
            self.agree("reading the weights after a step (model-parallel layers gather their slices)", {})
            for runner in self.model.values():
                self.blocking(lambda: runner.complete(self.net.params),
                               f"gathering the slices of model-parallel layer {runner.layer.name}")
        self._stale = False

    def gather_velocity(self) -> np.ndarray:
        """The full momentum buffer (each rank holds its own parts), for checkpoints."""
        v = self.opt.bound_velocity()
        out = v.copy()
        for b in self.blocks:
            start, stop = b.range
            out[start:stop] = 0.0
            out[b.own] = v[b.own]
            self.blocking(lambda: b.comm.Allgatherv(
                self.MPI.IN_PLACE, [out[start:stop], (b.counts, b.displs), self.MPI.FLOAT]),
                f"save: gathering the momentum of {b.name}")
        for runner in self.model.values():
            self.blocking(lambda: runner.complete(out), f"save: gathering the momentum slices of {runner.layer.name}")
        return out
