"""`pcldnn-gen tune`: the model's best few register tiles per kernel, each built and timed on the
real shape, the winner recorded in the tuning database (pcldnn_gen.tuning).

Method (the one benchmarks/ab.py uses to judge a kernel change): build k of a net forces every
kernel's k-th candidate, so N candidates cost N builds of the net (unchanged kernels come from
the compile cache); then each kernel's candidates are timed alternately, `rounds` times with the
order rotated, each round taking the median of `repeats` calls, and compared on the medians over
rounds. A candidate replaces the model's tile only when it is faster by more than NOISE.

`precision` bf16 tunes a bf16 build's kernels (vdpbf16ps; AMX kernels have no register tile to
choose), each on the bf16 activations and gradients it has in that net: the build the user
compiles with `--precision bf16`, timed on a CPU that runs it."""
from __future__ import annotations

import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pcldnn_runtime as pr

from .arch import Arch
from .bench import KernelTimer, kernel_timers, measure_peak
from .build import build, check_precision, net_activations, net_gradients, plan_kernel
from .netspec import NetSpec
from .planner import LAYER_PASSES, Measured, TileTiming
from .tuning import Entry, TuningDB, key_id, plan_key

# A build timed against a copy of itself (benchmarks/ab.py, cifar_small on the EPYC VM, one
# thread, 5 rounds) gave per-kernel ratios of 0.96-1.03: a candidate must beat the model's tile
# by more than that to replace it.
NOISE = 0.03
WARM_CALL_MS = 5.0
KERNEL_SECONDS = 3.0
MIN_ROUNDS = 5


@dataclass(frozen=True)
class TuneRow:
    net: str
    layer: str
    pass_name: str
    model: tuple[int, int]      # the model's first choice
    best: tuple[int, int]       # the fastest measured
    choice: tuple[int, int]     # what compile will use (the model's unless beaten by more than NOISE)
    model_ms: float             # medians over rounds
    best_ms: float
    gain: float                 # median over rounds of model time / best time: what tuning buys (1.0: nothing)
    candidates: int

    @property
    def hit(self) -> bool:
        return self.best == self.model


@dataclass(frozen=True)
class TuneReport:
    rows: tuple[TuneRow, ...]
    single: int         # kernels whose planner has one candidate: nothing to tune
    known: int          # kernels with an entry already (not measured again without --force)
    unmeasured: int     # kernels left when the budget ran out
    peak_gflops: float
    seconds: float


@dataclass(frozen=True)
class _Kernel:
    layer: str
    pass_name: str
    key: dict
    flops: int
    tiles: tuple[tuple[int, int], ...]   # candidates, the model's first
    predicted: tuple[float, ...]


def tune(nets: list[NetSpec], arch: Arch, batch: int, threads: int, *, candidates: int = 4, rounds: int = 15,
         repeats: int = 1, budget: float | None = None, force: bool = False, db: TuningDB | None = None,
         progress: Callable[[str], None] = lambda line: None, precision: str = "fp32") -> TuneReport:
    """Time the candidates of every conv / fc kernel of `nets`' `precision` builds (each kernel
    once) and merge the results into `db` (default: the database at its usual path) net by net."""
    check_can_tune(arch, precision)
    db = db if db is not None else TuningDB.load()
    db.check_writable()  # before minutes of measuring, not after
    start = time.perf_counter()
    peak = measure_peak(arch, threads)
    rows: list[TuneRow] = []
    seen: set[str] = set()
    single = known = unmeasured = 0

    def over_budget() -> bool:
        return budget is not None and time.perf_counter() - start > budget

    for net in nets:
        kernels, counts = _kernels_to_time(net, arch, batch, candidates, db, force, seen, precision)
        single, known = single + counts[0], known + counts[1]
        if not kernels:
            continue
        if over_budget():
            unmeasured += len(kernels)
            continue
        entries = []
        with tempfile.TemporaryDirectory(prefix="pcldnn-tune-") as tmp:
            loaded = []
            for k in range(max(len(kn.tiles) for kn in kernels)):
                choices = {(kn.layer, kn.pass_name): kn.tiles[k] for kn in kernels if k < len(kn.tiles)}
                out = build(net, arch, Path(tmp) / f"candidate{k}", choices=choices, precision=precision).directory
                loaded.append(pr.load(out, threads=threads))
            for layer_name in dict.fromkeys(kn.layer for kn in kernels):
                mine = [kn for kn in kernels if kn.layer == layer_name]
                if over_budget():
                    unmeasured += len(mine)
                    continue
                runs = [kernel_timers(n.layers[layer_name], batch) for n in loaded[:max(len(kn.tiles) for kn in mine)]]
                for kn in mine:
                    times = _time_candidates([r[kn.pass_name] for r in runs[:len(kn.tiles)]], rounds, repeats)
                    row, entry = _result(net.name, kn, times, arch, batch, threads, peak)
                    rows.append(row)
                    entries.append(entry)
                    progress(format_row(row))
        if entries:
            db.merge_into(entries)
    return TuneReport(tuple(rows), single, known, unmeasured, peak, time.perf_counter() - start)


