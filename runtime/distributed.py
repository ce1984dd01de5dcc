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
import fnmatch
import os
import shutil
import sys
import threading
import time
import traceback
from pathlib import Path

import numpy as np

from .errors import PcldnnError
from .kernels import CACHE_LINE_FLOATS, zeros_aligned


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


# Environment variables through which MPI launchers announce the job's size (MPICH / Intel
# MPI hydra, Open MPI, MVAPICH) and the number of ranks on this node.
_WORLD_SIZE_ENV = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE")
_LOCAL_SIZE_ENV = ("MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE", "MV2_COMM_WORLD_LOCAL_SIZE")
_guarded: set[int] = set()


def mpiexec() -> str | None:
    """The MPI launcher: the one installed beside this Python (the mpich wheel's), else PATH's."""
    return shutil.which("mpiexec", path=str(Path(sys.executable).parent)) or shutil.which("mpiexec")


def world():
    """MPI.COMM_WORLD when this process is one of several MPI ranks, else None. mpi4py is
    imported only when a launcher announced a job of more than one rank (or the program
    already imported it)."""
    launched = any(os.environ.get(k, "").isdigit() and int(os.environ[k]) > 1 for k in _WORLD_SIZE_ENV)
    if not launched and "mpi4py.MPI" not in sys.modules:
        return None
    try:
        from mpi4py import MPI
    except ImportError:
        return None
    if not MPI.Is_initialized() or MPI.Is_finalized() or MPI.COMM_WORLD.Get_size() < 2:
        return None
    return MPI.COMM_WORLD


def guard_world():
    """Under an MPI job of more than one rank, an uncaught exception on any rank aborts the
    job (its traceback printed) instead of leaving the others waiting. Idempotent; returns
    COMM_WORLD or None. Needs no collective: ranks may call it at different times."""
    comm = world()
    if comm is not None and id(comm) not in _guarded:
        _guarded.add(id(comm))
        abort_on_exception(comm)
    return comm


def ranks_on_this_node() -> int:
    """MPI ranks sharing this node: from the launcher's environment, else a shared-memory split
    of COMM_WORLD (a collective: every rank then calls it), 1 outside MPI."""
    for key in _LOCAL_SIZE_ENV:
        text = os.environ.get(key, "")
        if text.isdigit() and int(text) >= 1:
            return int(text)
    comm = world()
    if comm is None:
        return 1
    from mpi4py import MPI
    return comm.Split_type(MPI.COMM_TYPE_SHARED).Get_size()


def agree(comm, op: str, values: dict, own=None, watchdog: "_Watchdog | None" = None) -> list:
    """Every collective entry point (start-up, step, save, evaluate, reading weights, exit)
    begins here: the ranks exchange which operation they are in and the values they must share.
    A rank in another operation, or with other values, makes every rank raise the same
    PcldnnError naming both (instead of a hang or silently different work). Returns each
    rank's `own` value (e.g. its shard size)."""
    if watchdog is not None:
        watchdog.waiting(op)
    everyone = comm.allgather((op, values, own))
    if watchdog is not None:
        watchdog.waiting(None)
    first_op, first_values, _ = everyone[0]
    for rank, (other_op, other_values, _) in enumerate(everyone):
        if other_op != first_op:
            raise PcldnnError(f"rank 0 is in {first_op} but rank {rank} is in {other_op}: under MPI these calls are "
                              "collective: every rank must make the same calls in the same order (e.g. every rank "
                              "calls trainer.save(path); rank 0 writes the file)")
        for key in first_values:
            if other_values.get(key) != first_values[key]:
                raise PcldnnError(f"{op}: ranks disagree on {key}: rank 0 has {first_values[key]!r}, rank {rank} has "
                                  f"{other_values.get(key)!r}; every rank must pass the same {key}")
    return [o for _, _, o in everyone]


