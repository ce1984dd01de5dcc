"""Loading a build directory into a `Net`, and running it forward and backward with blocked
layouts throughout: one conversion at the input, one at the logits, none in between."""
from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any

import numpy as np

from . import cpu, families, observe
from .activations import ACTIVATIONS
from .errors import BuildDirError, NonFiniteError, PcldnnError
from .families import bf16_gradients, bf16_outputs, sides
from .families.fusion import NONE as NO_FUSIONS
from .families.fusion import plan_fusions
from .kernels import (
    CACHE_LINE_FLOATS,
    KernelLibrary,
    empty_aligned,
    fma_peak_gflops,
    load_library,
    pin_openmp_runtimes,
    zeros_aligned,
)
from .launcher import local_ranks
from .layers import (
    ActivationLayer,
    AddLayer,
    AvgPoolLayer,
    ConcatLayer,
    DropoutLayer,
    JoinLayer,
    Layer,
    LossLayer,
    MaxPoolLayer,
    MulLayer,
    NormLayer,
    ParamLayer,
    WeightedLayer,
)
from .manifest import PEAK_SYMBOL, SGD_SYMBOL, WEIGHTS_FILE, LayerEntry, Manifest, inside, read_manifest
from .state_io import StateKeys, check_running_stats, check_state, expected_state, read_npz
from .validate import non_finite_at

_LAYER_CLASSES: dict[str, type[Layer]] = {
    "conv": WeightedLayer, "fc": WeightedLayer, "batchnorm": NormLayer, "maxpool": MaxPoolLayer,
    "avgpool": AvgPoolLayer, **dict.fromkeys(ACTIVATIONS, ActivationLayer), "dropout": DropoutLayer,
    "drop_path": DropoutLayer,
    "add": AddLayer, "concat": ConcatLayer, "mul": MulLayer, "softmax_cross_entropy": LossLayer}


MAX_WORKSPACES = 2  # minibatch sizes whose buffers a Net keeps (see Net.workspace)


class _BufferPool:
    """Buffers of `floats` floats each, lent as float32 or bf16 views of a shape and given back:
    as many are allocated as are out at once."""

    def __init__(self, floats: int):
        self._floats = floats
        self._free: list[np.ndarray] = []
        self._lent: dict[int, np.ndarray] = {}  # the buffers given out, by their address

    @property
    def allocated(self) -> int:
        return len(self._free) + len(self._lent)

    def take(self, shape: tuple[int, ...], bf16: bool = False) -> np.ndarray:
        buf = self._free.pop() if self._free else empty_aligned((self._floats,))
        self._lent[buf.ctypes.data] = buf
        return (buf.view(np.uint16) if bf16 else buf)[: int(np.prod(shape))].reshape(shape)

    def give(self, view: np.ndarray) -> None:
        self._free.append(self._lent.pop(view.ctypes.data))


class _Workspace:
    """Everything a forward + backward pass of one minibatch size needs, allocated once: the
    net input's and every layer's blocked output (acts[0], acts[i + 1]: kept for the backward
    pass; bf16 where families.bf16_outputs says), argmax / dropout state, a pool of buffers for
    activation gradients (each fp32, or bf16 where families.bf16_gradients says: a chain takes
    two, a graph as many as gradients wait at once), softmax probabilities and labels."""

    def __init__(self, net: Net, batch: int):
        chain = net.chain
        self.batch = batch
        self.acts = [empty_aligned(chain[0].input_shape(batch))]
        # (a batchnorm whose add computes with it writes no output of its own: families.fusion)
        self.acts += [empty_aligned((0,)) if i in net.fusions.residual else
                      empty_aligned(l.blocked_shape(l.out_shape, batch), dtype=np.uint16 if l.out_bf16 else np.float32)
                      for i, l in enumerate(chain)]
        self.aux = [l.aux_buffer(batch) for l in chain]
        self._grads = _BufferPool(max(a.size for a in self.acts))
        classes = chain[-1].out_shape[0]
        self.probs = np.empty((batch, classes), dtype=np.float32)
        self.labels = np.empty(batch, dtype=np.int32)

    def grad(self, like: np.ndarray, bf16: bool = False) -> np.ndarray:
        """A gradient buffer from the pool viewed with the shape of `like`, as float32 or as
        bf16 bits; `release` returns it."""
        return self._grads.take(like.shape, bf16)

    def release(self, grad: np.ndarray) -> None:
        self._grads.give(grad)


