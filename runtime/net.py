"""Loading a build directory into a `Net` and running it with blocked layouts throughout."""
from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from . import cpu
from .errors import BuildDirError, PcldnnError
from .kernels import empty_aligned, load_library, ptr
from .layers import Layer, LossLayer, PoolLayer, ReluLayer, WeightedLayer
from .manifest import inside, read_manifest

_LAYER_CLASSES = {"conv": WeightedLayer, "fc": WeightedLayer, "maxpool": PoolLayer,
                  "relu": ReluLayer, "softmax_cross_entropy": LossLayer}


class Net:
    """A compiled network: `layers` in net.json order, `forward` on canonical arrays."""

    def __init__(self, build_dir: Path, manifest: dict, threads: int, seed: int):
        self.build_dir = build_dir
        self.manifest = manifest
        self.name: str = manifest["net"]["name"]
        self.isa: str = manifest["arch"]["isa"]
        self.vector_floats: int = manifest["arch"]["vector_bits"] // 32
        self.threads = threads
        self.layers: dict[str, Layer] = {}
        for index, spec in enumerate(manifest["layers"]):
            cls = _LAYER_CLASSES.get(spec["type"])
            if cls is None:
                raise BuildDirError(f"{build_dir}: layer {spec['name']} has unknown type {spec['type']!r}")
            kernels = self._load_kernels(spec)
            if cls is WeightedLayer:
                # Per-layer seed: a layer's initial weights do not depend on the other layers.
                rng = np.random.default_rng(np.random.SeedSequence([seed, index]))
                layer = cls(spec, kernels, self.vector_floats, self, rng)
            else:
                layer = cls(spec, kernels, self.vector_floats, self)
            self.layers[spec["name"]] = layer
        self._chain = [l for l in self.layers.values() if not isinstance(l, LossLayer)]
        seen_fc = False
        for layer in self.layers.values():
            layer.flat_input = layer.flat_input or seen_fc
            seen_fc = seen_fc or layer.type == "fc"
            layer.flat_output = seen_fc
        self._buffers: dict[int, list[np.ndarray]] = {}

    def _load_kernels(self, spec: dict) -> dict:
        """{role: callable}: 'fwd' and the layout roles ('in_to_blocked', 'wt_from_blocked', ...)."""
        roles = {}
        prefix = f"pcldnn_{spec['name']}_"
        for pass_name, entry in spec["kernels"].items():
            fns = load_library(inside(self.build_dir, entry["library"]), entry["sha256"], entry["symbols"])
            for symbol, fn in fns.items():
                roles[pass_name if pass_name != "layout" else symbol[len(prefix):]] = fn
        return roles

    def __repr__(self) -> str:
        return f"<Net {self.name} ({self.isa}, {self.threads} threads): {', '.join(self.layers)}>"

    def _batch_buffers(self, batch: int) -> list[np.ndarray]:
        """Blocked activation buffers for this minibatch size, allocated once and reused."""
        if batch not in self._buffers:
            first = self._chain[0]
            bufs = [empty_aligned(first.blocked_shape(first.in_shape, batch))]
            bufs += [empty_aligned(l.blocked_shape(l.out_shape, batch)) for l in self._chain]
            self._buffers[batch] = bufs
        return self._buffers[batch]

    def forward(self, x: np.ndarray, timings: dict[str, float] | None = None) -> np.ndarray:
        """Logits (N, classes) — or the last layer's output — for a canonical (N, C, H, W) batch.
        One conversion at the input, one at the output, blocked layouts in between.
        If `timings` is a dict, each layer's kernel time in seconds is stored under its name."""
        first, last = self._chain[0], self._chain[-1]
        x = first._check_input(x)
        batch = x.shape[0]
        bufs = self._batch_buffers(batch)
        first._k["in_to_blocked"](ptr(x.reshape(batch, *first.in_shape)), ptr(bufs[0]), batch, self.threads)
        for i, layer in enumerate(self._chain):
            if timings is None:
                layer.forward_blocked(bufs[i], bufs[i + 1])
            else:
                start = time.perf_counter()
                layer.forward_blocked(bufs[i], bufs[i + 1])
                timings[layer.name] = time.perf_counter() - start
        y = np.empty((batch, *last.out_shape), dtype=np.float32)
        last._k["out_from_blocked"](ptr(bufs[-1]), ptr(y), batch, self.threads)
        return y.reshape(batch, -1) if last.flat_output else y


def load(build_dir: str | Path, threads: int | None = None, seed: int = 0) -> Net:
    """Load a build directory made by `pcldnn-gen compile`.

    threads: OpenMP threads per kernel call (None: every core this process may use).
    seed: seeds the He-normal weight initialisation (biases start at zero).
    """
    build_dir = Path(build_dir)
    manifest = read_manifest(build_dir)
    cpu.require(manifest["arch"]["isa"], f"build {build_dir}")
    if threads is None:
        threads = cpu.usable_cores()
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise PcldnnError(f"threads must be a positive int or None, got {threads!r}")
    return Net(build_dir, manifest, threads, seed)
