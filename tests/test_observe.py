"""PCLDNN_VERBOSE and PCLDNN_TIMELINE (pcldnn_runtime.observe): the verbose line format and its
figures against an independent count, the timeline's Chrome-trace structure, and that watching
a run changes none of its results. The two-rank timeline is checked in test_distributed.py."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest
from helpers import REPO, TRAIN_LAYERS, TRAIN_SHAPE, build_and_load

import pcldnn_runtime as pr
from pcldnn_runtime import observe

LINE = re.compile(r"pcldnn_verbose,(\d+),exec,(\w+),(\w+),(scalar|avx2|avx512),mb(\d+)_([a-z0-9_]+),(\d+),"
                  r"(\d+\.\d{4}),(-|\d+\.\d),(-|\d+)")


@pytest.fixture(scope="module")
def build_dir(tmp_path_factory):
    return build_and_load(tmp_path_factory.mktemp("obs"), TRAIN_LAYERS, TRAIN_SHAPE, "scalar", name="obs").build_dir


@pytest.fixture
def fresh_observer(monkeypatch):
    """observe.observer() reads the environment once per process: cleared around each test."""
    observe.observer.cache_clear()
    yield monkeypatch
    observe.observer.cache_clear()


def _step(build_dir, seed=3):
    net = pr.load(build_dir, threads=1, seed=seed)
    trainer = pr.Trainer(net, pr.SGD(0.05, momentum=0.9))
    x, y = next(pr.synthetic(8, TRAIN_SHAPE, 5, seed=1).batches(8))
    trainer.step(x, y)
    return net


def test_verbose_lines_count_every_kernel_call_with_nominal_flops(build_dir, fresh_observer, capsys):
    fresh_observer.setenv("PCLDNN_VERBOSE", "1")
    net = _step(build_dir)
    err = capsys.readouterr().err.splitlines()
    peak_lines = [l for l in err if l.startswith("pcldnn_verbose,0,info,peak,")]
    assert len(peak_lines) == 1  # one thread count in this run: measured once
    peak = net.peak_gflops(1)  # the figure the lines were measured against (printed to 0.1)
    assert float(peak_lines[0].split(",")[5]) == pytest.approx(peak, abs=0.051)
    calls = [LINE.fullmatch(l) for l in err if ",exec," in l]
    assert calls and all(calls), [l for l in err if ",exec," in l and not LINE.fullmatch(l)][:2]
    seen = [(m[2], m[3]) for m in calls]
    for name, passes in (("conv1", ("fwd", "bwd_weights")), ("fc1", ("fwd", "bwd_data", "bwd_weights")),
                         ("pool1", ("fwd", "bwd_data")), ("loss", ("fwd", "bwd_data"))):
        for p in passes:
            assert seen.count((name, p)) == 1, (name, p)
    assert ("conv1", "bwd_data") not in seen  # the first layer's input gradient is never computed
    # GFLOP/s from the printed time and an independent FLOP count of the shape; % of the peak
    flops = {"conv1": 2 * 8 * 6 * 8 * 8 * 3 * 3 * 3, "fc1": 2 * 8 * 12 * 6 * 4 * 4, "fc2": 2 * 8 * 5 * 12}
    for m in calls:
        if m[2] in flops and m[3] in ("fwd", "bwd_data", "bwd_weights"):
            ms, gflops, share = float(m[8]), float(m[9]), int(m[10])
            # ms is printed to 1e-4, GFLOP/s to 0.1: the bounds of both roundings
            assert flops[m[2]] / ((ms + 5e-5) * 1e6) - 0.051 <= gflops <= flops[m[2]] / (max(ms - 5e-5, 1e-9) * 1e6) + 0.051
            assert abs(share - 100 * gflops / peak) <= 0.5 + 100 * 0.06 / peak
        else:
            assert (m[9], m[10]) == ("-", "-")
    assert any(m[2] == "conv1" and m[6] == "ic3oc6_ih8oh8kh3sh1ph1_iw8ow8kw3sw1pw1" for m in calls)
    assert any(m[2] == "fc1" and m[6] == "ic96oc12" for m in calls)


def test_watching_changes_no_result_and_costs_nothing_when_off(build_dir, fresh_observer, capsys):
    plain = _step(build_dir)
    assert not hasattr(plain.layers["conv1"]._k["fwd"], "__wrapped__")  # nothing wrapped when off
    observe.observer.cache_clear()
    fresh_observer.setenv("PCLDNN_VERBOSE", "1")
    watched = _step(build_dir)
    assert hasattr(watched.layers["conv1"]._k["fwd"], "__wrapped__")
    np.testing.assert_array_equal(watched.params, plain.params)
    assert capsys.readouterr().err.count(",exec,") > 10


@pytest.mark.parametrize("name, value, message", [
    ("PCLDNN_VERBOSE", "yes", "PCLDNN_VERBOSE must be 0 or 1"),
    ("PCLDNN_TIMELINE", "/nonexistent-dir/t.json", "must name a file in an existing directory"),
])
def test_bad_settings_are_refused_in_one_line(build_dir, fresh_observer, name, value, message):
    fresh_observer.setenv(name, value)
    with pytest.raises(pr.PcldnnError, match=message):
        pr.load(build_dir)


def test_a_build_without_a_peak_kernel_loads_and_prints_no_share(build_dir, tmp_path, fresh_observer, capsys):
    import shutil
    old = tmp_path / "old"
    shutil.copytree(build_dir, old)
    manifest = json.loads((old / "manifest.json").read_text())
    del manifest["peak"]
    (old / "manifest.json").write_text(json.dumps(manifest))
    fresh_observer.setenv("PCLDNN_VERBOSE", "1")
    net = _step(old)
    assert net.peak_gflops() is None
    err = capsys.readouterr().err
    assert "info,peak,1,- (a build without a peak kernel: recompile)" in err
    assert all(LINE.fullmatch(l)[10] == "-" for l in err.splitlines() if ",exec," in l)


SCRIPT = """
import sys, pcldnn_runtime as pr
net = pr.load(sys.argv[1], threads=1, seed=3)
trainer = pr.Trainer(net, pr.SGD(0.05, momentum=0.9))
for x, y in pr.synthetic(24, (3, 8, 8), 5, seed=1).batches(8):
    trainer.step(x, y)
