"""Layers at run time: generated kernels behind a canonical-layout numpy API.

Each layer has two faces. `forward_blocked` / `backward_blocked` run its kernels on blocked
buffers owned by the caller: `Net` chains these, so activations stay blocked from the input
conversion to the logits and back. `forward` / `backward_data` / `backward_weights` take and
return canonical arrays (NCHW activations, OIHW / (OC, IC) weights), converting at the
boundary with the layer's generated layout kernels, and remember the last forward pass (its
input, output and argmax or dropout seed) for the backward calls that follow.
"""
from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import numpy as np

from . import families
from .abi import DROPOUT_HASH_STEP
from .errors import PcldnnError
from .geometry import (
    fc_tile_geometry,
    input_pixel_floats,
)
from .kernels import bf16_bits, bf16_values, empty_aligned, ptr, ptr_array, same_bytes
from .layer_types import ConvKind
from .limits import blocks
from .manifest import PASSES, LayerEntry

Grads = tuple[np.ndarray, np.ndarray]  # a weighted layer's (weight, bias) gradient buffers


def as_float32(x: Any, what: str) -> np.ndarray:
    """A C-contiguous float32 copy or view of x, or a PcldnnError when x holds no numbers."""
    try:
        return np.ascontiguousarray(x, dtype=np.float32)
    except (TypeError, ValueError) as e:
        raise PcldnnError(f"{what}: must be an array of numbers ({e})") from None


# Waking the OpenMP team for a kernel call costs more than sharing out very little work saves:
# a 16 -> 16 fc call at minibatch 1 took 5.8 us on one thread and 13 us on two (EPYC VM,
# benchmarks/api_overhead.py). A call whose work is under both figures below, about 20 us on one
# thread, runs on one thread (the kernels' results do not depend on the thread count).
PARALLEL_MIN_FLOPS = 2_000_000
PARALLEL_MIN_BYTES = 512 * 1024