class _EvaluationBuffers:
    """An evaluation forward's buffers for one minibatch size. No backward pass follows, so an
    activation's buffer goes back to a pool once its last reader has run (Net.freed_after): a
    chain holds two, a residual net three or four, where a training workspace holds every
    layer's output (ResNet-50 at 256 images: about 3 GB instead of 25)."""

    def __init__(self, net: Net, batch: int):
        chain = net.chain
        self.batch = batch
        self.input = empty_aligned(chain[0].input_shape(batch))
        self.aux = [l.aux_buffer(batch) for l in chain]
        self._shapes = [l.blocked_shape(l.out_shape, batch) for l in chain]
        self._acts = _BufferPool(max(int(np.prod(shape)) for shape in self._shapes))
        self.probs = np.empty((batch, chain[-1].out_shape[0]), dtype=np.float32)
        self.output: np.ndarray | None = None  # the last forward's output (blocked)

    @property
    def pooled(self) -> int:
        """Activation buffers allocated so far (each of the largest activation's size)."""
        return self._acts.allocated

    def take(self, layer: Layer, i: int) -> np.ndarray:
        """A pooled buffer as layer i's output: float32, or bf16 bits where it stores bf16."""
        return self._acts.take(self._shapes[i], layer.out_bf16)

    def give(self, act: np.ndarray) -> None:
        self._acts.give(act)


