"""Training: SGD against a plain numpy trainer, checkpoints, data, option errors."""
from __future__ import annotations

import io
import json
import math
import zipfile

import numpy as np
import pytest
import reference as ref
from helpers import RUNNABLE_ISAS, TRAIN_LAYERS, TRAIN_SHAPE, build_and_load

import pcldnn_runtime as pr

LAYERS, SHAPE = TRAIN_LAYERS, TRAIN_SHAPE


@pytest.fixture(scope="module")
def build_dir(tmp_path_factory):
    """One avx2-or-scalar build shared by the tests; each test loads its own Net from it."""
    tmp = tmp_path_factory.mktemp("train")
    net = build_and_load(tmp, LAYERS, SHAPE, RUNNABLE_ISAS[-1], name="tiny")
    return net.build_dir


def _net(build_dir, seed=0, threads=2):
    return pr.load(build_dir, threads=threads, seed=seed)


class NumpyTrainer:
    """The same net, loss and SGD written plainly in float64: forward, backward by the chain
    rule with the reference layer functions, and PyTorch's momentum / weight-decay update."""

    def __init__(self, net, opt: pr.SGD):
        self.w = {n: [net.layers[n].weights.astype(np.float64), net.layers[n].bias.astype(np.float64)]
                  for n in ("conv1", "fc1", "fc2")}
        self.v = {n: [np.zeros_like(a) for a in p] for n, p in self.w.items()}
        self.opt = opt
        self.step_count = 0

    def step(self, x, y):
        (w1, b1), (w2, b2), (w3, b3) = self.w["conv1"], self.w["fc1"], self.w["fc2"]
        h1 = ref.conv2d(x, w1, b1, (1, 1), (1, 1), relu=True)
        p1 = ref.maxpool(h1, (2, 2), (2, 2), (0, 0))
        h2 = ref.fc(p1, w2, b2, relu=True)
        z = ref.fc(h2, w3, b3)
        loss, dz = ref.softmax_cross_entropy(z, y)
        g3 = ref.fc_bwd_weights(h2, dz)
        dh2 = ref.fc_bwd_data(dz, w3, h2.shape) * (h2 > 0)
        g2 = ref.fc_bwd_weights(p1, dh2)
        dp1 = ref.fc_bwd_data(dh2, w2, p1.shape)
        dh1 = ref.maxpool_bwd(h1, dp1, (2, 2), (2, 2), (0, 0)) * (h1 > 0)
        g1 = ref.conv2d_bwd_weights(x, dh1, (3, 3), (1, 1), (1, 1))
        lr = self.opt.lr_at(self.step_count)
        for name, grads in (("conv1", g1), ("fc1", g2), ("fc2", g3)):
            for i, g in enumerate(grads):
                d = g + self.opt.weight_decay * self.w[name][i]
                self.v[name][i] = self.opt.momentum * self.v[name][i] + d
                self.w[name][i] = self.w[name][i] - lr * self.v[name][i]
        self.step_count += 1
        return loss


def test_sgd_steps_match_a_numpy_trainer(build_dir):
    net = _net(build_dir)
    data = pr.synthetic(8 * 20, SHAPE, 5, seed=1)
    make_opt = lambda: pr.SGD(0.05, momentum=0.9, weight_decay=1e-3, schedule="cosine",  # noqa: E731
                              total_steps=20, warmup_steps=3)
    ours, theirs = pr.Trainer(net, make_opt()), NumpyTrainer(net, make_opt())
    initial = {n: net.layers[n].weights.copy() for n in theirs.w}
    for i, (xb, yb) in enumerate(data.batches(8)):
        loss = ours.step(xb, yb)
        want = theirs.step(xb, yb)
        # float32 kernels against float64: the loss agrees to float32 accuracy, amplified by
        # the steps the weights have taken.
        assert loss == pytest.approx(want, rel=1e-4, abs=1e-5), i
    assert ours.step_count == 20
    for name, (w_ref, b_ref) in theirs.w.items():
        layer = net.layers[name]
        # After 20 steps, the difference is float32 rounding (~1e-7 relative per operation)
        # accumulated through 20 momentum updates; 1e-3 of the distance the weights travelled
        # is far above that and far below any wrong update (wrong sign, missing decay, a
        # skipped momentum term each move the weights by a sizeable fraction of it).
        moved = np.abs(w_ref - initial[name]).max()
        assert moved > 1e-3
        np.testing.assert_allclose(layer.weights, w_ref, rtol=0, atol=1e-3 * moved)
        np.testing.assert_allclose(layer.bias, b_ref, rtol=0, atol=1e-3 * np.abs(b_ref).max() + 1e-6)


