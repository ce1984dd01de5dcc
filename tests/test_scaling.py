"""The communication model (pcldnn_runtime.scaling) on hand-computed cases, its choices, its
simulation against its closed form, and `pcldnn-gen plan`."""
from __future__ import annotations

import json
import math
import random
from dataclasses import replace

import pytest
from helpers import MPIEXEC, NETS

from pcldnn_gen.cli import main
from pcldnn_gen.netspec import load_netspec
from pcldnn_runtime import PcldnnError, scaling
from pcldnn_runtime.scaling import LayerCost, LayerLoad, collective_time, iteration_time, layer_cost, simulate

# alpha 10 us, 1 GB/s link, sums at 2 GB/s, 1 GFLOP/s peak, efficiency 1/2, memory never the limit
TOY = scaling.Machine("toy", "test", 1.0, dict.fromkeys(scaling.KINDS, 0.5), 1e6, 10.0, 1.0, 2.0, "ring", True)


def test_collectives_by_hand():
    n = 8e6
    # ring reduce-scatter on 4 nodes: 3 alpha + 3/4 n (beta + gamma)
    assert collective_time("reduce_scatter", n, 4, TOY) == pytest.approx(3 * 10e-6 + 0.75 * n * (1e-9 + 0.5e-9))
    assert collective_time("allgather", n, 4, TOY) == pytest.approx(3 * 10e-6 + 0.75 * n * 1e-9)
    assert collective_time("allreduce", n, 4, TOY) == pytest.approx(6 * 10e-6 + 0.75 * n * (2e-9 + 0.5e-9))
    # recursive halving / doubling: log2(p) latency terms, the same bytes
    rhd = replace(TOY, algorithm="rhd")
    assert collective_time("reduce_scatter", n, 8, rhd) == pytest.approx(3 * 10e-6 + 7 / 8 * n * 1.5e-9)
    assert collective_time("alltoall", n, 4, rhd) == pytest.approx(3 * 10e-6 + 0.75 * n * 1e-9)
    assert collective_time("allgather", n, 1, TOY) == 0.0


def test_layer_cost_by_hand():
    # fc 1000 -> 100 on a 1x1 input: 2e5 FLOPs per image per pass, 400,400 bytes of weights
    fc = LayerLoad.from_shapes("fc", "fc", (1000, 1, 1), (100, 1, 1), (1, 1), first=False)
    assert (fc.flops, fc.weight_bytes, fc.in_bytes, fc.out_bytes) == (2e5, 400_400, 4000, 400)
    data = layer_cost(fc, 1, 2, 8, TOY)          # 4 images per node, all outputs
    assert data.fwd == pytest.approx(4 * 2e5 / 0.5e9)
    assert data.bwd == pytest.approx(2 * data.fwd)
    assert data.mp_fwd == data.mp_bwd == 0
    # ring on 2 nodes: one step each; reduce-scatter sends and sums half, all-gather sends half
    assert data.dp == pytest.approx(10e-6 + 0.5 * 400_400 * 1.5e-9 + 10e-6 + 0.5 * 400_400 * 1e-9)
    model = layer_cost(fc, 2, 2, 8, TOY)         # 8 rows per node, half the outputs: the same FLOPs
    assert model.fwd == pytest.approx(data.fwd) and model.dp == 0
    gather = 10e-6 + 0.5 * 8 * 4000 * 1e-9            # the input rows of the other node
    exchange = 10e-6 + 0.5 * (8 * 400 / 2) * 1e-9      # half of my output columns go to the other node
    assert model.mp_fwd == pytest.approx(gather + exchange)
    assert model.mp_bwd == pytest.approx(exchange + 10e-6 + 0.5 * 8 * 4000 * 1.5e-9)
    first = layer_cost(replace(fc, first=True), 2, 2, 8, TOY)   # no input gradient to reduce
    assert first.mp_bwd == pytest.approx(exchange) and first.bwd == pytest.approx(model.bwd / 2)
    with pytest.raises(PcldnnError, match="group size 3 does not divide 4 nodes"):
        layer_cost(fc, 3, 4, 8, TOY)


