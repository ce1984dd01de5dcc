"""Benchmark plumbing (not speed: timings are never asserted): peak kernel, per-pass table,
baselines, and the parsing of oneDNN's verbose output."""
from __future__ import annotations

import json
import sys

import numpy as np
import pytest
from helpers import RUNNABLE_ISAS

from pcldnn_gen import bench
from pcldnn_gen.arch import get_arch
from pcldnn_gen.baselines import MARK, check_isa, parse_verbose, verbose_isa
from pcldnn_gen.cli import main
from pcldnn_gen.netspec import parse_netspec

TINY = parse_netspec({"name": "tiny", "input": {"channels": 3, "height": 8, "width": 8}, "layers": [
    {"name": "c1", "type": "conv", "out_channels": 8, "kernel": 3, "pad": 1, "activation": "relu"},
    {"name": "f1", "type": "fc", "out_features": 5}]})


def test_peak_kernel_runs_and_reports_flops():
    gflops = bench.measure_peak(get_arch(RUNNABLE_ISAS[-1]), threads=1, repeats=1)
    assert np.isfinite(gflops) and gflops > 0


def test_bench_net_with_numpy_baseline(tmp_path):
    peak, results = bench.bench_net(TINY, get_arch(RUNNABLE_ISAS[-1]), batch=3, threads=1, repeats=1,
                                    compare=("numpy",), peak=100.0)
    assert peak == 100.0
    assert [(r.layer, r.pass_name) for r in results] == [(l, p) for l in ("c1", "f1") for p in bench.PASSES]
    for r in results:
        assert r.ms > 0 and r.gflops > 0 and r.peak_fraction == pytest.approx(r.gflops / 100.0)
        assert r.vs_numpy is not None and r.vs_numpy > 0 and r.vs_onednn is None
    table = bench.format_table(TINY.name, get_arch("avx2"), 3, 1, peak, results)
    assert "c1       bwd_weights" in table and "measured FMA peak 100.0" in table


MEMORY_NET = parse_netspec({"name": "mem", "input": {"channels": 20, "height": 9, "width": 7}, "layers": [
    {"name": "dw", "type": "conv", "out_channels": 20, "kernel": 3, "stride": 2, "pad": 1, "groups": 20},
    {"name": "bn", "type": "batchnorm", "activation": "relu"},
    {"name": "f1", "type": "fc", "out_features": 5}]})