class Net:
    """A compiled network: `layers` in net.json order; `forward`, `backward`, `loss_and_grad`.

    Parameters live in one flat buffer (`params`) and their gradients in another (`grads`),
    each layer's blocked weights and bias being views into them, so an optimizer or an MPI
    reduction can work on contiguous slices."""

    def __init__(self, build_dir: Path, manifest: Manifest, threads: int, seed: int):
        self.build_dir = build_dir
        self.manifest = manifest
        self.name: str = manifest.net_name
        self.isa: str = manifest.isa
        self.precision: str = manifest.precision
        self.vector_floats: int = manifest.vector_floats
        self.threads = threads
        self.seed = seed
        self.dropout_draws = 0  # dropout calls so far: with `seed`, what the next mask is drawn from
        self.row_offset = 0  # first row of this process's shard in the global minibatch (dropout masks)
        self._scratch = empty_aligned((0,))
        self._libraries: list = []  # loaded kernel libraries (KernelLibrary): their functions stay callable
        self._workspaces: dict[int, _Workspace] = {}
        self._peaks: dict[int, float] = {}  # FMA peak GFLOP/s by thread count (peak_gflops)
        self._own_libraries: dict[str, KernelLibrary] = {}  # the build's kernels of no layer, by symbol (_own)
        for entry in (manifest.peak, manifest.sgd):  # loaded on first use only, but their paths are checked now
            if entry is not None:
                inside(build_dir, entry.library)
        self._pending: _Workspace | None = None  # set by a training-mode forward, used by backward
        specs = manifest.layers
        v = self.vector_floats

        # Flat parameter and gradient buffers: [w0, b0, w1, b1, ...], each block cache-line aligned.
        offsets, total = {}, 0
        for spec in specs:
            cls = _LAYER_CLASSES[spec.type]
            if issubclass(cls, ParamLayer):
                wshape, blen = cls.blocked_sizes(spec, v)
                wsize = int(np.prod(wshape))
                offsets[spec.name] = (total, wshape, total + _round_up(wsize), blen)
                total += _round_up(wsize) + _round_up(blen)
        self._params = zeros_aligned((total,))
        self._grads = zeros_aligned((total,))
        # Bumped whenever the weights may have changed: copies derived from them (an AMX fc
        # layer's bf16 weight tiles) are remade on their next use after a bump.
        self._weights_version = 0
        # Set by the MPI runtime after a step while part-broadcasts are pending: the next read
        # of the weights (by any route: params, layer.weights, forward, save) waits for them.
        self._on_access = None
        self._bias_slices = [(b0, b0 + blen) for _, _, b0, blen in offsets.values()]
        # [start, stop) of each weighted layer's block (weights, then bias) in params / grads
        self.param_ranges = {name: (w0, b0 + _round_up(blen)) for name, (w0, _, b0, blen) in offsets.items()}

        self.layers: dict[str, Layer] = {}
        for index, spec in enumerate(specs):
            cls = _LAYER_CLASSES[spec.type]
            kernels = self._load_kernels(spec)
            layer: Layer
            if issubclass(cls, ParamLayer):
                w0, wshape, b0, blen = offsets[spec.name]
                wsize = int(np.prod(wshape))
                views = lambda buf: (buf[w0:w0 + wsize].reshape(wshape), buf[b0:b0 + blen])  # noqa: E731
                weighted = cls(spec, kernels, v, self, views(self._params), views(self._grads), (w0, b0))
                # Per-layer seed: a layer's initial weights do not depend on the other layers.
                weighted.init_weights(np.random.default_rng(np.random.SeedSequence([seed, index])))
                layer = weighted
            else:
                layer = cls(spec, kernels, v, self)
            self.layers[spec.name] = layer
        # The layers in file order but the loss (a topological order of the graph: a layer reads
        # only earlier ones); layer i writes acts[i + 1] and reads acts[s] for s in sources[i]
        # (0: the net's input).
        self.chain: list[Layer] = [l for l in self.layers.values() if not isinstance(l, LossLayer)]
        losses = [l for l in self.layers.values() if isinstance(l, LossLayer)]
        self.loss_layer: LossLayer | None = losses[0] if losses else None
        position = {"input": 0} | {l.name: i + 1 for i, l in enumerate(self.chain)}
        self.sources: list[tuple[int, ...]] = [tuple(position[n] for n in l.spec.inputs) for l in self.chain]
        # activations whose gradient is wanted: those a parameter's layer wrote or read through
        self.needs_grad = [False] * (len(self.chain) + 1)
        for i, layer in enumerate(self.chain):
            self.needs_grad[i + 1] = isinstance(layer, ParamLayer) or any(self.needs_grad[s] for s in self.sources[i])
        # Kernels that do two layers' work (families.fusion, as the build planned them): a
        # convolution filling its batchnorm's statistics, a batchnorm computing its add (run at
        # the add's position, when the shortcut is ready).
        self.fusions = plan_fusions(specs, manifest.target) if manifest.fusion else NO_FUSIONS
        self._joined_at = {add: norm for norm, add in self.fusions.residual.items()}
        self._stats_ready = frozenset(self.fusions.statistics.values())  # batchnorms whose convolution fills them
        # activations whose gradient a residual fusion's batchnorm reads (an add's output): a second
        # reader's gradient is summed into the first by that batchnorm's kernel, not by numpy
        self._summed_in_kernel = frozenset(add + 1 for add in self._joined_at)
        # per layer, the activations no layer reads after it (an evaluation forward frees them
        # there; a residual fusion's batchnorm reads its input at its add's position; the net's
        # input and output are not pooled)
        last_read: dict[int, int] = {}
        for i, sources in enumerate(self.sources):
            for s in sources:
                last_read[s] = max(last_read.get(s, -1), self.fusions.residual.get(i, i))
        self.freed_after: list[tuple[int, ...]] = [
            tuple(s for s, at in last_read.items() if at == i and 0 < s < len(self.chain)
                  and s - 1 not in self.fusions.residual)  # (a fused batchnorm writes no output)
            for i in range(len(self.chain))]
        self._evaluations: dict[int, _EvaluationBuffers] = {}
        chained = families.chain_edges(specs)
        # Chain positions of max poolings right above a convolution with a fused ReLU, its only
        # reader: in the backward pass the pooling masks the gradient it routes by that ReLU
        # (from its own, smaller, output) and the convolution's kernels read no mask (Net.backward).
        self.relu_pools = frozenset(i for i in range(1, len(self.chain)) if isinstance(self.chain[i], MaxPoolLayer)
                                    and self.sources[i] == (i,) and chained[i - 1]
                                    and isinstance(below := self.chain[i - 1], WeightedLayer) and below.spec.activation)
        flat = [False] * (len(self.chain) + 1)  # after an fc layer activations are vectors
        for i, layer in enumerate(self.chain):
            layer.flat_input = layer.flat_input or flat[self.sources[i][0]]
            flat[i + 1] = layer.flat_output = layer.flat_input or layer.type == "fc"
        if self.loss_layer is not None:
            self.loss_layer.flat_input = self.loss_layer.flat_output = True
        # bf16 builds: an activation whose writer and reader kernels all take bf16 is stored so
        # (families.bf16_outputs, on chain edges only; the manifest says the same)
        outputs = sides(bf16_outputs(self.precision, manifest.arch.get("amx") is True, v, specs))
        gradients = sides(bf16_gradients(self.precision, manifest.arch.get("amx") is True, v, specs))
        for spec, (in16, out16), (in_grad16, out_grad16) in zip(specs, outputs, gradients, strict=True):
            layer = self.layers[spec.name]
            layer.in_bf16, layer.out_bf16, layer.in_grad_bf16, layer.out_grad_bf16 = in16, out16, in_grad16, out_grad16

    def _load_kernels(self, spec: LayerEntry) -> dict:
        """{role: callable}: 'fwd', 'bwd_data', 'bwd_weights' and the layout roles
        ('in_to_blocked', 'wt_from_blocked', ...)."""
        roles = {}
        prefix = f"pcldnn_{spec.name}_"
        for entry in spec.kernels.values():
            fns = load_library(inside(self.build_dir, entry.library), entry.sha256, entry.symbols, pin=False)
            self._libraries.append(fns)  # the handles live as long as the net
            if len(self._libraries) == 1:  # the first brings the OpenMP runtime: held before any kernel runs
                pin_openmp_runtimes()
            for symbol, fn in fns.items():
                role = symbol[len(prefix):]  # the pass name, or a layout role, or <pass>_tiles
                kind = entry.symbols[symbol]
                watch = observe.observer()
                if watch is not None and observe.per_minibatch(kind):  # PCLDNN_VERBOSE / PCLDNN_TIMELINE
                    isa = self.isa + families.isa_suffix(kind)
                    fn = watch.wrap(fn, observe.KernelCall(spec, role, kind, isa, self.vector_floats),
                                    self.peak_gflops)
                roles[role] = fn
        return roles

    def peak_gflops(self, threads: int | None = None) -> float | None:
        """This machine's FMA peak in GFLOP/s on `threads` threads (default: the net's), from the
        build's peak kernel, measured on first use (~0.3 s) per thread count; None for a build
        without one (made before the kernel was part of builds)."""
        threads = self.threads if threads is None else threads
        entry = self.manifest.peak
        if entry is None:
            return None
        if threads not in self._peaks:
            self._peaks[threads] = fma_peak_gflops(self._own(entry, PEAK_SYMBOL),
                                                   self.manifest.peak_flops_per_iteration, threads)
        return self._peaks[threads]

    def _own(self, entry: Any, symbol: str) -> Any:
        """`symbol` of one of the build's kernels of no layer (peak, sgd), its library loaded on
        first use and held like the layers' libraries."""
        if symbol not in self._own_libraries:
            self._own_libraries[symbol] = load_library(inside(self.build_dir, entry.library), entry.sha256,
                                                       entry.symbols)
        return self._own_libraries[symbol][symbol]

    def sgd_kernel(self) -> Any:
        """The build's SGD update (templates/sgd.c.j2, abi "sgd"), loaded on first use; None for a
        build made before it was part of builds (the optimizer then updates with numpy)."""
        entry = self.manifest.sgd
        return None if entry is None else self._own(entry, SGD_SYMBOL)

    @property
    def params(self) -> np.ndarray:
        """Every layer's blocked weights and bias in one flat buffer (current on every rank).
        Writable: each access counts as a change of the weights (weights_changed), so copies
        derived from them are remade before their next use. A view kept across a forward call
        and written later is not seen: take `net.params` again to write."""
        self.current()
        self.weights_changed()
        return self._params

    @property
    def weights_version(self) -> int:
        """A count that moves whenever the weights may have changed (see `params`)."""
        return self._weights_version

    def weights_changed(self) -> None:
        """Mark the weights changed: the writers that do not go through `params` call it (a
        layer's weights setter, a completed MPI part-broadcast)."""
        self._weights_version += 1

    @property
    def grads(self) -> np.ndarray:
        """The gradients of `params`, same layout."""
        self.current()
        return self._grads

    def complete_on_access(self, hook: Any) -> None:
        """Run `hook` before the next read of the weights (None: nothing pending). The MPI
        runtime registers its pending part-broadcasts here after a step."""
        self._on_access = hook

    def current(self) -> None:
        """Complete any pending update of the weights (MPI part-broadcasts) before they are read."""
        hook = self._on_access
        if hook is not None:
            self._on_access = None
            hook()

    def __repr__(self) -> str:
        return f"<Net {self.name} ({self.isa}, {self.threads} threads): {', '.join(self.layers)}>"

    # -- weights in and out, canonical layouts ----------------------------------------------
    def _weighted(self) -> dict[str, ParamLayer]:
        return {name: l for name, l in self.layers.items() if isinstance(l, ParamLayer)}

    def _norms(self) -> dict[str, NormLayer]:
        return {name: l for name, l in self.layers.items() if isinstance(l, NormLayer)}

    @property
    def canonical_size(self) -> int:
        """Floats of every weighted layer's canonical weights and bias: what checkpoints hold."""
        return sum(int(np.prod(l.weight_shape)) + l.out_shape[0] for l in self._weighted().values())

    def to_canonical(self, flat: np.ndarray) -> np.ndarray:
        """A params-like blocked buffer (params, momentum) as one canonical vector: per weighted
        layer in net order its weights (PyTorch's layout, C order) then its bias. The same on
        every ISA; an exact permutation of the values."""
        self.current()
        return np.concatenate([l.canonical_from(flat) for l in self._weighted().values()])

    def from_canonical(self, vector: np.ndarray, flat: np.ndarray) -> None:
        """The inverse of to_canonical, into a params-like blocked buffer."""
        self.current()
        start = 0
        for layer in self._weighted().values():
            n = int(np.prod(layer.weight_shape)) + layer.out_shape[0]
            layer.canonical_into(vector[start:start + n], flat)
            start += n

    def batch_norm_channels(self) -> list[int]:
        """The channels of every batchnorm layer, in net order."""
        return [layer.out_shape[0] for layer in self._norms().values()]

    def running_statistics(self) -> tuple[np.ndarray, list[int]]:
        """Every batchnorm layer's running mean then variance, canonical, as one float32 vector
        (checkpoints hold it), and their batch counts."""
        norms = self._norms().values()
        stats = [part for layer in norms for part in layer.running_stats()]
        return (np.concatenate(stats) if stats else np.zeros(0, np.float32)), [l.num_batches_tracked for l in norms]

    def set_running_statistics(self, vector: np.ndarray, counts: list[int]) -> None:
        """The inverse of running_statistics."""
        start = 0
        for layer, count in zip(self._norms().values(), counts, strict=True):
            c = layer.out_shape[0]
            layer.set_running_stats(vector[start:start + c], vector[start + c:start + 2 * c])
            layer.num_batches_tracked = int(count)
            start += 2 * c

    def state_dict(self) -> dict[str, np.ndarray]:
        """{"<layer>.weight": conv (OC, IC, KH, KW) / fc (OC, IC), "<layer>.bias": (OC,)}: float32
        copies in canonical layouts (PyTorch's for Conv2d and Linear), in net order, the same
        whatever the ISA the net was built for; a batchnorm's as BatchNorm2d's: weight and bias
        (C,), running_mean and running_var (C,), num_batches_tracked (an int64 scalar)."""
        out: dict[str, np.ndarray] = {}
        for name, layer in self._weighted().items():
            out[f"{name}.weight"] = layer.weights
            if layer.spec.bias:
                out[f"{name}.bias"] = layer.bias
            if isinstance(layer, NormLayer):
                out[f"{name}.running_mean"], out[f"{name}.running_var"] = layer.running_stats()
                out[f"{name}.num_batches_tracked"] = np.array(layer.num_batches_tracked, dtype=np.int64)
        return out

    def export_onnx(self, path: str | Path) -> Path:
        """The inference graph (image in, logits out) with the current weights as an ONNX model
        (needs the onnx package); onnxruntime gives this net's logits."""
        from .onnx_export import export_onnx
        try:
            return export_onnx(self, path)
        except OSError as e:
            raise PcldnnError(f"{path}: cannot write the ONNX model: {e.strerror or e}") from None

    def load_state_dict(self, state: Any, strict: bool = True) -> StateKeys:
        """Set weights and biases from a mapping like `state_dict()`'s: numpy arrays, torch
        tensors (anything with .detach().cpu().numpy()) or array-likes of any float dtype. Every
        entry is checked (shape, finite values) before anything is written, so a refused call
        leaves the net as it was. strict: missing and unexpected keys are an error listing all
        of them; otherwise the matching keys load and the others come back in the result."""
        arrays, keys = check_state(expected_state(self.manifest.layers), state, "load_state_dict", strict)
        check_running_stats(arrays, "load_state_dict")
        for key, array in arrays.items():
            name, what = key.rsplit(".", 1)
            layer = self.layers[name]
            if what in ("weight", "bias"):
                setattr(layer, "weights" if what == "weight" else "bias", array)
            elif isinstance(layer, NormLayer):
                if what == "num_batches_tracked":
                    layer.num_batches_tracked = int(array)
                else:
                    mean, var = layer.running_stats()
                    layer.set_running_stats(array if what == "running_mean" else mean,
                                            array if what == "running_var" else var)
        return keys

    # -- buffers -------------------------------------------------------------------------
    def workspace(self, batch: int) -> _Workspace:
        """The buffers of a `batch`-sized pass. At most MAX_WORKSPACES sizes are kept, the least
        recently used dropped first (never the one a pending backward needs): a training size,
        an evaluation size and a last partial batch do not pile up one workspace each forever."""
        ws = self._workspaces.pop(batch, None) or _Workspace(self, batch)
        self._workspaces[batch] = ws  # most recent last
        for size in list(self._workspaces):
            if len(self._workspaces) <= MAX_WORKSPACES:
                break
            if self._workspaces[size] is not self._pending and size != batch:
                del self._workspaces[size]
        return ws

    def bias_slices(self) -> list[tuple[int, int]]:
        """[start, stop) of every bias inside `params` (optimizers may exempt them from decay)."""
        return list(self._bias_slices)

    def build_fingerprint(self) -> str:
        """sha256 over the build's kernel libraries and arch: ranks of one job must agree on it."""
        # The libraries' digests already cover everything that shapes the code; the ISA and flags
        # say what it runs on. Descriptive arch fields (the core count of the compiling shell's
        # affinity mask) stay out, so identical kernels built under different masks agree.
        kernels = {l.name: {p: k.sha256 for p, k in l.kernels.items()} for l in self.manifest.layers}
        blob = json.dumps({"isa": self.manifest.isa, "cflags": self.manifest.arch["cflags"], "kernels": kernels},
                          sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()

    @property
    def net_hash(self) -> str:
        """sha256 of the net description the build was made from (checkpoints carry it)."""
        return self.manifest.net_hash

    def scratch(self, floats: int) -> np.ndarray:
        """Shared kernel scratch (conv backward-data's transposed weights), grown on demand."""
        if self._scratch.size < floats:
            self._scratch = empty_aligned((floats,))
        return self._scratch

    def next_dropout_seed(self) -> int:
        """A fresh seed for every dropout call, from (net seed, call count): runs are
        reproducible, and each step and layer draws a new mask."""
        self.dropout_draws += 1
        return int(np.random.SeedSequence([self.seed, self.dropout_draws]).generate_state(1, np.uint64)[0])

    # -- passes --------------------------------------------------------------------------
    # The mode forward runs in when not told (train() / eval(), as PyTorch's Module): a loaded
    # net evaluates; Trainer steps and loss_and_grad always run in training mode.
    training = False

    def train(self, mode: bool = True) -> Net:
        """Training mode: forward applies dropout and normalizes by the batch's statistics
        (updating the running ones), as a PyTorch module after .train()."""
        self.training = bool(mode)
        return self

    def eval(self) -> Net:
        """Evaluation mode (the default): no dropout, batchnorm by its running statistics."""
        return self.train(False)

    def forward(self, x: np.ndarray, *, training: bool | None = None, timings: dict[str, float] | None = None,
                before_layer: Any = None) -> np.ndarray:
        """Logits (N, classes) — or the last layer's output — for a canonical (N, C, H, W) batch.
        training=True (default: the net's mode, `train()` / `eval()`) applies dropout, normalizes
        by the batch's statistics and keeps what `backward` needs. If `timings` is a dict,
        each layer's kernel time in seconds is stored under its name. `before_layer(layer)` is
        called before each layer runs (the MPI runtime waits there for that layer's weights)."""
        if before_layer is None:
            self.current()
        training = self.training if training is None else training
        first, last = self.chain[0], self.chain[-1]
        x = first.check_input(x)
        batch = x.shape[0]
        bad = non_finite_at(x)
        if bad is not None:  # a fused ReLU would map NaN to 0: the loss stays finite, the weights do not
            raise NonFiniteError(f"input sample {self.row_offset + bad // (x.size // batch)} of the minibatch holds NaN "
                                 f"or infinity (layer {first.name}'s input)")
        ws = self.workspace(batch) if training else None
        ev = None if training else self.evaluation_buffers(batch)
        if ev is not None and ev.output is not None:  # the previous evaluation's output: read by now
            ev.give(ev.output)
            ev.output = None
        acts: list[Any] = ws.acts if ws is not None else [ev.input] + [None] * len(self.chain)  # type: ignore[union-attr]
        auxes = ws.aux if ws is not None else ev.aux  # type: ignore[union-attr]
        first.input_into_blocked(x, acts[0])
        fusions = self.fusions
        for i, layer in enumerate(self.chain):
            if before_layer is not None:
                before_layer(layer)
            if ev is not None and i not in fusions.residual:
                acts[i + 1] = ev.take(layer, i)
            start = time.perf_counter()
            timed = layer
            if i in fusions.residual:
                pass  # its add's position runs it (below)
            elif i in self._joined_at:  # the batchnorm computing this add: relu(bn(x) + shortcut) into its output
                j = self._joined_at[i]
                norm, shortcut = self.chain[j], self._shortcut(i, j)
                assert isinstance(norm, NormLayer)
                norm.forward_blocked(acts[self.sources[j][0]], acts[i + 1], auxes[j], training,
                                     residual=acts[shortcut], statistics_ready=training and j in self._stats_ready)
                timed = norm
            elif isinstance(layer, JoinLayer):
                layer.forward_join([acts[s] for s in self.sources[i]], acts[i + 1])
            elif isinstance(layer, WeightedLayer) and training and i in fusions.statistics:
                aux = auxes[fusions.statistics[i]]  # its batchnorm's batch statistics, filled by the kernel
                layer.forward_blocked(acts[self.sources[i][0]], acts[i + 1], auxes[i], training, (aux[0], aux[1]))
            elif isinstance(layer, NormLayer):
                layer.forward_blocked(acts[self.sources[i][0]], acts[i + 1], auxes[i], training,
                                      statistics_ready=training and i in self._stats_ready)
            else:
                layer.forward_blocked(acts[self.sources[i][0]], acts[i + 1], auxes[i], training)
            if timings is not None:  # a fused pair's time goes to the layer whose kernel ran
                timings.setdefault(layer.name, 0.0)
                timings[timed.name] = time.perf_counter() - start
            if ev is not None:
                for s in self.freed_after[i]:
                    ev.give(acts[s])
                    acts[s] = None
        self._pending = ws
        if ev is not None:
            ev.output = acts[-1]
        return last.output_from_blocked(acts[-1])

    def evaluation_buffers(self, batch: int) -> _EvaluationBuffers:
        """The pooled buffers of a `batch`-sized evaluation forward (at most MAX_WORKSPACES sizes
        kept, the least recently used dropped first)."""
        ev = self._evaluations.pop(batch, None) or _EvaluationBuffers(self, batch)
        self._evaluations[batch] = ev
        while len(self._evaluations) > MAX_WORKSPACES:
            del self._evaluations[next(iter(self._evaluations))]
        return ev

    def backward(self, labels: np.ndarray, *, timings: dict[str, float] | None = None,
                 grad_scale: float = 1.0, after_layer: Any = None) -> float:
        """After `forward(x, training=True)`: the mean loss against `labels`, and every layer's
        gradients (in `grads`; per layer `grad_weights` / `grad_bias`). The gradients are those
        of grad_scale x the mean loss (the MPI runtime weights each rank's shard by its share of
        the global minibatch); `after_layer(layer)` is called as each layer's gradients are done."""
        if self.loss_layer is None:
            raise PcldnnError(f"net {self.name} has no loss layer to differentiate")
        ws = self._pending
        if ws is None:
            raise PcldnnError("backward needs a forward(x, training=True) just before it")
        labels = self.loss_layer.check_labels(labels, ws.batch)
        np.copyto(ws.labels, labels)
        loss = self.loss_layer.loss_blocked(ws.acts[-1], ws.labels, ws.probs)
        dy = ws.grad(ws.acts[-1])
        self.loss_layer.grad_blocked(ws.probs, ws.labels, dy)
        if grad_scale != 1.0:
            dy *= np.float32(grad_scale)
        # Each activation's gradient, summed over its readers as they finish (in reverse file
        # order every reader of an activation runs before its writer); a layer whose input needs
        # no gradient (below every parameter) computes none, and one with neither is skipped.
        grads: dict[int, np.ndarray] = {len(self.chain): dy}
        later: dict[int, np.ndarray] = {}  # second gradients, summed by a residual fusion's kernel
        for i in range(len(self.chain) - 1, -1, -1):
            layer, sources = self.chain[i], self.sources[i]
            if i + 1 not in grads:  # below every parameter: no gradient reaches this layer's output
                continue
            dy = grads.pop(i + 1)
            wanted = [s for s in sources if self.needs_grad[s]]
            if not wanted and not isinstance(layer, ParamLayer) and i not in self._joined_at:
                ws.release(dy)
                continue
            start = time.perf_counter()
            if i in self._joined_at:
                self._backward_joined(ws, grads, later, i, dy, after_layer)
            elif isinstance(layer, AddLayer):
                layer.backward_join(ws.acts[i + 1], dy)
                for s in wanted:  # the same gradient for every input: the last takes the buffer itself
                    self._accumulate(grads, later, ws, s, dy, alias=s == wanted[-1])
                if not wanted:
                    ws.release(dy)
            elif isinstance(layer, (ConcatLayer, MulLayer)):
                parts = [ws.grad(ws.acts[s]) for s in sources]
                if isinstance(layer, MulLayer):  # (each part from the other input's values)
                    layer.backward_join(dy, [ws.acts[s] for s in sources], parts)
                else:
                    layer.backward_join(dy, parts)
                ws.release(dy)
                for s, part in zip(sources, parts, strict=True):
                    if self.needs_grad[s]:
                        self._accumulate(grads, later, ws, s, part, alias=True)
                    else:
                        ws.release(part)
            else:
                s = sources[0]
                dx = ws.grad(ws.acts[s], layer.in_grad_bf16) if wanted else None
                param_grads = layer.grad_buffers if isinstance(layer, ParamLayer) else None
                # a max pooling over a fused ReLU's output applies that ReLU's mask for the layer below
                fused = ({"mask_input": True} if i in self.relu_pools else
                         {"dy_masked": True} if i + 1 in self.relu_pools else {})
                layer.backward_blocked(ws.acts[s], ws.acts[i + 1], ws.aux[i], dy, dx, param_grads, **fused)
                ws.release(dy)
                if dx is not None:
                    self._accumulate(grads, later, ws, s, dx, alias=True)
            if timings is not None:  # a fused pair's time goes to the batchnorm, whose kernels ran
                timings[layer.name] = 0.0
                timings[self.chain[self._joined_at.get(i, i)].name] = time.perf_counter() - start
            if after_layer is not None:
                after_layer(layer)
        for g in grads.values():  # the net input's gradient is not computed (never wanted)
            ws.release(g)
        self._pending = None
        return loss

    def _shortcut(self, add: int, norm: int) -> int:
        """The activation a residual fusion's batchnorm adds: its add's other input."""
        return next(s for s in self.sources[add] if s != norm + 1)

    def _backward_joined(self, ws: _Workspace, grads: dict[int, np.ndarray], later: dict[int, np.ndarray], add: int,
                         dy: np.ndarray, after_layer: Any) -> None:
        """A residual fusion's backward at its add: the batchnorm's passes add the output's second
        gradient (`later`, when two layers read it) and mask dy by the add's ReLU in place
        (backward-weights), after which dy is the shortcut's gradient as it is."""
        dy_extra = later.pop(add + 1, None)
        j = self._joined_at[add]
        norm, shortcut, x = self.chain[j], self._shortcut(add, j), self.sources[j][0]
        assert isinstance(norm, NormLayer)
        dx = ws.grad(ws.acts[x]) if self.needs_grad[x] else None
        joined = self.chain[add]
        assert isinstance(joined, AddLayer)
        norm.backward_blocked(ws.acts[x], ws.acts[add + 1], ws.aux[j], dy, dx, norm.grad_buffers,
                              residual_relu=bool(joined.spec.activation), dy_extra=dy_extra)
        if dy_extra is not None:
            ws.release(dy_extra)
        if after_layer is not None:
            after_layer(norm)
        if dx is not None:
            self._accumulate(grads, later, ws, x, dx, alias=True)
        if self.needs_grad[shortcut]:
            self._accumulate(grads, later, ws, shortcut, dy, alias=True)
        else:
            ws.release(dy)

    def _accumulate(self, grads: dict[int, np.ndarray], later: dict[int, np.ndarray], ws: _Workspace, s: int,
                    g: np.ndarray, alias: bool) -> None:
        """Activation s's gradient gets g: g itself when it is the first (alias: g may become it;
        else a copy), added to it after (a fan-out's gradients summed in fp32); where a residual
        fusion's batchnorm reads it, the second is kept apart in `later` for that kernel to add."""
        have = grads.get(s)
        if have is None or (s in self._summed_in_kernel and s not in later):
            if alias:
                (grads if have is None else later)[s] = g
            else:
                (grads if have is None else later)[s] = copy = ws.grad(g)
                np.copyto(copy, g)
            return
        np.add(have, g, out=have)
        if alias:
            ws.release(g)

    def predict(self, x: Any, batch_size: int = 256) -> np.ndarray:
        """Logits of every sample of x (an (N, C, H, W) array or a dataset), in evaluation mode,
        `batch_size` samples per forward pass: memory stays one minibatch's workspace."""
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or not 1 <= batch_size <= 1 << 20:
            raise PcldnnError(f"predict: batch_size must be an int in [1, 2^20], got {batch_size!r}")
        if hasattr(x, "read") and hasattr(x, "__len__"):
            chunks = (x.read(np.arange(s, min(s + batch_size, len(x))))[0] for s in range(0, len(x), batch_size))
        else:
            x = np.asarray(x)
            if x.ndim < 1 or x.shape[0] == 0:
                raise PcldnnError(f"predict: expected a non-empty batch of inputs, got shape {x.shape}")
            chunks = (x[s:s + batch_size] for s in range(0, x.shape[0], batch_size))
        return np.concatenate([self.forward(c, training=False) for c in chunks])

    def loss_and_grad(self, x: np.ndarray, labels: np.ndarray) -> float:
        """Mean loss of a training-mode forward pass, with every gradient computed."""
        self.forward(x, training=True)
        return self.backward(labels)

    def loss(self, x: np.ndarray, labels: np.ndarray) -> float:
        """Mean loss in evaluation mode (no dropout); gradients untouched."""
        logits = self.forward(x, training=False)
        if self.loss_layer is None:
            raise PcldnnError(f"net {self.name} has no loss layer")
        ev = self.evaluation_buffers(logits.shape[0])
        labels = self.loss_layer.check_labels(labels, ev.batch)
        assert ev.output is not None
        return self.loss_layer.loss_blocked(ev.output, labels, ev.probs)


def _round_up(n: int) -> int:
    return -(-n // CACHE_LINE_FLOATS) * CACHE_LINE_FLOATS  # every parameter block starts on a cache line


def load(build_dir: str | Path, threads: int | None = None, seed: int = 0) -> Net:
    """Load a build directory made by `pcldnn-gen compile` (the core of `pcldnn_runtime.load`,
    which adds the MPI job's part).

    threads: OpenMP threads per kernel call. None: default_threads() (the ranks on this node as
    the launcher announced them). seed: seeds the He-normal weight initialisation (biases start
    at zero) and dropout.
    """
    build_dir = Path(build_dir)
    if threads is None:
        threads = default_threads()
    if isinstance(threads, bool) or not isinstance(threads, int) or not 1 <= threads <= 4096:
        raise PcldnnError(f"threads must be a positive int (at most 4096) or None, got {threads!r}")
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2 ** 63:
        raise PcldnnError(f"seed must be an int in [0, 2^63), got {seed!r}")
    attempts = 3  # a recompile swapping the directory while we read it: start again on the new build
    while True:
        attempts -= 1
        manifest = read_manifest(build_dir)
        cpu.require(manifest.isa, f"build {build_dir}")
        cpu.require_precision(manifest.precision, f"build {build_dir}")
        if manifest.uses_amx:
            cpu.require_amx(f"build {build_dir}")
        try:
            net = Net(build_dir, manifest, threads, seed)
            if manifest.weights_sha256 is not None:
                _load_initial_weights(net, build_dir, manifest.weights_sha256)
            return net
        except BuildDirError:
            if attempts == 0 or not _manifest_changed(build_dir, manifest):
                raise  # an unchanged manifest means the defect is real
        except MemoryError:
            raise PcldnnError(f"{build_dir}: not enough memory for the net's parameter and gradient buffers") from None


def _load_initial_weights(net: Net, build_dir: Path, sha256: str) -> None:
    """The weights `compile --weights` recorded, checked against their digest first."""
    path = build_dir / WEIGHTS_FILE
    state = read_npz(path, BuildDirError, sha256)
    arrays, _ = check_state(expected_state(net.manifest.layers), state, str(path), error=BuildDirError)
    net.load_state_dict(arrays)


def _manifest_changed(build_dir: Path, manifest: Manifest) -> bool:
    try:
        return read_manifest(build_dir) != manifest
    except BuildDirError:
        return True


def default_threads(ranks_on_node: int | None = None) -> int:
    """OMP_NUM_THREADS when set (a positive int), else this process's usable cores divided
    among the ranks that share this node (`ranks_on_node`; None: as the launcher announced them,
    else 1)."""
    text = os.environ.get("OMP_NUM_THREADS", "").split(",")[0].strip()
    if text:
        if not text.isdigit() or not 1 <= int(text) <= 4096:
            raise PcldnnError(f"OMP_NUM_THREADS must be a positive int, got {text!r}")
        return int(text)
    ranks = ranks_on_node if ranks_on_node is not None else local_ranks() or 1
    return max(1, cpu.usable_cores() // ranks)
