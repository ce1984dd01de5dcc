"""SGD with momentum, weight decay and a learning-rate schedule, over the net's flat buffers.

PyTorch's convention, so hyperparameters port unchanged:
    g <- grad + weight_decay * w;   v <- momentum * v + g;   w <- w - lr * v
Everything works on the one contiguous parameter buffer and its gradient buffer (padding
included: padded weights and their gradients are zero, so they stay zero), which is also
what the MPI runtime reduces and broadcasts in slices.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from .errors import NonFiniteError, PcldnnError
from .kernels import ptr
from .validate import non_finite_at

SCHEDULES = ("constant", "step", "cosine")


class SGD:
    """`SGD(lr, momentum=0, weight_decay=0, schedule="constant", ...)`.

    schedule: "constant"; "step" (lr x gamma every `step_size` steps); "cosine" (from lr down
    to `min_lr` over `total_steps`). `warmup_steps` > 0 ramps linearly from lr/warmup_steps
    up to the schedule's value first. `decay_bias=False` exempts biases from weight decay."""

    def __init__(self, lr: float, momentum: float = 0.0, weight_decay: float = 0.0, *,
                 schedule: str = "constant", step_size: int = 0, gamma: float = 0.1,
                 total_steps: int = 0, min_lr: float = 0.0, warmup_steps: int = 0,
                 decay_bias: bool = True):
        def check(name: Any, value: Any, ok: Any, what: Any) -> None:
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or not ok(value):
                raise PcldnnError(f"SGD: {name} must be {what}, got {value!r}")
        check("lr", lr, lambda x: x > 0, "a positive number")
        check("momentum", momentum, lambda x: 0 <= x < 1, "in [0, 1)")
        check("weight_decay", weight_decay, lambda x: x >= 0, ">= 0")
        check("gamma", gamma, lambda x: 0 < x <= 1, "in (0, 1]")
        check("min_lr", min_lr, lambda x: 0 <= x <= lr, "in [0, lr]")
        for name, value in (("step_size", step_size), ("total_steps", total_steps), ("warmup_steps", warmup_steps)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise PcldnnError(f"SGD: {name} must be a non-negative int, got {value!r}")
        if schedule not in SCHEDULES:
            raise PcldnnError(f"SGD: unknown schedule {schedule!r} (known: {', '.join(SCHEDULES)})")
        if schedule == "step" and step_size < 1:
            raise PcldnnError("SGD: schedule 'step' needs step_size >= 1")
        if schedule == "cosine" and total_steps < 1:
            raise PcldnnError("SGD: schedule 'cosine' needs total_steps >= 1")
        self.lr, self.momentum, self.weight_decay = float(lr), float(momentum), float(weight_decay)
        self.schedule, self.step_size, self.gamma = schedule, step_size, float(gamma)
        self.total_steps, self.min_lr, self.warmup_steps = total_steps, float(min_lr), warmup_steps
        self.decay_bias = decay_bias
        self.velocity: np.ndarray | None = None
        self._decay: np.ndarray | float | None = None
        self._scratch: np.ndarray | None = None
        self._kernel = None  # the build's SGD update (Net.sgd_kernel), when bound to a net that has one
        self._threads = 1
        self._layers: list[tuple[int, int, str]] = []  # [start, stop) of each layer in params: errors name it
        self._flag = np.zeros(1, np.int32)  # the update kernel's non-finite flag

    def config(self) -> dict:
        """Hyperparameters, for checkpoints and logs."""
        return {k: getattr(self, k) for k in ("lr", "momentum", "weight_decay", "schedule", "step_size", "gamma",
                                              "total_steps", "min_lr", "warmup_steps", "decay_bias")}

    def lr_at(self, step: int) -> float:
        """Learning rate used by update number `step` (0-based)."""
        if self.schedule == "step":
            lr = self.lr * self.gamma ** (step // self.step_size)
        elif self.schedule == "cosine":
            t = min(step, self.total_steps) / self.total_steps
            lr = self.min_lr + 0.5 * (self.lr - self.min_lr) * (1 + math.cos(math.pi * t))
        else:
            lr = self.lr
        if step < self.warmup_steps:
            lr *= (step + 1) / self.warmup_steps
        return lr

    def bind(self, net: Any) -> None:
        """Allocate the state for `net`'s flat buffers (zero velocity), and the per-element
        weight decay when biases are exempt."""
        self.velocity = np.zeros_like(net.params)
        self._kernel, self._threads = net.sgd_kernel(), net.threads
        self._layers = sorted((start, stop, name) for name, (start, stop) in getattr(net, "param_ranges", {}).items())
        self._scratch = None if self._kernel is not None else np.empty_like(net.params)
        if self.decay_bias or self.weight_decay == 0:
            self._decay = self.weight_decay
        else:
            decay = np.full_like(net.params, self.weight_decay)
            for start, stop in net.bias_slices():
                decay[start:stop] = 0.0
            self._decay = decay

    def apply(self, params: np.ndarray, grads: np.ndarray, step: int,
              sl: slice = slice(None)) -> None:
        """One update of params[sl] from grads[sl] (in place). The slice is what the MPI
        runtime updates on each rank; a single process updates everything. Through the build's
        update kernel (one threaded pass) where the net has one, else numpy (the same float
        operations, so the same bits: tests/test_training.py checks it)."""
        if self.velocity is None:
            raise PcldnnError("SGD: bind(net) before the first update")
        lr = self.lr_at(step)
        p, v, g = params[sl], self.velocity[sl], grads[sl]
        self._check_finite(g, "gradient", sl, step)  # a pass of its own, before the update: the weights stay numbers
        if self._update(p, v, g, sl, lr):  # the update kernel's own flag; numpy: a pass
            self._check_finite(p, "updated weights", sl, step)

    def _check_finite(self, buf: np.ndarray, what: str, sl: slice, step: int) -> None:
        """A NonFiniteError naming the step and the layer where `buf` (params[sl] or grads[sl])
        holds NaN or infinity: one pass (validate.non_finite_at)."""
        bad = non_finite_at(buf)
        if bad is None:
            return
        at = (sl.start or 0) + bad
        layer = next((name for start, stop, name in self._layers if start <= at < stop), "?")
        raise NonFiniteError(f"the {what} of layer {layer} hold NaN or infinity (diverged, or NaN in the data: lower "
                             "the learning rate or check the inputs)", step)

    def _update(self, p: np.ndarray, v: np.ndarray, g: np.ndarray, sl: slice, lr: float) -> bool:
        """The update in place; whether the weights must be checked for NaN and infinity (the
        build's kernel checks them as it writes them and says where it found one)."""
        decay = self._decay[sl] if isinstance(self._decay, np.ndarray) else self._decay
        if self._kernel is not None:
            per_element = isinstance(decay, np.ndarray)
            self._kernel(ptr(p), ptr(v), ptr(g), ptr(decay if per_element else None),
                         0.0 if per_element or decay is None else decay, lr, self.momentum, p.size, self._threads,
                         ptr(self._flag))
            return bool(self._flag[0])
        if self._scratch is None:
            self._scratch = np.empty_like(self.velocity)
        tmp = self._scratch[sl]
        with np.errstate(over="ignore", invalid="ignore"):  # an overflow is reported by the check that follows
            if decay is not None and (isinstance(decay, np.ndarray) or decay != 0.0):
                np.multiply(p, decay, out=tmp)
                tmp += g
            else:
                np.copyto(tmp, g)
            if self.momentum:
                v *= self.momentum
                v += tmp
                np.multiply(v, lr, out=tmp)  # v itself stays unscaled, as in PyTorch
            else:
                tmp *= lr
            p -= tmp
        return True

    def bound_velocity(self) -> np.ndarray:
        """The momentum buffer (same layout as the net's params); `bind` allocates it."""
        if self.velocity is None:
            raise PcldnnError("SGD: bind(net) before reading its state")
        return self.velocity
