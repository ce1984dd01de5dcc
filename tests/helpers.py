"""Helpers shared by the tests: paths, the ISAs to run, one-layer nets built on the fly,
tolerances. Imported as `helpers` (tests/ is on sys.path through conftest.py)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import pcldnn_runtime as pr
from pcldnn_gen.arch import get_arch
from pcldnn_gen.build import build
from pcldnn_gen.netspec import parse_netspec
from pcldnn_gen.planner import LAYER_PASSES, plan_layer
from pcldnn_runtime import cpu
from pcldnn_runtime.launcher import mpiexec

REPO = Path(__file__).resolve().parent.parent
NETS = REPO / "examples" / "nets"
MPIEXEC = mpiexec()

# Every ISA the generator emits; the ones this CPU (or PCLDNN_MAX_ISA) cannot execute are shown as
# skipped. A test that needs an ISA level says so with the needs_isa marker (conftest.py skips it
# where the level is missing, and counts the skips per level); a parameter named `isa` gets the
# marker from its value, however it was parametrized.
ISAS = ("scalar", "avx2", "avx512")
RUNNABLE_ISAS = [isa for isa in ISAS if cpu.supports(isa)]
# AVX2 where this CPU runs it (8-lane blocks: the MPI and whole-net tests' builds), else the widest
VECTOR_ISA = "avx2" if "avx2" in RUNNABLE_ISAS else RUNNABLE_ISAS[-1]
ISA_PARAMS = [pytest.param(isa, marks=pytest.mark.needs_isa(isa), id=isa) for isa in ISAS]


def runs(level: str) -> bool:
    """Whether this process runs kernels of ISA level `level` (cpu.ISA_LEVELS; after the cap)."""
    return cpu.ISA_LEVELS.index(cpu.isa_level()) >= cpu.ISA_LEVELS.index(level)


U32 = 2.0 ** -24  # unit roundoff of float32


# A small net that trains in milliseconds: conv + relu, max-pool, two fc, softmax loss.
TRAIN_LAYERS = [
    {"name": "conv1", "type": "conv", "out_channels": 6, "kernel": 3, "pad": 1, "activation": "relu"},
    {"name": "pool1", "type": "maxpool", "kernel": 2, "stride": 2},
    {"name": "fc1", "type": "fc", "out_features": 12, "activation": "relu"},
    {"name": "fc2", "type": "fc", "out_features": 5},
    {"name": "loss", "type": "softmax_cross_entropy"},
]
TRAIN_SHAPE = (3, 8, 8)


def build_and_load(tmp_path: Path, layers: list[dict], input_shape, isa: str, name: str = "t", threads: int = 2,
                   candidate: int = 0):
    """Build and load a net; `candidate` k > 0 forces every kernel's k-th best register tile
    (the model's own ranking, as the tuner tries them; the last one where there are fewer)."""
    c, h, w = input_shape
    net = parse_netspec({"name": name, "input": {"channels": c, "height": h, "width": w}, "layers": layers})
    out = tmp_path / (f"{name}-{isa}" + (f"-candidate{candidate}" if candidate else ""))
    arch = get_arch(isa)
    choices = {}
    if candidate:
        for layer in net.layers:
            for p in LAYER_PASSES[layer.type]:
                tiles = plan_layer(layer, p, arch).candidate_tiles
                if tiles:
                    t = tiles[min(candidate, len(tiles) - 1)]
                    choices[(layer.name, p)] = (t.width, t.vectors)
    build(net, arch, out, choices=choices)
    return pr.load(out, threads=threads)


def assert_dot_close(got: np.ndarray, ref: np.ndarray, abs_ref: np.ndarray, terms: int) -> None:
    """Each output is a bias plus a dot product of `terms` float32 products. Whatever the
    summation order (blocked, FMA or not), the rounding error of such a sum is bounded by
    (terms + 2)·u·Σ|x·w| (Higham, Accuracy and Stability, §3.1), where `abs_ref` is the same
    computation on absolute values in float64. A wrong index gives errors of order |y|."""
    assert got.shape == ref.shape, (got.shape, ref.shape)
    bound = (terms + 2) * U32 * abs_ref + 1e-30
    err = np.abs(got.astype(np.float64) - ref)
    worst = np.unravel_index(np.argmax(err / bound), err.shape)
    assert np.all(err <= bound), f"error {err[worst]:.3g} > bound {bound[worst]:.3g} at {worst}"


# Convolutions with a fused ReLU under max poolings (2x2, and 3x3 stride 2: overlapping windows),
# and one without a ReLU under a pooling: Net.relu_pools says where the pooling masks.
RELU_POOL_LAYERS = [
    {"name": "c1", "type": "conv", "out_channels": 16, "kernel": 3, "pad": 1, "activation": "relu"},
    {"name": "p1", "type": "maxpool", "kernel": 2, "stride": 2},
    {"name": "c2", "type": "conv", "out_channels": 32, "kernel": 3, "pad": 1, "activation": "relu"},
    {"name": "p2", "type": "maxpool", "kernel": 3, "stride": 2},
    {"name": "c3", "type": "conv", "out_channels": 16, "kernel": 1},
    {"name": "p3", "type": "maxpool", "kernel": 2, "stride": 1},
    {"name": "f4", "type": "fc", "out_features": 5},
    {"name": "loss", "type": "softmax_cross_entropy"},
]


def check_relu_pool_masks(tmp_path, monkeypatch, arch, precision: str = "fp32") -> None:
    """A max pooling above a convolution with a fused ReLU masks the gradient it routes by that
    ReLU (from its own output: the max routed to an input is that input's value) and the
    convolution's backward kernels read no mask: the same loss and gradients, bit for bit, as
    the convolution masking dy itself. And the mask matters on this data (some windows are all
    zero after the ReLU): a pooling that did not apply it would change the gradients."""
    build(parse_netspec({"name": "relu_pools", "input": {"channels": 3, "height": 14, "width": 13},
                         "layers": RELU_POOL_LAYERS}), arch, tmp_path / "b", precision=precision)
    net = pr.load(tmp_path / "b", threads=2, seed=5)
    assert net.relu_pools == {1, 3}  # p1 over c1, p2 over c2; not p3 (c3 has no ReLU)
    rng = np.random.default_rng(7)
    x = rng.standard_normal((4, 3, 14, 13)).astype(np.float32)
    labels = rng.integers(0, 5, 4)
    fused = net.loss_and_grad(x, labels), net.grads.copy()
    pools = net.relu_pools
    net.relu_pools = frozenset()
    plain = net.loss_and_grad(x, labels), net.grads.copy()
    assert fused[0] == plain[0] and np.any(plain[1] != 0)
    np.testing.assert_array_equal(fused[1], plain[1])
    net.relu_pools = pools  # the convolutions told dy is masked, the poolings not masking it
    original = pr.layers.MaxPoolLayer.backward_blocked
    monkeypatch.setattr(pr.layers.MaxPoolLayer, "backward_blocked",
                        lambda self, *args, mask_input=False, **kw: original(self, *args, **kw))
    assert np.any(net.loss_and_grad(x, labels) != fused[0]) or np.any(net.grads != fused[1])


def conv_net(tmp_path: Path, source: dict, layer: dict, precision: str, name: str = "b", arch=None) -> Path:
    """A build of one convolution (layer "conv") on `source` for `arch` (AVX-512 by default)."""
    spec = parse_netspec({"name": name, "input": source, "layers": [{"name": "conv", "type": "conv", **layer}]})
    out = tmp_path / f"{name}-{precision}"
    build(spec, arch or get_arch("avx512"), out, precision=precision)
    return out


def one_sgd_step(net, model, x: np.ndarray, labels: np.ndarray) -> tuple[dict, dict]:
    """One plain SGD step (lr 1) of the net on (x, labels), and PyTorch's backward of the same
    minibatch through `model`: (each parameter's move, ours; each parameter's gradient, PyTorch's
    by its name in the model). A step of lr 1 moves a parameter by its gradient."""
    import torch
    before = net.state_dict()
    pr.Trainer(net, pr.SGD(lr=1.0)).step(x, labels)
    after = net.state_dict()
    model.zero_grad()
    torch.nn.functional.cross_entropy(model(torch.from_numpy(x)), torch.from_numpy(labels)).backward()
    moves = {key: before[key] - after[key] for key in before if key in after}
    return moves, {name: p.grad.numpy() for name, p in model.named_parameters()}
