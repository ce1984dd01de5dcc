"""Scaling on this machine: 1 rank x 1 thread, 1 rank x 2 threads and 2 ranks x 1 thread at the
same global minibatch, with the communication the MPI runtime does and how much of it shows;
the spread of per-step compute times (the straggler model's coefficient of variation); and
the 2-rank speedup `plan --machine local` predicts against the measured one.

    python benchmarks/scaling.py [--nets cifar_small,vgg_a_small] [--batch 64] [--steps 12]
        [--repeats 3] [--parallel data|auto|model] [--json out.json]

--parallel: the trainer's choice per layer (data: every layer data parallel; model: every fc
layer model parallel over the ranks; auto: the runtime's rule).
Per configuration (median over steps after warm-up): step time, compute time (forward,
backward, SGD on the owned part), exposed communication (time blocked waiting for a
part-reduce or part-broadcast), and the effective bandwidth of part-reduce + part-broadcast
of the whole gradient buffer against a plain Allreduce of the same bytes (blocking calls,
same buffer). Each configuration runs under `mpiexec -n R` (the mpich wheel's).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
NETS = {"cifar_small": REPO / "examples" / "nets" / "cifar_small.json",
        "vgg_a_small": REPO / "benchmarks" / "nets" / "vgg_a_64.json"}


def worker(cfg: dict) -> None:
    from mpi4py import MPI

    import pcldnn_runtime as pr
    from pcldnn_runtime.partition import part_counts, shard_bounds
    comm = MPI.COMM_WORLD
    net = pr.load(cfg["build"], threads=cfg["threads"])
    trace: list = []
    parallel = {"fc*": "model"} if cfg["parallel"] == "model" else cfg["parallel"]
    trainer = pr.Trainer(net, pr.SGD(0.01, momentum=0.9, weight_decay=5e-4), comm=comm, trace=trace,
                         parallel=parallel)
    classes = net.loss_layer.out_shape[0]
    data = pr.synthetic(cfg["batch"] * 2, tuple(net.chain[0].in_shape), classes, seed=0)
    batches = list(data.batches(cfg["batch"]))
    steps = []
    for i in range(cfg["steps"] + 2):
        xb, yb = batches[i % len(batches)]
        lo, hi = shard_bounds(len(yb), comm.size, comm.rank)
        mark = len(trace)
        t0 = time.perf_counter()
        trainer.step(xb[lo:hi], yb[lo:hi])
        if i >= 2:
            events = trace[mark:]
            wait = sum(e["dur"] for e in events if e["cat"] == "wait") * 1e-6
            # model-parallel layers block inside the forward and backward events: not compute
            inside = sum(e["dur"] for e in events if e["name"].startswith("model-parallel")) * 1e-6
            compute = sum(e["dur"] for e in events if e["cat"] == "compute") * 1e-6 - inside
            steps.append((time.perf_counter() - t0, compute, wait))
    trainer.sync()
    # bandwidth: part-reduce + part-broadcast of the whole buffer against Allreduce
    buf = np.random.default_rng(comm.rank).standard_normal(net.params.size).astype(np.float32)
    counts = part_counts(buf.size, comm.size)
    displs = np.concatenate(([0], np.cumsum(counts)[:-1]))
    part = np.empty(int(counts[comm.rank]), np.float32)
    out = np.empty_like(buf)

    def split():
        comm.Reduce_scatter(buf, part, recvcounts=[int(c) for c in counts])
        out[displs[comm.rank]:displs[comm.rank] + counts[comm.rank]] = part
        comm.Allgatherv(MPI.IN_PLACE, [out, ([int(c) for c in counts], [int(d) for d in displs]), MPI.FLOAT])

    def allreduce():
        comm.Allreduce(buf, out)

    timings = {}
    for name, fn in (("part", split), ("allreduce", allreduce)):
        fn()
        ts = []
        for _ in range(5):
            comm.Barrier()
            t = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t)
        timings[name] = statistics.median(ts)
    computes = [c for _, c, _ in steps]  # this rank's compute per step: its spread is the straggler term's
    cv = statistics.pstdev(computes) / statistics.mean(computes)
    cvs = comm.gather(cv, root=0)
    if comm.rank == 0:
        med = lambda k: statistics.median(s[k] for s in steps)  # noqa: E731
        nbytes = buf.size * 4
        print(json.dumps({"ranks": comm.size, "threads": cfg["threads"], "params": int(buf.size), "step_cv": cvs,
                          "step_ms": med(0) * 1e3, "compute_ms": med(1) * 1e3, "exposed_comm_ms": med(2) * 1e3,
                          "images_per_s": cfg["batch"] / med(0),
                          "part_reduce_broadcast_GBps": nbytes / timings["part"] / 1e9,
                          "allreduce_GBps": nbytes / timings["allreduce"] / 1e9}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    ap.add_argument("--nets", default="cifar_small,vgg_a_small")
    ap.add_argument("--arch", default="avx2")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--repeats", type=int, default=3, help="runs of each configuration (the spread is reported)")
    ap.add_argument("--parallel", default="data", choices=("data", "auto", "model"))
    ap.add_argument("--json", default=None)
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(json.loads(args.worker))
        return
    from pcldnn_gen.arch import get_arch
    from pcldnn_gen.build import build
    from pcldnn_gen.netspec import load_netspec
    from pcldnn_runtime.launcher import mpiexec as find_mpiexec
    mpiexec = find_mpiexec()
    results = []
    predictions = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.nets.split(","):
            out = Path(tmp) / name
            spec = load_netspec(NETS[name])
            build(spec, get_arch(args.arch), out)
            # Interleaved: repeat r runs every configuration once, so a slow spell hits all of them.
            for repeat in range(args.repeats):
                for ranks, threads in ((1, 1), (1, 2), (2, 1)):
                    cfg = {"build": str(out), "threads": threads, "batch": args.batch, "steps": args.steps,
                           "parallel": args.parallel}
                    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
                    proc = subprocess.run([mpiexec, "-n", str(ranks), sys.executable, __file__, "--worker",
                                           json.dumps(cfg)], env=env, capture_output=True, text=True, timeout=1800)
                    if proc.returncode:
                        sys.exit(f"{name} {ranks}x{threads}: {proc.stderr}")
                    r = json.loads(proc.stdout.strip().splitlines()[-1]) | {"net": name, "parallel": args.parallel,
                                                                             "repeat": repeat}
                    results.append(r)
                    print(f"{name:12s} {ranks} rank(s) x {threads} thread(s): {r['images_per_s']:7.1f} images/s, "
                          f"step {r['step_ms']:7.1f} ms = compute {r['compute_ms']:7.1f} + exposed comm "
                          f"{r['exposed_comm_ms']:5.1f} (+ rest); step CV {', '.join(f'{c:.1%}' for c in r['step_cv'])}"
                          f"; part-reduce+broadcast {r['part_reduce_broadcast_GBps']:.2f} GB/s vs Allreduce "
                          f"{r['allreduce_GBps']:.2f} GB/s ({r['params'] * 4 / 1e6:.1f} MB)", flush=True)
            predictions.append(predict(spec, name, args, results))
    cvs = [c for r in results for c in r["step_cv"]]
    print(f"per-step compute time, coefficient of variation over {len(cvs)} rank runs: median "
          f"{statistics.median(cvs):.1%}, range {min(cvs):.1%}-{max(cvs):.1%}")
    if args.json:
        Path(args.json).write_text(json.dumps({"runs": results, "predictions": predictions,
                                               "step_cv_median": statistics.median(cvs)}, indent=1))


def predict(spec, name: str, args, results: list[dict]) -> dict:
    """The 2-rank speedup of `plan --machine local` (efficiencies measured now on this net at the
    per-node minibatches, the network probe) against the measured speedups of the repeats."""
    from pcldnn_gen.scaling_report import layer_loads, local_machine
    from pcldnn_runtime import scaling
    machine = local_machine(spec, args.arch, sorted({args.batch // 2, args.batch}))
    loads = layer_loads(spec, machine)
    plan = scaling.best_strategy(loads, 2, args.batch, machine)
    mine = [r for r in results if r["net"] == name]
    measured = [two["images_per_s"] / one["images_per_s"]
                for one, two in zip([r for r in mine if (r["ranks"], r["threads"]) == (1, 1)],
                                    [r for r in mine if (r["ranks"], r["threads"]) == (2, 1)])]
    out = {"net": name, "predicted_speedup": plan.speedup, "measured_speedups": measured,
           "measured_median": statistics.median(measured), "error": plan.speedup / statistics.median(measured) - 1,
           "predicted_1_rank_images_per_s": args.batch / plan.single,
           "measured_1_rank_images_per_s": [r["images_per_s"] for r in mine if (r["ranks"], r["threads"]) == (1, 1)]}
    print(f"{name}: 2-rank speedup predicted {plan.speedup:.2f}, measured {', '.join(f'{m:.2f}' for m in measured)} "
          f"(median {out['measured_median']:.2f}; prediction {out['error']:+.0%})", flush=True)
    return out


if __name__ == "__main__":
    main()