class Layer:
    """Common part: shapes, the layer's kernels by role, canonical <-> blocked conversion."""

    def __init__(self, spec: LayerEntry, kernels: dict[str, Callable], v: int, net: Any) -> None:
        self.name: str = spec.name
        self.type: str = spec.type
        self.in_shape: tuple[int, int, int] = spec.in_shape
        self.out_shape: tuple[int, int, int] = spec.out_shape
        self.kernel: tuple[int, int] = spec.kernel
        self.groups: int = spec.groups  # conv: 1, or the channels (depthwise)
        self.spec = spec
        self._k = kernels
        self.kernels = kernels  # the layer's kernels by role (the family modules call them)
        self._v = v
        self._net = net
        # V, or the packed channels of a first conv layer's few-channel input (geometry.input_pixel_floats)
        self.in_pixel_floats = input_pixel_floats(spec.index, spec.type, spec.in_shape[0], v, spec.groups)
        self._saved: tuple | None = None  # (xb, yb, aux) of the last canonical forward
        self._saved_weights = -1  # the net's weights version at that forward
        self._buffers: dict[str, np.ndarray] = {}  # blocked buffers of the canonical API, by use
        self._results: dict[str, list[np.ndarray]] = {}  # the canonical arrays handed out last, by role (_result)
        self._teams: dict[tuple[int, int], int] = {}  # (minibatch, net threads) -> threads per call
        # Set by Net: inside the fully-connected part of the chain activations are vectors.
        self.flat_input = self.type == "fc"
        self.flat_output = self.type == "fc"
        # Set by Net: the input / output activation is stored as bf16 (families.bf16_outputs); the
        # canonical API converts at its boundary and stays float32
        self.in_bf16 = False
        self.out_bf16 = False
        # and the gradients of the input / output are stored as bf16 (families.bf16_gradients)
        self.in_grad_bf16 = False
        self.out_grad_bf16 = False

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name}: {self.in_shape} -> {self.out_shape}>"

    @property
    def vector_floats(self) -> int:
        """Floats per vector of the build's ISA: the lane count of the blocked layouts."""
        return self._v

    def blocked_shape(self, shape: tuple[int, int, int], batch: int) -> tuple[int, ...]:
        """Blocked (N, C/V, H, W, V) of an activation of `shape` (the output; the input unless packed)."""
        c, h, w = shape
        return (batch, blocks(c, self._v), h, w, self._v)

    def input_shape(self, batch: int) -> tuple[int, ...]:
        """The blocked input buffer's shape: (N, C/V, H, W, V), or (N, 1, H, W, C) when packed."""
        _, h, w = self.in_shape
        if self.in_pixel_floats != self._v:
            return (batch, 1, h, w, self.in_pixel_floats)
        return self.blocked_shape(self.in_shape, batch)

    def team(self, batch: int) -> int:
        """Threads for one kernel call at `batch`: the net's, or one when the call's work (nominal
        FLOPs; bytes of activations and weights) is under PARALLEL_MIN_FLOPS and _BYTES."""
        threads = self._net.threads
        team = self._teams.get((batch, threads))
        if team is None:
            oc, oh, ow = self.out_shape
            weights = (oc * (self.in_shape[0] // self.groups) * self.kernel[0] * self.kernel[1]
                       if self.type in ("conv", "fc") else 0)
            flops = 2 * batch * oh * ow * weights
            moved = 4 * (batch * (int(np.prod(self.in_shape)) + int(np.prod(self.out_shape))) + weights)
            small = flops < PARALLEL_MIN_FLOPS and moved < PARALLEL_MIN_BYTES
            team = self._teams[(batch, threads)] = 1 if small else threads
        return team

    def aux_buffer(self, batch: int) -> Any:
        """Per-minibatch state the backward pass needs besides x and y (argmax, seed)."""
        return None

    # -- the blocked fast path (buffers owned by the caller) --------------------------
    def forward_blocked(self, xb: np.ndarray, yb: np.ndarray, aux: np.ndarray | None = None, training: bool = False) -> None:
        raise NotImplementedError

    def backward_blocked(self, xb: np.ndarray, yb: np.ndarray, aux: np.ndarray | None,
                         dyb: np.ndarray, dxb: np.ndarray | None, grads: Grads | None = None) -> None:
        """Gradient w.r.t. the input into dxb (skipped when None); weighted layers also write
        (dw, db) into `grads` when given. dyb may be modified in place (ReLU mask). In a Net's
        chain a max pooling above a convolution with a fused ReLU applies that ReLU's mask
        (MaxPoolLayer: mask_input, WeightedLayer: dy_masked)."""
        raise NotImplementedError

    def kernel_kind(self, pass_name: str) -> str:
        """The ABI kind (abi.SIGNATURES) of this layer's `pass_name` kernel: conv_fwd_bf16 in a
        bf16 build, else <type>_<pass>."""
        return next(iter(self.spec.kernels[pass_name].symbols.values()))

    def traced_kernel_call(self, pass_name: str, run: Callable[[], None]) -> tuple[Callable, tuple]:
        """(kernel, arguments) of the one call that run() makes to this layer's `pass_name`
        kernel, which is not executed: what `pcldnn-gen bench` repeats in a C loop."""
        real, seen = self._k[pass_name], []
        self._k[pass_name] = lambda *args: seen.append(args)
        try:
            run()
        finally:
            self._k[pass_name] = real
        if len(seen) != 1:
            raise PcldnnError(f"layer {self.name}: {pass_name} made {len(seen)} kernel calls, expected 1")
        return getattr(real, "__wrapped__", real), seen[0]  # the C function, also under PCLDNN_VERBOSE

    # -- canonical API ------------------------------------------------------------------
    def _check(self, x: np.ndarray, shape: tuple[int, int, int], flat: bool, what: str) -> np.ndarray:
        x = np.asarray(x)
        c, h, w = shape
        flat_ok = flat and x.ndim == 2 and x.shape[1] == c * h * w
        if not (flat_ok or (x.ndim == 4 and x.shape[1:] == (c, h, w))):
            want = f"(N, {c}, {h}, {w})" + (f" or (N, {c * h * w})" if flat else "")
            raise PcldnnError(f"layer {self.name}: {what} shape {x.shape}, expected {want}")
        if x.shape[0] < 1:
            raise PcldnnError(f"layer {self.name}: empty minibatch")
        return as_float32(x, f"layer {self.name}: {what}").reshape(x.shape[0], c, h, w)

    def check_input(self, x: np.ndarray) -> np.ndarray:
        """x as a float32 (N, C, H, W) batch of this layer's input shape, or a clear error."""
        return self._check(x, self.in_shape, self.flat_input, "input")

    def input_into_blocked(self, x: np.ndarray, xb: np.ndarray) -> None:
        """A checked canonical input batch into the blocked buffer xb (the net's first activation)."""
        self._k["in_to_blocked"](ptr(x), ptr(xb), x.shape[0], self.team(x.shape[0]))

    def output_from_blocked(self, yb: np.ndarray) -> np.ndarray:
        """The blocked output yb (float32, or bf16 bits) in canonical layout: (N, C, H, W), or
        (N, F) for fc outputs."""
        return self._from_blocked("out", yb, self.out_shape, self.flat_output)

    def output_buffer(self, use: str, batch: int) -> np.ndarray:
        """The blocked output buffer of the canonical API for `use`: bf16 bits where the
        layer's output is stored as bf16."""
        return self._buffer(use, self.blocked_shape(self.out_shape, batch), np.uint16 if self.out_bf16 else np.float32)

    def input_blocked(self, x: np.ndarray, use: str) -> np.ndarray:
        """A checked canonical input batch, blocked as this layer reads it: float32, or bf16 bits
        rounded as the kernels round where its input is stored as bf16."""
        return self._to_blocked("in", x, self.in_shape, use, self.in_bf16)

    def output_gradient_blocked(self, dy: np.ndarray, use: str) -> np.ndarray:
        """A checked canonical output gradient, blocked as this layer's backward kernels read
        it: float32, or bf16 bits rounded as the kernels round where it is stored as bf16."""
        return self._to_blocked("out", dy, self.out_shape, use, self.out_grad_bf16)

    def _buffer(self, use: str, shape: tuple[int, ...], dtype: Any = np.float32) -> np.ndarray:
        """The blocked buffer the canonical API (or a bf16 copy) uses for `use`, kept from call
        to call while the shape stays: fresh buffers cost a page fault per 4 KiB on every call
        (VGG-A conv4 forward at minibatch 16: 51 MB of output, ~8% of the kernel's time)."""
        buf = self._buffers.get(use)
        if buf is None or buf.shape != shape:
            buf = self._buffers[use] = empty_aligned(shape, dtype=dtype)
        return buf

    def _to_blocked(self, role: str, x: np.ndarray, shape: tuple[int, int, int], use: str,
                    bf16: bool = False) -> np.ndarray:
        """x blocked into the buffer of `use`: as float32, or as bf16 bits (one pass of the
        layout library's `*_to_blocked16`: layout and rounding together, threaded)."""
        blocked = self.input_shape(x.shape[0]) if role == "in" else self.blocked_shape(shape, x.shape[0])
        out = self._buffer(use, blocked, np.uint16 if bf16 else np.float32)
        self._k[f"{role}_to_blocked16" if bf16 else f"{role}_to_blocked"](ptr(x), ptr(out), x.shape[0],
                                                                          self.team(x.shape[0]))
        return out

    def _result(self, role: str, shape: tuple[int, ...]) -> np.ndarray:
        """A canonical array to hand to the caller: one of the last two handed out for `role`
        that nothing outside this layer holds any more (no name, no view: its reference count
        says so; in `y = layer.forward(x)` the one before the last), else a fresh one. A fresh
        50 MB result costs a page fault per 4 KiB on first touch: ~35% of a bf16 convolution
        kernel's time (VGG-A conv4, minibatch 16)."""
        kept = self._results.setdefault(role, [])
        for k in range(len(kept)):
            old = kept[k]
            if old.shape == shape and sys.getrefcount(old) == 3:  # the list, `old`, the call's argument
                kept.append(kept.pop(k))  # most recently handed out last
                return old
        kept.append(np.empty(shape, dtype=np.float32))
        del kept[:-2]
        return kept[-1]

    def _from_blocked(self, role: str, xb: np.ndarray, shape: tuple[int, int, int], flat: bool) -> np.ndarray:
        """A blocked float32 or bf16 activation in canonical float32 (bf16: widened as it is laid out)."""
        out = self._result(role, (xb.shape[0], *shape))
        kind = f"{role}_from_blocked16" if xb.dtype == np.uint16 else f"{role}_from_blocked"
        self._k[kind](ptr(xb), ptr(out), xb.shape[0], self.team(xb.shape[0]))
        return out.reshape(out.shape[0], -1) if flat else out

    def forward(self, x: np.ndarray) -> np.ndarray:
        """Forward pass (training mode) on canonical arrays; remembered for `backward_data`."""
        self._net.current()
        self._given_shape = np.shape(x)  # backward_data answers in the shape x came in
        x = self.check_input(x)
        xb = self.input_blocked(x, "x")
        yb = self.output_buffer("y", x.shape[0])
        aux = self.aux_buffer(x.shape[0])
        self.forward_blocked(xb, yb, aux, training=True)
        self._saved = (xb, yb, aux)
        self._saved_weights = self._net.weights_version
        return self.output_from_blocked(yb)

    def backward_data(self, dy: np.ndarray) -> np.ndarray:
        """Gradient w.r.t. the input of the last `forward`, given the gradient of its output."""
        if self._saved is None:
            raise PcldnnError(f"layer {self.name}: backward_data needs a forward call first")
        self._net.current()
        xb, yb, aux = self._saved
        dy = self._check(dy, self.out_shape, self.flat_output, "output gradient")
        if dy.shape[0] != xb.shape[0]:
            raise PcldnnError(f"layer {self.name}: output gradient minibatch {dy.shape[0]} differs from "
                              f"the last forward's {xb.shape[0]}")
        dyb = self.output_gradient_blocked(dy, "dy")
        dxb = self._buffer("dx", xb.shape, np.uint16 if self.in_grad_bf16 else np.float32)
        self.backward_blocked(xb, yb, aux, dyb, dxb)
        return self._from_blocked("in", dxb, self.in_shape, False).reshape(self._given_shape)


class ParamLayer(Layer):
    """A layer with trained parameters: blocked weights and a padded bias, both views into the
    net's flat parameter buffer; their gradients are views into the gradient buffer. How the
    weights are blocked is the subclass's (`blocked_sizes`, `_canonical`, `_into_blocked`)."""

    def __init__(self, spec: LayerEntry, kernels: dict[str, Callable], v: int, net: Any,
                 params: tuple[np.ndarray, np.ndarray], grads: tuple[np.ndarray, np.ndarray],
                 offsets: tuple[int, int] = (0, 0)) -> None:
        super().__init__(spec, kernels, v, net)
        self.weight_shape: tuple[int, ...] = self.canonical_weight_shape(spec)
        self._wt, self._bias = params
        self._dwt, self._dbias = grads
        # Views into the net's parameter buffer for the layer's life: their C pointers are made
        # once, not on every kernel call (each costs about a microsecond).
        self.weights_ptr, self.bias_ptr = ptr(self._wt), ptr(self._bias)
        self.weights_size: int = self._wt.size  # floats of the blocked weights
        # where the blocked weights and the bias start in the net's flat params / grads buffers
        self.param_offsets: tuple[int, int] = offsets
        # Under MPI, a model-parallel fc layer's training passes go through its runner
        # (pcldnn_runtime.distributed); every other layer's stays None.
        self.runner = None

    @staticmethod
    def canonical_weight_shape(spec: LayerEntry) -> tuple[int, ...]:
        raise NotImplementedError

    @staticmethod
    def blocked_sizes(spec: LayerEntry, v: int) -> tuple[tuple[int, ...], int]:
        """(blocked weight shape, padded bias length) of a layer from the manifest."""
        raise NotImplementedError

    def init_weights(self, rng: np.random.Generator) -> None:
        raise NotImplementedError

    def _canonical(self, blocked: np.ndarray) -> np.ndarray:
        """Blocked weights (the layer's, or a params-like buffer's slice) in the canonical layout."""
        raise NotImplementedError

    def _into_blocked(self, weights: np.ndarray, dst: np.ndarray) -> None:
        """Canonical float32 weights into a blocked slice (padding zero)."""
        raise NotImplementedError

    @property
    def grad_buffers(self) -> tuple[np.ndarray, np.ndarray]:
        """The blocked (weight, bias) gradient views into the net's gradient buffer, which
        `Net.backward` fills."""
        return self._dwt, self._dbias

    def canonical_from(self, flat: np.ndarray) -> np.ndarray:
        """This layer's weights then bias, canonical and flattened, from a flat buffer laid out
        like the net's params (params itself, a gradient or momentum buffer)."""
        w0, b0 = self.param_offsets
        blocked = flat[w0:w0 + self._wt.size].reshape(self._wt.shape)
        return np.concatenate([self._canonical(blocked).ravel(), flat[b0:b0 + self.out_shape[0]]])

    def canonical_into(self, values: np.ndarray, flat: np.ndarray) -> None:
        """The inverse of canonical_from: `values` (weights then bias) into a params-like flat
        buffer, padding lanes zero."""
        w0, b0 = self.param_offsets
        n = int(np.prod(self.weight_shape))
        weights = np.ascontiguousarray(values[:n], dtype=np.float32).reshape(self.weight_shape)
        self._into_blocked(weights, flat[w0:w0 + self._wt.size].reshape(self._wt.shape))
        flat[b0:b0 + self._bias.size] = 0.0
        flat[b0:b0 + self.out_shape[0]] = values[n:]

    @property
    def weights(self) -> np.ndarray:
        """Canonical copy: conv (OC, IC, KH, KW), fc (OC, IC), batchnorm's scale (C,). Assign to set."""
        self._net.current()
        return self._canonical(self._wt)

    @weights.setter
    def weights(self, value: np.ndarray) -> None:
        value = np.asarray(value)
        if value.shape != self.weight_shape:
            raise PcldnnError(f"layer {self.name}: weights shape {value.shape}, expected {self.weight_shape}")
        value = as_float32(value, f"layer {self.name}: weights")
        self._net.current()
        self._into_blocked(value, self._wt)
        self._net.weights_changed()

    @property
    def bias(self) -> np.ndarray:
        self._net.current()
        return self._bias[: self.out_shape[0]].copy()

    @bias.setter
    def bias(self, value: np.ndarray) -> None:
        value = as_float32(value, f"layer {self.name}: bias")
        if value.shape != (self.out_shape[0],):
            raise PcldnnError(f"layer {self.name}: bias shape {value.shape}, expected ({self.out_shape[0]},)")
        if not self.spec.bias and value.any():
            raise PcldnnError(f"layer {self.name}: has no bias (\"bias\": false in its description)")
        self._net.current()
        self._bias[: self.out_shape[0]] = value

    @property
    def grad_weights(self) -> np.ndarray:
        """Canonical copy of the weight gradient left by the last `Net.backward`."""
        self._net.current()
        return self._canonical(self._dwt)

    @property
    def grad_bias(self) -> np.ndarray:
        return self._dbias[: self.out_shape[0]].copy()


class WeightedLayer(ParamLayer):
    """conv and fc: blocked weights (OC/V, IC/V, KH, KW, V, V), or a depthwise layer's (C/V, KH,
    KW, V), converted by the layer's layout kernels. Its family modules (runtime/families/) run
    its kernels: `kernels[role]` on `ptr(array)`."""

    ptr = staticmethod(ptr)  # an array as a C pointer to its data, None as NULL

    def __init__(self, spec: LayerEntry, kernels: dict[str, Callable], v: int, net: Any,
                 params: tuple[np.ndarray, np.ndarray], grads: tuple[np.ndarray, np.ndarray],
                 offsets: tuple[int, int] = (0, 0)) -> None:
        super().__init__(spec, kernels, v, net, params, grads, offsets)
        # fc: the output-feature blocks this process computes (all of them unless a model-parallel
        # runtime gives it a slice); conv kernels always compute the whole layer. (A model-parallel
        # layer's runner exchanges activations and calls run_forward / run_backward on its slice;
        # evaluation runs locally on the whole layer.)
        self.ocb_range: tuple[int, int] | None = (0, blocks(self.out_shape[0], v)) if self.type == "fc" else None
        # The family that computes each pass (families.choose, as the manifest recorded it): its
        # module says how its kernel is called (scratch, weight copies, the ReLU mask).
        self.family: dict[str, families.Family] = {}
        for p in PASSES:
            kind = families.kind_named(self.kernel_kind(p))
            assert kind is not None, self.kernel_kind(p)  # the manifest reader checked the kinds
            self.family[p] = families.family_of(kind)
        self._calls = {p: self._calls_of(p) for p in PASSES}
        # bf16 fc layers (AMX or vdpbf16ps): all three passes read bf16 tile copies of the weights
        # (geometry.FcTileGeometry) made on first use after each change of the weights
        self._weight_tiles: tuple[np.ndarray, np.ndarray] | None = None
        self._tiles_made: tuple[int, int, int] | None = None  # (weights version, ocb_lo, ocb_hi) they hold
        # bf16 conv forward / backward-data (AMX or vdpbf16ps): the bf16 copy of the weights each
        # kernel reads, by pass, with the weights version it was made at (kept between calls, as
        # the fc tiles)
        self._conv_tiles: dict[str, tuple[np.ndarray, int]] = {}
        # a statistics fusion's (mean, var) rows during a forward call that fills them (conv_direct)
        self.statistics: tuple[np.ndarray, np.ndarray] | None = None

    def _calls_of(self, pass_name: str) -> families.Calls:
        calls = self.family[pass_name].calls
        assert calls is not None, self.family[pass_name].name  # every conv and fc family has them
        return calls

    def buffer(self, use: str, shape: tuple[int, ...], dtype: Any = np.float32) -> np.ndarray:
        """A blocked buffer the layer keeps for `use` (a kernel's converted input, say)."""
        return self._buffer(use, shape, dtype)

    def scratch(self, floats: int) -> np.ndarray:
        """The net's shared scratch as `floats` floats."""
        return self._net.scratch(floats)

    @property
    def blocked_weight_shape(self) -> tuple[int, ...]:
        """(OC/V, IC/V, KH, KW, V, V), depthwise (C/V, KH, KW, V): the weights' layout in the flat buffers."""
        return self._wt.shape

    @staticmethod
    def canonical_weight_shape(spec: LayerEntry) -> tuple[int, ...]:
        if spec.weight_shape is None:  # the manifest schema gives every conv / fc layer one
            raise PcldnnError(f"layer {spec.name}: a {spec.type} layer without a weight shape")
        return spec.weight_shape

    @staticmethod
    def blocked_sizes(spec: LayerEntry, v: int) -> tuple[tuple[int, ...], int]:
        """(blocked weight shape, padded bias length) of a layer from the manifest: (OC/V, IC/V,
        KH, KW, V, V), or a depthwise layer's (C/V, KH, KW, V)."""
        oc, ic = spec.out_shape[0], spec.in_shape[0]
        kh, kw = spec.kernel
        if spec.conv_kind is ConvKind.DEPTHWISE:
            return (blocks(oc, v), kh, kw, v), blocks(oc, v) * v
        return (blocks(oc, v), blocks(ic, v), kh, kw, v, v), blocks(oc, v) * v

    def init_weights(self, rng: np.random.Generator) -> None:
        """The layer's `init` (net.json): "pytorch", PyTorch's default for Conv2d and Linear
        (weights and bias uniform in +-1 / sqrt(fan_in): kaiming_uniform with a = sqrt(5)), so a
        recipe tuned in PyTorch starts where it did there; "he", He-normal weights (variance
        2 / fan_in keeps activations' scale through ReLUs) and a zero bias; "xavier", Xavier-
        uniform weights (+-sqrt(6 / (fan_in + fan_out))) and a zero bias. A bias-free layer's
        bias stays zero."""
        receptive = int(np.prod(self.weight_shape[2:])) if len(self.weight_shape) > 2 else 1
        fan_in, fan_out = self.weight_shape[1] * receptive, self.weight_shape[0] * receptive
        bias = np.zeros(self.out_shape[0], np.float32)
        if self.spec.init == "he":
            w = rng.standard_normal(self.weight_shape, dtype=np.float32)
            w *= np.float32(np.sqrt(2.0 / fan_in))  # in place: one temporary the size of the weights
        else:
            bound = np.float32(1.0 / np.sqrt(fan_in) if self.spec.init == "pytorch" else np.sqrt(6.0 / (fan_in + fan_out)))
            w = rng.random(self.weight_shape, dtype=np.float32)  # in [0, 1), scaled in place to [-bound, bound)
            w *= 2 * bound
            w -= bound
            if self.spec.init == "pytorch" and self.spec.bias:
                bias = (rng.random(self.out_shape[0], dtype=np.float32) * 2 - 1) * bound
        self.weights = w
        self._bias.fill(0.0)
        self._bias[: self.out_shape[0]] = bias

    def _canonical(self, blocked: np.ndarray) -> np.ndarray:
        out = np.empty(self.weight_shape, dtype=np.float32)
        self._k["wt_from_blocked"](ptr(blocked), ptr(out))
        return out

    def _into_blocked(self, weights: np.ndarray, dst: np.ndarray) -> None:
        self._k["wt_to_blocked"](ptr(weights), ptr(dst))

    def forward_blocked(self, xb: np.ndarray, yb: np.ndarray, aux: np.ndarray | None = None, training: bool = False,
                        statistics: tuple[np.ndarray, np.ndarray] | None = None) -> None:
        """statistics: the (mean, var) rows of the batchnorm reading this output, which the
        kernel fills too (a statistics fusion: families.fusion)."""
        if training and self.runner is not None:
            self.runner.forward(xb, yb)
            return
        self.statistics = statistics
        try:
            self.run_forward(xb, yb, self.ocb_range)
        finally:
            self.statistics = None

    def backward_blocked(self, xb: np.ndarray, yb: np.ndarray | None, aux: np.ndarray | None, dyb: np.ndarray,
                         dxb: np.ndarray | None, grads: Grads | None = None, dy_masked: bool = False) -> None:
        """dy_masked: dyb already carries this layer's fused ReLU mask (the max pooling above
        applied it, MaxPoolLayer.backward_blocked), so the kernels skip reading y for it."""
        if self.runner is not None:
            self.runner.backward(dyb, dxb)
        else:
            self.run_backward(xb, yb, dyb, dxb, grads, self.ocb_range, dy_masked)

    def weight_tiles(self, part: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
        """A bf16 fc layer's (forward, backward-data) tile copies of the weights, holding
        output blocks `part`: remade from the fp32 master weights when these changed since they
        were made (Net.weights_version), so once a training step, not once a kernel call."""
        self._net.current()
        if self._weight_tiles is None:
            geometry = fc_tile_geometry(self.in_shape, self.out_shape[0], self._v)
            self._weight_tiles = (empty_aligned((geometry.forward_tile_values,), dtype=np.uint16),
                                  empty_aligned((geometry.data_tile_values,), dtype=np.uint16))
        made, version = self._tiles_made, self._net.weights_version
        if made is None or made[0] != version or not made[1] <= part[0] <= part[1] <= made[2]:
            fwd, data = self._weight_tiles
            self.kernels["wt_to_tiles"](self.weights_ptr, ptr(fwd), ptr(data), part[0], part[1], self._net.threads)
            self._tiles_made = (version, *part)
        return self._weight_tiles

    def conv_weight_tiles(self, pass_name: str) -> np.ndarray:
        """A bf16 conv forward or backward-data pass's copy of the weights (AMX B tiles or a
        vdpbf16ps layout: its library's `<pass>_tiles` makes it), remade from the fp32 master
        weights when these changed since it was made (Net.weights_version): once a training
        step, not once a call. Under MPI the layer's pending part-broadcast was awaited before
        it runs (and moved the version)."""
        made = self._conv_tiles.get(pass_name)
        version = self._net.weights_version
        if made is None or made[1] != version:
            values = self._calls[pass_name].weight_copy_values
            assert values is not None, self.family[pass_name].name  # a family with a weight copy says its size
            tiles = made[0] if made is not None else empty_aligned((values(self, pass_name),), dtype=np.uint16)
            self.kernels[f"{pass_name}_tiles"](self.weights_ptr, ptr(tiles), self._net.threads)
            made = self._conv_tiles[pass_name] = (tiles, version)
        return made[0]

    def scratch16(self, values: int) -> np.ndarray:
        """The net's shared scratch as `values` bf16 values."""
        return self._net.scratch(-(-values // 2)).view(np.uint16)

    def run_forward(self, xb: np.ndarray, yb: np.ndarray, part: tuple[int, int] | None) -> None:
        """The forward kernel on this process's data; fc: output blocks `part` only."""
        self._calls["fwd"].forward(self, xb, yb, part, xb.shape[0], self.team(xb.shape[0]))

    def run_backward(self, xb: np.ndarray, yb: np.ndarray | None, dyb: np.ndarray, dxb: np.ndarray | None,
                     grads: Grads | None, part: tuple[int, int] | None, dy_masked: bool = False) -> None:
        """The backward kernels on this process's data (dxb / grads None: skip that pass).
        Backward-weights runs first: a family that masks dy in place by the ReLU (the fp32
        and fc-tile kernels) leaves backward-data nothing to mask."""
        batch = xb.shape[0]
        threads = self.team(batch)
        mask = yb if self.spec.activation and not dy_masked else None
        if grads is not None:
            dw, db = grads
            if self._calls["bwd_weights"].backward_weights(self, xb, dyb, mask, dw, db, part, batch, threads):
                mask = None
            if not self.spec.bias:
                db[...] = 0.0  # a bias-free layer's bias stays zero: no gradient, no update, no decay
        if dxb is not None:
            self._calls["bwd_data"].backward_data(self, dyb, mask, dxb, part, batch, threads)

    def backward_weights(self, x: np.ndarray, dy: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(dw, db) in canonical layouts for input x and output gradient dy (does not touch
        the net's gradient buffer)."""
        self._net.current()
        x = self.check_input(x)
        dy = self._check(dy, self.out_shape, self.flat_output, "output gradient")
        if dy.shape[0] != x.shape[0]:
            raise PcldnnError(f"layer {self.name}: minibatch of x ({x.shape[0]}) and dy ({dy.shape[0]}) differ")
        # own buffers: the last forward's x and y stay for backward_data
        xb = self.input_blocked(x, "weights.x")
        dyb = self.output_gradient_blocked(dy, "weights.dy")
        yb = None
        if self.spec.activation:  # the mask needs this input's forward output: the last forward's when of this x
            saved = self._saved
            if saved is not None and self._saved_weights == self._net.weights_version and same_bytes(saved[0], xb):
                yb = saved[1]
            else:
                yb = self.output_buffer("weights.y", x.shape[0])
                self.forward_blocked(xb, yb)
        dw, db = self._buffer("weights.dw", self._dwt.shape), self._buffer("weights.db", self._dbias.shape)
        self.backward_blocked(xb, yb, None, dyb, None, grads=(dw, db))
        return self._canonical(dw), db[: self.out_shape[0]].copy()


class NormLayer(ParamLayer):
    """batchnorm: a per-channel scale (`weights`, PyTorch's `weight`) and shift (`bias`), padded
    to whole channel blocks in the flat buffers, and running statistics updated by every
    training-mode forward as PyTorch's BatchNorm2d updates them (the biased batch variance
    normalizes, the unbiased one goes into the running estimate). A training-mode forward
    normalizes by the batch's statistics (kept in `aux` for the backward pass), an evaluation
    forward by the running ones.

    `across_ranks` (set by SyncSGD for sync_batchnorm): a collective that stacks every rank's
    float64 row, rank by rank; the statistics and their gradient then span every rank's shard
    of the minibatch, so p ranks normalize exactly like one rank with the whole minibatch."""

    def __init__(self, spec: LayerEntry, kernels: dict[str, Callable], v: int, net: Any,
                 params: tuple[np.ndarray, np.ndarray], grads: tuple[np.ndarray, np.ndarray],
                 offsets: tuple[int, int] = (0, 0)) -> None:
        super().__init__(spec, kernels, v, net, params, grads, offsets)
        self.momentum: float = spec.momentum
        padded = self._bias.size
        self.running_mean = np.zeros(padded, dtype=np.float32)
        self.running_var = np.ones(padded, dtype=np.float32)  # padding lanes 1: a finite 1 / sqrt
        self.num_batches_tracked = 0
        self.across_ranks: Callable[[np.ndarray], np.ndarray] | None = None

    @staticmethod
    def canonical_weight_shape(spec: LayerEntry) -> tuple[int, ...]:
        return (spec.out_shape[0],)

    @staticmethod
    def blocked_sizes(spec: LayerEntry, v: int) -> tuple[tuple[int, ...], int]:
        padded = blocks(spec.out_shape[0], v) * v
        return (padded,), padded

    def init_weights(self, rng: np.random.Generator) -> None:
        """PyTorch's: scale 1, shift 0 (running mean 0, variance 1)."""
        self._wt.fill(0.0)
        self._wt[: self.out_shape[0]] = 1.0
        self._bias.fill(0.0)

    def _canonical(self, blocked: np.ndarray) -> np.ndarray:
        return blocked[: self.out_shape[0]].copy()

    def _into_blocked(self, weights: np.ndarray, dst: np.ndarray) -> None:
        dst.fill(0.0)
        dst[: self.out_shape[0]] = weights

    def aux_buffer(self, batch: int) -> np.ndarray:
        return np.empty((2, self._bias.size), dtype=np.float32)  # the batch's mean and variance

    def forward_blocked(self, xb: np.ndarray, yb: np.ndarray, aux: np.ndarray | None = None, training: bool = False,
                        residual: np.ndarray | None = None, statistics_ready: bool = False) -> None:
        """residual: a residual fusion's shortcut (families.fusion), yb then the add's output;
        statistics_ready: aux already holds the batch statistics (a statistics fusion's
        convolution computed them)."""
        batch = xb.shape[0]
        if not training:
            self._k["fwd"](ptr(xb), self.weights_ptr, self.bias_ptr, ptr(self.running_mean), ptr(self.running_var),
                           ptr(yb), ptr(residual), 0, batch, self.team(batch))
            return
        assert aux is not None
        values = batch * self.in_shape[1] * self.in_shape[2]
        if values < 2:
            raise PcldnnError(f"layer {self.name}: a training-mode batchnorm needs more than one value per channel, "
                              f"got a minibatch of {batch} of {self.in_shape[1]}x{self.in_shape[2]} pixels")
        if self.across_ranks is not None:
            values = self._combine_statistics(xb, aux, values, statistics_ready)
        self._k["fwd"](ptr(xb), self.weights_ptr, self.bias_ptr, ptr(aux[0]), ptr(aux[1]), ptr(yb), ptr(residual),
                       0 if self.across_ranks is not None or statistics_ready else 1, batch, self.team(batch))
        m = np.float32(self.momentum)
        self.running_mean *= 1 - m
        self.running_mean += m * aux[0]
        self.running_var *= 1 - m
        self.running_var += (m * np.float32(values / (values - 1))) * aux[1]
        self.running_var[self.out_shape[0]:] = 1.0
        self.num_batches_tracked += 1

    def _combine_statistics(self, xb: np.ndarray, aux: np.ndarray, values: int, ready: bool) -> int:
        """sync_batchnorm: this shard's mean and biased variance (the kernel's statistics only,
        unless `ready`: a fused convolution's), every rank's combined in float64 as Chan et
        al.'s pairwise update does (no sum of squares to cancel), into aux; returns the values
        per channel over every rank's shard."""
        assert self.across_ranks is not None
        batch = xb.shape[0]
        if not ready:
            self._k["fwd"](ptr(xb), self.weights_ptr, self.bias_ptr, ptr(aux[0]), ptr(aux[1]), ptr(None), ptr(None), 2,
                           batch, self.team(batch))
        rows = self.across_ranks(np.concatenate([[float(values)], aux[0], aux[1]]))
        counts, means, variances = rows[:, :1], rows[:, 1:1 + aux.shape[1]], rows[:, 1 + aux.shape[1]:]
        total = float(counts.sum())  # every shard has rows: an empty one is refused before (empty minibatch)
        mean = (counts * means).sum(axis=0) / total
        aux[0] = mean
        aux[1] = (counts * (variances + (means - mean) ** 2)).sum(axis=0) / total
        return int(total)

    def backward_blocked(self, xb: np.ndarray, yb: np.ndarray | None, aux: np.ndarray | None, dyb: np.ndarray,
                         dxb: np.ndarray | None, grads: Grads | None = None, residual_relu: bool = False,
                         dy_extra: np.ndarray | None = None) -> None:
        """After a training-mode forward (aux: its batch statistics). Backward-weights first: it
        masks dy by the fused ReLU in place (or scales it by the derivative of an activation that
        reads its input: activations.py), so backward-data has nothing left to mask (a
        residual fusion's: the add's ReLU, `residual_relu`, yb the add's output; dy masked is
        then the shortcut's gradient too). `dy_extra` (with `grads`, an fp32 dy): a second gradient
        of the output, added into dy in place first (by backward-weights, as its sums read dy).
        Under sync_batchnorm, backward-weights' sums (this
        shard's) are summed over the ranks into the means backward-data needs: it runs even
        where the scale and shift need no gradient. Without it backward-data takes its means from
        the sums backward-weights just made (d shift = sum dy, d scale = sum dy x-hat): two reads
        of x and dy fewer."""
        assert aux is not None
        batch = xb.shape[0]
        team = self.team(batch)
        act = self.spec.act
        mask: np.ndarray | None = None
        if act is not None and act.from_input:  # the kernels recompute its input from x, gamma and beta
            mask = np.concatenate((self._wt, self._bias))
        else:
            mask = yb if act is not None or residual_relu else None
        synced = self.across_ranks is not None and dxb is not None
        if grads is None and synced:
            grads = (self._buffer("sync.dw", self._dwt.shape), self._buffer("sync.db", self._dbias.shape))
        means = None
        assert dy_extra is None or grads is not None, "backward-weights adds dy_extra"
        if grads is not None:
            dw, db = grads
            self._k["bwd_weights"](ptr(xb), ptr(dyb), ptr(dy_extra), ptr(mask), ptr(aux[0]), ptr(aux[1]), ptr(dw),
                                   ptr(db), batch, team)
            mask = None
            values = batch * self.in_shape[1] * self.in_shape[2]
            if synced:  # every rank's values per channel, then sums of dy and of dy x-hat
                assert self.across_ranks is not None
                sums = self.across_ranks(np.concatenate([[float(values)], db, dw])).sum(axis=0)
                means = (sums[1:] / sums[0]).astype(np.float32)
            elif dxb is not None:  # this minibatch's sums, just made: backward-data reads no x and dy for them
                means = (np.concatenate([db, dw]) / float(values)).astype(np.float32)
        if dxb is not None:
            self._k["bwd_data"](ptr(dyb), ptr(mask), ptr(xb), self.weights_ptr, ptr(aux[0]), ptr(aux[1]), ptr(means),
                                ptr(dxb), 1, batch, team)

    def backward_weights(self, x: np.ndarray, dy: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(d scale, d shift) for input x and output gradient dy, from x's batch statistics (a
        training-mode forward of x; the running statistics are not touched)."""
        self._net.current()
        x = self.check_input(x)
        dy = self._check(dy, self.out_shape, False, "output gradient")
        if dy.shape[0] != x.shape[0]:
            raise PcldnnError(f"layer {self.name}: minibatch of x ({x.shape[0]}) and dy ({dy.shape[0]}) differ")
        xb, dyb = self.input_blocked(x, "weights.x"), self.output_gradient_blocked(dy, "weights.dy")
        aux, yb = self.aux_buffer(x.shape[0]), self.output_buffer("weights.y", x.shape[0])
        self._k["fwd"](ptr(xb), self.weights_ptr, self.bias_ptr, ptr(aux[0]), ptr(aux[1]), ptr(yb), ptr(None), 1,
                       x.shape[0], self.team(x.shape[0]))
        dw, db = self._buffer("weights.dw", self._dwt.shape), self._buffer("weights.db", self._dbias.shape)
        self.backward_blocked(xb, yb, aux, dyb, None, grads=(dw, db))
        return self._canonical(dw), db[: self.out_shape[0]].copy()

    def running_stats(self) -> tuple[np.ndarray, np.ndarray]:
        """Copies of the running mean and variance, (C,) each."""
        c = self.out_shape[0]
        return self.running_mean[:c].copy(), self.running_var[:c].copy()

    def set_running_stats(self, mean: np.ndarray, var: np.ndarray) -> None:
        c = self.out_shape[0]
        self.running_mean[:c], self.running_var[:c] = mean, var


class JoinLayer(Layer):
    """add, concat and mul: several inputs (Net passes their blocked activations). The canonical
    per-layer API of a single input does not apply: a Net runs them."""

    def __init__(self, spec: LayerEntry, kernels: dict[str, Callable], v: int, net: Any) -> None:
        super().__init__(spec, kernels, v, net)
        self.in_shapes: tuple[tuple[int, int, int], ...] = spec.in_shapes

    def forward(self, x: np.ndarray) -> np.ndarray:
        raise PcldnnError(f"layer {self.name}: a {self.type} of {len(self.in_shapes)} inputs runs in its net (Net.forward)")

    def input_blocked_shapes(self, batch: int) -> list[tuple[int, ...]]:
        return [self.blocked_shape(s, batch) for s in self.in_shapes]

    def forward_join(self, xbs: list[np.ndarray], yb: np.ndarray) -> None:
        self._k["fwd"](ptr_array(xbs), ptr(yb), yb.shape[0], self.team(yb.shape[0]))


class AddLayer(JoinLayer):
    def backward_join(self, yb: np.ndarray, dyb: np.ndarray) -> None:
        """dy masked in place by the fused ReLU: then it is every input's gradient."""
        self._k["bwd_data"](ptr(dyb), ptr(yb) if self.spec.activation else ptr(None), dyb.shape[0],
                            self.team(dyb.shape[0]))


class MulLayer(JoinLayer):
    def backward_join(self, dyb: np.ndarray, xbs: list[np.ndarray], dxbs: list[np.ndarray]) -> None:
        """Each input's gradient: dy times the other input (a per-channel one's summed over the pixels)."""
        self._k["bwd_data"](ptr(dyb), ptr_array(xbs), ptr_array(dxbs), dyb.shape[0], self.team(dyb.shape[0]))


class ConcatLayer(JoinLayer):
    def backward_join(self, dyb: np.ndarray, dxbs: list[np.ndarray]) -> None:
        """Each input's channels of dy into its gradient buffer."""
        self._k["bwd_data"](ptr(dyb), ptr_array(dxbs), dyb.shape[0], self.team(dyb.shape[0]))


class MaxPoolLayer(Layer):
    def aux_buffer(self, batch: int) -> np.ndarray:
        return np.empty(self.blocked_shape(self.out_shape, batch), dtype=np.int32)  # argmax per output lane

    def forward_blocked(self, xb: np.ndarray, yb: np.ndarray, aux: np.ndarray | None = None, training: bool = False) -> None:
        if aux is None:
            aux = self.aux_buffer(xb.shape[0])
        self._k["fwd"](ptr(xb), ptr(yb), ptr(aux), xb.shape[0], self.team(xb.shape[0]))

    def backward_blocked(self, xb: np.ndarray, yb: np.ndarray, aux: np.ndarray | None, dyb: np.ndarray,
                         dxb: np.ndarray | None, grads: Grads | None = None, mask_input: bool = False) -> None:
        """mask_input: the input is a fused ReLU's output (the convolution below, in a Net):
        inputs that were not positive get no gradient, decided from this layer's own output
        (the max routed to each input is that input's value), so the convolution need not
        read its own, four times larger, output for the mask. The layer API leaves it off."""
        self._k["bwd_data"](ptr(dyb), ptr(aux), ptr(yb) if mask_input else ptr(None), ptr(dxb), dyb.shape[0],
                            self.team(dyb.shape[0]))


class AvgPoolLayer(Layer):
    def forward_blocked(self, xb: np.ndarray, yb: np.ndarray, aux: np.ndarray | None = None, training: bool = False) -> None:
        self._k["fwd"](ptr(xb), ptr(yb), xb.shape[0], self.team(xb.shape[0]))

    def backward_blocked(self, xb: np.ndarray, yb: np.ndarray, aux: np.ndarray | None,
                         dyb: np.ndarray, dxb: np.ndarray | None, grads: Grads | None = None) -> None:
        self._k["bwd_data"](ptr(dyb), ptr(dxb), dyb.shape[0], self.team(dyb.shape[0]))


class ActivationLayer(Layer):
    """A standalone activation (activations.py): its backward reads the forward output (a mask)
    or the forward input (the derivative's argument), as its row says."""

    def forward_blocked(self, xb: np.ndarray, yb: np.ndarray, aux: np.ndarray | None = None, training: bool = False) -> None:
        self._k["fwd"](ptr(xb), ptr(yb), xb.shape[0], self.team(xb.shape[0]))

    def backward_blocked(self, xb: np.ndarray, yb: np.ndarray, aux: np.ndarray | None,
                         dyb: np.ndarray, dxb: np.ndarray | None, grads: Grads | None = None) -> None:
        act = self.spec.act
        assert act is not None  # an activation layer is its own activation
        read = xb if act.from_input else yb
        self._k["bwd_data"](ptr(dyb), ptr(read), ptr(dxb), dyb.shape[0], self.team(dyb.shape[0]))




class DropoutLayer(Layer):
    """Training: keep each element (dropout), or each image whole (drop_path: stochastic depth),
    with probability 1 - rate, scaled by 1/(1 - rate), from a hash of (seed, index); evaluation:
    identity. `aux` is a one-element array holding the seed.

    The index (of an element, or an image) counts from the first row of the *global* minibatch:
    a rank whose shard starts at row `net.row_offset` shifts the seed instead (the hash takes
    seed + (i + 1) x G, so adding offset x G to the seed is the same as adding offset to i), and
    p ranks draw exactly the masks one process draws for the whole minibatch."""

    def __init__(self, spec: LayerEntry, kernels: dict[str, Callable], v: int, net: Any) -> None:
        super().__init__(spec, kernels, v, net)
        self.rate: float = spec.rate

    def aux_buffer(self, batch: int) -> np.ndarray:
        return np.zeros(1, dtype=np.uint64)

    def forward_blocked(self, xb: np.ndarray, yb: np.ndarray, aux: np.ndarray | None = None, training: bool = False) -> None:
        if not training:  # the identity, between the activations' storage types
            if xb.dtype == yb.dtype:
                np.copyto(yb, xb)
            elif yb.dtype == np.uint16:
                bf16_bits(xb, yb, flush_subnormals=True)
            else:
                np.copyto(yb, bf16_values(xb))
            return
        assert aux is not None  # the mask's seed, kept for the backward pass
        offset = self._net.row_offset * (1 if self.type == "drop_path" else int(np.prod(yb.shape[1:])))
        aux[0] = (self._net.next_dropout_seed() + offset * DROPOUT_HASH_STEP) % 2 ** 64
        self._k["fwd"](ptr(xb), ptr(yb), int(aux[0]), xb.shape[0], self.team(xb.shape[0]))

    def backward_blocked(self, xb: np.ndarray, yb: np.ndarray, aux: np.ndarray | None,
                         dyb: np.ndarray, dxb: np.ndarray | None, grads: Grads | None = None) -> None:
        assert aux is not None
        self._k["bwd_data"](ptr(dyb), ptr(dxb), int(aux[0]), dyb.shape[0], self.team(dyb.shape[0]))


class LossLayer(Layer):
    """softmax_cross_entropy over the logits (the previous layer's output)."""

    def check_labels(self, labels: np.ndarray, batch: int) -> np.ndarray:
        labels = np.asarray(labels)
        classes = self.in_shape[0]
        if labels.shape != (batch,) or not np.issubdtype(labels.dtype, np.integer):
            raise PcldnnError(f"layer {self.name}: labels must be {batch} integers, got {labels.dtype} {labels.shape}")
        if batch and (labels.min() < 0 or labels.max() >= classes):
            raise PcldnnError(f"layer {self.name}: labels must lie in [0, {classes}), got "
                              f"[{labels.min()}, {labels.max()}]")
        return np.ascontiguousarray(labels, dtype=np.int32)

    def loss_blocked(self, logits_b: np.ndarray, labels: np.ndarray, probs: np.ndarray) -> float:
        loss = np.zeros(1, dtype=np.float64)
        self._k["fwd"](ptr(logits_b), ptr(labels), ptr(probs), ptr(loss), logits_b.shape[0], self.team(logits_b.shape[0]))
        return float(loss[0])

    def grad_blocked(self, probs: np.ndarray, labels: np.ndarray, dlogits_b: np.ndarray) -> None:
        self._k["bwd_data"](ptr(probs), ptr(labels), ptr(dlogits_b), dlogits_b.shape[0], self.team(dlogits_b.shape[0]))

    def forward(self, logits: np.ndarray, labels: np.ndarray) -> float:  # type: ignore[override]
        """Mean cross-entropy of softmax(logits) against integer labels; remembered for backward_data."""
        logits = self._check(logits, self.in_shape, True, "logits")
        batch = logits.shape[0]
        labels = self.check_labels(labels, batch)
        lb = self._to_blocked("in", logits, self.in_shape, "x")
        probs = np.empty((batch, self.in_shape[0]), dtype=np.float32)
        loss = self.loss_blocked(lb, labels, probs)
        self._saved = (probs, labels)
        return loss

    def backward_data(self, dy: Any = None) -> np.ndarray:
        """Gradient of the last forward's mean loss w.r.t. its logits, (N, classes)."""
        if self._saved is None:
            raise PcldnnError(f"layer {self.name}: backward_data needs a forward call first")
        probs, labels = self._saved
        db = self._buffer("dx", self.blocked_shape(self.in_shape, probs.shape[0]))
        self.grad_blocked(probs, labels, db)
        return self._from_blocked("in", db, self.in_shape, True)