def test_depthwise_and_batchnorm_loads_by_hand():
    # depthwise 3x3 over 32 channels of 16x16: 1/32 of the dense layer's FLOPs and weights
    dense = LayerLoad.from_shapes("c", "conv", (32, 16, 16), (32, 16, 16), (3, 3), first=False)
    depthwise = LayerLoad.from_shapes("d", "conv", (32, 16, 16), (32, 16, 16), (3, 3), first=False, groups=32)
    assert depthwise.flops == dense.flops / 32 == 2 * 32 * 16 * 16 * 9
    assert depthwise.weight_bytes == 4 * (32 * 9 + 32) and depthwise.in_bytes == dense.in_bytes
    # batchnorm: memory bound at any FLOP rate; forward reads the input twice and writes once,
    # each backward pass moves three activations; its 2C scale and shift are communicated
    bn = LayerLoad.batchnorm("bn", (32, 16, 16))
    act = 4 * 32 * 16 * 16
    m = replace(TOY, memory_gbs=2.0)
    cost = layer_cost(bn, 1, 2, 8, m)                # 4 images per node
    assert cost.fwd == pytest.approx((2 * 4 * 32 + 4 * 3 * act) / 2e9)
    assert cost.bwd == pytest.approx(2 * cost.fwd)
    assert cost.dp == pytest.approx(2 * 10e-6 + 0.5 * 256 * 1.5e-9 + 0.5 * 256 * 1e-9)
    assert cost.sync == 0


def test_bf16_activations_exchange_and_sync_batchnorm_by_hand():
    """loads_of's training options: bf16 activations move half the bytes (a memory-bound
    batchnorm takes half the time, a conv's FLOPs stay); bf16 gradients halve the part-reduce
    and -broadcast's bytes; sync_batchnorm allgathers each node's 2C + 1 doubles in each pass,
    on the critical path (forward and backward), and nothing on one node."""
    from pcldnn_gen.netspec import parse_netspec
    spec = parse_netspec({"name": "t", "input": {"channels": 8, "height": 16, "width": 16}, "layers": [
        {"name": "c", "type": "conv", "out_channels": 32, "kernel": 3, "pad": 1},
        {"name": "bn", "type": "batchnorm", "activation": "relu"},
        {"name": "fc", "type": "fc", "out_features": 10}, {"name": "loss", "type": "softmax_cross_entropy"}]})
    m = replace(TOY, memory_gbs=2.0)
    fp32 = scaling.loads_of(spec.layers)
    bf16 = scaling.loads_of(spec.layers, "bf16", "bf16", sync_batchnorm=True)
    assert [(a.flops, a.weight_bytes) for a in fp32] == [(b.flops, b.weight_bytes) for b in bf16]
    assert [(b.in_bytes, b.out_bytes) for b in bf16] == [(a.in_bytes / 2, a.out_bytes / 2) for a in fp32]
    (conv16, bn16, _), (conv32, bn32, _) = bf16, fp32
    assert layer_cost(bn16, 1, 4, 16, m).fwd == pytest.approx((8 * 32 + 4 * 3 * 2 * 32 * 256) / 2e9)
    assert layer_cost(conv16, 1, 4, 16, m).fwd == layer_cost(conv32, 1, 4, 16, m).fwd  # FLOP-bound on TOY's peak
    sent = 0.5 * 4 * (32 * 8 * 9 + 32)
    assert layer_cost(conv16, 1, 4, 16, m).dp == pytest.approx(
        collective_time("reduce_scatter", sent, 4, m) + collective_time("allgather", sent, 4, m))
    synced = layer_cost(bn16, 1, 4, 16, m)
    assert bn16.sync_values == 65 and synced.sync == pytest.approx(3 * 10e-6 + 0.75 * 4 * 65 * 8 * 1e-9)
    assert layer_cost(bn16, 1, 1, 16, m).sync == 0 and layer_cost(bn32, 1, 4, 16, m).sync == 0
    costs = [layer_cost(load, 1, 4, 16, m) for load in bf16]
    unsynced = [replace(c, sync=0.0) for c in costs]
    for overlap in (True, False):
        assert iteration_time(costs, overlap) - iteration_time(unsynced, overlap) == pytest.approx(2 * synced.sync)
    # simulated: the same without overlap; with it, the backward allgather may wait for the link
    assert simulate(costs, 4, False)["time"] == pytest.approx(iteration_time(costs, False), rel=1e-12)
    assert simulate(costs, 4, True)["time"] >= iteration_time(costs, True) * (1 - 1e-12)


