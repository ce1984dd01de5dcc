"""What a run does, seen from outside without changing its script (as ONEDNN_VERBOSE and
PyTorch's profiler traces show it):

- `PCLDNN_VERBOSE=1`: one line per kernel call on stderr,
  `pcldnn_verbose,<rank>,exec,<layer>,<pass>,<isa>,<shape>,<threads>,<ms>,<GFLOP/s>,<% of peak>`,
  with nominal FLOPs for conv and fc passes (`-` for the others) against the FMA peak of the
  call's thread count, measured once with the build's own peak kernel and printed as
  `pcldnn_verbose,<rank>,info,peak,<threads>,<GFLOP/s>`. The shape reads like oneDNN's
  (`mb16_ic64oc128_ih56oh56kh3sh1ph1_iw56ow56kw3sw1pw1`).
- `PCLDNN_TIMELINE=path`: a Chrome-trace JSON (chrome://tracing, ui.perfetto.dev) written at
  exit, one process per rank (merged on rank 0 under MPI): each kernel call per layer and
  pass, steps and the optimizer, MPI waits, and the part-reduces and part-broadcasts as async
  slices, which show how they overlap the backward and forward kernels.

Both wrap the kernel functions as a net is loaded: with neither set nothing is wrapped and
nothing costs anything.
"""
from __future__ import annotations

import atexit
import functools
import itertools
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .abi import SIGNATURES
from .errors import PcldnnError
from .launcher import WORLD_RANK_ENV, WORLD_SIZE_ENV, launcher_value
from .limits import blocks
from .manifest import LayerEntry
from .validate import write_atomic

VERBOSE_ENV = "PCLDNN_VERBOSE"
TIMELINE_ENV = "PCLDNN_TIMELINE"
MAX_EVENTS = 2_000_000  # per rank (~200 MB of JSON); later events are counted, not kept
# Thread ids of the timeline's tracks within a rank's process, and their names.
TRACKS = {"kernels": 1, "steps": 2, "MPI waits": 3}


def per_minibatch(kind: str) -> bool:
    """Kernels that run on a minibatch (a `batch` parameter) are observed; weight conversions,
    which a layer runs once per call whatever the minibatch, are not."""
    return " batch" in SIGNATURES[kind]


class KernelCall:
    """What a kernel's verbose line and timeline slice say, fixed when the net is loaded: layer,
    pass, shape text, nominal FLOPs per image, and where batch, nthreads and a model-parallel
    slice sit in its argument list."""

    def __init__(self, layer: LayerEntry, role: str, kind: str, isa: str, v: int):
        self.layer, self.role, self.isa = layer.name, role, isa
        self.label = f"{layer.name} {role}"
        self.shape = shape_text(layer.type, layer.in_shape, layer.out_shape, layer.kernel, layer.stride, layer.pad)
        params = [p.split()[-1].lstrip("*") for p in SIGNATURES[kind].split(",")]
        self.batch_at, self.threads_at = params.index("batch"), params.index("nthreads")
        self.slice_at = params.index("ocb_lo") if "ocb_lo" in params else None
        self.out_blocks = blocks(layer.out_shape[0], v)
        weighted = kind.startswith(("conv_", "fc_")) and role in ("fwd", "bwd_data", "bwd_weights")
        oc, oh, ow = layer.out_shape
        self.flops = 2.0 * oc * oh * ow * layer.in_shape[0] * layer.kernel[0] * layer.kernel[1] if weighted else 0.0

    def flops_of(self, args: tuple) -> float:
        flops = self.flops * args[self.batch_at]
        if self.slice_at is not None and flops:  # a model-parallel rank's output blocks only
            flops *= (args[self.slice_at + 1] - args[self.slice_at]) / self.out_blocks
        return flops