def test_memory_bound_rows_count_their_bytes_against_the_copy_rate(tmp_path):
    """Depthwise and batchnorm rows: bytes a second of the compulsory traffic, by hand (20
    channels pad to whole vector blocks in the buffers), and that over the copy rate given;
    compute-bound rows have neither. The copy kernel measures a positive rate."""
    arch = get_arch(RUNNABLE_ISAS[-1])
    peak, results = bench.bench_net(MEMORY_NET, arch, batch=2, threads=1, repeats=1, peak=100.0, copy_rate=10.0)
    v = arch.vector_floats
    x, y = 4.0 * 2 * (-(-20 // v) * v) * 9 * 7, 4.0 * 2 * (-(-20 // v) * v) * 5 * 4
    w = 4.0 * (-(-20 // v) * v) * (9 + 1)  # (the kernel's weights and bias, padded)
    want = {("dw", "fwd"): x + y + w, ("dw", "bwd_data"): y + x + w, ("dw", "bwd_weights"): x + y + w,
            ("bn", "fwd"): 3 * y, ("bn", "bwd_weights"): 2 * y, ("bn", "bwd_data"): 3 * y}
    rows = {(r.layer, r.pass_name): r for r in results}
    assert set(rows) == set(want) | {("f1", p) for p in bench.PASSES}
    for key, nbytes in want.items():
        r = rows[key]
        assert r.gbs == pytest.approx(nbytes / (r.ms * 1e-3) / 1e9, rel=1e-6) and r.bound_fraction == pytest.approx(r.gbs / 10)
    assert all(rows[("f1", p)].gbs is None and rows[("f1", p)].bound_fraction is None for p in bench.PASSES)
    table = bench.format_table("mem", get_arch("avx2"), 2, 1, peak, results)
    assert "copy rate 10.0 GB/s" in table and "%copy" in table
    assert bench.measure_copy_rate(get_arch(RUNNABLE_ISAS[-1]), threads=1, repeats=1) > 0


@pytest.mark.parametrize("layer_name", ["c1", "f1"])
def test_kernel_timer_repeats_the_traced_call_in_c(tmp_path, layer_name):
    """Tracing a kernel call does not run it; the timer runs exactly that call (same buffers,
    same result as the runtime's own call) and calibrates its repeat count."""
    import pcldnn_runtime as pr
    from pcldnn_gen.build import build
    from pcldnn_runtime.kernels import empty_aligned
    arch = get_arch(RUNNABLE_ISAS[-1])
    build(TINY, arch, tmp_path / "b")
    layer = pr.load(tmp_path / "b", threads=1).layers[layer_name]
    rng = np.random.default_rng(1)
    xb = empty_aligned(layer.input_shape(2))
    xb[...] = rng.standard_normal(xb.shape)
    want, yb = (empty_aligned(layer.blocked_shape(layer.out_shape, 2)) for _ in range(2))
    layer.forward_blocked(xb, want)
    yb[...] = 0
    kernel, args = layer.traced_kernel_call("fwd", lambda: layer.forward_blocked(xb, yb))
    assert not yb.any()  # traced, not run
    timer = bench.KernelTimer(f"{layer.type}_fwd", kernel, args)
    assert timer() > 0 and 1 < timer.reps <= bench.MAX_REPEATS  # a us-long kernel is repeated
    np.testing.assert_array_equal(yb, want)


def test_rounds_pair_each_baseline_with_the_kernel_time_next_to_it(monkeypatch):
    """Ratios are the median of per-round ratios (pairs measured back to back), not the ratio
    of medians: here a slow first round for ours and a slow third round for numpy."""
    ours, theirs = iter([1.0, 4.0, 4.0]), iter([2.0, 2.0, 20.0])
    monkeypatch.setattr(bench, "median_kernel_seconds", lambda timer, repeats: next(ours))
    monkeypatch.setattr(bench, "run_baselines", lambda layers, *a: {f"{layers[0].name}/fwd": {"numpy": next(theirs)}})
    _, results = bench.bench_net(TINY, get_arch(RUNNABLE_ISAS[-1]), batch=2, threads=1, passes=("fwd",),
                                 layers=["c1"], compare=("numpy",), peak=100.0, rounds=3)
    (r,) = results
    assert r.ms == pytest.approx(4000.0)      # median of our three rounds
    assert r.vs_numpy == pytest.approx(2.0)   # median of 2/1, 2/4, 20/4 (the ratio of medians would be 0.5)


def test_parse_onednn_verbose_attributes_primitive_times_to_passes():
    conv = ("onednn_verbose,v1,primitive,exec,cpu,convolution,{impl},{prop},src:f32 wei:f32 dst:f32,"
            "attr-scratchpad:user,alg:convolution_direct,mb16_ic128oc256_ih56oh56kh3sh1dh0ph1_iw56ow56kw3sw1dw0pw1,{ms}")
    reorder = "onednn_verbose,v1,primitive,exec,cpu,reorder,jit:blk,undef,src:f32 dst:f32,,16x128x56x56,23.9"
    fwd = "brg_conv_fwd:avx2"
    text = "\n".join([
        "onednn_verbose,v1,info,cpu,isa:Intel AVX2 with Intel DL Boost",
        f"{MARK} conv3 fwd", reorder, conv.format(impl=fwd, prop="forward_inference", ms="10.0"),
        f"{MARK} conv3 fwd", reorder, conv.format(impl=fwd, prop="forward_inference", ms="12.0"),
        f"{MARK} conv3 fwd", conv.format(impl=fwd, prop="forward_inference", ms="30.0"), f"{MARK} end",
        # autograd's backward region runs a forward convolution too: not a forward timing
        f"{MARK} conv3 bwd", conv.format(impl=fwd, prop="forward_training", ms="500.0"), reorder,
        conv.format(impl="jit:avx2", prop="backward_data", ms="20.0"),
        conv.format(impl="brgconv_bwd_w:avx2", prop="backward_weights", ms="40.0"), f"{MARK} end",
        conv.format(impl=fwd, prop="forward_inference", ms="999"),  # outside any marker: ignored
    ])
    got = parse_verbose(text)
    assert {k: v.seconds for k, v in got.items()} == {
        "conv3/fwd": pytest.approx(0.012), "conv3/bwd_data": pytest.approx(0.020),
        "conv3/bwd_weights": pytest.approx(0.040)}
    assert {k: v.implementations for k, v in got.items()} == {
        "conv3/fwd": (fwd,), "conv3/bwd_data": ("jit:avx2",), "conv3/bwd_weights": ("brgconv_bwd_w:avx2",)}
    assert verbose_isa(text) == "Intel AVX2 with Intel DL Boost"


def test_parse_onednn_verbose_reads_inner_product_for_fc_rows():
    """fc rows time oneDNN's inner product; its weight reorders are not kernel time."""
    ip = ("onednn_verbose,v1,primitive,exec,cpu,inner_product,brg_matmul:avx512_core,{prop},src:f32:a:blocked:ab::f0 "
          "wei:f32:a:blocked:ab::f0 dst:f32:a:blocked:ab::f0,attr-scratchpad:user,,mb16ic9216oc4096,{ms}")
    reorder = "onednn_verbose,v1,primitive,exec,cpu,reorder,jit_direct_copy:uni,undef,src:f32 dst:f32,,4096x9216,48.2"
    text = "\n".join([
        f"{MARK} fc6 fwd", ip.format(prop="forward_training", ms="13.0"), f"{MARK} end",
        f"{MARK} fc6 bwd", ip.format(prop="backward_data", ms="15.0"), ip.format(prop="backward_weights", ms="51.0"),
        reorder, f"{MARK} end"])
    got = parse_verbose(text)
    assert {k: v.seconds for k, v in got.items()} == {
        "fc6/fwd": pytest.approx(0.013), "fc6/bwd_data": pytest.approx(0.015), "fc6/bwd_weights": pytest.approx(0.051)}
    assert got["fc6/bwd_weights"].implementations == ("brg_matmul:avx512_core",)


def test_an_onednn_implementation_wider_than_our_isa_is_refused():
    check_isa("avx2", ("brg_conv_fwd:avx2", "gemm:jit"))
    check_isa("avx512", ("brg_conv_fwd:avx512_core",))
    with pytest.raises(ValueError, match="brg_conv_fwd:avx512_core under --arch avx2"):
        check_isa("avx2", ("jit:avx2", "brg_conv_fwd:avx512_core"))
    with pytest.raises(ValueError, match="amx"):
        check_isa("avx512", ("brg_conv_fwd:avx512_core_amx",))


def test_cli_bench_json_and_errors(tmp_path, capsys):
    net = tmp_path / "tiny.json"
    net.write_text(json.dumps({"name": "tiny", "input": {"channels": 3, "height": 8, "width": 8}, "layers": [
        {"name": "c1", "type": "conv", "out_channels": 8, "kernel": 3, "pad": 1}]}))
    out = tmp_path / "r.json"
    assert main(["bench", str(net), "--arch", RUNNABLE_ISAS[-1], "--batch", "2", "--threads", "1",
                 "--repeats", "1", "--passes", "fwd", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["batch"] == 2 and [r["pass_name"] for r in data["results"]] == ["fwd"]
    assert (data["net"], data["precision"]) == ("tiny", "fp32")
    assert main(["bench", str(net), "--passes", "sideways"]) == 2
    assert "unknown pass sideways" in capsys.readouterr().err
    assert main(["bench", str(net), "--layers", "nope", "--arch", RUNNABLE_ISAS[-1]]) == 2
    assert "no conv/fc/batchnorm layer named nope" in capsys.readouterr().err


def test_cli_bench_efficiency_curve_feeds_plan_local(tmp_path, capsys):
    """`bench --batch 1,4,2` times each pass at each minibatch in one run (ascending); its JSON
    is the curve `plan --machine local --bench-json` reads."""
    from pcldnn_gen.netspec import load_netspec
    from pcldnn_gen.scaling_report import _bench_curve
    net = tmp_path / "tiny.json"
    net.write_text(json.dumps({"name": "tiny", "input": {"channels": 8, "height": 8, "width": 8}, "layers": [
        {"name": "c1", "type": "conv", "out_channels": 16, "kernel": 3, "pad": 1},
        {"name": "f1", "type": "fc", "out_features": 10}]}))
    out = tmp_path / "curve.json"
    assert main(["bench", str(net), "--arch", RUNNABLE_ISAS[-1], "--batch", "1,4,2", "--threads", "1",
                 "--repeats", "1", "--json", str(out)]) == 0
    table = capsys.readouterr().out
    assert "mb1     mb2     mb4" in table and table.count("\n") >= 7   # header lines + 6 layer-pass rows
    data = json.loads(out.read_text())
    assert data["batch"] == [1, 2, 4]
    assert sorted({(r["layer"], r["pass_name"], r["batch"]) for r in data["results"]}) == sorted(
        (l, p, b) for l in ("c1", "f1") for p in ("fwd", "bwd_data", "bwd_weights") for b in (1, 2, 4))
    curve = _bench_curve(out, load_netspec(net))
    assert set(curve) == {"conv_fwd", "conv_bwd_data", "conv_bwd_weights", "fc_fwd", "fc_bwd_data", "fc_bwd_weights"}
    assert all([b for b, _ in points] == [1, 2, 4] and all(0 < e <= 1 for _, e in points) for points in curve.values())
    assert main(["bench", str(net), "--batch", "1,2", "--compare", "numpy"]) == 2
    assert "several --batch values" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        main(["bench", str(net), "--batch", "0,2"])
    assert exit_.value.code == 2 and "--batch: must be an int in [1, 1048576], got '0'" in capsys.readouterr().err


def _summarize():
    import importlib.util

    from helpers import REPO
    spec = importlib.util.spec_from_file_location("summarize", REPO / "benchmarks" / "summarize.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["summarize"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_summarize_keys_rows_by_layer_and_refuses_a_second_timing(tmp_path):
    """A run of a few layers joins the full run's other layers; two files timing the same layer
    and pass are refused instead of one silently replacing the other."""
    summarize = _summarize()

    def run(name, threads, rows, isa="avx2"):
        path = tmp_path / name
        path.write_text(json.dumps({"net": "n", "arch": {"isa": isa}, "batch": 4, "threads": threads,
                                    "peak_gflops": 100.0, "results": [
            {"layer": layer, "pass_name": "fwd", "ms": ms, "gflops": 1.0, "peak_fraction": eff, "vs_onednn": x,
             "layer_type": "conv"} for layer, ms, eff, x in rows]}))
        return path

    full = run("full.json", 1, [("a", 4.0, 0.5, 3.0), ("b", 2.0, 0.9, 1.2), ("c", 2.0, 0.7, 0.8)])
    extra = run("extra.json", 1, [("d", 1.0, 0.95, 1.1)])
    two = run("two.json", 2, [("a", 2.0, 0.5, 3.0), ("b", 0.5, 0.9, 1.2)])
    groups = summarize.load([full, extra, two])
    one = next(g for g in groups if g.threads == 1)
    assert [k[0] for k in one.rows] == ["a", "b", "c", "d"]
    f = summarize.pass_figures(one, "fwd")
    # the first conv layer (a, by order) is apart; the others' median and worst
    assert f["first_layer"] == "a" and f["first_onednn"] == 3.0
    assert (f["conv_peak"].median, f["conv_peak"].worst, f["conv_peak"].worst_layer) == (0.9, 0.7, "c")
    assert summarize.thread_ratios(groups) == {("n", "avx2", 4): [2.0, 4.0]}
    assert "| fwd × oneDNN, conv after the first | median ≥ 1.0, none < 0.9 | median 1.10, worst 0.80 (c) | **no** |" \
        in summarize.markdown(groups)
    with pytest.raises(SystemExit, match=r"a fwd is also in .*full\.json"):
        summarize.load([full, run("again.json", 1, [("a", 3.0, 0.6, 2.0)])])
    # the same net on another ISA is a group of its own
    wide = summarize.load([full, run("wide.json", 1, [("a", 3.0, 0.6, 2.0)], isa="avx512")])
    assert sorted((g.isa, len(g.rows)) for g in wide) == [("avx2", 3), ("avx512", 1)]


def test_summarize_judges_bf16_runs_against_their_fp32_runs(tmp_path):
    """bf16 and fp32 runs of the same layers are groups of their own (a bench file's "precision",
    or the title older bf16 files carried); the bf16 figures pool the nets' conv rows: fp32 time
    over bf16 time matched by layer, x oneDNN of the bf16 rows, and each fc row x oneDNN."""
    summarize = _summarize()

    def run(name, net, precision, rows, title_only=False, zoo=False):
        path = tmp_path / name
        head = {"net": f"{net} (bf16 build: %peak against the fp32 FMA peak)"} if title_only else \
            {"net": net, "precision": precision, "zoo": zoo}
        path.write_text(json.dumps({**head, "arch": {"isa": "avx512"}, "batch": 16, "threads": 1, "peak_gflops": 100.0,
                                    "results": [{"layer": layer, "pass_name": "fwd", "ms": ms, "gflops": 1.0,
                                                 "peak_fraction": 0.5, "vs_onednn": x, "onednn_impl": impl,
                                                 "layer_type": layer[:-1]} for layer, ms, x, impl in rows]}))
        return path

    files = [run("a32.json", "a", "fp32", [("conv2", 4.0, 1.5, "jit"), ("conv3", 3.0, 1.1, "jit")]),
             run("a16.json", "a", "bf16", [("conv2", 2.0, 1.2, "jit_bf16"), ("conv3", 2.0, 0.8, "jit_bf16"),
                                           ("fc6", 1.0, 1.3, "brg_matmul")]),
             run("b32.json", "b", "fp32", [("conv2", 9.0, 1.0, "jit")]),
             run("b16.json", "b", "bf16", [("conv2", 5.0, 1.0, "jit_bf16"), ("fc7", 1.0, 0.9, "brg_matmul")],
                 title_only=True),
             # a zoo's first layers, far ahead of oneDNN: judged as a zoo, not pooled with the nets
             run("z16.json", "zoo z.json", "bf16", [(f"conv{i}", 1.0, 5.0, "brgconv") for i in range(5)], zoo=True)]
    groups = summarize.load(files)
    assert sorted((g.net, g.precision, len(g.rows)) for g in groups) == \
        [("a", "bf16", 3), ("a", "fp32", 2), ("b", "bf16", 2), ("b", "fp32", 1), ("zoo z.json", "bf16", 5)]
    f = summarize.bf16_figures(groups)[("avx512", 16, 1)]["fwd"]
    # fp32 / bf16 times: a conv2 2.0, a conv3 1.5, b conv2 1.8
    assert (f.speedup.median, f.speedup.worst, f.speedup.worst_layer) == (1.8, 1.5, "a conv3")
    assert (f.onednn.median, f.onednn.worst, f.onednn.worst_layer) == (1.0, 0.8, "a conv3")
    assert (f.fc_onednn.worst, f.fc_onednn.worst_layer) == (0.9, "b fc7") and f.impls == ("brg_matmul", "jit_bf16")
    text = summarize.markdown(groups)
    assert "| fwd fp32 time / bf16 time, conv | median ≥ 1.7 | median 1.80, worst 1.50 (a conv3) | yes |" in text
    assert "| fwd × oneDNN bf16 matmul, fc | each ≥ 1.0 | median 1.10, worst 0.90 (b fc7) | **no** |" in text
    assert text.count("| fwd % peak, conv after the first |") == 1  # the fp32 run's; bf16 runs are judged above


def test_the_shipped_zoo_covers_what_users_train():
    from helpers import REPO

    from pcldnn_gen.zoo import load_zoo
    shapes = load_zoo(REPO / "benchmarks" / "zoo" / "zoo.json")
    layers = [s.net.layers[0] for s in shapes]
    conv = [l for l in layers if l.type == "conv"]
    assert len(conv) >= 40 and len(layers) - len(conv) >= 10
    assert {s.family for s in shapes} >= {"AlexNet", "VGG", "GoogLeNet", "ResNet", "MobileNet", "CIFAR"}
    assert {1, 3, 5, 7, 11} <= {l.kernel[0] for l in conv} and {1, 2, 4} <= {l.stride[0] for l in conv}
    channels = {l.in_shape[0] for l in layers} | {l.out_shape[0] for l in layers}
    assert {3, 24, 40, 48, 96, 200, 500} <= channels
    assert max(l.in_shape[1] for l in conv) >= 224 and min(l.in_shape[1] for l in conv) <= 7
    # issue 50: every convolution of ResNet-50 and MobileNetV2 as the examples describe them,
    # depthwise ones of stride 1 and 2, and EfficientNet-B0's 5x5 depthwise convolutions
    from pcldnn_gen.netspec import load_netspec

    def key(l):
        return l.in_shape, l.out_shape[0], l.kernel, l.stride, l.pad, l.groups

    have = {key(l) for l in conv}
    for name in ("resnet50", "mobilenet_v2"):
        missing = [l.name for l in load_netspec(REPO / "examples" / "nets" / f"{name}.json").layers
                   if l.type == "conv" and key(l) not in have]
        assert not missing, (name, missing)
    depthwise = [l for l in conv if l.groups > 1]
    assert {1, 2} <= {l.stride[0] for l in depthwise} and {3, 5} <= {l.kernel[0] for l in depthwise}
    assert {"ResNet-50", "MobileNetV2", "EfficientNet-B0"} <= {s.family for s in shapes}


def test_a_bf16_zoo_times_a_convolution_as_inside_a_net(tmp_path):
    """ZooShape.inner: a convolution between two ReLU layers, so a bf16 build keeps its input and
    output, and their gradients, in bf16 as between convolutions (with AMX or vdpbf16ps); a
    first-layer shape (3 channels, packed) as a net's first layer, its output into a ReLU (bf16,
    its gradient fp32: the packed layer's backward kernels read it so); an fc layer as it is."""
    from pcldnn_gen.zoo import load_zoo
    from pcldnn_runtime.families import bf16_gradients, bf16_outputs
    zoo = tmp_path / "zoo.json"
    zoo.write_text(json.dumps({"name": "z", "shapes": [
        {"name": "relu_before", "family": "X", "input": [32, 6, 6], "layer": {"type": "conv", "out_channels": 16,
                                                                              "kernel": 1}},
        {"name": "rgb", "family": "X", "input": [3, 8, 8], "layer": {"type": "conv", "out_channels": 16, "kernel": 3}},
        {"name": "f", "family": "X", "input": [64, 1, 1], "layer": {"type": "fc", "out_features": 10}}]}))
    conv, rgb, fc = load_zoo(zoo)
    assert [l.type for l in conv.inner.layers] == ["relu", "conv", "relu"] and conv.inner.layers[1].name == "relu_before"
    for amx in (True, False):
        outputs, grads = bf16_outputs("bf16", amx, 16, conv.inner.layers), bf16_gradients("bf16", amx, 16, conv.inner.layers)
        assert outputs[:2] == grads[:2] == (True, True)  # the convolution's input and output
        assert not any(bf16_outputs("bf16", amx, 16, conv.net.layers))
    assert [l.type for l in rgb.inner.layers] == ["conv", "relu"] and fc.inner is fc.net
    for amx in (True, False):
        assert bf16_outputs("bf16", amx, 16, rgb.inner.layers)[0] and not bf16_gradients("bf16", amx, 16, rgb.inner.layers)[0]


@pytest.mark.parametrize("patch, fragment", [
    ({"shapes": []}, "shapes: must be a list of 1 to 10000 items"),
    ({"shapes": [{"name": "a", "family": "X", "input": [3, 8, 8], "layer": {"type": "pool"}}]},
     "shapes[0].layer.type: must be one of"),
    ({"shapes": [{"name": "a", "family": "X", "input": [3, 8, 8], "layer": {"type": "conv", "out_channels": 4,
                                                                              "kernel": 99}}]}, "shapes[0]"),
    ({"shapes": [{"name": "a", "family": "X", "input": [3, 8, 8], "layer": {"type": "fc", "out_features": 4}}] * 2},
     "shapes[1].name: a appears twice"),
])
def test_a_broken_zoo_is_refused_in_one_line(tmp_path, capsys, patch, fragment):
    path = tmp_path / "zoo.json"
    path.write_text(json.dumps({"name": "z", **patch}))
    assert main(["bench", "--zoo", str(path), "--arch", RUNNABLE_ISAS[-1]]) == 2
    err = capsys.readouterr().err
    assert fragment in err and str(path) in err and len(err.strip().splitlines()) == 1


def test_bench_zoo_times_every_shape_as_its_own_net(tmp_path):
    zoo = tmp_path / "zoo.json"
    zoo.write_text(json.dumps({"name": "z", "shapes": [
        {"name": "c24", "family": "CIFAR", "input": [3, 8, 8],
         "layer": {"type": "conv", "out_channels": 24, "kernel": 3, "pad": 1}},
        {"name": "f40", "family": "Toy", "input": [40, 1, 1], "layer": {"type": "fc", "out_features": 10}}]}))
    out = tmp_path / "r.json"
    assert main(["bench", "--zoo", str(zoo), "--arch", RUNNABLE_ISAS[-1], "--batch", "2", "--threads", "1",
                 "--repeats", "1", "--rounds", "1", "--passes", "fwd,bwd_data", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["zoo"] is True
    assert [(r["layer"], r["pass_name"], r["family"], r["layer_type"]) for r in data["results"]] == [
        ("c24", "fwd", "CIFAR", "conv"), ("c24", "bwd_data", "CIFAR", "conv"),
        ("f40", "fwd", "Toy", "fc"), ("f40", "bwd_data", "Toy", "fc")]
    assert all(0 < r["peak_fraction"] == pytest.approx(r["gflops"] / data["peak_gflops"]) for r in data["results"])


def test_bf16_targets_script_runs_the_issues_measurements():
    """benchmarks/bf16_targets.py (issue 18's runs in one command): every bench command parses
    with the CLI's own parser and together they time VGG-A conv2-8 and OverFeat-FAST conv2-5 in
    bf16 and fp32, VGG-A fc6-8 at minibatch 64 and 256 in both, the zoo's first layers in bf16,
    all against oneDNN on one thread; the training runs name nets that exist; summarize.py is
    given every bench file and no training file."""
    import io
    from contextlib import redirect_stdout
    from pathlib import Path

    from helpers import REPO

    from pcldnn_gen.cli import parser
    sys.path.insert(0, str(REPO / "benchmarks"))
    import bf16_targets
    runs = bf16_targets.steps(Path("/tmp/out"), "native")
    benches = [parser().parse_args(argv[3:]) for _, argv, _ in runs if argv[1:4] == ["-m", "pcldnn_gen", "bench"]]
    assert all(a.threads == 1 and a.compare == "onednn" and a.json and a.no_tuning for a in benches)
    got = {(Path(a.net or a.zoo).stem, a.precision, tuple(a.batch), a.layers) for a in benches}
    assert got == {("vgg_a", p, (16,), "conv2,conv3,conv4,conv5,conv6,conv7,conv8") for p in ("bf16", "fp32")} | \
        {("overfeat_fast", p, (16,), "conv2,conv3,conv4,conv5") for p in ("bf16", "fp32")} | \
        {("vgg_a", p, (b,), "fc6,fc7,fc8") for p in ("bf16", "fp32") for b in (64, 256)} | \
        {("zoo", "bf16", (16,), bf16_targets.FIRST_LAYERS)}
    trains = [argv for name, argv, _ in runs if name.startswith("train_")]
    assert len(trains) == 4 and all(Path(argv[argv.index("--net") + 1]).exists() for argv in trains)
    tunes = [parser().parse_args(argv[3:]) for _, argv, _ in runs if argv[1:4] == ["-m", "pcldnn_gen", "tune"]]
    assert [(Path(a.zoo).name, a.precision, a.threads, a.json is not None) for a in tunes] == [("zoo.json", "bf16", 1, True)]
    out = io.StringIO()
    with redirect_stdout(out), pytest.MonkeyPatch.context() as mp:
        mp.setattr(sys, "argv", ["bf16_targets.py", "--out", "/tmp/out", "--dry-run"])
        assert bf16_targets.main() == 0
    lines = out.getvalue().strip().splitlines()
    summary = lines[-1].split()
    assert summary[1].endswith("summarize.py") and sorted(summary[2:]) == sorted(a.json for a in benches)
    # the tuning run writes the output folder's database, never the user's
    assert [line.split()[0] for line in lines if " tune " in line] == ["PCLDNN_TUNING_DB=/tmp/out/tuning.json"]


@pytest.mark.needs_isa("avx2")
def test_tile_microbench_latency_chains_run_and_more_chains_go_faster():
    """`tile_microbench.py --latency` (how Arch.fma_latency and dot_latency are measured): the
    chains program compiles for the ISA, runs, and more independent chains issue faster than 2
    (each op waits for its own chain's previous one: 2 chains run at 2 / latency per cycle)."""
    from helpers import REPO

    from pcldnn_gen.arch import PRESETS
    sys.path.insert(0, str(REPO / "benchmarks"))
    import tile_microbench
    out = tile_microbench.run_program(tile_microbench.chains_program(3, "avx2", False, ops=4_000_000),
                                      PRESETS["avx2"].cflags)
    rates = {int(k): float(r) for k, r in (line.split() for line in out.splitlines())}
    assert sorted(rates) == tile_microbench.latency_chains("avx2") == [2, 4, 6, 8, 10, 12, 14]
    assert all(r > 0 for r in rates.values()) and rates[14] > 1.5 * rates[2]