@pytest.mark.parametrize("kwargs", [{"momentum": 0.9, "weight_decay": 1e-3, "decay_bias": False},
                                    {"momentum": 0.9, "weight_decay": 5e-4}, {"momentum": 0.0, "weight_decay": 0.0},
                                    {"momentum": 0.5, "weight_decay": 0.0}])
def test_the_builds_sgd_kernel_gives_numpys_bits(build_dir, kwargs):
    """The build's one-pass update (templates/sgd.c.j2) against the optimizer's numpy form, on
    the whole buffer and on a slice (an MPI rank's part), three steps: the same bits."""
    rng = np.random.default_rng(3)
    nets = [_net(build_dir), _net(build_dir)]
    opts = [pr.SGD(0.05, **kwargs), pr.SGD(0.05, **kwargs)]
    for net, opt in zip(nets, opts):
        opt.bind(net)
    assert opts[0]._kernel is not None
    opts[1]._kernel = None  # the numpy form
    start = rng.standard_normal(nets[0].params.size).astype(np.float32)
    part = slice(16, nets[0].params.size - 16)
    for step in range(3):
        grads = rng.standard_normal(start.size).astype(np.float32)
        for net, opt in zip(nets, opts):
            if step == 0:
                net.params[...] = start
            net.grads[...] = grads
            opt.apply(net.params, net.grads, step, part if step == 2 else slice(None))
    np.testing.assert_array_equal(nets[0].params, nets[1].params)
    np.testing.assert_array_equal(opts[0].velocity, opts[1].velocity)
    assert not np.array_equal(nets[0].params, start)


def test_schedules_and_bias_decay(build_dir):
    opt = pr.SGD(1.0, schedule="step", step_size=10, gamma=0.5, warmup_steps=4)
    assert [opt.lr_at(s) for s in (0, 3, 9, 10, 25)] == [0.25, 1.0, 1.0, 0.5, 0.25]
    cos = pr.SGD(1.0, schedule="cosine", total_steps=100, min_lr=0.1)
    assert cos.lr_at(0) == 1.0 and cos.lr_at(50) == pytest.approx(0.55) and cos.lr_at(100) == pytest.approx(0.1)
    assert cos.lr_at(500) == pytest.approx(0.1)
    # With zero gradients, decay alone moves the parameters: every weight shrinks by 1 - lr*wd;
    # biases (made nonzero first) shrink too by default and stay put with decay_bias=False.
    for decay_bias, bias_factor in ((True, 0.95), (False, 1.0)):
        net = _net(build_dir)
        for layer in ("conv1", "fc1", "fc2"):
            net.layers[layer].bias = np.ones(net.layers[layer].out_shape[0], np.float32)
        weights, biases = net.layers["fc1"].weights, net.layers["fc1"].bias
        net.grads[...] = 0
        opt = pr.SGD(0.1, weight_decay=0.5, decay_bias=decay_bias)
        opt.bind(net)
        opt.apply(net.params, net.grads, 0)
        np.testing.assert_allclose(net.layers["fc1"].weights, weights * 0.95, rtol=1e-6)
        np.testing.assert_allclose(net.layers["fc1"].bias, biases * bias_factor, rtol=1e-6)


@pytest.mark.parametrize("kwargs, message", [
    ({"lr": -0.1}, "lr must be a positive number"),
    ({"lr": 0.1, "momentum": 1.0}, r"momentum must be in \[0, 1\)"),
    ({"lr": 0.1, "schedule": "exponential"}, "unknown schedule 'exponential'"),
    ({"lr": 0.1, "schedule": "cosine"}, "cosine' needs total_steps"),
    ({"lr": 0.1, "weight_decay": float("nan")}, "weight_decay must be >= 0"),
])
def test_bad_optimizer_options_are_clear_errors(kwargs, message):
    with pytest.raises(pr.PcldnnError, match=message):
        pr.SGD(**kwargs)