def shape_text(kind: str, in_shape: Any, out_shape: Any, kernel: Any, stride: Any, pad: Any) -> str:
    """oneDNN-style problem descriptor, without the minibatch."""
    (ic, ih, iw), (oc, oh, ow) = in_shape, out_shape
    if kind in ("conv", "maxpool", "avgpool"):
        channels = f"ic{ic}oc{oc}" if kind == "conv" else f"ic{ic}"
        return (f"{channels}_ih{ih}oh{oh}kh{kernel[0]}sh{stride[0]}ph{pad[0]}"
                f"_iw{iw}ow{ow}kw{kernel[1]}sw{stride[1]}pw{pad[1]}")
    if kind == "fc":
        return f"ic{ic * ih * iw}oc{oc}"
    return f"c{ic}h{ih}w{iw}" if (ih, iw) != (1, 1) else f"c{ic}"


class Observer:
    """Collects timeline events and prints verbose lines for one process (one rank)."""

    def __init__(self, verbose: bool, timeline: Path | None):
        self.verbose, self.timeline = verbose, timeline
        self.rank = launcher_value(WORLD_RANK_ENV, 0)
        self.launched_ranks = launcher_value(WORLD_SIZE_ENV, 1)
        self.zero = time.perf_counter()  # this rank's clock at the common origin (MPI: after a barrier)
        self.comm = None                  # set by the MPI runtime: the events merge on its rank 0
        self._finalized: Callable[[], bool] = lambda: True
        self.events: list[tuple] = []     # (phase, name, track, start, end, args)
        self.dropped = 0
        self._ids = itertools.count(1)
        self._peaks: dict[int, float | None] = {}
        if timeline is not None:
            atexit.register(self.write_at_exit)

    # -- recording -----------------------------------------------------------------------
    def _add(self, event: tuple) -> None:
        if len(self.events) < MAX_EVENTS:
            self.events.append(event)
        else:
            self.dropped += 1

    def span(self, name: str, track: str, start: float, end: float, args: dict | None = None) -> None:
        """A slice on one of the rank's tracks (slices of a track nest or follow each other)."""
        if self.timeline is not None:
            self._add(("X", name, track, start, end, args))

    def overlapping(self, name: str, start: float, end: float) -> None:
        """An async slice (communication in flight: several overlap each other and the kernels)."""
        if self.timeline is not None:
            self._add(("b", name, next(self._ids), start, end, None))

    def wrap(self, fn: Callable, call: KernelCall, peak: Callable[[int], float | None]) -> Callable:
        """fn, timed: a verbose line and a timeline slice per call. `peak(threads)`: GFLOP/s."""
        def timed(*args: Any) -> None:
            threads = args[call.threads_at]
            if self.verbose and threads not in self._peaks:  # measured once, outside any timed call
                self._peaks[threads] = peak(threads)
                self._print_peak(threads)
            start = time.perf_counter()
            fn(*args)
            end = time.perf_counter()
            flops = call.flops_of(args)
            batch = args[call.batch_at]
            if self.timeline is not None:
                extra = {"shape": f"mb{batch}_{call.shape}", "threads": threads}
                if flops:
                    extra["GFLOP/s"] = round(flops / max(end - start, 1e-9) / 1e9, 2)
                self._add(("X", call.label, "kernels", start, end, extra))
            if self.verbose:
                self._print_call(call, batch, threads, end - start, flops)
        timed.__wrapped__ = fn  # type: ignore[attr-defined]  # the C function (bench repeats it in C)
        return timed

    # -- verbose lines -------------------------------------------------------------------
    def _print_peak(self, threads: int) -> None:
        peak = self._peaks[threads]
        _line(f"pcldnn_verbose,{self.rank},info,peak,{threads},{peak:.1f}" if peak else
              f"pcldnn_verbose,{self.rank},info,peak,{threads},- (a build without a peak kernel: recompile)")

    def _print_call(self, call: KernelCall, batch: int, threads: int, seconds: float, flops: float) -> None:
        gflops = flops / max(seconds, 1e-9) / 1e9
        peak = self._peaks.get(threads)
        rate = f"{gflops:.1f}" if flops else "-"
        share = f"{100 * gflops / peak:.0f}" if flops and peak else "-"
        _line(f"pcldnn_verbose,{self.rank},exec,{call.layer},{call.role},{call.isa},mb{batch}_{call.shape},"
              f"{threads},{seconds * 1e3:.4f},{rate},{share}")

    # -- MPI -----------------------------------------------------------------------------
    def join(self, comm: Any, finalized: Callable[[], bool]) -> None:
        """Under MPI: align this rank's clock with the others' (right after a barrier) and merge
        the events on rank 0 of `comm` at exit (a communicator only the runtime uses), unless
        `finalized()` says MPI has ended by then (the cluster layer's check: no MPI import here)."""
        comm.Barrier()
        self.zero = time.perf_counter()
        self.rank, self.comm, self._finalized = comm.rank, comm, finalized

    # -- the file ------------------------------------------------------------------------
    def trace_events(self, rank: int, zero: float, events: list[tuple], dropped: int) -> list[dict]:
        """Chrome-trace events of one rank's records (times relative to its common origin)."""
        out: list[dict] = [{"name": "process_name", "ph": "M", "pid": rank, "args": {"name": f"rank {rank}"}},
                           {"name": "process_sort_index", "ph": "M", "pid": rank, "args": {"sort_index": rank}}]
        out += [{"name": "thread_name", "ph": "M", "pid": rank, "tid": tid, "args": {"name": name}}
                for name, tid in TRACKS.items()]
        for phase, name, track, start, end, args in events:
            ts = round((start - zero) * 1e6, 3)
            if phase == "X":
                event = {"name": name, "ph": "X", "pid": rank, "tid": TRACKS[track], "ts": ts,
                         "dur": round((end - start) * 1e6, 3)}
                if args:
                    event["args"] = args
                out.append(event)
            else:  # async: track holds the slice's id
                common = {"name": name, "cat": "communication", "id": f"{rank}.{track}", "pid": rank, "tid": 0}
                out.append(common | {"ph": "b", "ts": ts})
                out.append(common | {"ph": "e", "ts": round((end - zero) * 1e6, 3)})
        if dropped:
            out.append({"name": f"{dropped} later events not kept (over {MAX_EVENTS})", "ph": "i", "s": "p",
                        "pid": rank, "tid": TRACKS["steps"], "ts": out[-1].get("ts", 0)})
        return out

    def write_at_exit(self) -> None:
        """The timeline file: merged on rank 0 when the MPI runtime joined, else this process's
        (with `.rank<r>` added when a launcher started several processes that did not join)."""
        path, comm = self.timeline, self.comm
        if path is None:
            return
        if comm is not None and self._finalized():
            comm = None
        mine = (self.rank, self.zero, self.events, self.dropped)
        if comm is not None:
            parts = comm.gather(mine, root=0)
            if comm.rank != 0:
                return
        else:
            parts = [mine]
            if self.launched_ranks > 1:
                path = path.with_name(f"{path.name}.rank{self.rank}")
        events = [e for part in parts for e in self.trace_events(*part)]
        document = {"traceEvents": events, "displayTimeUnit": "ms",
                    "otherData": {"producer": "pcldnn_runtime", "ranks": len(parts)}}
        write_atomic(path, json.dumps(document, separators=(",", ":")).encode())


def _line(text: str) -> None:
    """One verbose line in one write: a launcher that merges several ranks' stderr (mpiexec)
    then gets whole lines."""
    sys.stderr.write(text + "\n")
    sys.stderr.flush()


@functools.lru_cache(maxsize=1)
def observer() -> Observer | None:
    """The process's Observer from PCLDNN_VERBOSE and PCLDNN_TIMELINE; None when neither is set."""
    verbose_text = os.environ.get(VERBOSE_ENV, "0")
    if verbose_text not in ("0", "1"):
        raise PcldnnError(f"{VERBOSE_ENV} must be 0 or 1, got {verbose_text[:40]!r}")
    timeline_text = os.environ.get(TIMELINE_ENV, "")
    timeline = None
    if timeline_text:
        timeline = Path(timeline_text).expanduser()
        if "\0" in timeline_text or len(timeline_text) > 4096 or timeline.is_dir() or not timeline.parent.is_dir():
            raise PcldnnError(f"{TIMELINE_ENV}={timeline_text[:80]!r}: must name a file in an existing directory")
        timeline = timeline.absolute()
    if verbose_text == "0" and timeline is None:
        return None
    return Observer(verbose_text == "1", timeline)