def check_can_tune(arch: Arch, precision: str) -> None:
    """An ArchError unless this CPU runs `precision` builds for `arch` (the tuner times them)."""
    check_precision(precision, arch)
    pr.cpu.require(arch.isa, "tuning")
    pr.cpu.require_precision(precision, "every build `tune` times",
                             "tune where the bf16 build will run (it runs only on such a CPU)")


def _kernels_to_time(net: NetSpec, arch: Arch, batch: int, candidates: int, db: TuningDB, force: bool,
                     seen: set[str], precision: str) -> tuple[list[_Kernel], tuple[int, int]]:
    """The net's kernels with two or more candidate tiles not measured yet (this run: `seen`;
    the database, unless `force`), and (kernels with one candidate, kernels already known)."""
    kernels, single, known = [], 0, 0
    activations, gradients = net_activations(net, arch, precision), net_gradients(net, arch, precision)
    for layer in net.layers:
        if not layer.weighted:
            continue

        def plan(p: str, choice: tuple[int, int] | None = None) -> Any:
            return plan_kernel(layer, p, arch, None, choice, precision, activations[layer.name], gradients[layer.name])

        for p in LAYER_PASSES[layer.type]:
            model = plan(p)
            key = plan_key(layer, model, arch)
            if key_id(key) in seen:
                continue
            seen.add(key_id(key))
            if key_id(key) in db.entries and not force:
                known += 1
                continue
            tiles = model.candidate_tiles[:candidates]
            if len(tiles) < 2:
                single += 1
                continue
            # each candidate's figure as the planner rates it in its own plan
            predicted = [plan(p, (t.width, t.vectors)).predicted_efficiency for t in tiles]
            kernels.append(_Kernel(layer.name, p, key, layer.flops(batch), tuple((t.width, t.vectors) for t in tiles),
                                   tuple(predicted)))
    return kernels, (single, known)


def _time_candidates(timers: list[KernelTimer], rounds: int, repeats: int) -> list[list[float]]:
    """Milliseconds per kernel call of each candidate per round (median of `repeats`), the
    candidates timed back to back within a round and their order rotated between rounds.
    Kernels shorter than WARM_CALL_MS get an untimed call first (their buffers back in cache
    after the other candidates'); long ones get fewer rounds, down to MIN_ROUNDS, to keep near
    KERNEL_SECONDS."""
    first = [timer() * 1e3 for timer in timers]  # also warms every candidate up
    warm = first[0] < WARM_CALL_MS
    per_round = sum(first) * (repeats + warm) / 1e3
    rounds = max(min(rounds, MIN_ROUNDS), min(rounds, int(KERNEL_SECONDS / per_round)))
    times: list[list[float]] = [[] for _ in timers]
    for r in range(rounds):
        for i in range(len(timers)):
            k = (i + r) % len(timers)
            if warm:
                timers[k]()
            times[k].append(statistics.median(timers[k]() for _ in range(repeats)) * 1e3)
    return times