def test_fit_shows_a_bar_on_a_terminal_or_when_asked(build_dir, capsys):
    """progress=None (the default, and `train`'s): a bar only where stderr is a terminal, so a
    log or a pipe (mpiexec's) gets the epoch lines alone; True: always; False: never."""
    trainer = pr.Trainer(_net(build_dir, seed=3), pr.SGD(0.02), seed=0)
    train = pr.synthetic(64, SHAPE, 5, seed=7)
    for progress, shown in ((None, False), (True, True), (False, False)):
        trainer.fit(train, epochs=trainer.step_count // 2 + 1, batch_size=32, progress=progress)
        err = capsys.readouterr().err
        assert ("epoch " in err and "step" in err) == shown, (progress, err)


def test_fit_learns_and_writes_metrics(build_dir, tmp_path):
    net = _net(build_dir, seed=3)
    train = pr.synthetic(320, SHAPE, 5, seed=7, noise=1.0)
    val = pr.synthetic(100, SHAPE, 5, seed=7, noise=1.0, split=1)  # same class patterns, other samples
    trainer = pr.Trainer(net, pr.SGD(0.02, momentum=0.9), seed=0)
    before = trainer.evaluate(val)
    history = trainer.fit(train, val, epochs=3, batch_size=32, metrics_file=tmp_path / "m.jsonl", progress=False)
    after = trainer.evaluate(val)
    assert after["loss"] < 0.5 * before["loss"] and after["accuracy"] > 0.9
    assert [h["epoch"] for h in history] == [1, 2, 3] and history[-1]["val_accuracy"] == after["accuracy"]
    lines = [json.loads(l) for l in (tmp_path / "m.jsonl").read_text().splitlines()]
    steps = [l for l in lines if "loss" in l and "train_loss" not in l]
    assert [l["step"] for l in steps] == list(range(1, 31))
    assert all(math.isfinite(l["loss"]) and l["images_per_s"] > 0 for l in steps)
    with pytest.raises(pr.PcldnnError, match="batch size 400 is larger than the 320 training samples"):
        trainer.fit(train, epochs=4, batch_size=400, progress=False)


def test_resume_is_bit_identical(tmp_path):
    """With dropout in the net: the masks after resuming continue the interrupted sequence."""
    with_dropout = LAYERS[:3] + [{"name": "drop", "type": "dropout", "rate": 0.3}] + LAYERS[3:]
    build_dir = build_and_load(tmp_path, with_dropout, SHAPE, "scalar", name="drop").build_dir
    train = pr.synthetic(96, SHAPE, 5, seed=11)
    opt = lambda: pr.SGD(0.05, momentum=0.9, weight_decay=1e-4, schedule="cosine", total_steps=12)  # noqa: E731
    straight = pr.Trainer(_net(build_dir, seed=5), opt(), seed=2)
    straight.fit(train, epochs=4, batch_size=32, progress=False)  # 3 steps per epoch, 12 in all

    first = pr.Trainer(_net(build_dir, seed=5), opt(), seed=2)
    first.fit(train, epochs=2, batch_size=32, progress=False)
    ckpt = first.save(tmp_path / "ck" / "trainer.npz")
    # Resume into a fresh net whose own initial weights differ (other seed): all state comes from the file.
    resumed = pr.Trainer.resume(ckpt, _net(build_dir, seed=99))
    assert resumed.step_count == 6 and resumed.optimizer.config() == first.optimizer.config()
    resumed.fit(train, epochs=4, batch_size=32, progress=False)
    assert resumed.step_count == 12
    np.testing.assert_array_equal(resumed.net.params, straight.net.params)
    np.testing.assert_array_equal(resumed.optimizer.velocity, straight.optimizer.velocity)


@pytest.mark.needs_isa("avx2")  # two ISAs: scalar and a vector one
def test_checkpoints_move_between_isas(tmp_path):
    """Canonical layouts: a checkpoint saved by one ISA's build resumes bit for bit (weights and
    momentum) on another's, records where it came from, and training continues alike."""
    a, b = RUNNABLE_ISAS[0], RUNNABLE_ISAS[-1]
    builds = {isa: build_and_load(tmp_path, LAYERS, SHAPE, isa, name="moving").build_dir for isa in (a, b)}
    train = pr.synthetic(64, SHAPE, 5, seed=3)
    first = pr.Trainer(_net(builds[a], seed=1), pr.SGD(0.05, momentum=0.9), seed=4)
    first.fit(train, epochs=1, batch_size=16, progress=False)
    ckpt = first.save(tmp_path / "a.npz")
    with zipfile.ZipFile(ckpt) as z:
        meta = json.loads(bytes(np.load(io.BytesIO(z.read("meta.npy")))).decode())
    assert (meta["isa"], meta["vector_floats"], meta["precision"]) == (a, first.net.vector_floats, "fp32")
    moved = pr.Trainer.resume(ckpt, _net(builds[b], seed=2))
    for k, v in first.net.state_dict().items():
        np.testing.assert_array_equal(moved.net.state_dict()[k], v)
    np.testing.assert_array_equal(moved.net.to_canonical(moved.optimizer.bound_velocity()),
                                  first.net.to_canonical(first.optimizer.bound_velocity()))
    first.fit(train, epochs=1, batch_size=16, progress=False)
    moved.fit(train, epochs=1, batch_size=16, progress=False)
    for k, v in first.net.state_dict().items():
        np.testing.assert_allclose(moved.net.state_dict()[k], v, rtol=1e-4, atol=1e-5)


def test_interrupted_save_keeps_the_previous_checkpoint(build_dir, tmp_path, monkeypatch):
    import pcldnn_runtime.trainer as tr
    trainer = pr.Trainer(_net(build_dir), pr.SGD(0.1))
    path = trainer.save(tmp_path / "c.npz")
    good = path.read_bytes()
    trainer.step(*next(pr.synthetic(8, SHAPE, 5).batches(8)))

    def fail_midway(f, meta, params, velocity, statistics):
        f.write(b"PK\x03\x04 half a zip")
        raise OSError("disk full")
    monkeypatch.setattr(tr, "_write_checkpoint", fail_midway)
    with pytest.raises(pr.CheckpointError, match=r"c\.npz: cannot write the checkpoint: disk full"):
        trainer.save(path)
    assert path.read_bytes() == good
    assert [p.name for p in tmp_path.iterdir()] == ["c.npz"]  # no temporary file left behind
    assert pr.Trainer.resume(path, _net(build_dir)).step_count == 0


def test_resume_refuses_other_nets_and_corrupt_files(build_dir, tmp_path):
    path = pr.Trainer(_net(build_dir), pr.SGD(0.1)).save(tmp_path / "c.npz")
    other = build_and_load(tmp_path, LAYERS[:1] + LAYERS[2:], SHAPE, "scalar", name="other")
    with pytest.raises(pr.PcldnnError, match=r"checkpoint of net 'tiny'.*this net is 'other'"):
        pr.Trainer.resume(path, other)
    bad = tmp_path / "bad.npz"
    bad.write_bytes(path.read_bytes()[: 200])
    with pytest.raises(pr.PcldnnError, match=r"bad\.npz: not a readable pcldnn checkpoint"):
        pr.Trainer.resume(bad, _net(build_dir))
    with pytest.raises(pr.PcldnnError, match="no such checkpoint"):
        pr.Trainer.resume(tmp_path / "missing.npz", _net(build_dir))


def test_digits_data_and_loader_errors():
    train, test = pr.digits()
    assert train.x.shape == (1438, 1, 16, 16) and test.x.shape == (359, 1, 16, 16)
    assert set(np.unique(train.y)) == set(range(10))
    mean, std = train.channel_stats()
    assert abs(mean[0]) < 1e-5 and std[0] == pytest.approx(1.0, rel=1e-4)
    again, _ = pr.digits()
    np.testing.assert_array_equal(again.x, train.x)  # the split is fixed
    # upsampling repeats each pixel 2x2
    np.testing.assert_array_equal(train.x[:, :, ::2, ::2], train.x[:, :, 1::2, 1::2])
    with pytest.raises(pr.PcldnnError, match="labels must be"):
        pr.ArrayDataset(np.zeros((4, 1, 2, 2)), np.zeros(3, int))
    with pytest.raises(pr.PcldnnError, match="batch size 5 is larger than the 4 samples"):
        next(pr.ArrayDataset(np.zeros((4, 1, 2, 2)), np.zeros(4, int)).batches(5))


def test_train_script_runs_and_rejects_bad_options(tmp_path, monkeypatch, capsys):
    import importlib.util

    from helpers import REPO, RUNNABLE_ISAS
    spec = importlib.util.spec_from_file_location("train_script", REPO / "examples" / "train.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    monkeypatch.chdir(tmp_path)  # the build goes to ./build/
    # the metrics and the plot go into folders that do not exist yet (as `make demo` on a fresh clone)
    args = ["--arch", RUNNABLE_ISAS[-1], "--data", "synthetic", "--epochs", "2", "--batch-size", "64",
            "--no-progress", "--checkpoint-dir", "ck", "--metrics", "out/m.jsonl", "--threads", "1"]
    assert script.main(args + ["--plot", "plots/curve.png"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("digits: test accuracy") and "images/s" in last and "after 64 steps" in last
    assert (tmp_path / "ck" / "checkpoint.npz").exists() and (tmp_path / "out" / "m.jsonl").stat().st_size > 0
    assert (tmp_path / "plots" / "curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # resuming at the end of epoch 2 and asking for 3 epochs runs exactly one more epoch
    assert script.main(args[:5] + ["3"] + args[6:] + ["--resume", "ck/checkpoint.npz"]) == 0
    assert "after 96 steps" in capsys.readouterr().out
    assert script.main(args + ["--lr", "-1"]) == 2
    assert "train.py: error: command line: --lr: must be a number in (0, 1e+06], got -1.0" in capsys.readouterr().err


@pytest.mark.slow
def test_the_papers_speech_dnn_compiles_and_trains(tmp_path):
    """examples/nets/dnn7.json (429 inputs, 7 hidden fc layers of 2,048, 9,304 outputs: 45.1 M
    weights; He-normal init, the deep ReLU net's): compiled for the widest ISA here, a few SGD
    steps on one minibatch of synthetic frames lower its loss on that minibatch, which starts
    near ln(9304)."""
    from helpers import NETS

    from pcldnn_gen.arch import get_arch
    from pcldnn_gen.build import build
    from pcldnn_gen.netspec import load_netspec
    spec = load_netspec(NETS / "dnn7.json")
    assert sum(int(np.prod(l.weight_shape)) for l in spec.layers if l.weighted) == (
        429 * 2048 + 6 * 2048 * 2048 + 2048 * 9304)
    build(spec, get_arch(RUNNABLE_ISAS[-1]), tmp_path / "dnn7")
    net = pr.load(tmp_path / "dnn7", threads=2)
    trainer = pr.Trainer(net, pr.SGD(0.01, momentum=0.9))
    x, y = next(pr.synthetic(32, (429, 1, 1), 9304, seed=2).batches(32))
    losses = [trainer.step(x, y) for _ in range(4)]
    assert abs(losses[0] - math.log(9304)) < 2.0 and losses[-1] < losses[0] - 0.1, losses


@pytest.mark.parametrize("record, message", [
    ({"epoch": 1, "train_loss": 1168.0, "train_accuracy": 0.1}, r"far above ln\(10\) = 2.3.*learning rate \(0.02\)"),
    ({"epoch": 2, "train_loss": 2.31, "train_accuracy": 0.1}, "uniform guess that ignores the input"),
    ({"epoch": 2, "train_loss": 3.9, "train_accuracy": 0.1}, "diverged into dead ReLUs"),
    ({"epoch": 1, "train_loss": 2.31, "train_accuracy": 0.1}, None),   # one epoch at chance: a slow start
    ({"epoch": 3, "train_loss": 0.9, "train_accuracy": 0.7}, None),
])
def test_a_stuck_or_diverged_epoch_warns_with_its_likely_cause(record, message):
    import warnings

    from pcldnn_runtime.trainer import _warn_if_stuck
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        _warn_if_stuck(record, 10, 0.02)
    if message is None:
        assert not seen
    else:
        assert len(seen) == 1 and seen[0].category is RuntimeWarning
        import re
        assert re.search(message, str(seen[0].message)), str(seen[0].message)


def test_a_batchnorm_net_resumes_bit_identically_with_its_running_statistics(tmp_path):
    """The running statistics and batch counts travel in the checkpoint (pcldnn-checkpoint/3):
    training resumed into a fresh net ends with the weights, momentum and statistics of the run
    that was not interrupted, bit for bit; a /2 checkpoint, which has none, is refused for it."""
    layers = [{"name": "c", "type": "conv", "out_channels": 8, "kernel": 3, "pad": 1, "bias": False},
              {"name": "bn", "type": "batchnorm", "activation": "relu", "momentum": 0.2},
              {"name": "fc", "type": "fc", "out_features": 5}, {"name": "loss", "type": "softmax_cross_entropy"}]
    build_dir = build_and_load(tmp_path, layers, SHAPE, "scalar", name="bnr").build_dir
    train = pr.synthetic(64, SHAPE, 5, seed=7)
    opt = lambda: pr.SGD(0.05, momentum=0.9, weight_decay=5e-4)  # noqa: E731
    straight = pr.Trainer(_net(build_dir, seed=5), opt(), seed=2)
    straight.fit(train, epochs=4, batch_size=16, progress=False)
    first = pr.Trainer(_net(build_dir, seed=5), opt(), seed=2)
    first.fit(train, epochs=2, batch_size=16, progress=False)
    ckpt = first.save(tmp_path / "bn.npz")
    resumed = pr.Trainer.resume(ckpt, _net(build_dir, seed=99))
    resumed.fit(train, epochs=4, batch_size=16, progress=False)
    for key, value in straight.net.state_dict().items():
        np.testing.assert_array_equal(resumed.net.state_dict()[key], value, err_msg=key)
    assert int(resumed.net.state_dict()["bn.num_batches_tracked"]) == 16
    np.testing.assert_array_equal(resumed.optimizer.velocity, straight.optimizer.velocity)
    with zipfile.ZipFile(ckpt) as z:  # the same file as format /2: no statistics member
        meta = json.loads(bytes(np.load(io.BytesIO(z.read("meta.npy")))).decode())
        arrays = {n: np.load(io.BytesIO(z.read(f"{n}.npy"))) for n in ("params", "velocity")}
    meta["format"] = "pcldnn-checkpoint/2"
    del meta["batch_counts"]
    np.savez(tmp_path / "old.npz", meta=np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8), **arrays)
    with pytest.raises(pr.CheckpointError, match="holds no batchnorm statistics"):
        pr.Trainer.resume(tmp_path / "old.npz", _net(build_dir, seed=1))


def test_checkpoints_of_the_previous_format_resume_nets_without_batchnorm(build_dir, tmp_path):
    """A pcldnn-checkpoint/2 file (no statistics member) still resumes a net that has no batchnorm."""
    trainer = pr.Trainer(_net(build_dir, seed=3), pr.SGD(0.05, momentum=0.9), seed=1)
    trainer.fit(pr.synthetic(32, SHAPE, 5, seed=2), epochs=1, batch_size=16, progress=False)
    with zipfile.ZipFile(trainer.save(tmp_path / "new.npz")) as z:
        meta = json.loads(bytes(np.load(io.BytesIO(z.read("meta.npy")))).decode())
        arrays = {n: np.load(io.BytesIO(z.read(f"{n}.npy"))) for n in ("params", "velocity")}
        assert np.load(io.BytesIO(z.read("statistics.npy"))).size == 0 and meta["batch_counts"] == []
    meta["format"] = "pcldnn-checkpoint/2"
    del meta["batch_counts"]
    np.savez(tmp_path / "old.npz", meta=np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8), **arrays)
    resumed = pr.Trainer.resume(tmp_path / "old.npz", _net(build_dir, seed=9))
    np.testing.assert_array_equal(resumed.net.params, trainer.net.params)
    assert resumed.step_count == trainer.step_count == 2
