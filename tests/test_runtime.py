"""Runtime loading: refusing bad build directories, thread counts, profiling hook."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from helpers import build_and_load

import pcldnn_runtime as pr

LAYERS = [{"name": "c", "type": "conv", "out_channels": 8, "kernel": 3, "pad": 1, "activation": "relu"},
          {"name": "p", "type": "maxpool", "kernel": 2},
          {"name": "r", "type": "relu"},
          {"name": "f", "type": "fc", "out_features": 5},
          {"name": "loss", "type": "softmax_cross_entropy"}]


@pytest.fixture
def built(tmp_path):
    build_and_load(tmp_path, LAYERS, (3, 6, 6), "scalar", name="rt")
    return tmp_path / "rt-scalar"


def test_not_a_build_directory(tmp_path):
    with pytest.raises(pr.BuildDirError, match="not a build directory"):
        pr.load(tmp_path)


def test_wrong_format_is_refused(built):
    m = json.loads((built / "manifest.json").read_text())
    m["format"] = "pcldnn-build/0"
    (built / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(pr.BuildDirError, match="format is 'pcldnn-build/0'"):
        pr.load(built)


def test_manifest_paths_cannot_escape_the_build_directory(built, tmp_path):
    m = json.loads((built / "manifest.json").read_text())
    shutil.copy(built / "lib" / "c_fwd.so", tmp_path / "outside.so")
    m["layers"][0]["kernels"]["fwd"]["library"] = "../outside.so"
    (built / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(pr.BuildDirError, match="escapes the build directory"):
        pr.load(built)


@pytest.mark.parametrize("threads", [0, -1, 1.5, True])
def test_bad_thread_counts(built, threads):
    with pytest.raises(pr.PcldnnError, match="threads must be a positive int"):
        pr.load(built, threads=threads)


def test_thread_count_does_not_change_results(built):
    x = np.random.default_rng(0).standard_normal((5, 3, 6, 6)).astype(np.float32)
    one, two = pr.load(built, threads=1), pr.load(built, threads=2)
    np.testing.assert_array_equal(one.forward(x), two.forward(x))


def test_chain_with_standalone_relu_and_timings(built):
    net = pr.load(built)
    x = np.random.default_rng(1).standard_normal((3, 3, 6, 6)).astype(np.float32)
    timings: dict[str, float] = {}
    y = net.forward(x, timings=timings)
    assert y.shape == (3, 5) and set(timings) == {"c", "p", "r", "f"}
    h = net.layers["r"].forward(net.layers["p"].forward(net.layers["c"].forward(x)))
    assert (h >= 0).all()
    np.testing.assert_allclose(net.layers["f"].forward(h), y, rtol=1e-6, atol=1e-6)
    labels = np.array([0, 4, 2])
    loss = net.layers["loss"].forward(y, labels)
    assert loss == pytest.approx(net.loss(x, labels), rel=1e-6)
    with pytest.raises(pr.PcldnnError, match="backward needs a forward"):
        net.backward(labels)  # the last forward was in evaluation mode
    net.forward(x, training=True)
    timings.clear()
    assert net.backward(labels, timings=timings) == pytest.approx(loss, rel=1e-6)
    assert set(timings) == {"c", "p", "r", "f"}



def test_builds_differing_only_in_core_count_have_one_fingerprint(tmp_path):
    """Ranks compare build fingerprints before training: the core count of the shell that
    compiled (its affinity mask) changes no kernel, so it must not make them disagree."""
    import dataclasses

    from pcldnn_gen.arch import get_arch
    from pcldnn_gen.build import build
    from pcldnn_gen.netspec import parse_netspec
    spec = parse_netspec({"name": "fp", "input": {"channels": 3, "height": 6, "width": 6},
                          "layers": [{"name": "c", "type": "conv", "out_channels": 4, "kernel": 3}]})
    one, many = (dataclasses.replace(get_arch("scalar"), cores=n) for n in (1, 64))
    build(spec, one, tmp_path / "a")
    build(spec, many, tmp_path / "b")
    assert pr.load(tmp_path / "a").build_fingerprint() == pr.load(tmp_path / "b").build_fingerprint()
    other = parse_netspec({"name": "fp", "input": {"channels": 3, "height": 6, "width": 6},
                           "layers": [{"name": "c", "type": "conv", "out_channels": 5, "kernel": 3}]})
    build(other, one, tmp_path / "c")
    assert pr.load(tmp_path / "c").build_fingerprint() != pr.load(tmp_path / "a").build_fingerprint()


def test_unloading_every_net_keeps_the_openmp_runtime_under_its_threads(built):
    """A Net's kernel libraries are unloaded with it; the OpenMP runtime they pulled in must not
    be (its parked worker threads would crash: SIGSEGV at exit in about one run in four). Run
    in a fresh process, where no other Net holds the runtime."""
    import subprocess
    import sys
    code = ("import gc, sys, numpy as np, pcldnn_runtime as pr\n"
            f"net = pr.load({str(built)!r}, threads=2)\n"
            "net.forward(np.zeros((2, *net.chain[0].in_shape), np.float32))\n"
            "del net\n"
            "gc.collect()\n"
            "maps = open('/proc/self/maps').read()\n"
            "sys.exit(0 if 'libgomp' in maps or 'libomp' in maps else 3)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])


def test_canonical_calls_keep_their_own_state_across_reused_buffers(built):
    """The canonical API reuses its blocked buffers from call to call: a returned array is the
    caller's, and backward_weights on other data leaves the last forward's state intact."""
    net = pr.load(built, threads=1)
    conv = net.layers["c"]
    rng = np.random.default_rng(5)
    x1, x2 = (rng.standard_normal((2, 3, 6, 6)).astype(np.float32) for _ in range(2))
    y1 = conv.forward(x1)
    keep = y1.copy()
    dy = rng.standard_normal(y1.shape).astype(np.float32)
    dx_alone = conv.backward_data(dy)
    conv.forward(x2)
    np.testing.assert_array_equal(y1, keep)           # the second forward did not write into the first result
    np.testing.assert_array_equal(conv.forward(x1), keep)
    conv.backward_weights(x2, rng.standard_normal(y1.shape).astype(np.float32))
    np.testing.assert_array_equal(conv.backward_data(dy), dx_alone)  # still the mask of forward(x1)


def test_results_are_reused_only_when_the_caller_let_them_go(built):
    """A canonical result's array is reused for a later one only where nothing outside the layer
    holds it: a name, a view or a container keeps it the caller's; in the loop `y =
    layer.forward(x)` two arrays take turns."""
    net = pr.load(built, threads=1)
    conv = net.layers["c"]
    rng = np.random.default_rng(6)
    xs = [rng.standard_normal((2, 3, 6, 6)).astype(np.float32) for _ in range(4)]
    want = [conv.forward(x).copy() for x in xs]
    held = [conv.forward(xs[0]), conv.forward(xs[1])[:, :2]]  # an array, and a view of another
    kept = {"y": conv.forward(xs[2])}
    for _ in range(3):
        conv.forward(xs[3])  # results dropped at once: their arrays come back
    np.testing.assert_array_equal(held[0], want[0])
    np.testing.assert_array_equal(held[1], want[1][:, :2])
    np.testing.assert_array_equal(kept["y"], want[2])
    import weakref
    made = []
    for x, w in zip(xs, want, strict=True):  # the loop pattern: the previous result held while the next is made
        y = conv.forward(x)
        np.testing.assert_array_equal(y, w)
        made.append(weakref.ref(y))  # (a weak reference holds nothing)
    assert made[2]() is made[0]() is not None and made[3]() is made[1]() is not None  # two arrays take turns


def test_same_bytes_compares_bits():
    """The test backward_weights uses to reuse the last forward's mask: every bit counts (a NaN
    input equals itself, -0.0 differs from 0.0), and arrays of another dtype or shape differ."""
    from pcldnn_runtime.kernels import same_bytes
    a = np.random.default_rng(1).standard_normal((3, 5, 16)).astype(np.float32)
    a[0, 0, 0] = np.nan
    b = a.copy()
    assert same_bytes(a, b)
    b.view(np.uint32)[2, 4, 15] ^= 1
    assert not same_bytes(a, b)
    c, d = np.zeros(4, np.float32), np.array([0.0, 0.0, 0.0, -0.0], np.float32)
    assert not same_bytes(c, d) and not same_bytes(a, a.reshape(15, 16)) and not same_bytes(c, c.view(np.int32))


def test_backward_weights_takes_the_last_forwards_mask_only_for_its_input_and_weights(built):
    """backward_weights(x, dy) of a layer with a ReLU masks dy by forward(x): the last canonical
    forward's output where that forward had the same input and the same weights, else a forward
    of its own; the result is the same either way."""
    net = pr.load(built, threads=1)
    conv = net.layers["c"]
    rng = np.random.default_rng(8)
    x1, x2 = (rng.standard_normal((2, 3, 6, 6)).astype(np.float32) for _ in range(2))
    dy = rng.standard_normal((2, *conv.out_shape)).astype(np.float32)
    alone = [g.copy() for g in conv.backward_weights(x1, dy)]  # no forward before it
    conv.forward(x1)
    for got, want in zip(conv.backward_weights(x1, dy), alone, strict=True):
        np.testing.assert_array_equal(got, want)
    conv.forward(x2)
    for got, want in zip(conv.backward_weights(x1, dy), alone, strict=True):  # another input: its own forward
        np.testing.assert_array_equal(got, want)
    conv.forward(x1)
    conv.weights = conv.weights * -1.0  # the mask of the last forward is stale now
    fresh = pr.load(built, threads=1)
    fresh.load_state_dict(net.state_dict())
    for got, want in zip(conv.backward_weights(x1, dy), fresh.layers["c"].backward_weights(x1, dy), strict=True):
        np.testing.assert_array_equal(got, want)


def test_calls_with_little_work_run_on_one_thread(tmp_path):
    """Waking a thread team costs more than sharing out a tiny call saves (PARALLEL_MIN_*):
    such calls get one thread, larger ones the net's, decided per minibatch."""
    from pcldnn_runtime.layers import PARALLEL_MIN_BYTES, PARALLEL_MIN_FLOPS
    net = build_and_load(tmp_path, [{"name": "c", "type": "conv", "out_channels": 8, "kernel": 3, "pad": 1},
                                    {"name": "r", "type": "relu"}], (8, 8, 8), "scalar", threads=2)
    conv, relu = net.layers["c"], net.layers["r"]
    per_image_flops = 2 * 8 * 8 * 8 * 8 * 9
    assert per_image_flops < PARALLEL_MIN_FLOPS
    assert conv.team(1) == 1 and relu.team(1) == 1
    big = PARALLEL_MIN_FLOPS // per_image_flops + 1
    assert conv.team(big) == 2
    assert relu.team(big) == (2 if big * 2 * 4 * 8 * 8 * 8 >= PARALLEL_MIN_BYTES else 1)
    assert relu.team(PARALLEL_MIN_BYTES // (2 * 4 * 8 * 8 * 8) + 1) == 2
    x = np.random.default_rng(0).standard_normal((big, 8, 8, 8)).astype(np.float32)
    np.testing.assert_array_equal(conv.forward(x[:1]), conv.forward(x)[:1])  # same results either way


def test_openmp_runtimes_are_found_in_process_maps():
    """The one-pass scan of /proc/self/maps: whole paths (spaces allowed), one line each, the
    three runtimes' names only."""
    from pcldnn_runtime.kernels import _OPENMP_PATH
    maps = ("7f1-7f2 r-xp 00000000 fe:00 123   /usr/lib/x86_64-linux-gnu/libgomp.so.1.0.0\n"
            "7f3-7f4 rw-p 00000000 00:00 0 \n"
            "7f5-7f6 r-xp 00000000 fe:00 9  /opt/my libs/libiomp5.so\n"
            "7f7-7f8 r-xp 00000000 fe:00 9  /usr/lib/libgompish/other.so\n"
            "7f9-7fa r-xp 00000000 fe:00 9  /usr/lib/llvm/libomp.so.5\n")
    assert _OPENMP_PATH.findall(maps) == ["/usr/lib/x86_64-linux-gnu/libgomp.so.1.0.0", "/opt/my libs/libiomp5.so",
                                          "/usr/lib/llvm/libomp.so.5"]
