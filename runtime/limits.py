"""The documented range of every size in a net description, and the memory bound.

A description is refused before anything is planned when a field leaves its range or when
training it at minibatch 1 needs more memory than `max_memory` bytes (the user raises it
with `pcldnn-gen compile --max-memory` or PCLDNN_MAX_MEMORY). The runtime checks a build's
manifest against the same ranges, so a tampered manifest cannot ask for absurd buffers.
"""
from __future__ import annotations

import os
from collections.abc import Iterable

from .errors import PcldnnError

MAX_CHANNELS = 65536           # input channels and conv output channels (real nets: <= 8192)
MAX_SPATIAL = 16384            # input / activation height and width (larger images are tiled)
MAX_KERNEL = 64                # conv window side (real nets: <= 11); pooling windows may cover the input
MAX_STRIDE = 64
MAX_PAD = 64                   # and below the window side for pooling, at most the side for conv
MAX_FEATURES = 1 << 20         # fc outputs and classes
MAX_LAYERS = 1024
MAX_TENSOR_FLOATS = 1 << 31    # one image's activation or one layer's weights: C offsets stay far from overflow
DEFAULT_MAX_MEMORY = 16 << 30  # bytes to train at minibatch 1: weights x 4 (+ gradients, momentum,
                               # transposed copy) and every activation kept for the backward pass
MEMORY_ENV = "PCLDNN_MAX_MEMORY"


def out_size(size: int, kernel: int, stride: int, pad: int) -> int:
    """Output extent of a window sliding over `size` with padding `pad` on both sides."""
    return (size + 2 * pad - kernel) // stride + 1


def blocks(channels: int, v: int) -> int:
    """Channel blocks of V floats (the last one zero-padded): the one rounding every blocked
    layout, plan and buffer size uses."""
    return -(-channels // v)


def padded(channels: int, v: int = 16) -> int:
    """Channels rounded up to whole vectors (the widest, 16 floats, when the ISA is not known)."""
    return blocks(channels, v) * v


def training_bytes(layers: Iterable[tuple[tuple[int, int, int], tuple[int, int, int], int]]) -> int:
    """Bytes to train at minibatch 1, from (in_shape, out_shape, weight count) per layer:
    parameters, their gradients, momentum and conv backward-data's transposed copy (4x the
    weights; in a bf16 build the two 2-byte weight copies take that copy's place), each layer's
    output kept for the backward pass (an upper bound where bf16 builds store it as bf16), and
    two gradient buffers the size of the largest activation."""
    weights = acts = largest = 0
    for (c, h, w), (oc, oh, ow), nweights in layers:
        weights += nweights + oc
        size = padded(oc) * oh * ow
        acts += size
        largest = max(largest, size, padded(c) * h * w)
    return 4 * (4 * weights + acts + 2 * largest)


def max_memory(given: int | None = None) -> int:
    """The memory bound: `given`, else PCLDNN_MAX_MEMORY (bytes, or with a K/M/G/T suffix), else
    DEFAULT_MAX_MEMORY."""
    if given is not None:
        return given
    text = os.environ.get(MEMORY_ENV)
    return parse_bytes(text, MEMORY_ENV) if text else DEFAULT_MAX_MEMORY


def parse_bytes(text: str, what: str) -> int:
    """'16G', '512M', '1073741824' -> bytes (binary multiples)."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    body = text.strip().upper().removesuffix("B").removesuffix("I")
    scale = units.get(body[-1:], 1)
    if body[-1:] in units:
        body = body[:-1]
    try:
        value = float(body) * scale if len(body) <= 20 else -1.0
    except ValueError:
        value = -1.0
    if not 1 << 20 <= value <= 1 << 50:
        raise PcldnnError(f"{what}: must be a size between 1M and 1024T (bytes, or with K/M/G/T), got {text!r}")
    return int(value)


def plural(n: int, noun: str, nouns: str | None = None) -> str:
    """'1 kernel', '2 kernels' (`nouns` where the plural is not noun + s)."""
    return f"{n} {noun if n == 1 else nouns or noun + 's'}"


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n:.3g} {unit}"
        n /= 1024
    return f"{n:.3g} TiB"