def _exit_agreement(comm) -> None:
    """At interpreter exit of a rank that trained: tell ranks still in a pcldnn collective
    (step, save, evaluate) that this one is leaving, so they fail with a message."""
    from mpi4py import MPI
    if MPI.Is_finalized():
        return
    try:
        agree(comm, "exit", {})
    except PcldnnError as e:
        _abort(comm, f"[rank {comm.rank}] {e}\n", 1)


def abort_on_exception(comm) -> None:
    """An uncaught exception on any rank prints that rank's traceback and aborts the whole job
    (the other ranks would otherwise wait forever in the next collective)."""
    def hook(kind, value, tb):
        text = "".join(traceback.format_exception(kind, value, tb))
        _abort(comm, f"[rank {comm.rank}] uncaught {kind.__name__}: {value}\n{text}", 1)
    sys.excepthook = hook


def _abort(comm, message: str, code: int) -> None:
    """Print `message` on this rank's stderr and end the whole job. The message goes straight
    to the file descriptor, and the launcher gets a moment to forward it before MPI_Abort
    kills every rank (under load, hydra lost it otherwise)."""
    sys.stderr.flush()
    os.write(2, message.encode())
    time.sleep(0.5)
    comm.Abort(code)


def comm_timeout() -> float:
    """PCLDNN_COMM_TIMEOUT: seconds one collective may wait before the watchdog ends the job."""
    text = os.environ.get("PCLDNN_COMM_TIMEOUT", "600")
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value <= 1e7:
        raise PcldnnError(f"PCLDNN_COMM_TIMEOUT must be seconds in [0, 1e7] (0: no watchdog), got {text!r}")
    return value


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
                _abort(self.comm, f"[rank {self.comm.rank}] pcldnn watchdog: {what[0]} has waited more than "
                                  f"{self.timeout:g} s; aborting the job (under MPI every rank must make the same pcldnn calls "
                                  "in the same order: step, save, evaluate, reading weights)\n", 3)


def layer_modes(net, parallel, p: int, batch: int) -> dict[str, int]:
    """{weighted layer: model-parallel group size} (1: data parallel) for `parallel`:
    "data"; "auto"; or a mapping of layer-name patterns (fnmatch) to "data", "model" (model
    parallel over all p ranks) or "model:G" (hybrid: model parallel within groups of G
    consecutive ranks, data parallel across the p/G groups); unmatched layers are data
    parallel. Only fc layers can be model parallel.

    "auto" asks the communication model (`pcldnn_runtime.scaling.plan`, the one behind
    `pcldnn-gen plan`) for the choice that minimises the iteration time at this global
    minibatch, on the machine PCLDNN_MACHINE names (a preset or a machine JSON file; default
    scaling.DEFAULT_MACHINE)."""
    weighted = [name for name, layer in net.layers.items() if name in net.param_ranges]
    modes = dict.fromkeys(weighted, 1)
    if p == 1 or parallel == "data":
        return modes
    if parallel == "auto":
        from . import scaling
        chosen = scaling.plan(scaling.loads_of(net.layers.values()), p, max(batch, p), scaling.machine_from_env())
        modes.update({c.layer: c.group for c in chosen.costs})
        return modes
    if not isinstance(parallel, dict):
        raise PcldnnError(f'parallel={parallel!r}: use "auto", "data" or a mapping like {{"fc*": "model"}}')
    for pattern, how in parallel.items():
        matched = [name for name in weighted if fnmatch.fnmatchcase(name, str(pattern))]
        if not matched:
            raise PcldnnError(f"parallel: pattern {pattern!r} matches no layer with weights "
                              f"(those are: {', '.join(weighted)})")
        group = _group_size(pattern, how, p)
        for name in matched:
            if group > 1 and net.layers[name].type != "fc":
                raise PcldnnError(f"parallel: layer {name} is {net.layers[name].type}; only fc layers can be "
                                  "model parallel")
            modes[name] = group
    return modes


