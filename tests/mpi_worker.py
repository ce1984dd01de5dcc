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
from pcldnn_runtime.partition import part_counts

comm = MPI.COMM_WORLD


def batches(cfg):
    data = pr.synthetic(cfg["batch"] * cfg["steps_total"], tuple(cfg["shape"]), cfg["classes"], seed=4)
    return list(data.batches(cfg["batch"]))


def shard(x, y):
    from pcldnn_runtime.partition import shard_bounds
    lo, hi = shard_bounds(len(y), comm.size, comm.rank)
    return x[lo:hi], y[lo:hi]


def optimizer(cfg):
    return pr.SGD(cfg["lr"], momentum=0.9, weight_decay=1e-3, schedule="cosine", total_steps=cfg["steps_total"])


def train(cfg):
    # Each rank loads with its own seed: the runtime must broadcast rank 0's initial weights.
    net = pr.load(cfg["build"], threads=1, seed=cfg["seed"] + comm.rank)
    trace = []
    extra = {"trace": trace, "parallel": cfg.get("parallel", "data"), "gradient_exchange": cfg.get("exchange", "fp32"),
             "sync_batchnorm": cfg.get("sync_batchnorm", False)}
    if cfg.get("resume"):
        trainer = pr.Trainer.resume(cfg["resume"], net, comm=comm, **extra)
    else:
        trainer = pr.Trainer(net, optimizer(cfg), seed=0, comm=comm, **extra)
    losses = []
    for xb, yb in batches(cfg)[trainer.step_count:cfg["steps"]]:
        losses.append(trainer.step(*shard(xb, yb)))
    if cfg.get("save"):
        trainer.save(cfg["save"])
    trainer.sync()
    identical = len(set(comm.allgather(net.params.tobytes()))) == 1  # every rank holds the same weights
    statistics = comm.gather(net.running_statistics()[0])  # batchnorm layers' running mean and variance
    if comm.rank == 0:
        np.savez(cfg["out"], params=net.params, losses=np.array(losses), library=MPI.Get_library_version(),
                 identical=identical, statistics=np.stack(statistics))
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


def read_after_step(cfg):
    """Steps without `sync`, then every rank reads the weights by one route (cfg["read"]):
    they must be the current ones (rank 0 checks them against a sync'd copy afterwards)."""
    net = pr.load(cfg["build"], threads=1, seed=cfg["seed"])
    trainer = pr.Trainer(net, optimizer(cfg), seed=0, comm=comm, parallel=cfg.get("parallel", "data"))
    got = {}
    for xb, yb in batches(cfg)[:cfg["steps"]]:
        trainer.step(*shard(xb, yb))
        if cfg["read"] == "layer":
            got = {name: layer.weights.copy() for name, layer in net.layers.items() if name in net.param_ranges}
        else:
            got = {"params": net.params.copy()}
    if comm.rank == 0:
        np.savez(cfg["out"], **got)


def faults(cfg):
    """One rank misbehaves the way cfg["fault"] says; the job must end with a message."""
    fault = cfg["fault"]
    if fault == "load_missing":  # the build is missing on one node
        pr.load(cfg["build"] if comm.rank == 0 else cfg["build"] + "-absent", threads=1)
        pr.Trainer(pr.load(cfg["build"], threads=1), optimizer(cfg), comm=comm)
        return
    if fault == "threads":
        print(f"rank {comm.rank} threads {pr.load(cfg['build']).threads}", flush=True)
        return
    net = pr.load(cfg["build"], threads=1)
    seed = comm.rank if fault == "seed" else 0
    trainer = pr.Trainer(net, optimizer(cfg), seed=seed, comm=comm, parallel=cfg.get("parallel", "data"))
    data = pr.synthetic(48, tuple(cfg["shape"]), cfg["classes"], seed=4)
    if fault == "batch":
        trainer.fit(data, epochs=1, batch_size=12 if comm.rank == 0 else 6, progress=False)
    elif fault == "seed":
        trainer.fit(data, epochs=1, batch_size=12, progress=False)
    elif fault in ("save_rank0", "save_rank0_then_exit"):
        xb, yb = batches(cfg)[0]
        trainer.step(*shard(xb, yb))
        if comm.rank == 0:
            trainer.save(cfg["out"])
        if fault == "save_rank0":
            trainer.step(*shard(xb, yb))
    elif fault == "exit_early":
        if comm.rank == 1:
            sys.exit(3)
        xb, yb = batches(cfg)[0]
        trainer.step(*shard(xb, yb))


class RecordingMemmap(pr.MemmapDataset):
    """A memory-mapped dataset that notes every row this rank reads (the loader's reader
    threads may read the next minibatches while a step runs: list.append is atomic)."""

    reads: list

    def _load(self, indices):
        self.reads.append(np.array(indices, np.int64))
        return super()._load(indices)


def fit_data(cfg):
    """fit on a memory-mapped, augmented dataset; every rank reports the rows it read."""
    net = pr.load(cfg["build"], threads=1, seed=cfg["seed"] + comm.rank)
    trainer = pr.Trainer(net, optimizer(cfg), seed=3, comm=comm)
    data = RecordingMemmap(cfg["images"], cfg["labels"], augment=pr.Augment(crop_padding=1, flip=True, seed=5))
    data.reads = []
    trainer.fit(data, epochs=cfg["epochs"], batch_size=cfg["batch"], progress=False)
    trainer.sync()
    rows = comm.gather(np.concatenate(data.reads).tolist(), root=0)
    if comm.rank == 0:
        np.savez(cfg["out"], params=net.params)
        Path(cfg["out"] + ".rows.json").write_text(json.dumps(rows))


if __name__ == "__main__":
    mode, cfg = sys.argv[1], json.loads(sys.argv[2])
    modes = {"train": train, "collectives": collectives, "mismatch": mismatch, "read": read_after_step,
             "faults": faults, "fit_data": fit_data, "fail": lambda c: misbehave(c, "fail"),
             "stall": lambda c: misbehave(c, "stall")}
    modes[mode](cfg)