"""


def test_timeline_of_a_single_process_run(build_dir, tmp_path):
    """Written at exit without any change to the script: steps on one track with the optimizer
    inside them, every kernel call on another, each kernel inside its step."""
    path = tmp_path / "run.json"
    env = dict(os.environ, PCLDNN_TIMELINE=str(path), PYTHONPATH=str(REPO))
    subprocess.run([sys.executable, "-c", SCRIPT, str(build_dir)], env=env, check=True, timeout=120)
    doc = json.loads(path.read_text())
    events = doc["traceEvents"]
    assert doc["otherData"]["ranks"] == 1 and not list(tmp_path.glob(".run.json.*"))  # no temporary left
    names = {(e["tid"], e["args"]["name"]) for e in events if e["name"] == "thread_name"}
    assert names == {(1, "kernels"), (2, "steps"), (3, "MPI waits")}
    steps = [e for e in events if e["ph"] == "X" and e["tid"] == 2 and e["name"].startswith("step ")]
    sgd = [e for e in events if e["ph"] == "X" and e["tid"] == 2 and e["name"] == "sgd"]
    kernels = [e for e in events if e["ph"] == "X" and e["tid"] == 1]
    assert [s["name"] for s in steps] == ["step 0", "step 1", "step 2"] and len(sgd) == 3
    assert all(e["ts"] >= 0 and e["dur"] >= 0 for e in steps + sgd + kernels)

    def inside(e, s):
        return s["ts"] <= e["ts"] and e["ts"] + e["dur"] <= s["ts"] + s["dur"] + 1e-3

    fwd = [k for k in kernels if k["name"] == "conv1 fwd"]
    assert len(fwd) == 3 and all(any(inside(k, s) for s in steps) for k in fwd)
    assert all(any(inside(u, s) for s in steps) for u in sgd)
    assert all(k["args"]["shape"].startswith("mb8_") for k in kernels)
    assert all("GFLOP/s" in k["args"] for k in kernels if k["name"] in ("fc1 fwd", "conv1 bwd_weights"))
