"""What keeps an MPI job from hanging or silently diverging: finding the world (from the
launcher's environment, `launcher.py`), aborting the job on an uncaught exception, the watchdog
on collectives, and the agreement every collective entry point starts with (same operation,
same values, same build on every rank). The cluster layer: the core runtime never imports it."""
from __future__ import annotations

import os
import sys
import threading
import time
import traceback
from typing import Any

from .errors import PcldnnError
from .launcher import launched, local_ranks

_guarded: set[int] = set()


def world() -> Any:
    """MPI.COMM_WORLD when this process is one of several MPI ranks, else None. mpi4py is
    imported only when a launcher announced a job of more than one rank (or the program
    already imported it)."""
    if not launched() and "mpi4py.MPI" not in sys.modules:
        return None
    try:
        from mpi4py import MPI
    except ImportError:
        return None
    if not MPI.Is_initialized() or MPI.Is_finalized() or MPI.COMM_WORLD.Get_size() < 2:
        return None
    return MPI.COMM_WORLD


def guard_world() -> Any:
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
    announced = local_ranks()
    if announced is not None:
        return announced
    comm = world()
    if comm is None:
        return 1
    from mpi4py import MPI
    return comm.Split_type(MPI.COMM_TYPE_SHARED).Get_size()


def agree(comm: Any, op: str, values: dict, own: Any = None, watchdog: Watchdog | None = None) -> list:
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


def exit_agreement(comm: Any) -> None:
    """At interpreter exit of a rank that trained: tell ranks still in a pcldnn collective
    (step, save, evaluate) that this one is leaving, so they fail with a message."""
    from mpi4py import MPI
    if MPI.Is_finalized():
        return
    try:
        agree(comm, "exit", {})
    except PcldnnError as e:
        _abort(comm, f"[rank {comm.rank}] {e}\n", 1)


def abort_on_exception(comm: Any) -> None:
    """An uncaught exception on any rank prints that rank's traceback and aborts the whole job
    (the other ranks would otherwise wait forever in the next collective)."""
    def hook(kind: Any, value: Any, tb: Any) -> None:
        text = "".join(traceback.format_exception(kind, value, tb))
        _abort(comm, f"[rank {comm.rank}] uncaught {kind.__name__}: {value}\n{text}", 1)
    sys.excepthook = hook


def _abort(comm: Any, message: str, code: int) -> None:
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


class Watchdog:
    """Reports (and aborts on) a collective that waits longer than `timeout` seconds: which
    rank, which layer, which operation."""

    def __init__(self, comm: Any, timeout: float) -> None:
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


def check_same_net(net: Any, comm: Any) -> None:
    """Refuse to start when ranks loaded different nets, builds or ISAs (a hash exchange)."""
    mine = (net.net_hash, int(net.params.size), net.isa, net.build_fingerprint())
    everyone = comm.allgather(mine)
    if any(other != mine for other in everyone):
        lines = [f"rank {r}: net {h[:12]}, {n} parameters, {isa}, build {fp[:12]}"
                 for r, (h, n, isa, fp) in enumerate(everyone)]
        raise PcldnnError("ranks loaded different nets or builds; refusing to train:\n  " + "\n  ".join(lines))
