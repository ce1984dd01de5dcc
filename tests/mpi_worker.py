"""Run by tests/test_distributed.py under `mpiexec -n P python tests/mpi_worker.py MODE JSON`.

Every rank does the same thing on its own shard; rank 0 writes the results the test checks.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
from mpi4py import MPI

import pcldnn_runtime as pr
from pcldnn_runtime.distributed import part_counts

comm = MPI.COMM_WORLD


def batches(cfg):
    data = pr.synthetic(cfg["batch"] * cfg["steps_total"], tuple(cfg["shape"]), cfg["classes"], seed=4)
    return list(data.batches(cfg["batch"]))


def shard(x, y):
    from pcldnn_runtime.distributed import shard_bounds
    lo, hi = shard_bounds(len(y), comm.size, comm.rank)
    return x[lo:hi], y[lo:hi]


def optimizer(cfg):
    return pr.SGD(cfg["lr"], momentum=0.9, weight_decay=1e-3, schedule="cosine", total_steps=cfg["steps_total"])


def train(cfg):
    # Each rank loads with its own seed: the runtime must broadcast rank 0's initial weights.
    net = pr.load(cfg["build"], threads=1, seed=cfg["seed"] + comm.rank)
    trace = []
    if cfg.get("resume"):
        trainer = pr.Trainer.resume(cfg["resume"], net, comm=comm, trace=trace, parallel=cfg.get("parallel", "data"))
    else:
        trainer = pr.Trainer(net, optimizer(cfg), seed=0, comm=comm, trace=trace, parallel=cfg.get("parallel", "data"))
    losses = []
    for xb, yb in batches(cfg)[trainer.step_count:cfg["steps"]]:
        losses.append(trainer.step(*shard(xb, yb)))
    if cfg.get("save"):
        trainer.save(cfg["save"])
    trainer.sync()
    if comm.rank == 0:
        np.savez(cfg["out"], params=net.params, losses=np.array(losses))
        Path(cfg["out"] + ".trace.json").write_text(json.dumps({"traceEvents": trace}))


def collectives(cfg):
    """Part-reduce (reduce-scatter) then part-broadcast (all-gather) equals Allreduce."""
    rng = np.random.default_rng(comm.rank)
    report = []
    for n in cfg["sizes"]:
        # small integers: every summation order gives the same float32 sum, so compare exactly
        buf = rng.integers(-50, 50, n).astype(np.float32)
        want = np.empty_like(buf)
        comm.Allreduce(buf, want)
        counts = part_counts(n, comm.size)
        displs = np.concatenate(([0], np.cumsum(counts)[:-1]))
        part = np.empty(int(counts[comm.rank]), np.float32)
        comm.Ireduce_scatter(buf, part, recvcounts=[int(c) for c in counts]).Wait()
        full = np.zeros_like(buf)
        full[displs[comm.rank]:displs[comm.rank] + counts[comm.rank]] = part
        comm.Iallgatherv(MPI.IN_PLACE, [full, ([int(c) for c in counts], [int(d) for d in displs]), MPI.FLOAT]).Wait()
        report.append({"n": n, "counts": counts.tolist(), "equal": bool(np.array_equal(full, want))})
    if comm.rank == 0:
        Path(cfg["out"]).write_text(json.dumps(report))


def misbehave(cfg, how):
    """After one step rank 1 raises ("fail": the abort hook must end the job) or stops taking
    part ("stall": rank 0's watchdog must end it); the other ranks would wait forever."""
    import time
    net = pr.load(cfg["build"], threads=1)
    trainer = pr.Trainer(net, optimizer(cfg), comm=comm)
    xb, yb = batches(cfg)[0]
    trainer.step(*shard(xb, yb))
    if comm.rank == 1:
        if how == "fail":
            raise RuntimeError("rank 1 fails on purpose")
        time.sleep(120)
    trainer.step(*shard(xb, yb))


def mismatch(cfg):
    build = cfg["build"] if comm.rank == 0 else cfg["other_build"]
    try:
        pr.Trainer(pr.load(build, threads=1), optimizer(cfg), comm=comm)
    except pr.PcldnnError as e:
        print(f"rank {comm.rank}: {e}", flush=True)
        sys.exit(5)


if __name__ == "__main__":
    mode, cfg = sys.argv[1], json.loads(sys.argv[2])
    modes = {"train": train, "collectives": collectives, "mismatch": mismatch,
             "fail": lambda c: misbehave(c, "fail"), "stall": lambda c: misbehave(c, "stall")}
    modes[mode](cfg)
