"""Layers at run time: generated kernels behind a canonical-layout numpy API.

Each layer keeps its parameters in the blocked layout its kernels read. The public methods
take and return canonical arrays (NCHW activations, OIHW / (OC, IC) weights) and convert at
the boundary with the layer's generated layout kernels; `Net` chains the `_blocked`
methods instead, so activations stay blocked between layers.
"""
from __future__ import annotations

from typing import Callable

import numpy as np

from .errors import PcldnnError
from .kernels import empty_aligned, ptr


def blocks(channels: int, v: int) -> int:
    return -(-channels // v)


class Layer:
    """Common part: shapes, and the generated kernels of this layer by role."""

    def __init__(self, spec: dict, kernels: dict[str, Callable], v: int, net):
        self.name: str = spec["name"]
        self.type: str = spec["type"]
        self.in_shape: tuple[int, int, int] = tuple(spec["in_shape"])
        self.out_shape: tuple[int, int, int] = tuple(spec["out_shape"])
        self.spec = spec
        self._k = kernels
        self._v = v
        self._net = net
        # Set by Net: inside the fully-connected part of the chain activations are vectors.
        self.flat_input = self.type == "fc"
        self.flat_output = self.type == "fc"

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name}: {self.in_shape} -> {self.out_shape}>"

    def blocked_shape(self, shape: tuple[int, int, int], batch: int) -> tuple[int, ...]:
        c, h, w = shape
        return (batch, blocks(c, self._v), h, w, self._v)

    # -- canonical <-> blocked at the API boundary -----------------------------------
    def _check_input(self, x: np.ndarray) -> np.ndarray:
        x = np.asarray(x)
        c, h, w = self.in_shape
        flat_ok = self.flat_input and x.ndim == 2 and x.shape[1] == c * h * w
        if not (flat_ok or (x.ndim == 4 and x.shape[1:] == (c, h, w))):
            want = f"(N, {c}, {h}, {w})" + (f" or (N, {c * h * w})" if self.flat_input else "")
            raise PcldnnError(f"layer {self.name}: input shape {x.shape}, expected {want}")
        if x.shape[0] < 1:
            raise PcldnnError(f"layer {self.name}: empty minibatch")
        return np.ascontiguousarray(x, dtype=np.float32)

    def _to_blocked(self, role: str, x: np.ndarray, shape: tuple[int, int, int]) -> np.ndarray:
        out = empty_aligned(self.blocked_shape(shape, x.shape[0]))
        self._k[f"{role}_to_blocked"](ptr(x), ptr(out), x.shape[0], self._net.threads)
        return out

    def _from_blocked(self, role: str, xb: np.ndarray, shape: tuple[int, int, int]) -> np.ndarray:
        out = np.empty((xb.shape[0], *shape), dtype=np.float32)
        self._k[f"{role}_from_blocked"](ptr(xb), ptr(out), xb.shape[0], self._net.threads)
        return out

    def forward(self, x: np.ndarray) -> np.ndarray:
        """Forward pass on canonical arrays: (N, C, H, W) in, (N, C', H', W') out
        ((N, F) out for fc)."""
        x = self._check_input(x)
        xb = self._to_blocked("in", x.reshape(x.shape[0], *self.in_shape), self.in_shape)
        yb = empty_aligned(self.blocked_shape(self.out_shape, x.shape[0]))
        self.forward_blocked(xb, yb)
        y = self._from_blocked("out", yb, self.out_shape)
        return y.reshape(y.shape[0], -1) if self.flat_output else y

    def forward_blocked(self, xb: np.ndarray, yb: np.ndarray) -> None:
        raise NotImplementedError


class WeightedLayer(Layer):
    """conv and fc: blocked weights (OC/V, IC/V, KH, KW, V, V) and a padded bias."""

    def __init__(self, spec: dict, kernels: dict[str, Callable], v: int, net, rng: np.random.Generator):
        super().__init__(spec, kernels, v, net)
        self.weight_shape: tuple[int, ...] = tuple(spec["weight_shape"])
        oc, ic = self.out_shape[0], self.in_shape[0]
        kh, kw = spec["kernel"]
        self._wt = empty_aligned((blocks(oc, v), blocks(ic, v), kh, kw, v, v))
        self._bias = np.zeros(blocks(oc, v) * v, dtype=np.float32)
        self._fwd = kernels["fwd"]
        fan_in = ic * kh * kw
        # He-normal initialisation: keeps activation variance constant through ReLUs.
        self.weights = rng.standard_normal(self.weight_shape, dtype=np.float32) * np.float32(np.sqrt(2.0 / fan_in))

    @property
    def weights(self) -> np.ndarray:
        """Canonical copy: conv (OC, IC, KH, KW), fc (OC, IC). Assign to set."""
        out = np.empty(self.weight_shape, dtype=np.float32)
        self._k["wt_from_blocked"](ptr(self._wt), ptr(out))
        return out

    @weights.setter
    def weights(self, value: np.ndarray) -> None:
        value = np.asarray(value)
        if value.shape != self.weight_shape:
            raise PcldnnError(f"layer {self.name}: weights shape {value.shape}, expected {self.weight_shape}")
        value = np.ascontiguousarray(value, dtype=np.float32)
        self._k["wt_to_blocked"](ptr(value), ptr(self._wt))

    @property
    def bias(self) -> np.ndarray:
        return self._bias[: self.out_shape[0]].copy()

    @bias.setter
    def bias(self, value: np.ndarray) -> None:
        value = np.asarray(value, dtype=np.float32)
        if value.shape != (self.out_shape[0],):
            raise PcldnnError(f"layer {self.name}: bias shape {value.shape}, expected ({self.out_shape[0]},)")
        self._bias[: self.out_shape[0]] = value

    def forward_blocked(self, xb: np.ndarray, yb: np.ndarray) -> None:
        self._fwd(ptr(xb), ptr(self._wt), ptr(self._bias), ptr(yb), xb.shape[0], self._net.threads)


class PoolLayer(Layer):
    def forward_blocked(self, xb: np.ndarray, yb: np.ndarray) -> None:
        self._k["fwd"](ptr(xb), ptr(yb), xb.shape[0], self._net.threads)


class ReluLayer(Layer):
    """Elementwise, so layout-agnostic: padded channels stay zero."""

    def forward_blocked(self, xb: np.ndarray, yb: np.ndarray) -> None:
        np.maximum(xb, 0.0, out=yb)


class LossLayer(Layer):
    """softmax_cross_entropy: the end of the chain; `Net.forward` returns its input, the logits.
    Its forward (mean loss) and backward come with the training passes."""

    def forward(self, x: np.ndarray) -> np.ndarray:
        raise PcldnnError(f"layer {self.name}: the loss layer has no standalone forward yet; "
                          "Net.forward returns the logits")
