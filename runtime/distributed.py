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

import os
import sys
import threading
import time
import traceback

import numpy as np

from .errors import PcldnnError

ALIGN = 16  # floats: part boundaries on cache lines


def part_counts(n: int, parts: int, align: int = ALIGN) -> np.ndarray:
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


def abort_on_exception(comm) -> None:
    """An uncaught exception on any rank prints that rank's traceback and aborts the whole job
    (the other ranks would otherwise wait forever in the next collective)."""
    def hook(kind, value, tb):
        sys.stderr.write(f"[rank {comm.rank}] uncaught {kind.__name__}: {value}\n")
        traceback.print_exception(kind, value, tb, file=sys.stderr)
        sys.stderr.flush()
        comm.Abort(1)
    sys.excepthook = hook


class _Watchdog:
    """Reports (and aborts on) a collective that waits longer than `timeout` seconds: which
    rank, which layer, which operation."""

    def __init__(self, comm, timeout: float):
        self.comm, self.timeout = comm, timeout
        self._what: tuple[str, float] | None = None
        self._lock = threading.Lock()
        if timeout > 0:
            threading.Thread(target=self._run, daemon=True, name="pcldnn-watchdog").start()

    def waiting(self, what: str | None) -> None:
        with self._lock:
            self._what = (what, time.monotonic()) if what else None

    def _run(self) -> None:
        while True:
            time.sleep(min(1.0, self.timeout / 4))
            with self._lock:
                what = self._what
            if what and time.monotonic() - what[1] > self.timeout:
                sys.stderr.write(f"[rank {self.comm.rank}] pcldnn watchdog: {what[0]} has waited more than "
                                 f"{self.timeout:g} s; aborting the job\n")
                sys.stderr.flush()
                self.comm.Abort(3)


