"""Measures this machine's MPI latency and bandwidth and its summing and copying rates, for
`pcldnn-gen plan --machine local`. Run under mpiexec with 2 ranks:

    mpiexec -n 2 python -m pcldnn_gen.network_probe      # prints one JSON line on rank 0
"""
from __future__ import annotations

import json
import time
from typing import Any

import numpy as np


def probe(comm: Any) -> dict:
    """Alpha, beta (ping-pong between ranks 0 and 1), gamma (summing float32 arrays) and the
    memory bandwidth (copying them), medians of repeats."""

    def median_time(fn: Any, repeats: int) -> float:
        times = []
        for _ in range(repeats):
            comm.Barrier()
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        return sorted(times)[len(times) // 2]

    def pingpong(buf: np.ndarray) -> None:
        if comm.rank == 0:
            comm.Send(buf, dest=1)
            comm.Recv(buf, source=1)
        elif comm.rank == 1:
            comm.Recv(buf, source=0)
            comm.Send(buf, dest=0)

    small, big = np.zeros(2, np.float32), np.zeros(4 << 20, np.float32)  # 8 B, 16 MB
    latency = median_time(lambda: pingpong(small), 200) / 2
    bandwidth = big.nbytes / (median_time(lambda: pingpong(big), 10) / 2 - latency)
    a, b = np.ones(4 << 20, np.float32), np.ones(4 << 20, np.float32)
    reduce_rate = a.nbytes / median_time(lambda: np.add(a, b, out=a), 10)
    copy_rate = 2 * a.nbytes / median_time(lambda: np.copyto(b, a), 10)  # read + write
    out = {"latency_us": latency * 1e6, "bandwidth_gbs": bandwidth / 1e9, "reduce_gbs": reduce_rate / 1e9,
           "memory_gbs": copy_rate / 1e9}
    return comm.bcast(out, root=0) if comm.size > 1 else out


if __name__ == "__main__":
    from mpi4py import MPI

    result = probe(MPI.COMM_WORLD)
    if MPI.COMM_WORLD.rank == 0:
        print(json.dumps(result))