def _group_size(pattern, how, p: int) -> int:
    if how == "data":
        return 1
    if how == "model":
        return p
    if isinstance(how, str) and how.startswith("model:") and how[6:].isdigit():
        g = int(how[6:])
        if g >= 1 and p % g == 0:
            return g
        raise PcldnnError(f"parallel: {pattern!r}: {how!r}: the group size must divide the {p} ranks")
    raise PcldnnError(f'parallel: {pattern!r}: {how!r}: use "data", "model" or "model:G" (groups of G ranks)')


class _ModelParallelFC:
    """One fc layer split by output features over a group of ranks (`gcomm`): each member owns
    output-feature blocks [lo, hi) of the weights, bias and optimizer state.

    Forward: the group's input rows are gathered (Allgatherv), the owned columns computed for
    all of them, and each member's rows sent back with every column (Alltoallv). Backward: the
    output gradient goes the reverse way, the owned weight gradient is complete over the
    group's rows, and the input gradients, partial sums over the owned features, are added
    and returned to their rows' owners (Reduce_scatter)."""

    def __init__(self, sgd: "SyncSGD", layer, gcomm):
        self.sgd, self.layer, self.comm = sgd, layer, gcomm
        v = layer._net.vector_floats
        self.v, self.ocb = v, layer.ocb_range[1]
        counts = part_counts(self.ocb, gcomm.size, align=1)
        self.parts = [(int(counts[:r].sum()), int(counts[:r + 1].sum())) for r in range(gcomm.size)]
        self.lo, self.hi = self.parts[gcomm.rank]
        self.k = int(np.prod(layer.blocked_shape(layer.in_shape, 1)))
        # (start in the flat buffers, floats per output block) of the weights and of the bias
        w0, b0 = layer.param_offsets
        self.spans = ((w0, int(np.prod(layer.blocked_weight_shape[1:]))), (b0, v))
        self.rows: list[int] = []      # this step's shard sizes of the group's members
        self.bufs: dict[int, dict] = {}  # by group minibatch

    def begin_step(self, sizes: list[int]) -> None:
        self.rows = sizes

    def _buffers(self, total: int) -> dict:
        if total not in self.bufs:
            n = self.ocb * self.v
            self.bufs[total] = {"x": zeros_aligned((total, self.k)), "y": zeros_aligned((total, n)),
                                "dy": zeros_aligned((total, n)), "dx": zeros_aligned((total, self.k))}
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
        self.sgd.blocking(lambda: self.comm.Alltoallv([send, (scounts, _displs(scounts))],
                                                       [recv, (rcounts, _displs(rcounts))]), what)
        if forward:
            for (a, b), off, count in zip(self.parts, _displs(rcounts), rcounts):
                dst[:, a * v:b * v] = recv[off:off + count].reshape(mine, (b - a) * v)
        else:
            dst[:, lo * v:hi * v] = recv.reshape(sum(self.rows), (hi - lo) * v)

    def forward(self, xb: np.ndarray, yb: np.ndarray) -> None:
        name, total = self.layer.name, sum(self.rows)
        buf = self._buffers(total)
        counts = [r * self.k for r in self.rows]
        self.sgd.blocking(lambda: self.comm.Allgatherv(xb, [buf["x"], (counts, _displs(counts))]),
                           f"model-parallel {name}: gather of the input")
        self.layer.run_forward(buf["x"], buf["y"], (self.lo, self.hi))
        self._exchange(buf["y"], yb.reshape(len(xb), -1), True, f"model-parallel {name}: all-to-all of the output")

    def backward(self, dyb: np.ndarray, dxb: np.ndarray | None) -> None:
        name, total = self.layer.name, sum(self.rows)
        buf = self.bufs[total]
        self._exchange(dyb.reshape(len(dyb), -1), buf["dy"], False,
                       f"model-parallel {name}: all-to-all of the output gradient")
        self.layer.run_backward(buf["x"], buf["y"], buf["dy"], buf["dx"] if dxb is not None else None,
                                self.layer.grad_buffers, (self.lo, self.hi))
        if dxb is not None:
            counts = [r * self.k for r in self.rows]
            self.sgd.blocking(lambda: self.comm.Reduce_scatter(buf["dx"], dxb.reshape(-1), recvcounts=counts,
                                                                op=self.sgd.MPI.SUM),
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
            self.comm.Allgatherv(self.sgd.MPI.IN_PLACE, [whole, (counts, _displs(counts)), self.sgd.MPI.FLOAT])


def _displs(counts: list[int]) -> list[int]:
    return [int(sum(counts[:r])) for r in range(len(counts))]


class SyncSGD:
    """Synchronous SGD over `comm` for every weighted layer of `net`: data parallel
    (part-reduce / SGD on the owned part / part-broadcast) or, for fc layers, model parallel
    within groups of ranks (hybrid when the groups are smaller than the job), per `parallel`
    (see `layer_modes`; decided at the first step, when the global minibatch is known).

    `step(x_local, labels_local, step_index)` runs one synchronous step and returns the global
    mean loss and accuracy. `trace` (a list) collects Chrome-trace events when given."""

    def __init__(self, net, optimizer, comm, *, parallel="auto", timeout: float | None = None,
                 trace: list | None = None):
        from mpi4py import MPI
        if not isinstance(comm, MPI.Intracomm):
            raise PcldnnError(f"comm must be an MPI intracommunicator (e.g. MPI.COMM_WORLD), got {type(comm).__name__}")
        self.MPI, self.net, self.opt, self.comm = MPI, net, optimizer, comm
        self.p, self.rank = comm.size, comm.rank
        self.parallel = parallel
        guard_world()
        if comm.size > 1:
            abort_on_exception(comm)
        timeout = comm_timeout() if timeout is None else timeout
        self.watchdog = _Watchdog(comm, timeout)
        self.trace = trace
        self._t0 = time.perf_counter()
        self._lock = threading.Lock()
        self.comm_wait = 0.0  # seconds blocked in MPI this step (exposed communication and rank skew)
        # Every start-up exchange runs under the watchdog: a rank that never arrives ends the job.
        # The agreements travel on a duplicate of comm, so they can never match a collective
        # the program itself runs on comm; at exit this rank announces that it leaves.
        self.ctl = self.blocking(comm.Dup, "start-up: duplicating the communicator")
        atexit.register(_exit_agreement, self.ctl)
        self.agree("start-up (Trainer with comm)", {})
        self.blocking(lambda: check_same_net(net, comm), "start-up: comparing the ranks' builds")
        layer_modes(net, parallel, self.p, self.p)  # refuse a bad mapping or machine before the first step
        self.blocking(lambda: comm.Bcast(net.params, root=0), "start-up: broadcast of rank 0's initial weights")
        net.seed = self.blocking(lambda: comm.bcast(net.seed, root=0), "start-up: broadcast of the dropout seed")
        self._stale = False  # other ranks' slices of model-parallel layers are a step old
        self.modes: dict[str, int] | None = None
        self.blocks: list[dict] = []
        self.by_name: dict[str, list[dict]] = {}
        self.model: dict[str, _ModelParallelFC] = {}
        # Progress: requests are tested between layer kernels; with PCLDNN_PROGRESS_THREAD=1
        # (and MPI_THREAD_MULTIPLE) a helper thread also tests them while kernels run (they
        # release the GIL). Every MPI call on a request holds _lock: MPI does not allow two
        # threads to complete the same request.
        self._threaded = (self.p > 1 and os.environ.get("PCLDNN_PROGRESS_THREAD", "0") == "1"
                          and MPI.Query_thread() == MPI.THREAD_MULTIPLE)
        if self._threaded:
            threading.Thread(target=self._progress_loop, daemon=True, name="pcldnn-progress").start()

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
                runner = _ModelParallelFC(self, self.net.layers[name], gcomm)
                self.net.layers[name].runner = self.model[name] = runner
                ranges = runner.owned_ranges()
            self.by_name[name] = []
            for lo, hi in ranges:
                counts = [int(c) for c in part_counts(hi - lo, comm.size)]
                displs = _displs(counts)
                own = slice(lo + displs[comm.rank], lo + displs[comm.rank] + counts[comm.rank])
                block = {"name": name, "range": (lo, hi), "comm": comm, "counts": counts, "displs": displs,
                         "own": own, "recv": np.empty(counts[comm.rank], np.float32), "reduce": None, "gather": None}
                self.blocks.append(block)
                self.by_name[name].append(block)

    # -- events --------------------------------------------------------------------------
    def _event(self, name: str, cat: str, start: float, end: float) -> None:
        if self.trace is not None:
            self.trace.append({"name": name, "cat": cat, "ph": "X", "pid": self.rank, "tid": cat,
                               "ts": (start - self._t0) * 1e6, "dur": (end - start) * 1e6})

    def blocking(self, call, what: str):
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

    def agree(self, op: str, values: dict, own=None) -> list:
        """`agree` on this job's control communicator, under the watchdog."""
        return agree(self.ctl, op, values, own, self.watchdog)

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
        for b in self.by_name.get(layer.name, ()):
            if b["gather"] is not None:
                self._wait(b["gather"], f"part-broadcast {layer.name}")
                b["gather"] = None
        self._progress()

    def _after_backward(self, layer) -> None:
        for b in self.by_name.get(layer.name, ()):
            start, stop = b["range"]
            with self._lock:
                b["reduce"] = b["comm"].Ireduce_scatter(self.net.grads[start:stop], b["recv"],
                                                        recvcounts=b["counts"], op=self.MPI.SUM)
            b["t_reduce"] = time.perf_counter()
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
            self._wait(b["reduce"], f"step {step_index}: part-reduce of layer {b['name']}")
            b["reduce"] = None
            self._event(f"part-reduce {b['name']}", "comm", b.pop("t_reduce", t3), time.perf_counter())
            s = time.perf_counter()
            np.copyto(self.net.grads[b["own"]], b["recv"])
            self.opt.apply(self.net.params, self.net.grads, step_index, b["own"])
            start, stop = b["range"]
            with self._lock:
                b["gather"] = b["comm"].Iallgatherv(
                    self.MPI.IN_PLACE, [self.net.params[start:stop], (b["counts"], b["displs"]), self.MPI.FLOAT])
            self._event(f"sgd {b['name']}", "compute", s, time.perf_counter())
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
            if b["gather"] is not None:
                self._wait(b["gather"], f"part-broadcast {b['name']}")
                b["gather"] = None
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
            start, stop = b["range"]
            out[start:stop] = 0.0
            out[b["own"]] = v[b["own"]]
            self.blocking(lambda: b["comm"].Allgatherv(
                self.MPI.IN_PLACE, [out[start:stop], (b["counts"], b["displs"]), self.MPI.FLOAT]),
                f"save: gathering the momentum of {b['name']}")
        for runner in self.model.values():
            self.blocking(lambda: runner.complete(out), f"save: gathering the momentum slices of {runner.layer.name}")
        return out


def check_same_net(net, comm) -> None:
    """Refuse to start when ranks loaded different nets, builds or ISAs (a hash exchange)."""
    mine = (net.net_hash, int(net.params.size), net.isa, net.build_fingerprint())
    everyone = comm.allgather(mine)
    if any(other != mine for other in everyone):
        lines = [f"rank {r}: net {h[:12]}, {n} parameters, {isa}, build {fp[:12]}"
                 for r, (h, n, isa, fp) in enumerate(everyone)]
        raise PcldnnError("ranks loaded different nets or builds; refusing to train:\n  " + "\n  ".join(lines))