class DataParallel:
    """Part-reduce / SGD on the owned part / part-broadcast for every weighted layer of `net`.

    `step(x_local, labels_local, step_index)` runs one synchronous step and returns the global
    mean loss and accuracy. `trace` (a list) collects Chrome-trace events when given."""

    def __init__(self, net, optimizer, comm, *, timeout: float | None = None, trace: list | None = None):
        from mpi4py import MPI
        self.MPI, self.net, self.opt, self.comm = MPI, net, optimizer, comm
        self.p, self.rank = comm.size, comm.rank
        check_same_net(net, comm)
        comm.Bcast(net.params, root=0)  # identical starting weights whatever each rank's seed
        self.blocks = []  # per weighted layer: name, [start, stop), counts, displacements, owned slice, recv
        for name, (start, stop) in net.param_ranges.items():
            counts = [int(c) for c in part_counts(stop - start, self.p)]
            displs = [sum(counts[:r]) for r in range(self.p)]
            own = slice(start + displs[self.rank], start + displs[self.rank] + counts[self.rank])
            self.blocks.append({"name": name, "range": (start, stop), "counts": counts, "displs": displs,
                                "own": own, "recv": np.empty(counts[self.rank], np.float32),
                                "reduce": None, "gather": None})
        self.by_name = {b["name"]: b for b in self.blocks}
        timeout = float(os.environ.get("PCLDNN_COMM_TIMEOUT", 600)) if timeout is None else timeout
        self.watchdog = _Watchdog(comm, timeout)
        self.trace = trace
        self._t0 = time.perf_counter()
        # Progress: requests are tested between layer kernels; with PCLDNN_PROGRESS_THREAD=1
        # (and MPI_THREAD_MULTIPLE) a helper thread also tests them while kernels run (they
        # release the GIL). Every MPI call on a request holds _lock: MPI does not allow two
        # threads to complete the same request.
        self._lock = threading.Lock()
        self._threaded = (self.p > 1 and os.environ.get("PCLDNN_PROGRESS_THREAD", "0") == "1"
                          and MPI.Query_thread() == MPI.THREAD_MULTIPLE)
        if self._threaded:
            threading.Thread(target=self._progress_loop, daemon=True, name="pcldnn-progress").start()
        self.comm_wait = 0.0  # seconds blocked in MPI this step (exposed communication and rank skew)

    # -- events --------------------------------------------------------------------------
    def _event(self, name: str, cat: str, start: float, end: float) -> None:
        if self.trace is not None:
            self.trace.append({"name": name, "cat": cat, "ph": "X", "pid": self.rank, "tid": cat,
                               "ts": (start - self._t0) * 1e6, "dur": (end - start) * 1e6})

    def _wait(self, req, what: str) -> None:
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
            for b in self.blocks:
                for key in ("reduce", "gather"):
                    if b[key] is not None:
                        b[key].Test()  # a finished request becomes REQUEST_NULL: waiting on it is free

    def _progress_loop(self) -> None:
        while True:
            self._progress()
            time.sleep(200e-6)

    # -- hooks called by Net between layers ---------------------------------------------------
    def _before_forward(self, layer) -> None:
        b = self.by_name.get(layer.name)
        if b is not None and b["gather"] is not None:
            self._wait(b["gather"], f"part-broadcast {layer.name}")
            b["gather"] = None
        self._progress()

    def _after_backward(self, layer) -> None:
        b = self.by_name.get(layer.name)
        if b is not None:
            start, stop = b["range"]
            with self._lock:
                b["reduce"] = self.comm.Ireduce_scatter(self.net.grads[start:stop], b["recv"],
                                                        recvcounts=b["counts"], op=self.MPI.SUM)
            b["t_reduce"] = time.perf_counter()
        self._progress()

    # -- one step --------------------------------------------------------------------------
    def step(self, x: np.ndarray, labels: np.ndarray, step_index: int) -> tuple[float, float]:
        self.comm_wait = 0.0
        t = time.perf_counter()
        local = np.array([len(labels)], np.int64)
        total = np.empty_like(local)
        self.watchdog.waiting(f"step {step_index}: allreduce of the minibatch size")
        self.comm.Allreduce(local, total)  # blocking: also where ranks that arrive early wait
        self.watchdog.waiting(None)
        b_local, b_global = int(local[0]), int(total[0])
        t1 = time.perf_counter()
        self.comm_wait += t1 - t
        self._event("allreduce minibatch size", "wait", t, t1)
        logits = self.net.forward(x, training=True, before_layer=self._before_forward)
        t2 = time.perf_counter()
        self._event("forward", "compute", t1, t2)
        loss = self.net.backward(labels, grad_scale=b_local / b_global, after_layer=self._after_backward)
        t3 = time.perf_counter()
        self._event("backward", "compute", t2, t3)
        correct = float((logits.argmax(axis=1) == np.asarray(labels)).sum())
        sums = np.array([loss * b_local, correct], np.float64)
        s = time.perf_counter()
        self.watchdog.waiting(f"step {step_index}: allreduce of the loss")
        self.comm.Allreduce(self.MPI.IN_PLACE, sums)
        self.watchdog.waiting(None)
        self.comm_wait += time.perf_counter() - s
        self._event("allreduce loss", "wait", s, time.perf_counter())
        for b in reversed(self.blocks):  # the order their reductions started: the top layer first
            self._wait(b["reduce"], f"step {step_index}: part-reduce of layer {b['name']}")
            b["reduce"] = None
            self._event(f"part-reduce {b['name']}", "comm", b.pop("t_reduce", t3), time.perf_counter())
            s = time.perf_counter()
            np.copyto(self.net.grads[b["own"]], b["recv"])
            self.opt.apply(self.net.params, self.net.grads, step_index, b["own"])
            start, stop = b["range"]
            with self._lock:
                b["gather"] = self.comm.Iallgatherv(
                    self.MPI.IN_PLACE, [self.net.params[start:stop], (b["counts"], b["displs"]), self.MPI.FLOAT])
            self._event(f"sgd {b['name']}", "compute", s, time.perf_counter())
        self._event("step", "step", t, time.perf_counter())
        return float(sums[0] / b_global), float(sums[1] / b_global)

    def sync(self) -> None:
        """Wait for every pending part-broadcast: the full weights are then current on every rank."""
        for b in self.blocks:
            if b["gather"] is not None:
                self._wait(b["gather"], f"part-broadcast {b['name']}")
                b["gather"] = None

    def gather_velocity(self) -> np.ndarray:
        """The full momentum buffer (each rank holds its own parts), for checkpoints."""
        v = self.opt.velocity
        out = np.zeros_like(v)
        for b in self.blocks:
            start, stop = b["range"]
            out[b["own"]] = v[b["own"]]
            self.comm.Allgatherv(self.MPI.IN_PLACE, [out[start:stop], (b["counts"], b["displs"]), self.MPI.FLOAT])
        return out


def check_same_net(net, comm) -> None:
    """Refuse to start when ranks loaded different nets, builds or ISAs (a hash exchange)."""
    mine = (net.net_hash, int(net.params.size), net.isa, net.build_fingerprint())
    everyone = comm.allgather(mine)
    if any(other != mine for other in everyone):
        lines = [f"rank {r}: net {h[:12]}, {n} parameters, {isa}, build {fp[:12]}"
                 for r, (h, n, isa, fp) in enumerate(everyone)]
        raise PcldnnError("ranks loaded different nets or builds; refusing to train:\n  " + "\n  ".join(lines))