@pytest.mark.parametrize("net", ["resnet18", "mobilenet_v2"])
def test_plan_cli_on_graphs(net, capsys):
    """The modern example nets plan: every conv (depthwise ones too), batchnorm and fc layer
    gets a row, each batchnorm data parallel."""
    assert main(["plan", str(NETS / f"{net}.json"), "--machine", "aws-c4", "--nodes", "1,8", "--batch", "256"]) == 0
    text = capsys.readouterr().out
    spec = load_netspec(NETS / f"{net}.json")
    rows = {line.split()[0]: line.split()[1] for line in text.splitlines()[-sum(
        layer.type in ("conv", "fc", "batchnorm") for layer in spec.layers):]}
    assert set(rows) == {layer.name for layer in spec.layers if layer.type in ("conv", "fc", "batchnorm")}
    assert all(rows[layer.name] == "data" for layer in spec.layers if layer.type == "batchnorm")


def _cost(name, fwd, bwd, dp, group=1, mp=0.0):
    return LayerCost(name, group, fwd, bwd, mp, mp, dp)


def test_iteration_time_by_hand():
    costs = [_cost("l0", 1, 1, 0.5), _cost("l1", 1, 1, 0.5), _cost("l2", 1, 1, 3)]  # bottom to top
    # backward from the top: l2 done at 1, its 3 s of communication end at 4; l1's (released
    # at 2) waits for the link and ends at 4.5, l0's at 5 > the backward's end (3)
    assert iteration_time(costs, overlap=True) == pytest.approx(3 + 5)
    assert iteration_time(costs, overlap=False) == pytest.approx(3 + 3 + 4)
    small = [_cost("l0", 1, 1, 0.1), _cost("l1", 1, 1, 0.1), _cost("l2", 1, 1, 0.1)]
    assert iteration_time(small, overlap=True) == pytest.approx(3 + 3 + 0.1)  # only the last one shows


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("p", [1, 4, 16, 1024])
def test_simulation_equals_closed_form_when_data_parallel(p, overlap):
    rng = random.Random(p)
    costs = [_cost(f"l{i}", rng.uniform(0, 1), rng.uniform(0, 2), rng.uniform(0, 1.5)) for i in range(9)]
    assert simulate(costs, p, overlap)["time"] == pytest.approx(iteration_time(costs, overlap), rel=1e-12)


def test_simulation_adds_link_contention_and_stragglers():
    # a model-parallel exchange at layer 1 has to wait for layer 2's part-reduce on the link:
    # the closed form counts the exchange but not the wait
    costs = [_cost("l0", 1, 1, 0.5), _cost("l1", 1, 1, 0, group=2, mp=0.5), _cost("l2", 1, 1, 3)]
    closed = iteration_time(costs, True)
    sim = simulate(costs, 4, True)
    assert sim["time"] > closed
    # forward ends at 3.5 (l1's exchange 2-2.5); l2's backward ends at 4.5 and its part-reduce
    # holds the link until 7.5: only then can l1's backward exchange start. Closed form: 8.
    assert closed == pytest.approx(8.0) and sim["time"] == pytest.approx(10.5)
    assert ("model-parallel bwd l1", "comm", 7.5, 8.0) in sim["events"]
    data = [_cost("l0", 1, 1, 0.2), _cost("l1", 1, 1, 0.2)]
    base = simulate(data, 8, True)["time"]
    assert simulate(data, 8, True, jitter=[1.0] * 7 + [1.5])["time"] == pytest.approx(base + 0.5 * 4)