def _result(net: str, kn: _Kernel, times: list[list[float]], arch: Arch, batch: int, threads: int,
            peak: float) -> tuple[TuneRow, Entry]:
    """Candidates ranked by the median over rounds of the model's time / theirs in the same
    round: a slow spell of the machine (the project VMs drift by 10% over seconds) hits every
    candidate of a round alike and cancels."""
    speedup = [statistics.median(m / t for m, t in zip(times[0], tk)) for tk in times]
    ms = [statistics.median(tk) for tk in times]
    best = max(range(len(ms)), key=speedup.__getitem__)
    choice = best if speedup[best] > 1 + NOISE else 0
    order = sorted(range(len(ms)), key=lambda i: -speedup[i])
    timings = tuple(TileTiming(width=kn.tiles[i][0], vectors=kn.tiles[i][1], predicted_efficiency=kn.predicted[i],
                               ms=ms[i]) for i in order)
    measured = Measured(model=kn.tiles[0], batch=batch, threads=threads, peak_gflops=peak, flops=kn.flops,
                        timings=timings)
    row = TuneRow(net, kn.layer, kn.pass_name, kn.tiles[0], kn.tiles[best], kn.tiles[choice], ms[0], ms[best],
                  speedup[best], len(ms))
    return row, Entry(kn.key, arch.name, kn.tiles[choice], measured)


def _tile(t: tuple[int, int]) -> str:
    return f"{t[0]}x{t[1]}"


def format_row(row: TuneRow) -> str:
    return (f"  {row.layer:<24} {row.pass_name:<12} model {_tile(row.model):>6} {row.model_ms:9.3f} ms   "
            f"best {_tile(row.best):>6} {row.best_ms:9.3f} ms   {row.gain:5.2f}x   uses {_tile(row.choice)}")


def summary(report: TuneReport) -> str:
    rows = report.rows
    lines = [f"measured FMA peak {report.peak_gflops:.1f} GFLOP/s; {len(rows)} kernels timed in "
             f"{report.seconds:.0f} s"]
    if rows:
        gains = sorted(r.gain for r in rows)
        top = max(rows, key=lambda r: r.gain)
        hits = sum(r.hit for r in rows)
        near = sum(r.gain <= 1 + NOISE for r in rows)
        changed = sum(r.choice != r.model for r in rows)
        lines += [f"model's first choice measured fastest: {hits} of {len(rows)} ({hits / len(rows):.0%}); "
                  f"within {NOISE:.0%} of the fastest: {near} ({near / len(rows):.0%})",
                  f"gain of tuning (model's time / best time): median {statistics.median(gains):.3f}x, "
                  f"largest {top.gain:.2f}x ({top.layer} {top.pass_name}: {_tile(top.model)} -> {_tile(top.best)}); "
                  f"{changed} kernels now use a measured tile"]
    for count, what in ((report.known, "already in the database (--force measures them again)"),
                        (report.single, "with a single candidate (nothing to tune)"),
                        (report.unmeasured, "left unmeasured: the budget ran out")):
        if count:
            lines.append(f"{count} kernels {what}")
    return "\n".join(lines)


def report_json(report: TuneReport, arch: Arch, batch: int, threads: int, precision: str = "fp32") -> dict:
    return {"arch": arch.name, "isa": arch.isa, "precision": precision, "batch": batch, "threads": threads,
            "peak_gflops": report.peak_gflops, "seconds": report.seconds, "single": report.single,
            "known": report.known, "unmeasured": report.unmeasured,
            "rows": [{"net": r.net, "layer": r.layer, "pass": r.pass_name, "model": list(r.model),
                      "best": list(r.best), "choice": list(r.choice), "model_ms": r.model_ms, "best_ms": r.best_ms,
                      "gain": r.gain, "candidates": r.candidates} for r in report.rows]}