def test_choices_flip_where_the_algebra_says():
    vgg = scaling.loads_of(load_netspec(NETS / "vgg_a.json").layers)
    aws = scaling.PRESETS["aws-c4"]
    small = scaling.best_strategy(vgg, 16, 64, aws).modes()     # 4 images per node on 10 GbE
    assert small["fc6"] != "data"                       # 411 MB of weights against 4 x 25088 activations
    assert all(small[f"conv{i}"] == "data" for i in range(1, 9))
    # a conv layer split by outputs would move far more than its weights
    conv = next(l for l in vgg if l.name == "conv3")
    assert layer_cost(conv, 16, 16, 64, aws).mp_fwd > layer_cost(conv, 1, 16, 64, aws).dp
    # fc6 at a large per-node minibatch: its activations outweigh the weights -> data parallel
    fc6 = next(l for l in vgg if l.name == "fc6")
    big = scaling.best_strategy([fc6], 2, 2 * 16384, aws).modes()
    assert big["fc6"] == "data"
    assert scaling.best_strategy([fc6], 2, 16, aws).modes()["fc6"] == "model:2"


def test_plan_speedup_and_minimum_minibatch():
    vgg = scaling.loads_of(load_netspec(NETS / "vgg_a.json").layers)
    aws = scaling.PRESETS["aws-c4"]
    one, sixteen = scaling.best_strategy(vgg, 1, 256, aws), scaling.best_strategy(vgg, 16, 256, aws)
    assert one.speedup == 1 and sixteen.time < one.time and 1 < sixteen.speedup <= 16
    assert sixteen.images_per_s == pytest.approx(256 / sixteen.time)
    b = scaling.min_batch_per_node(vgg, 16, aws, 0.90)
    assert b is not None and b > 1
    enough, short = scaling.best_strategy(vgg, 16, b * 16, aws), scaling.best_strategy(vgg, 16, (b - 1) * 16, aws)
    assert enough.efficiency >= 0.90 > short.efficiency
    # Waiting for the slowest of 16 nodes caps the efficiency at 1 / straggler_factor (0.935 at
    # the presets' 3.9%): no per-node minibatch reaches 95%; without stragglers one does.
    assert 0.90 < 1 / scaling.straggler_factor(16, aws.step_cv) < 0.95
    assert scaling.min_batch_per_node(vgg, 16, aws, 0.95) is None
    assert scaling.min_batch_per_node(vgg, 16, replace(aws, step_cv=0.0), 0.95) is not None
    with pytest.raises(PcldnnError, match="global minibatch 8 is smaller than 16 nodes"):
        scaling.best_strategy(vgg, 16, 8, aws)


@pytest.mark.parametrize("patch, message", [
    ({"bandwidth_gbs": 0}, r"bandwidth_gbs: must be a number in \[1e-06, 100000\], got 0"),
    ({"latency_us": 1e300}, r"latency_us: must be a number in"),
    ({"peak_gflops": "fast"}, r"peak_gflops: must be a number in"),
    ({"efficiency": {"conv_fwd": 0.5}}, "efficiency.conv_bwd_data: missing required field"),
    ({"efficiency": [0.5]}, "efficiency: must be an object"),
    ({"name": "a\nb"}, "name: must match"),
    ({"overlap": "yes"}, "overlap: must be true or false"),
    ({"algorithm": "tree"}, "algorithm: must be one of ring, rhd"),
    ({"colour": 1}, "colour: unknown field"),
])
def test_bad_machine_files(tmp_path, patch, message):
    path = tmp_path / "m.json"
    path.write_text(json.dumps({**scaling.PRESETS["cori-haswell"].to_json(), **patch}))
    with pytest.raises(PcldnnError, match=message):
        scaling.get_machine(str(path))


def test_plan_cli(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main(["plan", str(NETS / "vgg_a.json"), "--machine", "cori-haswell", "--nodes", "1,2,4,128",
                 "--batch", "512", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "vgg_a on cori-haswell" in text and "fc6" in text
    plans = json.loads(out.read_text())["plans"]
    assert [p["nodes"] for p in plans] == [1, 2, 4, 128]
    assert plans[0]["speedup"] == 1 and plans[-1]["speedup"] > plans[-2]["speedup"]
    assert plans[-1]["simulated_time_s"] >= plans[-1]["time_s"] * (1 - 1e-12)


def test_plan_of_the_mlperf_cluster(capsys):
    """ResNet-50 on the MLPerf v3.0 Sapphire Rapids preset (bf16 peak: 56 cores x 2 GHz x 1024
    FLOP a cycle), with sync_batchnorm and bf16 gradients: 35 epochs' time is 35 epochs of
    images at the printed rate; sync_batchnorm slows every multi-node plan and not one node."""
    m = scaling.get_machine("mlperf-v3-spr")
    assert m.precision == "bf16" and m.peak_gflops == 56 * 2.0 * 1024 and m.cores == 56
    rows = {}
    for sync in (False, True):
        assert main(["plan", str(NETS / "resnet50.json"), "--machine", "mlperf-v3-spr", "--nodes", "1,32",
                     "--batch", "3264", "--epoch-images", "1281167", "--epochs", "35", "--gradient-exchange", "bf16",
                     *(["--sync-batchnorm"] if sync else [])]) == 0
        text = capsys.readouterr().out
        assert "bf16 peak 114688 GFLOP/s per node" in text and "35 epochs" in text
        table = [line.split() for line in text.splitlines() if line.strip().startswith(("1 ", "32 "))]
        rows[sync] = {int(r[0]): r for r in table}
        for r in table:
            days = int(r[8][:-1]) if r[8].endswith("d") else 0
            h, mi, s = (int(v) for v in r[9 if days else 8].split(":"))
            assert abs(86400 * days + 3600 * h + 60 * mi + s - 35 * 1281167 / float(r[4])) <= 1
    assert float(rows[True][32][4]) < float(rows[False][32][4]) and rows[True][1][4] == rows[False][1][4]


@pytest.mark.parametrize("args, message", [
    (["--machine", "cray-xc99", "--batch", "64"], "unknown machine 'cray-xc99'"),
    (["--machine", "aws-c4", "--batch", "64", "--nodes", "0,2"], "node counts must be positive"),
    (["--machine", "aws-c4", "--batch", "64", "--nodes", "two"], "use comma-separated node counts"),
    (["--machine", "aws-c4", "--batch", "8", "--nodes", "1,16"], "--batch 8 is smaller than 16 nodes"),
])
def test_plan_cli_bad_input(args, message, capsys):
    assert main(["plan", str(NETS / "vgg_a.json"), *args]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


@pytest.mark.slow
def test_plan_local_machine_is_measured(tmp_path, capsys):
    """`local`: the FMA peak of one thread, and alpha / beta from two ranks under mpiexec."""
    if not MPIEXEC:
        pytest.skip("no mpiexec")
    out = tmp_path / "local.json"
    assert main(["plan", str(NETS / "cifar_small.json"), "--machine", "local", "--arch", "scalar",
                 "--nodes", "1,2", "--batch", "16", "--json", str(out)]) == 0
    m = json.loads(out.read_text())["machine"]
    assert m["name"] == "local" and m["peak_gflops"] > 0.1
    assert 0 < m["latency_us"] < 1e4 and m["bandwidth_gbs"] > 0.01 and m["memory_gbs"] > 0.1


def _bench_rows(batch, rows):
    return [{"layer": l, "pass_name": p, "ms": ms, "gflops": g, "peak_fraction": g / 100, "batch": batch}
            for l, p, ms, g in rows]


def test_local_efficiency_curve_from_a_bench_file(tmp_path):
    """FLOP-weighted per kind and minibatch: total FLOPs over total time, against the file's
    peak; capped at 1 (noise above the peak)."""
    from pcldnn_gen.scaling_report import _bench_curve
    spec = load_netspec(NETS / "cifar_small.json")
    results = (_bench_rows(4, [("conv1", "fwd", 1.0, 50.0), ("conv2", "fwd", 3.0, 70.0), ("fc1", "bwd_data", 1.0, 130.0)])
               + _bench_rows(16, [("conv1", "fwd", 2.0, 80.0), ("conv2", "fwd", 2.0, 60.0)]))
    path = tmp_path / "b.json"
    path.write_text(json.dumps({"net": "cifar_small", "batch": [4, 16], "peak_gflops": 100.0, "results": results}))
    curve = _bench_curve(path, spec)
    # conv_fwd at 4: (50 x 1 + 70 x 3) MFLOP-ms over 4 ms = 65 GFLOP/s: 0.65 of the peak
    assert [b for b, _ in curve["conv_fwd"]] == [4, 16]
    assert [e for _, e in curve["conv_fwd"]] == pytest.approx([0.65, 0.70])
    assert curve["fc_bwd_data"] == ((4, 1.0),)
    path.write_text(json.dumps({"net": "vgg_a", "batch": 4, "peak_gflops": 100.0, "results": results}))
    with pytest.raises(PcldnnError, match="bench results of net 'vgg_a', not 'cifar_small'"):
        _bench_curve(path, spec)
    path.write_text(json.dumps({"net": "cifar_small", "batch": 4, "peak_gflops": 100.0,
                                "results": _bench_rows(4, [("conv9", "fwd", 1.0, 50.0)])}))
    with pytest.raises(PcldnnError, match="not a `pcldnn-gen bench --json` file of cifar_small"):
        _bench_curve(path, spec)


def test_efficiency_curve_and_thread_division_by_hand_on_a_two_layer_net():
    """A conv and an fc layer, one node of 4 threads at 3 images: efficiencies interpolated in
    log minibatch between the measured 2 and 4, times the static schedule's share of busy
    threads from each pass's loop."""
    conv = LayerLoad.from_shapes("conv", "conv", (8, 6, 6), (16, 6, 6), (3, 3), first=True)
    fc = LayerLoad.from_shapes("fc", "fc", (16, 6, 6), (10, 1, 1), (6, 6), first=False)
    loops = {"fwd": scaling.ParallelLoop(2, 1, 0), "bwd_weights": scaling.ParallelLoop(0, 1, 6),
             "bwd_data": scaling.ParallelLoop(0, 1, 8)}
    conv, fc = replace(conv, loops=loops), replace(fc, loops={"fwd": scaling.ParallelLoop(1, 2, 0)})
    curve = {"conv_fwd": ((2, 0.4), (4, 0.6)), "conv_bwd_weights": ((2, 0.5), (4, 0.5))}
    m = replace(TOY, cores=4, efficiency_curve=curve, memory_gbs=1e9)
    t = math.log(3 / 2) / math.log(2)              # 3 images: between 2 and 4 in log minibatch
    eff_fwd = 0.4 + t * 0.2
    assert m.efficiency_at("conv_fwd", 3) == pytest.approx(eff_fwd)
    assert m.efficiency_at("conv_fwd", 1) == 0.4 and m.efficiency_at("conv_fwd", 64) == 0.6  # clamped
    assert m.efficiency_at("fc_fwd", 3) == 0.5        # no curve: the machine's constant
    c = layer_cost(conv, 1, 1, 3, m)
    # forward: 2 x 3 = 6 items on 4 threads -> 2 rounds, 6 / 8 busy; bwd_weights: 6 fixed items, same
    assert c.fwd == pytest.approx(3 * conv.flops / (1e9 * eff_fwd * 6 / 8))
    assert c.bwd == pytest.approx(3 * conv.flops / (1e9 * 0.5 * 6 / 8))   # first layer: no bwd_data
    f = layer_cost(fc, 1, 1, 3, m)
    # fc forward: ceil(3 / 2) = 2 row tiles, 2 items on 4 threads: half busy; backward passes: no loop model
    assert f.fwd == pytest.approx(3 * fc.flops / (1e9 * 0.5 * 0.5))
    assert f.bwd == pytest.approx(2 * 3 * fc.flops / (1e9 * 0.5))
    assert iteration_time([c, f], overlap=True) == pytest.approx(c.fwd + f.fwd + c.bwd + f.bwd)
    assert scaling.division_efficiency(18, 32) == pytest.approx(18 / 32)
    assert scaling.division_efficiency(33, 32) == pytest.approx(33 / 64) and scaling.division_efficiency(5, 1) == 1


@pytest.mark.parametrize("p", [2, 7, 128, 1000])
def test_expected_maximum_of_p_normals_against_monte_carlo(p):
    import numpy as np
    draws = np.random.default_rng(p).standard_normal((20000, p)).max(axis=1)
    stderr = draws.std() / math.sqrt(len(draws))
    assert abs(scaling.expected_max_normal(p) - draws.mean()) < 4 * stderr
    assert scaling.expected_max_normal(1) == 0.0 and scaling.straggler_factor(1, 0.05) == 1.0
    assert scaling.expected_max_normal(2) == pytest.approx(1 / math.sqrt(math.pi), abs=1e-9)


def test_simulated_stragglers_match_the_closed_form():
    """One data-parallel layer, communication negligible: the simulation's mean over draws of
    per-node times equals the closed form's E[slowest of p] factor."""
    load = LayerLoad.from_shapes("conv", "conv", (8, 16, 16), (8, 16, 16), (3, 3), first=True)
    m = replace(TOY, bandwidth_gbs=1e6, reduce_gbs=1e6, latency_us=1e-6, step_cv=0.05)
    plan = scaling.best_strategy([load], 16, 64, m)
    closed = plan.time
    compute = layer_cost(load, 1, 16, 64, m)
    assert closed == pytest.approx((compute.fwd + compute.bwd) * scaling.straggler_factor(16, 0.05), rel=1e-6)
    simulated = scaling.simulate_stragglers(plan.costs, 16, m, draws=400)
    assert simulated == pytest.approx(closed, rel=0.01)   # 400 draws: MC error ~0.1% of the time
    assert scaling.simulate_stragglers(plan.costs, 16, replace(m, step_cv=0.0)) == pytest.approx(
        compute.fwd + compute.bwd, rel=1e-6)   # only the (negligible) part-reduce added


@pytest.mark.parametrize("edit, message", [
    ({"step_cv": 2}, "step_cv: must be"),
    ({"cores": 0}, "cores: must be"),
    ({"efficiency_curve": {"conv_fwd": [[4, 0.5], [2, 0.6]]}}, "minibatches must be distinct and ascending"),
    ({"efficiency_curve": {"conv_fwd": [[4, 1.5]]}}, r"efficiency_curve\.conv_fwd\[0\]\[1\]: must be"),
    ({"efficiency_curve": {"conv_sideways": []}}, "efficiency_curve"),
    ({"precision": "fp16"}, "precision: must be one of fp32, bf16"),
])
def test_machine_file_new_fields_are_checked(edit, message):
    data = scaling.PRESETS["aws-c4"].to_json() | edit
    with pytest.raises(PcldnnError, match=message):
        scaling.machine_from_dict(data, "m.json")
